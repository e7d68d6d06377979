"""Inductor's C++ wrapper (``[onecard] compile_wrapper = "cpp"``) trains what its Python wrapper trains: bitwise on the
CPU, within a stated fp32 tolerance on the GPU.

:func:`cosmos_framework_ext.levers.compile_blocks.compile_blocks` with ``wrapper="cpp"`` compiles each decoder
layer with ``options={"cpp_wrapper": True}``: the code that allocates buffers and launches the kernels is C++
instead of Python; the kernels are the same.

- **Exact, CPU** (tiny preset, fp32, activation checkpointing on as in the trainer, dense attention, inductor):
  packed micro-batches of three lengths, forward and backward: every loss and gradient of the C++-wrapped layers
  ``torch.equal`` those of the Python-wrapped ones (the anchor: inductor's default, itself checked against the
  eager model in ``test_compile_blocks.py``); the C++ wrapper was really built (a C++ source with its entry point
  in the test's own inductor cache), the Python one not.
- **GPU** (the recipe's flex attention): the same comparison on a CUDA device, to a stated fp32 tolerance: the
  losses equal, every gradient within ``GPU_RTOL`` (relative to its largest value). On the GPU the compiled layers,
  compiled twice with nothing changed, are not bitwise repeatable (inductor times some kernel settings when it first
  loads a kernel; measured 4.3e-7 to 4.8e-7 of the same tiny model's gradients), so the test compiles the Python
  wrapper twice, each run in a fresh inductor cache (a compile anew, not one loaded from the other's cache), prints
  that run-to-run difference beside the wrapper's, and checks that the C++ wrapper was built there too.

Planted: the option not passed on (the Python wrapper built while the C++ one was asked for) fails the "was
built" check; a C++ wrapper whose kernels changed with it (inductor's CPU kernels not vectorised,
``cpp.simdlen = 1``) breaks the equality.
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch

from cosmos_framework_ext.levers.compile_blocks import WRAPPERS, compile_blocks
from cosmos_framework_ext.recipe.config import OnecardConfig
from tests.equivalence import tiny_recipe as R
from tests.equivalence.test_compile_blocks import _step

LENGTHS = (3, 5, 4)
"""Samples per micro-batch: three packed lengths (the second is where dynamic shapes take over)."""

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")


def _run(compile_fn, impl: str = "dense", device: str = "cpu") -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    torch._dynamo.reset()
    model, _ = R.make_model(device=device)
    model.enable_gradient_checkpointing()
    compile_fn(model)
    return [_step(model, impl, n) for n in LENGTHS]


def _same(a, b) -> bool:
    """Bitwise the same runs: every loss and gradient equal (:func:`_worst` with no difference at all)."""
    return _worst(a, b) == 0.0


def _cpp_entries(cache: Path) -> int:
    """C++ wrapper sources inductor wrote into ``cache``: the ``*.cpp`` files that define its wrapper's entry
    point, ``inductor_entry_impl`` (the Python wrapper has none; CPU kernels are ``.cpp`` files either way)."""
    return sum(1 for f in cache.rglob("*.cpp") if "inductor_entry_impl" in f.read_text(errors="replace"))


@pytest.fixture()
def own_cache(tmp_path, monkeypatch) -> Path:
    """A fresh inductor cache for this test only (no entry of another test or run is reused)."""
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    return cache


def test_cpp_wrapper_trains_the_same_cpu(own_cache):
    python = _run(lambda m: compile_blocks(m, backend="inductor", wrapper="python"))
    assert _cpp_entries(own_cache) == 0
    cpp = _run(lambda m: compile_blocks(m, backend="inductor", wrapper="cpp"))
    assert _cpp_entries(own_cache) > 0  # the C++ wrapper was built and ran
    assert _same(python, cpp)


def test_planted_the_option_not_passed_on_is_caught(own_cache):
    _run(lambda m: m.compile_repeated_blocks(dynamic=True, backend="inductor"))  # the bug: "cpp" asked, default built
    assert _cpp_entries(own_cache) == 0  # what the test above asserts to be > 0


def test_planted_kernels_changed_with_the_wrapper_break_the_equality(own_cache):
    python = _run(lambda m: compile_blocks(m, backend="inductor", wrapper="python"))
    changed = _run(lambda m: m.compile_repeated_blocks(dynamic=True, backend="inductor",
                                                       options={"cpp_wrapper": True, "cpp.simdlen": 1}))
    assert not _same(python, changed)


@pytest.mark.parametrize("wrapper, backend", [("fortran", "inductor"), ("cpp", "eager"), ("cpp", "aot_eager")])
def test_a_wrapper_that_cannot_be_built_is_refused(wrapper, backend):
    model, _ = R.make_model()
    with pytest.raises(ValueError, match="wrapper"):
        compile_blocks(model, backend=backend, wrapper=wrapper)


def test_the_config_key_takes_the_wrappers_compile_blocks_builds():
    """``[onecard] compile_wrapper``'s values (the config's ``Literal``) are :data:`WRAPPERS`, no more, no fewer."""
    hints = typing.get_type_hints(OnecardConfig)
    assert typing.get_args(hints["compile_wrapper"]) == WRAPPERS == ("python", "cpp")


GPU_RTOL = 1e-5
"""The GPU comparison's tolerance: each gradient's largest difference over its largest value (fp32; about 20x the
compiled layers' measured run-to-run difference, 4.3e-7 to 4.8e-7)."""


def _worst(a, b) -> float:
    """Largest relative difference of the gradients of two runs (each relative to the gradient's largest value);
    ``inf`` when the runs hold different numbers of micro-batches, a loss differs, the gradient lists or shapes do
    not pair up, or a value is not finite (a NaN must not compare as no difference)."""
    if len(a) != len(b) or not a:
        return float("inf")
    worst = 0.0
    for (la, ga), (lb, gb) in zip(a, b):
        if not torch.equal(la, lb) or len(ga) != len(gb) or not ga:
            return float("inf")
        for x, y in zip(ga, gb):
            if x.shape != y.shape or not (torch.isfinite(x).all() and torch.isfinite(y).all()):
                return float("inf")
            worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)))
    return worst


