"""Memory timeline sampler shared by every lever.

A :class:`MemorySampler` runs one daemon thread that, every ``interval_s`` seconds, records one row:

=========================  =====  ==================================================================
CSV column                 unit   source
=========================  =====  ==================================================================
``t_s``                    s      wall time since :meth:`MemorySampler.start` (``time.perf_counter``)
``phase``                  --     the innermost phase active when the row was taken (``idle`` if none)
``gpu_allocated_bytes``    bytes  ``allocated_bytes.all.current`` of ``torch.cuda.memory_stats``
                                  (= ``torch.cuda.memory_allocated``); 0 without CUDA
``gpu_reserved_bytes``     bytes  ``reserved_bytes.all.current`` (= ``torch.cuda.memory_reserved``)
``gpu_max_allocated_bytes`` bytes ``allocated_bytes.all.peak`` (= ``torch.cuda.max_memory_allocated``:
                                  the global peak the trainer reports; never reset here)
``nvml_used_bytes``        bytes  NVML ``used`` of the whole device (all processes, includes the CUDA
                                  context); empty when ``pynvml`` (package ``nvidia-ml-py``) is absent
                                  or fails, and on CPU
``host_rss_bytes``         bytes  resident set size of this process (``psutil``)
``pinned_bytes``           bytes  :func:`patches.core.host_arena.pinned_bytes_total`
=========================  =====  ==================================================================

One row is one read of the caching allocator's counters (``torch._C._cuda_memoryStats``, the nested dict
behind ``torch.cuda.memory_stats``, whose Python flattening costs 7x more; falls back to the public call),
one NVML query, one ``/proc/self/statm`` read (psutil) and one sum under the host-arena lock. The
allocator's mutex and the host-arena lock are held only while counters are copied; the sampler's own
lock only guards list appends. No lock the training thread waits on is held for long.

One row (``_sample``) and one phase transition each cost tens of microseconds, so at the default
``interval_s=0.5`` the sampler takes well under 0.1 % of one core and a handful of transitions per micro-batch add
well under 1 ms to a step. :attr:`MemorySampler.mean_sample_s` reports the per-row cost measured in the run itself.

Phases
------
:meth:`MemorySampler.phase` (context manager, nests; leaving restores the outer phase) and
:meth:`MemorySampler.mark` (plain setter) name what the training thread is doing. Every change of the
current phase is recorded as ``(t_s, phase)`` in :attr:`MemorySampler.transitions` (about 90 bytes
each; a few per micro-batch is fine for long runs).

Per-phase GPU peak, without disturbing the trainer's global peak: this module NEVER calls
``torch.cuda.reset_peak_memory_stats``. Instead, at every transition the training thread reads the
allocator's counters once (current allocated/reserved and the global peak) and:

* the allocated bytes at the boundary and every sample taken during the phase are lower bounds of the
  phase's peak (``gpu_allocated_bytes`` in :meth:`peaks` per phase, sample-based);
* the global peak is monotone, so if it rose while a phase was current, the new global peak WAS reached
  in that phase: an exact value for that visit. If it did not rise, the global peak at the end of the
  visit is an upper bound. Per phase, ``gpu_allocated_exact`` is True when an exact value is known and
  no other visit's upper bound exceeds it; then ``gpu_allocated_bytes`` is the exact peak over all
  visits. ``gpu_allocated_upper_bytes`` is the upper bound (None when unknown, e.g. the trainer reset the
  peak stats during the visit).

Other per-phase columns (reserved, NVML, RSS, pinned) are sample-based maxima (RSS and reserved are also
read at the boundaries): a phase shorter than ``interval_s`` may be missed by NVML/pinned.

Attribution is by time: memory allocated by another thread (an EMA worker, a prefetcher) counts toward
whatever phase the training thread is in. GPU numbers are the caching allocator's, which follow the host
order of allocations (kernels may still be running), the same view ``max_memory_allocated`` gives. If the
trainer itself resets the peak stats (``train.py`` does once before its loop), the visit spanning the
reset gets an unknown upper bound; later visits are exact-checked as usual.
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from .io import atomic_open
from .runtime import GiB

__all__ = ["MemorySampler", "COLUMNS", "IDLE"]

IDLE = "idle"
COLUMNS = (
    "t_s",
    "phase",
    "gpu_allocated_bytes",
    "gpu_reserved_bytes",
    "gpu_max_allocated_bytes",
    "nvml_used_bytes",
    "host_rss_bytes",
    "pinned_bytes",
)
_NUMERIC = COLUMNS[2:]  # the byte columns, in order


def _rss_reader():
    """A zero-argument callable returning this process's RSS in bytes (0 if psutil is missing)."""
    try:
        import psutil

        proc = psutil.Process(os.getpid())
        return lambda: int(proc.memory_info().rss)
    except Exception:  # psutil is a project dependency; be robust anyway
        return lambda: 0


