"""Where a Cosmos micro-batch's time goes: a profiled breakdown by phase, kernel category and decoder layer.

:class:`ProfiledMicroBatches` wraps a :class:`~cosmos_framework_ext.recipe.train.CosmosSFT` before it runs. For
the micro-batches it is told to profile (one optimizer step's, after the warm-up step), it

- runs ``torch.profiler`` (CPU and CUDA activities) over them and exports the Chrome trace;
- marks each micro-batch (``onecard.micro_batch``) and each of the recipe's memory phases inside it
  (``onecard.encode``, ``onecard.forward``, ``onecard.backward``) with ``record_function``, by default with a device
  synchronize at the start and end of each phase, so a phase's kernels run inside its own window (this adds idle
  time: the profiled micro-batch is slower than an unprofiled one, and both are reported). With ``sync=False`` the
  phases are marked without synchronizes: the GPU then runs behind the host as in an unprofiled run, and what the
  host was doing while the GPU had nothing to run (``gpu_idle_while``) is the critical path as training has it;
- marks each decoder layer's call through the activation-checkpoint function (``onecard.layer.<i>``), outside the
  compiled layer (no graph break): the same mark in the backward window is that layer's recompute. Under selective
  checkpointing (no checkpoint function; the checkpoint is inside the compiled layer) the layer's call is marked
  instead: forward only, the recompute runs inside the compiled backward and is not separated.

:func:`breakdown` reads the trace: every GPU event (kernel, memcpy, memset) is attributed to the phase and layer in
which the CPU *launched* it (the launch is found through the event's ``correlation`` id), and its duration is
summed per kernel category (:data:`CATEGORIES`, first match wins). A phase's GPU busy time is the time in which some
GPU event ran while the host's main thread was in that phase, whoever launched it (without synchronizes the GPU runs
behind the host, so the kernels a phase launched may run in the next one); idle = the phase's wall time - busy, the
same as its ``gpu_idle_while``. ``gpu_idle_while`` splits the time in which no GPU
event runs, from the first profiled micro-batch's start to the last one's end, by where the host's main thread was at
that moment (a phase, ``host and data``, or ``between micro-batches``). Everything is reported per micro-batch (mean
over the profiled ones), in seconds.
"""

from __future__ import annotations

import contextlib
import json
import re
from bisect import bisect_right
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

__all__ = ["CATEGORIES", "categorize", "breakdown", "ProfiledMicroBatches", "markdown_table", "wrap_layer_calls"]

PREFIX = "onecard."
PHASES = ("encode", "forward", "backward")
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("attention", r"flex_attention|flash|fmha|_attn_|attention|sdpa|cudnn"),
    ("GEMM", r"gemm|cutlass|nvjet|xmma|cublas|splitk|triton_tem_fused_(?:add)?b?mm|sm\d\d_"),
    ("fused elementwise (Triton)", r"^triton_(?:poi|red|per)_"),
    ("memcpy / memset", r"^memcpy|^memset|^\[memcpy|^\[memset"),
    ("elementwise / reduce (eager)", r"elementwise|vectorized|reduce|unrolled|at::native|index|scatter|gather|cat|copy"),
)
"""(category, regex on the lower-cased kernel name), in order; a name matching none is ``other``."""
_COMPILED = [(c, re.compile(p)) for c, p in CATEGORIES]
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
HOST_CATS = {"cpu_op", "user_annotation"}
SYNC_RX = re.compile(r"Synchronize|^cudaMemcpy$|^cuMemcpyDtoH")
"""Runtime calls that wait for the device: the synchronize calls (a GPU tensor's ``.item()`` is a copy and a
``cudaStreamSynchronize``) and a synchronous ``cudaMemcpy``; an ``.item()`` of a CPU tensor waits for nothing and is
not counted."""
LAUNCH_RX = re.compile(r"Launch|^cudaMemcpyAsync$|^cudaMemsetAsync$")


