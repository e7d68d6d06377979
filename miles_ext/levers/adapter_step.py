"""The offloaded LoRA adapters' AdamW step on the GPU (``--adapter-step-on-gpu``), and their gradients copied to the
host without a wait (exact).

**The fault.** Under full CPU offload (``RESIDENT_BLOCKS=none``) FSDP2 keeps the adapters (345,899,008 fp32 values on
the 33 B model), their gradients and AdamW's two moments on the host, and torch's AdamW steps them there: 0.44-1.98 s
per optimizer step on the H200's host (16 cores), on the critical path. And FSDP2 copies each adapter unit's reduced
gradient to the host *synchronously* (``foreach_reduce`` copies with ``non_blocking=True`` only when the shard is
pinned through ``FSDPParam.pin_memory``, which the exact pinned arena of :mod:`miles_ext.levers.pinned` turns off): in
the backward the host thread waits at every adapter unit until the GPU has caught up, so it cannot queue the next
blocks' work and copies ahead (305 ms of such waits in one profiled 17x320x192 step, and the side stream's copies
starve behind them).

**The lever.**

- :func:`pin_adapter_gradients` sets ``FSDPParam.pin_memory`` back on for the offloaded *trainable* parameters whose
  shards live in a page-locked arena: FSDP2 then copies their first gradient of a step device-to-host with
  ``non_blocking=True`` into pinned memory and waits for it once, at the end of the backward (its own
  ``grad_offload_event``). FSDP2 re-pins a shard only when it is not pinned (``reset_sharded_param``), and an arena
  registered with ``cudaHostRegister`` is, so the shards stay where they are. The same bytes arrive; only the host's
  waiting changes.
- :class:`AdapterStepOnDevice` replaces ``optimizer.step``: the parameters are cut into *stream groups* (consecutive
  parameters of one param group, at most ``group_bytes`` of parameter, gradient and moments each). For each group,
  the host shards of the parameters, their gradients and their moments are copied host-to-device on a side stream
  (the next group's copies are issued before this group steps), the optimizer class's OWN ``step`` runs on device
  copies of them (plain tensors standing in for the parameters, with the parameters' ``step`` counters and
  hyper-parameters: the kernel torch picks for tensors on that device, the one an all-resident run's AdamW uses), and
  the new parameters and moments are copied back to the host shards and to a page-locked arena on a second side
  stream. The device copies are marked as used by the compute stream (they are allocated on the copy stream, and a
  gradient is dropped as soon as its step is queued). ``optimizer.step()`` returns once every copy has landed.

Between steps the moments live in ONE exact-size page-locked :class:`patches.core.host_arena.HostArena` (2.77 GB at
rank 64 on the 33 B model, what the stock host moments take, now pinned), wrapped as DTensors like the parameters, so
``optimizer.state_dict()``, :func:`miles_ext.levers.host_checkpoint.host_full_state` and a resume see the stock
layout; a ``load_state_dict`` post-hook copies loaded moments into the arena. A first step lets torch initialise the
state on the device (zeros, a CPU ``step`` counter), as the all-resident run does, and then moves it to the arena.

**Exactness.** On a CUDA device the step is the all-resident run's: the same foreach AdamW kernels on the same fp32
values (the adapters' gradients are bitwise the same in every placement: :mod:`miles_ext.levers.residency`), so the
adapters and moments after any number of steps are ``torch.equal`` to the all-resident run's; stock full offload's
host AdamW (torch's single-tensor CPU path) rounds differently from both. On the CPU (the proofs' machine) the copies
are plain host copies and the step is stock full offload's own single-tensor kernel: bitwise stock. GPU memory during
the step: at most three stream groups (the one stepping, the next arriving, the last leaving: ``<= 3 x group_bytes``),
after the backward has freed the activations; none between steps.

Proof: ``tests/equivalence/test_h3_adapter_step.py`` (CPU: adapters, moments and step counts after 3 steps and a
resume bitwise stock full offload's, the checkpoint's layout unchanged; CUDA: bitwise the all-resident run's, the
backward with no synchronous gradient copy; planted: a moment streamed through bf16, a parameter not written back, a
stream group skipped, a missing stream wait).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any

import torch
from torch import nn

from patches.core.errors import UserError
from patches.core.host_arena import HostArena
from patches.core.runtime import host_dtensor_like, to_local

__all__ = ["AdapterStepOnDevice", "StepGroup", "pin_adapter_gradients", "DEFAULT_GROUP_BYTES"]

DEFAULT_GROUP_BYTES = 256 << 20
"""Bytes of parameters, gradients and moments per stream group (256 MiB): at most three groups are on the device at
once during the step (0.75 GiB), and the 33 B model's 5.5 GB of adapter state streams in about 22 groups."""
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
"""AdamW's per-parameter moments (``max_exp_avg_sq`` only with ``amsgrad``)."""


