"""Helpers for CUDA tests that tell stream order by a GPU sleep, not by timing.

A test queues a long ``torch.cuda._sleep`` on one stream, then the work whose order it checks; right code and a
planted bug give different bytes. Two things can let the sleep's end, not the code, order that work, so that a
planted race passes:

- CUDA's lazy module loading (PyTorch's default): a kernel's first launch in the process can wait for the device to
  go idle. :func:`rehearsed` runs the test's steps once without the sleep first, so every kernel is loaded.
- a blocking call on the host (an allocation, a stall): :func:`gpu_sleep` returns an event recorded after the sleep, and
  :func:`still_sleeping` fails the measured run where it was already reached when the race was queued.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

GPU_SLEEP_CYCLES = 1_000_000_000
"""``torch.cuda._sleep`` cycles: about 0.5 s at an H100's or H200's clock."""

T = TypeVar("T")


def gpu_sleep(cycles: int, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
    """``torch.cuda._sleep(cycles)`` on ``stream`` (the current one by default); returns an event recorded after it:
    while it is not reached, the work queued so far was ordered by the code, not by the sleep's end."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        torch.cuda._sleep(cycles)
        slept = torch.cuda.Event()
        slept.record()
    return slept


def still_sleeping(slept: torch.cuda.Event, cycles: int) -> None:
    """Fails when a measured run's sleep (``cycles`` > 0) had ended before the race it brackets was queued: the host
    stalled, or something synchronized, and the test would test nothing."""
    assert cycles == 0 or not slept.query(), "the work was ordered by the sleep's end, not by the code under test"


def rehearsed(helper: Callable[[T, int], Any], make: Callable[[], T]) -> Any:
    """``helper(make(), 0)`` (the rehearsal: every kernel the measured run launches is loaded), then
    ``helper(make(), GPU_SLEEP_CYCLES)``, whose result it returns."""
    helper(make(), 0)
    return helper(make(), GPU_SLEEP_CYCLES)
