"""Recomputed block inputs (``miles_ext.levers.input_recompute``) change no value and free the inputs they drop.

Claims, on the tiny H3 preset with 5 transformer blocks and LoRA (fp32 on the CPU; fp32 and bf16 on the GPU), the
recipe's schedule for 2 optimizer steps of global batch 4 (AdamW, clip 0.05), one rank:

- the LoRA gradients of step 1 and the LoRA weights after 2 steps are **bitwise** equal to diffusers' plain
  checkpoint (``k = 0``) with 1 and 2 inputs recomputed: without FSDP, under FSDP2 with every unit on the device, and
  under full CPU offload (exact arena), the independent reference being the plain checkpoint of the same model;
- after a forward the dropped blocks' inputs are freed and the kept ones are alive (weak references on the CPU; on
  the GPU the allocated bytes after a forward fall by the dropped inputs' bytes);
- each dropped input costs exactly one more forward of the block before it per micro-batch (``recomputed``).

Planted bugs, each failing its own check: a recipe that reruns the wrong block (the block two back) breaks the
gradients; a pack hook that keeps the input (no memory saved) breaks the freed-input check.
"""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path

import pytest
import torch

from tests.equivalence.h3_ranks import cpu_mesh, launch

GBS, STEPS, LAYERS = 4, 2, 5
FSDP = {"none": None, "resident": dict(cpu_offload=False), "offload": dict(cpu_offload=True, exact_pin=True)}


def _preset():
    from miles_ext.recipe.presets import TINY

    return dataclasses.replace(TINY, num_layers=LAYERS)


def _plant(bug: str):
    """Planted bugs (undone by the caller's ``finally``): returns the undo."""
    from miles_ext.levers import input_recompute as ir

    if bug == "wrong_block":
        real = ir.InputRecompute.__call__

        def call(self, block, *args):
            i = self._index.get(id(block))
            if self._last is not None and i is not None and i in self.dropped and i >= 2:
                j, _, a, out = self._last
                self._last = (j, self.blocks[i - 2], a, out)  # the recipe reruns the block two back
            return real(self, block, *args)

        ir.InputRecompute.__call__ = call
        return lambda: setattr(ir.InputRecompute, "__call__", real)
    if bug == "keeps_input":
        real_same = ir._same
        ir._same = lambda a, b: False  # the pack hook never recognises the input: it is saved as before
        return lambda: setattr(ir, "_same", real_same)
    assert not bug
    return lambda: None


