"""Packed latents by one gather (``[onecard] latent_gather``) train exactly what diffusers' per-sample loops train.

:mod:`cosmos_framework_ext.levers.latent_gather` replaces ``Cosmos3OmniTransformer``'s three packing helpers
(``_patchify_and_pack_latents``, ``_apply_timestep_embeds_to_noisy_tokens``, ``_unpatchify_and_unpack_latents``)
by one indexed copy each, with indices built on the host from the latent shapes (:func:`gather_plan`).

- **Helpers, CPU:** packed latents, timestep-embedded tokens and unpacked predictions ``torch.equal`` diffusers'
  own loops (the anchor: diffusers' code, not ours), for latents whose H and W are and are not multiples of the
  patch (padding), and the backward of the unpack (its input's gradient) as well.
- **Model, CPU** (tiny preset, fp32, activation checkpointing on): three packed micro-batches of different sample
  counts and shapes, forward and backward: every loss and gradient ``torch.equal`` the model without the lever.
- **Trainer, CPU:** the tiny recipe with ``latent_gather = true`` (4 steps, EMA, checkpoint) equals the same run
  without it, tensor for tensor, and every micro-batch was packed by the gather.
- **Falls back** to diffusers' loops without a plan, for latents of other shapes than the plan's, and when not
  every frame is noisy.
- **GPU:** the model comparison on a CUDA device, and the helpers launch nothing that waits for the GPU.

Planted: the pack index with the patch's two axes swapped (``thwqpc``), and an unpack index one row off, each break
the equality; a plan of another micro-batch's shapes is not used.
"""

from __future__ import annotations

import json

import pytest
import torch

from cosmos_framework_ext.levers import latent_gather as lg
from tests.equivalence import tiny_recipe as R
from tests.test_train import env, run_main, small_toml  # noqa: F401 - env: the fixture (dataset, output root)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")

SHAPES = [(1, 48, 2, 4, 6), (1, 48, 3, 5, 3), (1, 48, 1, 3, 4)]
"""Latents of three samples: one a multiple of the patch (2), two padded (H 5, W 3 and H 3)."""


