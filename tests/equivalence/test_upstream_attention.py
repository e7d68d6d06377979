"""``COSMOS_ATTN_BACKEND=torch``: the torch attention backend equals a dense masked reference.

The reference is written from upstream's semantics (``cosmos_framework.model.attention.frontend.attention``
and ``CausalType``), not from the backend: the packed sequences are laid in one ``[1, T, H, D]`` tensor,
one boolean mask over the whole pack is built token by token (a query sees a key only inside its own
sequence; when causal, only keys at or before its position, aligned top-left or bottom-right), KV heads are
repeated to the query heads (query head ``h`` reads KV head ``h // (H / H_kv)``), and one
``scaled_dot_product_attention`` runs over the pack. The backend instead runs per sequence (``sdpa``,
``math``) or torch's ``varlen_attn`` (CUDA); the two must agree in outputs and in the gradients of query,
key and value.

Shapes: the Edge recipe's 16 query / 8 KV heads, packed text lengths (150, 17, 1, 256, 130) (the
(300, 17, 1, 512, 260) of the issue halved for speed; a length-1 sequence kept), head dim 32.

Tolerance (fp32, CPU): rtol = atol = 1e-5 on outputs and gradients; measured max abs error 0 to 3.4e-6
(printed with ``-s``). bf16 on CUDA (``varlen_attn``, H200, torch 2.11): rtol = atol = 2e-2 against the fp32
reference on the same bf16-rounded inputs; measured max abs error 4e-3 to 8e-3 on outputs and 8e-3 to
3.4e-2 on gradients (at most 5.3e-3 of the largest reference value), the same as stock bf16
``scaled_dot_product_attention`` run per sequence on those inputs, i.e. bf16 rounding, not the kernel.

Planted bugs that make the comparison fail: cumulative offsets off by one at one boundary (the first token
of a sequence counted into the one before it), two neighbouring sequences merged (a block-diagonal leak),
a causal mask that lets each token see the next one.
"""

from __future__ import annotations

import enum

import pytest
import torch
import torch.nn.functional as F

from cosmos_framework_ext.upstream import attention as ua

CausalType = enum.Enum("CausalType", ["TopLeft", "BottomRight", "DontCare"])
"""Stands in for upstream's ``cosmos_framework.model.attention.masks.CausalType`` (matched by name)."""

HEADS, KV_HEADS, DIM = 16, 8, 32
TEXT = (150, 17, 1, 256, 130)
VISION = (48, 24, 8, 64, 40)
TOL = dict(rtol=1e-5, atol=1e-5)


def _cu(lengths, device="cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def reference(q, k, v, cu_q, cu_k, kind, scale=None, with_lse=False):
    """Dense masked SDPA over the whole pack. q [1,Tq,H,D], k/v [1,Tk,Hkv,D]; kind None or a CausalType name.

    Tokens outside every sequence (trailing padding) see nothing and give zero rows.
    """
    total_q, total_k = q.shape[1], k.shape[1]
    seq_q = torch.full((total_q,), -1)
    seq_k = torch.full((total_k,), -2)
    pos_q = torch.zeros(total_q, dtype=torch.long)
    pos_k = torch.zeros(total_k, dtype=torch.long)
    shift = torch.zeros(total_q, dtype=torch.long)  # where the causal diagonal sits for each query row
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        seq_q[cq[i]:cq[i + 1]] = i
        seq_k[ck[i]:ck[i + 1]] = i
        pos_q[cq[i]:cq[i + 1]] = torch.arange(cq[i + 1] - cq[i])
        pos_k[ck[i]:ck[i + 1]] = torch.arange(ck[i + 1] - ck[i])
        if kind in ("BottomRight", "DontCare"):
            shift[cq[i]:cq[i + 1]] = (ck[i + 1] - ck[i]) - (cq[i + 1] - cq[i])
    allowed = seq_q[:, None] == seq_k[None, :]
    if kind is not None:
        allowed &= pos_k[None, :] <= pos_q[:, None] + shift[:, None]
    allowed = allowed.to(q.device)
    rep = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                         attn_mask=allowed, scale=scale).transpose(1, 2)
    if not with_lse:
        return out
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk.float()) * (scale or q.shape[-1] ** -0.5)
    lse = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), dim=-1).transpose(1, 2)  # [1,Tq,H]
    return out, lse