def run(k: int, fsdp: str, *, mesh=None, device=None, dtype=torch.float32, bug: str = "") -> dict:
    """Train 2 steps with ``k`` block inputs recomputed; step-1 grads, final weights, which block inputs a forward
    leaves alive, and the lever's counters."""
    from miles_ext.levers import input_recompute as ir
    from miles_ext.levers.fsdp_policy import apply_fsdp2
    from miles_ext.levers.lora import lora_parameters
    from miles_ext.recipe.schedule import pair_schedule
    from miles_ext.recipe.sft import draw_micro_batch, micro_batch_loss_sum, train_step
    from tests.equivalence.h3_tiny_run import OPTIM, make_lora_model, synthetic_pairs

    undo = _plant(bug)
    try:
        pairs = synthetic_pairs(GBS * STEPS, _preset())
        model = make_lora_model(_preset(), master_dtype=None if dtype == torch.float32 else "bf16")
        model.enable_gradient_checkpointing()
        model.train()
        fn = ir.enable(model, k)
        if FSDP[fsdp] is not None:
            apply_fsdp2(model, param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32,
                        mesh=mesh, **FSDP[fsdp])
        elif device is not None:
            model.to(device)
        lora = lora_parameters(model)
        opt = torch.optim.AdamW(list(lora.values()), **OPTIM)
        out: dict = {"grads": {}}

        def full(t):
            return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()

        def snap() -> None:
            if not out["grads"]:
                out["grads"] = {n: full(p.grad) for n, p in lora.items()}

        for slots in pair_schedule(GBS, 1, STEPS, 1)[:STEPS]:
            train_step(model, opt, slots, pairs, seed=3, max_grad_norm=0.05, after_backward=snap, device=device)
        out["weights"] = {n: full(p) for n, p in lora.items()}
        out["counters"] = (fn.dropped_calls, fn.recomputed, sorted(fn.dropped)) if fn else (0, 0, [])

        # one more forward: which block inputs are still alive before the backward
        refs: dict[int, weakref.ref] = {}
        blocks = list(model.transformer_blocks)

        def seen(i: int):
            def hook(module, args) -> None:  # returns nothing: the args stay as they are
                refs.setdefault(i, weakref.ref(args[0]))
            return hook

        hooks = [b.register_forward_pre_hook(seen(i), prepend=True) for i, b in enumerate(blocks)]
        micro = [p if device is None else p.to(device) for p in pairs[:2]]
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() if device is not None and torch.device(device).type == "cuda" else 0
        loss = micro_batch_loss_sum(model, draw_micro_batch(micro, seed=3, rollout_id=0, microbatch_id=0, dp_rank=0))
        after = torch.cuda.memory_allocated() if before else 0
        out["alive"] = [i for i in range(len(blocks)) if refs[i]() is not None]
        out["forward_bytes"] = after - before
        loss.backward()
        for h in hooks:
            h.remove()
        opt.zero_grad(set_to_none=True)
        return out
    finally:
        undo()


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _worker(rank: int, world: int, out_dir: str) -> None:
    res = {}
    for fsdp in FSDP:
        for k in (0, 1, 2):
            res[(fsdp, k)] = run(k, fsdp, mesh=cpu_mesh() if FSDP[fsdp] is not None else None)
    res["bug_wrong_block"] = run(2, "offload", mesh=cpu_mesh(), bug="wrong_block")
    res["bug_keeps_input"] = run(2, "none", bug="keeps_input")
    torch.save(res, Path(out_dir) / "recompute.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("input_recompute")
    launch(_worker, 1, str(out))
    return torch.load(out / "recompute.pt")


@pytest.mark.parametrize("fsdp", list(FSDP))
@pytest.mark.parametrize("k", [1, 2])
def test_gradients_and_weights_bitwise_equal_the_plain_checkpoint(results, fsdp, k):
    ref, got = results[(fsdp, 0)], results[(fsdp, k)]
    assert any(g.abs().sum() > 0 for g in ref["grads"].values())
    assert _equal(got["grads"], ref["grads"]), f"{fsdp}, {k} recomputed: step-1 LoRA gradients differ"
    assert _equal(got["weights"], ref["weights"]), f"{fsdp}, {k} recomputed: weights after {STEPS} steps differ"


def test_the_three_placements_agree(results):
    assert _equal(results[("offload", 0)]["grads"], results[("none", 0)]["grads"])
    assert _equal(results[("resident", 2)]["weights"], results[("none", 2)]["weights"])


@pytest.mark.parametrize("fsdp", list(FSDP))
def test_dropped_inputs_are_freed_after_the_forward(results, fsdp):
    assert results[(fsdp, 0)]["alive"] == list(range(LAYERS))
    assert results[(fsdp, 1)]["alive"] == [0, 2, 3, 4]  # select_dropped(5, 1) == [1]
    assert results[(fsdp, 2)]["alive"] == [0, 2, 4]


@pytest.mark.parametrize("fsdp", list(FSDP))
def test_each_dropped_input_costs_one_forward_of_the_block_before(results, fsdp):
    micro_batches = GBS * STEPS  # micro-batch size 1
    for k, dropped in ((1, [1]), (2, [1, 3])):
        calls, recomputed, chosen = results[(fsdp, k)]["counters"]
        assert chosen == dropped
        assert calls == recomputed == k * micro_batches


def test_planted_recipe_of_the_wrong_block_is_caught(results):
    assert not _equal(results["bug_wrong_block"]["grads"], results[("offload", 0)]["grads"])


def test_planted_input_kept_is_caught(results):
    assert results["bug_keeps_input"]["alive"] != [0, 2, 4]


def test_select_dropped_by_hand():
    """Odd indices only, spread: 50 blocks, 25 -> every odd one, 1 -> odd[round(12.0)] = 25; 5 blocks (odd 1, 3):
    1 -> odd[round(0.5)] = odd[0] (round half to even), 2 -> both; 0 -> none; more than half refused."""
    from miles_ext.levers.input_recompute import select_dropped

    assert select_dropped(50, 25) == list(range(1, 50, 2))
    assert select_dropped(5, 1) == [1] and select_dropped(5, 2) == [1, 3] and select_dropped(5, 0) == []
    assert select_dropped(50, 1) == [25]
    d = select_dropped(50, 18)
    assert len(d) == 18 and all(i % 2 == 1 for i in d) and d == sorted(set(d))
    with pytest.raises(ValueError, match="every second block at most"):
        select_dropped(5, 3)
    with pytest.raises(ValueError):
        select_dropped(5, -1)


def test_a_bad_dropped_set_is_refused():
    from miles_ext.levers.input_recompute import InputRecompute

    blocks = [torch.nn.Linear(2, 2) for _ in range(4)]
    for bad in ([0], [1, 2], [4]):
        with pytest.raises(ValueError, match="cannot have their inputs recomputed"):
            InputRecompute(blocks, bad)
    assert InputRecompute(blocks, [1, 3]).dropped == {1, 3}


def test_a_block_called_with_another_input_keeps_its_input():
    """The recipe is used only when a dropped block's input IS the output of the block before: called with any other
    tensor, the block's input is kept and its gradients are the plain checkpoint's."""
    from torch.utils.checkpoint import checkpoint

    from miles_ext.levers.input_recompute import InputRecompute

    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    x, y = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)

    def grads(fn):
        for p in (*a.parameters(), *b.parameters(), x, y):
            p.grad = None
        out_a = fn(a, x)
        out_b = fn(b, y * 1.0)  # not out_a
        (out_a.sum() + (out_b ** 2).sum()).backward()
        return [p.grad.clone() for p in (*a.parameters(), *b.parameters(), x, y)]

    lever = InputRecompute([a, b], [1])
    got = grads(lever)
    ref = grads(lambda blk, *args: checkpoint(blk.__call__, *args, use_reentrant=False))
    assert lever.dropped_calls == 0 and lever.recomputed == 0
    assert all(torch.equal(g, r) for g, r in zip(got, ref))