def _tok(shapes, p=2):
    return [(s[2], -(-s[3] // p), -(-s[4] // p)) for s in shapes]


def _helpers_both_ways(shapes, plan_fn=lg.gather_plan):
    model, _ = R.make_model()
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(s, generator=g) for s in shapes]
    ref_packed, orig = model._patchify_and_pack_latents(xs)
    hidden = torch.randn(ref_packed.shape[0], 8, generator=g)
    emb = torch.randn(ref_packed.shape[0], 8, generator=g)
    noisy = [torch.arange(t[0]) for t in _tok(shapes)]
    ref_emb = model._apply_timestep_embeds_to_noisy_tokens(hidden, emb, noisy, _tok(shapes))
    preds = torch.randn(ref_packed.shape, generator=g, requires_grad=True)
    ref_out = model._unpatchify_and_unpack_latents(preds, _tok(shapes), noisy, orig)
    ref_grad = torch.autograd.grad(sum((o * (i + 1)).sum() for i, o in enumerate(ref_out)), preds)[0]
    gather = lg.install(model)
    gather.plan = plan_fn(shapes, model.config.latent_patch_size)
    packed, orig2 = model._patchify_and_pack_latents(xs)
    emb2 = model._apply_timestep_embeds_to_noisy_tokens(hidden, emb, noisy, _tok(shapes))
    out = model._unpatchify_and_unpack_latents(preds, _tok(shapes), noisy, orig2)
    grad = torch.autograd.grad(sum((o * (i + 1)).sum() for i, o in enumerate(out)), preds)[0]
    same = (torch.equal(packed, ref_packed) and orig2 == orig and torch.equal(emb2, ref_emb)
            and len(out) == len(ref_out) and all(torch.equal(a, b) for a, b in zip(out, ref_out))
            and torch.equal(grad, ref_grad))
    return same, gather


@pytest.mark.parametrize("shapes", [SHAPES, SHAPES[:1], [(1, 48, 4, 6, 8)] * 3], ids=["padded", "one", "even"])
def test_helpers_equal_diffusers_loops(shapes):
    same, gather = _helpers_both_ways(shapes)
    assert same and gather.gathered == 1


def _micro_batch(n: int, seed: int):
    """``n`` samples of shapes that change with ``seed`` (H and W odd and even)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t, h, w = 1 + (seed + i) % 3, 3 + (seed * 2 + i) % 4, 2 + (seed + 3 * i) % 5
        ids = torch.randint(0, 1000, (4 + i,), generator=g).tolist()
        out.append((ids, torch.randn(1, 48, t, h, w, generator=g), float(torch.rand((), generator=g)),
                    torch.randn(1, 48, t, h, w, generator=g)))
    return out


def _train(model, gather=None, device="cpu", impl="dense", plan_fn=lg.gather_plan):
    def set_plan(xt):
        gather.plan = plan_fn([x.shape for x in xt], model.config.latent_patch_size).to(torch.device(device))

    out = []
    for n, seed in ((3, 1), (5, 2), (2, 3)):
        loss, grads = R.packed_step(model, _micro_batch(n, seed), impl, set_plan if gather is not None else None)
        if gather is not None:
            gather.plan = None
        out.append((loss.cpu(), [g.cpu() for g in grads]))
    return out


def _same(a, b) -> bool:
    return all(torch.equal(la, lb) and len(ga) == len(gb) > 0 and all(torch.equal(x, y) for x, y in zip(ga, gb))
               for (la, ga), (lb, gb) in zip(a, b))


def _pair(device="cpu", impl="dense", plan_fn=lg.gather_plan):
    stock, _ = R.make_model(device=device)
    stock.enable_gradient_checkpointing()
    lever, _ = R.make_model(device=device)
    lever.enable_gradient_checkpointing()
    gather = lg.install(lever)
    return _train(stock, device=device, impl=impl), _train(lever, gather, device=device, impl=impl, plan_fn=plan_fn), gather


def test_the_model_trains_the_same_cpu():
    stock, lever, gather = _pair()
    assert gather.gathered == 3 and _same(stock, lever)


def test_the_trainer_trains_the_same(env, monkeypatch, capsys):
    def run(name, on):
        monkeypatch.setenv("OUTPUT_ROOT", str(env / name))
        toml = small_toml(env, **{"compile_blocks = true": f"compile_blocks = true\nlatent_gather = {str(on).lower()}",
                                  "cpu_max_sequence_length = 300": "cpu_max_sequence_length = 600"})
        rc, _, err = run_main(["--sft-toml", str(toml)], capsys)
        assert rc == 0, err
        s = json.loads((env / name / "cosmos3" / "sft" / "vision_sft_edge_24gb" / "summary.json").read_text())
        return s, torch.load(s["checkpoint"], map_location="cpu", weights_only=False)["model"]

    (s0, a), (s1, b) = run("stock", False), run("gather", True)
    assert s0["latent_gather"] is None and s1["latent_gather"] == {"micro_batches": 4}
    assert s0["losses"] == s1["losses"] and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_falls_back_to_the_loops():
    model, _ = R.make_model()
    gather = lg.install(model)
    xs = [torch.randn(s) for s in SHAPES]
    ref, _ = gather._orig["_patchify_and_pack_latents"](xs)
    assert torch.equal(model._patchify_and_pack_latents(xs)[0], ref) and gather.gathered == 0  # no plan
    gather.plan = lg.gather_plan(SHAPES[:2], 2)  # another micro-batch's shapes
    assert torch.equal(model._patchify_and_pack_latents(xs)[0], ref) and gather.gathered == 0
    gather.plan = lg.gather_plan(SHAPES, 2)
    packed, orig = model._patchify_and_pack_latents(xs)
    some = [torch.arange(t[0])[:1] for t in _tok(SHAPES)]  # only the first frame of each sample noisy
    hidden, emb = torch.randn(packed.shape[0], 8), torch.randn(sum(len(s) * t[1] * t[2] for s, t in zip(some, _tok(SHAPES))), 8)
    want = gather._orig["_apply_timestep_embeds_to_noisy_tokens"](hidden, emb, some, _tok(SHAPES))
    assert torch.equal(model._apply_timestep_embeds_to_noisy_tokens(hidden, emb, some, _tok(SHAPES)), want)
    preds = torch.randn(packed.shape)  # a row for every token, as many as the plan's: only the frames decide
    want = gather._orig["_unpatchify_and_unpack_latents"](preds, _tok(SHAPES), some, orig)
    got = model._unpatchify_and_unpack_latents(preds, _tok(SHAPES), some, orig)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_bad_shapes_are_refused():
    for shapes in ([], [(48, 2, 4, 6)], [(1, 48, 2, 4, 6), (1, 16, 2, 4, 6)], [(2, 48, 2, 4, 6)]):
        with pytest.raises(ValueError, match="latent shapes"):
            lg.gather_plan(shapes, 2)


# ------------------------------------------------------------------------------------------ planted bugs
def _swapped_pack(shapes, p, pin=False):
    """The bug: the patch's two axes swapped in the pack index (``thwqpc``)."""
    plan = lg.gather_plan(shapes, p, pin)
    idx = plan.patch_index.view(plan.tokens, p, p, -1).transpose(1, 2).reshape(-1)
    return lg.GatherPlan(plan.latent_shapes, idx.contiguous(), plan.unpatch_index, plan.tokens)


def _unpack_row_off(shapes, p, pin=False):
    """The bug: the unpack reads each value from the next token's row (wrapping at the end)."""
    plan = lg.gather_plan(shapes, p, pin)
    width = plan.patch_index.numel() // plan.tokens
    idx = (plan.unpatch_index.long() + width) % plan.patch_index.numel()
    return lg.GatherPlan(plan.latent_shapes, plan.patch_index, idx.to(torch.int32), plan.tokens)


@pytest.mark.parametrize("bug", [_swapped_pack, _unpack_row_off], ids=["pack-axes-swapped", "unpack-row-off"])
def test_planted_index_bugs_break_the_equality(bug):
    assert not _helpers_both_ways(SHAPES, plan_fn=bug)[0]
    stock, lever, _ = _pair(plan_fn=bug)
    assert not _same(stock, lever)


# ------------------------------------------------------------------------------------------ GPU
@cuda
def test_cuda_the_model_trains_the_same():
    stock, lever, gather = _pair(device="cuda", impl="flex")
    assert gather.gathered == 3 and _same(stock, lever)


@cuda
def test_cuda_the_gather_waits_for_nothing():
    model, _ = R.make_model(device="cuda")
    gather = lg.install(model)
    xs = [torch.randn(s, device="cuda") for s in SHAPES]
    plan = lg.gather_plan(SHAPES, 2, pin=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gather.plan = plan.to(torch.device("cuda"))
        packed, orig = model._patchify_and_pack_latents(xs)
        out = model._unpatchify_and_unpack_latents(packed, _tok(SHAPES), [torch.arange(t[0], device="cuda")
                                                                          for t in _tok(SHAPES)], orig)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert gather.gathered == 1 and len(out) == 3
