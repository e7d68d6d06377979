"""Lever 2 (``COSMOS_VAE_CPU_OFFLOAD=1``): park the frozen Wan2.2 VAE in pinned host memory.

The VAE is frozen, so its weights never change after construction. :class:`VAEOffload` therefore keeps
one persistent host copy of every parked parameter and buffer, in a single exact-size pinned
:class:`~patches.core.host_arena.HostArena`, and moves the module between two states:

- **parked**: each parked tensor *is* its host copy (a view into the arena); no device memory is held.
- **unparked**: each parked tensor is a fresh device tensor filled from its host copy by a
  ``non_blocking`` H2D copy out of pinned memory.

:meth:`VAEOffload.on_device` is the one way to bring the module to the device: a re-entrant context
manager with one depth counter. Entering at depth 0 unparks, leaving back to depth 0 parks (also when the
body raised); nested blocks move nothing. Parking copies nothing back (the weights are frozen: the host
copy is still exact), it only drops the device storage, so a round trip costs one H2D transfer. Measured
on an H200 for the full-size VAE: ``module.to("cpu")``/``.to("cuda")`` through pageable memory 0.88 s per
round trip; park + unpark 33 ms, latents ``torch.equal`` after.

The trainer unparks once per micro-batch, around all of that micro-batch's encodes::

    offload = VAEOffload(vae, "cuda")          # attaches itself as vae._onecard_offload
    with offload.on_device():                  # one H2D transfer
        for clip in micro_batch:
            latents = encode_latents(vae, clip)  # nested on_device(): no second move
    # parked again here, also when the body raised

Like accelerate's hooks, the lever is an object attached to the module (``module._onecard_offload``);
code that encodes looks it up (see :func:`encode_latents`) instead of branching on a flag.

How tensors are swapped: a parked *parameter* keeps its ``nn.Parameter`` object and only its ``.data``
is re-pointed (exactly what ``nn.Module.to`` does by default), so anything holding the parameter
(named_parameters, hooks, an optimizer's param groups) keeps seeing the same object with its
``requires_grad`` unchanged. A parked *buffer* is a plain tensor and is replaced in
``module._buffers[name]`` (again what ``nn.Module.to`` does); every module registering the same buffer
tensor is updated together. Shapes, strides, dtypes and the set of buffers are preserved exactly.

Not thread-safe: use one module's ``on_device()`` from one thread. Device tensors are allocated and
filled on the current CUDA stream; entering ``on_device()`` returns only after the copies completed, so
they are valid on every stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from patches.core.host_arena import HostArena
from patches.core.runtime import GiB

__all__ = [
    "OFFLOAD_ATTR",
    "VAEOffload",
    "EquivalenceReport",
    "check_equivalence",
    "encode_latents",
    "get_offload",
    "measure_round_trip",
    "offload_from_env",
    "poisoned_uninitialized_memory",
]

OFFLOAD_ATTR = "_onecard_offload"
"""Attribute name under which a :class:`VAEOffload` records itself on its module."""


@dataclasses.dataclass
class _Slot:
    """One parked tensor: its persistent host copy and where it is registered in the module."""

    host: torch.Tensor
    """View into the arena, same shape/stride/dtype as the original tensor."""
    param: nn.Parameter | None
    """The parameter whose ``.data`` is swapped, or ``None`` for a buffer."""
    buffer_refs: list[tuple[nn.Module, str]]
    """``(module, name)`` registrations of a buffer (several when the same tensor is shared)."""

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


def _dense_strides(t: torch.Tensor) -> bool:
    """Whether ``t`` covers exactly ``numel`` contiguous elements in some dimension order (no gaps, no overlap)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class VAEOffload:
    """Keeps a frozen module's tensors in pinned host memory, on ``device`` only while unparked.

    At construction the parked part's parameters and buffers are copied into ONE
    :class:`~patches.core.host_arena.HostArena` (pinned when ``device`` is CUDA), the resident part (if any)
    is moved to ``device``, and the module is left **parked**. ``module._onecard_offload`` is set to
    this object.

    Args:
        module: the frozen module (e.g. ``diffusers.AutoencoderKLWan``); every parameter must have
            ``requires_grad=False``. Its tensors may be anywhere except the meta device.
        device: where the module runs (``"cuda"``, ``"cuda:1"``, ``torch.device``). ``"cpu"`` is allowed
            for CPU-only machines: ``on_device()`` then makes fresh CPU copies and leaving it points back
            at the arena, so the storage really is swapped and the mechanism is exercised.
        keep_encoder_resident: keep the encode path permanently on ``device`` and park only the rest
            (for ``AutoencoderKLWan``: ``encoder`` and ``quant_conv`` stay, ``decoder`` and
            ``post_quant_conv`` are parked).
        encoder_attr: name of the encoder submodule; with ``keep_encoder_resident``, the submodule of
            that name plus ``quant_conv`` when the module has one (``AutoencoderKLWan._encode`` applies
            it after the encoder) stay resident. A tuple of names lists the resident submodules exactly.

    Attributes:
        module: the offloaded module.
        device: normalized ``torch.device`` (CUDA always with an index).
        arena: the host arena holding the host copies.
        keep_encoder_resident: as given.
        resident_attrs: names of the resident submodules (empty unless ``keep_encoder_resident``).

    Raises:
        ValueError: a parameter requires grad (fix: ``module.requires_grad_(False)``); the module already
            has an offload attached; ``device`` is the meta device or a tensor is on it; a resident
            submodule name does not exist.
        RuntimeError: page-locking the arena failed (see :class:`~patches.core.host_arena.HostArena`).
    """

    def __init__(
        self,
        module: nn.Module,
        device: torch.device | str,
        *,
        keep_encoder_resident: bool = False,
        encoder_attr: str | tuple[str, ...] = "encoder",
    ) -> None:
        dev = torch.device(device)
        if dev.type == "meta":
            raise ValueError("VAEOffload device must be a real device ('cuda', 'cuda:N' or 'cpu'), not meta")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if getattr(module, OFFLOAD_ATTR, None) is not None:
            raise ValueError(
                f"{type(module).__name__} already has a VAEOffload attached: call "
                f"module.{OFFLOAD_ATTR}.remove() before attaching another"
            )
        trainable = [n for n, p in module.named_parameters() if p.requires_grad]
        if trainable:
            shown = ", ".join(trainable[:3]) + (", ..." if len(trainable) > 3 else "")
            raise ValueError(
                f"VAEOffload needs a frozen module, but {len(trainable)} parameter(s) require grad ({shown}): "
                "parking drops the device copy without copying it back, so updates would be lost; call "
                "module.requires_grad_(False) first (build_vae does)"
            )
        meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if meta:
            raise ValueError(f"VAEOffload cannot offload meta tensors ({meta[0]}, ...): materialize the module first")

        self.module = module
        self.device = dev
        self.keep_encoder_resident = keep_encoder_resident
        if not keep_encoder_resident:
            self.resident_attrs: tuple[str, ...] = ()
        elif isinstance(encoder_attr, str):
            extra = ("quant_conv",) if isinstance(getattr(module, "quant_conv", None), nn.Module) else ()
            self.resident_attrs = (encoder_attr, *extra)
        else:
            self.resident_attrs = tuple(encoder_attr)
        resident: list[nn.Module] = []
        for name in self.resident_attrs:
            sub = getattr(module, name, None)
            if not isinstance(sub, nn.Module):
                raise ValueError(
                    f"keep_encoder_resident: {type(module).__name__} has no submodule {name!r}; pass "
                    "encoder_attr naming the encoder submodule(s)"
                )
            resident.append(sub)
        resident_ids = {id(t) for m in resident for t in (*m.parameters(), *m.buffers())}

        # Parked tensors, each once (shared parameters/buffers are deduplicated by identity).
        sources: list[torch.Tensor] = []
        params: list[nn.Parameter | None] = []
        refs: list[list[tuple[nn.Module, str]]] = []
        for p in module.parameters():  # deduplicated by nn.Module
            if id(p) not in resident_ids:
                sources.append(p.data)
                params.append(p)
                refs.append([])
        buf_index: dict[int, int] = {}
        for m in module.modules():
            for name, b in m._buffers.items():
                if b is None or id(b) in resident_ids:
                    continue
                if id(b) not in buf_index:
                    buf_index[id(b)] = len(sources)
                    sources.append(b)
                    params.append(None)
                    refs.append([])
                refs[buf_index[id(b)]].append((m, name))

        self.arena = HostArena(
            [((t.numel(),), t.dtype) for t in sources], pin=dev.type == "cuda", name="vae_offload"
        )
        start = self.arena._buf.data_ptr()
        self._arena_range = (start, start + self.arena.nbytes) if self.arena.nbytes else (0, 0)
        self._slots: list[_Slot] = []
        for src, flat, p, r in zip(sources, self.arena.tensors, params, refs):
            if _dense_strides(src):
                host = flat.as_strided(src.shape, src.stride())  # keep the layout: identical kernels after unpark
            else:  # overlapping/gapped layouts (never in the Wan VAE) are stored contiguous
                host = flat.view(src.shape)
            host.copy_(src)
            self._slots.append(_Slot(host=host, param=p, buffer_refs=r))
        del sources  # drop our references to the original storage; _point_at_host() below drops the module's

        self._park_count = 0
        self._unpark_count = 0
        self._park_s = 0.0
        self._unpark_s = 0.0
        self._depth = 0
        self._removed = False
        self._parked = False
        for sub in resident:
            sub.to(dev)
        self._point_at_host()
        self._parked = True
        setattr(module, OFFLOAD_ATTR, self)

    # ------------------------------------------------------------------ state
    @property
    def parked(self) -> bool:
        """True while the parked tensors are their host copies (no device memory held for them)."""
        return self._parked

    @property
    def depth(self) -> int:
        """How many :meth:`on_device` blocks are open (0: parked)."""
        return self._depth

    @property
    def encode_path_resident(self) -> bool:
        """True when encoding needs no move (``keep_encoder_resident``)."""
        return self.keep_encoder_resident

    @property
    def num_tensors(self) -> int:
        """Number of parked tensors (parameters + buffers, shared ones counted once)."""
        return len(self._slots)

    @property
    def host_bytes(self) -> int:
        """Bytes of the host arena (parked tensors, each start aligned to 64 B)."""
        return self.arena.nbytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the arena that are page-locked (``host_bytes`` on CUDA, 0 without CUDA)."""
        return self.arena.pinned_bytes

    @property
    def device_bytes_when_unparked(self) -> int:
        """Bytes of parked tensors while unparked (tensor bytes; the CUDA allocator rounds blocks up to 512 B)."""
        return sum(s.nbytes for s in self._slots)

    @property
    def stats(self) -> dict[str, float | int]:
        """Counters: ``park_count``/``unpark_count`` (real moves only, idempotent no-ops excluded),
        ``park_seconds``/``unpark_seconds`` (total wall time in s, CUDA-synchronized), ``pinned_bytes``,
        ``host_bytes``, ``device_bytes_when_unparked`` (bytes), ``num_tensors``."""
        return {
            "park_count": self._park_count,
            "unpark_count": self._unpark_count,
            "park_seconds": self._park_s,
            "unpark_seconds": self._unpark_s,
            "pinned_bytes": self.pinned_bytes,
            "host_bytes": self.host_bytes,
            "device_bytes_when_unparked": self.device_bytes_when_unparked,
            "num_tensors": self.num_tensors,
        }

    def host_tensors(self) -> list[torch.Tensor]:
        """The persistent host copies (views into :attr:`arena`), in parking order."""
        return [s.host for s in self._slots]

    def in_arena(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s data lies inside the arena buffer (i.e. ``t`` is a host copy)."""
        lo, hi = self._arena_range
        return t.device.type == "cpu" and lo <= t.data_ptr() < hi

    # ------------------------------------------------------------------ moves
    def _assign(self, slot: _Slot, t: torch.Tensor) -> None:
        if slot.param is not None:
            slot.param.data = t
        for m, name in slot.buffer_refs:
            m._buffers[name] = t

    def _point_at_host(self) -> None:
        for slot in self._slots:
            self._assign(slot, slot.host)

    def _device_copy(self, host: torch.Tensor) -> torch.Tensor:
        """A new tensor on :attr:`device` with ``host``'s shape, stride and dtype, filled from ``host``.

        The copy is issued ``non_blocking`` on the current stream; :meth:`_unpark` waits for it.
        """
        out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
        out.copy_(host, non_blocking=True)
        return out

    def _unpark(self) -> None:
        """Put every parked tensor on :attr:`device` (one H2D copy each from the pinned host copy).

        Idempotent: a no-op while unparked. Returns after the copies completed (CUDA: the current stream
        is synchronized), so the device tensors are valid on every stream. All copies are made before any
        tensor is swapped, so an allocation failure (CUDA OOM) leaves the module parked and consistent.
        """
        if not self._parked:
            return
        _sync(self.device)
        t0 = time.perf_counter()
        copies = [self._device_copy(s.host) for s in self._slots]
        _sync(self.device)  # the copies are non_blocking: wait until the data is valid
        for slot, t in zip(self._slots, copies):
            self._assign(slot, t)
        self._parked = False
        self._unpark_s += time.perf_counter() - t0
        self._unpark_count += 1

    def _park(self) -> None:
        """Point every parked tensor back at its host copy, dropping the device storage.

        Nothing is copied back: the module is frozen, so the host copies are still exact. The freed
        device blocks return to PyTorch's caching allocator (no ``empty_cache``), where the training
        step can reuse them. Idempotent: a no-op while parked, and after :meth:`remove`.
        """
        if self._parked or self._removed:
            return
        _sync(self.device)
        t0 = time.perf_counter()
        self._point_at_host()
        self._parked = True
        _sync(self.device)
        self._park_s += time.perf_counter() - t0
        self._park_count += 1

    @contextlib.contextmanager
    def on_device(self, *, encode_only: bool = False) -> Iterator["VAEOffload"]:
        """The module on :attr:`device` inside the block: the one way to bring it there.

        Re-entrant, with one depth counter: entering at depth 0 unparks, leaving back to depth 0 parks
        (also when the body raises); nested blocks move nothing. If unparking fails (CUDA OOM) the module
        stays parked and the depth unchanged.

        Args:
            encode_only: the block only encodes; with ``keep_encoder_resident`` the encode path is
                already on the device, so nothing moves and the depth is not touched.
        """
        if encode_only and self.encode_path_resident:
            yield self
            return
        if self._depth == 0:
            self._unpark()
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._park()

    def remove(self) -> None:
        """Detach: leave the whole module resident on :attr:`device`, free the arena, clear the attribute.

        Raises:
            RuntimeError: called inside :meth:`on_device`.
        """
        if self._depth:
            raise RuntimeError("VAEOffload.remove() called inside on_device(): leave the context first")
        self._unpark()
        self._removed = True
        self._slots = []
        self._arena_range = (0, 0)
        self.arena.release()
        if getattr(self.module, OFFLOAD_ATTR, None) is self:
            delattr(self.module, OFFLOAD_ATTR)

    def __repr__(self) -> str:
        return (
            f"VAEOffload({type(self.module).__name__}, device={self.device}, parked={self._parked}, "
            f"tensors={self.num_tensors}, host={self.host_bytes / GiB:.3f} GiB, "
            f"pinned={self.pinned_bytes / GiB:.3f} GiB, resident={list(self.resident_attrs)})"
        )


