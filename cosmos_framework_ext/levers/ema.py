"""EMA for the Cosmos3-Edge recipe: the power-function schedule and ONE EMA object whose placement is config.

Schedule (upstream ``OmniMoTModel.ema_beta``; the power EMA of Karras et al., EDM2, 2024, with
``rate`` = sigma_rel): gamma is the largest real root of
``gamma^3 + 7 gamma^2 + (16 - s^-2) gamma + (12 - s^-2) = 0`` (equivalently
``sigma_rel^2 = (gamma+1) / ((gamma+2)^2 (gamma+3))``), and for the trainer's iteration ``i`` *before*
its increment, ``beta(i) = 0 if i < 1 else (1 - 1/(i+1))^(gamma+1)``. The update runs after the optimizer
step: ``ema = ema * beta + (1 - beta) * param``, as ``_foreach_mul_(beta)`` then
``_foreach_add_(param, alpha=1-beta)``.

:class:`EMA` holds the model it was built for and speaks diffusers' ``EMAModel`` verbs (``step``,
``copy_to``, ``store``, ``restore``, ``state_dict``, ``load_state_dict``) plus ``synchronize``,
``ema_scope`` and ``close``. Where the EMA lives is its ``placement``:

- ``"device"`` -- upstream's ``DTensorFastEmaModelUpdater`` behaviour: a full fp32 clone of every
  parameter on the parameters' device (12.5 GiB for the Edge tower), updated over all parameters
  (:class:`DevicePlacement`).
- ``"cpu_subset"`` -- lever 1 (``COSMOS_EMA_CPU_SUBSET=1``): fp32 EMA of the trainable subset only, in one
  exact-size pinned host arena. The device->host copy of the new parameter values is issued
  asynchronously on a side stream, gated on a CUDA event recorded after the optimizer step; the host
  lerp runs on a worker thread, overlapped with the next micro-batches, and is joined before the next
  update or any read; an optimizer pre-step hook (:meth:`EMA.attach_optimizer`) keeps the optimizer from
  writing parameters still being copied (:class:`CpuSubsetPlacement`). Same operations, same order,
  same fp32 arithmetic as ``"device"``: trainable entries are bit-exact. Frozen entries are reported as
  ``net`` cast to fp32 -- exactly what a perfect EMA of a constant is (the full clone drifts from it by
  fp32 rounding, at most ~2e-6 after 200 updates).

:meth:`EMA.state_dict` is ``{"num_updates": n, "shadow": {canonical key: fp32 host tensor}}`` with one
entry for every key of ``model.state_dict()``; the trainer stores the shadow as upstream's
``net_ema.<k>`` checkpoint entries.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from patches.core.host_arena import HostArena
from patches.core.io import alias_bytes
from patches.core.streamsave import Deferred
from patches.core.threads import thread_pool
from patches.core.runtime import as_dtensor, shard_of, to_local

_STRIP = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """``name`` with the wrapper segments torch.compile / activation checkpointing / FSDP1 insert removed."""
    for seg in _STRIP:
        name = name.replace(seg, "")
    return name


def power_ema_gamma(rate: float) -> float:
    """gamma of the power EMA for ``rate`` (sigma_rel), the largest real root of the cubic above.

    Raises:
        ValueError: ``rate`` is not in (0, 0.28) (beyond ~0.28 the cubic has no positive root).
    """
    if not 0.0 < rate < 0.28:
        raise ValueError(f"EMA rate {rate} is outside (0, 0.28): use the recipe's 0.1 or a value in range")
    s2 = rate ** -2
    roots = np.roots([1.0, 7.0, 16.0 - s2, 12.0 - s2])
    return float(roots.real.max())


def power_ema_beta(iteration: int, gamma: float, iteration_shift: int = 0) -> float:
    """beta for the update after the optimizer step of trainer iteration ``iteration`` (before increment)."""
    i = iteration + iteration_shift
    if i < 1:
        return 0.0
    return (1.0 - 1.0 / (i + 1)) ** (gamma + 1)


def _lerp_(targets: list[torch.Tensor], sources: list[torch.Tensor], beta: float) -> None:
    """The stock update, in place: ``targets = targets * beta + sources * (1 - beta)`` (fp32 targets)."""
    torch._foreach_mul_(targets, beta)
    torch._foreach_add_(targets, sources, alpha=1.0 - beta)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a new host tensor: float32 if floating, else in its own dtype (an EMA entry's saved form)."""
    t = t.detach()
    return t.to("cpu", torch.float32, copy=True) if t.is_floating_point() else t.to("cpu", copy=True)


