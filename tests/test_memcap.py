"""benchmarks/upstream/memcap.py, the torchrun worker entry of upstream runs: its input checks on the CPU.

A bad ``ONECARD_MEMCAP_EVERY_S`` is one ``error:`` line and exit status 2 before anything runs; a good one (or
none) runs the module as ``python -m`` would. ``ONECARD_GPU_MEMORY_GIB`` without a GPU is refused the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MEMCAP = Path(__file__).resolve().parents[1] / "benchmarks" / "upstream" / "memcap.py"


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "hello_memcap.py").write_text("print('module ran')\n")
    e = {k: v for k, v in os.environ.items()
         if k not in ("ONECARD_MEMCAP_EVERY_S", "ONECARD_GPU_MEMORY_GIB", "ONECARD_MEMCAP_STEPS")}
    e.update(env, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(MEMCAP), "-m", "hello_memcap"], cwd=tmp_path, env=e,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan", "1e-300"])
def test_bad_interval_is_one_error_line(tmp_path, value):
    r = _run(tmp_path, ONECARD_MEMCAP_EVERY_S=value)
    assert r.returncode == 2 and "module ran" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "error: ONECARD_MEMCAP_EVERY_S" in lines[0] and "seconds >= 1" in lines[0], r.stderr


@pytest.mark.parametrize("env", [{}, {"ONECARD_MEMCAP_EVERY_S": "15"}])
def test_module_runs(tmp_path, env):
    r = _run(tmp_path, **env)
    assert r.returncode == 0 and "module ran" in r.stdout, r.stderr


def test_cap_without_a_gpu_is_refused(tmp_path):
    r = _run(tmp_path, ONECARD_GPU_MEMORY_GIB="22.06")
    assert r.returncode == 2 and "no CUDA device" in r.stderr and "module ran" not in r.stdout


def test_unknown_module_is_one_error_line(tmp_path):
    e = {k: v for k, v in os.environ.items() if k != "ONECARD_MEMCAP_EVERY_S"}
    r = subprocess.run([sys.executable, str(MEMCAP), "-m", "no_such_module_here"], cwd=tmp_path, env=e,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no module named" in r.stderr, r.stderr


def test_token_split_counts_upstreams_text_and_vision_tokens():
    """Per sample: ``len(text_token_ids) + 1`` and ``ceil(H/32) * ceil(W/32) * (1 + (T - 1) // 4) + 2`` per clip
    (the packing loader's own count), from the packed layout upstream hands ``training_step``."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("memcap_under_test", MEMCAP)
    memcap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memcap)
    data = {"text_token_ids": [[torch.zeros(5)], [torch.zeros(9)]],
            "video": [[torch.zeros(3, 9, 256, 320, dtype=torch.uint8)], [torch.zeros(3, 1, 200, 320)]]}
    assert memcap.token_split(data) == [(6, 8 * 10 * 3 + 2), (10, 7 * 10 * 1 + 2)]


def test_bad_steps_switch_is_one_error_line(tmp_path):
    r = _run(tmp_path, ONECARD_MEMCAP_STEPS="maybe")
    lines = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 2 and len(lines) == 1 and "ONECARD_MEMCAP_STEPS" in lines[0], r.stderr
    assert "module ran" not in r.stdout
