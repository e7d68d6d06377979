"""Exact pinned host memory for FSDP2's CPU offload.

``CPUOffloadPolicy(pin_memory=True)`` pins each offloaded shard with ``Tensor.pin_memory()``, which goes through
PyTorch's caching host allocator: every block is rounded up to a power of two (torch 2.11 .. 2.13,
``CachingHostAllocator.h``; :func:`power_of_two_bytes` says how much that locks). torch 2.13 has an allocator setting against it (``PYTORCH_CUDA_ALLOC_CONF=
pinned_max_round_threshold_mb:N``), but a request above N is then still *cached* in the power-of-two free list,
and 2.13's ``get_free_block`` hands a cached block out without comparing its size (a larger request can get a
smaller block: pytorch PR 192722), and the GPU runs use torch 2.11. So this module does not rely on it:

- shard with ``CPUOffloadPolicy(pin_memory=False)`` (FSDP2 then never calls ``pin_memory()``), then
- :func:`pin_offloaded_shards` moves every offloaded shard (``FSDPParam._sharded_param_data``, 1-D, padded
  size) into ONE :class:`patches.core.host_arena.HostArena` of exactly the summed bytes (64-byte aligned),
  page-locked with ``cudaHostRegister``. The H2D copy of FSDP2's all-gather (``.to(device, non_blocking=True)``)
  then reads page-locked memory and is asynchronous as with ``pin_memory()``.

Gradients: the offloaded shards keep ``FSDPParam.pin_memory = False``, so FSDP2 copies an offloaded *gradient*
to ordinary (pageable) host memory, synchronously: nothing of the gradient path is pinned either. Only
trainable parameters have gradients (the LoRA adapters); with
``adapters_on_device`` (:mod:`miles_ext.levers.residency`) they stay on the GPU and no gradient is offloaded at all.

What is reported (:class:`PinnedReport`): the bytes requested (sum of the shards' bytes), the arena's bytes, and
the bytes **measured** as locked in this process (:func:`locked_bytes`): the caching host allocator's own
counter of bytes it holds from ``cudaHostAlloc`` (``torch.cuda.host_memory_stats()["allocated_bytes.current"]``,
rounded sizes) plus the bytes every live arena registered (the driver accepted each ``cudaHostRegister`` of
exactly that size), and ``VmLck`` / ``VmPin`` of ``/proc/self/status`` for reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from patches.core import torch_internals
from patches.core.host_arena import HostArena, pinned_bytes_total
from patches.core.runtime import proc_status_kib

__all__ = ["PinnedReport", "fsdp_params", "offloaded_fsdp_params", "rebind_shard", "pin_offloaded_shards",
           "locked_bytes", "pinned_report"]

ARENA_ATTR = "_onecard_fsdp_arena"
"""Attribute of the root module that keeps its arena alive (views into it are the offloaded shards)."""


@dataclasses.dataclass(frozen=True)
class PinnedReport:
    """What :func:`pin_offloaded_shards` did; bytes unless named otherwise."""

    shards: int
    """Offloaded FSDP2 parameter shards moved into the arena."""
    requested_bytes: int
    """Sum of the shards' bytes (``numel * element_size`` of each padded 1-D shard)."""
    arena_bytes: int
    """Bytes of the arena (``requested_bytes`` plus at most 63 B of alignment per shard)."""
    pinned_bytes: int
    """Bytes the arena page-locked (``arena_bytes`` on CUDA, 0 without CUDA)."""
    power_of_two_bytes: int = 0
    """What FSDP2's own ``pin_memory()`` would have locked for the same shards (:func:`power_of_two_bytes`)."""

    def as_dict(self) -> dict[str, int]:
        """The fields as a plain dict (for ``summary.json``)."""
        return dataclasses.asdict(self)


def fsdp_params(model: nn.Module) -> list[Any]:
    """Every ``FSDPParam`` of ``model``'s FSDP2 units, in module order (private attributes, see
    :func:`patches.core.torch_internals.fsdp_param_groups`)."""
    return [fp for g in torch_internals.fsdp_param_groups(model) for fp in g.fsdp_params]


def offloaded_fsdp_params(model: nn.Module) -> list[Any]:
    """The ``FSDPParam`` s of ``model`` whose unit has a ``CPUOffloadPolicy``."""
    return [fp for fp in fsdp_params(model) if fp.offload_to_cpu]


