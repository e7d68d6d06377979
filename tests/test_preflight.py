"""Pre-flight: every input a user can get wrong is found before torchrun starts a rank.

Each case runs the launcher exactly as a user would (``bash launchers/...``) and expects exit status 2, exactly
one ``error:`` line on stderr naming the problem, no traceback (neither Python's nor torchrun's), and no output
folder. These used to reach the ranks (exit 1 after a ``ChildFailedError`` report), or, for ``OUTPUT_ROOT``, to
fail only after every step had trained.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COSMOS = REPO / "launchers" / "sft_edge_24gb.sh"
H3 = REPO / "launchers" / "sft_h3_t2va_1gpu.sh"
CLEARED = ("MEMTEST", "EMAVAL", "DRYRUN", "TOML_FILE", "COSMOS_FRAMEWORK_ROOT", "DATASET_PATH", "BASE_CHECKPOINT_PATH",
           "WAN_VAE_PATH", "MASTER_PORT", "MASTER_ADDR", "NPROC_PER_NODE", "NNODES", "NODE_RANK", "RANK", "WORLD_SIZE",
           "LOCAL_RANK", "MILES_DIFFUSION_ROOT", "FROM_GPUS")


def launch(script: Path, tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in CLEARED}
    e.update(OUTPUT_ROOT=str(tmp_path / "out"), ONECARD_DATA_CACHE=str(tmp_path / "cache"), PYTHON=sys.executable,
             COSMOS_EMA_CPU_SUBSET="1", COSMOS_VAE_CPU_OFFLOAD="1")
    e.update(env)
    return subprocess.run(["bash", str(script), *args], env=e, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)


def assert_refused(r: subprocess.CompletedProcess, needle: str, tmp_path: Path, out: Path | None = None) -> str:
    """Exit 2, one ``error:`` line holding ``needle``, no traceback, and no output folder."""
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert len(lines) == 1 and needle in lines[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr, r.stderr[-3000:]
    out = out if out is not None else tmp_path / "out"
    assert not out.exists(), sorted(out.rglob("*"))
    assert not (tmp_path / "outputs").exists()
    return lines[0]


def dataset(tmp_path: Path, sample_dataset: Path, rows: list[str] | None = None, name: str = "data") -> Path:
    """A ``DATASET_PATH`` whose media are the sample dataset's and whose JSONL is ``rows`` (default: its rows)."""
    train = tmp_path / name / "train"
    train.mkdir(parents=True)
    (train / "media").symlink_to(sample_dataset / "train" / "media")
    src = (sample_dataset / "train" / "video_dataset_file.jsonl").read_text().splitlines()
    (train / "video_dataset_file.jsonl").write_text("".join(r + "\n" for r in (src if rows is None else rows)))
    return train.parent