def get_offload(module: nn.Module) -> VAEOffload | None:
    """The :class:`VAEOffload` attached to ``module``, or ``None``."""
    off = getattr(module, OFFLOAD_ATTR, None)
    return off if isinstance(off, VAEOffload) else None


def offload_from_env(
    vae: nn.Module,
    device: torch.device | str,
    *,
    environ: Mapping[str, str] | None = None,
    keep_encoder_resident: bool = False,
) -> VAEOffload | None:
    """Attach a :class:`VAEOffload` when ``COSMOS_VAE_CPU_OFFLOAD`` is on, else move ``vae`` to ``device``.

    Returns the offload, or ``None`` when the flag is off. Raises :class:`patches.core.flags.FlagError` on a
    malformed flag value, and what :class:`VAEOffload` raises.
    """
    from patches.core.flags import VAE_CPU_OFFLOAD

    if not VAE_CPU_OFFLOAD.value(dict(environ) if environ is not None else None):
        vae.to(device)
        return None
    return VAEOffload(vae, device, keep_encoder_resident=keep_encoder_resident)


# ---------------------------------------------------------------------- encoding
def _latent_stats(vae: nn.Module, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = vae.config
    c = like.shape[1]
    if len(cfg.latents_mean) != c or len(cfg.latents_std) != c:
        raise ValueError(
            f"vae.config latents_mean/latents_std have {len(cfg.latents_mean)}/{len(cfg.latents_std)} "
            f"entries but the posterior has {c} channels"
        )
    mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, c, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, c, 1, 1, 1)
    return mean.to(like.device, like.dtype), inv_std.to(like.device, like.dtype)


