"""Tests against a real cosmos-framework checkout: run when COSMOS_FRAMEWORK_ROOT points at one.

They need the upstream's own dependencies installed (``docs/upstream.md``); without the variable every test here is
skipped with that reason. A test marked ``optimizer_only`` needs only upstream's optimizer module (omegaconf, loguru,
numpy, nvidia-ml-py: it runs with a CPU torch, where the model modules need a torchvision that matches torch).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

ROOT = os.environ.get("COSMOS_FRAMEWORK_ROOT", "")
FULL = ("cosmos_framework.checkpoint.dcp", "cosmos_framework.model.generator.omni_mot_model")
OPTIMIZER = ("cosmos_framework.utils.generator.optimizer",)


def pytest_configure(config):
    config.addinivalue_line("markers", "optimizer_only: needs only upstream's optimizer module to import")


def _why_not(modules: tuple[str, ...]) -> str | None:
    if not ROOT:
        return "COSMOS_FRAMEWORK_ROOT is not set: no upstream cosmos-framework checkout to test against"
    if not os.path.isdir(os.path.join(ROOT, "cosmos_framework")):
        return f"COSMOS_FRAMEWORK_ROOT={ROOT} holds no cosmos_framework/ package"
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    try:
        for mod in modules:
            importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - any import failure means: cannot test here
        return f"cosmos-framework at {ROOT} does not import here ({type(e).__name__}: {e}); install its dependencies"
    return None


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    reasons: dict[tuple[str, ...], str | None] = {}
    for item in items:
        if not str(item.fspath).startswith(here):
            continue
        need = OPTIMIZER if item.get_closest_marker("optimizer_only") else FULL
        if need not in reasons:
            reasons[need] = _why_not(need)
        if reasons[need]:
            item.add_marker(pytest.mark.skip(reason=reasons[need]))