def truncated_faststart_copy(src: Path, dst: Path) -> Path:
    """``src`` remuxed with its index first (``faststart``), then cut in half: it opens, and its first frame
    decodes, but the frames its index promises past the cut do not."""
    import av

    full = dst.with_name("full_" + dst.name)
    with av.open(str(src)) as i, av.open(str(full), "w", options={"movflags": "faststart"}) as o:
        stream = o.add_stream_from_template(i.streams.video[0])
        for pkt in i.demux(i.streams.video[0]):
            if pkt.dts is not None:
                pkt.stream = stream
                o.mux(pkt)
    data = full.read_bytes()
    assert data.find(b"moov") < data.find(b"mdat")  # the index comes first: the file still opens when cut
    dst.write_bytes(data[: len(data) // 2])
    full.unlink()
    return dst


# ------------------------------------------------------------------------------------ Cosmos: the dataset
@pytest.mark.parametrize("case", ["empty-jsonl", "row-missing-key", "one-folder-too-deep", "truncated-video"])
def test_cosmos_bad_dataset_is_refused_before_the_ranks(tmp_path, sample_dataset, case):
    rows = (sample_dataset / "train" / "video_dataset_file.jsonl").read_text().splitlines()
    if case == "empty-jsonl":
        root, needle = dataset(tmp_path, sample_dataset, rows=[]), "holds no rows"
    elif case == "row-missing-key":
        bad = json.loads(rows[3])
        del bad["windows"]
        root, needle = dataset(tmp_path, sample_dataset, rows=rows[:3] + [json.dumps(bad)]), ":4: missing key(s) ['windows']"
    elif case == "one-folder-too-deep":
        good = dataset(tmp_path, sample_dataset)
        root, needle = good / "train", f"is one folder too deep (it holds video_dataset_file.jsonl itself): use {good}"
    else:
        root = dataset(tmp_path, sample_dataset, rows=[])
        media = root / "train" / "media"
        media.unlink()
        media.mkdir()
        truncated_faststart_copy(sample_dataset / "train" / "media" / "bikes.mp4", media / "bikes.mp4")
        (root / "train" / "video_dataset_file.jsonl").write_text(
            "".join(r + "\n" for r in rows if "bikes.mp4" in r))
        needle = "bikes.mp4 (row"
    r = launch(COSMOS, tmp_path, DATASET_PATH=str(root))
    line = assert_refused(r, needle, tmp_path)
    if case == "truncated-video":
        assert "truncated" in line


# ------------------------------------------------------------------------ Cosmos: outputs, checkpoint, port
def _unwritable_folder(tmp_path: Path) -> Path | None:
    """A folder this process cannot write in (a read-only one; /sys when running as root), or None."""
    ro = tmp_path / "read_only"
    ro.mkdir()
    ro.chmod(0o555)
    for folder in (ro, Path("/sys")):
        try:
            (folder / ".probe").touch()
            (folder / ".probe").unlink()
        except OSError:
            return folder
    return None


def test_cosmos_output_root_under_a_regular_file(tmp_path, sample_dataset):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    r = launch(COSMOS, tmp_path, DATASET_PATH=str(sample_dataset), OUTPUT_ROOT=str(blocker / "runs"))
    line = assert_refused(r, f"{blocker} is a file, not a folder", tmp_path, out=blocker / "runs")
    assert "OUTPUT_ROOT=" in line and blocker.read_text() == "not a folder"


def test_cosmos_output_root_not_writable(tmp_path, sample_dataset):
    folder = _unwritable_folder(tmp_path)
    if folder is None:
        pytest.skip("every folder is writable here")
    r = launch(COSMOS, tmp_path, DATASET_PATH=str(sample_dataset), OUTPUT_ROOT=str(folder / "onecard-runs"))
    assert_refused(r, "is not writable", tmp_path, out=folder / "onecard-runs")


def test_cosmos_base_checkpoint_that_is_a_random_file(tmp_path, sample_dataset):
    junk = tmp_path / "model.pt"
    junk.write_bytes(os.urandom(4096))
    r = launch(COSMOS, tmp_path, DATASET_PATH=str(sample_dataset), BASE_CHECKPOINT_PATH=str(junk))
    assert_refused(r, f"BASE_CHECKPOINT_PATH={junk} is not a torch checkpoint (not the zip archive", tmp_path)


def test_cosmos_busy_master_port_and_refused_max_iter(tmp_path, sample_dataset):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = launch(COSMOS, tmp_path, DATASET_PATH=str(sample_dataset), MASTER_PORT=str(port))
    assert_refused(r, f"MASTER_PORT={port} is in use", tmp_path)
    r = launch(COSMOS, tmp_path, "--max-iter", "-1", DATASET_PATH=str(sample_dataset))
    assert "nothing to do" not in r.stdout
    assert_refused(r, "--max-iter = -1 must be >= 0", tmp_path)


# ---------------------------------------------------------------------------------------------- MiniMax-H3
@pytest.mark.parametrize("args, env, needle", [
    (["--num-rollout", "-1"], {}, "--num-rollout = -1 must be >= 1"),
    (["--lora-rank", "0"], {}, "--lora-rank = 0 must be >= 1"),
    ([], {"DATASET_PATH": "/nonexistent/dataset"}, "--data-dir /nonexistent/dataset (DATASET_PATH in the launcher)"),
    ([], {"MASTER_PORT": "BUSY"}, "MASTER_PORT="),
], ids=["num-rollout-negative", "lora-rank-zero", "missing-dataset-path", "busy-master-port"])
def test_h3_bad_input_is_refused_before_anything_is_encoded(tmp_path, args, env, needle):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        env = {k: str(busy.getsockname()[1]) if v == "BUSY" else v for k, v in env.items()}
        r = launch(H3, tmp_path, *args, **env)
    line = assert_refused(r, needle, tmp_path)
    assert "--dataset " not in line and "nothing to do" not in r.stdout
    if "MASTER_PORT" in env:
        assert f"MASTER_PORT={env['MASTER_PORT']} is in use" in line


# ------------------------------------------------------------------------------- the check helpers, in-process
def test_check_at_least_refuses_nan_and_values_below():
    """``check_at_least``: ``value >= minimum`` passes (the bound included); below it, and NaN (which compares
    false with everything), are one UserError naming the setting, its value and the hint."""
    from patches.core.errors import UserError
    from patches.core.preflight import check_at_least

    check_at_least(2, 2, "--steps")
    check_at_least(2.5, 1, "--steps")
    for bad in (float("nan"), 1, -float("inf")):
        with pytest.raises(UserError, match=r"--steps = .* must be >= 2; raise it"):
            check_at_least(bad, 2, "--steps", "raise it")


def test_check_writable_refuses_a_broken_link_at_the_path_itself(tmp_path):
    """An output folder that is itself a dangling symbolic link cannot be created (``mkdir`` fails with
    FileExistsError): refused up front naming the link, as a dangling link higher up the path is; a folder that is
    a working link, or a missing one under a writable folder, passes."""
    from patches.core.errors import UserError
    from patches.core.preflight import check_writable

    (tmp_path / "out").symlink_to(tmp_path / "gone")
    with pytest.raises(UserError, match=f"{tmp_path / 'out'} is a broken symbolic link"):
        check_writable(tmp_path / "out", "OUTPUT_ROOT")
    with pytest.raises(UserError, match="broken symbolic link"):
        check_writable(tmp_path / "out" / "run1", "OUTPUT_ROOT")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert check_writable(tmp_path / "link", "OUTPUT_ROOT") == tmp_path / "link"
    assert check_writable(tmp_path / "new" / "run", "OUTPUT_ROOT") == tmp_path / "new" / "run"
    assert not (tmp_path / "new").exists()


def test_check_writable_refuses_a_path_it_cannot_look_at(tmp_path):
    """A folder name too long for the file system (``OSError`` ENAMETOOLONG from ``exists()``) is one ``UserError``
    naming the flag, not a traceback; a long name that fits passes."""
    from patches.core.errors import UserError
    from patches.core.preflight import check_writable

    with pytest.raises(UserError, match=r"^--out='.*' cannot be used \(File name too long\); point --out at another"):
        check_writable(tmp_path / ("a" * 300), "--out")
    assert check_writable(tmp_path / ("a" * 200), "--out") == tmp_path / ("a" * 200)
