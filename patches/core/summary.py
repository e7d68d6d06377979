"""One ``summary.json`` schema for both recipes: the same facts under the same keys.

Every run writes ``<run dir>/summary.json`` (atomically, rank 0) when it ends. The shared keys, :data:`COMMON`, mean
the same thing in both recipes; each recipe adds its own facts beside them (the Cosmos recipe's ``ema``, ``drops``,
``cap``...; the H3 recipe's ``global_batch``, ``host_rss_gib``, ``fsdp_resident_blocks``...), and a recipe key never
reuses a shared key's name. ``docs/outputs.md`` lists both recipes' own keys.
"""

from __future__ import annotations

import math
from typing import Any

from patches.core.device import gpu_memory_cap_gib
from patches.core.runtime import GiB

__all__ = ["SCHEMA", "COMMON", "run_summary", "missing_keys"]

SCHEMA = "onecard-run-summary/1"
"""Version of the schema, the value of the ``schema`` key."""

COMMON: dict[str, str] = {
    "schema": f"the schema's version ({SCHEMA!r})",
    "recipe": "'cosmos3-edge' or 'minimax-h3'",
    "preset": "the model preset that ran ('edge', 'tiny', 'full', ...)",
    "device": "the GPU's name, or 'cpu'",
    "world_size": "ranks of the run",
    "unit": "what a checkpoint counts: 'iteration' (Cosmos: one optimizer step) or 'rollout' (H3)",
    "steps": "optimizer steps this run trained (a resumed run counts only its own)",
    "optimizer_steps_total": "optimizer steps the model has had, the resumed checkpoint's included",
    "resumed_from": "the unit count the run started from (0: a fresh run)",
    "reached": "the unit count reached, the number in the newest checkpoint's name",
    "losses": "the training loss of each optimizer step this run trained (random weights: no quality signal)",
    "last_loss": "the last of those (NaN when the run trained none)",
    "s_per_step_median": "median seconds per optimizer step (s)",
    "peak_gpu_allocated_gib": "peak GPU memory allocated by torch (GiB; 0 on the CPU)",
    "peak_gpu_reserved_gib": "peak GPU memory reserved by torch's caching allocator (GiB; 0 on the CPU)",
    "gpu_memory_cap_gib": "ONECARD_GPU_MEMORY_GIB's cap (GiB), or null for the whole card",
    "peak_host_rss_gib": "the process's peak resident host memory that the run saw (GiB)",
    "pinned_bytes": "page-locked host bytes onecard's own arenas hold at the end (B)",
    "checkpoint": "path of the newest checkpoint this run wrote, or null",
}
"""The shared keys and what each means."""


def run_summary(*, recipe: str, preset: str, device: Any, world_size: int, unit: str, steps: int,
                optimizer_steps_total: int, resumed_from: int, reached: int, losses: list[float],
                s_per_step_median: float, peak_host_rss_gib: float, pinned_bytes: int, checkpoint: Any,
                **details: Any) -> dict[str, Any]:
    """The summary dict: :data:`COMMON`'s keys (GPU name, peaks and cap read from ``device`` here) then ``details``.

    Raises:
        ValueError: a detail reuses a shared key's name.
    """
    import torch

    clash = sorted(set(details) & set(COMMON))
    if clash:
        raise ValueError(f"recipe summary keys {clash} are shared keys of {SCHEMA}: rename them")
    cuda = getattr(device, "type", str(device)) == "cuda"
    out = {
        "schema": SCHEMA,
        "recipe": recipe,
        "preset": preset,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "world_size": int(world_size),
        "unit": unit,
        "steps": int(steps),
        "optimizer_steps_total": int(optimizer_steps_total),
        "resumed_from": int(resumed_from),
        "reached": int(reached),
        "losses": [float(x) for x in losses],
        "last_loss": float(losses[-1]) if losses else math.nan,
        "s_per_step_median": float(s_per_step_median),
        "peak_gpu_allocated_gib": torch.cuda.max_memory_allocated(device) / GiB if cuda else 0.0,
        "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved(device) / GiB if cuda else 0.0,
        "gpu_memory_cap_gib": gpu_memory_cap_gib(),
        "peak_host_rss_gib": float(peak_host_rss_gib),
        "pinned_bytes": int(pinned_bytes),
        "checkpoint": str(checkpoint) if checkpoint else None,
    }
    out.update(details)
    return out


def missing_keys(summary: dict[str, Any]) -> list[str]:
    """The shared keys a summary lacks (``[]`` for one that follows the schema)."""
    return [k for k in COMMON if k not in summary]
