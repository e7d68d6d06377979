"""``patches.core.torchinfo``: the installed torch's GPU backends read from ``torch/version.py`` without importing
torch, anchored to what torch itself says; an unreadable layout is ``None`` (ask torch), never a guess."""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys

import pytest
import torch

from patches.core import torchinfo


def test_the_installed_build_matches_torch_version():
    want = {k for k in ("cuda", "hip", "xpu") if getattr(torch.version, k, None)}
    assert torchinfo.gpu_backends_built() == want
    assert torchinfo.cuda_available() == torch.cuda.is_available()


def _fake_torch(tmp_path, monkeypatch, text: str | None) -> None:
    pkg = tmp_path / "torch"
    pkg.mkdir()
    if text is not None:
        (pkg / "version.py").write_text(text)
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(pkg)]
    monkeypatch.setattr(torchinfo.importlib.util, "find_spec", lambda name: spec if name == "torch" else None)


@pytest.mark.parametrize("text,want", [
    ("from typing import Optional\ncuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n", {"cuda"}),
    ("cuda = None\nhip = '6.2'\n", {"hip"}),
    ("cuda = None\nhip = None\nxpu = None\n", set()),
    ("cuda = None\n", None),  # planted: no ``hip`` line, so the file says nothing about ROCm
    ("cuda = compute()\nhip = None\n", None),  # not a literal
    (None, None),  # no version.py
], ids=["cuda", "hip", "cpu", "no-hip-line", "not-literal", "missing"])
def test_version_file_layouts(tmp_path, monkeypatch, text, want):
    _fake_torch(tmp_path, monkeypatch, text)
    assert torchinfo.gpu_backends_built() == want


def test_a_gpu_build_asks_torch(tmp_path, monkeypatch):
    """With a CUDA build the answer is torch's own (here faked to True), not the file's."""
    _fake_torch(tmp_path, monkeypatch, "cuda = '12.8'\nhip = None\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert torchinfo.cuda_available() is True


def test_launcher_args_imports_no_torch_on_a_cpu_build():
    if torchinfo.gpu_backends_built():
        pytest.skip("this torch has a GPU backend: the helper asks torch")
    code = ("import sys, runpy; sys.argv = ['x', 'launcher-args']\n"
            "try:\n    runpy.run_module('miles_ext.levers.residency', run_name='__main__')\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "False", r.stdout + r.stderr
