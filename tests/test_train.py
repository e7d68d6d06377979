"""The embedded trainer as a user meets it: bad input fails cleanly, checkpoints resume exactly."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from cosmos_framework_ext.recipe import train

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "toml" / "vision_sft_edge_24gb.toml"


def small_toml(tmp_path: Path, **edits: str) -> Path:
    """The 24 GB recipe with its CPU-smoke values shrunk further (and ``edits`` applied as line swaps)."""
    text = RECIPE.read_text()
    text = text.replace("cpu_max_iter            = 3", "cpu_max_iter            = 4")
    text = text.replace("cpu_grad_accum_iter     = 2", "cpu_grad_accum_iter     = 1")
    text = text.replace("cpu_max_sequence_length = 1228", "cpu_max_sequence_length = 300")
    text = text.replace("save_iter            = 100", "save_iter            = 2")
    for old, new in edits.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


@pytest.fixture()
def env(tmp_path, monkeypatch, small_dataset):
    monkeypatch.setenv("OUTPUT_ROOT", str(tmp_path / "out"))
    monkeypatch.setenv("DATASET_PATH", str(small_dataset))
    monkeypatch.setenv("COSMOS_EMA_CPU_SUBSET", "1")
    monkeypatch.setenv("COSMOS_VAE_CPU_OFFLOAD", "1")
    for var in ("BASE_CHECKPOINT_PATH", "WAN_VAE_PATH", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def run_main(args, capsys):
    rc = train.main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "setup, needle",
    [
        (lambda t, m: m.setenv("COSMOS_EMA_CPU_SUBSET", "maybe"), "COSMOS_EMA_CPU_SUBSET='maybe' is not a boolean"),
        (lambda t, m: m.setenv("DATASET_PATH", str(t / "nowhere")), "DATASET_PATH="),
        (lambda t, m: m.setenv("BASE_CHECKPOINT_PATH", str(t / "no.pt")), "BASE_CHECKPOINT_PATH="),
        (lambda t, m: m.setenv("WAN_VAE_PATH", str(t / "novae")), "WAN_VAE_PATH="),
    ],
    ids=["bad-flag-value", "missing-dataset", "missing-checkpoint", "missing-vae"],
)
def test_bad_environment_fails_with_one_line_and_writes_nothing(env, monkeypatch, capsys, setup, needle):
    setup(env, monkeypatch)
    rc, out, err = run_main(["--sft-toml", str(small_toml(env))], capsys)
    assert rc == 2
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert not (env / "out").exists()


@pytest.mark.parametrize(
    "edit, needle",
    [
        ({'keys_to_select = ["moe_gen", "time_embedder", "vae2llm", "llm2vae", "k_norm_und_for_gen"]':
          "keys_to_select = []"}, "keys_to_select is empty"),
        ({'keys_to_select = ["moe_gen", "time_embedder", "vae2llm", "llm2vae", "k_norm_und_for_gen"]':
          'keys_to_select = ["moe_gen", "no_such_module"]'}, "'no_such_module' matches no parameter"),
        ({"max_caption_tokens  = 2048": "max_caption_tokens  = 2048\nmax_caption_tokenz = 1"},
         "unknown key(s) ['max_caption_tokenz'] in [dataloader_train]"),
        ({"[onecard]": "[onecard]\n[mystery]\nx = 1\n[onecard2]"}, "unknown table [mystery]"),
        ({"rate            = 0.1": "rate            = 0.9"}, "[model.ema].rate = 0.9 must be > 0 and < 0.28"),
        ({"compile_blocks = true": 'compile_blocks = false\ncompile_wrapper = "cpp"'},
         '[onecard].compile_wrapper = "cpp" chooses the wrapper of compiled layers, and the layers are not compiled'),
        ({"compile_blocks = true": 'compile_blocks = true\ncompile_wrapper = "c++"'}, "compile_wrapper"),
        ({"compile_blocks = true": "compile_blocks = {}"},
         "[onecard].compile_blocks is a table here, and it takes a value"),
        ({"compile_blocks = true": "compile_blocks = [true]"},
         "[onecard].compile_blocks = [true] has the wrong type: expected true or false"),
    ],
    ids=["empty-keys", "keys-match-nothing", "unknown-key", "unknown-table", "bad-ema-rate", "cpp-wrapper-uncompiled",
         "unknown-wrapper", "table-for-a-value", "list-for-a-bool"],
)
def test_bad_toml_fails_with_one_line_and_writes_nothing(env, capsys, edit, needle):
    rc, out, err = run_main(["--sft-toml", str(small_toml(env, **edit))], capsys)
    assert rc == 2
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0], err
    assert not (env / "out").exists()


def test_missing_toml(env, capsys):
    rc, _, err = run_main(["--sft-toml", str(env / "missing.toml")], capsys)
    assert rc == 2 and "does not exist" in err


@pytest.mark.parametrize(
    "extra, needle",
    [({"MEMTEST": "sure"}, "MEMTEST='sure' is not a boolean"),
     ({"MEMTEST": "1", "EMAVAL": "1"}, "set only one"),
     ({"NPROC_PER_NODE": "two"}, "NPROC_PER_NODE=two is not a whole number"),
     # errors the trainer finds reach the caller as they are, not wrapped by torchrun
     ({"COSMOS_EMA_CPU_SUBSET": "maybe"}, "COSMOS_EMA_CPU_SUBSET='maybe' is not a boolean"),
     ({"DATASET_PATH": "/nonexistent/dataset"}, "DATASET_PATH=/nonexistent/dataset does not exist")],
    ids=["bad-memtest", "memtest-and-emaval", "bad-nproc", "bad-lever-flag", "missing-dataset"],
)
def test_launcher_refuses_bad_variables(tmp_path, extra, needle):
    import sys

    e = {k: v for k, v in os.environ.items()
         if k not in ("MEMTEST", "EMAVAL", "COSMOS_FRAMEWORK_ROOT", "DATASET_PATH", "COSMOS_EMA_CPU_SUBSET")}
    e.update(extra, OUTPUT_ROOT=str(tmp_path / "out"), ONECARD_DATA_CACHE=str(tmp_path / "cache"), PYTHON=sys.executable)
    r = subprocess.run(["bash", str(REPO / "launchers" / "sft_edge_24gb.sh")], env=e, capture_output=True, text=True)
    assert r.returncode == 2 and needle in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


# ---------------------------------------------------------------------------------- the main job
def _final(out_root: Path) -> dict:
    job = out_root / "cosmos3" / "sft" / "vision_sft_edge_24gb"
    return json.loads((job / "summary.json").read_text())


def test_main_job_summary_and_checkpoint(env, capsys):
    rc, out, err = run_main(["--sft-toml", str(small_toml(env))], capsys)
    assert rc == 0, err
    assert out.splitlines()[0].startswith("onecard: preset tiny on CPU (no GPU found)")
    s = _final(env / "out")
    assert s["steps"] == 4 and s["drops"] == 0 and s["ema"]["placement"] == "cpu_subset"
    # upstream passes the iteration before its increment: the 4th step (iteration 3) updates with
    # beta(3) = (1 - 1/4)^(gamma + 1), gamma = 6.9372039 for rate 0.1
    assert s["ema"]["num_updates"] == 4 and s["ema"]["last_beta"] == pytest.approx(0.75 ** 7.9372039, rel=1e-6)
    for key in ("samples_per_optimizer_step", "peak_gpu_allocated_gib", "peak_host_rss_gib", "pinned_bytes", "checkpoint"):
        assert key in s
    assert s["checkpoint_layers"] == 2 and s["host_tables"] is None  # "all" resolved to the tiny preset's layers
    assert s["text_stream_detached"] is True  # the recipe's detach_text_stream
    assert s["compile"] == "eager (the layers are compiled on a GPU only)"  # the recipe asks; a CPU run says why not
    blob = torch.load(s["checkpoint"], map_location="cpu", weights_only=False)
    net = {k[4:] for k in blob["model"] if k.startswith("net.")}
    ema = {k[8:]: v for k, v in blob["model"].items() if k.startswith("net_ema.")}
    assert net == set(ema) and all(v.dtype == torch.float32 for v in ema.values())
    assert blob["iteration"] == 4 and blob["ema_num_updates"] == 4
    assert not list((env / "out").rglob(".*.tmp-*"))  # no temp files left behind
    # the memory timeline sits beside the checkpoints, with per-phase peaks in the summary
    assert Path(s["timeline"]["csv"]).is_file() and Path(s["timeline"]["png"]).is_file()
    assert {"encode", "forward", "backward", "optimizer", "ema"} <= set(s["memory"]["phases"])
    assert s["memory"]["phases"]["checkpoint"]["host_rss_bytes"] > 0  # the whole save is the checkpoint phase


def test_resume_continues_exactly(env, monkeypatch, capsys):
    toml = str(small_toml(env))
    monkeypatch.setenv("OUTPUT_ROOT", str(env / "straight"))
    assert run_main(["--sft-toml", toml], capsys)[0] == 0
    monkeypatch.setenv("OUTPUT_ROOT", str(env / "resumed"))
    assert run_main(["--sft-toml", toml, "--max-iter", "2"], capsys)[0] == 0
    rc, out, _ = run_main(["--sft-toml", toml], capsys)
    assert rc == 0 and "resumed from" in out
    a = torch.load(_final(env / "straight")["checkpoint"], map_location="cpu", weights_only=False)
    b = torch.load(_final(env / "resumed")["checkpoint"], map_location="cpu", weights_only=False)
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["iteration"] == b["iteration"] == 4
    assert a["ema_num_updates"] == b["ema_num_updates"] == 4  # the resumed EMA kept counting from its checkpoint
    assert a["micro_batches_consumed"] == b["micro_batches_consumed"]
    # once more: nothing left to do, and the finished run's summary is kept
    before = _final(env / "resumed")
    rc, out, _ = run_main(["--sft-toml", toml], capsys)
    assert rc == 0 and "nothing to do" in out and _final(env / "resumed") == before


def test_oversized_sample_is_counted_as_a_drop(env, monkeypatch, capsys, caplog):
    """One row whose caption alone exceeds the cap: the loader drops it (one error line) and the summary counts it."""
    src = Path(os.environ["DATASET_PATH"]) / "train"
    data = env / "oversized" / "train"
    data.mkdir(parents=True)
    (data / "media").symlink_to(src / "media")
    rows = (src / "video_dataset_file.jsonl").read_text().splitlines()
    big = dict(json.loads(rows[0]), caption=" ".join(["cyclist"] * 400))
    (data / "video_dataset_file.jsonl").write_text("\n".join([*rows, json.dumps(big)]) + "\n")
    monkeypatch.setenv("DATASET_PATH", str(data.parent))
    toml = small_toml(env, **{"cfg_dropout  = 0.1": "cfg_dropout  = 0.0"})  # the caption is never dropped
    rc, _, err = run_main(["--sft-toml", str(toml), "--max-iter", "1", "--no-save"], capsys)
    assert rc == 0, err
    assert _final(env / "out")["drops"] == 1  # every other row fits the cap of 300 (test_packing.py)
    dropped = [r for r in caplog.records if r.name == "onecard.packing" and "dropped sample" in r.getMessage()]
    assert len(dropped) == 1 and f"dropped sample {len(rows)} " in dropped[0].getMessage()


@pytest.mark.parametrize("keys, needle", [
    (("cpu_max_iter",), "(CPU smoke: [onecard] cpu_max_iter replace the recipe's values, cap 12288, grad_accum_iter 61)"),
    ((), "no [onecard] cpu_* value is set, so the recipe's whole schedule runs, cap 12288, grad_accum_iter 61"),
], ids=["one-key", "none"])
def test_the_cpu_run_names_the_cpu_keys_it_applies(env, keys, needle):
    """The run's max_iter line names the cpu_* keys that replaced the recipe's values, and says so when none did
    (a copy of a shipped TOML without them trains the whole recipe on the CPU)."""
    text = RECIPE.read_text()
    for key in ("cpu_max_iter", "cpu_grad_accum_iter", "cpu_max_sequence_length"):
        if key not in keys:
            text = "\n".join(line for line in text.splitlines() if not line.startswith(key))
    toml = env / "recipe.toml"
    toml.write_text(text)
    recipe = train.CosmosSFT(train.parse_args(["--sft-toml", str(toml)]))
    recipe.preflight()
    assert needle in recipe.smoke
    assert recipe.max_steps == (3 if keys else 500)
