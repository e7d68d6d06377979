"""``miles_ext.recipe.train --adapter-step-on-gpu`` on the CPU, tiny preset, full offload: the flag reaches
:mod:`miles_ext.levers.adapter_step` (the summary's ``adapter_step``), the LoRA and AdamW moments trained equal stock
full offload's bitwise (on the CPU the step runs on the host: the same kernel), a resumed run continues bitwise, and a
run where it has nothing to stream is one ``error:`` line before any work."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_h3_train_residency import lora_of, small, train  # noqa: F401  (small: the shared fixture)


def _last(run_dir) -> dict:
    ckpt = sorted((run_dir / "checkpoints").glob("iter_*.pt"))[-1]
    assert ckpt.name == "iter_000000003.pt"
    return torch.load(ckpt, weights_only=False)


def test_the_adapter_step_trains_stock_full_offloads_lora_bitwise(small, tmp_path, capsys):  # noqa: F811
    runs = {"stock": ["--fsdp-cpu-offload", "--num-rollout", "2"],
            "lever": ["--fsdp-cpu-offload", "--adapter-step-on-gpu", "--pin-adapter-gradients", "--num-rollout", "2"]}
    for name, extra in runs.items():
        rc, out, err = train(small, tmp_path / name, *extra, capsys=capsys)
        assert rc == 0, err[-3000:]
    # the lever's run resumed for one more rollout, against stock's 3 straight
    rc, out, err = train(small, tmp_path / "lever", "--fsdp-cpu-offload", "--adapter-step-on-gpu",
                         "--pin-adapter-gradients", "--num-rollout", "3", capsys=capsys)
    assert rc == 0 and "resumed" in out, err[-3000:]
    assert "none: the offloaded shards are not page-locked" in out  # a CPU run pins nothing, and says so
    rc, out, err = train(small, tmp_path / "stock", "--fsdp-cpu-offload", "--num-rollout", "3", capsys=capsys)
    assert rc == 0, err[-3000:]
    s = {n: json.loads((tmp_path / n / "summary.json").read_text()) for n in runs}
    assert s["stock"]["adapter_step"] is None
    assert s["lever"]["adapter_step"]["groups"] >= 1 and s["lever"]["adapter_step"]["steps"] >= 1
    assert s["lever"]["optimizer_device"] == "cpu"  # the CPU run's "device" is the host
    assert s["lever"]["pinned_adapter_gradients"] == 0
    assert s["lever"]["adapter_step"]["pinned_moment_bytes"] == 0  # nothing is page-locked without CUDA
    a, b = _last(tmp_path / "stock")["lora"], _last(tmp_path / "lever")["lora"]
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert any(not a[k].equal(lora_of(tmp_path / "stock")[k]) for k in a)  # rollouts 2 and 3 moved the adapters
    ma, mb = _last(tmp_path / "stock")["optimizer"]["state"], _last(tmp_path / "lever")["optimizer"]["state"]
    assert ma.keys() == mb.keys() and all(ma[n][k].equal(mb[n][k]) for n in ma for k in ma[n])


@pytest.mark.parametrize("extra", [["--adapter-step-on-gpu"], ["--pin-adapter-gradients"],
                                   ["--fsdp-cpu-offload", "--fsdp-resident-blocks", "1", "--adapter-step-on-gpu"],
                                   ["--fsdp-cpu-offload", "--fsdp-resident-blocks", "0", "--pin-adapter-gradients"]])
def test_nothing_to_stream_is_one_error_line_before_any_work(small, tmp_path, capsys, extra):  # noqa: F811
    rc, out, err = train(small, tmp_path / "bad", *extra, capsys=capsys)
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    flag = next(x for x in extra if x in ("--adapter-step-on-gpu", "--pin-adapter-gradients"))
    assert lines and lines[-1].startswith("error:") and flag in lines[-1], err
    assert "RESIDENT_BLOCKS=none" in lines[-1]
    assert not (tmp_path / "bad" / "checkpoints").exists()
    assert "clips from" not in out


@pytest.mark.parametrize("short", ["--adapter", "--pin", "--fsdp-resident"])
def test_abbreviated_flags_are_refused(small, tmp_path, capsys, short):  # noqa: F811
    """argparse's prefix matching is off: ``--fsdp-resident none`` would pass for ``--fsdp-resident-blocks`` and slip
    past the launcher's check of RESIDENT_BLOCKS given twice."""
    extra = ["--fsdp-cpu-offload", short] + (["none"] if short == "--fsdp-resident" else [])
    with pytest.raises(SystemExit) as e:  # argparse's refusal, in one line (patches.core.errors.ArgumentParser)
        train(small, tmp_path / "bad", *extra)
    rc, err = e.value.code, capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and lines[-1].startswith("error:") and short in lines[-1], err
    assert not (tmp_path / "bad").exists()
