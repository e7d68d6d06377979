"""Block-sparse packed attention (``[onecard].attention = "flex"``) equals the dense-mask reference.

:mod:`cosmos_framework_ext.levers.attention_blocksparse` states the packed-attention rule (text: causal within its own
sample; vision: all text and vision tokens of its own sample) as flex_attention block masks. Proofs, for packed
micro-batches of 1, 2 and 8 samples (two of them a single text token, two a single vision token) and tiles of
2, 4, 16 and 128 tokens:

- the token-level mask a kernel applies with the block mask (full tiles: all; partial tiles: the mask_mod;
  unlisted tiles: none) is exactly the dense ``PackedSegments`` mask, and the tile lists are exactly
  ``create_block_mask``'s (which evaluates the mask_mod on the whole grid);
- outputs and gradients (q, k, v) equal the dense ``scaled_dot_product_attention`` path in fp32 on the CPU within
  1e-6 relative (Frobenius norm of the difference over the norm of the reference), grouped-query heads included;
- the compiled CPU kernel (inductor's flex template, which skips unlisted tiles) gives the same outputs
  (forward only: PyTorch 2.13 has no CPU flex backward; opt-in, ``ONECARD_CPU_KERNEL_TESTS=1``, as its
  compile takes 25-60 s on 2 cores);
- a training step of the tiny preset (loss within 1e-6, every trainable gradient within 1e-5 relative; measured
  0 and 7e-7) and a run of the embedded trainer (loss and weights after an optimizer step, within 1e-5) are the
  same with ``flex`` as with ``dense``.

Planted bugs that must fail: a vision token allowed to see the next sample's text; a causal diagonal tile
marked full (text sees later text). On a GPU (marked ``cuda``): bf16 outputs and gradients of the compiled
kernel against the fp32 reference, within 2e-2 relative and no worse than twice the dense bf16 path's error
plus 1e-3.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from cosmos_framework_ext.recipe import attention
from cosmos_framework_ext.levers.attention_blocksparse import BlockSparseSegments, segment_block_mask
from cosmos_framework_ext.recipe.loss import flow_matching_inputs, micro_batch_loss
from tests.equivalence import tiny_recipe as R

PACKINGS = {
    "one": [(5, 12)],
    "two": [(4, 9), (6, 20)],
    # (text tokens, vision tokens) per sample: single-token texts and single-token videos included
    "many": [(1, 1), (3, 9), (1, 30), (7, 1), (2, 17), (6, 40), (3, 3), (5, 22)],
}
BLOCKS = [2, 4, 16, 128]
TOL = 1e-6


def segment_ids(packing) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [und_len], [gen_len]: the sample index of each text and each vision token."""
    und = torch.cat([torch.full((t,), i) for i, (t, _) in enumerate(packing)])
    gen = torch.cat([torch.full((g,), i) for i, (_, g) in enumerate(packing)])
    return und, gen


