"""The smaller command lines and the launchers, checked by meaning: each bad value is one ``error:`` line on stderr,
exit status 2, before any work and with nothing written. Each kind has a planted check beside it (the good
neighbouring value passes, or the check turned off lets the bad value through), so the test can fail.

- the memory ledger (``python -m patches.ledger``): ``--budget-gib`` / ``BUDGET_GIB`` absurd or overflowing,
  ``--world-size`` out of range, an unknown ``--preset``;
- the packing planner (``python -m cosmos_framework_ext.recipe.plan``): counts out of range, a ``--json`` path that
  cannot be written, a cap that drops every sample; its JSON stays valid JSON;
- the GPU budgets the residency planner fills (``MILES_GPU_BUDGET_GIB``, ``ONECARD_GPU_MEMORY_GIB`` without a card);
- ``launchers/sft_edge_24gb.sh``: ``NPROC_PER_NODE`` / ``NNODES`` / ``NODE_RANK`` / ``MASTER_PORT``, boolean flags with
  spaces, a ``COSMOS_FRAMEWORK_ROOT`` without ``cosmos_framework/scripts/train.py``, the TOML copy removed on every
  exit; ``launchers/sft_h3_t2va_1gpu.sh``'s ``FROM_GPUS``;
- ``python -m patches.run``: no module, a flag instead of one, a module that does not exist.

No test here trains: every launcher run fails before the trainer starts, or runs a fake torchrun.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cosmos_framework_ext.recipe import plan as planmod
from patches.core import flags as flagmod
from patches.core import ledger as coreledger

from .cli import run_main

REPO = Path(__file__).resolve().parents[1]
TOML = REPO / "toml" / "vision_sft_edge_24gb.toml"
COSMOS = REPO / "launchers" / "sft_edge_24gb.sh"
H3 = REPO / "launchers" / "sft_h3_t2va_1gpu.sh"
CLEARED = ("COSMOS_", "MILES_", "MEMTEST", "EMAVAL", "DRYRUN", "TOML_FILE", "DATASET_PATH", "BASE_CHECKPOINT_PATH",
           "WAN_VAE_PATH", "MASTER_PORT", "MASTER_ADDR", "NPROC_PER_NODE", "NNODES", "NODE_RANK", "RANK", "WORLD_SIZE",
           "LOCAL_RANK", "FROM_GPUS", "RESIDENT_BLOCKS", "BUDGET_GIB", "ONECARD_", "TAIL_OVERRIDES", "OUTPUT_ROOT",
           "IMAGINAIRE_OUTPUT_ROOT")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEARED)}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(PYTHON=sys.executable, OUTPUT_ROOT=str(tmp_path / "out"), ONECARD_DATA_CACHE=str(tmp_path / "cache"))
    env.update(extra)
    return env


def _tmpdir(tmp_path: Path) -> Path:
    """The ``TMPDIR`` of the launcher runs that stage a TOML copy (``mktemp -d`` makes ``tmp.*`` there)."""
    d = tmp_path / "tmp"
    d.mkdir(exist_ok=True)
    return d


def _run(cmd: list[str], tmp_path: Path, timeout: float = 60, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=_env(tmp_path, **extra), capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path)


def _in_process(main, argv: list[str], tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    """``python -m <module> ARGV`` in this process (:func:`tests.cli.run_main`), with :func:`_run`'s environment and
    working directory."""
    return run_main(main, argv, _env(tmp_path, **extra), tmp_path)


def _one_error(r: subprocess.CompletedProcess | tuple[int, str], *needles: str) -> str:
    """The run's one stderr line: it starts with ``error:``, holds every needle, and the status is 2."""
    code, err = (r.returncode, r.stderr) if isinstance(r, subprocess.CompletedProcess) else r
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _written(tmp_path: Path) -> set[str]:
    """What a refused run left in ``tmp_path``."""
    return {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}


# ------------------------------------------------------------------ 1. the memory ledger


@pytest.mark.parametrize("text", ["1e300", "1e20", "1025", "1e-30", "nan", "-1", "inf"])
def test_ledger_budget_out_of_range_is_one_line(text, capsys):
    from patches import ledger

    assert ledger.main(["--toml", str(TOML), f"--budget-gib={text}", "--preset", "tiny"]) == 2
    _one_error((2, capsys.readouterr().err), "--budget-gib", repr(text))