def _host_piece(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of :func:`_host_copy` ``(t)`` (row-major), made from that slice of ``t`` alone."""
    return _host_copy(t.detach().reshape(-1)[start:stop])


def _deferred_host_copy(t: torch.Tensor, shape: Any) -> Deferred:
    """:func:`_host_copy` ``(t)`` made only as the save writes it; piece by piece where ``t`` is contiguous (a
    non-contiguous ``t`` would be copied whole by the reshape of every piece)."""
    dtype = torch.float32 if t.is_floating_point() else t.dtype
    piece = functools.partial(_host_piece, t) if t.is_contiguous() else None
    return Deferred(shape, dtype, functools.partial(_host_copy, t), piece)


def _host_fp32(t: torch.Tensor) -> bool:
    """Whether ``t`` is a float32 host tensor (saved as it is: nothing to convert or move)."""
    return t.device.type == "cpu" and t.dtype == torch.float32


# ------------------------------------------------------------------------------------------ placements
class Placement:
    """Where an :class:`EMA`'s fp32 shadow lives and how it is updated (one per ``placement`` name).

    Args:
        sources: the tracked parameters' local tensors (detached), in tracking order.
        pin: page-lock host buffers when CUDA is present (host placements only).
        chunk_numel: elements upcast to fp32 at a time in a host lerp (host placements only).
        threads: intra-op CPU threads of the host lerp's worker thread (``None``: PyTorch's default, one per core;
            :func:`patches.core.threads.cap_this_thread`; host placements only). The values do not depend on it.

    Attributes:
        shadow: the fp32 EMA, one tensor per source.
        store_device: where :meth:`EMA.store` keeps its copy (``None``: beside the parameter).
    """

    name = ""
    store_device: str | None = None

    def __init__(self, sources: list[torch.Tensor], *, pin: bool = True, chunk_numel: int = 1 << 25,
                 threads: int | None = None):
        self.shadow: list[torch.Tensor] = []

    @classmethod
    def select(cls, params: dict[str, nn.Parameter], trainable: list[str] | None) -> list[str]:
        """The parameter names this placement tracks (every parameter by default)."""
        return list(params)

    def update(self, sources: list[torch.Tensor], beta: float) -> None:
        """``shadow = shadow * beta + (1 - beta) * sources`` (possibly queued)."""
        raise NotImplementedError

    def synchronize(self) -> float:
        """Block until every queued update is in :attr:`shadow`; returns the seconds waited."""
        return 0.0

    def before_optimizer_step(self) -> None:
        """Called before the optimizer writes the parameters (see :meth:`EMA.attach_optimizer`)."""

    @property
    def host_bytes(self) -> int:
        return 0

    @property
    def pinned_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Release what the placement holds."""


class DevicePlacement(Placement):
    """Upstream's EMA: a full fp32 clone of every parameter, on the parameters' device.

    Memory: 4 bytes x all parameters on the device (12.52 GiB for the 3.36 B Edge tower). The update is
    on the training stream; on CUDA :meth:`update` returns once it has run (it is on the critical path).
    """

    name = "device"

    def __init__(self, sources: list[torch.Tensor], *, pin: bool = True, chunk_numel: int = 1 << 25,
                 threads: int | None = None):
        super().__init__(sources)
        self.shadow = [s.to(torch.float32).clone() for s in sources]
        self.device = sources[0].device if sources else torch.device("cpu")

    def update(self, sources: list[torch.Tensor], beta: float) -> None:
        _lerp_(self.shadow, sources, beta)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class _CopyHandle:
    """A pending device->host copy: :meth:`wait` returns once the staging buffers hold the data."""

    def __init__(self, event: "torch.cuda.Event | None" = None, waiter: Callable[[], None] | None = None):
        self._event = event
        self._waiter = waiter

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        if self._waiter is not None:
            self._waiter()