def _inputs(total_q, total_k, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, total_q, HEADS, DIM, generator=g).to(device, dtype).requires_grad_()
    k = torch.randn(1, total_k, KV_HEADS, DIM, generator=g).to(device, dtype).requires_grad_()
    v = torch.randn(1, total_k, KV_HEADS, DIM, generator=g).to(device, dtype).requires_grad_()
    return q, k, v


def _run(fn, q, k, v, seed=1):
    """Output and (dq, dk, dv) for a fixed random output gradient."""
    out = fn(q, k, v)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return out.detach(), dq, dk, dv


def compare(backend_kwargs, ref_cu, kind, total_q, total_k, scale=None, report=""):
    """Backend (called with ``backend_kwargs``) vs the reference (with the true offsets ``ref_cu``)."""
    q, k, v = _inputs(total_q, total_k)
    got = _run(lambda q, k, v: ua.torch_attention(q, k, v, scale=scale, **backend_kwargs), q, k, v)
    want = _run(lambda q, k, v: reference(q, k, v, *ref_cu, kind, scale=scale), q, k, v)
    worst = max((a - b).abs().max().item() for a, b in zip(got, want))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    print(f"{report}: max abs error {worst:.2e} (out, dq, dk, dv)")
    return worst


def _text_call(cu):
    """The recipe's causal text call: DontCare, query and key offsets the same tensor."""
    return dict(is_causal=True, causal_type=CausalType.DontCare, cumulative_seqlen_Q=cu, cumulative_seqlen_KV=cu,
                max_seqlen_Q=max(TEXT), max_seqlen_KV=max(TEXT))


# ------------------------------------------------------------------------------------------ the recipe's calls
def test_packed_causal_text_call_matches_reference():
    cu = _cu(TEXT)
    assert ua.kernel_for(*_inputs(4, 4)[:3]) == "sdpa"  # the CPU path under test
    compare(_text_call(cu), (cu, cu), "DontCare", sum(TEXT), sum(TEXT), report="causal text (DontCare)")


def test_packed_full_vision_call_matches_reference():
    """Vision queries against all tokens of their own sample: query offsets differ from key offsets."""
    cu_q, cu_k = _cu(VISION), _cu([t + g for t, g in zip(TEXT, VISION)])
    kw = dict(cumulative_seqlen_Q=cu_q, cumulative_seqlen_KV=cu_k, max_seqlen_Q=max(VISION),
              max_seqlen_KV=max(t + g for t, g in zip(TEXT, VISION)))
    compare(kw, (cu_q, cu_k), None, sum(VISION), int(cu_k[-1]), report="full vision -> all")


def test_explicit_scale_and_causal_alignments():
    cu = _cu(TEXT)
    compare(_text_call(cu), (cu, cu), "DontCare", sum(TEXT), sum(TEXT), scale=0.05, report="scale 0.05")
    # unequal query/key lengths per sequence, both shorter and longer queries, both alignments
    lq, lk = (20, 33, 1, 9), (25, 12, 4, 9)
    cu_q, cu_k = _cu(lq), _cu(lk)
    for kind in ("TopLeft", "BottomRight"):
        kw = dict(is_causal=True, causal_type=CausalType[kind], cumulative_seqlen_Q=cu_q, cumulative_seqlen_KV=cu_k,
                  max_seqlen_Q=max(lq), max_seqlen_KV=max(lk))
        compare(kw, (cu_q, cu_k), kind, sum(lq), sum(lk), report=f"causal {kind}, unequal lengths")


def test_dense_calls_match_reference():
    """Inference with one sample: the same two calls without offsets (batch 1), and batch 2."""
    n = 97
    compare(dict(is_causal=True, causal_type=CausalType.DontCare), (_cu([n]), _cu([n])), "DontCare", n, n,
            report="dense causal")
    compare({}, (_cu([40]), _cu([n])), None, 40, n, report="dense full")
    q, k, v = _inputs(2 * n, 2 * n)
    q2, k2, v2 = (t.detach().reshape(2, n, *t.shape[2:]) for t in (q, k, v))
    got = ua.torch_attention(q2, k2, v2, is_causal=True, causal_type=CausalType.TopLeft)
    want = reference(q.detach(), k.detach(), v.detach(), _cu([n, n]), _cu([n, n]), "TopLeft")
    torch.testing.assert_close(got.reshape(1, 2 * n, HEADS, DIM), want, **TOL)


