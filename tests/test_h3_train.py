"""``miles_ext.recipe.train``, the embedded H3 LoRA SFT trainer, on the CPU (tiny preset): its typed config, a run,
its cache and checkpoints, exact resume, its export, bad input. Every run writes under ``tmp_path`` and picks a
free rendezvous port, so the tests run in parallel."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from miles_ext.recipe.train import H3SFTConfig, parse_args
from patches.core.checkpoint import CheckpointManager
from patches.core.config import field_docs
from tests.cli import run_main
from tests.datasets import first_rows

REPO = Path(__file__).resolve().parents[1]


def checkpoint(out_root: Path, rollout: int) -> Path:
    """The launcher's checkpoint of ``rollout`` under ``OUTPUT_ROOT=out_root``."""
    return CheckpointManager(out_root / "h3_t2va_sft").path(rollout)


def latest_marker(out_root: Path) -> str:
    return (out_root / "h3_t2va_sft" / "checkpoints" / "latest_checkpoint.txt").read_text()


DATA: dict[str, str] = {}
"""``DATASET_PATH`` for every launcher run of this module (set once by :func:`_h3_rows`)."""


@pytest.fixture(scope="module", autouse=True)
def _h3_rows(h3_dataset, tmp_path_factory):
    """The launcher's own sample dataset, its first 16 rows (one rollout of 16): prepared once for the session, not
    once per ``ONECARD_DATA_CACHE``."""
    DATA["DATASET_PATH"] = str(first_rows(h3_dataset, tmp_path_factory.mktemp("h3rows") / "data", 16))
    yield
    DATA.clear()


def run(tmp_path, *extra, env=None):
    e = dict(os.environ, OUTPUT_ROOT=str(tmp_path / "out"), ONECARD_DATA_CACHE=str(tmp_path / "cache"),
             PYTHON=sys.executable, **DATA)
    e.update(env or {})
    e.pop("MILES_DIFFUSION_ROOT", None)
    return subprocess.run(["bash", str(REPO / "launchers" / "sft_h3_t2va_1gpu.sh"), "--rollout-batch-size", "16",
                           "--num-steps-per-rollout", "2", *extra], env=e, capture_output=True, text=True,
                          timeout=600)


