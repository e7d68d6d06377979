"""Stand-in: the signature of upstream's ``broadcast_full_state_to_fsdp`` (checkpoint.py@3636bdd7)."""


def broadcast_full_state_to_fsdp(model, full_state, *, cpu_offload):
    """One rank: load ``full_state`` into the sharded parameters (``set_model_state_dict``, full state)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
    calls.append("stand-in")


calls: list = []
