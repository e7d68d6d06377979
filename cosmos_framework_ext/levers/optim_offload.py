"""Optimizer-state streaming (``COSMOS_OPTIM_STATE_OFFLOAD=1``): AdamW's moments live on the host, the step is stock.

Between optimizer steps, ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq`` with ``amsgrad``) of every
parameter live in ONE exact-size host arena (:class:`patches.core.host_arena.HostArena`, page-locked when
CUDA is present), in the dtype and shape the stock optimizer gives them (``torch.zeros_like(param)``: fp32
for an fp32 master, bf16 for a bf16 one). At ``optimizer.step()`` they stream to the parameters' device in
*stream groups* (consecutive parameters of one param group, at most ``group_bytes`` of state each):

1. group ``i + 1``'s host->device copies are issued on a side stream *before* group ``i`` steps, so the
   copy engine moves the next group while the compute stream runs this one;
2. group ``i``'s entries in ``optimizer.state`` are pointed at the device copies and the optimizer's OWN
   ``step()`` runs with its param groups restricted to group ``i``'s parameters: the same fused / foreach /
   single-tensor kernel torch picks for stock, the same hyper-parameters (lr, betas, eps, weight decay,
   ``step`` counters), nothing re-implemented. Adam is elementwise, so stepping a subset computes each
   element exactly as one whole step does;
3. group ``i``'s new state streams back (device->host on a second side stream, after the step's event) and
   ``optimizer.state`` points at the host arena again. The step returns once every copy has landed.

On a CPU the "device" is the host: the same code runs with plain copies and no streams (no overlap, no
saving; the path is the one the GPU takes, which is what the CPU proofs exercise).

What stays stock: gradients (accumulation, clipping: they never move), ``optimizer.param_groups``, the
``step`` counters (left where torch puts them), ``optimizer.state_dict()`` (same keys, dtypes and values;
the moments' tensors are the host arena's, so their device is the CPU), ``optimizer.load_state_dict()``
(a post-hook copies the loaded moments into the arena). A first step initialises the state as stock does
(on the device, zeros), then it streams out. FSDP2 (DTensor) parameters keep DTensor state: the host
copy is the local shard, wrapped with the parameter's mesh and placements.

GPU memory during the step: at most three stream groups of state at once (the one stepping, the next
arriving, the previous leaving), i.e. <= 3 x ``group_bytes``; between steps none. The bound holds on the device,
not only in the host's order: before group ``i + 1`` is fetched the host waits for group ``i - 2``'s write-back
to end (the GPU still has group ``i - 1``'s step queued, so it does not idle). The device buffers come from the
compute stream's pool, where the next micro-batches' activations reuse them: buffers allocated on the copy stream
stay cached there after the step (the caching allocator reuses a block only on its own stream), 3.4 GiB reserved
but out of the activations' reach in the 24 GB recipe (measured on an H100). Host: 2 x (bytes of the
trainable parameters), pinned. Copies move that twice per optimizer step over PCIe, once per ``grad_accum_iter``
micro-batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any

import torch

from patches.core.errors import UserError
from patches.core.host_arena import HostArena
from patches.core.runtime import to_local

MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
"""The per-parameter state tensors that stream (``max_exp_avg_sq`` only exists with ``amsgrad``)."""
SUPPORTED = (torch.optim.Adam, torch.optim.AdamW)
"""Optimizer classes whose state layout this module knows."""


def _wrap_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor with ``like``'s spec (mesh, placements, global shape and stride) when ``like`` is a
    DTensor, else ``local`` itself. No data moves: the local tensor may live on the host while the mesh is CUDA
    (``DTensor.from_local`` would copy it to the mesh's device, so the constructor is used with ``like``'s spec)."""
    if not hasattr(like, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


@dataclasses.dataclass
class StreamGroup:
    """Parameters whose state streams together (all from one param group)."""

    group_index: int
    """Index into ``optimizer.param_groups``."""
    params: list[torch.nn.Parameter]
    """The parameters, in the param group's order."""
    nbytes: int
    """Bytes of their streamed state."""


class OptimStateOffload:
    """Keeps a ``torch.optim.Adam``/``AdamW``'s moments in a host arena and streams them for each step.

    Construct it after the optimizer (its state may be empty or loaded), before or after an LR scheduler; it
    replaces ``optimizer.step`` on the instance by a bound method (:meth:`_install_step`) and registers a
    ``load_state_dict`` post-hook. :meth:`close` undoes both.

    Args:
        optimizer: the optimizer (``Adam`` or ``AdamW``; any ``fused``/``foreach`` setting).
        group_bytes: most bytes of state per stream group (a parameter larger than this is a group alone).
        pin: page-lock the arena (when CUDA is present).

    Attributes:
        groups: the stream groups, in step order.
        arena: the host arena (``nbytes``, ``pinned_bytes``).
        stats: ``steps``, ``h2d_bytes``, ``d2h_bytes``.

    Raises:
        UserError: the optimizer is not ``Adam``/``AdamW``, or its parameters are not all on one device.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, group_bytes: int = 256 << 20, pin: bool = True):
        if not isinstance(optimizer, SUPPORTED):
            raise UserError(f"COSMOS_OPTIM_STATE_OFFLOAD=1 streams torch.optim.Adam/AdamW state; this optimizer is "
                            f"{type(optimizer).__name__}: use AdamW or unset COSMOS_OPTIM_STATE_OFFLOAD")
        self.optimizer = optimizer
        params = [p for g in optimizer.param_groups for p in g["params"]]
        devices = {to_local(p).device for p in params}
        if len(devices) > 1:
            raise UserError(f"COSMOS_OPTIM_STATE_OFFLOAD=1 needs the parameters on one device, found {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        amsgrad = any(g.get("amsgrad", False) for g in optimizer.param_groups)
        self.keys = MOMENT_KEYS if amsgrad else MOMENT_KEYS[:2]
        specs, self._slots = [], {}
        for p in params:
            local = to_local(p)
            for k in self.keys:
                self._slots[(id(p), k)] = len(specs)
                specs.append((tuple(local.shape), local.dtype))  # stock: torch.zeros_like(param)
        self.arena = HostArena(specs, pin=pin, name="optimizer-state")
        self.groups = self._plan(group_bytes)
        cuda = self.device.type == "cuda"
        self._h2d = torch.cuda.Stream(self.device) if cuda else None
        self._d2h = torch.cuda.Stream(self.device) if cuda else None
        self.stats = {"steps": 0, "h2d_bytes": 0, "d2h_bytes": 0}
        self._hook = optimizer.register_load_state_dict_post_hook(lambda opt: self._adopt())
        self._install_step()
        self._adopt()

    def _install_step(self) -> None:
        """Make ``optimizer.step`` this lever's step, as a method torch's wrappers accept.

        ``optimizer.step`` becomes a *bound method* of the optimizer whose function is torch's own hook wrapper
        (``Optimizer.profile_hook_step``) around :meth:`step`: the step pre/post hooks and the profiler range run
        once per optimizer step, as stock, and an LR scheduler built afterwards wraps it as it wraps any optimizer
        (``LRScheduler.__init__`` takes ``opt.step.__func__`` and binds it to the optimizer again). One built
        before keeps its order check: the new method carries ``_wrapped_by_lr_sched`` and sets ``_opt_called`` as
        that scheduler's wrapper would. Each stream group runs the optimizer class's raw ``step`` (without the hook
        wrapper, so no hook runs per group)."""
        optimizer = self.optimizer
        self._stock_step = optimizer.step  # restored by close()
        cls_step = type(optimizer).step  # torch hooks the class's step once (Optimizer._patch_step_function)
        self._raw_step = cls_step.__wrapped__ if getattr(cls_step, "hooked", False) else cls_step
        lever = self

        def offload_step(opt, closure=None):
            opt._opt_called = True  # what an LR scheduler's step wrapper records
            return lever.step(closure)

        hooked = torch.optim.Optimizer.profile_hook_step(offload_step)
        if hasattr(self._stock_step, "_wrapped_by_lr_sched"):  # a scheduler was built first: keep it quiet
            hooked._wrapped_by_lr_sched = True
        optimizer.step = types.MethodType(hooked, optimizer)

    # ------------------------------------------------------------------ bookkeeping
    def _plan(self, group_bytes: int) -> list[StreamGroup]:
        """Consecutive parameters of each param group, cut where the next would pass ``group_bytes``."""
        out: list[StreamGroup] = []
        for gi, g in enumerate(self.optimizer.param_groups):
            cur: list[torch.nn.Parameter] = []
            size = 0
            for p in g["params"]:
                local = to_local(p)
                b = local.numel() * local.element_size() * len(self.keys)
                if cur and size + b > group_bytes:
                    out.append(StreamGroup(gi, cur, size))
                    cur, size = [], 0
                cur.append(p)
                size += b
            if cur:
                out.append(StreamGroup(gi, cur, size))
        return out

    def host(self, p: torch.nn.Parameter, key: str) -> torch.Tensor:
        """The arena view holding ``p``'s ``key`` moment (the local shard for a DTensor parameter)."""
        return self.arena.tensors[self._slots[(id(p), key)]]

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes held (the arena)."""
        return self.arena.pinned_bytes

    @torch.no_grad()
    def _adopt(self) -> None:
        """Point every existing moment at its arena view, copying it there first (after a load or a step)."""
        for p, st in self.optimizer.state.items():
            if (id(p), self.keys[0]) not in self._slots:
                continue
            for k in self.keys:
                v = st.get(k)
                if v is None:
                    continue
                h = self.host(p, k)
                if to_local(v).data_ptr() != h.data_ptr():
                    h.copy_(to_local(v))
                st[k] = _wrap_like(h, v)

    # ------------------------------------------------------------------ the stream
    def _chunks_to_run(self) -> list[StreamGroup]:
        """The stream groups holding a parameter with a gradient (stock skips parameters without one)."""
        return [g for g in self.groups if any(p.grad is not None for p in g.params)]

    def _fetch(self, group: StreamGroup) -> tuple[dict[tuple[int, str], torch.Tensor], Any]:
        """Start the host->device copies of ``group``'s existing moments; returns the device locals and the
        CUDA event that marks their arrival (``None`` on the CPU).

        The device buffers are allocated on the compute stream, the one that steps and frees them: the caching
        allocator gives a freed block only to allocations on the stream it was allocated on, so buffers allocated
        on the copy stream would stay cached there after the step, reserved but out of reach of the next
        micro-batches' activations (3.4 GiB of the 24 GB recipe's reserved memory, measured). The copy stream
        first waits for the compute stream's work so far: a reused block may still be read by a queued kernel. (So
        the first group's copy starts after the backward's queued kernels, once per optimizer step.)"""
        out: dict[tuple[int, str], torch.Tensor] = {}
        todo = []
        for p in group.params:
            st = self.optimizer.state.get(p)
            if not st:
                continue  # first step: the optimizer initialises this state itself (zeros, on the device)
            for k in self.keys:
                if k in st:
                    h = self.host(p, k)
                    out[(id(p), k)] = self._device_buffer(h)
                    todo.append((out[(id(p), k)], h))
                    self.stats["h2d_bytes"] += h.numel() * h.element_size()
        if self._h2d is None:
            for d, h in todo:
                d.copy_(h)
            return out, None
        self._h2d.wait_stream(torch.cuda.current_stream(self.device))  # a reused block's queued readers first
        with torch.cuda.stream(self._h2d):
            for d, h in todo:
                d.copy_(h, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return out, event

    def _device_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised device tensor shaped as the host moment ``like``, from the current (compute) stream's pool."""
        return torch.empty_like(like, device=self.device)

    @staticmethod
    def _wait_for_room(written: list, i: int) -> None:
        """Before group ``i + 1`` is fetched: wait (host) for group ``i - 2``'s write-back ``written[i - 2]`` to end,
        so that its buffers are free and at most three groups' state is on the device."""
        if i >= 2 and written[i - 2] is not None:
            written[i - 2].synchronize()

    def _install(self, group: StreamGroup, fetched: dict[tuple[int, str], torch.Tensor], event) -> None:
        """Wait (on the device) for ``group``'s copies, then point its state at the device tensors."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        for p in group.params:
            st = self.optimizer.state.get(p)
            for k in self.keys:
                d = fetched.get((id(p), k))
                if d is not None:
                    st[k] = _wrap_like(d, st[k])

    def _to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One device->host copy of a moment (on the D2H stream on CUDA)."""
        dst.copy_(src, non_blocking=True)

    def _writeback(self, group: StreamGroup, fetched: dict[tuple[int, str], torch.Tensor]) -> Any:
        """Stream ``group``'s new state back to the arena (after the step, on the D2H stream), re-point it and drop
        ``fetched`` (its device buffers); returns the CUDA event that marks the copies' end (``None`` on the CPU).

        The buffers are freed before the event is recorded: the caching allocator records its own events for them on
        the D2H stream at the free, so they come before this one, and once it has completed the buffers serve the
        next allocation (:meth:`_wait_for_room` relies on it)."""
        if self._d2h is not None:
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        ctx = torch.cuda.stream(self._d2h) if self._d2h is not None else contextlib.nullcontext()
        with ctx:
            for p in group.params:
                st = self.optimizer.state.get(p)
                if not st:
                    continue
                for k in self.keys:
                    v = st.get(k)
                    if v is None:
                        continue
                    d, h = to_local(v), self.host(p, k)
                    if self._d2h is not None:
                        d.record_stream(self._d2h)
                    self._to_host(h, d)
                    self.stats["d2h_bytes"] += h.numel() * h.element_size()
                    st[k] = _wrap_like(h, v)
            d = v = None  # noqa: F841 -- the last moment's references, dropped before the event
            fetched.clear()
            event = torch.cuda.Event() if self._d2h is not None else None
            if event is not None:
                event.record()
        return event

    def _step_only(self, group: StreamGroup, closure) -> Any:
        """The optimizer class's own ``step`` (raw, no hooks) with its param groups restricted to ``group``'s parameters."""
        saved = [g["params"] for g in self.optimizer.param_groups]
        try:
            for gi, g in enumerate(self.optimizer.param_groups):
                g["params"] = group.params if gi == group.group_index else []
            return self._raw_step(self.optimizer, closure) if closure is not None else self._raw_step(self.optimizer)
        finally:
            for g, ps in zip(self.optimizer.param_groups, saved):
                g["params"] = ps

    @torch.no_grad()
    def step(self, closure=None) -> Any:
        """``optimizer.step()``: stream each group in, run the stock step on it, stream it out (see module doc)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = self._chunks_to_run()
        if not todo:
            return loss
        written = []  # each group's write-back event, in order
        nxt = self._fetch(todo[0])
        try:
            for i, group in enumerate(todo):
                cur = nxt
                if i + 1 < len(todo):  # the next group's copy overlaps this group's step
                    self._wait_for_room(written, i)
                    nxt = self._fetch(todo[i + 1])
                self._install(group, *cur)
                self._step_only(group, None)
                written.append(self._writeback(group, cur[0]))
        except BaseException:
            if self._h2d is not None:  # a buffer still being copied into returns to the compute stream's pool
                torch.cuda.current_stream(self.device).wait_stream(self._h2d)
            raise
        if self._d2h is not None:
            self._d2h.synchronize()
        self.stats["steps"] += 1
        return loss

    def close(self) -> None:
        """Restore ``optimizer.step`` and remove the load hook. The moments stay in the arena (moving them back
        to the device at the end of a run could exceed a capped card); the arena lives as long as they do."""
        self.optimizer.step = self._stock_step
        self._hook.remove()
