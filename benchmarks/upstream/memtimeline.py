"""What is on the GPU at the peak: replay a CUDA allocator trace and name the code that allocated it.

``memcap.py`` turns PyTorch's allocator history on (``torch.cuda.memory._record_memory_history``) before
upstream's trainer allocates anything, when ``ONECARD_MEMORY_HISTORY`` is set, and hands the snapshot to
:func:`analyse` at exit (a run that ends in an out-of-memory error included). The report says

* ``peak_bytes``: the highest sum of live blocks in the replayed trace, and when (s since the first event);
  it should equal ``torch.cuda.max_memory_allocated`` (both count a block from ``alloc`` to
  ``free_requested``; a ring buffer that overflowed shows up as a mismatch, flagged in ``complete``);
* ``at_peak``: the live blocks at that moment grouped by the first frame in upstream or onecard code
  (``where``) and by the top frame (``top``: the torch function that asked the allocator), largest first;
* ``timeline``: (t_s, allocated GiB) downsampled to at most ``points`` rows, for a plot;
* ``oom``: the allocator's out-of-memory events (bytes requested, free at the time), if any.

Only the snapshot's ``device_traces`` are read: each event a dict with ``action`` (``alloc``,
``free_requested``, ``free_completed``, ``segment_alloc``, ``oom``, ...), ``addr``, ``size`` (bytes, the
rounded block size the allocator counts), ``time_us`` and ``frames`` (``filename``/``line``/``name``, most
recent first). Unknown actions are ignored.

    python benchmarks/upstream/memtimeline.py SNAPSHOT.pickle [--device 0]   # report as JSON on stdout

**Only open snapshots you made.** A snapshot is a pickle, and ``pickle.load`` runs whatever code a crafted file
names. :func:`load_snapshot` (what the command line uses) unpickles with :class:`_PlainData`, which refuses every
class and function reference, so only plain data loads (dict, list, tuple, str, bytes, int, float, bool, None:
all that ``torch.cuda.memory._snapshot()`` holds); torch offers no loader for these raw pickles (``torch.load``'s
``weights_only`` reads ``torch.save`` files). That closes the known way a pickle runs code, but a hostile file
can still exhaust memory (a huge nested payload): do not point this tool at files from elsewhere. A payload
that is not a snapshot (not a dict, no ``device_traces`` list, ``--device`` out of range, an event that is not
a dict) is one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from collections import defaultdict
from typing import Any, Iterable

GiB = 1 << 30


class SnapshotError(ValueError):
    """A file that is not a usable allocator snapshot: the message names the problem and the fix, in one line."""


class _PlainData(pickle.Unpickler):
    """An unpickler that loads plain data only: any class or function reference (``find_class``) is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it references {module}.{name}; a snapshot holds plain data only "
                                     "(refused: unpickling it could run code)")


def load_snapshot(path: str, device: int = 0) -> dict[str, Any]:
    """Unpickle ``path`` as plain data (:class:`_PlainData`) and check it is a snapshot with a trace for ``device``.

    Raises:
        SnapshotError: the file cannot be read or unpickled, references a class or function, is not a dict with
            a ``device_traces`` list, has no trace for ``device``, or holds an event that is not a dict.
    """
    try:
        with open(path, "rb") as fh:
            snap = _PlainData(fh).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise SnapshotError(f"cannot read snapshot {path!r}: {exc}; pass a file written by "
                            "torch.cuda.memory._dump_snapshot") from None
    if not isinstance(snap, dict) or not isinstance(snap.get("device_traces"), list):
        what = type(snap).__name__ if not isinstance(snap, dict) else "a dict without a device_traces list"
        raise SnapshotError(f"{path!r} is not an allocator snapshot (it holds {what}); pass a file written by "
                            "torch.cuda.memory._dump_snapshot")
    traces = snap["device_traces"]
    if not 0 <= device < len(traces):
        raise SnapshotError(f"--device {device}: {path!r} has traces for devices 0..{len(traces) - 1}" if traces else
                            f"{path!r} has no device traces: record with torch.cuda.memory._record_memory_history "
                            "(ONECARD_MEMORY_HISTORY) before the run allocates")
    events = traces[device]
    if not isinstance(events, list) or not all(isinstance(ev, dict) for ev in events):
        raise SnapshotError(f"{path!r}: device_traces[{device}] is not a list of event dicts; pass a file written by "
                            "torch.cuda.memory._dump_snapshot")
    return snap
