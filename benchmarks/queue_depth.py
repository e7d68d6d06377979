"""How far the GPU runs behind the host through one optimizer step of a Cosmos run, without a profiler.

A profiler slows every host operation it records, so a profiled micro-batch cannot say where an *unprofiled* one makes
the GPU wait. :class:`QueueDepth` instead puts marks into one optimizer step (installed before the run): at each mark
the host records a CUDA event on the current stream and reads its clock. The GPU reaches the event when it has run
everything queued before it, so

    lag = (time the GPU reached the mark) - (time the host recorded it)

is how much queued work the GPU had left at that moment (ms). A lag near 0 means the GPU had caught up with the host
there: it waited for the host, and the host work just before the mark is on the critical path. A large lag means the
host ran ahead and its work there was hidden.

The two clocks are tied at the step's start: the trainer synchronizes the device at the end of each optimizer step,
so the GPU has nothing queued when the probed step begins; there the host records a first event and reads its clock,
and the GPU reaches that event at once (within a launch latency, a few microseconds, which every lag carries). Each
later GPU time is that clock reading plus the event's elapsed time from the first (CUDA event resolution about 0.5 us).

Marks, per micro-batch of the probed step: ``start``; the recipe's memory phases (``encode``, ``forward``,
``backward``), entered and left; each decoder layer's call in the forward (``layer <i> forward``, outside the compiled
region: no graph break) and the moment the backward reaches that layer's output (``layer <i> backward``, a gradient
hook on the vision stream the layer returns, recorded on the autograd thread); ``end``. Then the optimizer step's
phases. A mark costs one event record and one clock read (about 10 us of host time, some 70 per micro-batch: under 1 ms).

On the CPU (the smoke) there are no events: the marks keep the host times and every lag is ``None``.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Any

import torch

from benchmarks.breakdown import wrap_layer_calls

__all__ = ["GcPauses", "QueueDepth", "STARVED_MS", "summarize", "markdown_table"]

STARVED_MS = 0.1
"""A lag at or below this many ms counts as "the GPU had caught up with the host" (the first event's own launch
latency and the event resolution are a few microseconds)."""


def summarize(marks: list[tuple[int | None, str, float, float | None]]) -> dict[str, Any]:
    """The lags of one probed step.

    Args:
        marks: ``(micro-batch or None, name, host_s, gpu_s)`` in the order recorded, both times in seconds from the
            step's start (the tied clocks); ``micro`` ``None`` for marks outside the micro-batches (the optimizer
            step); ``gpu_s`` ``None`` without events (CPU).

    Returns:
        ``{"micro_batches": n, "marks": [{"name", "host_ms", "lag_ms", "lag_min_ms", "starved"}, ...],
        "per_micro_batch": [{"micro", "wall_ms", "starved_marks": [names], "idle_bound_ms", "marks": [[name,
        host_ms, lag_ms], ...]}], "optimizer": [{"name", "host_ms", "lag_ms"}]}``: per mark name (in the order first
        seen), the mean over micro-batches of its host time from its micro-batch's ``start`` and of its lag, the
        smallest lag, in how many micro-batches the GPU had caught up there (``starved``: lag <= :data:`STARVED_MS`;
        the GPU had nothing queued before the mark, so it waited for the host) of the ``of`` that have the mark; per
        micro-batch its marks in host order and ``idle_bound_ms``, the most the GPU can have idled between its
        ``start`` and ``end``: a GPU with ``lag`` ms of queued work at a mark is busy for at least that long, so
        between two marks ``dt`` ms apart it idles at most ``max(0, dt - lag)``, summed over the micro-batch's
        consecutive marks. Lags and bounds ``None`` without events.

    Raises:
        ValueError: no mark inside a micro-batch, or a micro-batch without its ``start`` mark.
    """
    by_micro: dict[int, list[tuple[str, float, float | None]]] = {}
    optimizer = []
    for micro, name, host_s, gpu_s in marks:
        if micro is None:
            optimizer.append((name, host_s, gpu_s))
        else:
            by_micro.setdefault(micro, []).append((name, host_s, gpu_s))
    if not by_micro:
        raise ValueError("no mark inside a micro-batch: install QueueDepth before the run reaches the probed step")
    order: list[str] = []
    host: dict[str, list[float]] = {}
    lag: dict[str, list[float]] = {}
    per = []
    for micro, rows in sorted(by_micro.items()):
        start = next((h for n, h, _ in rows if n == "start"), None)
        if start is None:
            raise ValueError(f"micro-batch {micro} has no start mark")
        starved = []
        rows = sorted(rows, key=lambda r: r[1])  # the autograd thread's marks interleave by time
        gaps = [max(0.0, 1e3 * (b[1] - a[1]) - 1e3 * (a[2] - a[1])) for a, b in zip(rows, rows[1:])
                if a[2] is not None]
        for name, h, g in rows:
            if name not in host:
                order.append(name)
                host[name], lag[name] = [], []
            host[name].append(1e3 * (h - start))
            if g is not None:
                lag[name].append(1e3 * (g - h))
                if 1e3 * (g - h) <= STARVED_MS:
                    starved.append(name)
        ends = [h for n, h, _ in rows if n == "end"]
        per.append({"micro": micro, "wall_ms": 1e3 * (ends[-1] - start) if ends else None, "starved_marks": starved,
                    "idle_bound_ms": sum(gaps) if rows[0][2] is not None else None,
                    "marks": [[n, 1e3 * (h - start), None if g is None else 1e3 * (g - h)] for n, h, g in rows]})
    out_marks = []
    for name in order:
        lags = lag[name]
        out_marks.append({
            "name": name, "host_ms": statistics.fmean(host[name]),
            "lag_ms": statistics.fmean(lags) if lags else None, "lag_min_ms": min(lags) if lags else None,
            "starved": sum(1 for x in lags if x <= STARVED_MS) if lags else None, "of": len(host[name]),
        })
    return {"micro_batches": len(by_micro), "marks": out_marks, "per_micro_batch": per,
            "optimizer": [{"name": n, "host_ms": 1e3 * h, "lag_ms": None if g is None else 1e3 * (g - h)}
                          for n, h, g in optimizer]}


def markdown_table(q: dict[str, Any]) -> str:
    """:func:`summarize`'s result as markdown: one row per mark (decoder layers shown every seventh, with the
    smallest lag over all of them), and the marks where the GPU had caught up, per micro-batch."""
    f = lambda v, fmt=".2f": "–" if v is None else format(v, fmt)  # noqa: E731
    layer_rows = [m for m in q["marks"] if m["name"].startswith("layer ")]
    lines = [f"GPU lag behind the host at each mark (mean over {q['micro_batches']} micro-batches, unprofiled; "
             f"\"caught up\": lag <= {STARVED_MS} ms, the GPU waited for the host there).", "",
             "| mark | host ms from the micro-batch's start | GPU lag ms (mean) | smallest | caught up in |",
             "|---|---|---|---|---|"]
    last = max((int(m["name"].split()[1]) for m in layer_rows), default=0)
    for m in q["marks"]:
        if m["name"].startswith("layer ") and int(m["name"].split()[1]) % 7 and int(m["name"].split()[1]) != last:
            continue
        caught = "–" if m["starved"] is None else f"{m['starved']} of {m['of']}"
        lines.append(f"| {m['name']} | {f(m['host_ms'], '.1f')} | {f(m['lag_ms'])} | {f(m['lag_min_ms'])} | {caught} |")
    for kind in ("forward", "backward"):
        lags = [m["lag_min_ms"] for m in layer_rows if m["name"].endswith(kind) and m["lag_min_ms"] is not None]
        if lags:
            lines.append(f"| every layer {kind} (smallest) | | | {min(lags):.2f} | |")
    bounds = [m["idle_bound_ms"] for m in q["per_micro_batch"] if m.get("idle_bound_ms") is not None]
    if bounds:
        lines += ["", "GPU idle at most, per micro-batch (ms, from its marks' lags): "
                  + ", ".join(f"{b:.1f}" for b in bounds) + f" (mean {statistics.fmean(bounds):.1f})"]
    if q["optimizer"]:
        lines += ["", "Optimizer step: " + "; ".join(f"{o['name']} at {o['host_ms']:.1f} ms, lag {f(o['lag_ms'])} ms"
                                                     for o in q["optimizer"])]
    return "\n".join(lines) + "\n"


class _Marked:
    """Stands in for the recipe's memory sampler during the probed step: each phase is also marked on entry and exit."""

    def __init__(self, mem: Any, probe: "QueueDepth"):
        self._mem, self._probe = mem, probe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mem, name)

    def phase(self, name: str):
        @contextlib.contextmanager
        def marked():
            with self._mem.phase(name):
                self._probe.mark(f"{name} in")
                self._probe.in_backward = name == "backward"
                try:
                    yield
                finally:
                    self._probe.in_backward = False
                    self._probe.mark(f"{name} out")

        return marked()


