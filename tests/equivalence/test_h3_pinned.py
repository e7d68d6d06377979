"""Exact pinned memory for FSDP2's CPU offload (``miles_ext.levers.pinned``, ``apply_fsdp2(exact_pin=True)``).

On the CPU (3 gloo ranks, so shards are uneven and padded; tiny H3 + LoRA, fp32) the bookkeeping:

- every offloaded shard's storage is a view into the one arena; the views do not overlap; each parameter's
  local tensor shares the shard's storage (what FSDP2 all-gathers is what the parameter holds);
- the report's requested bytes are the sum of the shards' bytes, the arena is within 63 B per shard of it;
- the parameters hold the same values as with FSDP2's own host storage (full tensors compared bitwise), and no
  offloaded shard keeps ``pin_memory`` (FSDP2 would re-pin it through the caching allocator);
- the <= 5 % check (:func:`miles_ext.levers.pinned.locked_within`) accepts the arena and rejects the caching host
  allocator's power-of-two rounding of the same shards -- on the full 33 B preset's shard sizes too (meta
  device, nothing allocated): the planted bug.

On a GPU (``test_cuda_*``, for the device machine): the bytes measured as locked
(:func:`miles_ext.levers.pinned.locked_bytes`) grow by the requested bytes within 5 %.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_ext.levers.pinned import locked_within, power_of_two_bytes
from tests.equivalence.h3_ranks import cpu_mesh, launch


def _build(exact: bool, mesh=None):
    from miles_ext.levers.fsdp_policy import apply_fsdp2
    from tests.equivalence.h3_tiny_run import make_lora_model

    model = make_lora_model()
    apply_fsdp2(model, cpu_offload=True, param_dtype=None, mesh=mesh, exact_pin=exact)
    return model


def _worker(rank: int, world: int, out_dir: str) -> None:
    from miles_ext.levers.pinned import ARENA_ATTR, offloaded_fsdp_params, pinned_report

    plain, exact = _build(False, cpu_mesh()), _build(True, cpu_mesh())
    fps = offloaded_fsdp_params(exact)
    arena = getattr(exact, ARENA_ATTR)
    lo = arena._buf.data_ptr()
    spans = []
    for fp in fps:
        d = fp._sharded_param_data
        spans.append((d.data_ptr(), d.data_ptr() + d.numel() * d.element_size()))
        assert d.untyped_storage().data_ptr() == arena._buf.untyped_storage().data_ptr(), fp._param_fqn
        local = fp.sharded_param._local_tensor
        assert local.numel() == 0 or local.data_ptr() == d.data_ptr(), fp._param_fqn
        assert not fp.pin_memory
    spans.sort()
    result = {
        "inside": all(lo <= a and b <= lo + arena.nbytes for a, b in spans),
        "disjoint": all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:])),
        "report": pinned_report(exact).as_dict(),
        "shard_bytes": [fp._sharded_param_data.numel() * fp._sharded_param_data.element_size() for fp in fps],
        "padded": sum(fp._sharded_param_data.numel() != fp.sharded_param._local_tensor.numel() for fp in fps),
        "equal": all(torch.equal(p.full_tensor(), q.full_tensor())
                     for p, q in zip(plain.parameters(), exact.parameters())),
    }
    if rank == world - 1:
        torch.save(result, Path(out_dir) / "pinned.pt")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("pinned")
    launch(_worker, 3, str(out))
    return torch.load(out / "pinned.pt")


def test_shards_are_disjoint_views_of_one_arena(result):
    assert result["inside"] and result["disjoint"]
    assert result["padded"] > 0  # uneven shards on the last rank: padding is carried as FSDP2 stores it


def test_report_counts_requested_and_arena_bytes(result):
    r = result["report"]
    assert r["requested_bytes"] == sum(result["shard_bytes"]) and r["shards"] == len(result["shard_bytes"])
    assert r["requested_bytes"] <= r["arena_bytes"] < r["requested_bytes"] + 64 * r["shards"]
    assert r["pinned_bytes"] == 0  # no CUDA here: ordinary memory, nothing locked


def test_values_equal_fsdp2_own_storage(result):
    assert result["equal"]


def test_five_percent_check_accepts_arena_rejects_power_of_two_rounding(result):

    r = result["report"]
    assert locked_within(r["requested_bytes"], r["arena_bytes"])
    # planted bug: the caching host allocator's blocks for the same shards
    assert not locked_within(r["requested_bytes"], power_of_two_bytes(result["shard_bytes"]))


def test_full_preset_shards_rounding_is_far_above_five_percent():
    """The 33 B preset's per-parameter shards (one rank, bf16 master, meta device): the power-of-two blocks the
    caching allocator would lock versus the bytes asked."""
    from miles_ext.levers.fsdp_policy import keep_in_fp32_names
    from miles_ext.recipe.presets import build_transformer

    model = build_transformer("full", device="meta")
    keep = keep_in_fp32_names(model)
    sizes = [p.numel() * (4 if n in keep else 2) for n, p in model.named_parameters()]
    asked, rounded = sum(sizes), power_of_two_bytes(sizes)
    assert 65e9 < asked < 68e9
    assert rounded > 1.2 * asked and not locked_within(asked, rounded)



def test_locked_within_bounds_by_hand():
    """``locked_within(requested, locked, tol)``: ``requested <= locked <= (1 + tol) * requested`` (both bounds
    included); with nothing requested, only nothing locked passes. Cases at and around each bound, with tolerances
    whose products are exact in binary (1.25 x 4 = 5, 1.5 x 100 = 150)."""
    assert locked_within(4, 4, 0.25) and locked_within(4, 5, 0.25)  # both bounds included
    assert not locked_within(4, 3, 0.25)  # less locked than asked: not served pinned
    assert not locked_within(4, 6, 0.25)
    assert locked_within(100, 150, 0.5) and not locked_within(100, 151, 0.5) and not locked_within(100, 99, 0.5)
    assert locked_within(0, 0) and not locked_within(0, 1) and not locked_within(0, 4096)
    assert locked_within(1000, 1050) and not locked_within(1000, 1051)  # the default 5 %


def test_power_of_two_bytes_by_hand():
    """What the caching host allocator locks: each size rounded up to the next power of two (a power of two stays
    itself, 1 B is 1 B, 0 B is nothing). Sum by hand: 0 + 1 + 2 + 4 + 4 + 8 + 64 + 128 = 211."""
    assert power_of_two_bytes([0, 1, 2, 3, 4, 5, 64, 65]) == 211
    assert power_of_two_bytes([1]) == 1 and power_of_two_bytes([4096]) == 4096
    assert power_of_two_bytes([4097]) == 8192 and power_of_two_bytes([]) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_cuda_locked_bytes_within_five_percent_of_requested():
    from miles_ext.levers.pinned import locked_bytes, pinned_report
    from patches.core.runtime import free_port

    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    before = locked_bytes()["total"]
    model = _build(True)
    rep = pinned_report(model)
    after = locked_bytes()["total"]
    assert rep.pinned_bytes == rep.arena_bytes > 0
    assert locked_within(rep.requested_bytes, after - before), (rep, before, after)
