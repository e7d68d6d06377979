"""Test helpers for the VAE-offload proof (lever 2): poisoned allocations, the resident-vs-parked A/B, round trips."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from cosmos_framework_ext.levers.vae_offload import VAEOffload
from cosmos_framework_ext.recipe.vae import encode_latents
from patches.core.runtime import GiB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def poisoned_uninitialized_memory() -> Iterator[None]:
    """Fill every ``torch.empty``-style allocation with NaN (floats) / max value (ints) inside the block.

    Uses ``torch.use_deterministic_algorithms(True, warn_only=True)`` with
    ``torch.utils.deterministic.fill_uninitialized_memory = True``; restores the previous settings on
    exit. An equivalence proof needs this: an unpark that allocates without copying would otherwise
    often get back the block it just freed, still holding the right weights, and pass by accident.
    """
    import torch.utils.deterministic as det

    prev = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    prev_fill = det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        det.fill_uninitialized_memory = prev_fill
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])


@dataclasses.dataclass
class EquivalenceReport:
    """Outcome of :func:`check_equivalence`; :attr:`ok` is the verdict."""

    latents_equal: bool
    """Offloaded latents ``torch.equal`` the resident ones."""
    max_abs_diff: float
    """max |offloaded - resident| over the latents (nan when NaN appears; 0.0 when equal)."""
    state_equal_parked: bool
    """state_dict while parked: same keys, dtypes, shapes, strides and values as before offloading."""
    state_equal_unparked: bool
    """The same check while unparked."""
    buffers_equal: bool
    """Same buffer names before/after, each with the same dtype and value."""
    cycles: int
    """park/unpark cycles run before the offloaded encode."""

    @property
    def ok(self) -> bool:
        return self.latents_equal and self.state_equal_parked and self.state_equal_unparked and self.buffers_equal


def _snapshot(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


def _same(ref: Mapping[str, torch.Tensor], now: Mapping[str, torch.Tensor]) -> bool:
    if ref.keys() != now.keys():
        return False
    for k, r in ref.items():
        n = now[k]
        if n.dtype != r.dtype or n.shape != r.shape or (n.dim() and n.stride() != r.stride()):
            return False
        if not torch.equal(n.detach().cpu(), r):
            return False
    return True


def check_equivalence(
    vae: nn.Module,
    video: torch.Tensor,
    device: torch.device | str,
    *,
    keep_encoder_resident: bool = False,
    cycles: int = 3,
    offload_factory: Callable[..., VAEOffload] = VAEOffload,
) -> EquivalenceReport:
    """A/B proof for the lever: resident latents vs latents after attaching an offload and cycling it.

    Steps (all under :func:`poisoned_uninitialized_memory`): snapshot the state_dict and buffers;
    encode with ``vae`` resident; attach ``offload_factory(vae, device, keep_encoder_resident=...)``;
    run ``cycles`` ``on_device()`` round trips, comparing the state inside (unparked) and after (parked);
    encode inside ``on_device()``; compare. The offload is removed at the end and the snapshot loaded back
    (``vae`` resident with its original weights again, even after a buggy offload), also when a step
    raises.

    Args:
        vae: frozen VAE with every tensor on ``device`` and no offload attached.
        video: ``[B, 3, T, H, W]`` clip (see :func:`encode_latents`).
        device: the device ``vae`` lives on.
        keep_encoder_resident: passed to the offload.
        cycles: ``on_device()`` round trips (>= 1) before the offloaded encode.
        offload_factory: the offload class (tests pass planted-bug subclasses).

    Raises:
        ValueError: ``cycles < 1``; a tensor of ``vae`` is not on ``device``; what the offload raises.
    """
    if cycles < 1:
        raise ValueError(f"cycles must be >= 1, got {cycles}")
    dev = torch.device(device)
    off_dev = [n for n, t in [*vae.named_parameters(), *vae.named_buffers()] if t.device.type != dev.type]
    if off_dev:
        raise ValueError(f"check_equivalence needs vae resident on {dev}: {off_dev[0]} is not (call vae.to(device))")
    with poisoned_uninitialized_memory():
        state0 = _snapshot(vae.state_dict())
        bufs0 = _snapshot(dict(vae.named_buffers()))
        ref = encode_latents(vae, video)
        off = offload_factory(vae, device, keep_encoder_resident=keep_encoder_resident)
        try:
            unparked_ok = parked_ok = True
            for _ in range(cycles):
                with off.on_device():
                    unparked_ok &= _same(state0, vae.state_dict())
                parked_ok &= _same(state0, vae.state_dict())
            with off.on_device():
                out = encode_latents(vae, video)
            buffers_ok = _same(bufs0, dict(vae.named_buffers()))
        finally:
            off.remove()
            with torch.no_grad():  # a buggy offload may have left wrong values: give the caller its weights back
                vae.load_state_dict({k: v.to(dev) for k, v in state0.items()})
    equal = out.dtype == ref.dtype and out.shape == ref.shape and torch.equal(out, ref)
    if equal:
        diff = 0.0
    elif out.shape == ref.shape:
        diff = float((out.double() - ref.double()).abs().max())
    else:
        diff = math.inf
    return EquivalenceReport(equal, diff, parked_ok, unparked_ok, buffers_ok, cycles)


def measure_round_trip(offload: VAEOffload, n: int = 10, *, warmup: int = 1) -> dict[str, float | int]:
    """Time ``n`` unpark+park round trips (CUDA-synchronized) after ``warmup`` untimed ones.

    Call it outside any ``on_device()`` block; the offload is left parked.

    Returns:
        ``n``; ``median_s``, ``min_s``, ``max_s`` of a round trip (s); ``median_unpark_s`` and
        ``median_park_s`` (s); ``bytes`` moved per unpark; ``unpark_gib_per_s`` (GiB/s, from the
        median unpark).

    Raises:
        ValueError: ``n < 1`` or ``warmup < 0``; RuntimeError: called inside ``on_device()``.
    """
    if n < 1 or warmup < 0:
        raise ValueError(f"need n >= 1 and warmup >= 0, got n={n}, warmup={warmup}")
    if offload.depth:
        raise RuntimeError("measure_round_trip called inside on_device(): leave the context first")
    for _ in range(warmup):
        offload._unpark()
        offload._park()
    ups: list[float] = []
    parks: list[float] = []
    for _ in range(n):
        _sync(offload.device)
        t0 = time.perf_counter()
        offload._unpark()  # synchronizes before returning
        t1 = time.perf_counter()
        offload._park()
        t2 = time.perf_counter()
        ups.append(t1 - t0)
        parks.append(t2 - t1)
    trips = [u + p for u, p in zip(ups, parks)]
    med_up = statistics.median(ups)
    nbytes = offload.device_bytes_when_unparked
    return {
        "n": n,
        "median_s": statistics.median(trips),
        "min_s": min(trips),
        "max_s": max(trips),
        "median_unpark_s": med_up,
        "median_park_s": statistics.median(parks),
        "bytes": nbytes,
        "unpark_gib_per_s": nbytes / GiB / med_up if med_up > 0 else math.inf,
    }
