"""patches.core.sampler.MemorySampler: CSV/PNG output, thread lifecycle, phases, RSS response (CPU, fast)."""

from __future__ import annotations

import csv
import sys
import time
import types

import psutil
import pytest
import torch

from patches.core.sampler import COLUMNS, IDLE, MemorySampler

PNG_SIG = b"\x89PNG\r\n\x1a\n"
MB = 10**6


def _run(tmp_path, seconds=0.3, interval=0.05):
    with MemorySampler("cpu", interval_s=interval) as s:
        with s.phase("encode"):
            time.sleep(seconds / 3)
        with s.phase("forward"):
            time.sleep(seconds / 3)
        time.sleep(seconds / 3)
    return s, s.write(tmp_path)


def test_writes_valid_csv_and_png(tmp_path):
    s, paths = _run(tmp_path)
    assert set(paths) == {"csv", "png"}
    assert paths["csv"] == tmp_path / "memory.csv" and paths["png"] == tmp_path / "memory.png"

    with open(paths["csv"], newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == COLUMNS
    body = rows[1:]
    assert len(body) >= 2
    times = [float(r[0]) for r in body]
    assert all(b >= a for a, b in zip(times, times[1:])), times
    assert times[-1] >= 0.25  # final row is taken at stop
    for r in body:
        assert len(r) == len(COLUMNS)
        assert r[1] in {IDLE, "encode", "forward"}
        assert int(r[2]) == int(r[3]) == int(r[4]) == 0  # no CUDA here
        assert r[5] == ""  # no NVML on CPU
        assert int(r[6]) > 50 * MB  # python + torch RSS
        assert int(r[7]) >= 0
    assert {"encode", "forward"} <= {r[1] for r in body}

    data = paths["png"].read_bytes()
    assert data.startswith(PNG_SIG)
    assert len(data) > 10_000
    import matplotlib.image

    img = matplotlib.image.imread(paths["png"])
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 600


def test_write_leaves_no_temp_files(tmp_path):
    s, _ = _run(tmp_path, seconds=0.15)
    s.write(tmp_path, stem="again")  # second write, other stem
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.csv", "again.png", "memory.csv", "memory.png"]


def test_write_failure_removes_temp(tmp_path, monkeypatch):
    s, _ = _run(tmp_path / "a", seconds=0.1)

    def boom(*a, **k):
        raise RuntimeError("planted plot failure")

    monkeypatch.setattr(MemorySampler, "_figure", boom)
    with pytest.raises(RuntimeError, match="planted"):
        s.write(tmp_path / "b")
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["memory.csv"]  # csv done, no png temp


def test_thread_stops_with_the_run(tmp_path):
    s = MemorySampler("cpu", interval_s=0.05)
    s.start()
    assert s.running
    thread = s._thread
    s.stop()
    assert not thread.is_alive() and not s.running
    n = len(s.rows)
    s.stop()  # idempotent
    assert len(s.rows) == n
    with pytest.raises(RuntimeError, match="new MemorySampler"):
        s.start()

    with MemorySampler("cpu", interval_s=0.05) as s2:
        assert s2.running
    assert not s2._thread.is_alive()


def test_thread_stops_when_block_raises():
    with pytest.raises(KeyError):
        with MemorySampler("cpu", interval_s=0.05) as s:
            with s.phase("forward"):
                raise KeyError("boom")
    assert not s._thread.is_alive()
    assert s.current_phase == IDLE  # phase restored on the way out
    assert s.peaks()["phases"]["forward"]["seconds"] >= 0


def test_stop_is_prompt():
    s = MemorySampler("cpu", interval_s=5.0).start()
    t0 = time.perf_counter()
    s.stop()
    assert time.perf_counter() - t0 < 1.0  # the wait is interrupted, not slept out


def test_phases_recorded_and_nested():
    with MemorySampler("cpu", interval_s=0.02) as s:
        with s.phase("step"):
            with s.phase("forward"):
                assert s.current_phase == "forward"
                time.sleep(0.05)
            assert s.current_phase == "step"
            with s.phase("backward"):
                time.sleep(0.05)
            s.mark("optimizer")
            assert s.current_phase == "optimizer"
            time.sleep(0.03)
        assert s.current_phase == IDLE
        s.mark("checkpoint")
        time.sleep(0.03)
    names = [p for _, p in s.transitions]
    assert names == [IDLE, "step", "forward", "step", "backward", "step", "optimizer", IDLE, "checkpoint"]
    ts = [t for t, _ in s.transitions]
    assert all(b >= a for a, b in zip(ts, ts[1:]))
    pk = s.peaks()
    assert set(pk["phases"]) == {IDLE, "step", "forward", "backward", "optimizer", "checkpoint"}
    for name, d in pk["phases"].items():
        for col in COLUMNS[2:]:
            assert col in d
        assert {"gpu_allocated_exact", "gpu_allocated_upper_bytes", "seconds", "samples"} <= set(d)
        assert d["host_rss_bytes"] > 0  # boundary readings cover even phases with no periodic row
    assert pk["phases"]["forward"]["seconds"] >= 0.04
    assert pk["phases"]["forward"]["samples"] >= 1
    for col in COLUMNS[2:]:
        assert col in pk
    assert pk["nvml_used_bytes"] is None and pk["gpu_allocated_bytes"] == 0
    assert pk["sampler"]["rows"] == len(s.rows) and pk["sampler"]["errors"] == 0


@pytest.mark.parametrize("bad", [0, -1, 0.0, float("nan"), float("inf"), "x", None])
def test_bad_interval_raises(bad):
    with pytest.raises(ValueError, match="interval_s"):
        MemorySampler("cpu", interval_s=bad)


def test_bad_phase_name_raises():
    s = MemorySampler("cpu")
    with pytest.raises(ValueError, match="phase name"):
        s.mark("")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_without_cuda_raises():
    with pytest.raises(ValueError, match="device='cpu'"):
        MemorySampler("cuda:0")


def test_rss_column_responds_to_allocation():
    proc = psutil.Process()
    with MemorySampler("cpu", interval_s=0.05) as s:
        time.sleep(0.05)
        baseline = proc.memory_info().rss
        with s.phase("noalloc"):  # negative control: same duration, nothing allocated
            time.sleep(0.2)
        with s.phase("alloc"):
            x = torch.ones(50_000_000, dtype=torch.float32)  # 200 MB, pages touched
            time.sleep(0.2)
            del x
        time.sleep(0.1)
    ph = s.peaks()["phases"]
    assert ph["alloc"]["samples"] >= 2
    assert ph["alloc"]["host_rss_bytes"] >= baseline + 150 * MB, (ph["alloc"]["host_rss_bytes"] - baseline) / MB
    assert ph["noalloc"]["host_rss_bytes"] < baseline + 150 * MB
    assert s.peaks()["host_rss_bytes"] >= baseline + 150 * MB


def test_sampling_errors_never_reach_the_trainer(monkeypatch):
    import patches.core.sampler as sm

    def broken():
        raise RuntimeError("planted pinned failure")

    monkeypatch.setattr(sm, "_pinned_total", broken)
    with MemorySampler("cpu", interval_s=0.02) as s:
        time.sleep(0.08)
    assert len(s.rows) >= 2 and all(r[7] is None for r in s.rows)  # column empty, rows still taken
    assert s.errors == 0


def test_broken_nvml_is_ignored(monkeypatch):
    fake = types.ModuleType("pynvml")

    def fail():
        raise OSError("planted: no NVML library")

    fake.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    s = MemorySampler("cpu", interval_s=0.02)
    s._is_cuda = True  # force the NVML path without a GPU (GPU stats still 0: CUDA not initialised)
    with s:
        time.sleep(0.05)
    assert s.nvml_note.startswith("NVML unavailable") and all(r[5] is None for r in s.rows)


def test_overhead_under_one_percent():
    """Mean cost of one row must be < 1 % of the default 0.5 s interval (i.e. < 5 ms)."""
    s = MemorySampler("cpu", interval_s=0.01)
    s.start()
    time.sleep(0.3)
    s.stop()
    assert s.mean_sample_s < 0.01 * 0.5, s.mean_sample_s
    # and the timestamps keep the schedule (no drift beyond a few intervals over the run)
    assert len(s.rows) >= 10
