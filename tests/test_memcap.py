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


FAKE_TRAINER = '''
import contextlib
import types

import torch


class Timer:
    def __init__(self):
        self.names = []

    def __call__(self, name):
        self.names.append(name)
        return contextlib.nullcontext()


class ImaginaireTrainer:
    """Upstream's training_step shape: forward and backward inside training_timer regions, the optimizer
    step on the last call of an accumulation window."""

    def __init__(self, accum):
        self.training_timer = Timer()
        self.config = types.SimpleNamespace(trainer=types.SimpleNamespace(grad_accum_iter=accum))

    def training_step(self, model_ddp, optimizer, scheduler, grad_scaler, data, iteration=0, grad_accum_iter=0):
        with self.training_timer("forward"):
            loss = model_ddp(torch.ones(2, 4)).sum()
        with self.training_timer("backward"):
            loss.backward()
        grad_accum_iter += 1
        if grad_accum_iter == self.config.trainer.grad_accum_iter:
            with self.training_timer("optimizer_step"):
                model_ddp.zero_grad()
            grad_accum_iter = 0
        return {}, loss, grad_accum_iter
'''

DRIVER = '''
import torch
from cosmos_framework.trainer import ImaginaireTrainer, Timer


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        # compiled blocks, as upstream's are (an OptimizedModule hands attributes set on it to the inner module)
        self.model.layers = torch.nn.ModuleList(torch.compile(torch.nn.Linear(4, 4), backend="eager")
                                                for _ in range(3))

    def forward(self, x):
        for layer in self.model.layers:
            x = layer(x)
        return x


trainer, acc = ImaginaireTrainer(2), 0
net = Net()
for i in range(6):
    _, _, acc = trainer.training_step(net, None, None, None, {}, i, acc)
    print("call", i + 1, flush=True)
assert type(trainer.training_timer) is Timer, "the profiler's stand-in timer was left in place"
assert trainer.training_timer.names.count("forward") == 6, trainer.training_timer.names
print("done")
'''


def _run_fake(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    pkg = tmp_path / "cosmos_framework" / "trainer"
    pkg.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cosmos_framework" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(FAKE_TRAINER)
    (tmp_path / "drive_memcap.py").write_text(DRIVER)
    e = {k: v for k, v in os.environ.items() if not k.startswith("ONECARD_") and k != "OUTPUT_ROOT"}
    e.update(env, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(MEMCAP), "-m", "drive_memcap"], cwd=tmp_path, env=e,
                          capture_output=True, text=True, timeout=300)


def test_profile_marks_upstreams_micro_batches_phases_and_layers(tmp_path):
    """Calls 3-5 of a window of 2: calls 3 and 5 are plain micro-batches, call 4 runs the optimizer step and is
    marked apart; every call still goes through upstream's own timer, which is put back afterwards."""
    import gzip
    import json

    out = tmp_path / "prof"
    r = _run_fake(tmp_path, ONECARD_MEMCAP_PROFILE="3:3", ONECARD_MEMCAP_PROFILE_DIR=str(out))
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    result = json.loads((out / "upstream-profile-rank0.json").read_text())
    assert result["micro_batches"] == 2
    assert len(result["layers"]["forward_s"]) == 3
    assert not (out / "upstream-profile-rank0-trace.json").exists()
    trace = json.loads(gzip.open(out / "upstream-profile-rank0-trace.json.gz").read())
    names = [e.get("name") for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]
    assert names.count("onecard.micro_batch") == 2 and names.count("onecard.optimizer_micro_batch") == 1
    assert names.count("onecard.forward") == 3 and names.count("onecard.backward") == 3
    assert names.count("onecard.layer.0") == 3 and "onecard.layer.3" not in names
    cpu = [e for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]
    fwd = [(e["ts"], e["ts"] + e["dur"]) for e in cpu if e["name"] == "onecard.forward"]
    layers = [e for e in cpu if e["name"].startswith("onecard.layer.")]
    assert layers and all(any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in fwd) for e in layers), \
        "a layer mark must close at its layer's end, inside its forward"
    assert "| phase |" in r.stderr


def test_stop_after_exits_zero_after_that_many_calls(tmp_path):
    r = _run_fake(tmp_path, ONECARD_MEMCAP_STOP_AFTER="4")
    assert r.returncode == 0, r.stderr
    assert "call 3" in r.stdout and "call 4" not in r.stdout and "done" not in r.stdout
    assert "stopping after 4 training_step calls" in r.stderr


@pytest.mark.parametrize("var,value", [("ONECARD_MEMCAP_PROFILE", "0"), ("ONECARD_MEMCAP_PROFILE", "3:0"),
                                       ("ONECARD_MEMCAP_PROFILE", "x"), ("ONECARD_MEMCAP_PROFILE", "3:-1"),
                                       ("ONECARD_MEMCAP_STOP_AFTER", "0"), ("ONECARD_MEMCAP_STOP_AFTER", "2.5")])
def test_bad_profile_or_stop_is_one_error_line(tmp_path, var, value):
    r = _run_fake(tmp_path, **{var: value})
    lines = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 2 and len(lines) == 1 and var in lines[0], r.stderr
    assert "call 1" not in r.stdout


def test_profile_spec_defaults_to_four_calls(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("memcap_spec_under_test", MEMCAP)
    memcap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memcap)
    monkeypatch.setenv("ONECARD_MEMCAP_PROFILE", "3")
    assert memcap._profile_spec("0") == (3, 4)
    monkeypatch.setenv("ONECARD_MEMCAP_PROFILE", "5:2")
    assert memcap._profile_spec("0") == (5, 2)
    monkeypatch.delenv("ONECARD_MEMCAP_PROFILE")
    assert memcap._profile_spec("0") is None
