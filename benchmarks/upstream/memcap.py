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


def _time_steps(rank: str) -> None:
    """Wrap upstream's ``ImaginaireTrainer.training_step`` to print each micro-batch's seconds and token split."""
    import json

    import torch
    from cosmos_framework import trainer as upstream_trainer

    original = upstream_trainer.ImaginaireTrainer.training_step
    count = [0]

    def training_step(self, *args, **kwargs):
        data = kwargs.get("data", args[4] if len(args) > 4 else {})
        split = token_split(data)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = original(self, *args, **kwargs)
        torch.cuda.synchronize()
        count[0] += 1
        print(f"onecard memcap[rank {rank}]: micro-batch {count[0]} {time.perf_counter() - t:.4f} s samples "
              f"{json.dumps(split)}", file=sys.stderr, flush=True)
        return out

    upstream_trainer.ImaginaireTrainer.training_step = training_step


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
    _steps_on(os.environ.get("RANK", "0"))  # a bad value stops here, before the cap and the module
    _cap_and_report(os.environ.get("RANK", "0"))
    _wandb_compat()
    sys.path[0] = os.getcwd()
    if _steps_on(os.environ.get("RANK", "0")):
        _time_steps(os.environ.get("RANK", "0"))
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
