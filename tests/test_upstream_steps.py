"""``benchmarks/upstream/steps.py``: a harness log's optimizer steps, model time, loader wait and MFU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "upstream"))
import steps  # noqa: E402

LOG = """[12-02 15:48:57|INFO|iter_speed.py:58:on_training_step_end] Iteration 1: Hit counter: 1/50 | Loss: 21.1553 | Time: 168.28s
onecard memcap[rank 0]: micro-batch 1 90.0 s samples [[495, 1862], [20, 1862]]
onecard memcap[rank 0]: micro-batch 2 0.5 s samples [[495, 2482]]
onecard memcap[rank 0]: micro-batch 3 0.4 s samples [[495, 1862]]
onecard memcap[rank 0]: micro-batch 4 0.6 s samples [[495, 1986]]
onecard memcap[rank 0]: micro-batch 5 0.8 s samples [[495, 1862], [494, 1862]]
[12-02 15:49:28|INFO|iter_speed.py:58:on_training_step_end] Iteration 2: Hit counter: 2/50 | Loss: 21.3692 | Time: 3.00s
onecard memcap[rank 0]: cuda:0 peak allocated 18.44 GiB, peak reserved 22.02 GiB (cap 22.06 GiB)
"""


def test_step_two_is_its_micro_batches_plus_the_loader_wait():
    assert steps.summarise(LOG, 3, 1.0, flops_of=lambda samples: 1.0)["steps"] == []  # 5 micro-batches: no step 2
    s = steps.summarise(LOG, 2, 1.0, flops_of=lambda samples: 1e12 * len(samples))
    (st,) = s["steps"]
    assert st["step"] == 2 and st["model_s"] == 1.0 and st["loader_wait_s"] == 2.0  # micro-batches 3 and 4
    assert st["s_per_micro_batch"] == 1.5 and st["optimizer_micro_batch_s"] == 0.6 and st["model_median_s"] == 0.4
    assert st["mfu_model"] == 2.0 and st["mfu_wall"] == round(2 / 3, 4)  # 2 samples x 1 TFLOP over 1 s at 1 TFLOP/s
    assert s["peak_gib"] == {"allocated": 18.44, "reserved": 22.02} and len(s["micro_batch_s"]) == 5


def test_the_edge_preset_flops_are_what_the_reference_benchmark_counts():
    s = steps.summarise(LOG, 2, 989.0)
    assert 15 < s["steps"][0]["tflop_per_micro_batch"] < 30  # one clip of 1,862-1,986 vision tokens per micro-batch


def test_cli_prints_writes_json_and_refuses_bad_input(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text(LOG)
    assert steps.main([str(log), "--grad-accum-iter", "2", "--json", str(tmp_path / "s.json")]) == 0
    assert "step 2: 3.00 s" in capsys.readouterr().out and json.loads((tmp_path / "s.json").read_text())["steps"]
    for argv, what in (([str(tmp_path / "none.log")], "is not a file"), ([str(log), "--grad-accum-iter", "0"], ">= 1"),
                       ([str(log), "--peak-tflops", "nan"], "--peak-tflops nan"),
                       ([str(log), "--grad-accum-iter", "nan"], "invalid"), ([], "required: log")):
        try:
            code = steps.main(argv)
        except SystemExit as e:  # argparse's own refusals exit through the parser
            code = e.code
        err = capsys.readouterr().err
        assert code == 2, argv
        assert err.startswith("error:") and what in err and err.count("\n") == 1
    empty = tmp_path / "empty.log"
    empty.write_text("Iteration 2: | Loss: 1.0 | Time: 3.00s\n")
    assert steps.main([str(empty)]) == 2 and "ONECARD_MEMCAP_STEPS=1" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["Loss: x", "Time: s"])
def test_lines_that_do_not_parse_give_no_wall_time(bad):
    (st,) = steps.summarise(LOG.replace("Loss: 21.3692", bad).replace("Time: 3.00s", bad), 2, 1.0,
                            flops_of=lambda s: 1.0)["steps"]
    assert st["s"] is None and st["loss"] is None and st["loader_wait_s"] is None and st["mfu_wall"] is None
    assert st["model_s"] == 1.0 and st["model_mean_s"] == 0.5


def test_a_run_stopped_before_upstreams_last_line_is_summarised_from_its_micro_batches(tmp_path, capsys):
    """ONECARD_MEMCAP_STOP_AFTER stops the run after the last training_step, before upstream logs that step."""
    stopped = LOG.replace("Iteration 2: Hit counter: 2/50 | Loss: 21.3692 | Time: 3.00s", "")
    (st,) = steps.summarise(stopped, 2, 1.0, flops_of=lambda samples: 1e12 * len(samples))["steps"]
    assert st["step"] == 2 and st["s"] is None and st["loss"] is None and st["s_per_micro_batch"] is None
    assert st["model_s"] == 1.0 and st["model_mean_s"] == 0.5 and st["model_median_s"] == 0.4
    assert st["mfu_model"] == 2.0 and st["mfu_wall"] is None
    log = tmp_path / "run.log"
    log.write_text(stopped)
    assert steps.main([str(log), "--grad-accum-iter", "2"]) == 0
    out = capsys.readouterr().out
    assert "step 2: wall not logged" in out and "model 1.00 s (mean 0.500 s)" in out
    assert steps.main([str(log), "--grad-accum-iter", "3"]) == 0  # 5 timed micro-batches: no whole step 2
    assert "nothing is summarised" in capsys.readouterr().out


def test_one_micro_batch_per_step_has_a_median():
    """grad_accum_iter 1: each step is one micro-batch, which also runs the optimizer step (no traceback)."""
    s = steps.summarise(LOG, 1, 1.0, flops_of=lambda samples: 1.0)["steps"]
    assert [st["step"] for st in s] == [2, 3, 4, 5] and [st["model_median_s"] for st in s] == [0.5, 0.4, 0.6, 0.8]


def test_without_the_edge_preset_the_times_are_summarised_and_mfu_left_out(monkeypatch, tmp_path, capsys):
    """On the GPU machine beside upstream's own older diffusers the preset cannot be built: no traceback."""
    monkeypatch.setitem(sys.modules, "benchmarks.edge_24gb", None)  # its import raises ImportError
    s = steps.summarise(LOG, 2, 989.0)
    (st,) = s["steps"]
    assert st["mfu_model"] is None and st["tflop_per_micro_batch"] is None and st["s"] == 3.0
    assert s["mfu_note"].startswith("MFU not computed")
    log = tmp_path / "run.log"
    log.write_text(LOG)
    assert steps.main([str(log), "--grad-accum-iter", "2"]) == 0
    out = capsys.readouterr().out
    assert "step 2: 3.00 s" in out and "MFU" in out.splitlines()[-1] and "%" not in out