def test_ledger_budget_bounds_are_the_ones_that_hold():
    """Planted: the neighbours pass; without the upper bound ``1e300`` overflows (``int(inf)``), the old bug."""
    assert coreledger.parse_budget("1024") == 1024 * 2**30
    assert coreledger.parse_budget("0.01") == int(0.01 * 2**30) > 0
    with pytest.raises(OverflowError):
        int(float("1e300") * 2**30)  # what parse_budget returned before the bound
    with pytest.raises(ValueError, match="from 0.01 to 1024"):
        coreledger.parse_budget("1e300")


def test_ledger_budget_variable_overflow_and_blank(monkeypatch, capsys):
    from patches import ledger

    monkeypatch.setenv("BUDGET_GIB", "1e300")  # before: OverflowError traceback (what DRYRUN=1 BUDGET_GIB=1e300 showed)
    assert ledger.main(["--toml", str(TOML), "--preset", "tiny"]) == 2
    _one_error((2, capsys.readouterr().err), "BUDGET_GIB '1e300'")
    monkeypatch.setenv("BUDGET_GIB", " ")  # blank reads as unset, as every variable does: the default budget
    assert ledger.main(["--toml", str(TOML), "--preset", "tiny"]) == 0
    assert "budget 22.06 GiB" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "-1", "1048577", "99999999999999999999", " 2", "2.0", "abc"])
def test_ledger_world_size_out_of_range_is_one_line(value, capsys):
    from patches import ledger

    with pytest.raises(SystemExit) as e:
        ledger.main(["--toml", str(TOML), f"--world-size={value}", "--preset", "tiny"])
    _one_error((e.value.code, capsys.readouterr().err), "argument --world-size", "from 1 to 1048576")


def test_ledger_world_size_bound_is_inclusive(capsys):
    """Planted: the largest world size is sized (its ledger shards to almost nothing), and so is 1."""
    from patches import ledger

    for ws in ("1", str(flagmod.MAX_WORLD_SIZE)):
        assert ledger.main(["--toml", str(TOML), f"--world-size={ws}", "--preset", "tiny"]) == 0
        assert f"{ws} rank(s)" in capsys.readouterr().out


def test_ledger_unknown_preset_is_one_line_naming_the_flag(capsys):
    from patches import ledger

    with pytest.raises(SystemExit) as e:
        ledger.main(["--toml", str(TOML), "--preset", "huge"])
    _one_error((e.value.code, capsys.readouterr().err), "argument --preset", "'huge'", "edge")


# ------------------------------------------------------------------ 1b. the GPU budgets the residency planner fills


@pytest.mark.parametrize("value", ["1e300", "1025"])
def test_miles_gpu_budget_too_large_is_refused(value, tmp_path):
    env = {"MILES_ONECARD_FSDP": "1", "MILES_RESIDENT_BLOCKS": "auto", "MILES_GPU_BUDGET_GIB": value}
    _one_error(_in_process("patches.__main__", ["check"], tmp_path, **env), "MILES_GPU_BUDGET_GIB", "1024")
    assert flagmod.miles_gpu_budget_gib({"MILES_GPU_BUDGET_GIB": "1024"}) == 1024.0  # planted: the bound itself
    assert _written(tmp_path) == set()


def test_gpu_memory_cap_without_a_card_is_bounded(monkeypatch):
    from patches.core.device import gpu_budget_bytes, gpu_memory_cap_gib
    from patches.core.errors import UserError

    with pytest.raises(UserError, match="ONECARD_GPU_MEMORY_GIB='1e300'"):
        gpu_memory_cap_gib(environ={"ONECARD_GPU_MEMORY_GIB": "1e300"})
    assert gpu_memory_cap_gib(environ={"ONECARD_GPU_MEMORY_GIB": "1024"}) == 1024.0  # planted: the bound passes
    with pytest.raises(UserError):  # a card's own total still bounds it
        gpu_memory_cap_gib(2**30, environ={"ONECARD_GPU_MEMORY_GIB": "2"})
    import torch

    monkeypatch.setenv("ONECARD_GPU_MEMORY_GIB", "1e300")  # before: int(inf) raised OverflowError here
    with pytest.raises(UserError):
        gpu_budget_bytes(torch.device("cpu"))
    monkeypatch.setenv("ONECARD_GPU_MEMORY_GIB", "2")
    assert gpu_budget_bytes(torch.device("cpu")) == 2 * 2**30


