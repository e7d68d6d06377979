"""Tests against a real cosmos-framework checkout: run when COSMOS_FRAMEWORK_ROOT points at one.

They need the upstream's own dependencies installed (see README, "Driving your cosmos-framework
checkout"); without the variable every test here is skipped with that reason.
"""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.environ.get("COSMOS_FRAMEWORK_ROOT", "")


def pytest_collection_modifyitems(config, items):
    reason = None
    if not ROOT:
        reason = "COSMOS_FRAMEWORK_ROOT is not set: no upstream cosmos-framework checkout to test against"
    elif not os.path.isdir(os.path.join(ROOT, "cosmos_framework")):
        reason = f"COSMOS_FRAMEWORK_ROOT={ROOT} holds no cosmos_framework/ package"
    else:
        if ROOT not in sys.path:
            sys.path.insert(0, ROOT)
        try:
            import importlib

            for mod in ("cosmos_framework.checkpoint.dcp", "cosmos_framework.model.generator.omni_mot_model"):
                importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - any import failure means: cannot test here
            reason = f"cosmos-framework at {ROOT} does not import here ({type(e).__name__}: {e}); install its dependencies"
    if reason:
        here = os.path.dirname(__file__)
        for item in items:
            if str(item.fspath).startswith(here):
                item.add_marker(pytest.mark.skip(reason=reason))
