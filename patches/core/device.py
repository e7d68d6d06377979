"""One device picker for both recipes: the rank's GPU (capped by ``ONECARD_GPU_MEMORY_GIB``), or the CPU.

``ONECARD_GPU_MEMORY_GIB`` simulates a smaller card: :func:`pick_device` limits this process's share of the GPU with
``torch.cuda.set_per_process_memory_fraction`` (an allocation past the cap raises CUDA's out-of-memory error, as on
the smaller card), and :func:`gpu_budget_bytes` reports the cap to whatever plans memory (the H3 residency planner, the
Cosmos ledger), so a plan never assumes the whole card.
"""

from __future__ import annotations

import math
import os

import torch

from patches.core.errors import UserError
from patches.core.flags import MAX_GPU_GIB
from patches.core.runtime import GiB

__all__ = ["GPU_MEMORY_ENV", "gpu_memory_cap_gib", "gpu_budget_bytes", "pick_device", "to_device"]

GPU_MEMORY_ENV = "ONECARD_GPU_MEMORY_GIB"
"""Environment variable: GiB of GPU memory this process may use (unset: the whole card)."""


def gpu_memory_cap_gib(total_bytes: int | None = None, environ: dict[str, str] | None = None) -> float | None:
    """``$ONECARD_GPU_MEMORY_GIB`` in GiB, or ``None`` when unset or empty.

    Args:
        total_bytes: the card's memory; when given, a cap above it is refused (without it, one above
            :data:`patches.core.flags.MAX_GPU_GIB`).

    Raises:
        UserError: not a finite number > 0, or above ``total_bytes`` (one line naming the variable and the range).
    """
    raw = (environ if environ is not None else os.environ).get(GPU_MEMORY_ENV, "").strip()
    if not raw:
        return None
    try:
        gib = float(raw)
    except ValueError:
        gib = math.nan
    top = f"{total_bytes / GiB:.2f}" if total_bytes else f"{MAX_GPU_GIB:g}"
    limit = total_bytes / GiB if total_bytes is not None else MAX_GPU_GIB  # no card known: an absurd cap still fails
    if not (math.isfinite(gib) and 0 < gib <= limit):
        raise UserError(f"{GPU_MEMORY_ENV}={raw!r} must be a number of GiB in (0, {top}] for this card: fix it, or "
                        "unset it for the whole card")
    return gib


def pick_device(local_rank: int = 0) -> torch.device:
    """The rank's GPU (``cuda:local_rank``, made current and capped at ``ONECARD_GPU_MEMORY_GIB``), or the CPU.

    Raises:
        UserError: a bad ``ONECARD_GPU_MEMORY_GIB`` (see :func:`gpu_memory_cap_gib`), on a GPU or a CPU.
    """
    if not torch.cuda.is_available():
        gpu_memory_cap_gib()  # a bad value is refused on a CPU too (it would be on the GPU)
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    total = torch.cuda.get_device_properties(device).total_memory
    gib = gpu_memory_cap_gib(total)
    if gib is not None:
        torch.cuda.set_per_process_memory_fraction(gib * GiB / total, device)
    return device


def gpu_budget_bytes(device: torch.device) -> int:
    """The GPU memory this process may use on ``device``: the ``ONECARD_GPU_MEMORY_GIB`` cap, else the card's total
    (0 on the CPU).

    Raises:
        UserError: a bad ``ONECARD_GPU_MEMORY_GIB``.
    """
    if device.type != "cuda":
        gib = gpu_memory_cap_gib()
        return int(gib * GiB) if gib is not None else 0
    total = torch.cuda.get_device_properties(device).total_memory
    gib = gpu_memory_cap_gib(total)
    return int(gib * GiB) if gib is not None else int(total)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; a host tensor goes to a GPU from pinned memory without waiting for the GPU's queue (a
    plain ``.to`` from pageable memory synchronizes the stream). A tensor already pinned is not copied on the host."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