def test_lse_and_its_gradient_match_reference():
    """return_lse (upstream's three-way path merges by LSE): values and gradients through out and lse."""
    cu = _cu(TEXT[:3])
    q, k, v = _inputs(int(cu[-1]), int(cu[-1]))
    kw = dict(_text_call(cu), max_seqlen_Q=max(TEXT[:3]), max_seqlen_KV=max(TEXT[:3]), return_lse=True)
    assert ua.kernel_for(q, k, v, **{k_: kw[k_] for k_ in ("is_causal", "causal_type", "return_lse")}) == "math"
    out, lse = ua.torch_attention(q, k, v, **kw)
    ref_out, ref_lse = reference(q, k, v, cu, cu, "DontCare", with_lse=True)
    assert lse.shape == (1, int(cu[-1]), HEADS) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    g = torch.autograd.grad((out.sum() + lse.sin().sum()), (q, k, v))
    r = torch.autograd.grad((ref_out.sum() + ref_lse.sin().sum()), (q, k, v))
    for a, b in zip(g, r):
        torch.testing.assert_close(a, b, **TOL)


def test_trailing_padding_rows_are_zero_with_zero_gradient():
    cu = _cu(TEXT[:2])
    total = int(cu[-1]) + 7  # padding rows after the last sequence, in queries and keys
    q, k, v = _inputs(total, total)
    out = ua.torch_attention(q, k, v, **dict(_text_call(cu), max_seqlen_Q=150, max_seqlen_KV=150))
    assert torch.count_nonzero(out[0, int(cu[-1]):]) == 0
    torch.testing.assert_close(out, reference(q, k, v, cu, cu, "DontCare"), **TOL)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    for grad in (dq, dk, dv):
        assert torch.count_nonzero(grad[0, int(cu[-1]):]) == 0


