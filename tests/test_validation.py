"""Nothing trains wrong in silence: bad numbers, foreign checkpoints, full disks, empty locks, bad captions, a cap below
every sample and silent waits each end in one ``error:`` line (or a stated fallback), before any work where they can.

Each kind has a planted variant that shows the test can fail (the check switched off, or its input made valid).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from patches.core import config as coreconfig
from patches.core.checkpoint import CheckpointManager
from patches.core.errors import UserError

from tests.test_train import env  # noqa: F401 - the fixture: a private output folder, the tiny sample dataset

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ 1. numbers checked by what they mean
COSMOS_BAD = [
    ({"optimizer": {"lr": math.nan}}, "[optimizer].lr = nan must be a finite number"),
    ({"optimizer": {"lr": math.inf}}, "[optimizer].lr = inf must be a finite number"),
    ({"optimizer": {"lr": -1e-4}}, "[optimizer].lr = -0.0001 must be > 0"),
    ({"optimizer": {"lr": 0.0}}, "[optimizer].lr = 0.0 must be > 0"),
    ({"trainer": {"callbacks": {"grad_clip": {"clip_norm": -0.1}}}}, "clip_norm = -0.1 must be > 0"),
    ({"onecard": {"loss_scale": math.nan}}, "[onecard].loss_scale = nan"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, "[optimizer].betas = [0.9, 1.0]: element 1.0 must be >= 0 and < 1"),
    ({"optimizer": {"betas": [-0.1, 0.95]}}, "element -0.1 must be >= 0 and < 1"),
    ({"optimizer": {"betas": [0.9]}}, "must hold two numbers"),
    ({"optimizer": {"eps": 0.0}}, "[optimizer].eps = 0.0 must be > 0"),
    ({"optimizer": {"weight_decay": -0.01}}, "weight_decay = -0.01 must be >= 0"),
    ({"onecard": {"cfg_dropout": 1.5}}, "cfg_dropout = 1.5 must be >= 0 and <= 1"),
    ({"onecard": {"seed": -1}}, "[onecard].seed = -1 must be >= 0"),
    ({"onecard": {"seed": 2**63}}, "does not fit a 64-bit signed integer"),
    ({"onecard": {"keep_checkpoints": -1}}, "keep_checkpoints = -1 must be >= 0"),
    ({"trainer": {"grad_accum_iter": 0}}, "grad_accum_iter = 0 must be >= 1"),
    ({"checkpoint": {"save_iter": 0}}, "save_iter = 0 must be >= 1"),
    ({"dataloader_train": {"max_sequence_length": 0}}, "max_sequence_length = 0 must be >= 1"),
    ({"scheduler": {"warm_up_steps": [-5]}}, "element -5 must be >= 0"),
    ({"scheduler": {"f_max": [math.nan]}}, "must be a finite number"),
    ({"model": {"ema": {"rate": 0.3}}}, "[model.ema].rate = 0.3 must be > 0 and < 0.28"),
    ({"model": {"parallelism": {"data_parallel_shard_degree": 0}}}, "must be >= 1 (or -1)"),
]


@pytest.mark.parametrize("table,needle", COSMOS_BAD, ids=[n[:40] for _, n in COSMOS_BAD])
def test_cosmos_toml_numbers_are_checked_by_meaning(table, needle):
    from cosmos_framework_ext.recipe import config as cfgmod

    with pytest.raises(cfgmod.ConfigError) as e:
        cfgmod.from_dict(table)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_cosmos_accepts_the_recipes_own_values():
    from cosmos_framework_ext.recipe import config as cfgmod

    for toml in sorted((REPO / "toml").glob("*.toml")):
        cfgmod.load(toml)
    assert cfgmod.from_dict({"model": {"parallelism": {"data_parallel_shard_degree": -1}},
                             "onecard": {"cfg_dropout": 1.0, "seed": 2**63 - 1}}).onecard.seed == 2**63 - 1


def test_planted_no_meaning_check_trains_a_nan_learning_rate(monkeypatch):
    """Planted: with the meaning check switched off, a NaN learning rate loads (and would train NaN)."""
    from cosmos_framework_ext.recipe import config as cfgmod

    monkeypatch.setattr(coreconfig, "check_meaning", lambda *a, **k: None)
    assert math.isnan(cfgmod.from_dict({"optimizer": {"lr": math.nan}}).optimizer.lr)


def test_cosmos_trainer_refuses_a_nan_lr_in_one_line_and_writes_nothing(env, capsys):
    from cosmos_framework_ext.recipe import train
    from tests.test_train import small_toml

    tmp_path = env
    toml = small_toml(tmp_path, **{"lr             = 1.0e-4": "lr             = nan"})
    assert "nan" in toml.read_text()
    assert train.main(["--sft-toml", str(toml), "--validate-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "[optimizer].lr = nan" in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,needle", [
    (["--lr", "nan"], "--lr = nan must be a finite number"),
    (["--lr=-1e-4"], "--lr = -0.0001 must be > 0"),
    (["--clip-grad", "inf"], "--clip-grad = inf must be a finite number"),
    (["--seed", str(2**70)], "--seed = 1180591620717411303424 does not fit"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints = -1 must be >= 0"),
    (["--master-port", "70000"], "--master-port = 70000 must be >= 1 and <= 65535"),
    (["--fsdp-cpu-offload", "--fsdp-resident-blocks", "auto", "--gpu-budget-gib", "nan"], "--gpu-budget-gib = nan"),
    (["--lora-alpha", "0"], "--lora-alpha = 0.0 must be > 0"),
], ids=["lr-nan", "lr-negative", "clip-inf", "seed-70-bit", "keep-negative", "port-range", "budget-nan", "alpha-0"])
def test_h3_flags_are_checked_by_meaning_before_anything(tmp_path, capsys, args, needle):
    from miles_ext.recipe import train

    out = tmp_path / "run"
    assert train.main([*args, "--validate-only", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not out.exists()


# ------------------------------------------------------------------ 2. a newest checkpoint of another run
class _Tiny:
    """A recipe's checkpoint check, as the skeleton holds it (the Cosmos recipe's keys)."""

    from patches.core.trainer import Recipe as _R

    recipe_name = "cosmos3-edge"
    checkpoint_keys = ("model", "optimizer", "scheduler", "iteration", "micro_batches_consumed")
    checkpoint_problem = _R.checkpoint_problem


GOOD = {"model": {}, "optimizer": {}, "scheduler": {}, "iteration": 2, "micro_batches_consumed": 4,
        "onecard_recipe": "cosmos3-edge"}


@pytest.mark.parametrize("newest,why", [
    ({}, "lacks ['model'"), ([1, 2], "holds a list"),
    ({**GOOD, "onecard_recipe": "minimax-h3"}, "it is a minimax-h3 checkpoint, this run is cosmos3-edge"),
    ({"lora": {}, "lora_meta": {}, "optimizer": {}, "rollout": 1}, "lacks ['model', 'scheduler'"),
], ids=["empty-dict", "a-list", "another-recipe-tagged", "another-recipe-untagged"])
def test_a_newest_file_that_is_not_this_runs_checkpoint_falls_back(tmp_path, newest, why):
    cm = CheckpointManager(tmp_path)
    cm.save(2, GOOD)
    cm.save(4, newest)
    said: list[str] = []
    path, state = cm.load_latest(on_damaged=said.append, validate=_Tiny().checkpoint_problem)
    assert path == cm.path(2) and state["iteration"] == 2
    assert len(said) == 1 and "not a checkpoint of this run" in said[0] and why in said[0], said
    planted_path, _ = cm.load_latest(on_damaged=said.append)  # planted: without the check the foreign file wins
    assert planted_path == cm.path(4)


def test_cosmos_resume_skips_an_empty_newest_checkpoint(env, capsys):
    """End to end: the trainer's own run writes iter 2, an empty dict lands as iter 4; ``--validate-only`` passes and
    the resume trains from iter 2 with one warning line."""
    from cosmos_framework_ext.recipe import train
    from tests.test_train import small_toml

    tmp_path = env
    toml = small_toml(tmp_path, **{"cpu_max_iter            = 4": "cpu_max_iter            = 2"})
    assert train.main(["--sft-toml", str(toml)]) == 0
    run = next((tmp_path / "out").rglob("checkpoints")).parent
    torch.save({}, run / "checkpoints" / "iter_000000004.pt")
    capsys.readouterr()
    assert train.main(["--sft-toml", str(toml), "--validate-only"]) == 0
    assert train.main(["--sft-toml", str(toml), "--max-iter", "3"]) == 0
    out = capsys.readouterr()
    assert "not a checkpoint of this run" in out.err and f"resumed from {run / 'checkpoints' / 'iter_000000002.pt'}" in out.out
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == 2


# ------------------------------------------------------------------ 3. disk space
@pytest.mark.parametrize("existing,saves,keep,want", [
    (0, 5, 0, 5), (3, 2, 0, 2), (0, 5, 2, 3), (0, 1, 2, 1), (2, 4, 2, 1), (5, 3, 2, 1), (1, 3, 3, 3), (0, 0, 2, 0),
])
def test_checkpoint_space_needed_by_hand(existing, saves, keep, want):
    """Files at once beyond the existing ones, counted by hand: a new file is complete before old ones go."""
    from patches.core.trainer import checkpoint_space_needed

    assert checkpoint_space_needed(100, existing, saves, keep) == want * 100


class _SpaceRecipe:
    """The parts of a recipe :func:`check_checkpoint_space` reads."""

    def __init__(self, root: Path, keep: int = 2, size: int = 10**9):
        self.checkpoints = CheckpointManager(root, keep=keep)
        self.max_steps, self._size = 4, size

    def checkpoint_bytes(self) -> int:
        return self._size

    def save_due(self, done: int) -> bool:
        return done % 2 == 0


def test_too_little_free_space_is_refused_before_training(tmp_path, monkeypatch):
    import collections
    import shutil

    from patches.core.trainer import check_checkpoint_space

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 10**12 - 10**9, 10**9))
    with pytest.raises(UserError) as e:
        check_checkpoint_space(_SpaceRecipe(tmp_path / "run"), 0)  # 2 saves of 1 GB, keep 2: 2 GB needed
    msg = str(e.value)
    assert "\n" not in msg and "1.0 GB free" in msg and "need 2.0 GB" in msg and str(tmp_path / "run") in msg
    check_checkpoint_space(_SpaceRecipe(tmp_path / "run", size=4 * 10**8), 0)  # 0.8 GB fits in 1 GB
    check_checkpoint_space(_SpaceRecipe(tmp_path / "run"), 4)  # nothing left to save


def test_a_save_that_fails_for_space_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    from patches.core import io as coreio
    from tests.test_core_skeleton import ToyRecipe, run_toy

    real = coreio.atomic_torch_save
    calls = {"n": 0}

    def full_disk(obj, path):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
                               "data/0: file write failed")
        return real(obj, path)

    monkeypatch.setattr("patches.core.checkpoint.atomic_torch_save", full_disk)
    recipe = ToyRecipe(tmp_path / "run", max_steps=4, save_every=2)
    assert run_toy(recipe) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the disk is full") and "iter_000000002.pt is intact" in err[0]
    assert recipe.checkpoints.latest() == recipe.checkpoints.path(2)
    assert torch.load(recipe.checkpoints.path(2), weights_only=False)["x"] == 2
    assert not [p for p in recipe.checkpoints.dir.iterdir() if p.name.startswith(".")]  # no temporary left


# ------------------------------------------------------------------ 4. a lock left empty
def test_an_empty_lock_older_than_the_grace_is_taken_over(tmp_path, capsys):
    from patches.core.lock import EMPTY_GRACE_S, LOCK_NAME, RunLocked, hold_run_lock

    lock = tmp_path / LOCK_NAME
    lock.write_text("")
    with pytest.raises(RunLocked, match="being locked by another run right now"):  # planted: a fresh empty lock
        with hold_run_lock(tmp_path):
            pass
    old = time.time() - EMPTY_GRACE_S - 5
    os.utime(lock, (old, old))
    with hold_run_lock(tmp_path) as held:
        assert json.loads(held.read_text())["pid"] == os.getpid()
    assert "removing stale lock" in capsys.readouterr().out and not lock.exists()
    lock.write_text("{not json")
    os.utime(lock, (old, old))
    with hold_run_lock(tmp_path):
        pass


# ------------------------------------------------------------------ 5. captions that are not text
def _dataset(tmp_path: Path, sample_dataset: Path, caption_bytes: bytes) -> Path:
    import shutil

    root = tmp_path / "ds"
    shutil.copytree(sample_dataset, root)
    jsonl = root / "train" / "video_dataset_file.jsonl"
    lines = jsonl.read_bytes().splitlines(keepends=True)[:3]
    lines[1] = lines[1].replace(b'"caption": "', b'"caption": "' + caption_bytes, 1)
    jsonl.write_bytes(b"".join(lines))
    return root


@pytest.mark.parametrize("raw,needle", [(b"\xff\xfe ", "line 2 ... not UTF-8"), (b"\\ud800 ", "lone surrogate")],
                         ids=["not-utf8", "lone-surrogate"])
def test_a_caption_that_is_not_text_names_its_row_in_both_recipes(tmp_path, sample_dataset, capsys, raw, needle):
    from cosmos_framework_ext.recipe import train as cosmos
    from miles_ext.recipe import train as h3
    from patches.core.data.rows import DatasetError, load_records
    from tests.test_train import small_toml

    root = _dataset(tmp_path, sample_dataset, raw)
    with pytest.raises(DatasetError) as e:
        load_records(root)
    first, _, last = needle.partition(" ... ")
    assert ":2:" in str(e.value) and (first if not last else last) in str(e.value), str(e.value)
    assert load_records(_dataset(tmp_path / "ok", sample_dataset, b"plain "))  # planted: valid text loads
    os.environ.update(OUTPUT_ROOT=str(tmp_path / "out"), DATASET_PATH=str(root))
    try:
        assert cosmos.main(["--sft-toml", str(small_toml(tmp_path)), "--validate-only"]) == 2
    finally:
        del os.environ["DATASET_PATH"]
    assert h3.main(["--data-dir", str(root), "--validate-only", "--output-dir", str(tmp_path / "h3")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 2 and all(":2:" in line for line in err), err


# ------------------------------------------------------------------ 6. a cap below every sample
def test_a_cap_below_every_sample_is_one_line_before_training(env, capsys):
    from cosmos_framework_ext.levers.packing import PackingError, check_some_sample_fits
    from cosmos_framework_ext.recipe import train
    from tests.test_train import small_toml

    class Source:
        def __len__(self):
            return 2

        def min_token_count(self, i):
            return (30, 20)[i]

    with pytest.raises(PackingError, match="below every sample .* 20 tokens.*raise it above 20"):
        check_some_sample_fits(Source(), 20)  # the fit rule is strict: 20 < 20 is false
    check_some_sample_fits(Source(), 21)
    tmp_path = env
    toml = small_toml(tmp_path, **{"cpu_max_sequence_length = 300": "cpu_max_sequence_length = 8"})
    assert "= 8" in toml.read_text()
    assert train.main(["--sft-toml", str(toml)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the packing cap 8 is below every sample") and "Traceback" not in "\n".join(err)


# ------------------------------------------------------------------ 7. the long waits say what they do
def test_the_sample_dataset_says_it_is_being_prepared_once(tmp_path, capsys):
    from patches.core.data.sample_dataset import SampleSpec, prepare_sample_dataset

    prepare_sample_dataset(tmp_path / "sd", SampleSpec("tiny", 17))
    assert "preparing the sample dataset" in capsys.readouterr().out
    prepare_sample_dataset(tmp_path / "sd", SampleSpec("tiny", 17))
    assert "preparing" not in capsys.readouterr().out  # built once: nothing to say


def test_the_launcher_says_it_is_checking_before_the_run(tmp_path):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("COSMOS_", "MEMTEST", "EMAVAL"))}
    env.update(PYTHON=sys.executable, OUTPUT_ROOT=str(tmp_path / "out"), DATASET_PATH=str(tmp_path / "missing"))
    r = subprocess.run(["bash", str(REPO / "launchers" / "sft_edge_24gb.sh")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "checking every input before the run starts" in r.stdout
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: DATASET_PATH="), r.stderr


# ------------------------------------------------------------------ 8. the command line itself, Ctrl-C, the lock early
@pytest.mark.parametrize("argv,needle", [
    (["--sft-toml", "x.toml", "--max-iter", "abc"], "argument --max-iter: invalid int value: 'abc'"),
    (["--sft-toml", "x.toml", "--max-itr", "5"], "unrecognized arguments: --max-itr 5"),
], ids=["wrong-type", "unknown-flag"])
def test_a_bad_command_line_is_one_error_line(argv, needle, capsys):
    """The trainers' own argparse refusals: one ``error:`` line naming the command and ``--help``, exit 2 (argparse
    alone prints its usage block first: planted)."""
    import argparse

    from cosmos_framework_ext.recipe import train

    with pytest.raises(SystemExit) as e:
        train.parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: python -m cosmos_framework_ext.recipe.train")
    assert needle in err[0] and err[0].endswith("--help"), err
    plain = argparse.ArgumentParser(prog="p")  # planted: argparse's own parser
    plain.add_argument("--max-iter", type=int)
    with pytest.raises(SystemExit):
        plain.parse_args(["--max-iter", "abc"])
    assert len(capsys.readouterr().err.strip().splitlines()) > 1


def test_a_negative_value_after_a_space_says_to_use_equals(capsys):
    from miles_ext.recipe.train import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--lr", "-1e-4"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "argument --lr: expected one argument" in line and "--lr=-1e-4" in line


def test_ctrl_c_is_one_line_exit_130_and_the_lock_is_released(tmp_path):
    """A real process trains a toy recipe (one step a second) and gets SIGINT after its first step: one
    ``interrupted:`` line on stderr with the resume hint, exit 130, no traceback, no lock left. Planted: the same
    process without ``cli`` ends in a traceback."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "toy.py"
    script.write_text(f'''
import sys, time
sys.path[:0] = [{str(Path(__file__).resolve().parents[1])!r}]
from pathlib import Path
from patches.core.errors import cli
from patches.core.trainer import run
from tests.test_core_skeleton import ToyRecipe

class Slow(ToyRecipe):
    def train_step(self, step):
        print("step", step, flush=True)
        time.sleep(1.0)
        return super().train_step(step)

recipe = Slow(Path(sys.argv[1]), 20)
if sys.argv[2] == "cli":
    sys.exit(cli(lambda: run(recipe) and 0, interrupted="run the same command to resume"))
run(recipe)
''')
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for mode in ("cli", "plain"):
        p = subprocess.Popen([sys.executable, str(script), str(tmp_path / mode), mode], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
        while "step 0" not in p.stdout.readline():  # the progress bar shares the line (stdout)
            assert p.poll() is None
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        if mode == "cli":
            lines = [x for x in err.splitlines() if x.strip() and "%|" not in x]
            assert p.returncode == 130 and "Traceback" not in err, err
            assert lines[-1] == "interrupted: stopped by Ctrl-C; run the same command to resume", lines
            assert not (tmp_path / mode / ".onecard.lock").exists()
        else:
            assert "Traceback" in err and "KeyboardInterrupt" in err


def test_a_live_lock_is_refused_before_the_expensive_checks(env, capsys):
    """A run folder locked by a live process: ``--validate-only`` stops at the folder check with the holder named,
    before any dataset row is read (the lock's holder is this very process, alive). ``check_unlocked`` by hand: no
    file and a dead holder pass, a live holder and a fresh empty file are refused. Planted: a lock whose holder is
    dead passes."""
    import socket

    from cosmos_framework_ext.recipe import train
    from patches.core import lock
    from tests.test_train import small_toml

    toml = small_toml(env)
    run_dir = env / "out" / "cosmos3" / "sft" / "vision_sft_edge_24gb"  # the TOML's [job] project/group/name
    run_dir.mkdir(parents=True)
    (run_dir / lock.LOCK_NAME).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    assert train.main(["--sft-toml", str(toml), "--validate-only"]) == 2
    out = capsys.readouterr()
    (line,) = out.err.strip().splitlines()
    assert f"is in use by process {os.getpid()}" in line and "checking" not in out.out.lower(), (line, out.out)

    folder = env / "by-hand"
    folder.mkdir()
    lock.check_unlocked(folder)  # no lock file
    (folder / lock.LOCK_NAME).write_text("")
    with pytest.raises(lock.RunLocked, match="not written yet"):
        lock.check_unlocked(folder)
    (folder / lock.LOCK_NAME).write_text(json.dumps({"pid": 2**22 + 12345, "host": socket.gethostname()}))
    lock.check_unlocked(folder)  # a dead holder: the run will take the lock over
    (folder / lock.LOCK_NAME).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    with pytest.raises(lock.RunLocked, match="in use by process"):
        lock.check_unlocked(folder)


def test_unknown_preset_names_auto_and_an_empty_base_checkpoint_is_named(env, capsys):
    from cosmos_framework_ext.recipe import train
    from tests.test_train import small_toml

    toml = small_toml(env, **{'preset       = "auto"': 'preset       = "edg"'})
    assert train.main(["--sft-toml", str(toml), "--validate-only"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "[onecard].preset = 'edg' is unknown: use one of ['auto', 'edge', 'tiny']" in line
    empty = env / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(UserError, match="is an empty file"):
        train._check_base_checkpoint(str(empty))
    text = env / "text.pt"
    text.write_text("not a checkpoint")
    with pytest.raises(UserError, match=r"is not a torch checkpoint \(not the zip archive") as e:
        train._check_base_checkpoint(str(text))
    assert "mmap" not in str(e.value) and "please" not in str(e.value)