def categorize(name: str) -> str:
    """The category of a GPU event name (``"other"`` if no pattern of :data:`CATEGORIES` matches)."""
    low = name.lower()
    for cat, rx in _COMPILED:
        if rx.search(low):
            return cat
    return "other"


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` (any order) merged into sorted, disjoint intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _clip(iv: tuple[float, float], lo: float, hi: float) -> tuple[float, float] | None:
    a, b = max(iv[0], lo), min(iv[1], hi)
    return (a, b) if b > a else None


def _where(t: float, wins: list[tuple[float, float]]) -> int | None:
    """The index of the window of the sorted, disjoint ``wins`` that holds ``t``, or ``None``."""
    i = bisect_right(wins, (t, float("inf"))) - 1
    return i if i >= 0 and wins[i][0] <= t <= wins[i][1] else None


def _idle_while(gpu: list[tuple[float, float]], span: tuple[float, float],
                states: list[tuple[float, float, str]], default: str) -> dict[str, float]:
    """The time in ``span`` in which none of the ``gpu`` intervals runs, split by the host state that holds it.

    Args:
        gpu: GPU event intervals (any order; overlapping ones are merged).
        span: (start, end) of the time to cover.
        states: disjoint (start, end, name) windows of the host's state; time in none of them is ``default``'s.

    Returns:
        ``{state: idle time}`` in the units of the inputs, every state of ``states`` and ``default`` listed (0 when
        the GPU was busy all through it); the values sum to the idle time in ``span``.
    """
    out = {name: 0.0 for *_, name in states}
    out[default] = 0.0
    for a, b in _minus(span, _merged(gpu)):  # the gaps: the span without the busy time
        covered = 0.0
        for s, e, name in states:
            iv = _clip((a, b), s, e)
            if iv:
                out[name] += iv[1] - iv[0]
                covered += iv[1] - iv[0]
        out[default] += (b - a) - covered
    return out


def _minus(window: tuple[float, float], holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``window`` without the sorted, disjoint ``holes`` (those outside it change nothing), as sorted intervals."""
    out, t = [], window[0]
    for a, b in holes:
        a, b = max(a, window[0]), min(b, window[1])
        if b <= a:
            continue
        if a > t:
            out.append((t, a))
        t = max(t, b)
    if t < window[1]:
        out.append((t, window[1]))
    return out


def _training_threads(ev: list[dict]) -> set[Any]:
    """The threads that run the training step: those holding ``onecard.`` marks (the main thread; the autograd thread's
    recompute marks) and those that run autograd nodes (the backward's device thread). Every other thread (the loader
    threads that read and lay out the next micro-batches, the EMA's host lerp) runs beside the step, not in it."""
    out = {e.get("tid") for e in ev if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(PREFIX)}
    out |= {e.get("tid") for e in ev if e.get("cat") in HOST_CATS
            and str(e.get("name", "")).startswith("autograd::engine::evaluate_function")}
    return out


def _host_side(ev: list[dict], micro: list[tuple[float, float]], phase_of, names: tuple[str, ...], n: int,
               top: int) -> dict[str, Any]:
    """Per phase of ``names`` (``phase_of(ts)`` says which), per micro-batch of the ``n`` in ``micro``: the launch
    calls (:data:`LAUNCH_RX`), the device waits (:data:`SYNC_RX`: count and s) and the ``top`` host ops by inclusive
    time (name, count, s) of the host events ``ev`` that start inside a micro-batch (the ``onecard.`` marks left out)
    on the training threads (:func:`_training_threads`); ``other_threads``: the ``top`` host ops that other threads
    ran meanwhile (the loader threads, the EMA), which the phase's own time does not include. Launch and wait calls
    are counted on the training threads only."""
    train = _training_threads(ev)
    host = {p: {"launches": 0, "syncs": [0, 0.0], "ops": defaultdict(lambda: [0, 0.0]),
                "other": defaultdict(lambda: [0, 0.0])} for p in names}
    for e in ev:
        cat, name = e.get("cat"), str(e.get("name", ""))
        if (cat not in LAUNCH_CATS and cat not in HOST_CATS) or name.startswith(PREFIX) or _where(e["ts"], micro) is None:
            continue
        h = host[phase_of(e["ts"])]
        if e.get("tid") not in train:
            if cat in HOST_CATS:
                h["other"][name][0] += 1
                h["other"][name][1] += e["dur"] / 1e6
            continue
        if cat in LAUNCH_CATS and LAUNCH_RX.search(name):
            h["launches"] += 1
        if SYNC_RX.search(name):
            h["syncs"][0] += 1
            h["syncs"][1] += e["dur"] / 1e6
        if cat in HOST_CATS:
            h["ops"][name][0] += 1
            h["ops"][name][1] += e["dur"] / 1e6
    def ranked(ops: dict) -> list[dict[str, Any]]:
        return [{"name": k[:120], "count": c // n or c, "s": t / n}
                for k, (c, t) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:top]]

    return {p: {"launches": h["launches"] // n, "syncs": {"count": h["syncs"][0] // n, "s": h["syncs"][1] / n},
                "ops": ranked(h["ops"]), "other_threads": ranked(h["other"])}
            for p, h in host.items()}


def breakdown(trace: dict[str, Any], top: int = 15) -> dict[str, Any]:
    """The per-micro-batch breakdown of a Chrome trace written under :class:`ProfiledMicroBatches`.

    Args:
        trace: the parsed JSON of ``torch.profiler.profile.export_chrome_trace`` (``{"traceEvents": [...]}``;
            times in microseconds).
        top: how many kernels to list in ``top_kernels`` (by total time).

    Returns:
        ``{"micro_batches": n, "wall_s", "gpu_busy_s", "idle_s", "phases": {phase: {"wall_s", "gpu_busy_s",
        "idle_s", "kernels_s": {category: s}}}, "categories_s": {category: s}, "recompute_s", "layers":
        {"forward_s": [...], "recompute_s": [...]}, "top_kernels": [{"name", "category", "count", "s"}]}``, every
        time in seconds per micro-batch, plus ``"host": {phase: {"launches", "syncs": {"count", "s"}, "ops":
        [{"name", "count", "s"}], "other_threads": [...]}}`` (launch calls, device waits (:data:`SYNC_RX`; each phase
        window's own two synchronizes included) and the ``top`` host ops by inclusive time, per micro-batch, of the
        training threads; ``other_threads``: those the loader threads and the EMA ran meanwhile) and
        ``layers["forward_wall_s"]`` (each layer mark's wall time in the forward); phase ``"host and data"`` is the micro-batch's time outside the three
        phases (fetching the batch, noise, packing, the loss's host read); ``"gpu_idle_while": {"host and data",
        phase..., "between micro-batches": s}``: no GPU event running while the main thread was there (from the
        first micro-batch's start to the last one's end; with synchronized phases this includes their waits).

    Raises:
        ValueError: the trace holds no ``onecard.micro_batch`` mark (it was not written under the wrapper).
    """
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    marks = [e for e in ev if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(PREFIX)]
    micro = sorted((e["ts"], e["ts"] + e["dur"]) for e in marks if e["name"] == PREFIX + "micro_batch")
    if not micro:
        raise ValueError("the trace has no onecard.micro_batch mark: profile through ProfiledMicroBatches")
    n = len(micro)
    def inside(e) -> bool:  # a phase mark counts only inside a profiled micro-batch (not e.g. an optimizer one)
        i = bisect_right(micro, (e["ts"], float("inf"))) - 1
        return i >= 0 and micro[i][0] <= e["ts"] and e["ts"] + e["dur"] <= micro[i][1]

    phase_win = {p: sorted((e["ts"], e["ts"] + e["dur"]) for e in marks if e["name"] == PREFIX + p and inside(e))
                 for p in PHASES}
    layer_marks = defaultdict(list)  # tid -> [(start, end, layer)]
    for e in marks:
        m = re.fullmatch(re.escape(PREFIX) + r"layer\.(\d+)", e["name"])
        if m:
            layer_marks[e.get("tid")].append((e["ts"], e["ts"] + e["dur"], int(m.group(1))))
    for v in layer_marks.values():
        v.sort()
    launch = {}
    for e in ev:
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {}):
            launch[e["args"]["correlation"]] = (e["ts"], e.get("tid"))
    gpu = [e for e in ev if e.get("cat") in GPU_CATS]

    def phase_of(t: float) -> str:
        return next((p for p in PHASES if _where(t, phase_win[p]) is not None), "host and data")

    def layer_of(t: float, tid: Any) -> int | None:
        best = None
        for a, b, k in layer_marks.get(tid, ()):
            if a > t:
                break
            if t <= b:
                best = k  # the innermost (latest-starting) mark that holds t
        return best

    names = ("host and data",) + PHASES
    kern = {p: defaultdict(float) for p in names}
    cats_total = defaultdict(float)
    recompute = 0.0
    layer_fwd, layer_rec = defaultdict(float), defaultdict(float)
    per_kernel = defaultdict(lambda: [0, 0.0])
    for e in gpu:
        lt, tid = launch.get(e.get("args", {}).get("correlation"), (e["ts"], None))
        mb = _where(lt, micro)
        if mb is None:
            continue
        phase = phase_of(lt)
        cat = categorize(e["name"]) if e["cat"] == "kernel" else "memcpy / memset"
        dur = e["dur"] / 1e6
        kern[phase][cat] += dur
        cats_total[cat] += dur
        k = layer_of(lt, tid) if phase in ("forward", "backward") else None
        if k is not None:
            (layer_fwd if phase == "forward" else layer_rec)[k] += dur
            if phase == "backward":
                recompute += dur
        pk = per_kernel[e["name"]]
        pk[0] += 1
        pk[1] += dur

    layer_wall = defaultdict(float)
    for v in layer_marks.values():
        for a, b, k in v:
            if _where(a, phase_win["forward"]) is not None:
                layer_wall[k] += (b - a) / 1e6

    def wall(wins):
        return sum(b - a for a, b in wins) / 1e6

    micro_wall = wall(micro)
    in_phase = sorted((a, b, p) for p in PHASES for a, b in phase_win[p])
    host_data = [(a, b, "host and data") for w in micro for a, b in _minus(w, [(s, e) for s, e, _ in in_phase])]
    idle = _idle_while([(e["ts"], e["ts"] + e["dur"]) for e in gpu], (micro[0][0], micro[-1][1]),
                       sorted(in_phase + host_data), "between micro-batches")
    idle_while = {k: idle.get(k, 0.0) / 1e6 / n for k in names + ("between micro-batches",)}
    phases = {}
    for p in names:  # busy: a GPU event ran while the host was in the phase (whoever launched it)
        w = wall(phase_win[p]) if p in PHASES else micro_wall - sum(wall(phase_win[q]) for q in PHASES)
        i = min(idle.get(p, 0.0) / 1e6, w)
        phases[p] = {"wall_s": w / n, "gpu_busy_s": (w - i) / n, "idle_s": i / n,
                     "kernels_s": {c: s / n for c, s in sorted(kern[p].items(), key=lambda kv: -kv[1])}}
    all_idle = min(sum(idle.get(p, 0.0) for p in names) / 1e6, micro_wall)
    layers = sorted({k for v in layer_marks.values() for _, _, k in v})  # every marked layer, even with no GPU events
    tops = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "micro_batches": n, "wall_s": micro_wall / n, "gpu_busy_s": (micro_wall - all_idle) / n,
        "idle_s": all_idle / n, "phases": phases,
        "gpu_idle_while": idle_while,
        "categories_s": {c: s / n for c, s in sorted(cats_total.items(), key=lambda kv: -kv[1])},
        "recompute_s": recompute / n,
        "layers": {"forward_s": [layer_fwd[k] / n for k in layers], "recompute_s": [layer_rec[k] / n for k in layers],
                   "forward_wall_s": [layer_wall[k] / n for k in layers]},
        "host": _host_side(ev, micro, phase_of, names, n, top),
        "top_kernels": [{"name": name[:120], "category": categorize(name), "count": c // n or c, "s": s / n}
                        for name, (c, s) in tops],
    }


class _Phases:
    """Stands in for the recipe's memory sampler inside a profiled micro-batch: each phase is also a
    ``record_function`` mark, with a device synchronize at its start and end when ``sync``; everything else is the
    sampler's."""

    def __init__(self, mem: Any, device: torch.device, sync: bool = True):
        self._mem, self._device, self._sync_on = mem, device, sync

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mem, name)

    @contextlib.contextmanager
    def phase(self, name: str):
        with self._mem.phase(name):
            self._sync()
            with torch.profiler.record_function(PREFIX + name):
                try:
                    yield
                finally:
                    self._sync()

    def _sync(self) -> None:
        if self._sync_on and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)


def wrap_layer_calls(model: torch.nn.Module, wrap) -> int:
    """Replace each decoder layer's call (the modules ``model._repeated_blocks`` names, in module order) with
    ``wrap(call, index)``, outside the layer's compiled region (no graph break): the compiled call
    (``_compiled_call_impl``) of a compiled layer, else its ``forward``. Returns how many layers were wrapped."""
    names = set(getattr(model, "_repeated_blocks", ()))
    layers = [m for m in model.modules() if type(m).__name__ in names]
    for i, m in enumerate(layers):
        attr = "_compiled_call_impl" if getattr(m, "_compiled_call_impl", None) is not None else "forward"
        setattr(m, attr, wrap(getattr(m, attr), i))
    return len(layers)


class ProfiledMicroBatches:
    """Profile micro-batches ``micros`` of optimizer step ``iteration`` of ``recipe`` (install before the run).

    Args:
        recipe: a built-but-not-run ``CosmosSFT``.
        iteration: the 0-based optimizer step whose micro-batches to profile (after the warm-up step).
        micros: the micro-batch indices within that step (consecutive; e.g. ``range(1, 4)``).
        trace_path: where to write the Chrome trace (JSON).
        sync: synchronize the device at each phase's start and end (each phase's GPU work inside its own window;
            slower than unprofiled); ``False``: no synchronizes, the GPU runs behind the host as it does unprofiled.

    After the run, :attr:`result` holds :func:`breakdown` of the trace (``None`` if those micro-batches never ran).
    Raises ``ValueError`` at construction for an empty ``micros``.
    """

    def __init__(self, recipe: Any, iteration: int, micros: range, trace_path: Path, sync: bool = True):
        if len(micros) == 0:
            raise ValueError("micros is empty: name at least one micro-batch to profile")
        self.recipe, self.iteration, self.micros, self.trace_path = recipe, iteration, micros, Path(trace_path)
        self.sync = sync
        self.result: dict[str, Any] | None = None
        self._prof = None
        self._layer = 0
        inner = recipe._micro_batch
        recipe._micro_batch = self._wrap(inner)
        build = recipe._build_model

        def build_then_mark() -> None:
            build()
            self._mark_layers(recipe.model)

        recipe._build_model = build_then_mark

    def _mark_layers(self, model: torch.nn.Module) -> None:
        """Mark each decoder layer's call through the checkpoint function (``mode = "full"``: forward and
        recompute); with no checkpoint function in use (``selective`` or ``none``), mark the layer's call itself,
        outside its compiled region: forward only (a selective recompute runs inside the compiled backward)."""
        if not any(getattr(m, "_gradient_checkpointing_func", None) is not None
                   and getattr(m, "gradient_checkpointing", False) for m in model.modules()):
            wrap_layer_calls(model, lambda call, i: self._marked_call(call))
            return
        for m in model.modules():
            fn = getattr(m, "_gradient_checkpointing_func", None)
            if fn is None or not getattr(m, "gradient_checkpointing", False):
                continue

            def marked_ckpt(layer_call, *args, _fn=fn, **kw):
                if self._prof is None:
                    return _fn(layer_call, *args, **kw)
                idx = self._layer
                self._layer += 1

                def run(*a, **k):
                    with torch.profiler.record_function(f"{PREFIX}layer.{idx}"):
                        return layer_call(*a, **k)

                return _fn(run, *args, **kw)

            m._gradient_checkpointing_func = marked_ckpt

    def _marked_call(self, call):
        def marked(*args, **kwargs):
            if self._prof is None:
                return call(*args, **kwargs)
            idx = self._layer
            self._layer += 1
            with torch.profiler.record_function(f"{PREFIX}layer.{idx}"):
                return call(*args, **kwargs)

        return marked

    def _wrap(self, inner):
        def micro_batch(iteration: int, micro: int):
            if iteration != self.iteration or micro not in self.micros:
                return inner(iteration, micro)
            if micro == self.micros[0]:
                self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if self.recipe.device.type == "cuda" else []))
                self._prof.__enter__()
            mem = self.recipe.mem
            self.recipe.mem = _Phases(mem, self.recipe.device, self.sync)
            self._layer = 0
            try:
                with torch.profiler.record_function(PREFIX + "micro_batch"):
                    out = inner(iteration, micro)
            finally:
                self.recipe.mem = mem
            if micro == self.micros[-1]:
                self._finish()
            return out

        return micro_batch

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.trace_path))
        self.result = breakdown(json.loads(self.trace_path.read_text()))
        self.result["synchronized_phases"] = self.sync


def markdown_table(b: dict[str, Any], unprofiled_s: float | None = None) -> str:
    """The breakdown as markdown: phases (wall, GPU busy, idle), kernel categories per phase, layers, top kernels."""
    ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
    cats = list(b["categories_s"])
    sync = {True: " (a synchronize at each phase boundary)", False: " (phases not synchronized)"}.get(
        b.get("synchronized_phases"), "")
    lines = [f"Profiled {b['micro_batches']} micro-batches{sync}: {ms(b['wall_s'])} ms each"
             + (f" (unprofiled median {ms(unprofiled_s)} ms)" if unprofiled_s else "")
             + f", GPU busy {ms(b['gpu_busy_s'])} ms, idle {ms(b['idle_s'])} ms;"
             f" recompute (activation checkpointing) {ms(b['recompute_s'])} ms of the backward.", "",
             "| phase | wall ms | GPU busy ms | idle ms |" + "".join(f" {c} ms |" for c in cats),
             "|---" * (4 + len(cats)) + "|"]
    for p, d in b["phases"].items():
        lines.append(f"| {p} | {ms(d['wall_s'])} | {ms(d['gpu_busy_s'])} | {ms(d['idle_s'])} |"
                     + "".join(f" {ms(d['kernels_s'].get(c, 0.0))} |" for c in cats))
    lines.append(f"| **all** | {ms(b['wall_s'])} | {ms(b['gpu_busy_s'])} | {ms(b['idle_s'])} |"
                 + "".join(f" {ms(b['categories_s'][c])} |" for c in cats))
    fw, rc = b["layers"]["forward_s"], b["layers"]["recompute_s"]
    if fw:
        lines += ["", f"Decoder layers ({len(fw)}): forward {ms(min(fw))}–{ms(max(fw))} ms each (sum {ms(sum(fw))}),"
                  f" recompute {ms(min(rc or [0]))}–{ms(max(rc or [0]))} ms each (sum {ms(sum(rc))})."]
        wl = b["layers"].get("forward_wall_s") or []
        if wl:
            lines[-1] += f" Forward wall per layer {ms(min(wl))}–{ms(max(wl))} ms (sum {ms(sum(wl))})."
    if b.get("gpu_idle_while"):
        lines += ["", "GPU idle (no kernel, copy or memset running) while the host's main thread was in: "
                  + ", ".join(f"{p} {ms(s)} ms" for p, s in b["gpu_idle_while"].items()) + "."]
    if b.get("host"):
        lines += ["", "| phase | launches | device waits | wait ms | top host ops, training threads (inclusive ms) "
                  "| meanwhile on other threads (inclusive ms) |", "|---|---|---|---|---|---|"]
        for p, h in b["host"].items():
            ops, other = ("; ".join(f"`{o['name'][:48]}` ×{o['count']} {ms(o['s'])}" for o in rows[:6])
                          for rows in (h["ops"], h.get("other_threads", [])))
            lines.append(f"| {p} | {h['launches']} | {h['syncs']['count']} | {ms(h['syncs']['s'])} | {ops} | {other} |")
    lines += ["", "| kernel | category | launches / micro-batch | ms / micro-batch |", "|---|---|---|---|"]
    for k in b["top_kernels"]:
        lines.append(f"| `{k['name'][:70]}` | {k['category']} | {k['count']} | {ms(k['s'])} |")
    return "\n".join(lines) + "\n"
