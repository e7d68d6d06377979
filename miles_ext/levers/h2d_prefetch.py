"""Asynchronous host-to-device prefetch for FSDP2 CPU offload at world size 1.

**The fault.** At one rank, FSDP2 (torch 2.11 to 2.13, ``FSDPParamGroup.unshard`` / ``wait_for_unshard``) skips the
all-gather: ``unshard`` only records a placeholder result, and ``wait_for_unshard`` copies each offloaded shard
host-to-device *on the compute stream*, when the unit's own forward (or backward) starts. So
``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` change nothing, and every streamed
block's copy (1.29 GB bf16 for an H3 block) runs in series with compute (pytorch/torchtitan#2749). Under full
offload the lever was measured slower than FSDP2's own copy, so :func:`miles_ext.levers.fsdp_policy.apply_fsdp2`
attaches it by default only with partial residency (``docs/levers/h2d-prefetch.md`` has the measurements).

**The lever.** :class:`H2DPrefetch` is attached to each offloaded FSDP2 unit (an object on the module, as
accelerate attaches its hooks; :func:`attach`). When FSDP2 calls ``unshard`` -- the explicit prefetch from the
block before, or the unit's own pre-forward / pre-backward -- it:

1. allocates one device buffer per parameter shard (same shape and dtype as the host shard) on the compute
   stream, so the allocator's stream ordering covers their reuse;
2. has a side stream wait for the compute stream (the buffers' previous users are done), then issues
   ``buffer.copy_(host_shard, non_blocking=True)`` on the side stream (the shards live in the page-locked arena of
   :mod:`miles_ext.levers.pinned`, so these are DMA copies that run while the compute stream works) and records an event.

When FSDP2 then calls ``wait_for_unshard`` for the same unshard, the compute stream waits for that event, and
FSDP2's own code runs with each parameter's host shard swapped for its device copy (``_sharded_param_data``,
``offload_to_cpu=False`` for the call): the same ``_to_dtype_if_needed`` cast and the same copy into the
unsharded parameter, now device-to-device. Values are bit-identical by construction: the same bytes reach the
same kernels; only the stream that moves them differs. Proof: ``tests/equivalence/test_h2d_prefetch.py``
(CUDA: weights after several steps ``torch.equal`` with the lever off, full offload and partial residency;
planted: a stale staged copy reused across an optimizer step is caught).

A staged copy is used only by the ``wait_for_unshard`` of the unshard that made it (FSDP2's placeholder result
object is the key); any other is dropped. Units with a tensor-subclass shard (``fsdp_pre_all_gather``), on the
CPU, or at world size > 1 are left to FSDP2 (:func:`eligible` says why). Extra GPU memory: one staged copy per
unit in flight, already counted by :func:`miles_ext.levers.residency.plan_resident_blocks` (``streaming_buffers``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from patches.core import torch_internals

__all__ = ["H2DPrefetch", "eligible", "attach", "attached"]

_ATTR = "_onecard_h2d_prefetcher"


def _group(module: nn.Module) -> Any:
    """The unit's ``FSDPParamGroup`` (``None`` when ``module`` is not an FSDP2 unit or holds no parameters)."""
    state = getattr(module, "_get_fsdp_state", None)
    return state()._fsdp_param_group if callable(state) else None


def eligible(module: nn.Module) -> tuple[bool, str]:
    """Whether :class:`H2DPrefetch` may drive ``module``'s unit, and why not.

    Eligible: an FSDP2 unit on a CUDA device, world size 1, every parameter offloaded to the host
    (``CPUOffloadPolicy``) and plain tensor shards. The FSDP2 internals this module relies on are checked by
    :func:`patches.core.torch_internals.require` (an unsupported torch is refused by name, not skipped).
    """
    torch_internals.require()
    group = _group(module)
    if group is None or not group.fsdp_params:
        return False, "not an FSDP2 unit with parameters"
    if group.device.type != "cuda":
        return False, f"computes on {group.device.type}, not CUDA"
    pg = getattr(group, "_all_gather_process_group", None)
    if pg is None or pg.size() != 1:
        return False, "world size is not 1 (FSDP2 prefetches through its all-gather streams there)"
    for fp in group.fsdp_params:
        if not fp.offload_to_cpu:
            return False, "a parameter is not offloaded"
        if hasattr(getattr(fp, "_sharded_local_tensor", None), "fsdp_pre_all_gather"):
            return False, "a tensor-subclass shard (fsdp_pre_all_gather)"
    return True, ""