class CpuSubsetPlacement(Placement):
    """Lever 1: fp32 EMA of the trainable parameters only, in pinned host memory, updated off-thread.

    Memory: 4 bytes x trainable parameters of page-locked host memory for the EMA plus one staging copy in the
    parameters' dtype; nothing on the GPU. Allocation is exact (see :class:`patches.core.host_arena.HostArena`).

    Time per optimizer step on the critical path: issuing the asynchronous copies plus, on the *next* update, any
    part of the host lerp that the intervening micro-batches did not hide (``docs/levers/ema.md`` has the
    measured figures).
    """

    name = "cpu_subset"
    store_device = "cpu"

    def __init__(self, sources: list[torch.Tensor], *, pin: bool = True, chunk_numel: int = 1 << 25,
                 threads: int | None = None):
        super().__init__(sources)
        self.device = sources[0].device
        self._ema_arena = HostArena([(t.shape, torch.float32) for t in sources], pin=pin, name="ema")
        self.shadow = self._ema_arena.tensors
        # The worker reads only the staging copy, never the live parameters, so the optimizer may write
        # them as soon as the copy (not the lerp) is done.
        self._staging_arena = HostArena([(t.shape, t.dtype) for t in sources], pin=pin, name="ema-staging")
        self.staging = self._staging_arena.tensors
        with torch.no_grad():
            for s, t in zip(self.shadow, sources):
                s.copy_(t)
        self.chunk_numel = chunk_numel
        self._pool = thread_pool(1, "onecard-ema", threads)
        self._pending: concurrent.futures.Future | None = None
        self._copy_done: "torch.cuda.Event | None" = None
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._lock = threading.Lock()
        self.last_issue_s = 0.0

    @classmethod
    def select(cls, params: dict[str, nn.Parameter], trainable: list[str] | None) -> list[str]:
        """``trainable``, or the parameters with ``requires_grad``; refuses an empty selection."""
        if trainable is None:
            trainable = [n for n, p in params.items() if p.requires_grad]
        if not trainable:
            raise ValueError(
                "the CPU-subset EMA has no trainable parameter to track: keys_to_select is empty or matches "
                "nothing; fix [optimizer].keys_to_select or unset COSMOS_EMA_CPU_SUBSET"
            )
        return list(trainable)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes held (EMA + staging)."""
        return self._ema_arena.pinned_bytes + self._staging_arena.pinned_bytes

    @property
    def host_bytes(self) -> int:
        """Host bytes held (EMA + staging), pinned or not."""
        return self._ema_arena.nbytes + self._staging_arena.nbytes

    def _issue_copies(self, sources: list[torch.Tensor]) -> _CopyHandle:
        """Start copying ``sources`` into the staging buffers; the handle's ``wait`` gates reading them."""
        if self._copy_stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # after the optimizer step on the current stream
            done = torch.cuda.Event()
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(ready)
                for dst, src in zip(self.staging, sources):
                    dst.copy_(src, non_blocking=True)
                done.record()
            self._copy_done = done
            return _CopyHandle(event=done)
        for dst, src in zip(self.staging, sources):
            dst.copy_(src)
        return _CopyHandle()

    def _host_lerp(self, handle: _CopyHandle, beta: float) -> None:
        handle.wait()
        chunk_t: list[torch.Tensor] = []
        chunk_s: list[torch.Tensor] = []
        numel = 0
        for t, s in zip(self.shadow, self.staging):
            chunk_t.append(t)
            chunk_s.append(s)
            numel += t.numel()
            if numel >= self.chunk_numel:
                _lerp_(chunk_t, [x.to(torch.float32) for x in chunk_s], beta)
                chunk_t, chunk_s, numel = [], [], 0
        if chunk_t:
            _lerp_(chunk_t, [x.to(torch.float32) for x in chunk_s], beta)

    def update(self, sources: list[torch.Tensor], beta: float) -> None:
        """Join the previous lerp, start the copy (after the optimizer step), queue the lerp, return."""
        self.synchronize()
        t0 = time.perf_counter()
        handle = self._issue_copies(sources)
        self.last_issue_s = time.perf_counter() - t0
        self._pending = self._pool.submit(self._host_lerp, handle, beta)

    def synchronize(self) -> float:
        """Block until the last queued update is in the host buffers; re-raises what the worker raised."""
        t0 = time.perf_counter()
        with self._lock:
            fut, self._pending = self._pending, None
        if fut is not None:
            fut.result()
        return time.perf_counter() - t0

    def before_optimizer_step(self) -> None:
        """Make the current CUDA stream wait (on the GPU, not the host) for the last copy's event."""
        if self._copy_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copy_done)

    def close(self) -> None:
        """Join the worker and release the host arenas."""
        self.synchronize()
        self._pool.shutdown(wait=True)
        self._ema_arena.release()
        self._staging_arena.release()