# ------------------------------------------------------------------ 1c. the packing planner


def _plan(tmp_path: Path, *argv: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m cosmos_framework_ext.recipe.plan --preset tiny ARGV`` (in this process: :func:`_in_process`)."""
    extra = {"ONECARD_DATA_CACHE": str(cache)} if cache else {}
    return _in_process(planmod.main, ["--preset", "tiny", *argv], tmp_path, **extra)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One data cache with the tiny sample dataset for the planner runs that get past their arguments."""
    from cosmos_framework_ext.recipe.presets import get_preset
    from patches.core.data.sample_dataset import prepare_sample_dataset

    root = tmp_path_factory.mktemp("cache")
    prepare_sample_dataset(root / "sample_dataset_tiny", get_preset("tiny"))
    return root


PLAN_OK = ("--cap", "12288", "--ref-cap", "45056", "--ref-grad-accum", "2", "--ref-world-size", "8")


def _with(flag: str, value: str) -> list[str]:
    args = list(PLAN_OK)
    if flag in args:
        i = args.index(flag)
        del args[i:i + 2]
    return [*args, f"{flag}={value}"]


@pytest.mark.parametrize("flag,value", [
    ("--cap", "0"), ("--cap", "99999999999999999999999"), ("--cap", "2147483648"), ("--cap", " 12288"),
    ("--cap", "1_000"), ("--ref-cap", "-5"), ("--ref-grad-accum", "99999999999999999999"),
    ("--ref-grad-accum", "1048577"), ("--ref-world-size", "99999999999999999999"), ("--world-size", "1048577"),
    ("--world-size", "0"), ("--max-caption-tokens", "99999999999999999999"), ("--max-caption-tokens", "-1"),
])
def test_planner_count_out_of_range_is_one_line_before_any_work(flag, value, tmp_path):
    """Before: a huge world size hung (one simulated rank each), a huge grad accum or cap was planned; now argparse's
    one line, before the sample dataset is built."""
    out = tmp_path / "plan.json"
    r = _plan(tmp_path, *_with(flag, value), "--json", str(out))
    _one_error(r, f"argument {flag}", repr(value), "give plain digits")
    assert r.stdout == "" and _written(tmp_path) == set()


def test_planner_bounds_pass(tmp_path, cache):
    """Planted: the largest accepted counts run (world sizes at the bound take seconds, not a hang) and write a
    valid JSON report."""
    out = tmp_path / "plan.json"
    r = _plan(tmp_path, "--cap", str(planmod.MAX_TOKENS), "--ref-cap", "45056", "--ref-world-size", "1024",
              "--ref-grad-accum", str(planmod.MAX_GRAD_ACCUM), "--json", str(out), cache=cache)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert data["ref_grad_accum"] == planmod.MAX_GRAD_ACCUM and data["grad_accum"] >= 1


@pytest.mark.parametrize("which", ["--cap", "--ref-cap"])
def test_planner_cap_that_drops_every_sample_is_refused(which, tmp_path, cache):
    """Before: ``--ref-cap 10`` exited 0 with a reference of 0 samples per step and a made-up grad accum of 1, and
    ``--cap 10`` wrote its all-zero report; now one line naming the cap that drops nothing, nothing written."""
    out = tmp_path / "plan.json"
    r = _plan(tmp_path, *_with(which, "10"), "--json", str(out), cache=cache)
    _one_error(r, f"{which} 10 drops every sample", f"use {which} 95 or more")
    assert r.stdout == "" and not out.exists()  # no table, no report


@pytest.mark.parametrize("which", ["--cap", "--ref-cap"])
def test_planner_cap_that_drops_some_samples_is_still_a_plan(which, tmp_path, cache):
    """Planted: a cap that drops only some samples is still a report (exit 1 for ours, as documented)."""
    out = tmp_path / "plan.json"
    part = _plan(tmp_path, *_with(which, "80"), "--json", str(out), cache=cache)
    assert part.returncode == (1 if which == "--cap" else 0), part.stderr
    assert json.loads(out.read_text())["num_samples"] == 67


def test_planner_json_that_cannot_be_written_is_refused_before_work(tmp_path):
    folder = tmp_path / "a_folder"
    folder.mkdir()
    _one_error(_plan(tmp_path, *PLAN_OK, "--json", str(folder)), "is a folder")
    afile = tmp_path / "a_file"
    afile.write_text("x")
    _one_error(_plan(tmp_path, *PLAN_OK, "--json", str(afile / "sub" / "plan.json")), "is a file, not a folder")
    assert _written(tmp_path) == {"a_folder", "a_file"}  # the sample dataset was not even built
    assert afile.read_text() == "x"


def test_planner_json_check_is_what_refuses_before_work(tmp_path, monkeypatch, capsys, cache):
    """Planted: with the up-front check off, the same ``--json FOLDER`` is found only after the work (the sample
    dataset built, the plan simulated); before this change it was an ``IsADirectoryError`` traceback there."""
    folder = tmp_path / "a_folder"
    folder.mkdir()
    monkeypatch.setenv("ONECARD_DATA_CACHE", str(cache))
    monkeypatch.setattr(planmod, "_json_problem", lambda path: None)
    assert planmod.main(["--preset", "tiny", *PLAN_OK, "--json", str(folder)]) == 2
    out, err = capsys.readouterr()
    _one_error((2, err), "--json", "cannot be written")
    assert "dataset:" not in out  # the report is still not printed, but the dataset was read and the plan made


def test_planner_json_is_never_nan():
    from cosmos_framework_ext.levers.packing import plan

    report = plan([10, 20], 100, 100, 1, 1)
    report.ref_samples_per_step = float("inf")  # what an overflowing product would be
    with pytest.raises(ValueError):
        report.to_json()
    report.ref_samples_per_step = 2.0  # planted: a finite one is JSON
    assert json.loads(report.to_json())["ref_samples_per_step"] == 2.0


# ------------------------------------------------------------------ 2. the Cosmos launcher


def _launch(tmp_path: Path, script: Path = COSMOS, *args: str, **extra: str) -> subprocess.CompletedProcess:
    extra.setdefault("DATASET_PATH", str(tmp_path / "missing"))  # any run that gets past the launcher stops here
    if "COSMOS_FRAMEWORK_ROOT" in extra:
        extra.setdefault("TMPDIR", str(_tmpdir(tmp_path)))
    return _run(["bash", str(script), *args], tmp_path, **extra)


@pytest.mark.parametrize("env,needle", [
    ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE=0 is not a whole number from 1 to 1024"),
    ({"NPROC_PER_NODE": "1025"}, "NPROC_PER_NODE=1025 is not a whole number from 1 to 1024"),
    ({"NPROC_PER_NODE": "99999999999999999999"}, "NPROC_PER_NODE=99999999999999999999"),
    ({"NPROC_PER_NODE": " 1"}, "NPROC_PER_NODE=' 1' is not a whole number"),
    ({"NPROC_PER_NODE": "1e3"}, "NPROC_PER_NODE=1e3"),
    ({"NNODES": "0"}, "NNODES=0 is not a whole number from 1 to 1024"),
    ({"NNODES": "-2"}, "NNODES=-2"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2 is not a whole number from 0 to 1"),
    ({"NODE_RANK": "1"}, "NODE_RANK=1 is not a whole number from 0 to 0"),
    ({"NODE_RANK": "+0"}, "NODE_RANK=+0"),
    ({"MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a whole number from 1 to 65535"),
    ({"MASTER_PORT": "0", "NNODES": "2", "NODE_RANK": "1"}, "MASTER_PORT=0"),  # checked on every node now
], ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else None)
def test_launcher_counts_out_of_range_are_one_line(env, needle, tmp_path):
    _one_error(_launch(tmp_path, COSMOS, **env), needle)
    assert _written(tmp_path) == set()


def _echo_python(tmp_path: Path, module: str) -> Path:
    """A ``PYTHON`` that prints ``<module> ARGS`` instead of running ``-m <module>`` (so a launcher's good values are
    seen reaching it, without the seconds the real command takes), and runs this interpreter otherwise."""
    exe = tmp_path / "echo-python"
    exe.write_text(f"""#!/usr/bin/env bash
if [[ "$1 $2" == "-m {module}" ]]; then shift 2; echo "{module} $*"; exit 0; fi
exec "{sys.executable}" "$@"
""")
    exe.chmod(0o755)
    return exe


@pytest.mark.parametrize("env,world", [({"NPROC_PER_NODE": "08"}, 8), ({"NPROC_PER_NODE": "1024", "NNODES": "1024"},
                                       1024 * 1024), ({"NNODES": "2", "NODE_RANK": "1"}, 2)],
                         ids=["leading-zero", "the-bounds", "last-node"])
def test_launcher_counts_in_range_pass(env, world, tmp_path):
    """Planted: the neighbouring good values reach the ledger of a dry run (nothing trains). Before, ``08`` was a
    bash octal error and 2**32 x 2**32 wrapped to world size 0."""
    r = _launch(tmp_path, COSMOS, **env, DRYRUN="1", PYTHON=str(_echo_python(tmp_path, "patches.ledger")))
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    assert r.stdout.strip().endswith(f"--world-size {world}"), r.stdout
    assert _written(tmp_path) == {"echo-python"}


def test_launcher_reads_boolean_flags_with_spaces_as_flags_py_does(tmp_path):
    """``DRYRUN=" 1"`` is the dry run, as ``COSMOS_EMA_CPU_SUBSET=" 1"`` is on in patches/core/flags.py (before, the
    launcher refused the one and the trainer took the other)."""
    assert flagmod.EMA_CPU_SUBSET.value({"COSMOS_EMA_CPU_SUBSET": " 1"}) is True
    r = _launch(tmp_path, COSMOS, DRYRUN=" 1 ", MEMTEST="\t1", PYTHON=str(_echo_python(tmp_path, "patches.ledger")))
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    assert "vision_sft_edge_24gb_memtest.toml" in r.stdout  # MEMTEST="\t1" chose the memtest recipe
    # planted: a word that is no boolean, spaces or not, is still one line, in both readers
    _one_error(_launch(tmp_path, COSMOS, DRYRUN=" maybe"), "DRYRUN=' maybe' is not a boolean")
    with pytest.raises(flagmod.FlagError):
        flagmod.EMA_CPU_SUBSET.value({"COSMOS_EMA_CPU_SUBSET": " maybe"})
    assert _written(tmp_path) == {"echo-python"}


def _fake_checkout(root: Path, with_train: bool = True) -> Path:
    (root / "cosmos_framework" / "scripts").mkdir(parents=True)
    (root / "cosmos_framework" / "__init__.py").write_text("")
    (root / "cosmos_framework" / "scripts" / "__init__.py").write_text("")
    if with_train:
        (root / "cosmos_framework" / "scripts" / "train.py").write_text("raise SystemExit('never run here')\n")
    return root


def test_launcher_refuses_a_root_without_the_trainer_it_runs(tmp_path):
    """A folder with ``cosmos_framework/`` but no ``cosmos_framework/scripts/train.py`` (what torchrun would run) was
    taken and failed inside torchrun, after the TOML copy was written; now one line first."""
    root = _fake_checkout(tmp_path / "checkout", with_train=False)
    _one_error(_launch(tmp_path, COSMOS, COSMOS_FRAMEWORK_ROOT=str(root)), "COSMOS_FRAMEWORK_ROOT=",
               "cosmos_framework/scripts/train.py")
    assert not (tmp_path / "out").exists()


def _fake_python(tmp_path: Path, torchrun: str) -> Path:
    """A ``PYTHON`` that runs this interpreter, except for ``-m torch.distributed.run``: that runs ``torchrun`` (bash)
    after noting whether the ``--sft-toml`` file exists."""
    exe = tmp_path / "fake-python"
    exe.write_text(f"""#!/usr/bin/env bash
if [[ "$1 $2" == "-m torch.distributed.run" ]]; then
  for a in "$@"; do [[ "$a" == --sft-toml=* ]] && toml="${{a#--sft-toml=}}"; done
  [[ -f "$toml" ]] && echo "copy: $toml" >> "{tmp_path}/record"
  {torchrun}
fi
exec "{sys.executable}" "$@"
""")
    exe.chmod(0o755)
    return exe


def _leftovers(tmp_path: Path) -> list[Path]:
    staged = [p for p in _tmpdir(tmp_path).iterdir() if p.name.startswith("tmp.")]
    return [p for p in tmp_path.rglob("*.toml*") if p.name.startswith(".onecard-")] + staged


@pytest.mark.parametrize("how,code", [("exit 0", 0), ("exit 3", 3)], ids=["success", "failure"])
def test_launcher_keeps_one_toml_copy_per_recipe(how, code, tmp_path):
    """The upstream TOML copy is named by its content's hash: reruns of one recipe leave the one file (nothing piles
    up, as ``mktemp`` copies did), another recipe gets its own, and the staging folder is gone either way."""
    root = _fake_checkout(tmp_path / "checkout")
    for _ in range(2):
        r = _launch(tmp_path, COSMOS, COSMOS_FRAMEWORK_ROOT=str(root), PYTHON=str(_fake_python(tmp_path, how)),
                    OUTPUT_ROOT="out")  # relative: the copy's path must still hold from the checkout's folder
        assert r.returncode == code, r.stdout + r.stderr
    record = (tmp_path / "record").read_text()
    assert f"copy: {tmp_path / 'out'}/.onecard-vision_sft_edge_24gb-" in record  # it existed while torchrun ran
    (left,) = _leftovers(tmp_path)
    assert left.parent == tmp_path / "out" and "[onecard]" not in left.read_text()
    other = tmp_path / "vision_sft_edge_24gb.toml"
    other.write_text(TOML.read_text().replace("save_iter            = 100", "save_iter            = 50"))
    assert "save_iter            = 50" in other.read_text()
    _launch(tmp_path, COSMOS, COSMOS_FRAMEWORK_ROOT=str(root), PYTHON=str(_fake_python(tmp_path, how)),
            OUTPUT_ROOT="out", TOML_FILE=str(other))
    assert len(_leftovers(tmp_path)) == 2  # planted: a changed recipe must not reuse the first copy's name


def test_launcher_execs_torchrun_so_a_term_to_it_stops_the_run(tmp_path):
    """``timeout`` and ``kill PID`` signal the launcher's process only: with ``exec`` that process IS torchrun, so
    the run stops at once (a launcher waiting on a child would leave torchrun training on)."""
    root = _fake_checkout(tmp_path / "checkout")
    env = _env(tmp_path, COSMOS_FRAMEWORK_ROOT=str(root), DATASET_PATH=str(tmp_path / "missing"),
               TMPDIR=str(_tmpdir(tmp_path)),
               PYTHON=str(_fake_python(tmp_path, f"touch {tmp_path}/started; exec sleep 30")))
    p = subprocess.Popen(["bash", str(COSMOS)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "started").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)  # the launcher's pid alone, as `timeout` does
        p.wait(timeout=10)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == -signal.SIGTERM
    assert [q.name for q in _leftovers(tmp_path)] == [f".onecard-vision_sft_edge_24gb-{_digest(tmp_path)}.toml"]


def _digest(tmp_path: Path) -> str:
    (copy,) = [p for p in tmp_path.rglob(".onecard-*.toml")]
    import hashlib

    return hashlib.sha256(copy.read_bytes()).hexdigest()[:12]


def test_launcher_bad_recipe_with_a_root_writes_nothing(tmp_path):
    """Before: ``OUTPUT_ROOT`` was created and the copy's temporary made before the recipe was checked."""
    root = _fake_checkout(tmp_path / "checkout")
    bad = tmp_path / "bad.toml"
    bad.write_text(TOML.read_text() + "\n[surprise]\nx = 1\n")
    _one_error(_launch(tmp_path, COSMOS, COSMOS_FRAMEWORK_ROOT=str(root), TOML_FILE=str(bad)), "unknown table")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []
    # a bad flag with a root is refused by `patches check` first, before anything is staged
    _one_error(_launch(tmp_path, COSMOS, COSMOS_FRAMEWORK_ROOT=str(root), COSMOS_VAE_CPU_OFFLOAD="maybe"),
               "COSMOS_VAE_CPU_OFFLOAD='maybe'")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


# ------------------------------------------------------------------ 2b. the H3 launcher


@pytest.mark.parametrize("value", ["0", "1025", "99999999999999999999", " 8", "8.0"])
def test_h3_launcher_from_gpus_out_of_range_is_one_line(value, tmp_path):
    _one_error(_launch(tmp_path, H3, FROM_GPUS=value), "FROM_GPUS=", "from 1 to 1024")
    assert _written(tmp_path) == set()


def test_h3_launcher_from_gpus_in_range_passes_on(tmp_path):
    """Planted: ``FROM_GPUS=08`` gets past the launcher, to the trainer as ``--from-gpus 8``."""
    r = _launch(tmp_path, H3, FROM_GPUS="08", PYTHON=str(_echo_python(tmp_path, "miles_ext.recipe.train")))
    assert r.returncode == 0 and "miles_ext.recipe.train --from-gpus 8 " in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------ 3. patches.run


@pytest.mark.parametrize("argv,needle", [
    ([], "give the MODULE to run"),
    (["-x"], "'-x' is not a module"),
    (["no_such_module_xyz"], "no module named no_such_module_xyz"),
    (["no_such_pkg.train"], "no module named no_such_pkg.train"),
    (["patches.no_such_module"], "no module named patches.no_such_module"),
    (["foo bar"], "'foo bar' is not a module name"),
    ([""], "'' is not a module name"),
    (["patches.core"], "patches.core is a package with no __main__ module"),
], ids=["none", "a-flag", "missing", "missing-parent", "missing-child", "spaces", "empty", "package"])
def test_patches_run_bad_arguments_are_one_line(argv, needle, tmp_path):
    """Before: a usage line with no ``error:``, or the rank's line and a runpy ``ImportError`` traceback (exit 1)."""
    from patches import run

    r = _in_process(run.main, argv, tmp_path)
    _one_error(r, "python -m patches.run", needle)
    assert "onecard[rank" not in r.stderr and _written(tmp_path) == set()


def test_patches_run_finds_what_exists(tmp_path):
    """Planted: a real module runs (its own arguments and status), and ``--help`` is the usage, status 0."""
    r = _run([sys.executable, "-m", "patches.run", "json.tool", "--help"], tmp_path)
    assert r.returncode == 0 and "usage: python -m json.tool" in r.stdout and "onecard[rank 0]" in r.stderr
    h = _run([sys.executable, "-m", "patches.run", "--help"], tmp_path)
    assert h.returncode == 0 and h.stdout.startswith("usage: python -m patches.run MODULE") and h.stderr == ""


def test_patches_run_shows_what_the_levers_log(tmp_path):
    """A lever's INFO line (logger ``onecard.*``) reaches stderr under ``patches.run``; planted: run plainly, Python's
    last-resort handler drops it (what upstream runs showed before)."""
    (tmp_path / "lever_says.py").write_text(
        "import logging\nlogging.getLogger('onecard.upstream').info('onecard: 3.62 GiB saved')\n")
    r = _run([sys.executable, "-m", "patches.run", "lever_says"], tmp_path, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    assert r.returncode == 0 and "onecard: 3.62 GiB saved [rank 0]" in r.stderr, r.stderr
    plain = _run([sys.executable, "-m", "lever_says"], tmp_path, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    assert plain.returncode == 0 and "3.62 GiB saved" not in plain.stderr


def test_patches_run_module_check_is_what_refuses(tmp_path, monkeypatch, capsys):
    """Planted: with the module check off, a missing module is runpy's ImportError (a traceback), not one line."""
    from patches import run

    monkeypatch.setattr(run, "_module_problem", lambda name: None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # run.main sets sys.argv before runpy raises
    with pytest.raises(ImportError):
        run.main(["no_such_module_xyz"])


def test_patches_status_bad_command_is_one_line(tmp_path):
    from patches.__main__ import main

    _one_error(_in_process(main, ["stauts"], tmp_path), "invalid choice: 'stauts'")
    _one_error(_in_process(main, ["status", "extra"], tmp_path), "unrecognized arguments: extra")
