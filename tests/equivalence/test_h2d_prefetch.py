"""Side-stream host-to-device prefetch (``miles_ext.levers.h2d_prefetch``) changes no value.

Claim: with the lever on (``apply_fsdp2``'s default under ``cpu_offload``), the LoRA gradients of step 1 and the
LoRA weights after 2 optimizer steps are **bitwise** equal to FSDP2's own synchronous copy (``h2d_prefetch=False``),
under full offload (adapters offloaded too and stepped by the host AdamW between steps) and under partial residency.
The tiny H3 preset with LoRA, fp32, the recipe's schedule (``tests.equivalence.test_h3_residency.run_mode``), one
rank; CUDA only (the lever does nothing on a CPU mesh, checked below).

Planted bugs: a prefetch that copies each unit's shards once and then reuses that staged copy (a stale buffer
across an optimizer step) must break the weight check: the offloaded adapters change on the host at every step. A
missing stream wait (the compute stream does not wait for the side stream's copy) must break the gradient check: the
side stream is first held back (``torch.cuda._sleep``, about 10 ms per copy) so that the copy lands after the unit's
kernels read the buffer; the same slow copy with the wait stays bitwise (the control).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.equivalence.h3_ranks import cpu_mesh, launch
from tests.equivalence.test_h3_residency import MODES, _equal, run_mode

CASES = {"offload": MODES["offload_exact"], "partial": MODES["partial1"]}


# ------------------------------------------------------------------------------- CPU: the lever stays out of the way
def _cpu_worker(rank: int, world: int, out_dir: str) -> None:
    from miles_ext.levers.fsdp_policy import apply_fsdp2
    from miles_ext.levers.h2d_prefetch import H2DPrefetch, attached, eligible
    from tests.equivalence.h3_tiny_run import make_lora_model

    model = make_lora_model()
    apply_fsdp2(model, cpu_offload=True, param_dtype=None, mesh=cpu_mesh(), exact_pin=True, h2d_prefetch=True)
    block = next(m for m in model.modules() if type(m).__name__.endswith("MiniMaxH3TransformerBlock"))
    try:
        H2DPrefetch(block, stream=None)  # type: ignore[arg-type]
        error = ""
    except ValueError as e:
        error = str(e)
    defaults = {}  # h2d_prefetch=None: the lever is asked for with partial residency only
    for name, kw in (("offload", {}), ("partial", dict(resident=[1], adapters_on_device=True))):
        m = make_lora_model()
        apply_fsdp2(m, cpu_offload=True, param_dtype=None, mesh=cpu_mesh(), exact_pin=True, **kw)
        defaults[name] = hasattr(m, "_onecard_h2d_prefetch")
    # under full offload each block's offloaded adapter unit is prefetched just before the block, by the block before
    from miles_ext.levers.fsdp_policy import _adapter_linears

    wrap = set(model._no_split_modules)
    blocks = [m for m in model.modules() if type(m).__name__.removeprefix("FSDP") in wrap]
    order = {}
    for late in (False, True):
        m = make_lora_model()
        apply_fsdp2(m, cpu_offload=True, param_dtype=None, mesh=cpu_mesh(), exact_pin=True, h2d_prefetch=True,
                    prefetch_adapters=not late)
        bs = [x for x in m.modules() if type(x).__name__.removeprefix("FSDP") in wrap]
        names = {id(b._get_fsdp_state()): f"block{i}" for i, b in enumerate(bs)}
        names.update({id(a[0]._get_fsdp_state()): f"adapters{i}" for i, b in enumerate(bs)
                      if (a := _adapter_linears(b))})
        order[late] = [[names[id(st)] for st in b._get_fsdp_state()._states_to_forward_prefetch] for b in bs[:2]]
    torch.save({"report": model._onecard_h2d_prefetch, "attached": len(attached(model)), "blocks": len(blocks),
                "eligible": eligible(block), "error": error, "defaults": defaults, "order": order},
               Path(out_dir) / "cpu.pt")


def test_cpu_mesh_attaches_nothing_and_says_why(tmp_path):
    launch(_cpu_worker, 1, str(tmp_path))
    r = torch.load(tmp_path / "cpu.pt")
    assert r["report"]["units"] == 0 and r["attached"] == 0
    assert r["eligible"] == (False, "computes on cpu, not CUDA")
    assert "cannot prefetch host-to-device: computes on cpu" in r["error"]
    assert sum(r["report"]["skipped"].values()) > 0
    # by default only partial residency asks for it (measured slower under full offload on the H200)
    assert r["defaults"] == {"offload": False, "partial": True}
    # each block gathers the next block's adapter unit just before the block itself (False); the earlier order (True)
    # left the adapters to the block's own start
    assert r["order"][False][0][-2:] == ["adapters1", "block1"], r["order"]
    assert r["order"][True][0][-1:] == ["block1"] and "adapters1" not in r["order"][True][0], r["order"]


# ------------------------------------------------------------------------------- on the GPU (device machine)
def _stale_stage(self, result) -> None:
    """Planted bug: the first staged copy of a unit is reused for every later unshard."""
    from miles_ext.levers.h2d_prefetch import H2DPrefetch

    first = getattr(self, "_first", None)
    if first is None:
        H2DPrefetch._real_stage(self, result)
        self._first = self._pending[1:]
    else:
        self._pending = (result, *first)


def _slow_stage(self, result) -> None:
    """The side stream held back about 10 ms (2e7 GPU cycles) before each copy: a copy that lands late."""
    with torch.cuda.stream(self.stream):
        torch.cuda._sleep(20_000_000)
    type(self)._real_stage(self, result)


def _cuda_worker(rank: int, world: int, out_dir: str) -> None:
    from miles_ext.levers import h2d_prefetch
    from miles_ext.levers.h2d_prefetch import H2DPrefetch

    torch.cuda.set_device(0)
    torch.use_deterministic_algorithms(True)
    counts: dict[str, int] = {}
    real_attach = h2d_prefetch.attach

    def counting_attach(model, stream=None):
        rep = real_attach(model, stream)
        counts["units"] = counts.get("units", 0) + rep["units"]
        return rep

    h2d_prefetch.attach = counting_attach
    res = {}
    for name, kw in CASES.items():
        res[f"{name}_sync"] = run_mode(None, device="cuda", h2d_prefetch=False, **kw)
        res[f"{name}_prefetch"] = run_mode(None, device="cuda", h2d_prefetch=True, **kw)
    H2DPrefetch._real_stage = H2DPrefetch._stage
    H2DPrefetch._stage = _stale_stage
    res["bug_stale"] = run_mode(None, device="cuda", h2d_prefetch=True, **CASES["offload"])
    H2DPrefetch._stage = _slow_stage
    res["slow_copy"] = run_mode(None, device="cuda", h2d_prefetch=True, **CASES["offload"])
    H2DPrefetch._stage = H2DPrefetch._real_stage
    res["units"] = {"": torch.tensor([counts.get("units", 0)])}
    torch.save(res, Path(out_dir) / "cuda.pt")


def _cuda_no_wait_worker(rank: int, world: int, out_dir: str) -> None:
    """Planted: the compute stream does not wait for the (late) copy. Run alone: its kernels read buffers the side
    stream fills afterwards, and the late copy may land in memory the allocator has handed on (on the H200 it
    overwrote index tensors: a device-side assert that ends the process)."""
    from miles_ext.levers.h2d_prefetch import H2DPrefetch

    torch.cuda.set_device(0)
    torch.use_deterministic_algorithms(True)
    H2DPrefetch._real_stage = H2DPrefetch._stage
    H2DPrefetch._stage = _slow_stage
    H2DPrefetch._wait_copy = lambda self, done: None
    torch.save({"bug_no_wait": run_mode(None, device="cuda", h2d_prefetch=True, **CASES["offload"])},
               Path(out_dir) / "cuda.pt")


@pytest.fixture(scope="module")
def cuda_results(tmp_path_factory):
    from tests.equivalence.h3_ranks import cuda_results as run

    return run(tmp_path_factory, _cuda_worker, "h2d")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_prefetch_bitwise_equal_to_fsdp2_sync_copy(cuda_results, case):
    sync, pre = cuda_results[f"{case}_sync"], cuda_results[f"{case}_prefetch"]
    assert int(cuda_results["units"][""]) > 0  # the lever was attached where it runs
    assert any(g.abs().sum() > 0 for g in sync["grads"].values())
    assert _equal(pre["grads"], sync["grads"]), f"{case}: step-1 LoRA gradients differ"
    assert _equal(pre["weights"], sync["weights"]), f"{case}: LoRA weights after 2 steps differ"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_cuda_planted_stale_staged_copy_is_caught(cuda_results):
    assert not _equal(cuda_results["bug_stale"]["weights"], cuda_results["offload_sync"]["weights"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_cuda_a_late_copy_with_the_stream_wait_is_still_bitwise(cuda_results):
    assert _equal(cuda_results["slow_copy"]["grads"], cuda_results["offload_sync"]["grads"])
    assert _equal(cuda_results["slow_copy"]["weights"], cuda_results["offload_sync"]["weights"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_cuda_planted_missing_stream_wait_is_caught(cuda_results, tmp_path):
    """Caught either way: the process fails (a late copy over memory handed on) or its gradients differ."""
    from tests.equivalence.h3_ranks import launch_cuda

    try:
        launch_cuda(_cuda_no_wait_worker, str(tmp_path))
    except AssertionError:
        return  # the CUDA worker failed
    bug = torch.load(tmp_path / "cuda.pt")["bug_no_wait"]
    assert not _equal(bug["grads"], cuda_results["offload_sync"]["grads"])
