"""Resuming a run trains what it started, says what it changes, and never loses a checkpoint silently.

Both trainers, as a user meets them: a setting that changes what is trained (a new ``[optimizer].lr`` in the
TOML, a new ``--lr`` or ``--lora-alpha`` for H3) stops the resume with one error naming both values; a setting
that may change (``max_iter``/``--num-rollout``, ``save_iter``) is applied and said in one line; a truncated
newest checkpoint is reported in one line and the run resumes from the one before (exactly); temporary files of a
killed save are removed and said; a second run into a folder whose lock a live process holds stops with exit 2
and one error naming the lock and the process, and a lock left by a dead process is taken over.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cosmos_framework_ext.recipe import train
from patches.core import settings as settingsmod
from patches.core.checkpoint import CheckpointManager
from patches.core.lock import LOCK_NAME

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "toml" / "vision_sft_edge_24gb.toml"
JOB = ("cosmos3", "sft", "vision_sft_edge_24gb")
SMALL = {"cpu_max_iter": "4", "cpu_grad_accum_iter": "1", "cpu_max_sequence_length": "300", "save_iter": "2"}


def recipe_toml(tmp_path: Path, **values: str) -> Path:
    """The 24 GB recipe with its CPU smoke shrunk (4 iterations, a checkpoint every 2), then ``values`` set."""
    import re

    text = RECIPE.read_text()
    for key, value in {**SMALL, **values}.items():
        text, n = re.subn(rf"^{key}(\s*)=.*$", rf"{key}\g<1>= {value}", text, flags=re.M)
        assert n == 1, key
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


from tests.test_train import env  # noqa: E402,F401 - the same fixture: a private output folder, both levers on


def run_main(args, capsys) -> tuple[int, str, str]:
    rc = train.main(args)
    got = capsys.readouterr()
    return rc, got.out, got.err


def error_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.startswith("error:")]


def dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def write_lock(run_dir: Path, pid: int) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / LOCK_NAME
    lock.write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    return lock


# ------------------------------------------------------------------------------------------ the core rule
def test_compare_refuses_a_change_names_both_values_and_applies_adjustable_ones():
    saved = {"lr": 1e-4, "keys": ["a", "b"], "max_iter": 4, "seed": 0}
    assert settingsmod.compare(None, saved) == []  # a checkpoint from before settings were stored
    assert settingsmod.compare(saved, dict(saved, max_iter=4.0)) == []  # 4 == 4.0
    notes = settingsmod.compare(saved, dict(saved, max_iter=6), adjustable={"max_iter"}, checkpoint="ck.pt")
    assert notes == ["max_iter changed since ck.pt: 4 -> 6 (applied)"]
    with pytest.raises(settingsmod.SettingsChanged) as e:
        settingsmod.compare(saved, dict(saved, lr=2e-4, keys=["a"], max_iter=6), adjustable={"max_iter"},
                            checkpoint="ck.pt")
    msg = str(e.value)
    assert "\n" not in msg and "lr was 0.0001, now 0.0002" in msg and "keys was ['a', 'b'], now ['a']" in msg
    assert "max_iter" not in msg  # adjustable: not a reason to refuse
    assert settingsmod.compare(saved, {"lr": 1e-4, "new_setting": 3}) == []  # not in the checkpoint: not compared



def test_compare_tells_a_boolean_from_the_number_it_equals():
    """A boolean setting is not the integer it compares equal to in Python: ``True`` saved and ``1`` given (a flag
    turned into a count, say) is a change, and so are ``False`` -> ``0`` and ``1`` -> ``True``; ``True`` -> ``True``
    and ``1`` -> ``1.0`` are not. Expectations by hand from the module's rule (bool compared by identity)."""
    for old, new in ((True, 1), (False, 0), (1, True), (0.0, False), ([True], [1])):
        with pytest.raises(settingsmod.SettingsChanged, match=re.escape(f"flag was {old!r}, now {new!r}")):
            settingsmod.compare({"flag": old}, {"flag": new}, checkpoint="ck.pt")
    for old, new in ((True, True), (False, False), (1, 1.0), ([1, True], [1.0, True])):
        assert settingsmod.compare({"flag": old}, {"flag": new}) == []