def pin_adapter_gradients(model: nn.Module) -> int:
    """Let FSDP2 copy the offloaded trainable parameters' gradients to pinned host memory without a wait.

    Sets ``FSDPParam.pin_memory`` for every CPU-offloaded FSDP2 parameter that requires grad and whose host shard is
    page-locked (the exact arena on CUDA, :func:`miles_ext.levers.pinned.pin_offloaded_shards`); a shard that is not
    page-locked (a CPU run, an unpinned arena) is left as it is, since FSDP2 would re-pin it into a copy. Returns how
    many parameters were set. Values are unchanged: FSDP2 copies the same bytes, with ``non_blocking=True`` for a
    step's first gradient and a wait on its ``grad_offload_event`` before the backward returns.
    """
    from miles_ext.levers.pinned import offloaded_fsdp_params

    n = 0
    for fp in offloaded_fsdp_params(model):
        if fp.sharded_param.requires_grad and not fp.pin_memory and fp._sharded_param_data.is_pinned():
            fp.pin_memory = True
            n += 1
    return n


@dataclasses.dataclass
class StepGroup:
    """Parameters stepped together (all of one param group)."""

    group_index: int
    """Index into ``optimizer.param_groups``."""
    params: list[nn.Parameter]
    """The parameters, in the param group's order."""
    nbytes: int
    """Bytes of their parameters, gradients and moments."""