def rebind_shard(fp: Any, flat: torch.Tensor, *, copy: bool = True) -> None:
    """Make the 1-D host tensor ``flat`` the storage of ``fp``'s shard (its padded ``_sharded_param_data``).

    ``flat`` must have the shard's element count and dtype. ``copy`` copies the current values in (skipped for a
    shard still on the meta device). The sharded parameter is re-created as a DTensor over a view of ``flat`` and
    set on its module(s), as FSDP2's own ``_init_sharded_param`` does, so a shard built on the meta device becomes
    a CPU DTensor. ``fp.pin_memory`` is cleared: FSDP2 must not re-pin it, and offloaded gradients go to pageable
    memory (see the module docstring). Call before the optimizer is built (parameters are new objects).

    Raises:
        ValueError: ``flat`` has another size or dtype than the shard.
    """
    src = fp._sharded_param_data
    if flat.numel() != src.numel() or flat.dtype != src.dtype or flat.dim() != 1:
        raise ValueError(f"{fp._param_fqn}: arena view of {flat.numel()} x {flat.dtype} for a shard of "
                         f"{src.numel()} x {src.dtype}")
    if copy and not src.is_meta:
        with torch.no_grad():
            flat.copy_(src)
    old = fp.sharded_param
    dim = fp.fsdp_placement.dim
    local = old._local_tensor
    length = local.size(dim) if local.numel() > 0 else 0
    fp._sharded_param_data = flat
    view = flat.view(fp.padded_sharded_param_size).narrow(dim, 0, length)
    fp.sharded_param = nn.Parameter(fp.to_sharded_dtensor(view), requires_grad=old.requires_grad)
    fp._setattr_on_modules(fp.sharded_param)
    fp.pin_memory = False


def pin_offloaded_shards(model: nn.Module, *, pin: bool | None = None, copy: bool = True) -> PinnedReport:
    """Move every CPU-offloaded FSDP2 shard of ``model`` into one exact-size host arena, page-locked on CUDA.

    Args:
        model: the root module after ``fully_shard`` (units sharded with ``CPUOffloadPolicy(pin_memory=False)``;
            a unit sharded with ``pin_memory=True`` has already been rounded by the caching allocator, and moving
            it frees that block only back into the allocator's cache).
        pin: page-lock the arena (``None``: when CUDA is available).
        copy: copy the shards' current values (``False`` for shards still on the meta device that the caller
            fills afterwards, :mod:`miles_ext.levers.fast_init`).

    Returns:
        A :class:`PinnedReport`. The arena is kept alive by ``model`` (attribute ``_onecard_fsdp_arena``).

    Raises:
        RuntimeError: ``cudaHostRegister`` failed (locked-memory limit, ``ulimit -l``).
    """
    torch_internals.require()
    fps = offloaded_fsdp_params(model)
    if pin is None:
        pin = torch.cuda.is_available()
    arena = HostArena([((fp._sharded_param_data.numel(),), fp._sharded_param_data.dtype) for fp in fps], pin=pin,
                      name="fsdp-offload")
    for fp, flat in zip(fps, arena.tensors):
        rebind_shard(fp, flat, copy=copy)
    setattr(model, ARENA_ATTR, arena)
    sizes = [fp._sharded_param_data.numel() * fp._sharded_param_data.element_size() for fp in fps]
    return PinnedReport(shards=len(fps), requested_bytes=sum(sizes), arena_bytes=arena.nbytes,
                        pinned_bytes=arena.pinned_bytes, power_of_two_bytes=power_of_two_bytes(sizes))


def locked_bytes() -> dict[str, int]:
    """Page-locked host memory of this process, measured, in bytes.

    ``caching_allocator``: bytes the caching host allocator holds from ``cudaHostAlloc`` (its rounded block sizes,
    ``torch.cuda.host_memory_stats()["allocated_bytes.current"]``; 0 without CUDA or without that counter).
    ``arenas``: bytes registered by live :class:`~patches.core.host_arena.HostArena` objects.
    ``total``: their sum, the figure compared with the requested bytes. ``vm_lck`` / ``vm_pin``: the kernel's
    ``VmLck`` / ``VmPin`` (mlock'ed / long-term pinned pages; the CUDA driver's registrations may or may not be
    counted there, depending on the driver).
    """
    cached = 0
    if torch.cuda.is_available():
        try:
            stats = torch.cuda.host_memory_stats()
            cached = int(stats.get("allocated_bytes.current", stats.get("reserved_bytes.current", 0)))
        except (AttributeError, RuntimeError):
            cached = 0
    arenas = pinned_bytes_total()
    st = proc_status_kib(("VmLck", "VmPin"))
    return {"caching_allocator": cached, "arenas": arenas, "total": cached + arenas,
            "vm_lck": st["VmLck"] * 1024, "vm_pin": st["VmPin"] * 1024}


def pinned_report(model: nn.Module) -> PinnedReport | None:
    """The :class:`PinnedReport` ``apply_fsdp2(exact_pin=True)`` left on ``model``, or ``None``."""
    return getattr(model, "_onecard_pinned_report", None)


def locked_within(requested: int, locked: int, tolerance: float = 0.05) -> bool:
    """The exact-arena target: ``locked <= (1 + tolerance) * requested`` (and at least the requested bytes when any
    were requested: memory that is not locked is not served pinned)."""
    return requested <= locked <= (1.0 + tolerance) * requested if requested else locked == 0


def power_of_two_bytes(sizes: list[int]) -> int:
    """What the caching host allocator locks for blocks of ``sizes`` bytes: each rounded up to a power of two
    (``c10::llvm::PowerOf2Ceil``; used to show what the exact arena saves)."""
    return sum(1 << (s - 1).bit_length() if s > 0 else 0 for s in sizes)