def encode_latents(vae: nn.Module, video: torch.Tensor) -> torch.Tensor:
    """Normalized Wan2.2 latents of ``video``: ``(mu - latents_mean) * (1 / latents_std)``, deterministic.

    The multiply by a precomputed inverse std is upstream's (``WanVAE`` scale tuple ``(mean, 1/std)``).

    ``mu`` is the posterior mean (no sampling); ``latents_mean``/``latents_std`` come from
    ``vae.config`` (48 channels for Wan2.2). Works with or without a :class:`VAEOffload` attached: with
    one, the encode runs inside ``on_device(encode_only=True)`` (so inside the trainer's per-micro-batch
    ``on_device()`` no second move happens; standalone it moves once for this call, or not at all when
    the encoder is resident). Runs under ``torch.no_grad()``.

    Args:
        vae: ``diffusers.AutoencoderKLWan`` (Wan2.2 configuration), frozen.
        video: ``[B, 3, T, H, W]`` pixels in [-1, 1], any float dtype/device; it is cast to the VAE's
            parameter dtype and device. ``T = 4n + 1``; ``H`` and ``W`` multiples of
            ``vae.config.scale_factor_spatial`` (16 for Wan2.2).

    Returns:
        ``[B, z_dim, (T - 1) // 4 + 1, H / 16, W / 16]`` (``z_dim`` 48) in the VAE's dtype, on its device.

    Raises:
        ValueError: ``video`` is not 5-D with 3 channels, ``T`` is not ``4n + 1`` (the Wan encoder would
            silently drop the trailing frames), or ``H``/``W`` are not multiples of the spatial factor.
    """
    if video.dim() != 5 or video.shape[1] != 3:
        raise ValueError(f"video must be [B, 3, T, H, W], got shape {tuple(video.shape)}")
    t, h, w = video.shape[2:]
    tf = int(getattr(vae.config, "scale_factor_temporal", 4))
    sf = int(getattr(vae.config, "scale_factor_spatial", 16))
    if (t - 1) % tf != 0:
        raise ValueError(
            f"video has T={t} frames; the Wan VAE needs T = {tf}n + 1 (it would silently drop "
            f"{(t - 1) % tf} trailing frame(s)): trim or pad the clip"
        )
    if h % sf or w % sf:
        raise ValueError(f"video H x W = {h} x {w} must be multiples of {sf} (Wan2.2 spatial compression)")
    off = get_offload(vae)
    ctx = off.on_device(encode_only=True) if off is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        ref = next(vae.parameters())  # first parameter of the encoder: on device while encoding
        x = video.to(device=ref.device, dtype=ref.dtype)
        mu = vae.encode(x).latent_dist.mean
        mean, inv_std = _latent_stats(vae, mu)
        return (mu - mean) * inv_std


# ---------------------------------------------------------------------- proofs and benchmarks
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