class AdapterStepOnDevice:
    """Runs a ``torch.optim.Adam``/``AdamW`` whose parameters live on the host (FSDP2 CPU offload) on ``device``.

    Construct it after the optimizer (its state may be empty or loaded). It replaces ``optimizer.step`` on the instance
    (torch's step hooks and profiler range run once per step, as stock) and registers a ``load_state_dict`` post-hook;
    :meth:`close` undoes both.

    Args:
        optimizer: ``Adam`` or ``AdamW`` (any ``foreach`` setting; ``fused`` and ``capturable`` are refused: their state
            lives on the parameters' device).
        device: where the step runs (``cuda``: side streams overlap the copies; ``cpu``: plain copies, the same path).
        group_bytes: most bytes of parameters, gradients and moments per stream group (a larger parameter is a group
            alone).
        pin: page-lock the moments' arena (when CUDA is present).

    Attributes:
        groups: the stream groups in step order; ``arena``: the moments' host arena; ``stats``: ``steps``,
        ``h2d_bytes``, ``d2h_bytes`` (totals over the run).

    Raises:
        UserError: another optimizer class, ``fused``/``capturable``, or parameters not on the host.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device | str, *,
                 group_bytes: int = DEFAULT_GROUP_BYTES, pin: bool = True):
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise UserError(f"--adapter-step-on-gpu steps torch.optim.Adam/AdamW; this optimizer is "
                            f"{type(optimizer).__name__}: use AdamW or drop the flag")
        if any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups):
            raise UserError("--adapter-step-on-gpu needs AdamW's foreach or single-tensor step (fused and capturable "
                            "keep their state on the parameters' device): drop fused=/capturable= or the flag")
        self.optimizer = optimizer
        self.device = torch.device(device)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        where = {to_local(p).device.type for p in params}
        if where - {"cpu"}:
            raise UserError(f"--adapter-step-on-gpu streams adapters that live on the host (full offload, "
                            f"RESIDENT_BLOCKS=none); these are on {sorted(where)}: drop the flag")
        amsgrad = any(g.get("amsgrad", False) for g in optimizer.param_groups)
        self.keys = MOMENT_KEYS if amsgrad else MOMENT_KEYS[:2]
        specs, self._slots = [], {}
        for p in params:
            local = to_local(p)
            for k in self.keys:
                self._slots[(id(p), k)] = len(specs)
                specs.append((tuple(local.shape), local.dtype))  # torch.zeros_like(param)'s local shape and dtype
        self.arena = HostArena(specs, pin=pin, name="adapter-moments")
        self.groups = self._plan(group_bytes)
        cuda = self.device.type == "cuda"
        self._h2d = torch.cuda.Stream(self.device) if cuda else None
        self._d2h = torch.cuda.Stream(self.device) if cuda else None
        self.stats = {"steps": 0, "h2d_bytes": 0, "d2h_bytes": 0}
        cls_step = type(optimizer).step  # torch hooks the class's step once (Optimizer._patch_step_function)
        self._raw_step = cls_step.__wrapped__ if getattr(cls_step, "hooked", False) else cls_step
        self._stock_step = optimizer.step
        lever = self
        optimizer.step = types.MethodType(
            torch.optim.Optimizer.profile_hook_step(lambda opt, closure=None: lever.step(closure)), optimizer)
        self._hook = optimizer.register_load_state_dict_post_hook(lambda opt: self._adopt())
        self._adopt()

    # ------------------------------------------------------------------ bookkeeping
    def _plan(self, group_bytes: int) -> list[StepGroup]:
        """Consecutive parameters of each param group, cut where the next would pass ``group_bytes``."""
        out: list[StepGroup] = []
        per = 2 + len(self.keys)  # parameter, gradient, moments
        for gi, g in enumerate(self.optimizer.param_groups):
            cur: list[nn.Parameter] = []
            size = 0
            for p in g["params"]:
                local = to_local(p)
                b = local.numel() * local.element_size() * per
                if cur and size + b > group_bytes:
                    out.append(StepGroup(gi, cur, size))
                    cur, size = [], 0
                cur.append(p)
                size += b
            if cur:
                out.append(StepGroup(gi, cur, size))
        return out

    def host(self, p: nn.Parameter, key: str) -> torch.Tensor:
        """The arena view holding ``p``'s ``key`` moment (the local shard for a DTensor parameter)."""
        return self.arena.tensors[self._slots[(id(p), key)]]

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes the moments' arena holds."""
        return self.arena.pinned_bytes

    @torch.no_grad()
    def _adopt(self) -> None:
        """Point every existing moment at its arena view, copying it there first (after a load)."""
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
                st[k] = host_dtensor_like(h, p)

    # ------------------------------------------------------------------ the stream
    def _copy_in(self, src: torch.Tensor) -> torch.Tensor:
        dst = torch.empty_like(src, device=self.device)
        dst.copy_(src, non_blocking=True)
        self.stats["h2d_bytes"] += src.numel() * src.element_size()
        return dst

    def _fetch(self, group: StepGroup) -> tuple[list[tuple[torch.Tensor, dict]], Any]:
        """Issue ``group``'s host-to-device copies; returns ``(device parameter, device state)`` per parameter with a
        gradient, and the CUDA event marking their arrival (``None`` on the CPU)."""
        out: list[tuple[torch.Tensor, dict]] = []
        ctx = torch.cuda.stream(self._h2d) if self._h2d is not None else contextlib.nullcontext()
        with ctx:
            for p in group.params:
                if p.grad is None:
                    out.append((None, {}))  # stock skips a parameter without a gradient
                    continue
                d = self._copy_in(to_local(p).detach())
                d.grad = self._copy_in(to_local(p.grad))
                st = self.optimizer.state.get(p)
                state = {} if not st else {"step": st["step"], **{k: self._copy_in(self.host(p, k))
                                                                   for k in self.keys if k in st}}
                out.append((d, state))
            event = torch.cuda.Event() if self._h2d is not None else None
            if event is not None:
                event.record()
        return out, event

    def _wait(self, event) -> None:
        """The compute stream waits for a group's host-to-device copies (without it the step may read device buffers
        the side stream has not filled yet)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _used_by_compute(self, fetched: list[tuple[torch.Tensor, dict]]) -> None:
        """Mark every device copy of a group as used by the compute stream. They were allocated on the copy stream, so
        without this the caching allocator hands a freed one (a gradient, dropped as soon as its step is queued) to the
        next group's copies on that stream while the step may still be reading it."""
        if self._h2d is None:
            return
        compute = torch.cuda.current_stream(self.device)
        for d, state in fetched:
            if d is None:
                continue
            for t in (d, d.grad, *(state.get(k) for k in self.keys)):
                if t is not None:
                    t.record_stream(compute)

    def _step(self, group: StepGroup, fetched: list[tuple[torch.Tensor, dict]]) -> None:
        """The optimizer class's own ``step`` (raw, no hooks) on the device copies standing in for ``group``'s
        parameters, with their states and ``group``'s param group hyper-parameters."""
        opt = self.optimizer
        proxies = [d for d, _ in fetched if d is not None]
        for d, state in fetched:
            if d is not None and state:
                opt.state[d] = state
        saved = [g["params"] for g in opt.param_groups]
        try:
            for gi, g in enumerate(opt.param_groups):
                g["params"] = proxies if gi == group.group_index else []
            self._raw_step(opt)
        finally:
            for g, ps in zip(opt.param_groups, saved):
                g["params"] = ps

    def _write_back(self, group: StepGroup, fetched: list[tuple[torch.Tensor, dict]]) -> None:
        """Copy the new parameters into their host shards and the new moments into the arena (on the device-to-host
        stream, after the step), and point the optimizer's state at the arena again."""
        opt = self.optimizer
        if self._d2h is not None:
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        ctx = torch.cuda.stream(self._d2h) if self._d2h is not None else contextlib.nullcontext()
        with ctx:
            for p, (d, _) in zip(group.params, fetched):
                if d is None:
                    continue
                state = opt.state.pop(d)
                pairs = [(to_local(p).detach(), d)] + [(self.host(p, k), state[k]) for k in self.keys if k in state]
                for dst, src in pairs:
                    if self._d2h is not None:
                        src.record_stream(self._d2h)
                    dst.copy_(src, non_blocking=True)
                    self.stats["d2h_bytes"] += src.numel() * src.element_size()
                opt.state[p] = {k: (host_dtensor_like(self.host(p, k), p) if k in self.keys else v)
                                for k, v in state.items()}
                d.grad = None

    @torch.no_grad()
    def step(self, closure=None) -> Any:
        """``optimizer.step()``: each stream group copied in, stepped by the stock step, copied out (module doc)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [g for g in self.groups if any(p.grad is not None for p in g.params)]
        if not todo:
            return loss
        nxt = self._fetch(todo[0])
        for i, group in enumerate(todo):
            fetched, event = nxt
            if i + 1 < len(todo):  # the next group's copies overlap this group's step
                nxt = self._fetch(todo[i + 1])
            self._wait(event)
            self._used_by_compute(fetched)
            self._step(group, fetched)
            self._write_back(group, fetched)
            del fetched
        if self._d2h is not None:
            self._d2h.synchronize()
        self.stats["steps"] += 1
        return loss

    def close(self) -> None:
        """Restore ``optimizer.step`` and remove the load hook; the moments stay in the arena."""
        self.optimizer.step = self._stock_step
        self._hook.remove()