def _lse_by_hand(q, k, cu_q, cu_k, scale):
    """Log-sum-exp per (query row, head) written out row by row in float64: ``log(sum_j exp(scale * q.k_j))`` over
    the keys ``j`` a bottom-right causal row of its own sequence sees (``j <= i + (len_k - len_q)``), KV head
    ``h // (H / H_kv)``; ``-inf`` for a row that sees no key and for a row outside every sequence."""
    import math

    total_q, heads = q.shape[1], q.shape[2]
    rep = heads // k.shape[2]
    want = torch.full((1, total_q, heads), float("-inf"), dtype=torch.float64)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    qs, ks = q[0].tolist(), k[0].tolist()  # [T, H, D] as Python floats
    for s in range(len(cq) - 1):
        lq, lk = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
        for i in range(lq):
            keys = [j for j in range(lk) if j <= i + (lk - lq)]
            for h in range(heads):
                if keys:
                    dots = [scale * sum(a * b for a, b in zip(qs[cq[s] + i][h], ks[ck[s] + j][h // rep]))
                            for j in keys]
                    top = max(dots)
                    want[0, cq[s] + i, h] = top + math.log(sum(math.exp(d - top) for d in dots))
    return want


def test_lse_is_minus_inf_for_blind_rows_and_padding():
    """return_lse with a row that sees no key: bottom-right causal with more queries than keys (the first
    ``len_q - len_k`` rows of that sequence see nothing) and trailing padding rows after the last sequence.
    Expected, from the documented contract (upstream's backends): LSE ``-inf`` and output 0 on exactly those rows,
    the hand-computed float64 log-sum-exp of :func:`_lse_by_hand` on every other row, finite gradients."""
    lq, lk = (5, 3), (2, 3)
    cu_q, cu_k = _cu(lq), _cu(lk)
    pad = 3
    q, k, v = _inputs(sum(lq) + pad, sum(lk) + 2)
    kw = dict(is_causal=True, causal_type=CausalType.BottomRight, cumulative_seqlen_Q=cu_q, cumulative_seqlen_KV=cu_k,
              max_seqlen_Q=max(lq), max_seqlen_KV=max(lk), return_lse=True)
    out, lse = ua.torch_attention(q, k, v, **kw)
    want = _lse_by_hand(q.detach(), k.detach(), cu_q, cu_k, DIM ** -0.5)
    blind = [0, 1, 2, 8, 9, 10]  # rows 0..2 of sequence 0 (5 queries, 2 keys) and the 3 padding rows
    assert lse.shape == (1, sum(lq) + pad, HEADS) and lse.dtype == torch.float32
    assert torch.isneginf(want[0, blind]).all() and torch.isfinite(want[0, [3, 4, 5, 6, 7]]).all()
    assert torch.isneginf(lse[0, blind]).all(), lse[0, blind]
    torch.testing.assert_close(lse.double()[0, [3, 4, 5, 6, 7]], want[0, [3, 4, 5, 6, 7]], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(out[0, blind]) == 0
    seen = torch.isfinite(lse)
    grads = torch.autograd.grad(out.sum() + lse[seen].sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():  # the same call without gradients (another kernel choice) gives the same rows
        _, lse_ng = ua.torch_attention(q, k, v, **kw)
    assert torch.isneginf(lse_ng[0, blind]).all()
    torch.testing.assert_close(lse_ng, lse, rtol=0, atol=0)


def test_deterministic_uses_math_and_matches():
    cu = _cu(TEXT[:3])
    kw = dict(_text_call(cu), max_seqlen_Q=150, max_seqlen_KV=150, deterministic=True)
    compare(kw, (cu, cu), "DontCare", int(cu[-1]), int(cu[-1]), report="deterministic (math)")


# ------------------------------------------------------------------------------------------ refusals
def test_unsupported_arguments_are_refused_by_name():
    q, k, v = (t.detach() for t in _inputs(8, 8))
    with pytest.raises(ValueError, match="backend_kwargs"):
        ua.torch_attention(q, k, v, backend_kwargs={"window_size": (4, 4)})
    with pytest.raises(ValueError, match="causal_type"):
        ua.torch_attention(q, k, v, is_causal=True)
    with pytest.raises(ValueError, match="heads"):
        ua.torch_attention(q, k[:, :, :3], v[:, :, :3])


# ------------------------------------------------------------------------------------------ planted bugs
def test_planted_off_by_one_offset_is_caught():
    """One boundary moved by one token: the first token of sequence 5 is counted into sequence 4."""
    cu = _cu(TEXT)
    bad = cu.clone()
    bad[4] += 1
    for kw, kind in ((_text_call(bad), "DontCare"),
                     (dict(cumulative_seqlen_Q=bad, cumulative_seqlen_KV=bad, max_seqlen_Q=257, max_seqlen_KV=257), None)):
        with pytest.raises(AssertionError):
            compare(kw, (cu, cu), kind, sum(TEXT), sum(TEXT))


def test_planted_block_diagonal_leak_is_caught(monkeypatch):
    """Two neighbouring sequences merged into one: their tokens see each other."""
    real = ua._segments

    def leaky(cu_q, cu_k):
        s = real(cu_q, cu_k)
        return [(s[0][0], s[1][1], s[0][2], s[1][3]), *s[2:]]

    monkeypatch.setattr(ua, "_segments", leaky)
    cu = _cu(TEXT)
    with pytest.raises(AssertionError):
        compare(dict(cumulative_seqlen_Q=cu, cumulative_seqlen_KV=cu, max_seqlen_Q=256, max_seqlen_KV=256),
                (cu, cu), None, sum(TEXT), sum(TEXT))


def test_planted_causal_leak_is_caught(monkeypatch):
    """Each token also sees the next one."""
    real = ua._offset
    monkeypatch.setattr(ua, "_offset", lambda kind, lq, lk: None if kind is None else real(kind, lq, lk) + 1)
    cu = _cu(TEXT)
    with pytest.raises(AssertionError):
        compare(_text_call(cu), (cu, cu), "DontCare", sum(TEXT), sum(TEXT))


# ------------------------------------------------------------------------------------------ CUDA: varlen_attn
BF16_TOL = dict(rtol=2e-2, atol=2e-2)
"""bf16 varlen_attn vs the fp32 reference on the same (bf16-rounded) inputs (``|a - b| <= atol + rtol |b|``)."""

cuda = pytest.mark.skipif(not torch.cuda.is_available() or ua.VARLEN is None,
                          reason="needs CUDA and torch.nn.attention.varlen (torch >= 2.10)")


def _bf16_case(kw, ref_cu, kind, total_q, total_k, with_lse=False):
    q, k, v = _inputs(total_q, total_k, dtype=torch.bfloat16, device="cuda")
    assert ua.kernel_for(q, k, v, **{n: kw[n] for n in ("is_causal", "causal_type") if n in kw}) == "varlen"
    got = _run(lambda q, k, v: ua.torch_attention(q, k, v, **kw), q, k, v)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = _run(lambda q, k, v: reference(q, k, v, *ref_cu, kind), q32, k32, v32)
    errs = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        errs[name] = (a.float() - b).abs().max().item()
        torch.testing.assert_close(a.float(), b, **BF16_TOL, msg=lambda m, name=name: f"{name}: {m}")
    print("bf16 varlen max abs error: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    return errs


@cuda
def test_cuda_varlen_bf16_matches_fp32_reference():
    cu = _cu(TEXT, "cuda")
    _bf16_case(_text_call(cu), (cu.cpu(), cu.cpu()), "DontCare", sum(TEXT), sum(TEXT))
    cu_q, cu_k = _cu(VISION, "cuda"), _cu([t + g for t, g in zip(TEXT, VISION)], "cuda")
    kw = dict(cumulative_seqlen_Q=cu_q, cumulative_seqlen_KV=cu_k, max_seqlen_Q=max(VISION),
              max_seqlen_KV=max(t + g for t, g in zip(TEXT, VISION)))
    _bf16_case(kw, (cu_q.cpu(), cu_k.cpu()), None, sum(VISION), int(cu_k[-1]))
    # dense (one-sample inference) and TopLeft with equal offsets also take varlen_attn
    _bf16_case(dict(is_causal=True, causal_type=CausalType.DontCare), (_cu([97]), _cu([97])), "DontCare", 97, 97)
    cu2 = _cu(TEXT[:3], "cuda")
    _bf16_case(dict(is_causal=True, causal_type=CausalType.TopLeft, cumulative_seqlen_Q=cu2,
                    cumulative_seqlen_KV=cu2.clone(), max_seqlen_Q=150, max_seqlen_KV=150),
               (cu2.cpu(), cu2.cpu()), "TopLeft", int(cu2[-1]), int(cu2[-1]))


@cuda
def test_cuda_varlen_lse_padding_and_gradients_of_skipped_rows():
    cu = _cu(TEXT[:3], "cuda")
    total = int(cu[-1]) + 9
    q, k, v = _inputs(total, total, dtype=torch.bfloat16, device="cuda")
    kw = dict(_text_call(cu), max_seqlen_Q=150, max_seqlen_KV=150)
    with torch.no_grad():
        out, lse = ua.torch_attention(q, k, v, **kw, return_lse=True)
    ref_out, ref_lse = reference(*(t.detach().float() for t in (q, k, v)), cu.cpu(), cu.cpu(), "DontCare", with_lse=True)
    torch.testing.assert_close(out.float()[:, :int(cu[-1])], ref_out[:, :int(cu[-1])], **BF16_TOL)
    torch.testing.assert_close(lse[:, :int(cu[-1])], ref_lse[:, :int(cu[-1])], **BF16_TOL)
    assert torch.count_nonzero(out[0, int(cu[-1]):]) == 0
    out = ua.torch_attention(q, k, v, **kw)
    for grad in torch.autograd.grad(out.float().sum(), (q, k, v)):
        assert torch.isfinite(grad).all() and torch.count_nonzero(grad[0, int(cu[-1]):]) == 0


@cuda
def test_cuda_varlen_compiles_in_one_graph():
    cu = _cu(TEXT, "cuda")
    q, k, v = _inputs(sum(TEXT), sum(TEXT), dtype=torch.bfloat16, device="cuda")
    fn = torch.compile(lambda q, k, v: ua.torch_attention(q, k, v, **_text_call(cu)), fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), ua.torch_attention(q, k, v, **_text_call(cu)), rtol=0, atol=0)