def dense_masks(und: torch.Tensor, gen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference rule as bool [U, U] and [G, U + G] (``PackedSegments``'s masks)."""
    ref = attention.PackedSegments(und, gen)
    return ref.und_mask[0, 0], ref.gen_mask[0, 0]


def _tiles(num: torch.Tensor, idx: torch.Tensor, n_cols: int) -> torch.Tensor:
    """bool [rows, n_cols] from a BlockMask's (count, ordered indices) pair."""
    num, idx = num[0, 0], idx[0, 0]
    out = torch.zeros(num.shape[0], n_cols, dtype=torch.bool)
    for r in range(num.shape[0]):
        out[r, idx[r, : int(num[r])].long()] = True
    return out


def effective_mask(bm) -> torch.Tensor:
    """bool [Lq, Lkv]: what a block-sparse kernel computes with ``bm``: full tiles attend, partial tiles ask the
    mask_mod, unlisted tiles are skipped. Also checks the query-side lists (the backward's) are the transpose."""
    lq, lk = bm.seq_lengths
    bq, bk = bm.BLOCK_SIZE
    nq, nk = bm.kv_indices.shape[-2], bm.kv_indices.shape[-1]
    partial = _tiles(bm.kv_num_blocks, bm.kv_indices, nk)
    full = _tiles(bm.full_kv_num_blocks, bm.full_kv_indices, nk)
    assert not (partial & full).any()
    assert torch.equal(_tiles(bm.q_num_blocks, bm.q_indices, nq), partial.T)
    assert torch.equal(_tiles(bm.full_q_num_blocks, bm.full_q_indices, nq), full.T)

    def tokens(t):
        return t.repeat_interleave(bq, 0).repeat_interleave(bk, 1)[:lq, :lk]

    q, k = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    return tokens(full) | (tokens(partial) & bm.mask_mod(0, 0, q, k))


# ------------------------------------------------------------------------------------ the block lists
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("name", PACKINGS)
def test_block_mask_is_the_dense_rule_and_create_block_masks(name, block):
    und, gen = segment_ids(PACKINGS[name])
    segs = BlockSparseSegments(und, gen, block=block)
    ref_und, ref_gen = dense_masks(und, gen)
    assert torch.equal(effective_mask(segs.und_mask), ref_und)
    assert torch.equal(effective_mask(segs.gen_mask), ref_gen)
    for bm in (segs.und_mask, segs.gen_mask):
        lib = create_block_mask(bm.mask_mod, None, None, *bm.seq_lengths, device="cpu", BLOCK_SIZE=block)
        assert torch.equal(bm.to_dense(), lib.to_dense())  # listed tiles (partial or full)
        nk = bm.kv_indices.shape[-1]
        assert torch.equal(_tiles(bm.full_kv_num_blocks, bm.full_kv_indices, nk),
                           _tiles(lib.full_kv_num_blocks, lib.full_kv_indices, nk))


def test_mask_memory_is_linear_in_the_tokens():
    """At the recipe's cap (12288 tokens, 33 samples, 128-token tiles) the block mask holds O(L) + O((L/128)^2)
    bytes, against L^2 bytes of the dense masks."""
    n, per_text, per_vision = 33, 40, 330
    und, gen = segment_ids([(per_text, per_vision)] * n)
    segs = BlockSparseSegments(und, gen)
    tensors = [t for bm in (segs.und_mask, segs.gen_mask) for t in bm.as_tuple() if isinstance(t, torch.Tensor)]
    tensors += [c.cell_contents for bm in (segs.und_mask, segs.gen_mask) for c in bm.mask_mod.__closure__
                if isinstance(c.cell_contents, torch.Tensor)]
    sparse_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
    length = und.numel() + gen.numel()
    assert sparse_bytes < 64 * length  # 8 bytes per token and sample id, tile lists ~ (L / 128)^2 int32
    assert sparse_bytes * 300 < und.numel() ** 2 + gen.numel() * length  # dense: one byte per pair (135 MB here)


def test_planted_causal_diagonal_tile_marked_full_is_detected():
    """Planted: text tiles built without the causal rule (diagonal tiles full) let text see later text."""
    und, gen = segment_ids(PACKINGS["many"])
    segs = BlockSparseSegments(und, gen, block=4)
    wrong = segment_block_mask(und, und, segs.und_mask.mask_mod, causal=False, block=4)
    assert not torch.equal(effective_mask(wrong), dense_masks(und, gen)[0])


# ------------------------------------------------------------------------------- outputs and gradients
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def random_inputs(packing, heads, kv_heads, dim, dtype, device, seed):
    """Segment ids and seeded random attention inputs for ``packing``: (und ids, gen ids, {q_und, k_und, v_und, q_gen,
    k_all, v_all}, (text-output weights, vision-output weights)), drawn in fp32 on the host, then cast and moved."""
    und, gen = segment_ids(packing)
    g = torch.Generator().manual_seed(seed)
    u, n = und.numel(), gen.numel()

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    base = {"q_und": rnd(u, heads, dim), "k_und": rnd(u, kv_heads, dim), "v_und": rnd(u, kv_heads, dim),
            "q_gen": rnd(n, heads, dim), "k_all": rnd(u + n, kv_heads, dim), "v_all": rnd(u + n, kv_heads, dim)}
    return und, gen, base, (rnd(u, heads * dim), rnd(n, heads * dim))  # a loss that weighs every output differently


def dense_outputs(segs: attention.PackedSegments, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense reference's text and vision outputs for :func:`random_inputs`' tensors ``x``."""
    multi = not segs.single
    sdpa = attention.PackedAttnProcessor._sdpa
    return (sdpa(x["q_und"], x["k_und"], x["v_und"], segs.und_mask if multi else None, True),
            sdpa(x["q_gen"], x["k_all"], x["v_all"], segs.gen_mask if multi else None, False))


def attention_pair(packing, block=4, heads=4, kv_heads=2, dim=16, dtype=torch.float32, device="cpu",
                   plant=None, backend=None, grad=True, seed=0):
    """Dense and block-sparse attention of random q/k/v for ``packing``: {name: (dense, flex)} for the text
    output, the vision output and every input's gradient (``grad``). ``plant(segs, und, gen)`` may corrupt the
    block-sparse segments."""
    und, gen, base, (w_und, w_gen) = random_inputs(packing, heads, kv_heads, dim, dtype, device, seed)
    dense_segs = attention.PackedSegments(und.to(device), gen.to(device))
    flex_segs = BlockSparseSegments(und.to(device), gen.to(device), block=block)
    flex_segs.backend = backend
    if plant is not None:
        plant(flex_segs, und.to(device), gen.to(device))
    results = {}
    for impl in ("dense", "flex"):
        x = {k: v.clone().requires_grad_(grad) for k, v in base.items()}
        if impl == "dense":
            out_und, out_gen = dense_outputs(dense_segs, x)
        else:
            out_und = flex_segs.attend_und(x["q_und"], x["k_und"], x["v_und"])
            out_gen = flex_segs.attend_gen(x["q_gen"], x["k_all"], x["v_all"])
        results[impl] = {"out_und": out_und.detach(), "out_gen": out_gen.detach()}
        if grad:
            ((out_und.float() * w_und.float()).sum() + (out_gen.float() * w_gen.float()).sum()).backward()
            results[impl].update({f"grad_{k}": v.grad for k, v in x.items()})
    return {k: (results["dense"][k], results["flex"][k]) for k in results["dense"]}


def flex_matches_dense(tol: float = TOL, **kw) -> bool:
    """Whether every output and gradient of the block-sparse path is within ``tol`` relative of the dense one."""
    return all(_rel(f.float(), d.float()) <= tol for d, f in attention_pair(**kw).values())


@pytest.mark.parametrize("block", [4, 128])
@pytest.mark.parametrize("name", PACKINGS)
def test_outputs_and_gradients_equal_dense_fp32(name, block):
    pairs = attention_pair(PACKINGS[name], block=block)
    errors = {k: _rel(f, d) for k, (d, f) in pairs.items()}
    assert len(errors) == 8 and max(errors.values()) <= TOL, errors


def test_grouped_query_heads_and_plain_heads():
    """GQA (8 query heads over 2 key heads) and no grouping (4 over 4) both match."""
    assert flex_matches_dense(packing=PACKINGS["many"], heads=8, kv_heads=2)
    assert flex_matches_dense(packing=PACKINGS["many"], heads=4, kv_heads=4)


def _leak_next_sample_text(segs: BlockSparseSegments, und: torch.Tensor, gen: torch.Tensor) -> None:
    """Planted: a vision token of sample i may also see the text of sample i + 1."""
    all_seg = torch.cat([und, gen])
    n_und = und.numel()

    def leaky(b, h, q, k):
        return (gen[q] == all_seg[k]) | ((k < n_und) & (all_seg[k] == gen[q] + 1))

    segs.gen_mask = segment_block_mask(gen, all_seg, leaky, causal=False, block=segs.gen_mask.BLOCK_SIZE[0])


def test_planted_vision_sees_next_sample_text_is_detected():
    assert flex_matches_dense(packing=PACKINGS["many"])
    assert not flex_matches_dense(packing=PACKINGS["many"], plant=_leak_next_sample_text)
    assert not flex_matches_dense(packing=PACKINGS["two"], plant=_leak_next_sample_text)


@pytest.mark.skipif(os.environ.get("ONECARD_CPU_KERNEL_TESTS") != "1",
                    reason="compiles inductor's CPU flex kernel (25-60 s on 2 cores): set ONECARD_CPU_KERNEL_TESTS=1")
def test_compiled_cpu_kernel_skips_tiles_and_matches(monkeypatch):
    """Inductor's CPU flex kernel (it skips unlisted tiles; forward only) with 16-token tiles on the 8-sample
    packing; the planted leak is seen by it too. Compiled static: in PyTorch 2.13 inductor's CPU flex template
    fails to build with symbolic lengths (CppCompileError); the GPU path compiles with dynamic lengths."""
    from cosmos_framework_ext.levers import attention_blocksparse

    monkeypatch.setitem(attention_blocksparse._COMPILED, "inductor",
                        torch.compile(attention_blocksparse._flex, dynamic=False))
    pairs = attention_pair(PACKINGS["many"], block=16, backend="inductor", grad=False)
    errors = {k: _rel(f, d) for k, (d, f) in pairs.items()}
    assert max(errors.values()) <= TOL, errors
    leaky = attention_pair(PACKINGS["many"], block=16, backend="inductor", grad=False, plant=_leak_next_sample_text)
    assert _rel(*leaky["out_gen"][::-1]) > 1e-2


# ---------------------------------------------------------------------- a training step, the trainer
def step_grads(impl: str, n_samples: int = 5):
    """Loss and trainable gradients of one packed micro-batch of the tiny preset (fp32, CPU)."""
    model, trainable = R.make_model()
    model.enable_gradient_checkpointing()
    samples = R.micro_batch(3, 1, n_samples=n_samples)
    xt, targets = [], []
    for _, x0, sigma, noise in samples:
        a, v = flow_matching_inputs(x0, noise, sigma)
        xt.append(a)
        targets.append(v)
    kwargs, segs = attention.build_packed_inputs(model.config, [s[0] for s in samples], xt,
                                                 torch.tensor([s[2] for s in samples]), [24.0] * n_samples,
                                                 torch.device("cpu"), impl=impl, block=4)
    model.layers[0].self_attn.processor.segments = segs
    loss = micro_batch_loss(model(**kwargs).sample, targets, 10.0, 2)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def step_equals_dense(impl: str) -> None:
    """One training step of the tiny preset with ``impl`` attention and with ``"dense"``: the loss within 1e-6, every
    trainable gradient within 1e-5 relative."""
    loss_d, grads_d = step_grads("dense")
    loss_i, grads_i = step_grads(impl)
    assert _rel(loss_i, loss_d) <= TOL
    errors = {n: _rel(grads_i[n], grads_d[n]) for n in grads_d}
    assert grads_d.keys() == grads_i.keys() and max(errors.values()) <= 1e-5, errors


def test_training_step_flex_equals_dense():
    step_equals_dense("flex")


def trainer_equals_dense(impl, tmp_path, monkeypatch, sample_dataset, capsys) -> None:
    """``python -m cosmos_framework_ext.recipe.train`` on the tiny preset, one optimizer step, with ``[onecard]
    attention = impl`` and with ``"dense"``: the same loss and weights (within 1e-5)."""
    from cosmos_framework_ext.recipe import train
    from tests.test_train import small_toml

    monkeypatch.setenv("DATASET_PATH", str(sample_dataset))
    for var in ("BASE_CHECKPOINT_PATH", "WAN_VAE_PATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "COSMOS_LATENT_CACHE"):
        monkeypatch.delenv(var, raising=False)
    out = {}
    for name in ("dense", impl):
        toml = small_toml(tmp_path, **{'attention      = "varlen"': f'attention      = "{name}"'})  # the recipe's
        monkeypatch.setenv("OUTPUT_ROOT", str(tmp_path / name))
        assert train.main(["--sft-toml", str(toml), "--max-iter", "1"]) == 0, capsys.readouterr().err
        assert f"attention {name}" in capsys.readouterr().out
        summary = json.loads(next(Path(tmp_path / name).rglob("summary.json")).read_text())
        out[name] = (summary, torch.load(summary["checkpoint"], map_location="cpu", weights_only=False))
    (sd, cd), (si, ci) = out["dense"], out[impl]
    assert sd["attention"] == "dense" and si["attention"] == impl
    assert si["last_loss"] == pytest.approx(sd["last_loss"], rel=1e-5)
    for k, v in cd["model"].items():
        torch.testing.assert_close(ci["model"][k], v, rtol=1e-5, atol=1e-6)


def test_embedded_trainer_flex_equals_dense(tmp_path, monkeypatch, sample_dataset, capsys):
    trainer_equals_dense("flex", tmp_path, monkeypatch, sample_dataset, capsys)


# ------------------------------------------------------------------------------------------- GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")


@cuda
@pytest.mark.parametrize("name", ["many", "recipe"])
def test_cuda_bf16_compiled_kernel_close_to_fp32_reference(name):
    """bf16 on the GPU (128-token tiles, the inductor/Triton kernel): relative error against the fp32 dense
    reference <= 2e-2 for outputs and gradients, and <= 2x the dense bf16 path's error + 1e-3."""
    packing = PACKINGS["many"] if name == "many" else [(40, 330)] * 33  # ~12 k tokens, as the recipe's cap
    kw = dict(packing=packing, block=128, heads=16, kv_heads=8, dim=128, device="cuda")
    ref = attention_pair(dtype=torch.float32, **kw)
    low = attention_pair(dtype=torch.bfloat16, **kw)
    for key, (ref_dense, _) in ref.items():
        dense_bf16, flex_bf16 = low[key]
        err_flex, err_dense = _rel(flex_bf16.float(), ref_dense), _rel(dense_bf16.float(), ref_dense)
        assert err_flex <= 2e-2 and err_flex <= 2 * err_dense + 1e-3, (key, err_flex, err_dense)


@cuda
def test_cuda_planted_leak_is_detected():
    kw = dict(packing=PACKINGS["many"], block=128, heads=16, kv_heads=8, dim=128, device="cuda")
    assert flex_matches_dense(tol=1e-4, **kw)  # fp32 on the GPU: two different kernels' rounding
    assert not flex_matches_dense(tol=1e-4, plant=_leak_next_sample_text, **kw)  # the leak: ~0.4 relative
