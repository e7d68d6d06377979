"""Stand-in for an upstream whose ``apply_fsdp2`` changed its parameters (the table must refuse it)."""


def apply_fsdp2(model, parallel_plan, mesh=None, cpu_offload=False, args=None, offload_blocks=None):
    return model
