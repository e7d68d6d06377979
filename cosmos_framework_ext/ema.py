"""EMA for the Cosmos3-Edge recipe: the power-function schedule, the stock updater, and lever 1.

Schedule (upstream ``OmniMoTModel.ema_beta``; the power EMA of Karras et al., EDM2, 2024, with
``rate`` = sigma_rel): gamma is the largest real root of
``gamma^3 + 7 gamma^2 + (16 - s^-2) gamma + (12 - s^-2) = 0`` (equivalently
``sigma_rel^2 = (gamma+1) / ((gamma+2)^2 (gamma+3))``), and for the trainer's iteration ``i`` *before*
its increment, ``beta(i) = 0 if i < 1 else (1 - 1/(i+1))^(gamma+1)``. The update runs after the optimizer
step: ``ema = ema * beta + (1 - beta) * param``, as ``_foreach_mul_(beta)`` then
``_foreach_add_(param, alpha=1-beta)``.

Two updaters share the verbs of diffusers' ``EMAModel`` (``step``, ``copy_to``, ``store``, ``restore``,
``state_dict``, ``load_state_dict``):

- :class:`StockEMA` -- upstream's ``DTensorFastEmaModelUpdater`` behaviour: a full fp32 clone of every
  parameter on the model's device (12.5 GiB for the Edge tower), updated over all parameters.
- :class:`CpuSubsetEMA` -- lever 1 (``COSMOS_EMA_CPU_SUBSET=1``): fp32 EMA of the trainable subset only,
  in one exact-size pinned host arena. The device->host copy of the new parameter values is issued
  asynchronously on a side stream, gated on a CUDA event recorded after the optimizer step; the host
  lerp runs on a worker thread, overlapped with the next micro-batches, and is joined before the next
  update or any read. Same operations, same order, same fp32 arithmetic as stock: trainable entries are
  bit-exact. Frozen entries are reported as ``net`` cast to fp32 -- exactly what a perfect EMA of a
  constant is (the stock updater drifts from it by fp32 rounding, at most ~2e-6 after 200 updates).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn

from patches.core.host_arena import HostArena

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


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 parameter), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _lerp_(targets: list[torch.Tensor], sources: list[torch.Tensor], beta: float) -> None:
    """The stock update, in place: ``targets = targets * beta + sources * (1 - beta)`` (fp32 targets)."""
    torch._foreach_mul_(targets, beta)
    torch._foreach_add_(targets, sources, alpha=1.0 - beta)


class StockEMA:
    """Upstream's EMA: a full fp32 clone of every parameter, on the parameters' device.

    Memory: 4 bytes x all parameters on the device (12.52 GiB for the 3.36 B Edge tower).

    Args:
        model: the network; its parameters (local shards for DTensors) are cloned as fp32.
    """

    def __init__(self, model: nn.Module):
        self.names = [n for n, _ in model.named_parameters()]
        self.shadow = [_local(p).detach().to(torch.float32).clone() for p in model.parameters()]
        self.num_updates = 0
        self._stored: list[torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, model: nn.Module, beta: float) -> None:
        """``ema = ema * beta + (1 - beta) * param`` over all parameters (upstream ``update_average``)."""
        _lerp_(self.shadow, [_local(p).detach() for p in model.parameters()], beta)
        self.num_updates += 1

    def synchronize(self) -> None:
        """Nothing runs in the background; present for symmetry with :class:`CpuSubsetEMA`."""

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Write the EMA into the model's parameters (cast to each parameter's dtype)."""
        for s, p in zip(self.shadow, model.parameters()):
            _local(p).data.copy_(s)

    @torch.no_grad()
    def store(self, model: nn.Module) -> None:
        """Keep a copy of the model's parameters for :meth:`restore` (on their device, like upstream)."""
        self._stored = [_local(p).detach().clone() for p in model.parameters()]

    @torch.no_grad()
    def restore(self, model: nn.Module) -> None:
        """Put back the parameters saved by :meth:`store`."""
        if self._stored is None:
            raise RuntimeError("restore() without store(): call store(model) first")
        for s, p in zip(self._stored, model.parameters()):
            _local(p).data.copy_(s)
        self._stored = None

    @torch.no_grad()
    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """``{key: fp32 tensor}`` for every key of ``model.state_dict()`` (canonical names)."""
        shadow = {canonical_name(n): s for n, s in zip(self.names, self.shadow)}
        out = {}
        for k, v in model.state_dict().items():
            ck = canonical_name(k)
            src = shadow.get(ck, _local(v))
            out[ck] = src.detach().to("cpu", torch.float32, copy=True) if src.is_floating_point() else src.cpu()
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> int:
        """Load EMA values by canonical name; returns how many tensors were loaded."""
        n = 0
        for name, s in zip(self.names, self.shadow):
            v = state.get(canonical_name(name))
            if v is not None:
                s.copy_(v)
                n += 1
        return n


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


