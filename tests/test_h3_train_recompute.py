"""``miles_ext.recipe.train --recompute-block-inputs auto|N`` (and ``--fsdp-prefetch-h2d``) on the CPU, tiny preset (2 transformer blocks): the flag
reaches :mod:`miles_ext.levers.input_recompute` (the count in the model line and the summary), the LoRA trained equals
the plain checkpoint's bitwise under full offload, ``auto`` prints its plan, and each bad value is one ``error:`` line
before any work."""

from __future__ import annotations

import json

import pytest

from tests.test_h3_train_residency import lora_of, small, train  # noqa: F401  (small: the shared fixture)


def test_recomputed_input_trains_the_plain_lora_bitwise(small, tmp_path, capsys):  # noqa: F811
    runs = {"plain": ["--fsdp-cpu-offload"],
            "one": ["--fsdp-cpu-offload", "--recompute-block-inputs", "1"],
            "auto": ["--fsdp-cpu-offload", "--recompute-block-inputs", "auto", "--gpu-budget-gib", "64"],
            "prefetch": ["--fsdp-cpu-offload", "--fsdp-prefetch-h2d", "--recompute-block-inputs", "1"],
            "partial": ["--fsdp-cpu-offload", "--fsdp-resident-blocks", "1", "--recompute-block-inputs", "1"]}
    outs = {}
    for name, extra in runs.items():
        rc, out, err = train(small, tmp_path / name, *extra, capsys=capsys)
        assert rc == 0, err[-3000:]
        outs[name] = out
    assert "1 block inputs recomputed" in outs["one"] and "block inputs recomputed" not in outs["plain"]
    assert "input recompute auto: 0 block inputs recomputed; predicted peak" in outs["auto"]
    s = {n: json.loads((tmp_path / n / "summary.json").read_text()) for n in runs}
    assert [s[n]["recompute_block_inputs"] for n in runs] == [0, 1, 0, 1, 1]
    # the side-stream prefetch was asked for (its report exists; on the CPU it attaches nothing) under full offload
    # with --fsdp-prefetch-h2d and by default with partial residency, not under plain full offload
    assert [s[n]["h2d_prefetch"] is not None for n in runs] == [False, False, False, True, True]
    assert s["auto"]["input_recompute_plan_bytes"]["block inputs"] > 0 and s["one"]["input_recompute_plan_bytes"] is None
    a = lora_of(tmp_path / "plain")
    for other in ("one", "prefetch", "partial"):  # on the CPU the prefetch wiring runs (no side stream): the same values
        b = lora_of(tmp_path / other)
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), other


@pytest.mark.parametrize("extra, message", [
    (["--recompute-block-inputs", "some"], "--recompute-block-inputs 'some': use auto, a whole number"),
    (["--recompute-block-inputs", "-1"], "--recompute-block-inputs '-1': use auto, a whole number"),
    (["--recompute-block-inputs", "2"], "at most every second of the tiny preset's 2 transformer blocks"),
    (["--recompute-block-inputs", "auto", "--gpu-budget-gib", "8"], "plans the GPU peak of full offload"),
    (["--fsdp-cpu-offload", "--fsdp-resident-blocks", "1", "--recompute-block-inputs", "auto"],
     "plans the GPU peak of full offload"),
    (["--fsdp-cpu-offload", "--recompute-block-inputs", "auto"], "no GPU was found: pass --gpu-budget-gib"),
    (["--fsdp-cpu-offload", "--recompute-block-inputs", "1", "--gpu-budget-gib", "8"],
     "--gpu-budget-gib 8.0 is the budget"),
    (["--fsdp-prefetch-h2d"], "without --fsdp-cpu-offload nothing is offloaded"),
    (["--recompute-block-inputs", "9" * 5000], "--recompute-block-inputs '9999"),
    (["--fsdp-cpu-offload", "--recompute-block-inputs", "auto", "--gpu-budget-gib", "1.6"],
     "a 1.60 GiB GPU budget does not hold 1 token under full offload"),
    (["--fsdp-cpu-offload", "--fsdp-resident-blocks", "auto", "--recompute-block-inputs", "auto"],
     "(RESIDENT_BLOCKS=none in the launcher)"),
    (["--fsdp-cpu-offload", "--fsdp-resident-blocks", "1", "--fsdp-prefetch-h2d", "--fsdp-sync-h2d"],
     "ask for opposite things"),
])
def test_bad_settings_are_one_error_line_before_any_work(small, tmp_path, capsys, extra, message):  # noqa: F811
    rc, out, err = train(small, tmp_path / "bad", *extra, capsys=capsys)
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error:") and message in lines[-1], err
    assert not (tmp_path / "bad" / "checkpoints").exists()
    assert "clips from" not in out  # refused in the preflight: no clip read or encoded
