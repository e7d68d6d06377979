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


class WrappedFrozenBF16(FrozenBF16):
    """The same lever on a model FSDP2 has already wrapped: upstream cosmos-framework's order.

    Upstream builds ``net``, casts it to the fp32 master dtype and wraps it with FSDP2 in ``build_net``; only later,
    when it builds the optimizer (``keys_to_select``), does it mark which parameters train. So here, after that:
    for every FSDP2 unit whose ``MixedPrecisionPolicy.param_dtype`` is ``compute_dtype``, each frozen fp32
    parameter it manages is replaced by a parameter holding the ``fp32 -> compute_dtype`` cast of its local shard
    (same mesh, placements, global shape and stride), and FSDP2 is told, with the two steps its own
    ``FSDPModule._apply`` and lazy init run after a parameter changes (``FSDPParam.reset_sharded_param``, then
    ``init_dtype_attrs``): the unit then gathers those values without a cast (``param_dtype`` clamps to ``None``),
    which are the values its cast would have given. Trainable parameters stay fp32, so the unit's one-dtype rule
    (trainable parameters only) holds. The torch internals are checked first
    (:func:`patches.core.torch_internals.require`).

    The fp32 local shards go to one exact-size host arena (not page-locked: read at save and load only).
    ``model.state_dict()`` returns them for the frozen keys (a post-hook), so upstream's DCP ``ModelWrapper``
    and the host EMA's frozen entries see the fp32 values stock holds: at a mesh of one rank the host tensor
    itself; on a larger mesh this rank's shard as a DTensor (``DTensor.from_local``, which stages it on the mesh's
    device). ``model.load_state_dict(sd)`` (a pre-hook) copies incoming frozen entries into the arena (nothing to
    copy when ``sd`` holds the arena's own tensors, as a DCP template from ``state_dict()`` does), writes their cast
    into the device parameter and hands the module its own parameter for those keys.

    Args:
        model: the wrapped network (``fully_shard`` applied to its units), trainable subset already marked.
        compute_dtype: the policy's compute dtype (bf16).

    Attributes:
        names: the parameters held compact, in model order; ``device_bytes_saved``, ``host_bytes`` and
            :meth:`close` as for :class:`FrozenBF16`, whose state-dict hook it shares (the saved value and the load
            hook are its own: it holds local shards, not full tensors).

    Raises:
        UpstreamMismatch: this torch's FSDP2 internals differ from the supported releases'.
    """

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16):
        from patches.core.torch_internals import fsdp_param_groups, require

        require()
        self.model = model
        self.compute_dtype = compute_dtype
        names = {id(p): n for n, p in model.named_parameters()}
        todo = []  # (name, FSDPParam, policy)
        for g in fsdp_param_groups(model):
            if compute_dtype == torch.float32 or g.mp_policy.param_dtype != compute_dtype:
                continue
            for fp in g.fsdp_params:
                p = fp.sharded_param
                if not p.requires_grad and p.dtype == torch.float32 and id(p) in names:
                    todo.append((names[id(p)], fp, g.mp_policy))
        self.names = [n for n, _, _ in todo]
        self.arena = HostArena([(tuple(to_local(fp.sharded_param).shape), torch.float32) for _, fp, _ in todo],
                               pin=False, name="frozen-fp32")
        self.host = dict(zip(self.names, self.arena.tensors))
        saved = 0
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for n, fp, policy in todo:
                old = fp.sharded_param
                local = to_local(old)
                self.host[n].copy_(local)
                cast = DTensor.from_local(local.to(compute_dtype), old.device_mesh, old.placements, run_check=False,
                                          shape=old.shape, stride=old.stride())
                fp._setattr_on_modules(nn.Parameter(cast, requires_grad=False))
                fp.reset_sharded_param()  # FSDP2 adopts the new parameter; the fp32 shard is released
                fp.init_dtype_attrs(policy)  # orig dtype now compute_dtype: gathered without a cast
                saved += local.numel() * (4 - cast.element_size())
        self.device_bytes_saved = saved
        self._handles = [model.register_state_dict_post_hook(lambda *a: self._state_dict_hook(*a)),
                         model.register_load_state_dict_pre_hook(lambda *a: self._load_pre_hook(*a))]

    def _params(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())

    def _saved_value(self, name: str, live: torch.Tensor) -> torch.Tensor:
        host = self.host[name]
        mesh = getattr(live, "device_mesh", None)
        if mesh is None or mesh.size() == 1:
            return host
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(host, mesh, live.placements, run_check=False, shape=live.shape,
                                  stride=live.stride())

    @torch.no_grad()
    def _load_pre_hook(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        params = self._params()
        for n in self.names:
            key = prefix + n
            v = state_dict.get(key)
            if v is None or not torch.is_tensor(v):
                continue
            host = self.host[n]
            local = to_local(v)
            if local.data_ptr() != host.data_ptr():
                p = params[n]
                if tuple(local.shape) == tuple(host.shape):
                    host.copy_(local)
                elif tuple(local.shape) == tuple(p.shape):  # a full tensor: this rank's shard of it
                    host.copy_(shard_of(local, p.device_mesh, p.placements))
                else:
                    continue  # the module's own load reports the shape mismatch
            to_local(params[n]).copy_(host)
            state_dict[key] = params[n].detach()  # the module copies its own values onto themselves

    @torch.no_grad()
    def refresh(self) -> None:
        """Recast every device copy from the host fp32 values (after a loader wrote into the host tensors)."""
        params = self._params()
        for n in self.names:
            to_local(params[n]).copy_(self.host[n])
