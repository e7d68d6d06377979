"""benchmarks/upstream/memtimeline.py: the replay finds the peak and names what was live at it."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "memtimeline", Path(__file__).resolve().parents[1] / "benchmarks" / "upstream" / "memtimeline.py")
memtimeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memtimeline)

W = [{"filename": "/x/site/torch/optim/adamw.py", "line": 10, "name": "_init_group"},
     {"filename": "/ck/cosmos_framework/utils/generator/optimizer.py", "line": 7, "name": "step"}]
A = [{"filename": "/x/torch/nn/functional.py", "line": 3, "name": "linear"},
     {"filename": "/ck/cosmos_framework/model/generator/mot/net.py", "line": 99, "name": "forward"}]


def ev(action, addr, size, t, frames=()):
    return {"action": action, "addr": addr, "size": size, "time_us": t * 1_000_000, "frames": list(frames)}


def test_peak_and_groups():
    trace = [ev("segment_alloc", 0, 1 << 30, 0), ev("alloc", 1, 100, 1, W), ev("alloc", 2, 50, 2, A),
             ev("alloc", 3, 30, 3, A), ev("free_requested", 2, 50, 4), ev("free_completed", 2, 50, 5),
             ev("alloc", 4, 10, 6, A), ev("oom", 0, 999, 7)]
    rep = memtimeline.analyse({"device_traces": [trace]}, max_allocated=180)
    assert rep["peak_bytes"] == 180 and rep["complete"] is True
    assert rep["peak_t_s"] == 3.0
    where = {g["group"]: g["bytes"] for g in rep["at_peak"]["where"]}
    assert round(where["cosmos_framework/model/generator/mot/net.py:99:forward"]) == 80
    assert round(where["cosmos_framework/utils/generator/optimizer.py:7:step"]) == 100
    assert rep["at_peak"]["top"][0]["group"] == "torch/optim/adamw.py:10:_init_group"
    assert rep["oom"] and rep["oom"][0]["requested_bytes"] == 999
    # a trace that lost its start (ring buffer overflow) does not match the allocator's own peak
    assert memtimeline.analyse({"device_traces": [trace[2:]]}, max_allocated=180)["complete"] is False