# ---------------------------------------------------------------------------------------------- Cosmos
def test_cosmos_resume_refuses_a_new_lr_and_applies_a_new_save_interval(env, monkeypatch, capsys):
    toml = recipe_toml(env)
    assert run_main(["--sft-toml", str(toml), "--max-iter", "2"], capsys)[0] == 0
    run_dir = env / "out" / Path(*JOB)
    ckpt = CheckpointManager(run_dir).latest()
    stored = torch.load(ckpt, weights_only=False)[settingsmod.KEY]
    assert stored["[optimizer].lr"] == 1e-4 and stored["world size (NPROC_PER_NODE x NNODES)"] == 1
    before = ckpt.read_bytes()

    changed = recipe_toml(env, lr="2.0e-4")
    rc, out, err = run_main(["--sft-toml", str(changed), "--max-iter", "3"], capsys)
    lines = error_lines(err)
    assert rc == 2 and len(lines) == 1, err
    assert "[optimizer].lr was 0.0001, now 0.0002" in lines[0] and str(ckpt) in lines[0]
    assert CheckpointManager(run_dir).latest() == ckpt and ckpt.read_bytes() == before  # nothing written
    rc, _, err = run_main(["--sft-toml", str(changed), "--max-iter", "3", "--validate-only"], capsys)
    assert rc == 2 and "[optimizer].lr was 0.0001" in err  # the launcher's validate step finds it too

    legit = recipe_toml(env, save_iter="3")
    rc, out, err = run_main(["--sft-toml", str(legit), "--max-iter", "3"], capsys)
    assert rc == 0, err
    assert "[checkpoint].save_iter changed since" in out and "2 -> 3 (applied)" in out
    assert "[trainer].max_iter changed since" in out and "2 -> 3 (applied)" in out


def test_cosmos_truncated_latest_checkpoint_is_one_line_and_the_resume_is_exact(env, monkeypatch, capsys):
    toml = str(recipe_toml(env))  # 4 iterations, a checkpoint every 2
    assert run_main(["--sft-toml", toml], capsys)[0] == 0
    m = CheckpointManager(env / "out" / Path(*JOB))
    good = torch.load(m.path(4), weights_only=False)
    m.path(4).write_bytes(m.path(4).read_bytes()[:1000])  # the newest, cut short
    (m.dir / ".iter_000000005.pt.tmp-x1y2").write_bytes(b"half")  # what a killed save leaves
    rc, out, err = run_main(["--sft-toml", toml], capsys)
    assert rc == 0, err
    said = [x for x in err.splitlines() if "is damaged" in x]
    assert len(said) == 1 and said[0].startswith("onecard: warning: checkpoint ") and str(m.path(4)) in said[0]
    assert "resuming from iter_000000002.pt" in said[0]
    assert "Warning" not in err and "warnings.warn" not in err  # one line, not a Python warning's two
    assert "removed 1 temporary file(s) a killed save left" in err
    assert f"resumed from {m.path(2)} at iteration 2" in out
    again = torch.load(m.path(4), weights_only=False)
    assert all(torch.equal(good["model"][k], again["model"][k]) for k in good["model"])


def test_cosmos_second_run_while_a_live_process_holds_the_lock(env, monkeypatch, capsys):
    run_dir = env / "out" / Path(*JOB)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock = write_lock(run_dir, holder.pid)
        rc, out, err = run_main(["--sft-toml", str(recipe_toml(env))], capsys)
    finally:
        holder.kill()
        holder.wait()
    lines = error_lines(err)
    assert rc == 2 and len(lines) == 1, err
    assert str(lock) in lines[0] and f"process {holder.pid}" in lines[0]
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]  # nothing trained or written

    write_lock(run_dir, dead_pid())  # the holder died without removing it
    rc, out, err = run_main(["--sft-toml", str(recipe_toml(env)), "--max-iter", "1", "--no-save"], capsys)
    assert rc == 0, err
    assert "removing stale lock" in out and not (run_dir / LOCK_NAME).exists()


