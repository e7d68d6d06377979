"""``benchmarks/queue_depth.py``: the GPU's lag behind the host at each mark of one step (hand-made marks and a fake
clock and event pair with known answers), and ``edge_24gb.py --queue-depth`` end to end as a CPU smoke."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch

from benchmarks import queue_depth as qd
from benchmarks.checks import result_stem

ROW = "all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached"
FULL = "all levers + optimizer-state streaming"
"""A row under full activation checkpointing: the recompute calls each layer again from the backward's thread."""


def exit_status(main, argv) -> int:
    """``main(argv)``'s exit status: its return value, or the status of the ``SystemExit`` argparse raised."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_lags_per_mark_in_the_order_seen():
    s = 1e-3  # marks in seconds from the step's start: (micro-batch, name, host, GPU)
    marks = [(0, "start", 0 * s, 0 * s), (0, "forward in", 4 * s, 4.05 * s), (0, "layer 0 forward", 5 * s, 9 * s),
             (0, "end", 20 * s, 30 * s),
             (1, "start", 21 * s, 31 * s), (1, "forward in", 30 * s, 30.03 * s), (1, "layer 0 forward", 31 * s, 33 * s),
             (1, "end", 41 * s, 45 * s),
             (None, "optimizer in", 42 * s, 46 * s)]
    q = qd.summarize(marks)
    assert q["micro_batches"] == 2
    names = [m["name"] for m in q["marks"]]
    assert names == ["start", "forward in", "layer 0 forward", "end"]
    fwd = q["marks"][1]
    assert fwd["host_ms"] == pytest.approx((4 + 9) / 2)  # from each micro-batch's own start
    assert fwd["lag_ms"] == pytest.approx((0.05 + 0.03) / 2) and fwd["lag_min_ms"] == pytest.approx(0.03)
    assert fwd["starved"] == 2 and fwd["of"] == 2  # both within STARVED_MS: the GPU had caught up there
    layer = q["marks"][2]
    assert layer["lag_ms"] == pytest.approx(3.0) and layer["starved"] == 0
    per = [{k: v for k, v in m.items() if k != "marks"} for m in q["per_micro_batch"]]
    # idle at most: micro-batch 0, lags 0 / 0.05 / 4 ms at host 0 / 4 / 5 ms, end at 20: (4 - 0) + (1 - 0.05) + (15 - 4)
    # = 15.95 ms; micro-batch 1, lags 10 / 0.03 / 2 at host 21 / 30 / 31, end at 41: 0 + 0.97 + 8 = 8.97 ms
    assert per == [{"micro": 0, "wall_ms": pytest.approx(20.0), "starved_marks": ["start", "forward in"],
                    "idle_bound_ms": pytest.approx(15.95)},
                   {"micro": 1, "wall_ms": pytest.approx(20.0), "starved_marks": ["forward in"],
                    "idle_bound_ms": pytest.approx(8.97)}]
    assert q["per_micro_batch"][1]["marks"][0] == ["start", 0.0, pytest.approx(10.0)]
    assert q["optimizer"] == [{"name": "optimizer in", "host_ms": pytest.approx(42.0), "lag_ms": pytest.approx(4.0)}]
    md = qd.markdown_table(q)
    assert "| forward in | 6.5 | 0.04 | 0.03 | 2 of 2 |" in md and "| layer 0 forward | 7.5 | 3.00 | 2.00 | 0 of 2 |" in md
    assert "| every layer forward (smallest) | | | 2.00 | |" in md and "optimizer in at 42.0 ms, lag 4.00 ms" in md
    assert "per micro-batch (ms, from its marks' lags): 15.9, 9.0 (mean 12.5)" in md


def test_a_lag_at_the_threshold_counts_as_caught_up_and_marks_go_in_host_order():
    # 0.0001 s apart: a lag of exactly STARVED_MS (0.1 ms) counts; a backward mark recorded on the autograd thread
    # may be appended after a later main-thread mark: the bound walks the marks in host order
    assert 1e3 * 0.0001 == qd.STARVED_MS
    q = qd.summarize([(0, "start", 0.0, 0.0001), (0, "end", 0.010, 0.010), (0, "layer 0 backward", 0.004, 0.009)])
    assert q["marks"][0]["starved"] == 1 and q["per_micro_batch"][0]["starved_marks"] == ["start", "end"]
    assert [m[0] for m in q["per_micro_batch"][0]["marks"]] == ["start", "layer 0 backward", "end"]
    # start -> backward: 4 ms apart, lag 0.1 -> 3.9; backward -> end: 6 ms apart, lag 5 -> 1.0
    assert q["per_micro_batch"][0]["idle_bound_ms"] == pytest.approx(4.9)


def test_the_measured_part_leaves_out_the_warm_up_steps(edge_bench):
    assert edge_bench.measured_part(2, 8) == (slice(16, None), slice(2, None))
    assert edge_bench.measured_part(3, 8) == (slice(24, None), slice(3, None))
    assert edge_bench.measured_part(1, 61) == (slice(61, None), slice(1, None))


def test_without_events_the_lags_are_none():
    q = qd.summarize([(0, "start", 0.0, None), (0, "end", 0.01, None)])
    assert q["marks"][1] == {"name": "end", "host_ms": pytest.approx(10.0), "lag_ms": None, "lag_min_ms": None,
                             "starved": None, "of": 1}
    assert "| end | 10.0 | – | – | – |" in qd.markdown_table(q)


@pytest.mark.parametrize("marks, match", [([(None, "optimizer in", 0.0, 0.0)], "no mark inside a micro-batch"),
                                          ([(3, "end", 0.0, 0.0)], "micro-batch 3 has no start mark")])
def test_marks_that_say_nothing_are_refused(marks, match):
    with pytest.raises(ValueError, match=match):
        qd.summarize(marks)


def test_only_every_seventh_layer_and_the_last_are_shown():
    marks = [(0, "start", 0.0, 0.0)] + [(0, f"layer {i} forward", 1e-3 * (i + 1), 2e-3 * (i + 1)) for i in range(28)]
    md = qd.markdown_table(qd.summarize(marks))
    shown = [i for i in range(28) if f"| layer {i} forward |" in md]
    assert shown == [0, 7, 14, 21, 27]
    assert "| every layer forward (smallest) | | | 1.00 | |" in md  # layer 0: 2 ms - 1 ms, the smallest of all 28


class FakeEvent:
    """A CUDA event on a fake clock: the GPU reaches it ``behind`` s after the host records it."""

    now = [0.0]
    behind = 0.0

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = self.now[0] + FakeEvent.behind

    def elapsed_time(self, other):  # ms, as torch.cuda.Event does
        return 1e3 * (other.t - self.t)


def test_the_clocks_are_tied_at_the_step_start(monkeypatch):
    """The probe on a fake CUDA device: each mark's lag is the GPU time minus the host time, both from the step's first
    event (the GPU reaches it when the host reads its clock, nothing being queued): the GPU time is the events' elapsed
    time, the host time the clock reading less the first one. Host times left as raw clock readings (the clocks not
    tied) would give every lag minus the host clock's reading at the start (here -100 s)."""
    clock = FakeEvent.now
    clock[0] = 100.0
    monkeypatch.setattr(qd.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    class Mem:
        @contextlib.contextmanager
        def phase(self, name):
            yield

    def micro_batch(it, micro):
        clock[0] += 0.001
        FakeEvent.behind = 0.002 if micro == 0 else 0.0  # micro-batch 1: the GPU waits for the host
        with recipe.mem.phase("forward"):
            clock[0] += 0.001
        return 1, None

    def train_step(it):
        FakeEvent.behind = 0.0  # the step starts with nothing queued
        for m in range(2):
            recipe._micro_batch(it, m)

    recipe = SimpleNamespace(device=torch.device("cuda"), mem=Mem(), train_step=train_step, _micro_batch=micro_batch,
                             _build_model=lambda: None, model=torch.nn.Module())
    probe = qd.QueueDepth(recipe, iteration=1)
    recipe.train_step(0)  # not the probed step: no marks
    assert probe.result is None
    recipe.train_step(1)
    q = probe.result
    by = {m["name"]: m for m in q["marks"]}
    assert by["forward in"]["lag_ms"] == pytest.approx(1.0)  # mean of 2 ms (micro-batch 0) and 0 (micro-batch 1)
    assert by["forward in"]["lag_min_ms"] == pytest.approx(0.0, abs=1e-9) and by["forward in"]["starved"] == 1
    # micro-batch 0 starts on the tied clocks with nothing queued (lag 0); micro-batch 1 while micro-batch 0's 2 ms run
    assert by["start"]["lag_min_ms"] == pytest.approx(0.0, abs=1e-9) and by["start"]["lag_ms"] == pytest.approx(1.0)
    assert q["per_micro_batch"][1]["starved_marks"] == ["forward in", "forward out", "end"]


def test_gc_pauses_count_only_the_measured_steps():
    import gc

    def train_step(it):
        gc.collect()  # one full (generation 2) collection per step

    recipe = SimpleNamespace(train_step=train_step)
    pauses = qd.GcPauses(recipe, first=1)
    for it in range(3):
        recipe.train_step(it)
    r = pauses.result
    assert r["collections"] == {"0": 0, "1": 0, "2": 2} and r["steps"] == 2  # steps 1 and 2, not the warm-up step 0
    assert r["pause_s"]["2"] > 0 and r["longest_s"] > 0 and r["pause_s"]["0"] == 0
    assert pauses._callback not in gc.callbacks  # removed after each step


def test_queue_depth_smoke_adds_a_marked_row(edge_bench, tmp_path, edge_smoke_env):
    assert edge_bench.main(["--smoke", "--steps", "2", "--grad-accum", "2", "--only", ROW, "--queue-depth", FULL,
                            "--repeat", "2", "--out", str(tmp_path)]) == 0
    stem = result_stem("cosmos", "edge24gb", "cpu", smoke=True)
    rows = json.loads((tmp_path / f"{stem}.json").read_text())["rows"]
    assert [r["config"] for r in rows] == [ROW, ROW + " (run 2)", FULL + " (queue depth)"]
    assert rows[1]["micro_batch_s"] and rows[1]["tokens_per_micro_batch"] == rows[0]["tokens_per_micro_batch"]
    rows = [rows[0], rows[2]]
    q = rows[1]["queue_depth"]
    assert "queue_depth" not in rows[0] and q["micro_batches"] == 2
    assert all(set(r["gc"]) == {"steps", "collections", "pause_s", "longest_s"} for r in rows)
    assert all(r["gc"]["steps"] == 1 for r in rows)  # --steps 2: step 1 warms up, step 2 is measured
    from cosmos_framework_ext.recipe.presets import get_preset

    layers = get_preset("tiny").transformer["num_hidden_layers"]
    names = [m["name"] for m in q["marks"]]
    assert names[:4] == ["start", "encode in", "encode out", "forward in"]
    assert [f"layer {i} forward" for i in range(layers)] == [n for n in names if n.endswith(" forward")]
    # the backward reaches the layers last to first
    assert [n for n in names if n.endswith(" backward")] == [f"layer {i} backward" for i in reversed(range(layers))]
    assert names[-2:] == ["backward out", "end"] and all(m["lag_ms"] is None for m in q["marks"])
    # one forward mark per layer and micro-batch: the full checkpoint's recompute (the backward's thread) is not one
    assert all(m["of"] == q["micro_batches"] for m in q["marks"] if m["name"].startswith("layer "))
    assert all([n for n, *_ in mb["marks"]].index("backward in") > max(
        i for i, (n, *_) in enumerate(mb["marks"]) if n.endswith(" forward")) for mb in q["per_micro_batch"])
    assert [o["name"] for o in q["optimizer"]][:2] == ["optimizer in", "optimizer out"]
    md = (tmp_path / f"{stem}.md").read_text()
    assert f"How far the GPU runs behind the host: {FULL} (queue depth)" in md


@pytest.mark.parametrize("value", ["0", "6", "-1", "two"])
def test_repeat_is_one_to_five_runs(edge_bench, tmp_path, value, capsys):
    assert exit_status(edge_bench.main, ["--smoke", "--grad-accum", "1", "--repeat", value, "--out", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error:") and "--repeat" in line and not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, flag", [
    (["--warmup", "0"], "--warmup: '0' is not a whole number from 1 to 100"),
    (["--warmup", "2", "--steps", "2"], "--steps = 2 must be >= 3"),
    (["--warmup=-1"], "--warmup: '-1' is not a whole number from 1 to 100"),
    (["--warmup", "101"], "--warmup: '101' is not a whole number from 1 to 100"),
    (["--steps", "1001"], "--steps: '1001' is not a whole number from 1 to 1000"),
    (["--grad-accum", "4097"], "--grad-accum: '4097' is not a whole number from 1 to 4096"),
    (["--warmup", "9223372036854775807"], "from 1 to 100"), (["--out", ""], "--out: '' is empty"),
    (["--out", "  "], "--out: '  ' is empty")])
def test_warmup_leaves_a_measured_step(edge_bench, tmp_path, argv, flag, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an --out taken as the current folder would write here
    assert exit_status(edge_bench.main, ["--smoke", "--grad-accum", "1", "--out", str(tmp_path), *argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error:") and flag in line and not list(tmp_path.iterdir())


def test_checkpoint_layers_may_be_read_by_a_queue_depth_row_alone(edge_bench, tmp_path, capsys):
    row = "all levers + optimizer-state streaming + selective AC + fewer checkpointed layers"
    # accepted up to the last check before work (the timelines name a row this run does not run)
    assert edge_bench.main(["--smoke", "--grad-accum", "1", "--only", "stock", "--queue-depth", row,
                            "--checkpoint-layers", "1", "--timelines", "all levers", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--timelines" in err and "--checkpoint-layers" not in err and not list(tmp_path.iterdir())


def test_warmup_steps_are_not_measured(edge_bench, tmp_path, edge_smoke_env):
    assert edge_bench.main(["--smoke", "--steps", "3", "--warmup", "2", "--grad-accum", "2", "--only", ROW,
                       "--out", str(tmp_path)]) == 0
    stem = result_stem("cosmos", "edge24gb", "cpu", smoke=True)
    row = json.loads((tmp_path / f"{stem}.json").read_text())["rows"][0]
    assert row["warmup_steps"] == 2 and len(row["micro_batch_s"]) == 2  # step 3's two micro-batches only
    assert row["s_per_micro_batch"] == pytest.approx(max(row["micro_batch_s"]), abs=1e-4)  # the upper median of 2
    assert row["gc"]["steps"] == 1 and row["s_per_step"] > 0  # the GC pauses of step 3 alone
    assert "each row's first 2 optimizer step(s) not measured" in (tmp_path / f"{stem}.md").read_text()


@pytest.mark.parametrize("value", ["nosuch", "stock,nosuch", ","])
def test_queue_depth_names_known_configurations(edge_bench, tmp_path, value, capsys):
    assert edge_bench.main(["--smoke", "--grad-accum", "1", "--queue-depth", value, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--queue-depth" in err and not list(tmp_path.iterdir())