class QueueDepth:
    """Mark optimizer step ``iteration`` (0-based) of ``recipe`` (a built-but-not-run ``CosmosSFT``; install before
    the run).

    A layer's forward is marked outside the recipe's ``backward`` phase only: a full activation checkpoint's recompute
    calls the layer again inside the backward, and that call is not a forward. After the run, :attr:`result` holds
    :func:`summarize` of the marks (``None`` if the step never ran or failed).
    """

    def __init__(self, recipe: Any, iteration: int):
        self.recipe, self.iteration = recipe, iteration
        self.result: dict[str, Any] | None = None
        self._on = False
        self._micro: int | None = None
        self._marks: list[tuple[int | None, str, float, Any]] = []
        self._origin: tuple[float, Any] | None = None
        self.in_backward = False
        """Inside the recipe's ``backward`` phase (set by the phase marks)."""
        step, micro_batch, build = recipe.train_step, recipe._micro_batch, recipe._build_model

        def probed_step(it: int):
            if it != self.iteration:
                return step(it)
            cuda = recipe.device.type == "cuda"
            if cuda:
                torch.cuda.synchronize(recipe.device)  # the trainer's own step-end synchronize already did this
            ev = self._event()
            self._origin = (time.perf_counter(), ev)
            mem = recipe.mem
            recipe.mem = _Marked(mem, self)
            self._on = True
            try:
                result = step(it)
            finally:
                self._on = False
                recipe.mem = mem
            self._finish()  # only after a step that ran: a failing step's own error is what the caller sees
            return result

        def probed_micro(it: int, micro: int):
            if not self._on:
                return micro_batch(it, micro)
            self._micro = micro
            self.mark("start")
            try:
                return micro_batch(it, micro)
            finally:
                self.mark("end")
                self._micro = None

        def build_then_mark() -> None:
            build()
            self._mark_layers(recipe.model)

        recipe.train_step, recipe._micro_batch, recipe._build_model = probed_step, probed_micro, build_then_mark

    def _event(self):
        if self.recipe.device.type != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def mark(self, name: str) -> None:
        """Record mark ``name`` now (an event on the current stream, then the host clock); no-op outside the step."""
        if not self._on:
            return
        ev = self._event()
        self._marks.append((self._micro, name, time.perf_counter(), ev))

    def _mark_layers(self, model: torch.nn.Module) -> None:
        wrap_layer_calls(model, self._marked)

    def _marked(self, call, i: int):
        def marked(*args, **kwargs):
            if not self._on or not torch.is_grad_enabled() or self.in_backward:
                return call(*args, **kwargs)
            self.mark(f"layer {i} forward")
            out = call(*args, **kwargs)
            grads = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                     if isinstance(t, torch.Tensor) and t.requires_grad]
            if grads:
                micro = self._micro
                grads[-1].register_hook(lambda g, _i=i, _m=micro: self._backward_mark(_i, _m))
            return out

        return marked

    def _backward_mark(self, i: int, micro: int | None) -> None:
        if self._on:
            ev = self._event()
            self._marks.append((micro, f"layer {i} backward", time.perf_counter(), ev))

    def _finish(self) -> None:
        if self._origin is None or not self._marks:
            return
        if self.recipe.device.type == "cuda":
            torch.cuda.synchronize(self.recipe.device)
        h0, e0 = self._origin  # the GPU reached e0 when the host read h0 (nothing was queued): both clocks' zero
        rows = [(micro, name, h - h0, None if ev is None else e0.elapsed_time(ev) / 1e3)
                for micro, name, h, ev in self._marks]
        self.result = summarize(rows)


