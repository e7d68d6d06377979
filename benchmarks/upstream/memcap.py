"""torchrun worker entry for upstream runs: cap this rank's GPU memory, report its peak, run ``-m MODULE``.

    python benchmarks/upstream/memcap.py [-u] -m MODULE [ARGS...]

torchrun starts every worker as ``$PYTHON_EXEC -u -m MODULE ARGS...``. ``run_upstream.sh`` points
``PYTHON_EXEC`` at a two-line shell script that runs this file with those arguments, because neither
the launcher's upstream path nor upstream's trainer caps the card: ``ONECARD_GPU_MEMORY_GIB`` is read
only by onecard's embedded trainer, and upstream's own ``DEVICE_MEMORY_FRACTION`` only by its inference
init. So, before MODULE runs:

* with ``ONECARD_GPU_MEMORY_GIB`` set (e.g. ``22.06``, a 24 GB card's usable memory), the rank's device
  (``LOCAL_RANK``) is capped with ``torch.cuda.set_per_process_memory_fraction``: the caching allocator
  then fails with an out-of-memory error where a card that size would;
* at exit, one line reports the rank's peak allocated and reserved memory (``torch.cuda.max_memory_*``);
  with ``ONECARD_MEMCAP_EVERY_S=S`` also a running-peak line every S seconds, so that a run stopped by a
  time limit (which never reaches ``atexit``) still leaves its peak so far in the log;
* ``wandb.util.generate_id`` is supplied when the installed wandb lacks it (see :func:`_wandb_compat`);
* with ``ONECARD_MEMORY_HISTORY=DIR``, the allocator's history is recorded from before the first CUDA
  allocation (``torch.cuda.memory._record_memory_history``, Python stacks, ``ONECARD_MEMORY_HISTORY_MAX``
  events, default 2,000,000), and at exit ``DIR/memory-rank<R>.json`` gets :func:`memtimeline.analyse`'s
  report: the peak, what was live at it grouped by the upstream line that allocated it, and a timeline.

* with ``ONECARD_MEMCAP_STEPS=1`` (a boolean; another value is one error line, exit 2), upstream's ``ImaginaireTrainer.training_step`` (one micro-batch; the last of an
  optimizer step also runs the step) is timed between two CUDA synchronisations, and one line per call gives its
  seconds and each sample's ``(text tokens, vision tokens)`` by upstream's own count (``len(text_token_ids) + 1``;
  ``ceil(H/32) * ceil(W/32) * (1 + (T - 1) // 4) + 2`` per clip): what model FLOPs and MFU are computed from.

MODULE then runs as ``python -m`` would run it (``sys.path[0]`` is the working directory).
"""

from __future__ import annotations

import atexit
import time
import os
import runpy
import sys

GiB = 1 << 30
HERE = os.path.dirname(os.path.abspath(__file__))
"""This script's folder (memtimeline.py's), taken at import: ``__file__`` may be gone when ``atexit`` runs."""


def _every_s(rank: str) -> float | None:
    """``ONECARD_MEMCAP_EVERY_S`` as seconds (> 0), ``None`` when unset; a bad value exits 2 with one line."""
    raw = os.environ.get("ONECARD_MEMCAP_EVERY_S", "").strip()
    if not raw:
        return None
    try:
        every = float(raw)
    except ValueError:
        every = -1.0
    if not 1 <= every < float("inf"):
        print(f"onecard memcap[rank {rank}]: error: ONECARD_MEMCAP_EVERY_S={raw!r} must be a number of seconds >= 1 "
              "(e.g. 15), or unset", file=sys.stderr)
        sys.exit(2)
    return every