def test_enable_zero_leaves_diffusers_checkpoint_in_place():
    from miles_ext.levers import input_recompute as ir
    from tests.equivalence.h3_tiny_run import make_lora_model

    model = make_lora_model(_preset())
    model.enable_gradient_checkpointing()
    before = model._gradient_checkpointing_func
    assert ir.enable(model, 0) is None
    assert model._gradient_checkpointing_func is before and not hasattr(model, "_onecard_input_recompute")
    fn = ir.enable(model, 2)
    assert isinstance(fn, ir.InputRecompute) and model._onecard_input_recompute is fn
    assert model._gradient_checkpointing_func is fn and sorted(fn.dropped) == [1, 3]


def test_parse_setting_by_hand():
    from miles_ext.levers.input_recompute import parse_setting
    from patches.core.errors import UserError

    for given, want in ((None, 0), ("", 0), ("  ", 0), (" None ", 0), ("none", 0), ("AUTO", "auto"), (" auto ", "auto"),
                        ("0", 0), (" 3 ", 3), ("007", 7), (25, 25), ("999999999", 999999999)):
        assert parse_setting(given, "--x") == want, given
    for bad in ("-1", "1.5", "nan", "inf", "half", "0x1", "1e3", "1234567890", "9" * 5000):
        with pytest.raises(UserError, match=r"^--x '.{0,43}': use auto, a whole number"):
            parse_setting(bad, "--x")


def test_resolve_count_checks_on_its_own():
    """The count and ``auto``'s conditions are checked where the count is resolved too (callers other than the
    trainer's preflight: the benchmark)."""
    from miles_ext.levers.input_recompute import resolve_count
    from miles_ext.recipe.presets import build_transformer
    from patches.core.errors import UserError

    model = build_transformer(_preset(), device="meta")  # 5 transformer blocks: at most 2
    kw = dict(source="--x", budget_bytes=8 << 30, tokens=10)
    assert resolve_count(model, "2", full_offload=False, **kw) == (2, None)
    with pytest.raises(UserError, match="at most every second of the 5 transformer blocks .* use 0 to 2"):
        resolve_count(model, 3, full_offload=True, **kw)
    with pytest.raises(UserError, match="plans the GPU peak of full offload"):
        resolve_count(model, "auto", full_offload=False, **kw)
    with pytest.raises(UserError, match="no GPU was found"):
        resolve_count(model, "auto", full_offload=True, source="--x", budget_bytes=None, tokens=10)
    said = []
    k, plan = resolve_count(model, "auto", full_offload=True, say=said.append, **kw)
    assert k == plan.dropped == 0 and said and said[0].endswith("at 10 tokens")


# ------------------------------------------------------------------------------------------------- memory model
FULL_OFFLOAD_ROWS = [  # (tokens, inputs recomputed, side-stream prefetch, peak allocated GiB)
    (576, 0, False, 2.174), (8530, 0, False, 8.487), (27580, 0, False, 24.2),  # 2026-11-30 json, 2026-12-01 docs
    (27580, 18, False, 20.708), (8530, 0, True, 9.980), (24290, 0, True, 23.106),  # 2026-12-04, benchmarks/results
    (27580, 0, True, 25.707),
]
"""The full-offload H200 rows (``h3_1gpu.json`` of 2026-11-30 and 2026-12-04; 27,580 tokens without the lever from the
2026-12-01 run in ``docs/h3.md``)."""


