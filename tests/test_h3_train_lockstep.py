"""``miles_ext.recipe.train --lockstep-micro-batches N`` on the CPU, tiny preset, 2 micro-batches per optimizer step: the
flag reaches :mod:`miles_ext.levers.lockstep` (the summary's ``lockstep_micro_batches``), the LoRA trained equals the
one-micro-batch-at-a-time run's bitwise, all-resident and under full offload, and each bad value is one ``error:`` line
before any work."""

from __future__ import annotations

import json

import pytest

from tests.test_h3_train_residency import lora_of, small, train  # noqa: F401  (small: the shared fixture)


def test_lockstep_trains_the_sequential_lora_bitwise(small, tmp_path, capsys):  # noqa: F811
    runs = {"plain": ["--fsdp-cpu-offload"],
            "lockstep": ["--fsdp-cpu-offload", "--lockstep-micro-batches", "2"],
            "resident": ["--lockstep-micro-batches", " 2 "],
            "off": ["--fsdp-cpu-offload", "--lockstep-micro-batches", "none"]}
    for name, extra in runs.items():
        rc, out, err = train(small, tmp_path / name, *extra, capsys=capsys)
        assert rc == 0, err[-3000:]
    s = {n: json.loads((tmp_path / n / "summary.json").read_text()) for n in runs}
    assert [s[n]["lockstep_micro_batches"] for n in runs] == [1, 2, 2, 1]
    assert [s[n]["lockstep_groups_run"] for n in runs] == [0, 1, 1, 0]  # one step of 2 micro-batches: one group
    assert s["plain"]["micro_batches_per_step"] == 2  # the lever has two micro-batches to run together
    a = lora_of(tmp_path / "plain")
    for other in ("lockstep", "resident", "off"):
        b = lora_of(tmp_path / other)
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), other
    assert s["lockstep"]["losses"] == s["plain"]["losses"]


@pytest.mark.parametrize("extra, message", [
    (["--lockstep-micro-batches", "0"], "--lockstep-micro-batches '0': use a whole number of micro-batches >= 1"),
    (["--lockstep-micro-batches", "-2"], "--lockstep-micro-batches '-2': use a whole number"),
    (["--lockstep-micro-batches", "1.5"], "--lockstep-micro-batches '1.5': use a whole number"),
    (["--lockstep-micro-batches", "all"], "--lockstep-micro-batches 'all': use a whole number"),
    (["--lockstep-micro-batches", "9" * 5000], "--lockstep-micro-batches '9999"),
    (["--fsdp-cpu-offload", "--lockstep-micro-batches", "2", "--recompute-block-inputs", "1"], "do not combine"),
])
def test_bad_lockstep_settings_are_one_error_line_before_any_work(small, tmp_path, capsys, extra, message):  # noqa: F811
    rc, out, err = train(small, tmp_path / "bad", *extra, capsys=capsys)
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error:") and message in lines[-1], err
    assert not (tmp_path / "bad" / "checkpoints").exists()
    assert "clips from" not in out