def _pinned_total() -> int:
    from patches.core.host_arena import pinned_bytes_total

    return int(pinned_bytes_total())


class _PhaseStat:
    """Per-phase accumulators (all bytes unless noted)."""

    __slots__ = ("maxes", "samples", "seconds", "exact", "upper", "upper_unknown")

    def __init__(self) -> None:
        self.maxes: dict[str, int | None] = {c: None for c in _NUMERIC}
        self.samples = 0  # periodic rows taken while the phase was current
        self.seconds = 0.0  # s the phase was current (sum over visits)
        self.exact: int | None = None  # max over visits whose exact peak is known
        self.upper = 0  # max over visits without a global-peak rise of the global peak at visit end
        self.upper_unknown = False  # some visit saw the peak stats reset by someone else

    def bump(self, col: str, value: int | None) -> None:
        if value is None:
            return
        cur = self.maxes[col]
        if cur is None or value > cur:
            self.maxes[col] = value


class MemorySampler:
    """Background memory timeline of one device and this process's host memory.

    Args:
        device: the CUDA device to watch (``torch.device``, ``"cuda:0"``, ...). ``None`` picks the current
            CUDA device when CUDA is available, else CPU. On a non-CUDA device every GPU column is 0 and the
            NVML column is empty.
        interval_s: seconds between rows (> 0). The thread aims at ``start + k * interval_s`` and skips
            slots it fell behind on, so rows do not drift.

    Raises:
        ValueError: ``interval_s`` is not a finite number > 0 (pass e.g. ``interval_s=0.5``), or a CUDA
            device was asked for but CUDA is not available (pass ``device="cpu"`` or ``None``).

    Use as ``with MemorySampler(dev) as s: ...`` or ``s.start()`` / ``s.stop()``. One sampler runs once:
    calling :meth:`start` again raises ``RuntimeError`` (create a new sampler). Errors inside the sampling
    thread never reach the trainer: they are counted in :attr:`errors` (last one in :attr:`last_error`).
    """

    def __init__(self, device: torch.device | str | None = None, interval_s: float = 0.5):
        try:
            interval = float(interval_s)
        except (TypeError, ValueError):
            raise ValueError(f"interval_s must be a number of seconds > 0, got {interval_s!r}; pass e.g. interval_s=0.5") from None
        if not math.isfinite(interval) or interval <= 0:
            raise ValueError(f"interval_s must be a finite number of seconds > 0, got {interval_s!r}; pass e.g. interval_s=0.5")
        self.interval_s = interval
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {device} asked for but CUDA is not available; pass device='cpu' or None")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._is_cuda = device.type == "cuda"
        self.device_name = torch.cuda.get_device_name(device) if self._is_cuda else "cpu (no CUDA)"

        self._rss = _rss_reader()
        self._nvml = None  # pynvml module, once initialised
        self._nvml_handle = None
        self.nvml_note = "not on a CUDA device"

        self._lock = threading.Lock()  # guards rows / transitions / phase stats; held for appends only
        self._stop_evt = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        self._stopped = False
        self._t0 = 0.0

        self.rows: list[tuple] = []  # one tuple per row, in COLUMNS order
        self.transitions: list[tuple[float, str]] = []  # (t_s, phase) at every change of the current phase
        self._phase = IDLE
        self._phase_t = 0.0  # s, when the current phase became current
        self._phase_peak0 = 0  # bytes, global peak when the current phase became current
        self._stats: dict[str, _PhaseStat] = {}

        self.errors = 0
        self.last_error: str | None = None
        self._cost_sum = 0.0
        self._cost_n = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "MemorySampler":
        """Take the first row and start the daemon sampling thread. Returns ``self``.

        Raises:
            RuntimeError: the sampler was started before (create a new :class:`MemorySampler`).
        """
        if self._started:
            raise RuntimeError("MemorySampler.start() called twice; create a new MemorySampler for a new run")
        self._started = True
        self._init_nvml()
        self._t0 = time.perf_counter()
        _, _, peak = self._gpu_stats()
        with self._lock:
            self._phase_t = 0.0
            self._phase_peak0 = peak
            self.transitions.append((0.0, self._phase))
        self._sample()
        self._thread = threading.Thread(target=self._run, name="onecard-memory-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop and join the thread, take one final row and close the phase accounting. Idempotent."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        self._stop_evt.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        t = time.perf_counter() - self._t0
        alloc, reserved, peak = self._gpu_stats()
        with self._lock:
            self._close_visit(t, alloc, reserved, peak, self._safe_rss())
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
            self._nvml_handle = None

    @property
    def running(self) -> bool:
        """True while the sampling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> "MemorySampler":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()  # exceptions from the block propagate

    # ------------------------------------------------------------------ phases

    @property
    def current_phase(self) -> str:
        """The innermost active phase (``"idle"`` outside every phase)."""
        return self._phase

    def mark(self, name: str) -> None:
        """Set the current phase to ``name`` until the next mark or phase change (does not nest).

        Inside a :meth:`phase` block the mark lasts until the block ends, which restores the phase that
        was current when the block was entered. ``mark("idle")`` means "no phase".

        Raises:
            ValueError: ``name`` is not a non-empty string (pass e.g. ``"forward"``).
        """
        self._check_name(name)
        self._switch(name)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Context manager: ``name`` is the current phase inside the block; the outer one is restored after.

        Raises:
            ValueError: ``name`` is not a non-empty string (pass e.g. ``"forward"``).
        """
        self._check_name(name)
        outer = self._phase
        self._switch(name)
        try:
            yield
        finally:
            self._switch(outer)

    @staticmethod
    def _check_name(name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name must be a non-empty string, got {name!r}; pass e.g. 'forward'")

    def _switch(self, name: str) -> None:
        """Make ``name`` current (training thread). Cost: one memory_stats call + one RSS read."""
        if name == self._phase and self._started:
            return
        if not self._started or self._stopped:
            self._phase = name
            return
        t = time.perf_counter() - self._t0
        alloc, reserved, peak = self._gpu_stats()
        rss = self._safe_rss()
        with self._lock:
            self._close_visit(t, alloc, reserved, peak, rss)
            self._phase = name
            self._phase_t = t
            self._phase_peak0 = peak
            st = self._stat(name)
            st.bump("gpu_allocated_bytes", alloc)
            st.bump("gpu_reserved_bytes", reserved)
            st.bump("host_rss_bytes", rss)
            self.transitions.append((t, name))

    def _close_visit(self, t: float, alloc: int, reserved: int, peak: int, rss: int | None) -> None:
        """Fold the visit of the current phase that ends at ``t`` into its stats (caller holds the lock)."""
        st = self._stat(self._phase)
        st.seconds += max(0.0, t - self._phase_t)
        st.bump("gpu_allocated_bytes", alloc)
        st.bump("gpu_reserved_bytes", reserved)
        st.bump("host_rss_bytes", rss)
        if not self._is_cuda:
            return
        if peak > self._phase_peak0:  # the global peak rose during this visit: it was reached here
            st.exact = peak if st.exact is None else max(st.exact, peak)
        elif peak == self._phase_peak0:  # no rise: the visit's peak is <= the global peak
            st.upper = max(st.upper, peak)
        else:  # someone reset the peak stats during the visit
            st.upper_unknown = True
        self._phase_peak0 = peak

    def _stat(self, name: str) -> _PhaseStat:
        st = self._stats.get(name)
        if st is None:
            st = self._stats[name] = _PhaseStat()
        return st

    # ------------------------------------------------------------------ sampling

    def _init_nvml(self) -> None:
        if not self._is_cuda:
            return
        try:
            import pynvml  # package nvidia-ml-py

            pynvml.nvmlInit()
        except Exception as e:  # absent or no driver: the column stays empty
            self.nvml_note = f"NVML unavailable ({type(e).__name__}: {e})"
            return
        handle = None
        try:  # the UUID is robust to CUDA_VISIBLE_DEVICES reordering
            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid)
        except Exception:
            try:
                idx = torch.cuda._get_nvml_device_index(self.device)  # type: ignore[attr-defined]
            except Exception:
                idx = self.device.index
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(idx)
            except Exception as e:
                self.nvml_note = f"NVML handle not found ({type(e).__name__}: {e})"
        if handle is None:
            try:
                pynvml.nvmlShutdown()
            except Exception:
                pass
            return
        self._nvml, self._nvml_handle = pynvml, handle
        self.nvml_note = "ok"

    def _gpu_stats(self) -> tuple[int, int, int]:
        """(allocated, reserved, max_allocated) bytes of the watched device; zeros without CUDA.

        Reads ``torch.cuda.memory_stats`` once; does not initialise CUDA (returns zeros before init).
        """
        if not self._is_cuda or not torch.cuda.is_initialized():
            return 0, 0, 0
        try:  # fast path: the allocator's nested dict, without memory_stats' Python flattening (~5x cheaper)
            st = torch._C._cuda_memoryStats(self.device.index)
            return (int(st["allocated_bytes"]["all"]["current"]), int(st["reserved_bytes"]["all"]["current"]),
                    int(st["allocated_bytes"]["all"]["peak"]))
        except Exception:
            pass
        try:
            st = torch.cuda.memory_stats(self.device)
        except Exception:
            return 0, 0, 0
        return (int(st.get("allocated_bytes.all.current", 0)), int(st.get("reserved_bytes.all.current", 0)),
                int(st.get("allocated_bytes.all.peak", 0)))

    def _safe_rss(self) -> int | None:
        try:
            return self._rss()
        except Exception:
            return None

    def _nvml_used(self) -> int | None:
        if self._nvml is None:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._nvml_handle).used)
        except Exception:
            return None

    def _sample(self) -> None:
        """Take one row (any thread). Never raises."""
        c0 = time.perf_counter()
        try:
            phase = self._phase
            alloc, reserved, peak = self._gpu_stats()
            nvml = self._nvml_used()
            rss = self._safe_rss()
            try:
                pinned: int | None = _pinned_total()
            except Exception:
                pinned = None
            t = time.perf_counter() - self._t0
            row = (t, phase, alloc, reserved, peak, nvml, rss, pinned)
            with self._lock:
                self.rows.append(row)
                st = self._stat(phase)
                st.samples += 1
                for col, v in zip(_NUMERIC, row[2:]):
                    st.bump(col, v)
        except Exception as e:  # never let the sampler hurt training
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
        self._cost_sum += time.perf_counter() - c0
        self._cost_n += 1

    def _run(self) -> None:
        k = 1
        while True:
            target = self._t0 + k * self.interval_s
            delay = target - time.perf_counter()
            if delay > 0 and self._stop_evt.wait(delay):
                return
            if self._stop_evt.is_set():
                return
            self._sample()
            # next slot strictly in the future (skip the ones we fell behind on)
            k = max(k + 1, int((time.perf_counter() - self._t0) / self.interval_s) + 1)

    @property
    def mean_sample_s(self) -> float:
        """Mean seconds one row took to collect (measured in this run); 0.0 before any row."""
        return self._cost_sum / self._cost_n if self._cost_n else 0.0

    # ------------------------------------------------------------------ results

    def peaks(self) -> dict:
        """Maxima of the timeline (bytes) and per-phase peaks.

        Returns a dict with one key per byte column of :data:`COLUMNS` (max over rows; ``None`` when no
        row has a value, e.g. ``nvml_used_bytes`` without NVML), and:

        * ``"phases"``: ``{phase: {<byte column>: max over rows in the phase (and boundary readings for
          gpu allocated/reserved and RSS) or None, "gpu_allocated_exact": bool,
          "gpu_allocated_upper_bytes": int | None, "seconds": s current, "samples": rows}}``.
          ``gpu_allocated_bytes`` of a phase is a lower bound of its true peak, and equal to it when
          ``gpu_allocated_exact`` (see the module docstring).
        * ``"sampler"``: ``{"rows", "duration_s", "interval_s", "mean_sample_s", "errors", "last_error",
          "nvml", "device"}``.

        May be called while running (a consistent snapshot; the current phase's open visit is not folded
        in for the exact/upper/seconds fields until it ends).
        """
        with self._lock:
            rows = list(self.rows)
            stats = {k: (dict(v.maxes), v.samples, v.seconds, v.exact, v.upper, v.upper_unknown)
                     for k, v in self._stats.items()}
        out: dict[str, Any] = {}
        for i, col in enumerate(_NUMERIC, start=2):
            vals = [r[i] for r in rows if r[i] is not None]
            out[col] = max(vals) if vals else None
        phases: dict[str, dict] = {}
        for name, (maxes, n, secs, exact, upper, unknown) in stats.items():
            d: dict[str, Any] = dict(maxes)
            lower = d["gpu_allocated_bytes"]
            if exact is not None:
                lower = exact if lower is None else max(lower, exact)
            d["gpu_allocated_bytes"] = lower
            if not self._is_cuda:
                d["gpu_allocated_exact"] = False
                d["gpu_allocated_upper_bytes"] = None
            else:
                d["gpu_allocated_exact"] = exact is not None and not unknown and exact >= upper
                d["gpu_allocated_upper_bytes"] = None if unknown else max(upper, exact or 0)
            d["seconds"] = secs
            d["samples"] = n
            phases[name] = d
        out["phases"] = phases
        out["sampler"] = {
            "rows": len(rows),
            "duration_s": rows[-1][0] if rows else 0.0,
            "interval_s": self.interval_s,
            "mean_sample_s": self.mean_sample_s,
            "errors": self.errors,
            "last_error": self.last_error,
            "nvml": self.nvml_note,
            "device": self.device_name,
        }
        return out

    def write(self, out_dir: Path | str, stem: str = "memory") -> dict[str, Path]:
        """Write ``<stem>.csv`` and ``<stem>.png`` into ``out_dir`` (created if missing), each atomically.

        The CSV has a header row (:data:`COLUMNS`; seconds and bytes, empty cell = not available) and one
        row per sample. The PNG shows GPU allocated / reserved / max_allocated / NVML used (GiB, top) and
        host RSS + pinned (GiB, bottom) over time (s) with the phases as shaded spans. May be called while
        running (writes a snapshot).

        Returns:
            ``{"csv": path, "png": path}``; ``"png"`` is missing (with a warning) when matplotlib is not
            installed (``pip install matplotlib``).

        Raises:
            OSError: ``out_dir`` cannot be created or written.
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            rows = list(self.rows)
            transitions = list(self.transitions)
        paths: dict[str, Path] = {}
        csv_path = out_dir / f"{stem}.csv"
        with atomic_open(csv_path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(COLUMNS)
            for r in rows:
                w.writerow([f"{r[0]:.6f}", r[1], *("" if v is None else int(v) for v in r[2:])])
        paths["csv"] = csv_path
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            warnings.warn("matplotlib is not installed: memory plot skipped (pip install matplotlib)", stacklevel=2)
            return paths
        png_path = out_dir / f"{stem}.png"
        fig = self._figure(rows, transitions)
        with atomic_open(png_path, "wb") as f:
            fig.savefig(f, format="png", dpi=110)
        paths["png"] = png_path
        return paths

    def _figure(self, rows: list[tuple], transitions: list[tuple[float, str]]):
        # Figure + FigureCanvasAgg directly: the Agg backend, no pyplot global state, safe off the main thread.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        fig = Figure(figsize=(12, 6.5))
        FigureCanvasAgg(fig)
        ax_g, ax_h = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
        t = [r[0] for r in rows]

        def series(i: int) -> list[float]:
            return [math.nan if r[i] is None else r[i] / GiB for r in rows]

        ax_g.plot(t, series(2), label="GPU allocated", color="tab:blue", lw=1.4)
        ax_g.plot(t, series(3), label="GPU reserved", color="tab:orange", lw=1.2)
        ax_g.plot(t, series(4), label="GPU max_allocated (global peak)", color="tab:blue", lw=0.9, ls="--")
        if any(r[5] is not None for r in rows):
            ax_g.plot(t, series(5), label="NVML used (whole device)", color="tab:red", lw=1.0)
        ax_g.set_ylabel("GPU memory (GiB)")
        ax_h.plot(t, series(6), label="host RSS", color="tab:green", lw=1.4)
        ax_h.plot(t, series(7), label="pinned (host arenas)", color="tab:purple", lw=1.2)
        ax_h.set_ylabel("host memory (GiB)")
        ax_h.set_xlabel("time since start (s)")
        for ax in (ax_g, ax_h):
            top = ax.get_ylim()[1]
            ax.set_ylim(0, max(top, 1e-3) * 1.25)  # headroom so the legends do not cover the curves
            ax.grid(True, alpha=0.3)

        # phase spans: one BrokenBarH collection per phase name (cheap even with many transitions)
        end = max(t[-1] if t else 0.0, transitions[-1][0] if transitions else 0.0)
        spans: dict[str, list[tuple[float, float]]] = {}
        for (t_a, name), nxt in zip(transitions, transitions[1:] + [(end, None)]):
            if name != IDLE and nxt[0] > t_a:
                spans.setdefault(name, []).append((t_a, nxt[0] - t_a))
        cmap = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                "#bcbd22", "#17becf"]
        handles = []
        for i, (name, segs) in enumerate(sorted(spans.items())):
            color = cmap[i % len(cmap)]
            for ax in (ax_g, ax_h):
                lo, hi = ax.get_ylim()
                ax.broken_barh(segs, (lo, hi - lo), facecolors=color, alpha=0.13, zorder=0, lw=0, antialiased=False)
                ax.set_ylim(lo, hi)
            handles.append(Patch(facecolor=color, alpha=0.35, label=name))
        leg = ax_g.legend(loc="upper left", fontsize=8)
        if handles:
            ax_g.add_artist(leg)
            ax_g.legend(handles=handles, loc="upper right", fontsize=8, title="phase", title_fontsize=8,
                        ncol=max(1, math.ceil(len(handles) / 6)))
        ax_h.legend(loc="upper left", fontsize=8)
        peak = max((r[4] for r in rows), default=0) / GiB
        rss = max((r[6] for r in rows if r[6] is not None), default=0) / GiB
        fig.suptitle(f"memory timeline - {self.device_name}  (peak GPU allocated {peak:.2f} GiB, "
                     f"peak host RSS {rss:.2f} GiB, {len(rows)} samples every {self.interval_s:g} s)", fontsize=10)
        fig.tight_layout()
        return fig