def _steps_on(rank: str) -> bool:
    """``ONECARD_MEMCAP_STEPS`` as a boolean (1/0/true/false/yes/no; unset: off); another value exits 2, one line."""
    raw = os.environ.get("ONECARD_MEMCAP_STEPS", "").strip().lower()
    if raw in ("1", "true", "yes"):
        return True
    if raw in ("", "0", "false", "no"):
        return False
    print(f"onecard memcap[rank {rank}]: error: ONECARD_MEMCAP_STEPS={os.environ['ONECARD_MEMCAP_STEPS']!r} is not a "
          "boolean: set it to one of 1/0/true/false/yes/no, or unset it", file=sys.stderr)
    sys.exit(2)


def _cap_and_report(rank: str) -> None:
    every = _every_s(rank)
    raw = os.environ.get("ONECARD_GPU_MEMORY_GIB", "").strip()
    import torch

    if not torch.cuda.is_available():
        if raw:
            print(f"onecard memcap[rank {rank}]: error: ONECARD_GPU_MEMORY_GIB={raw!r} is set but there is no CUDA "
                  "device: unset it, or run on a GPU", file=sys.stderr)
            sys.exit(2)
        return
    device = int(os.environ.get("LOCAL_RANK", "0") or 0)
    total = torch.cuda.get_device_properties(device).total_memory
    if raw:
        try:
            gib = float(raw)
        except ValueError:
            gib = -1.0
        if not 0 < gib * GiB <= total:
            print(f"onecard memcap[rank {rank}]: error: ONECARD_GPU_MEMORY_GIB={raw!r} must be a number of GiB in "
                  f"(0, {total / GiB:.2f}] for this card", file=sys.stderr)
            sys.exit(2)
        torch.cuda.set_per_process_memory_fraction(gib * GiB / total, device)
        print(f"onecard memcap[rank {rank}]: cuda:{device} capped at {gib:.2f} GiB of {total / GiB:.2f} GiB "
              f"(set_per_process_memory_fraction {gib * GiB / total:.4f})", file=sys.stderr, flush=True)

    def report() -> None:
        try:
            alloc = torch.cuda.max_memory_allocated(device) / GiB
            reserved = torch.cuda.max_memory_reserved(device) / GiB
        except Exception:  # noqa: BLE001 - a report at exit must never mask the run's own error
            return
        cap = f" (cap {float(raw):.2f} GiB)" if raw else ""
        print(f"onecard memcap[rank {rank}]: cuda:{device} peak allocated {alloc:.2f} GiB, peak reserved "
              f"{reserved:.2f} GiB{cap}", file=sys.stderr, flush=True)

    history = os.environ.get("ONECARD_MEMORY_HISTORY", "").strip()
    max_entries = os.environ.get("ONECARD_MEMORY_HISTORY_MAX", "2000000").strip()
    if history and not (max_entries.isdigit() and int(max_entries) > 0):
        print(f"onecard memcap[rank {rank}]: error: ONECARD_MEMORY_HISTORY_MAX={max_entries!r} must be a whole number "
              "of events > 0 (default 2000000)", file=sys.stderr)
        sys.exit(2)
    if history:
        torch.cuda.memory._record_memory_history(
            max_entries=int(max_entries), stacks="python")

    def dump_history() -> None:
        try:
            import json
            import time

            sys.path.insert(0, HERE)
            from memtimeline import analyse

            t = time.perf_counter()
            snap = torch.cuda.memory._snapshot()
            rep = analyse(snap, device, max_allocated=torch.cuda.max_memory_allocated(device))
            os.makedirs(history, exist_ok=True)
            path = os.path.join(history, f"memory-rank{rank}.json")
            with open(path + ".tmp", "w") as fh:
                json.dump(rep, fh, indent=1)
            os.replace(path + ".tmp", path)
            print(f"onecard memcap[rank {rank}]: memory history ({rep['events']} events, replayed peak "
                  f"{rep['peak_GiB']:.2f} GiB) -> {path} in {time.perf_counter() - t:.1f} s",
                  file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - never mask the run's own error
            print(f"onecard memcap[rank {rank}]: memory history not written: {exc!r}", file=sys.stderr, flush=True)

    if every is not None:
        import threading

        def running_peak() -> None:  # a run stopped by a time limit never reaches atexit: its log keeps these
            while True:
                time.sleep(every)
                try:
                    alloc = torch.cuda.max_memory_allocated(device) / GiB
                    reserved = torch.cuda.max_memory_reserved(device) / GiB
                except Exception:  # noqa: BLE001
                    return
                print(f"onecard memcap[rank {rank}]: running peak allocated {alloc:.2f} GiB, reserved {reserved:.2f} "
                      "GiB", file=sys.stderr, flush=True)

        threading.Thread(target=running_peak, name="onecard-memcap", daemon=True).start()

    atexit.register(report)
    if history:
        atexit.register(dump_history)  # atexit runs last-registered first: the report then follows
        _AT_STOP.append(dump_history)
    _AT_STOP.append(report)


def token_split(data: dict) -> list[tuple[int, int]]:
    """``(text tokens, vision tokens)`` per sample of a packed upstream batch (upstream's packing-loader count)."""
    def flat(v):
        return [t for x in v for t in flat(x)] if isinstance(v, (list, tuple)) else [v]

    texts = data.get("text_token_ids") or []
    videos = data.get("video") or []
    out = []
    for i, text in enumerate(texts):
        u = sum(int(t.numel()) for t in flat(text)) + 1
        v = 0
        for clip in flat(videos[i]) if i < len(videos) else []:
            t_, h, w = (int(x) for x in clip.shape[-3:])
            v += -(-h // 32) * -(-w // 32) * (1 + (t_ - 1) // 4) + 2
        out.append((u, v))
    return out


def _profile_spec(rank: str) -> tuple[int, int] | None:
    """``ONECARD_MEMCAP_PROFILE=FIRST[:COUNT]`` as (first call, count) of ``training_step`` (1-based; COUNT default
    4); ``None`` when unset. A bad value exits 2 with one line."""
    raw = os.environ.get("ONECARD_MEMCAP_PROFILE", "").strip()
    if not raw:
        return None
    first, _, count = raw.partition(":")
    count = count or "4"
    if not (first.isdigit() and count.isdigit() and int(first) >= 1 and int(count) >= 1):
        print(f"onecard memcap[rank {rank}]: error: ONECARD_MEMCAP_PROFILE={raw!r} must be FIRST[:COUNT], the first "
              "training_step call to profile and how many (whole numbers >= 1, e.g. 3:4), or unset", file=sys.stderr)
        sys.exit(2)
    return int(first), int(count)


def _stop_after(rank: str) -> int | None:
    """``ONECARD_MEMCAP_STOP_AFTER=N`` (a whole number >= 1): calls of ``training_step`` after which the rank
    reports its peak and exits 0; ``None`` when unset. A bad value exits 2 with one line."""
    raw = os.environ.get("ONECARD_MEMCAP_STOP_AFTER", "").strip()
    if not raw:
        return None
    if not (raw.isdigit() and int(raw) >= 1):
        print(f"onecard memcap[rank {rank}]: error: ONECARD_MEMCAP_STOP_AFTER={raw!r} must be a whole number of "
              "training_step calls >= 1 (e.g. 6), or unset", file=sys.stderr)
        sys.exit(2)
    return int(raw)


def _decoder_layers(model) -> list:
    """The children of the first ``ModuleList`` named ``...layers`` with two or more entries (upstream's decoder
    stack, ``net.model.layers``), or ``[]``."""
    import torch

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.split(".")[-1] == "layers" and len(mod) >= 2:
            return list(mod)
    return []


class _Profiler:
    """torch.profiler over calls ``first .. first+count-1`` of upstream's ``training_step``, marked the way
    ``benchmarks/breakdown.py`` reads: each call ``onecard.micro_batch`` (``onecard.optimizer_micro_batch`` for
    the last of an accumulation window, which also runs the optimizer step, so that the breakdown's micro-batch is
    the plain one), upstream's own ``training_timer("forward")`` / ``("backward")`` regions ``onecard.forward`` /
    ``onecard.backward`` (each with a device synchronize at its start and end), and each decoder layer's call
    ``onecard.layer.<i>`` (forward hooks outside the compiled block: forward only). After the last call the Chrome
    trace is written to ``DIR/upstream-profile-rank<R>-trace.json.gz`` and :func:`breakdown.breakdown` of it to
    ``DIR/upstream-profile-rank<R>.json`` (DIR: ``ONECARD_MEMCAP_PROFILE_DIR``, else ``OUTPUT_ROOT``, else the
    working directory), and its table is printed."""

    def __init__(self, rank: str, first: int, count: int):
        self.rank, self.first, self.last = rank, first, first + count - 1
        self.dir = os.path.abspath(os.environ.get("ONECARD_MEMCAP_PROFILE_DIR") or os.environ.get("OUTPUT_ROOT")
                                   or os.getcwd())
        self.prof = None
        self.hooks: list = []
        self.open: dict = {}
        self.layer = 0

    def wanted(self, call: int) -> bool:
        return self.first <= call <= self.last

    def start(self, model) -> None:
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.__enter__()
        for layer in _decoder_layers(model):
            self.hooks.append(layer.register_forward_pre_hook(self._enter_layer))
            self.hooks.append(layer.register_forward_hook(self._exit_layer))

    def _enter_layer(self, module, args) -> None:
        import torch

        rf = torch.profiler.record_function(f"onecard.layer.{self.layer}")
        self.layer += 1
        rf.__enter__()
        self.open[id(module)] = rf  # kept here, not on the module: a compiled block (OptimizedModule) hands a set
        # attribute to its inner module, where the exit hook would not find it and the mark would never close

    def _exit_layer(self, module, args, output) -> None:
        rf = self.open.pop(id(module), None)
        if rf is not None:
            rf.__exit__(None, None, None)

    def finish(self) -> None:
        import json

        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        os.makedirs(self.dir, exist_ok=True)
        trace = os.path.join(self.dir, f"upstream-profile-rank{self.rank}-trace.json")
        prof.export_chrome_trace(trace)
        sys.path.insert(0, os.path.dirname(HERE))
        from breakdown import breakdown, markdown_table

        with open(trace) as fh:
            result = breakdown(json.load(fh))
        import gzip
        import shutil

        with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace)
        out = os.path.join(self.dir, f"upstream-profile-rank{self.rank}.json")
        with open(out, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"onecard memcap[rank {self.rank}]: profile of training_step calls {self.first}-{self.last} -> {out}, "
              f"trace {trace}.gz\n{markdown_table(result)}", file=sys.stderr, flush=True)


class _MarkedTimer:
    """Stands in for upstream's ``trainer.training_timer`` during a profiled call: ``timer(name)`` is still the
    timer's own context, inside a ``record_function("onecard.<phase>")`` with a synchronize at both ends."""

    PHASES = {"forward": "forward", "backward": "backward"}

    def __init__(self, timer):
        self._timer = timer

    def __getattr__(self, name: str):
        return getattr(self._timer, name)

    def __call__(self, func_name: str):
        import contextlib

        import torch

        inner = self._timer(func_name)
        phase = self.PHASES.get(func_name)
        if phase is None:
            return inner

        @contextlib.contextmanager
        def marked():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            with torch.profiler.record_function(f"onecard.{phase}"):
                with inner:
                    yield
                if torch.cuda.is_available():
                    torch.cuda.synchronize()

        return marked()


def _wrap_training_step(rank: str, timing: bool, profile: tuple[int, int] | None, stop_after: int | None) -> None:
    """Wrap upstream's ``ImaginaireTrainer.training_step``: with ``timing``, print each micro-batch's seconds and
    token split; with ``profile``, run :class:`_Profiler` over those calls; with ``stop_after``, after that many
    calls print the peak and exit 0 (no final checkpoint)."""
    import json

    import torch
    from cosmos_framework import trainer as upstream_trainer

    original = upstream_trainer.ImaginaireTrainer.training_step
    count = [0]
    prof = _Profiler(rank, *profile) if profile else None
    cuda = torch.cuda.is_available()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def training_step(self, *args, **kwargs):
        data = kwargs.get("data", args[4] if len(args) > 4 else {})
        accum = kwargs.get("grad_accum_iter", args[6] if len(args) > 6 else 0)
        split = token_split(data) if timing else None
        call = count[0] + 1
        profiled = prof is not None and prof.wanted(call)
        if profiled and prof.prof is None:
            model = kwargs.get("model_ddp", args[0] if args else None)
            prof.start(model if model is not None else torch.nn.Module())
        sync()
        t = time.perf_counter()
        if profiled:
            optimizer = accum + 1 == self.config.trainer.grad_accum_iter
            timer, self.training_timer = self.training_timer, _MarkedTimer(self.training_timer)
            prof.layer = 0
            try:
                name = "onecard.optimizer_micro_batch" if optimizer else "onecard.micro_batch"
                with torch.profiler.record_function(name):
                    out = original(self, *args, **kwargs)
            finally:
                self.training_timer = timer
        else:
            out = original(self, *args, **kwargs)
        sync()
        count[0] = call
        if timing:
            print(f"onecard memcap[rank {rank}]: micro-batch {call} {time.perf_counter() - t:.4f} s samples "
                  f"{json.dumps(split)}", file=sys.stderr, flush=True)
        if prof is not None and call == prof.last:
            prof.finish()
        if stop_after is not None and call >= stop_after:
            print(f"onecard memcap[rank {rank}]: stopping after {call} training_step calls "
                  "(ONECARD_MEMCAP_STOP_AFTER)", file=sys.stderr, flush=True)
            for fn in _AT_STOP:
                fn()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return out

    upstream_trainer.ImaginaireTrainer.training_step = training_step


_AT_STOP: list = []
"""Reports to run before an ``ONECARD_MEMCAP_STOP_AFTER`` exit (``os._exit`` skips ``atexit``)."""


def _wandb_compat() -> None:
    """Upstream calls ``wandb.util.generate_id()`` at train start even with ``wandb_mode=disabled``; wandb
    0.31 (the version that imports beside protobuf 7) no longer has it. Supply an equivalent random id."""
    try:
        import wandb.util
    except ImportError:
        return
    if not hasattr(wandb.util, "generate_id"):
        import secrets
        import string

        alphabet = string.ascii_lowercase + string.digits
        wandb.util.generate_id = lambda length=8: "".join(secrets.choice(alphabet) for _ in range(length))


def main(argv: list[str]) -> None:
    args = list(argv)
    while args and args[0] == "-u":  # torchrun's unbuffered flag; the launcher exports PYTHONUNBUFFERED=1
        args.pop(0)
    if len(args) < 2 or args[0] != "-m":
        print("usage: memcap.py [-u] -m MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    module, rest = args[1], args[2:]
    import importlib.util

    sys.path.insert(0, os.getcwd())
    try:
        # the top-level name only: a dotted name's spec would import its parent packages before the cap is set
        found = importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        found = False
    sys.path.pop(0)
    if not found:
        print(f"onecard memcap: error: no module named {module!r} from {os.getcwd()}: run from the folder that "
              "holds it (torchrun's working directory) or fix the name", file=sys.stderr)
        sys.exit(2)
    rank = os.environ.get("RANK", "0")
    timing, profile, stop = _steps_on(rank), _profile_spec(rank), _stop_after(rank)  # bad values stop here
    _cap_and_report(rank)
    _wandb_compat()
    sys.path[0] = os.getcwd()
    if timing or profile or stop:
        _wrap_training_step(rank, timing, profile, stop)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