def run_trainer(tmp_path, *extra):
    """What :func:`run` runs on this CPU machine (the launcher's trainer line), in this process: for the reruns of a
    folder whose launcher wiring a subprocess run already covered."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("MILES_DIFFUSION_ROOT", None)
    return run_main("miles_ext.recipe.train", ["--from-gpus", "8", "--fsdp-master-dtype", "bf16", "--output-dir",
                                               str(tmp_path / "out" / "h3_t2va_sft"), "--data-dir", DATA["DATASET_PATH"],
                                               "--rollout-batch-size", "16", "--num-steps-per-rollout", "2", *extra],
                    dict(env, ONECARD_DATA_CACHE=str(tmp_path / "cache")), tmp_path)


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
    assert "global batch 8 = 16 prompts x 1 sample(s) per prompt / 2 steps per rollout" in r.stdout
    s = json.loads((tmp / "out" / "h3_t2va_sft" / "summary.json").read_text())
    assert s["steps"] == 2 and s["global_batch"] == 8 and s["micro_batches_per_step"] == 8
    assert s["nonfinite_skipped_steps"] == 0 and s["nonfinite_skips"] == []  # counted (miles_ext.levers.finite_step)
    assert s["loss_sigma_buckets"] and all(k.startswith("loss_sigma_") for k in s["loss_sigma_buckets"])
    # the process's high-water mark, read after the last checkpoint save: at least every RSS sampled before it
    rss = s["host_rss_gib"]
    assert rss["vmhwm"] >= max(rss["after_init"], rss["peak_through_init"], rss["peak_steady"]) > 0
    assert s["data"]["cache_misses"] == s["data"]["rows"] > 0
    assert Path(s["checkpoint"]).is_file() and Path(s["checkpoint"]) == checkpoint(tmp / "out", 1)
    assert checkpoint(tmp / "out", 1).name == "iter_000000001.pt"
    assert latest_marker(tmp / "out") == "iter_000000001.pt\n"


def test_resume_continues_exactly_and_skips_encoding(first_run, tmp_path):
    import torch

    tmp, _ = first_run
    r = run(tmp, "--num-rollout", "2")  # resumes after rollout 1
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-3000:]
    s = json.loads((tmp / "out" / "h3_t2va_sft" / "summary.json").read_text())
    assert s["data"]["cache_misses"] == 0 and s["data"]["cache_hits"] == s["data"]["rows"]
    assert s["resumed_from"] == 1 and s["steps"] == 2 and s["reached"] == 2
    # the straight run reads the latents the first run encoded (the cache is proven exact on its own)
    straight = run(tmp_path, "--num-rollout", "2", env={"OUTPUT_ROOT": str(tmp_path / "straight"),
                                                        "ONECARD_DATA_CACHE": str(tmp / "cache")})
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert latest_marker(tmp / "out") == "iter_000000002.pt\n" and s["checkpoint"] == str(checkpoint(tmp / "out", 2))
    b = torch.load(checkpoint(tmp_path / "straight", 2), weights_only=False)

    def same_lora(path: Path) -> bool:
        a = torch.load(path, weights_only=False)
        return a["lora"].keys() == b["lora"].keys() and all(torch.equal(a["lora"][k], b["lora"][k]) for k in a["lora"])

    assert same_lora(checkpoint(tmp / "out", 2))
    again = run_trainer(tmp, "--num-rollout", "2")
    assert again.returncode == 0 and "nothing to do" in again.stdout
    # the checkpoint holds plain tensors only (no DTensor, so the export needs no process group; the export
    # itself is tested in test_h3_export_lora.py)
    assert b["lora"] and all(type(v) is torch.Tensor for v in b["lora"].values())
    # a damaged newest checkpoint: the run says so, resumes from the one before, and trains rollout 2 again exactly
    checkpoint(tmp / "out", 2).write_bytes(b"truncated")
    redo = run_trainer(tmp, "--num-rollout", "2")
    assert redo.returncode == 0 and "damaged" in redo.stderr, redo.stderr[-3000:]
    assert f"resumed from {checkpoint(tmp / 'out', 1)} after rollout 1" in redo.stdout
    assert same_lora(checkpoint(tmp / "out", 2))


@pytest.mark.parametrize("args, needle", [
    (["--fsdp-master-dtype", "fp16"], "fp16"),
    (["--lora-target-modules", "no_such_layer"], "match no nn.Linear"),
    (["--rollout-batch-size", "12"], "not divisible by the GPU count 8"),
    (["--master-port", "BUSY"], "is in use"),
], ids=["bad-master-dtype", "lora-targets-match-nothing", "batch-not-divisible", "master-port-in-use"])
def test_bad_input_is_one_error_line(tmp_path, args, needle):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = run_trainer(tmp_path, *[str(busy.getsockname()[1]) if a == "BUSY" else a for a in args])
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "out" / "h3_t2va_sft" / "checkpoints").exists()


# ------------------------------------------------------------------------------------------ typed config
OLD_FLAG_DEFAULTS = dict(  # the flags and defaults of the argparse namespace the config replaced
    preset="auto", rollout_batch_size=32, n_samples_per_prompt=1, num_steps_per_rollout=4, global_batch_size=None,
    micro_batch_size=1, from_gpus=8, num_rollout=1, lora_rank=64, lora_alpha=128, lora_target_modules=None, lr=1e-4,
    clip_grad=1.0, fsdp_master_dtype="bf16", fsdp_cpu_offload=False, deterministic_mode=False,
    text_encoder_random_weights=False, seed=1234, data_dir="", cache_dir="", output_dir="outputs/h3_sft",
)


def test_config_has_the_old_flags_and_defaults_and_a_doc_per_field():
    cfg = parse_args([])
    assert isinstance(cfg, H3SFTConfig) and cfg == H3SFTConfig()
    assert {k: getattr(cfg, k) for k in OLD_FLAG_DEFAULTS} == OLD_FLAG_DEFAULTS
    assert cfg.master_port is None  # was a fixed 29517: now $MASTER_PORT or a free port
    docs = field_docs(H3SFTConfig)
    assert all(docs.get(f.name) for f in dataclasses.fields(H3SFTConfig))


def test_flags_parse_into_typed_fields():
    cfg = parse_args(["--preset", "tiny", "--lora-target-modules", "attn.to_q", "ff.net.2", "--global-batch-size", "8",
                      "--lora-alpha", "32", "--fsdp-cpu-offload", "--master-port", "4242", "--num-rollout", "3"])
    assert cfg.preset == "tiny" and cfg.lora_target_modules == ["attn.to_q", "ff.net.2"]
    assert cfg.global_batch_size == 8 and cfg.lora_alpha == 32.0 and cfg.fsdp_cpu_offload is True
    assert cfg.master_port == 4242 and cfg.num_rollout == 3
    with pytest.raises(SystemExit) as e:
        parse_args(["--preset", "huge"])
    assert e.value.code == 2


def test_help_lists_every_flag_with_its_doc():
    r = subprocess.run([sys.executable, "-m", "miles_ext.recipe.train", "--help"], capture_output=True, text=True, cwd=REPO,
                       timeout=120, env=dict(os.environ, COLUMNS="1000"))  # no wrapping inside a doc
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for f in dataclasses.fields(H3SFTConfig):
        assert "--" + f.name.replace("_", "-") in text and field_docs(H3SFTConfig)[f.name] in text
    assert "{auto,tiny,full}" in text and "(default 32)" in text