# ---------------------------------------------------------------------------------------------- MiniMax-H3
H3_ARGS = ["--rollout-batch-size", "8", "--num-steps-per-rollout", "1", "--lora-rank", "4", "--lora-alpha", "8"]


def h3(out_dir: Path, data: Path, *extra: str, monkeypatch, capsys) -> tuple[int, str, str]:
    """The H3 trainer in this process (its imports paid once), as the launcher would call it on a CPU."""
    from miles_ext.recipe import train as h3train

    monkeypatch.delenv("MASTER_PORT", raising=False)  # the trainer sets it; restored after the test
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    rc = h3train.main(["--from-gpus", "8", "--fsdp-master-dtype", "bf16", "--output-dir", str(out_dir),
                       "--data-dir", str(data), *H3_ARGS, *extra])
    got = capsys.readouterr()
    return rc, got.out, got.err


@pytest.fixture()
def two_clip_dataset(tmp_path, sample_dataset) -> Path:
    """Two rows of the sample dataset: the H3 runs below encode two clips, not 67."""
    data = tmp_path / "two_clips" / "train"
    data.mkdir(parents=True)
    (data / "media").symlink_to(sample_dataset / "train" / "media")
    rows = (sample_dataset / "train" / "video_dataset_file.jsonl").read_text().splitlines()
    (data / "video_dataset_file.jsonl").write_text("\n".join(rows[:2]) + "\n")
    return data.parent


def test_h3_resume_refuses_new_lr_and_lora_alpha_reports_damage_and_locks(tmp_path, two_clip_dataset,
                                                                           monkeypatch, capsys):
    out = tmp_path / "h3"
    rc, o, err = h3(out, two_clip_dataset, monkeypatch=monkeypatch, capsys=capsys)
    assert rc == 0, err
    m = CheckpointManager(out)
    first = m.path(1).read_bytes()
    assert torch.load(m.path(1), weights_only=False)[settingsmod.KEY]["--lr"] == 1e-4

    for extra, needle in ((["--lr", "2e-4"], "--lr was 0.0001, now 0.0002"),
                          (["--lora-alpha", "16"], "--lora-alpha was 8.0, now 16.0")):
        rc, o, err = h3(out, two_clip_dataset, "--num-rollout", "2", *extra, monkeypatch=monkeypatch, capsys=capsys)
        lines = error_lines(err)
        assert rc == 2 and len(lines) == 1 and needle in lines[0], err
        assert [p for _, p in m.all()] == [m.path(1)] and m.path(1).read_bytes() == first

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock = write_lock(out, holder.pid)
        rc, o, err = h3(out, two_clip_dataset, "--num-rollout", "2", monkeypatch=monkeypatch, capsys=capsys)
    finally:
        holder.kill()
        holder.wait()
    lines = error_lines(err)
    assert rc == 2 and len(lines) == 1 and str(lock) in lines[0] and f"process {holder.pid}" in lines[0], err

    # a stale lock, and a newest checkpoint that is cut short: both said in one line, the run goes on
    write_lock(out, dead_pid())
    shutil.copyfile(m.path(1), m.path(2))
    m.path(2).write_bytes(first[: len(first) // 3])
    rc, o, err = h3(out, two_clip_dataset, "--num-rollout", "2", monkeypatch=monkeypatch, capsys=capsys)
    assert rc == 0, err
    said = [x for x in err.splitlines() if "is damaged" in x]
    assert len(said) == 1 and said[0].startswith("onecard: warning: checkpoint ") and "iter_000000002.pt" in said[0]
    assert "removing stale lock" in o and f"resumed from {m.path(1)} after rollout 1" in o
    assert "--num-rollout changed since" in o and "1 -> 2 (applied)" in o
    assert torch.load(m.path(2), weights_only=False)["rollout"] == 2
