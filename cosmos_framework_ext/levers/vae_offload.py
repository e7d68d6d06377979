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
copy is still exact), it only drops the device storage, so a round trip costs one H2D transfer out of pinned
memory, instead of ``module.to("cpu")``/``.to("cuda")`` through pageable memory both ways.

The trainer unparks once per micro-batch, around all of that micro-batch's encodes::

    offload = VAEOffload(vae, "cuda")          # attaches itself as vae._onecard_offload
    with offload.on_device():                  # one H2D transfer
        for clip in micro_batch:
            latents = encode_latents(vae, clip)  # nested on_device(): no second move
    # parked again here, also when the body raised

Like accelerate's hooks, the lever is an object attached to the module (``module._onecard_offload``);
code that encodes looks it up (``cosmos_framework_ext.recipe.vae.encode_latents`` does) instead of branching
on a flag.

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
import time
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from patches.core.host_arena import HostArena
from patches.core.runtime import GiB

__all__ = ["OFFLOAD_ATTR", "VAEOffload", "get_offload", "offload_from_env"]

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
