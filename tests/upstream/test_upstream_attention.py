"""``COSMOS_ATTN_BACKEND=torch`` against the real cosmos-framework attention frontend, on the CPU.

Upstream has no attention backend for the CPU (its ``choose_backend`` finds none there, as it finds none on
a GPU without flash-attn and with cuDNN older than it requires), so the stock frontend raises; with the
patch applied, upstream's own ``attention()`` -- its checks, its ``seqlens_*`` handling, its default scale --
and upstream's own ``two_way_attention`` (the Edge recipe's call site, through ``dispatch_attention`` and a
pack built by upstream's ``build_packed_sequence``) run on the torch backend and equal the dense masked
reference of ``tests/equivalence/test_upstream_attention.py`` (fp32, rtol = atol = 1e-5).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from patches.core.flags import ATTN_BACKEND
from patches.cosmos_table import patch_set
from tests.equivalence.test_upstream_attention import TOL, reference

ROOT = os.environ.get("COSMOS_FRAMEWORK_ROOT", "")
if ROOT and ROOT not in sys.path:
    sys.path.insert(0, ROOT)
ON = {ATTN_BACKEND.name: "torch"}
HEADS, KV_HEADS, DIM = 16, 8, 32


@pytest.fixture()
def patched():
    ps = patch_set()
    assert ps.apply(ON) == ["cosmos_framework.model.attention.frontend:choose_backend"]
    yield ps
    ps.revert()


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _qkv(tq, tk, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, tq, HEADS, DIM, generator=g).requires_grad_(),
            torch.randn(1, tk, KV_HEADS, DIM, generator=g).requires_grad_(),
            torch.randn(1, tk, KV_HEADS, DIM, generator=g).requires_grad_())


def test_stock_frontend_has_no_cpu_backend_and_revert_restores_it(patched):
    from cosmos_framework.model.attention import attention, frontend

    q, k, v = _qkv(6, 6)
    assert "torch" in frontend.BACKEND_MAP
    attention(q, k, v)
    patched.revert()
    assert "torch" not in frontend.BACKEND_MAP
    with pytest.raises(ValueError, match="Could not find a compatible Attention backend"):
        attention(q, k, v)


def test_upstream_attention_frontend_matches_reference(patched):
    from cosmos_framework.model.attention import attention  # bound before the patch, as the model binds it
    from cosmos_framework.model.attention.masks import CausalType

    text, vision = (150, 17, 1, 256, 130), (48, 24, 8, 64, 40)
    cu = _cu(text)
    q, k, v = _qkv(sum(text), sum(text))
    out = attention(q, k, v, is_causal=True, causal_type=CausalType.DontCare, cumulative_seqlen_Q=cu,
                    cumulative_seqlen_KV=cu, max_seqlen_Q=max(text), max_seqlen_KV=max(text))
    ref = reference(q, k, v, cu, cu, "DontCare")
    torch.testing.assert_close(out, ref, **TOL)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, **TOL)

    kv_lens = [t + g for t, g in zip(text, vision)]
    q, k, v = _qkv(sum(vision), sum(kv_lens), seed=1)
    seqlens = dict(seqlens_Q=torch.tensor(vision, dtype=torch.int32), seqlens_KV=torch.tensor(kv_lens, dtype=torch.int32))
    out, lse = attention(q, k, v, **seqlens, return_lse=True)  # upstream derives the offsets
    ref, ref_lse = reference(q, k, v, _cu(vision), _cu(kv_lens), None, with_lse=True)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


def test_upstream_two_way_attention_matches_reference(patched):
    """The recipe's call site: text causal within its sample, vision tokens see their whole sample."""
    from cosmos_framework.data.generator.sequence_packing.runtime import from_und_gen_splits, get_all_seq
    from cosmos_framework.model.generator.mot.attention import build_packed_sequence, dispatch_attention

    text, vision = (30, 17, 1, 64), (40, 8, 24, 16)
    split_lens = [n for pair in zip(text, vision) for n in pair]
    attn_modes = ["causal", "full"] * len(text)
    sample_lens = [t + g for t, g in zip(text, vision)]
    starts = _cu(sample_lens).tolist()
    und = torch.cat([torch.arange(s, s + t) for s, t in zip(starts, text)])
    gen = torch.cat([torch.arange(s + t, s + t + g) for s, t, g in zip(starts, text, vision)])
    pack, meta, _ = build_packed_sequence("two_way", packed_sequence=torch.zeros(sum(sample_lens), 1),
                                          attn_modes=attn_modes, split_lens=split_lens, sample_lens=sample_lens,
                                          packed_und_token_indexes=und, packed_gen_token_indexes=gen,
                                          num_heads=HEADS, head_dim=DIM, num_layers=1)
    g = torch.Generator().manual_seed(0)
    packs, leaves = [], []
    for heads in (HEADS, KV_HEADS, KV_HEADS):
        u = torch.randn(sum(text), heads, DIM, generator=g).requires_grad_()
        x = torch.randn(sum(vision), heads, DIM, generator=g).requires_grad_()
        packs.append(from_und_gen_splits(u, x, pack))
        leaves += [u, x]
    out_pack, _ = dispatch_attention(*packs, meta)
    out = get_all_seq(out_pack).view(1, -1, HEADS, DIM)

    # reference over all tokens in pack order: each sample is [text | vision]
    q, k, v = (get_all_seq(p).unsqueeze(0) for p in packs)
    n = sum(sample_lens)
    sample = torch.repeat_interleave(torch.arange(len(sample_lens)), torch.tensor(sample_lens))
    is_text = torch.zeros(n, dtype=torch.bool)
    is_text[und] = True
    allowed = (sample[:, None] == sample[None, :]) & (~is_text[:, None] | (is_text[None, :] & (
        torch.arange(n)[None, :] <= torch.arange(n)[:, None])))
    rep = HEADS // KV_HEADS
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2), v.repeat_interleave(rep, 2).transpose(1, 2),
        attn_mask=allowed).transpose(1, 2)
    torch.testing.assert_close(out, ref, **TOL)
    grad = torch.randn(out.shape, generator=g)
    for a, b in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, leaves, grad)):
        torch.testing.assert_close(a, b, **TOL)
