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
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from collections import defaultdict
from typing import Any, Iterable

GiB = 1 << 30
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
    p.add_argument("snapshot", help="a pickle written by torch.cuda.memory._dump_snapshot")
    p.add_argument("--device", type=int, default=0)
    args = p.parse_args(argv)
    try:
        with open(args.snapshot, "rb") as fh:
            snap = pickle.load(fh)
    except (OSError, pickle.UnpicklingError, EOFError) as exc:
        print(f"error: cannot read snapshot {args.snapshot!r}: {exc}", file=sys.stderr)
        return 2
    json.dump(analyse(snap, args.device), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
