"""The H3 checkpoint's LoRA and AdamW state at world size 1, saved and loaded without a host copy (so a save and a
resume keep the host peak of the training steps).

FSDP2's full-state paths (``full_tensor()``, ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` with
``full_state_dict=True``) send every CPU-offloaded shard to its mesh's GPU and back, a fresh host copy of every
adapter and moment; :func:`host_full_state` and :func:`load_host_state` take the shards as they are
(``docs/levers/host-checkpoint.md`` has the measured host peaks). The layout of
the checkpoint is unchanged (FQN keys, plain tensors), so checkpoints written either way load either way. With
more ranks both functions take torch's own paths.

Proof, ``tests/equivalence/test_host_checkpoint.py``: the saved state equals the gathered one and shares the
optimizer's memory; training after a resume is bitwise the uninterrupted run's, with the checkpoint's pages
released; a checkpoint of other groups, shapes or with a tensor's state missing goes to torch's path. Planted:
the gather, the full-state load path and pages left resident each fail it.
"""

from __future__ import annotations

from typing import Any

import torch

from patches.core.io import release_file_pages
from patches.core.runtime import to_local

__all__ = ["RELEASE_EVERY_BYTES", "host_full_state", "load_host_state"]

RELEASE_EVERY_BYTES = 256 << 20
"""A resume drops the checkpoint's pages of the AdamW moments it has copied every this many bytes (256 MiB): the
host holds at most this much twice, and ``release_file_pages`` (which reads ``/proc/self/maps``, about 1 ms) runs
about 11 times for the 33 B run's 2.77 GB of moments instead of once per tensor (1,248)."""


def host_full_state(model: torch.nn.Module, opt: torch.optim.Optimizer,
                    lora: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint's ``(lora, optimizer)``: every LoRA tensor whole on the host, and the optimizer state in
    ``get_optimizer_state_dict(full_state_dict=True)``'s layout (FQN keys, plain tensors: no DTensor or DeviceMesh
    pickled).

    At world size 1 each DTensor's local shard is the whole tensor, so it is taken as is: no gather. The gather
    (``full_tensor()``, or the full-state path's ``_gather_state_dict``) first moves a CPU-offloaded shard to its
    mesh's GPU and then back to the host, a fresh host copy of every adapter and AdamW moment at each save. Host
    tensors that view the pinned arena are written with their own bytes only by
    :func:`patches.core.io.atomic_torch_save`. With more ranks the shards are gathered as before.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    def host(t: Any) -> Any:
        return to_local(t).detach().cpu() if torch.is_tensor(t) else t

    if not dist.is_initialized() or dist.get_world_size() == 1:
        sharded = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=False))
        state = {k: {n: host(t) for n, t in v.items()} for k, v in sharded["state"].items()}
        return {k: host(v) for k, v in lora.items()}, {"state": state, "param_groups": sharded["param_groups"]}
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in lora.items()}
    return full, get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_host_state(model: torch.nn.Module, opt: torch.optim.Optimizer, lora: dict[str, torch.Tensor],
                    optimizer: dict[str, Any]) -> None:
    """Load a checkpoint's optimizer section (:func:`host_full_state`'s layout) into ``opt``.

    At world size 1, when the section holds state for exactly ``lora``'s tensors in ``opt``'s order and groups,
    and each saved moment has its parameter's shape, each saved moment is copied into a fresh tensor shaped like
    its parameter (a DTensor with its mesh and placements) on the parameter's device, one at a time, and a saved
    moment read from a file mapping (``torch.load(..., mmap=True)``) has its pages dropped once copied, every
    :data:`RELEASE_EVERY_BYTES` (:func:`patches.core.io.release_file_pages`): the host then holds each moment once,
    as in a run from scratch.
    The full-state path (``set_optimizer_state_dict``) first sends every host moment to the mesh's GPU and copies
    it back, a second host copy of every moment. Otherwise, and with more ranks, that path is taken (it refuses a section without state
    for every tensor, where fresh moments would be silent).
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    params = [p for g in opt.param_groups for p in g["params"]]
    name_of = {id(p): n for n, p in lora.items()}
    names = [name_of.get(id(p)) for p in params]
    saved_order = [n for g in optimizer.get("param_groups", ()) for n in g["params"]]
    one_rank = not dist.is_initialized() or dist.get_world_size() == 1
    # the same groups (a group's params are its indices below) and every saved moment its parameter's shape:
    # copy_ would broadcast a (1, n) moment into an (m, n) one without a word
    same_groups = [len(g["params"]) for g in optimizer.get("param_groups", ())] == [len(g["params"])
                                                                                   for g in opt.param_groups]
    same_shapes = all(k == "step" or not torch.is_tensor(t) or t.shape == p.shape for n, p in zip(names, params)
                      for k, t in optimizer["state"].get(n, {}).items())
    if not (one_rank and None not in names and saved_order == names and set(optimizer["state"]) == set(names)
            and same_groups and same_shapes):
        set_optimizer_state_dict(model, opt, optim_state_dict=optimizer, options=StateDictOptions(full_state_dict=True))
        return

    copied: list[torch.Tensor] = []  # saved moments copied since their pages were last released
    pending = [0]  # their bytes

    def like(param: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = torch.empty_like(param)  # the parameter's mesh, placements and device
            to_local(out).copy_(saved)
        copied.append(saved)
        pending[0] += saved.numel() * saved.element_size()
        if pending[0] >= RELEASE_EVERY_BYTES:
            release_file_pages(copied)
            copied.clear()
            pending[0] = 0
        return out

    state = {i: {k: like(p, v) if torch.is_tensor(v) and k != "step" else v
                 for k, v in optimizer["state"][n].items()}
             for i, (n, p) in enumerate(zip(names, params)) if n in optimizer["state"]}
    release_file_pages(copied)  # the last chunk
    groups, first = [], 0
    for g in optimizer["param_groups"]:
        groups.append({**g, "params": list(range(first, first + len(g["params"])))})
        first += len(g["params"])
    opt.load_state_dict({"state": state, "param_groups": groups})