class CpuSubsetEMA:
    """Lever 1: fp32 EMA of the trainable parameters only, in pinned host memory, updated off-thread.

    Memory: 4 bytes x trainable parameters of page-locked host memory for the EMA (5.66 GB for the
    1.415 B Edge subset) plus one staging copy in the parameters' dtype (2.83 GB in bf16); nothing on the
    GPU. Allocation is exact (see :class:`patches.core.host_arena.HostArena`); :attr:`pinned_bytes` reports it.

    Timing per optimizer step on the critical path: issuing the asynchronous copies (~4 ms on an H200)
    plus, on the *next* update, any part of the host lerp (0.7-1.0 s for 1.415 B parameters) that the
    intervening micro-batches did not hide.

    Args:
        model: the network (its parameters may be FSDP2 DTensors; the local shards are used).
        trainable: names (as in ``model.named_parameters()``) of the parameters to track; by default the
            ones with ``requires_grad``.
        pin: page-lock the host buffers when CUDA is present.
        chunk_numel: elements upcast to fp32 at a time in the host lerp (bounds the temporary memory).

    Raises:
        ValueError: no trainable parameter (empty ``keys_to_select``, or keys that match nothing).
    """

    def __init__(
        self,
        model: nn.Module,
        trainable: list[str] | None = None,
        *,
        pin: bool = True,
        chunk_numel: int = 1 << 25,
    ):
        params = dict(model.named_parameters())
        if trainable is None:
            trainable = [n for n, p in params.items() if p.requires_grad]
        if not trainable:
            raise ValueError(
                "CpuSubsetEMA has no trainable parameter to track: keys_to_select is empty or matches nothing; "
                "fix [optimizer].keys_to_select or unset COSMOS_EMA_CPU_SUBSET"
            )
        unknown = [n for n in trainable if n not in params]
        if unknown:
            raise ValueError(f"trainable names not in the model: {unknown[:5]}")
        self.names = list(trainable)
        self.canonical = [canonical_name(n) for n in self.names]
        locals_ = [_local(params[n]).detach() for n in self.names]
        self._meta = [
            (getattr(params[n], "device_mesh", None), getattr(params[n], "placements", None)) for n in self.names
        ]
        self.param_dtype = locals_[0].dtype
        self.device = locals_[0].device
        self._ema_arena = HostArena([(t.shape, torch.float32) for t in locals_], pin=pin, name="ema")
        self.shadow = self._ema_arena.tensors
        # The worker reads only the staging copy, never the live parameters, so the optimizer may write
        # them as soon as the copy (not the lerp) is done.
        self._staging_arena = HostArena([(t.shape, t.dtype) for t in locals_], pin=pin, name="ema-staging")
        self.staging = self._staging_arena.tensors
        with torch.no_grad():
            for s, t in zip(self.shadow, locals_):
                s.copy_(t)
        self.chunk_numel = chunk_numel
        self.num_updates = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="onecard-ema")
        self._pending: concurrent.futures.Future | None = None
        self._copy_done: "torch.cuda.Event | None" = None
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._stored: list[torch.Tensor] | None = None
        self._lock = threading.Lock()
        self.last_issue_s = 0.0

    # ---------------------------------------------------------------- bookkeeping
    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes held (EMA + staging)."""
        return self._ema_arena.pinned_bytes + self._staging_arena.pinned_bytes

    @property
    def host_bytes(self) -> int:
        """Host bytes held (EMA + staging), pinned or not."""
        return self._ema_arena.nbytes + self._staging_arena.nbytes

    def _params(self, model: nn.Module) -> list[torch.Tensor]:
        params = dict(model.named_parameters())
        return [_local(params[n]).detach() for n in self.names]

    # ---------------------------------------------------------------- the update
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

    @torch.no_grad()
    def step(self, model: nn.Module, beta: float) -> None:
        """Queue ``ema = ema * beta + (1 - beta) * param`` for the trainable subset and return.

        Call after ``optimizer.step()``. The copy starts once the work queued on the current CUDA stream
        so far (the optimizer step) is done; the lerp runs on the worker thread. Before the optimizer
        next writes the parameters, :meth:`attach_optimizer`'s hook makes the stream wait for the copy.
        """
        import time

        self.synchronize()
        t0 = time.perf_counter()
        sources = self._params(model)
        handle = self._issue_copies(sources)
        self.last_issue_s = time.perf_counter() - t0
        self._pending = self._pool.submit(self._host_lerp, handle, beta)
        self.num_updates += 1

    def synchronize(self) -> float:
        """Block until the last queued update is in the host buffers; returns the seconds waited.

        Raises:
            Exception: whatever the worker raised.
        """
        import time

        t0 = time.perf_counter()
        with self._lock:
            fut, self._pending = self._pending, None
        if fut is not None:
            fut.result()
        return time.perf_counter() - t0

    def attach_optimizer(self, optimizer: torch.optim.Optimizer):
        """Register a step pre-hook that keeps the optimizer from writing parameters still being copied.

        The hook makes the current CUDA stream wait (on the GPU, not the host) for the last copy's event.
        Returns the hook handle.
        """

        def _pre_step(*_args, **_kwargs):
            if self._copy_done is not None:
                torch.cuda.current_stream(self.device).wait_event(self._copy_done)

        return optimizer.register_step_pre_hook(_pre_step)

    # ---------------------------------------------------------------- reads
    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Write the EMA into the trainable parameters (cast to their dtype); frozen ones are untouched."""
        self.synchronize()
        for s, p in zip(self.shadow, self._params(model)):
            p.copy_(s, non_blocking=False)

    @torch.no_grad()
    def store(self, model: nn.Module) -> None:
        """Keep a host copy of the trainable parameters for :meth:`restore` (no device memory used)."""
        self._stored = [p.to("cpu", copy=True) for p in self._params(model)]

    @torch.no_grad()
    def restore(self, model: nn.Module) -> None:
        """Put back the trainable parameters saved by :meth:`store`, bit-exact."""
        if self._stored is None:
            raise RuntimeError("restore() without store(): call store(model) first")
        for s, p in zip(self._stored, self._params(model)):
            p.copy_(s)
        self._stored = None

    @contextlib.contextmanager
    def ema_scope(self, model: nn.Module) -> Iterator[None]:
        """Within the block the trainable parameters hold the EMA; on exit they are restored bit-exact."""
        self.store(model)
        try:
            self.copy_to(model)
            yield
        finally:
            self.restore(model)

    @torch.no_grad()
    def state_dict(self, model: nn.Module, full: bool = False) -> dict[str, torch.Tensor]:
        """``{canonical key: fp32 host tensor}`` for every key of ``model.state_dict()``.

        Trainable keys: the EMA; frozen parameters: ``net`` cast to fp32; floating buffers cast to fp32,
        other buffers as they are. With ``full=True`` and sharded parameters, EMA entries are gathered
        into full tensors (a collective: every rank must call it).
        """
        self.synchronize()
        ema = dict(zip(self.canonical, zip(self.shadow, self._meta)))
        out: dict[str, torch.Tensor] = {}
        for k, v in model.state_dict().items():
            ck = canonical_name(k)
            if ck in ema:
                buf, (mesh, placements) = ema[ck]
                if full and mesh is not None:
                    from torch.distributed.tensor import DTensor

                    dev = torch.device(mesh.device_type)
                    out[ck] = DTensor.from_local(buf.to(dev), mesh, placements).full_tensor().cpu()
                else:
                    out[ck] = buf.clone()
            else:
                if full and hasattr(v, "full_tensor"):
                    v = v.full_tensor()
                v = _local(v).detach()
                out[ck] = v.to("cpu", torch.float32, copy=True) if v.is_floating_point() else v.to("cpu", copy=True)
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> int:
        """Load EMA entries by canonical name (keys may carry ``_orig_mod.`` etc.); returns how many loaded.

        Entries for frozen keys are ignored (they are ``net`` by definition); nothing is ever written
        into the model. Full (unsharded) tensors are sliced to this rank's shard when the shapes differ.
        """
        self.synchronize()
        by_canon = {canonical_name(k): v for k, v in state.items()}
        n = 0
        for ck, buf, (mesh, placements) in zip(self.canonical, self.shadow, self._meta):
            v = by_canon.get(ck)
            if v is None:
                continue
            v = _local(v)
            if v.shape != buf.shape and mesh is not None:
                from torch.distributed.tensor import distribute_tensor

                v = distribute_tensor(v.to(mesh.device_type), mesh, placements).to_local()
            buf.copy_(v)
            n += 1
        return n

    def close(self) -> None:
        """Join the worker and release the host arenas."""
        self.synchronize()
        self._pool.shutdown(wait=True)
        self._ema_arena.release()
        self._staging_arena.release()