class H2DPrefetch:
    """The prefetch of one offloaded FSDP2 unit: host shards copied to the device on a side stream at
    ``unshard`` time, consumed at ``wait_for_unshard`` (see the module docstring).

    Args:
        module: an eligible FSDP2 unit (:func:`eligible`); ``ValueError`` otherwise.
        stream: the side stream for the copies (one shared by all units of a model: copies run in issue order).

    Attributes:
        staged: copies made and used; ``dropped``: copies made and not used (their unshard was never waited for).
    """

    def __init__(self, module: nn.Module, stream: torch.cuda.Stream):
        ok, why = eligible(module)
        if not ok:
            raise ValueError(f"{type(module).__name__}: cannot prefetch host-to-device: {why}")
        self.module, self.group, self.stream = module, _group(module), stream
        self._pending: tuple[Any, list[torch.Tensor], torch.cuda.Event] | None = None
        self.staged = 0
        self.dropped = 0
        self._orig_unshard = self.group.unshard
        self._orig_wait = self.group.wait_for_unshard
        self.group.unshard = self.unshard  # instance attributes: this unit only
        self.group.wait_for_unshard = self.wait_for_unshard

    def unshard(self, *args: Any, **kwargs: Any) -> Any:
        """FSDP2's ``unshard``; when it starts a new unshard, the host-to-device copies are issued here."""
        before = self.group._all_gather_result
        out = self._orig_unshard(*args, **kwargs)
        result = self.group._all_gather_result
        if result is not None and result is not before:
            self._stage(result)
        return out

    def _stage(self, result: Any) -> None:
        if self._pending is not None:
            self.dropped += 1
        compute = torch.cuda.current_stream(self.group.device)
        params = self.group.fsdp_params
        bufs = [torch.empty_like(fp._sharded_param_data, device=self.group.device) for fp in params]
        self.stream.wait_stream(compute)  # the buffers' memory may have just been freed by compute work
        with torch.cuda.stream(self.stream):
            for buf, fp in zip(bufs, params):
                buf.copy_(fp._sharded_param_data, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._pending = (result, bufs, done)

    def _wait_copy(self, done: torch.cuda.Event) -> None:
        """The compute stream waits for the staged copy: the one stream wait the values depend on (without it the
        unit's kernels may read a device buffer the side stream has not filled yet)."""
        torch.cuda.current_stream(self.group.device).wait_event(done)

    def wait_for_unshard(self, *args: Any, **kwargs: Any) -> Any:
        """FSDP2's ``wait_for_unshard``, reading this unshard's staged device copies instead of the host shards."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not self.group._all_gather_result:
            if pending is not None:
                self.dropped += 1
            return self._orig_wait(*args, **kwargs)
        _, bufs, done = pending
        self._wait_copy(done)
        params = self.group.fsdp_params
        saved = [(fp._sharded_param_data, fp.offload_to_cpu) for fp in params]
        try:
            for fp, buf in zip(params, bufs):
                fp._sharded_param_data, fp.offload_to_cpu = buf, False
            out = self._orig_wait(*args, **kwargs)
        finally:
            for fp, (data, off) in zip(params, saved):
                fp._sharded_param_data, fp.offload_to_cpu = data, off
        self.staged += 1
        return out


def attach(model: nn.Module, stream: torch.cuda.Stream | None = None) -> dict[str, Any]:
    """Attach an :class:`H2DPrefetch` to every eligible FSDP2 unit of ``model`` (idempotent).

    Returns ``{"units": n attached, "skipped": {reason: count}}``; nothing is attached on a CPU run.
    """
    units, skipped = 0, {}
    shared = stream
    for m in model.modules():
        if _group(m) is None:
            continue
        if getattr(m, _ATTR, None) is not None:
            units += 1
            continue
        ok, why = eligible(m)
        if not ok:
            skipped[why] = skipped.get(why, 0) + 1
            continue
        if shared is None:
            shared = torch.cuda.Stream(device=_group(m).device)
        setattr(m, _ATTR, H2DPrefetch(m, shared))
        units += 1
    return {"units": units, "skipped": skipped}


def attached(model: nn.Module) -> list[H2DPrefetch]:
    """The :class:`H2DPrefetch` objects on ``model``'s units."""
    return [p for m in model.modules() if (p := getattr(m, _ATTR, None)) is not None]

