"""The embedded H3 LoRA SFT trainer on the CPU (tiny preset): a run, its cache, its export, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(tmp_path, *extra, env=None):
    e = dict(os.environ, OUTPUT_ROOT=str(tmp_path / "out"), ONECARD_DATA_CACHE=str(tmp_path / "cache"),
             PYTHON=sys.executable)
    e.update(env or {})
    e.pop("MILES_DIFFUSION_ROOT", None)
    return subprocess.run(["bash", str(REPO / "launchers" / "sft_h3_t2va_1gpu.sh"), "--rollout-batch-size", "16",
                           "--num-steps-per-rollout", "2", *extra], env=e, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("h3")
    r = run(tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp, r


def test_main_job_trains_two_steps_with_the_8_gpu_schedule(first_run):
    tmp, r = first_run
    assert "preset tiny on CPU (no GPU found)" in r.stdout
    assert "8 micro-batches per step as 8 ranks would run them" in r.stdout
    s = json.loads((tmp / "out" / "h3_t2va_sft" / "summary.json").read_text())
    assert s["optimizer_steps"] == 2 and s["global_batch"] == 8 and s["micro_batches_per_step"] == 8
    assert s["loss_sigma_buckets"] and all(k.startswith("loss_sigma_") for k in s["loss_sigma_buckets"])
    assert s["data"]["cache_misses"] == s["data"]["rows"] > 0
    assert Path(s["checkpoint"]).is_file()


def test_resume_continues_exactly_and_skips_encoding(first_run, tmp_path):
    import torch

    tmp, _ = first_run
    r = run(tmp, "--num-rollout", "2")  # resumes after rollout 1
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-3000:]
    s = json.loads((tmp / "out" / "h3_t2va_sft" / "summary.json").read_text())
    assert s["data"]["cache_misses"] == 0 and s["data"]["cache_hits"] == s["data"]["rows"]
    assert s["resumed_from_rollout"] == 1 and s["optimizer_steps"] == 2
    straight = run(tmp_path, "--num-rollout", "2", env={"OUTPUT_ROOT": str(tmp_path / "straight")})
    assert straight.returncode == 0, straight.stderr[-3000:]
    a = torch.load(tmp / "out" / "h3_t2va_sft" / "checkpoints" / "iter_0000002.pt", weights_only=False)
    b = torch.load(tmp_path / "straight" / "h3_t2va_sft" / "checkpoints" / "iter_0000002.pt", weights_only=False)
    assert a["lora"].keys() == b["lora"].keys() and all(torch.equal(a["lora"][k], b["lora"][k]) for k in a["lora"])
    again = run(tmp, "--num-rollout", "2")
    assert again.returncode == 0 and "nothing to do" in again.stdout
    ex = subprocess.run([sys.executable, "-m", "miles_ext.export_lora", str(tmp_path / "straight" / "h3_t2va_sft" /
                         "checkpoints" / "iter_0000002.pt"), str(tmp_path / "adapter")],
                        capture_output=True, text=True, cwd=REPO)
    assert ex.returncode == 0 and "exported 36 LoRA tensors (rank 64, alpha 128" in ex.stdout, ex.stderr
    assert "DeviceMesh" not in ex.stderr  # the checkpoint holds plain tensors only


@pytest.mark.parametrize("args, needle", [
    (["--fsdp-master-dtype", "fp16"], "fp16"),
    (["--lora-target-modules", "no_such_layer"], "match no nn.Linear"),
    (["--rollout-batch-size", "12"], "not divisible by the GPU count 8"),
], ids=["bad-master-dtype", "lora-targets-match-nothing", "batch-not-divisible"])
def test_bad_input_is_one_error_line(tmp_path, args, needle):
    r = run(tmp_path, *args)
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "out" / "h3_t2va_sft" / "checkpoints").exists()