def _full_widths():
    from miles_ext.levers.residency import block_bytes
    from miles_ext.recipe.presets import meta_transformer
    from miles_ext.levers.fsdp_policy import set_master_dtype

    model = set_master_dtype(meta_transformer("full"), "bf16")
    sizes, _, _ = block_bytes(model)
    return len(sizes), max(sizes)


def test_full_offload_model_is_at_or_above_the_h200_rows():
    """Every full-offload H200 row is at or under the model, by at most 0.55 GiB."""
    from miles_ext.levers.input_recompute import full_offload_terms
    from miles_ext.recipe.presets import FULL

    n, big = _full_widths()
    for tokens, dropped, prefetch, measured in FULL_OFFLOAD_ROWS:
        terms = full_offload_terms(tokens, num_blocks=n, hidden=FULL.hidden_size, ffn_dim=FULL.ffn_dim,
                                   block_bytes=big, dropped=dropped, prefetch=prefetch)
        predicted = sum(terms.values()) / 2**30
        assert measured <= predicted <= measured + 0.55, (tokens, dropped, prefetch, measured, predicted)
    one = full_offload_terms(27580, num_blocks=n, hidden=FULL.hidden_size, ffn_dim=FULL.ffn_dim, block_bytes=big,
                             dropped=18, prefetch=True)
    assert one["second gathered block"] == big  # the recipe's forward consumes the staged copy: one block, not two


def test_auto_picks_the_fewest_inputs_for_the_24gb_card():
    from miles_ext.levers.input_recompute import FRAGMENTATION_GIB, full_offload_terms, plan_dropped
    from miles_ext.recipe.presets import FULL
    from patches.core.errors import UserError

    n, big = _full_widths()
    kw = dict(num_blocks=n, hidden=FULL.hidden_size, ffn_dim=FULL.ffn_dim, block_bytes=big)
    plan = plan_dropped(27580, budget_bytes=int(22.06 * 2**30), num_transformer_blocks=50, **kw)
    assert 0 < plan.dropped <= 25
    assert plan.total_bytes <= (22.06 - FRAGMENTATION_GIB) * 2**30
    fewer = full_offload_terms(27580, dropped=plan.dropped - 1, **kw)
    assert sum(fewer.values()) > (22.06 - FRAGMENTATION_GIB) * 2**30
    assert "block inputs recomputed" in plan.line()
    assert plan_dropped(576, budget_bytes=int(22.06 * 2**30), num_transformer_blocks=50, **kw).dropped == 0
    with pytest.raises(UserError, match="does not hold 27580 tokens"):
        plan_dropped(27580, budget_bytes=int(10 * 2**30), num_transformer_blocks=50, **kw)
    # a budget that only every second input recomputed fits: 25 is tried and chosen, one byte less is refused
    every = sum(full_offload_terms(27580, dropped=25, **kw).values()) + int(FRAGMENTATION_GIB * 2**30)
    assert plan_dropped(27580, budget_bytes=every, num_transformer_blocks=50, **kw).dropped == 25
    with pytest.raises(UserError, match=r"\(20\.\d\d GiB needed, 1 of it allocator room\)"):
        plan_dropped(27580, budget_bytes=every - 1, num_transformer_blocks=50, **kw)


# ------------------------------------------------------------------------------------------------- on the GPU
def _cuda_worker(rank: int, world: int, out_dir: str) -> None:
    torch.cuda.set_device(0)
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        for fsdp in ("none", "offload"):
            for k in (0, 2):
                res[(str(dtype), fsdp, k)] = run(k, fsdp, device="cuda", dtype=dtype)
    torch.save(res, Path(out_dir) / "cuda.pt")


@pytest.fixture(scope="module")
def cuda_results(tmp_path_factory):
    from tests.equivalence.h3_ranks import cuda_results as run

    return run(tmp_path_factory, _cuda_worker, "input_recompute_cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("dtype", [str(torch.float32), str(torch.bfloat16)])
@pytest.mark.parametrize("fsdp", ["none", "offload"])
def test_cuda_bitwise_equal_and_the_inputs_leave_the_card(cuda_results, dtype, fsdp):
    ref, got = cuda_results[(dtype, fsdp, 0)], cuda_results[(dtype, fsdp, 2)]
    assert _equal(got["grads"], ref["grads"]) and _equal(got["weights"], ref["weights"])
    assert got["alive"] == [0, 2, 4]
    assert ref["forward_bytes"] - got["forward_bytes"] > 0
