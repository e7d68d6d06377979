"""Stand-in: the signature of upstream's ``apply_fsdp2`` (model_loader.py@2f59a1e6) and the order in which its
``load_fsdp_models`` calls it and the state load (through this module's globals)."""

import torch

from . import checkpoint

_DT = {"bf16": torch.bfloat16, "fp32": torch.float32}


def apply_fsdp2(model, parallel_plan, mesh=None, cpu_offload=False, args=None):
    """Every ``parallel_plan.no_split_modules`` block, then the root; one policy; host offload or none."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=_DT.get(args.diffusion_forward_dtype), reduce_dtype=_DT[args.fsdp_reduce_dtype],
                              cast_forward_inputs=False)
    kw = dict(mesh=mesh, mp_policy=mp)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for m in [m for m in model.modules() if type(m).__name__ in parallel_plan.no_split_modules]:
        fully_shard(m, **kw)
    fully_shard(model, **kw)
    return model


def load_fsdp_models(model, parallel_plan, mesh, *, cpu_offload, args):
    """The tail of upstream's loader: full state taken before sharding, apply_fsdp2, then the state load."""
    full_state = model.state_dict()
    model = apply_fsdp2(model, parallel_plan, mesh=mesh, cpu_offload=cpu_offload, args=args)
    checkpoint.broadcast_full_state_to_fsdp(model, full_state, cpu_offload=cpu_offload)
    return model