_OWN = ("cosmos_framework/", "cosmos_framework_ext/", "/patches/")


def _where(frames: Iterable[dict[str, Any]]) -> str:
    """The first (innermost) frame in upstream or onecard code, as ``path-from-package:line:function``."""
    for f in frames:
        name = f.get("filename", "")
        for marker in _OWN:
            i = name.find(marker)
            if i >= 0:
                return f"{name[i:].lstrip('/')}:{f.get('line')}:{f.get('name')}"
    return "(no upstream frame)"


def _top(frames: list[dict[str, Any]]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if name and not name.startswith("??"):
            i = name.find("torch/")
            short = name[i:] if i >= 0 else name.rsplit("/", 2)[-1]
            return f"{short}:{f.get('line')}:{f.get('name')}"
    return "(no frame)"


def analyse(snapshot: dict[str, Any], device: int = 0, points: int = 400, top_n: int = 15,
            max_allocated: int | None = None) -> dict[str, Any]:
    """Replay ``snapshot['device_traces'][device]``; see the module docstring for the report's keys.

    Args:
        snapshot: ``torch.cuda.memory._snapshot()`` (or the unpickled file ``_dump_snapshot`` wrote).
        device: CUDA device index.
        points: most timeline rows kept (every k-th event, plus the peak).
        top_n: groups listed per grouping at the peak.
        max_allocated: ``torch.cuda.max_memory_allocated`` of the same run, to check the replay (bytes).
    """
    traces = snapshot.get("device_traces") or []
    events = traces[device] if device < len(traces) else []
    live: dict[int, tuple[int, list]] = {}
    current = peak = 0
    peak_t = 0.0
    peak_live: dict[int, tuple[int, list]] = {}
    t0 = events[0].get("time_us", 0) if events else 0
    series: list[tuple[float, int]] = []
    ooms = []
    for ev in events:
        action, addr, size = ev.get("action"), ev.get("addr"), int(ev.get("size", 0))
        t = (ev.get("time_us", t0) - t0) / 1e6
        if action == "alloc":
            live[addr] = (size, ev.get("frames") or [])
            current += size
            if current > peak:
                peak, peak_t = current, t
                peak_live = dict(live)
        elif action == "free_requested" and addr in live:
            current -= live.pop(addr)[0]
        elif action == "oom":
            ooms.append({"t_s": round(t, 3), "requested_bytes": size,
                         "device_free_bytes": ev.get("device_free"), "where": _where(ev.get("frames") or [])})
        else:
            continue
        series.append((t, current))
    step = max(1, len(series) // max(points, 1))
    timeline = [(round(t, 3), round(b / GiB, 4)) for t, b in series[::step]]
    timeline.append((round(peak_t, 3), round(peak / GiB, 4)))
    timeline.sort()

    def grouped(key) -> list[dict[str, Any]]:
        acc: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for size, frames in peak_live.values():
            g = acc[key(frames)]
            g[0] += size
            g[1] += 1
        rows = sorted(acc.items(), key=lambda kv: -kv[1][0])[:top_n]
        return [{"group": k, "GiB": round(v[0] / GiB, 4), "bytes": v[0], "blocks": v[1]} for k, v in rows]

    return {
        "events": len(events),
        "peak_bytes": peak,
        "peak_GiB": round(peak / GiB, 4),
        "peak_t_s": round(peak_t, 3),
        "max_memory_allocated_GiB": None if max_allocated is None else round(max_allocated / GiB, 4),
        "complete": None if max_allocated is None else peak == max_allocated,
        "at_peak": {"where": grouped(_where), "top": grouped(_top)},
        "oom": ooms,
        "timeline": timeline,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("snapshot", help="a pickle written by torch.cuda.memory._dump_snapshot; only open snapshots "
                   "you made (plain data only is unpickled, but a hostile file can still exhaust memory)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index of the trace to replay")
    args = p.parse_args(argv)
    try:
        snap = load_snapshot(args.snapshot, args.device)
        try:
            report = analyse(snap, args.device)
        except (TypeError, ValueError, AttributeError) as exc:  # a field of the wrong type in an event
            raise SnapshotError(f"{args.snapshot!r}: a malformed event in device_traces[{args.device}] ({exc}); "
                                "pass a file written by torch.cuda.memory._dump_snapshot") from None
    except SnapshotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