def test_the_gpu_comparison_can_fail():
    """The tolerance check rejects what it must: another loss, or a gradient off by more than ``GPU_RTOL``."""
    g = [torch.ones(3)]
    assert _worst([(torch.tensor(1.0), g)], [(torch.tensor(1.0), [torch.ones(3)])]) == 0.0
    assert _worst([(torch.tensor(1.0), g)], [(torch.tensor(1.0 + 1e-6), g)]) == float("inf")
    assert _worst([(torch.tensor(1.0), [torch.ones(3) * (1 + 3 * GPU_RTOL)])], [(torch.tensor(1.0), g)]) > GPU_RTOL
    one = (torch.tensor(1.0), g)
    assert _worst([(torch.tensor(1.0), [torch.tensor([1.0, float("nan"), 1.0])])], [one]) == float("inf")
    assert _worst([(torch.tensor(1.0), [torch.ones(1)])], [one]) == float("inf")  # not broadcast
    assert _worst([one, one], [one]) == float("inf") and _worst([], []) == float("inf")


@cuda
def test_cuda_cpp_wrapper_trains_the_same(tmp_path, monkeypatch):
    def fresh(name: str) -> Path:  # each run compiles anew: nothing is loaded from another run's cache
        cache = tmp_path / name
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
        return cache

    runs = {}
    for name, wrapper in (("python", "python"), ("again", "python"), ("cpp", "cpp")):
        cache = fresh(name)
        runs[name] = _run(lambda m: compile_blocks(m, backend="inductor", wrapper=wrapper), impl="flex", device="cuda")
        assert (_cpp_entries(cache) > 0) == (wrapper == "cpp")  # the C++ wrapper built where asked, and only there
    run_to_run, wrapper = _worst(runs["python"], runs["again"]), _worst(runs["python"], runs["cpp"])
    print(f"GPU: Python wrapper run to run {run_to_run:.3g}, C++ against Python {wrapper:.3g} (tolerance {GPU_RTOL})")
    assert run_to_run <= GPU_RTOL and wrapper <= GPU_RTOL