class GcPauses:
    """The Python garbage collector's pauses in the optimizer steps from ``first`` (0-based) on of ``recipe`` (install
    before the run; ``gc.callbacks``): a collection stops every Python thread, the one launching the GPU's work
    included.

    After the run, :attr:`result` is ``{"steps": n, "collections": {generation: count}, "pause_s": {generation: s},
    "longest_s": s}`` over those ``n`` steps (generations ``"0"``, ``"1"``, ``"2"``).
    """

    def __init__(self, recipe: Any, first: int = 1):
        self.counts = {g: 0 for g in range(3)}
        self.pause = {g: 0.0 for g in range(3)}
        self.longest = 0.0
        self.steps = 0
        self._on = False
        self._t0 = 0.0
        step = recipe.train_step

        def counted_step(it: int):
            if it < first:
                return step(it)
            gc.callbacks.append(self._callback)
            self._on = True
            self.steps += 1
            try:
                return step(it)
            finally:
                self._on = False
                gc.callbacks.remove(self._callback)

        recipe.train_step = counted_step

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._on:
            dt = time.perf_counter() - self._t0
            g = int(info.get("generation", 0))
            self.counts[g] += 1
            self.pause[g] += dt
            self.longest = max(self.longest, dt)

    @property
    def result(self) -> dict[str, Any]:
        return {"steps": self.steps, "collections": {str(g): n for g, n in self.counts.items()},
                "pause_s": {str(g): s for g, s in self.pause.items()}, "longest_s": self.longest}