PLACEMENTS: dict[str, type[Placement]] = {p.name: p for p in (DevicePlacement, CpuSubsetPlacement)}
"""Placement name -> strategy class."""


# ------------------------------------------------------------------------------------------------ EMA
class EMA:
    """The fp32 power EMA of ``model``; where it lives is ``placement`` (see the module docstring).

    Args:
        model: the network (its parameters may be FSDP2 DTensors; the local shards are tracked). The EMA
            holds it: every verb acts on it.
        placement: ``"device"`` (upstream's full fp32 clone) or ``"cpu_subset"`` (lever 1), or a
            :class:`Placement` subclass.
        trainable: names (as in ``model.named_parameters()``) the ``cpu_subset`` placement tracks; by
            default the ones with ``requires_grad``. ``device`` tracks every parameter, as upstream.
        pin: page-lock host buffers when CUDA is present.
        chunk_numel: elements upcast to fp32 at a time in a host lerp (bounds the temporary memory).
        threads: intra-op CPU threads of ``cpu_subset``'s host lerp (``None``: PyTorch's default); the same values.

    Attributes:
        num_updates: updates applied (checkpointed with the shadow).
        last_beta: beta of the last update (0.0 before any).
        placement: the placement's name.

    Raises:
        ValueError: an unknown placement; ``cpu_subset`` with no trainable parameter (empty
            ``keys_to_select``, or keys that match nothing); trainable names not in the model.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        placement: str | type[Placement] = "device",
        trainable: list[str] | None = None,
        pin: bool = True,
        chunk_numel: int = 1 << 25,
        threads: int | None = None,
    ):
        if isinstance(placement, str):
            if placement not in PLACEMENTS:
                raise ValueError(f"EMA placement {placement!r} is not one of {sorted(PLACEMENTS)}")
            placement = PLACEMENTS[placement]
        params = dict(model.named_parameters())
        names = placement.select(params, trainable)
        unknown = [n for n in names if n not in params]
        if unknown:
            raise ValueError(f"trainable names not in the model: {unknown[:5]}")
        self.model = model
        self.names = names
        self.canonical = [canonical_name(n) for n in names]
        # (mesh, placements, global shape, global stride) of each tracked parameter: a shard's place in the whole
        self._meta = [(getattr(params[n], "device_mesh", None), getattr(params[n], "placements", None),
                       tuple(params[n].shape), tuple(params[n].stride())) for n in names]
        self._impl = placement(self._sources(), pin=pin, chunk_numel=chunk_numel, threads=threads)
        self.placement = placement.name
        self.num_updates = 0
        self.last_beta = 0.0
        self._stored: list[torch.Tensor] | None = None

    # ---------------------------------------------------------------- bookkeeping
    @property
    def shadow(self) -> list[torch.Tensor]:
        """The fp32 EMA of the tracked parameters (local shards), in tracking order."""
        return self._impl.shadow

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes held."""
        return self._impl.pinned_bytes

    @property
    def host_bytes(self) -> int:
        """Host bytes held, pinned or not."""
        return self._impl.host_bytes

    def _sources(self) -> list[torch.Tensor]:
        params = dict(self.model.named_parameters())
        return [to_local(params[n]).detach() for n in self.names]

    # ---------------------------------------------------------------- the update
    @torch.no_grad()
    def step(self, beta: float) -> None:
        """``ema = ema * beta + (1 - beta) * param`` over the tracked parameters; call after ``optimizer.step()``.

        ``cpu_subset`` queues the update and returns: the copy starts once the work queued on the current
        CUDA stream so far (the optimizer step) is done; the lerp runs on the worker thread.
        """
        self._impl.update(self._sources(), beta)
        self.num_updates += 1
        self.last_beta = beta

    def synchronize(self) -> float:
        """Block until every queued update is in the shadow; returns the seconds waited.

        Raises:
            Exception: whatever a background update raised.
        """
        return self._impl.synchronize()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """Register the placement's optimizer step pre-hook; returns the hook handle.

        For ``cpu_subset`` the hook makes the current CUDA stream wait (on the GPU, not the host) for the
        last copy's event, so the optimizer never writes parameters still being copied.
        """
        return optimizer.register_step_pre_hook(lambda *_a, **_k: self._impl.before_optimizer_step())

    # ---------------------------------------------------------------- reads
    @torch.no_grad()
    def copy_to(self) -> None:
        """Write the EMA into the tracked parameters (cast to their dtype); others are untouched."""
        self.synchronize()
        for s, p in zip(self.shadow, self._sources()):
            p.copy_(s, non_blocking=False)

    @torch.no_grad()
    def store(self) -> None:
        """Keep a copy of the tracked parameters for :meth:`restore` (on the host for ``cpu_subset``)."""
        dev = self._impl.store_device
        self._stored = [p.to(dev or p.device, copy=True) for p in self._sources()]

    @torch.no_grad()
    def restore(self) -> None:
        """Put back the parameters saved by :meth:`store`, bit-exact."""
        if self._stored is None:
            raise RuntimeError("restore() without store(): call store() first")
        for s, p in zip(self._stored, self._sources()):
            p.copy_(s)
        self._stored = None

    @contextlib.contextmanager
    def ema_scope(self) -> Iterator[None]:
        """Within the block the tracked parameters hold the EMA; on exit they are restored bit-exact."""
        self.store()
        try:
            self.copy_to()
            yield
        finally:
            self.restore()

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"num_updates": n, "shadow": {canonical key: fp32 host tensor}}``, local shards.

        The shadow has one entry for every key of ``model.state_dict()``: tracked keys hold the EMA, other
        parameters ``net`` cast to fp32, floating buffers cast to fp32, other buffers as they are.
        """
        return {"num_updates": self.num_updates, "shadow": self._entries(full=False)}

    def full_state_dict(self, copy: bool = True) -> dict[str, Any]:
        """:meth:`state_dict` with sharded entries gathered into full tensors (a collective: call on every rank).

        ``copy=False`` (world size 1, for a save): fp32 host tensors are not copied: the shadow's own buffers, and an
        untracked entry (the net's fp32 host value) as a new tensor over the same bytes
        (:func:`patches.core.io.alias_bytes`), so a file saved from it holds separate ``net.<k>`` and
        ``net_ema.<k>`` as before; anything else (a bf16 or GPU weight, a GPU shadow) is a
        :class:`patches.core.streamsave.Deferred` that makes its fp32 host copy only as
        :func:`patches.core.io.atomic_torch_save` writes it, a piece of at most
        :data:`patches.core.streamsave.CHUNK_BYTES` at a time, so the save never holds all of them at once (7.25 GiB
        for Cosmos3-Edge's frozen weights at bf16), nor one whole (1 GiB for ``embed_tokens``). Only for such a save:
        the entries are not tensors.
        """
        return {"num_updates": self.num_updates, "shadow": self._entries(full=True, copy=copy)}

    @torch.no_grad()
    def _entries(self, full: bool, copy: bool = True) -> dict[str, torch.Tensor]:
        self.synchronize()
        ema = dict(zip(self.canonical, zip(self.shadow, self._meta)))
        out: dict[str, torch.Tensor] = {}
        for k, v in self.model.state_dict().items():
            ck = canonical_name(k)
            if ck in ema:
                buf, (mesh, placements, shape, stride) = ema[ck]
                if not copy and _host_fp32(buf) and tuple(buf.shape) == tuple(shape):  # world size 1: the whole tensor
                    out[ck] = buf.detach()
                elif not copy and tuple(buf.shape) == tuple(shape):
                    out[ck] = _deferred_host_copy(buf, shape)
                elif full and mesh is not None:
                    # the global shape and stride, so uneven shards (7 rows on 2 ranks, 1 row on 2) gather right
                    out[ck] = as_dtensor(buf, mesh, placements, shape, stride).full_tensor().cpu()
                else:
                    out[ck] = buf.detach().to("cpu", torch.float32, copy=True)
            else:
                if full and hasattr(v, "full_tensor"):
                    v = v.full_tensor()
                v = to_local(v).detach()
                if not copy and _host_fp32(v):
                    out[ck] = alias_bytes(v)
                elif not copy:  # converted only as the save writes it: never all of them in host memory at once
                    out[ck] = _deferred_host_copy(v, v.shape)
                else:
                    out[ck] = (v.to("cpu", torch.float32, copy=True) if v.is_floating_point()
                               else v.to("cpu", copy=True))
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> int:
        """Restore the counter and the shadow (by canonical name); returns how many tracked tensors were loaded.

        Shadow keys may carry ``_orig_mod.`` etc. Entries for untracked keys are ignored (they are ``net``
        by definition); nothing is ever written into the model. An entry may be this rank's shard (what
        :meth:`state_dict` gives) or the full tensor (what :meth:`full_state_dict` gives); a full tensor is
        sliced to this rank's shard locally (:func:`patches.core.runtime.shard_of`), with no collective, so a
        rank whose shard is empty or already whole does what the others do.

        Raises:
            ValueError: ``state`` is not ``{"num_updates": ..., "shadow": {...}}``, or an entry is neither the
                full tensor nor this rank's shard.
        """
        if not isinstance(state, dict) or "num_updates" not in state or "shadow" not in state:
            raise ValueError("EMA.load_state_dict needs {'num_updates': int, 'shadow': {key: tensor}} "
                             "(what EMA.state_dict returns)")
        self.synchronize()
        by_canon = {canonical_name(k): v for k, v in state["shadow"].items()}
        n = 0
        for ck, buf, (mesh, placements, shape, _) in zip(self.canonical, self.shadow, self._meta):
            v = by_canon.get(ck)
            if v is None:
                continue
            v = to_local(v)
            if tuple(v.shape) == shape:  # the full tensor: this rank's slice of it (the tensor itself unsharded)
                v = shard_of(v, mesh, placements)
            elif v.shape != buf.shape:
                raise ValueError(f"EMA entry {ck} has shape {tuple(v.shape)}; expected the full {shape} or this "
                                 f"rank's shard {tuple(buf.shape)}")
            buf.copy_(v)
            n += 1
        self.num_updates = int(state["num_updates"])
        return n

    def close(self) -> None:
        """Join any background update and release the placement's buffers."""
        self.synchronize()
        self._impl.close()
