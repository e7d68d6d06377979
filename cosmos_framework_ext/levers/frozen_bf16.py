"""Compact frozen storage (``COSMOS_FROZEN_BF16=1``): frozen fp32 weights computed in bf16 are stored as bf16.

Under upstream HEAD's dtypes (``fsdp_master_dtype = "float32"``, ``precision = "bfloat16"``) FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16)`` casts every parameter to bf16 when it gathers a unit for the
forward and backward. A frozen parameter never changes, so its bf16 cast never changes either: this lever
casts each frozen fp32 parameter to the compute dtype ONCE, before FSDP2 wraps the model, and FSDP2 then
gathers it without a cast (``param_dtype == orig_dtype``). The value every kernel reads is the same
``fp32 -> bf16`` round-to-nearest-even conversion, so forward outputs and gradients are identical; the device
holds 2 bytes per frozen parameter instead of 4 (3.62 GiB instead of 7.25 GiB for Edge's 1.946 B frozen
parameters). FSDP2 requires one dtype among a unit's *trainable* parameters only, which stay fp32.

The fp32 values stay on the host, in one exact-size :class:`~patches.core.host_arena.HostArena` (not
page-locked: nothing streams from it during training), full tensors:

- ``model.state_dict()`` returns them for the frozen keys (a state-dict post-hook on the root module), so
  every reader -- the trainer's checkpoint, the EMA's frozen entries (``net`` in fp32), upstream's DCP
  ``ModelWrapper`` -- sees the fp32 tensors stock holds, byte for byte. At a mesh of one rank (or without
  FSDP) the entry is the host tensor itself; on a larger mesh, this rank's shard of it as a DTensor.
- ``model.load_state_dict(sd)`` (a pre-hook) copies incoming frozen entries into the host arena first; the
  module's own load then writes their bf16 cast into the device parameter. After a loader that writes
  through ``model.state_dict()``'s tensors (``patches.core.checkpoint.load_full_state``), call
  :meth:`FrozenBF16.refresh` to recast the device copies from the host.

The stock device EMA (a full fp32 clone of every parameter) would average the bf16 copies, so this lever
goes with the CPU-subset EMA (``COSMOS_EMA_CPU_SUBSET=1``), whose frozen entries are the state dict's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from patches.core.errors import UserError
from patches.core.host_arena import HostArena
from patches.core.runtime import shard_of, to_local


def check_with_ema(acts: bool, ema_enabled: bool, ema_cpu_subset: bool) -> None:
    """Refuse the lever with the stock device EMA; the trainer and the ledger (``python -m patches.ledger``, the
    launcher's ``DRYRUN=1``) both call this, so both give the same one line.

    Args:
        acts: ``COSMOS_FROZEN_BF16=1`` and the parameters are stored in another dtype than they compute in (fp32
            master, bf16 compute: the only case the lever changes anything).
        ema_enabled: ``[model.ema].enabled``.
        ema_cpu_subset: ``COSMOS_EMA_CPU_SUBSET=1``.

    Raises:
        UserError: ``acts`` with the EMA on and not the CPU-subset EMA.
    """
    if acts and ema_enabled and not ema_cpu_subset:
        raise UserError("COSMOS_FROZEN_BF16=1 needs COSMOS_EMA_CPU_SUBSET=1 when [model.ema].enabled: the stock "
                        "device EMA clones every parameter and would average the bf16 copies of frozen ones; "
                        "set COSMOS_EMA_CPU_SUBSET=1 or unset COSMOS_FROZEN_BF16")


class FrozenBF16:
    """Holds ``model``'s frozen fp32 parameters as ``compute_dtype`` on their device, fp32 on the host.

    Apply it after ``requires_grad`` marks the trainable subset and BEFORE FSDP2 wraps the model (FSDP2
    records each parameter's dtype when it wraps).

    Args:
        model: the network (plain parameters, not yet sharded).
        compute_dtype: the dtype the forward computes in (FSDP2's ``param_dtype``; bf16).
        pin: page-lock the host arena (not needed: it is read at save and load only).

    Attributes:
        names: the parameters held compact (frozen, fp32, ``compute_dtype`` differs), in model order.
        arena: the host arena of their fp32 values (``nbytes``).
        device_bytes_saved: bytes no longer held on the device (fp32 minus ``compute_dtype`` sizes).

    Raises:
        ValueError: a parameter is already a DTensor (FSDP2 wrapped the model first).
    """

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16, *, pin: bool = False):
        params = dict(model.named_parameters())
        if any(hasattr(p, "device_mesh") for p in params.values()):
            raise ValueError("FrozenBF16 must be applied before FSDP2 wraps the model (it records the dtypes)")
        self.model = model
        self.compute_dtype = compute_dtype
        self.names = [n for n, p in params.items()
                      if not p.requires_grad and p.dtype == torch.float32 and compute_dtype != torch.float32]
        self.arena = HostArena([(tuple(params[n].shape), torch.float32) for n in self.names], pin=pin,
                               name="frozen-fp32")
        self.host = dict(zip(self.names, self.arena.tensors))
        saved = 0
        with torch.no_grad():
            for n in self.names:
                p = params[n]
                self.host[n].copy_(p.detach())
                p.data = p.data.to(compute_dtype)  # the value FSDP2's cast would give, once
                saved += p.numel() * (4 - p.element_size())
        self.device_bytes_saved = saved
        # torch marks the hook object: pass plain functions (a bound method takes no attributes)
        self._handles = [model.register_state_dict_post_hook(lambda *a: self._state_dict_hook(*a)),
                         model.register_load_state_dict_pre_hook(lambda *a: self._load_pre_hook(*a))]

    # ------------------------------------------------------------------ state dict
    def _saved_value(self, name: str, live: torch.Tensor) -> torch.Tensor:
        """What ``state_dict`` holds for frozen ``name`` (live: the device entry): the host fp32 values."""
        host = self.host[name]
        mesh = getattr(live, "device_mesh", None)
        if mesh is None or mesh.size() == 1:
            return host
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(shard_of(host, mesh, live.placements), mesh, live.placements, run_check=False,
                                  shape=live.shape, stride=live.stride())

    def _state_dict_hook(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for n in self.names:
            key = prefix + n
            if key in state_dict:
                state_dict[key] = self._saved_value(n, state_dict[key])

    @torch.no_grad()
    def _load_pre_hook(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        for n in self.names:
            v = state_dict.get(prefix + n)
            if v is None or not torch.is_tensor(v):
                continue
            if hasattr(v, "full_tensor"):
                v = v.full_tensor()
            if v.data_ptr() != self.host[n].data_ptr() and tuple(v.shape) == tuple(self.host[n].shape):
                self.host[n].copy_(v)

    @torch.no_grad()
    def refresh(self) -> None:
        """Recast every device copy from the host fp32 values (after a loader wrote into the host tensors)."""
        params = dict(self.model.named_parameters())
        for n in self.names:
            p = params[n]
            to_local(p).copy_(shard_of(self.host[n], getattr(p, "device_mesh", None), getattr(p, "placements", None)))

    @property
    def host_bytes(self) -> int:
        """Host bytes held (the fp32 arena)."""
        return self.arena.nbytes

    def close(self) -> None:
        """Remove the hooks (the device copies stay bf16) and drop the host arena."""
        for h in self._handles:
            h.remove()
        self.arena.release()
