"""The miles-diffusion patch table over upstream's REAL code: ``benchmarks/upstream/miles_real_cpu.py``.

Upstream's files never enter this repository, so the runs against them need a ``miles/...`` tree assembled outside it
(``MILES_DIFFUSION_ROOT``; ``MILES_DIFFUSION_STUBS`` optionally names a folder of stub modules for it). Claims:

- without upstream: bad input to the harness (a ``--miles-root`` that does not exist, is not a miles-diffusion
  tree, or lies inside this repository; an unknown ``--configs`` or ``--plant``; a missing ``--stubs``) is one
  ``error:`` line, exit 2, nothing written;
- with upstream: every check of every configuration passes (patched ``apply_fsdp2`` + one-rank state load: values
  bitwise the source state, the promised wrap units, the same values and gradients as upstream's own functions);
- with upstream: each planted bug makes the check it targets fail (exit 1, the failing check named in the result).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "upstream" / "miles_real_cpu.py"
ROOT = os.environ.get("MILES_DIFFUSION_ROOT")
STUBS = os.environ.get("MILES_DIFFUSION_STUBS")
NEEDS_UPSTREAM = pytest.mark.skipif(
    not ROOT, reason="needs MILES_DIFFUSION_ROOT: a miles/ tree of radixark/miles_diffusion's files, outside this repo")


def _harness(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}  # no flag of the caller's leaks in
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=timeout)


def _upstream_args(out: Path, *extra: str) -> list[str]:
    return ["--miles-root", str(ROOT), *(["--stubs", STUBS] if STUBS else []), "--out", str(out), *extra]


BAD = [
    (["--miles-root", "/nonexistent/miles_diffusion"], "--miles-root /nonexistent/miles_diffusion: no such folder"),
    (["--miles-root", "{tmp}"], "lacks miles/backends/fsdp_utils/model_loader.py"),
    (["--miles-root", str(REPO / "tests" / "fake_miles")], "inside this repository"),
    (["--miles-root", "{tree}", "--configs", "nosuch"], "--configs 'nosuch'"),
    (["--miles-root", "{tree}", "--plant", "nosuch"], "--plant 'nosuch'"),
    (["--miles-root", "{tree}", "--stubs", "/nonexistent/stubs"], "--stubs /nonexistent/stubs: no such folder"),
]


@pytest.mark.parametrize("args,mentions", BAD, ids=["missing-root", "not-a-tree", "inside-repo", "configs", "plant",
                                                    "stubs"])
def test_bad_input_is_one_error_line_and_nothing_written(tmp_path, args, mentions):
    tree = tmp_path / "tree"  # looks like a miles-diffusion tree (the two target files), outside the repo
    (tree / "miles" / "backends" / "fsdp_utils").mkdir(parents=True)
    for name in ("model_loader.py", "checkpoint.py"):
        (tree / "miles" / "backends" / "fsdp_utils" / name).write_text("")
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    r = _harness(*[a.format(tmp=empty, tree=tree) for a in args], "--out", str(out), timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert mentions in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir())


@NEEDS_UPSTREAM
def test_every_check_passes_against_real_upstream(tmp_path):
    r = _harness(*_upstream_args(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (res,) = tmp_path.glob("*_miles_cpu_real-upstream.json")
    result = json.loads(res.read_text())
    assert result["all_passed"] and result["plant"] == ""
    assert [r["config"]["name"] for r in result["rows"]] == ["lora-fp32-offload", "lora-fp32", "lora-bf16-offload",
                                                             "lora-fp32-offload-resident1", "full-fp32-offload"]
    for row in result["rows"]:
        assert all(row["checks"].values()), (row["config"]["name"], row["checks"])
        assert row["patched_targets"] == ["miles.backends.fsdp_utils.model_loader:apply_fsdp2",
                                          "miles.backends.fsdp_utils.checkpoint:broadcast_full_state_to_fsdp"]
        assert row["patched_shims"] == []  # the patched path runs on a CPU-only torch as it is
    files = {f["path"]: f for f in result["upstream_files"]}
    for target in ("model_loader.py", "checkpoint.py"):
        f = files[f"miles/backends/fsdp_utils/{target}"]
        assert len(f["sha256"]) == 64
    assert (tmp_path / res.name.replace(".json", ".md")).is_file()


PLANTED = {
    "skip-param": {"load_bitwise", "same_as_unpatched"},
    "flip-element": {"load_bitwise", "same_as_unpatched"},
    "unpatched-apply": {"units"},
    "grad-noise": {"grads_same_as_unpatched"},
}


@NEEDS_UPSTREAM
@pytest.mark.parametrize("plant", sorted(PLANTED))
def test_a_planted_bug_is_reported(tmp_path, plant):
    r = _harness(*_upstream_args(tmp_path, "--configs", "lora-fp32-offload", "--plant", plant))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    (res,) = tmp_path.glob(f"*_miles_cpu_real-upstream-planted-{plant}.json")
    result = json.loads(res.read_text())
    (row,) = result["rows"]
    failed = {k for k, ok in row["checks"].items() if not ok}
    assert not result["all_passed"] and PLANTED[plant] <= failed, (plant, row["checks"])
    if plant == "grad-noise":
        assert failed == {"grads_same_as_unpatched"}  # only what was planted
