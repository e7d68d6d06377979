"""Variable-length packed attention (``[onecard].attention = "varlen"``) against the dense-mask reference.

:mod:`cosmos_framework_ext.levers.attention_varlen` states the packed-attention rule (text: causal within its own
sample; vision: all text and vision tokens of its own sample) as sample boundaries (``cu_seqlens``) and one
gather that puts each sample's keys in one run. Proofs:

- **The layout, on the CPU** (the same per-run attention computed by ``scaled_dot_product_attention``'s math
  kernel): outputs and gradients (q, k, v) equal the dense ``PackedSegments`` path within 1e-6 relative in fp32,
  for packed micro-batches of 1, 2 and 8 samples (single text and vision tokens included), grouped-query heads and
  plain ones; the gather and boundaries by hand, bad segment indices refused; a training step of the tiny preset
  and a run of the embedded trainer (loss and weights after an optimizer step) the same as with ``dense``.
- **The GPU branch, on the CPU** (:class:`EmulatedFlashKernel`: the operator with FlashAttention-2's stated
  conventions): its arguments give the dense outputs and gradients; compiled, selectively checkpointed layers train
  as the uncompiled model, run the kernel once per call and do not recompile after the warm-up.
- **The kernel, on a GPU** (marked ``cuda``): FlashAttention-2's variable-length kernel in bf16 at the recipe's
  shapes (16 query heads over 8 key heads, head_dim 128), its outputs and gradients against a float64 reference: no
  further from it than the block-sparse kernel (the path it replaces) plus 1e-3, and within 2e-2; the tiny preset
  compiled and selectively checkpointed (the kernel's output kept) training as the eager model does, within bf16
  rounding.

Planted bug that must fail: the gather built with the next sample's text (a vision token sees the wrong text).
"""

from __future__ import annotations

import pytest
import torch

from cosmos_framework_ext.levers import attention_varlen as av
from cosmos_framework_ext.recipe import attention
from tests.equivalence import tiny_recipe as R
from tests.equivalence.test_attention_blocksparse import (PACKINGS, _rel, cuda, dense_outputs, random_inputs,
                                                          step_equals_dense, trainer_equals_dense)

TOL = 1e-6


def varlen_pair(packing, heads=4, kv_heads=2, dim=16, dtype=torch.float32, device="cpu", plant=None, seed=0,
                impls=("dense", "varlen")):
    """Dense and variable-length attention of random q/k/v for ``packing`` (the same values as
    ``attention_pair``'s): {name: (dense, varlen)} for the text output, the vision output and every input's
    gradient (``None`` for an implementation not in ``impls``). ``plant(segs)`` may corrupt the varlen segments."""
    und, gen, base, (w_und, w_gen) = random_inputs(packing, heads, kv_heads, dim, dtype, device, seed)
    segs = av.VarlenSegments(und, gen, device)
    if plant is not None:
        plant(segs)
    results = {}
    for impl in impls:
        x = {k: v.clone().requires_grad_(True) for k, v in base.items()}
        if impl == "dense":
            out_und, out_gen = dense_outputs(attention.PackedSegments(und.to(device), gen.to(device)), x)
        else:
            out_und = segs.attend_und(x["q_und"], x["k_und"], x["v_und"])
            out_gen = segs.attend_gen(x["q_gen"], x["k_all"], x["v_all"])
        results[impl] = {"out_und": out_und.detach(), "out_gen": out_gen.detach()}
        ((out_und.float() * w_und.float()).sum() + (out_gen.float() * w_gen.float()).sum()).backward()
        results[impl].update({f"grad_{k}": v.grad for k, v in x.items()})
    keys = next(iter(results.values())).keys()
    return {k: (results.get("dense", {}).get(k), results.get("varlen", {}).get(k)) for k in keys}


def varlen_matches_dense(tol: float = TOL, **kw) -> bool:
    return all(_rel(b.float(), a.float()) <= tol for a, b in varlen_pair(**kw).values())


@pytest.mark.parametrize("name", PACKINGS)
def test_outputs_and_gradients_equal_dense_fp32(name):
    pairs = varlen_pair(PACKINGS[name])
    errors = {k: _rel(b, a) for k, (a, b) in pairs.items()}
    assert len(errors) == 8 and max(errors.values()) <= TOL, errors


def test_grouped_query_heads_and_plain_heads():
    assert varlen_matches_dense(packing=PACKINGS["many"], heads=8, kv_heads=2)
    assert varlen_matches_dense(packing=PACKINGS["many"], heads=4, kv_heads=4)


def _ids(*lengths: int) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def test_boundaries_and_gather():
    """The boundaries are the cumulative lengths; the gather puts sample i's text, then its vision, in one run."""
    segs = av.VarlenSegments(_ids(2, 1, 3), _ids(4, 2, 1), "cpu")
    assert segs.cu_und.tolist() == [0, 2, 3, 6] and segs.cu_gen.tolist() == [0, 4, 6, 7]
    assert segs.cu_kv.tolist() == [0, 6, 9, 13] and segs.cu_und.dtype == torch.int32
    # [t0 t0 | t1 | t2 t2 t2] = 0..5, then vision [v0 x4 | v1 x2 | v2] = 6..12
    assert segs.kv_order.tolist() == [0, 1, 6, 7, 8, 9, 2, 10, 11, 3, 4, 5, 12]
    assert tuple(segs.longest.shape) == (3, 4, 6, 0)


@pytest.mark.parametrize("und, gen", [
    (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)),  # no token
    (_ids(1, 2), _ids(3)),  # sample 1 without vision
    (torch.tensor([0, 2, 2]), torch.tensor([0, 1, 2])),  # sample 1 without text
    (torch.tensor([1, 1]), torch.tensor([1])),  # no sample 0
    (torch.tensor([0, 1, 0]), torch.tensor([0, 1])),  # not in runs
], ids=["empty", "no-vision", "no-text", "not-from-0", "not-in-runs"])
def test_bad_segments_refused(und, gen):
    with pytest.raises(ValueError):
        av.VarlenSegments(und, gen, "cpu")


def test_runs_checked_against_the_longest_lengths():
    """The bounds the GPU kernel would get are checked by the CPU path: a run longer than them, or causal runs of
    other lengths, are refused (on the GPU a bound too small would skip query tiles)."""
    q, k = torch.randn(7, 2, 8), torch.randn(9, 1, 8)
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    assert av.varlen_attend(q, k, k, cu_q, cu_k, 4, 5, causal=False).shape == (7, 16)
    for max_q, max_k, causal in ((3, 5, False), (4, 4, False), (4, 5, True)):
        with pytest.raises(ValueError, match="run"):
            av.varlen_attend(q, k, k, cu_q, cu_k, max_q, max_k, causal=causal)


def _next_sample_text(segs: av.VarlenSegments) -> None:
    """Planted: each sample's keys start with the next sample's text (the gather off by one sample)."""
    t, v = segs.cu_und.diff().tolist(), segs.cu_gen.diff().tolist()
    order, starts = [], [0]
    for x in t:
        starts.append(starts[-1] + x)
    und_len, v0 = starts[-1], starts[-1]
    for i in range(len(t)):
        j = (i + 1) % len(t)
        order += list(range(starts[j], starts[j] + t[j]))[: t[i]] + [starts[j]] * max(0, t[i] - t[j])
        order += list(range(v0, v0 + v[i]))
        v0 += v[i]
    segs.kv_order = torch.tensor(order, dtype=torch.int64, device=segs.kv_order.device)


def test_planted_gather_with_the_next_sample_text_is_detected():
    assert varlen_matches_dense(packing=PACKINGS["many"])
    assert not varlen_matches_dense(packing=PACKINGS["many"], plant=_next_sample_text)
    assert not varlen_matches_dense(packing=PACKINGS["two"], plant=_next_sample_text)


@pytest.mark.parametrize("impl, device, dtype, refused", [
    ("varlen", "cuda", torch.float32, True), ("varlen", "cuda", torch.bfloat16, False),
    ("varlen", "cuda", torch.float16, False), ("varlen", "cpu", torch.float32, False),
    ("flex", "cuda", torch.float32, False), ("dense", "cuda", torch.float32, False)])
def test_fp32_on_the_gpu_refused(impl, device, dtype, refused):
    """The GPU kernel has no fp32 form: a GPU run computing in fp32 is refused (the message names the fix); the
    CPU's per-run math runs any dtype."""
    if refused:
        with pytest.raises(ValueError, match='precision = "bfloat16"'):
            av.check_varlen(impl, device, dtype)
    else:
        av.check_varlen(impl, device, dtype)


@pytest.mark.parametrize("precision, device, refused", [("float32", "cuda", True), ("bfloat16", "cuda", False),
                                                      ("float32", "cpu", False)])
def test_the_ledger_refuses_what_the_trainer_refuses(precision, device, refused):
    """The memory ledger (``python -m patches.ledger``, the launcher's ``DRYRUN``) runs the same check, so a recipe the
    GPU trainer refuses is not reported as fitting."""
    from cosmos_framework_ext.recipe import config as cfgmod
    from cosmos_framework_ext.recipe.ledger import cosmos_ledger

    cfg = cfgmod.from_dict({"model": {"precision": precision}, "onecard": {"attention": "varlen"}})
    if refused:
        with pytest.raises(ValueError, match='attention = "varlen".*no float32 form'):
            cosmos_ledger(cfg, "tiny", {}, device_type=device)
    else:
        assert cosmos_ledger(cfg, "tiny", {}, device_type=device).gpu_allocated > 0


def test_the_trainer_refuses_varlen_in_fp32_on_a_gpu(tmp_path, monkeypatch, sample_dataset, capsys):
    """One ``error:`` line, exit status 2, before the dataset and the model (a GPU run that computes in fp32)."""
    from cosmos_framework_ext.recipe import train
    from tests.test_train import small_toml

    monkeypatch.setenv("DATASET_PATH", str(sample_dataset))
    monkeypatch.setenv("OUTPUT_ROOT", str(tmp_path / "out"))
    monkeypatch.setattr(train, "pick_device", lambda local_rank: torch.device("cuda"))
    toml = small_toml(tmp_path, **{'precision                    = "bfloat16"': 'precision                    = "float32"'})
    assert train.main(["--sft-toml", str(toml), "--max-iter", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and 'attention = "varlen"' in err[0], err
    assert not (tmp_path / "out").exists()


def test_the_flash_kernel_is_a_kept_attention_op():
    """Selective checkpointing keeps the variable-length kernel's output as it keeps the other attention ops'
    (the policy sees ``aten._flash_attention_forward``), and the ledger counts it when the recipe's regexes match."""
    from torch.utils.checkpoint import CheckpointPolicy

    from cosmos_framework_ext.levers.selective_ac import ATTENTION_OPS, save_policy
    from cosmos_framework_ext.recipe.ledger import ATTENTION_OP_NAMES

    op = torch.ops.aten._flash_attention_forward.default
    assert save_policy(ATTENTION_OPS)(None, op) == CheckpointPolicy.MUST_SAVE
    assert save_policy(["fmha"])(None, op) == CheckpointPolicy.PREFER_RECOMPUTE
    assert ATTENTION_OP_NAMES["varlen"] == str(op)


@pytest.mark.parametrize("attention, regex, kept", [("varlen", ["flash_attention"], True),
                                                    ("varlen", ["flex_attention"], False),
                                                    ("flex", ["flash_attention"], False),
                                                    ("flex", ["flex_attention"], True),
                                                    ("dense", ["scaled_dot_product"], True)])
def test_the_ledger_counts_the_kept_outputs_of_the_runs_own_op(attention, regex, kept):
    """The ledger's "kept attention outputs" line follows the attention op the run calls: a regex that names another
    path's op keeps nothing."""
    from cosmos_framework_ext.recipe import config as cfgmod
    from cosmos_framework_ext.recipe.ledger import cosmos_ledger

    cfg = cfgmod.from_dict({"model": {"activation_checkpointing": {"mode": "selective", "save_ops_regex": regex}},
                            "onecard": {"attention": attention}})
    names = [i.name for i in cosmos_ledger(cfg, "tiny", {}).items]
    assert ("kept attention outputs (selective AC)" in names) == kept, names


# ---------------------------------------------------------------------- a training step, the trainer
def test_training_step_varlen_equals_dense():
    step_equals_dense("varlen")


def test_embedded_trainer_varlen_equals_dense(tmp_path, monkeypatch, sample_dataset, capsys):
    """The embedded trainer, one optimizer step: the same loss and weights as with ``dense``."""
    trainer_equals_dense("varlen", tmp_path, monkeypatch, sample_dataset, capsys)


# --------------------------------------------------------- the GPU branch on the CPU, against an emulated kernel
class EmulatedFlashKernel:
    """CPU implementations of ``aten._flash_attention_forward`` / ``_backward`` (variable-length form) with
    FlashAttention-2's conventions as its documentation states them: query head ``h`` reads key head
    ``h // (H / Hkv)``, scale ``1 / sqrt(D)``, causal bottom-right aligned, the log-sum-exp ``[H, total_q]`` fp32, and
    only the first ``max_q`` queries / ``max_k`` keys of a run computed (here: a run longer than them raises, as
    the tiles it would skip are a wrong result). It lets the CPU run the GPU branch (:func:`kernel_attend`) inside
    compiled layers; it says nothing about the real kernel's numerics (the ``cuda`` tests do)."""

    def __init__(self):
        self.calls = 0
        self.lib = torch.library.Library("aten", "IMPL")
        self.lib.impl("_flash_attention_forward", self.forward, "CPU")
        self.lib.impl("_flash_attention_backward", self.backward, "CPU")

    @staticmethod
    def _run(q, k, v, cu_q, cu_k, max_q, max_k, causal, i):
        """Run ``i``: (its bounds, per-head fp32 q, k, v with the key heads repeated, the softmax P)."""
        rep = q.shape[1] // k.shape[1]
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        assert b - a <= max_q and d - c <= max_k, f"run {i} ({b - a}, {d - c}) past the kernel's bounds"
        qs = q[a:b].transpose(0, 1).float()
        ks = k[c:d].transpose(0, 1).float().repeat_interleave(rep, 0)
        vs = v[c:d].transpose(0, 1).float().repeat_interleave(rep, 0)
        scores = qs @ ks.transpose(1, 2) / q.shape[-1] ** 0.5
        if causal:  # bottom-right: query j of m sees keys up to j + (n - m)
            m, n = b - a, d - c
            scores = scores.masked_fill(torch.ones(m, n, dtype=torch.bool).triu(n - m + 1), float("-inf"))
        return (a, b, c, d), qs, ks, vs, scores

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
                window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None, block_table=None,
                num_splits=None):
        self.calls += 1
        out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0])
        for i in range(cu_q.numel() - 1):
            (a, b, _, _), _, _, vs, scores = self._run(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, i)
            out[a:b] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
            lse[:, a:b] = torch.logsumexp(scores, -1)
        return out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(0, dtype=torch.uint64), torch.empty(0)

    def backward(self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state,
                 unused, *, scale=None, window_size_left=None, window_size_right=None):
        """The attention backward by hand (inside a kernel autograd does not record): dV = P^T dO, dS = P (dO V^T -
        rowsum(dO O)), dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D); repeated key heads summed back."""
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        rep, root = q.shape[1] // k.shape[1], q.shape[-1] ** 0.5
        for i in range(cu_q.numel() - 1):
            (a, b, c, d), qs, ks, vs, scores = self._run(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, i)
            p = scores.softmax(-1)
            go, o = grad_out[a:b].transpose(0, 1).float(), out[a:b].transpose(0, 1).float()
            ds = p * (go @ vs.transpose(1, 2) - (go * o).sum(-1, keepdim=True))
            dq[a:b] = (ds @ ks / root).transpose(0, 1).to(q.dtype)
            fold = lambda t: t.unflatten(0, (k.shape[1], rep)).sum(1).transpose(0, 1)  # noqa: E731
            dk[c:d] = fold(ds.transpose(1, 2) @ qs / root).to(k.dtype)
            dv[c:d] = fold(p.transpose(1, 2) @ go).to(v.dtype)
        return dq, dk, dv


@pytest.fixture()
def kernel_on_the_cpu(monkeypatch):
    """The GPU branch (:func:`kernel_attend`) on the CPU, against :class:`EmulatedFlashKernel`."""
    emulated = EmulatedFlashKernel()
    monkeypatch.setattr(av, "varlen_attend", lambda q, k, v, cu_q, cu_k, max_q, max_k, causal:
                        av.kernel_attend(q, k, v, cu_q, cu_k, max_q, max_k, causal))
    yield emulated
    emulated.lib._destroy()


@pytest.mark.parametrize("name", PACKINGS)
def test_the_kernel_branch_matches_dense(name, kernel_on_the_cpu):
    """The GPU branch's arguments (boundaries, bounds from the empty tensor's sizes, causal flags, the gather) give
    the dense masks' outputs and gradients under the emulated kernel, grouped-query heads and plain ones."""
    for heads, kv_heads in ((4, 2), (8, 2), (4, 4)):
        pairs = varlen_pair(PACKINGS[name], heads=heads, kv_heads=kv_heads)
        errors = {k: _rel(b, a) for k, (a, b) in pairs.items()}
        assert max(errors.values()) <= TOL, (heads, kv_heads, errors)
    assert kernel_on_the_cpu.calls > 0


def test_compiled_layers_keep_the_kernel_output_and_do_not_recompile(kernel_on_the_cpu):
    """The tiny preset's layers compiled as the recipe compiles them (``compile_dynamic = true``; Dynamo with the
    eager backend here) and selectively checkpointed with the kernel's op kept: the same losses and gradients as the
    uncompiled model, the kernel run once per attention call (not again in the backward), and new micro-batch
    lengths compile nothing after the warm-up."""
    from cosmos_framework_ext.levers.compile_blocks import compile_blocks
    from cosmos_framework_ext.levers.selective_ac import ATTENTION_OPS, apply_selective_checkpointing
    from tests.equivalence.test_compile_blocks import SAMPLES, compile_count, lengths_do_not_recompile

    torch._dynamo.reset()
    model, _ = R.make_model()
    eager, _ = R.make_model()
    apply_selective_checkpointing(model, list(ATTENTION_OPS))
    compile_blocks(model, dynamic=True, backend="eager")
    counts = []
    for n in SAMPLES:
        before, calls = compile_count(), kernel_on_the_cpu.calls
        loss, grads = R.packed_step(model, R.micro_batch(n, 0, n_samples=n), "varlen")
        counts.append(compile_count() - before)
        assert kernel_on_the_cpu.calls - calls == 2 * len(model.layers)  # text and vision calls, forward only
        loss_e, grads_e = R.packed_step(eager, R.micro_batch(n, 0, n_samples=n), "varlen")
        assert _rel(loss, loss_e) <= TOL and max(_rel(g, ge) for g, ge in zip(grads, grads_e)) <= 1e-5
    assert counts[0] > 0 and lengths_do_not_recompile(counts), counts


# ------------------------------------------------------------------------------- GPU (``cuda``: skipped without one)
@cuda
@pytest.mark.parametrize("name", ["many", "recipe"])
def test_cuda_bf16_kernel_no_further_from_the_reference_than_flex(name):
    """bf16 on the GPU at the recipe's head shapes: each output's and gradient's relative error against a float64
    reference (the per-run math on the CPU, equal to the dense masks above) is <= 2e-2 and <= the block-sparse
    kernel's (128-token tiles, the path it replaces) + 1e-3."""
    from tests.equivalence.test_attention_blocksparse import attention_pair

    packing = PACKINGS["many"] if name == "many" else [(40, 330)] * 33  # ~12 k tokens, as the recipe's cap
    kw = dict(packing=packing, heads=16, kv_heads=8, dim=128)
    ref = varlen_pair(dtype=torch.float64, device="cpu", impls=("varlen",), **kw)
    low = varlen_pair(dtype=torch.bfloat16, device="cuda", impls=("varlen",), **kw)
    flex = attention_pair(dtype=torch.bfloat16, device="cuda", block=128, **kw)
    worst = {}
    for key, (_, want) in ref.items():
        err_v = _rel(low[key][1].double().cpu(), want)
        err_f = _rel(flex[key][1].double().cpu(), want)
        worst[key] = (err_v, err_f)
        assert err_v <= 2e-2 and err_v <= err_f + 1e-3, (key, err_v, err_f)
    print(f"varlen bf16 {name}: " + ", ".join(f"{k} {v:.2e} (flex {f:.2e})" for k, (v, f) in worst.items()))


@cuda
def test_cuda_planted_gather_is_detected():
    kw = dict(packing=PACKINGS["many"], heads=16, kv_heads=8, dim=128, device="cuda", dtype=torch.bfloat16)
    assert varlen_matches_dense(tol=2e-2, **kw)
    assert not varlen_matches_dense(tol=2e-2, plant=_next_sample_text, **kw)


def _bf16_step(model, samples):
    """One packed micro-batch (varlen attention) forward and backward in the model's dtype on its device."""
    from cosmos_framework_ext.recipe.loss import flow_matching_inputs, micro_batch_loss

    ref = model.proj_in.weight
    xt, targets = [], []
    for _, x0, sigma, noise in samples:
        a, v = flow_matching_inputs(x0.to(ref.device), noise.to(ref.device), sigma)
        xt.append(a.to(ref.dtype))
        targets.append(v)
    kwargs, segs = attention.build_packed_inputs(model.config, [s[0] for s in samples], xt,
                                                 torch.tensor([s[2] for s in samples]), [24.0] * len(samples),
                                                 ref.device, impl="varlen")
    model.layers[0].self_attn.processor.segments = segs
    model.zero_grad(set_to_none=True)
    loss = micro_batch_loss(model(**kwargs).sample, targets, 10.0, 1)
    loss.backward()
    return loss.detach().float(), [p.grad.float() for p in model.parameters() if p.requires_grad]


@cuda
def test_cuda_compiled_selective_layers_train_the_same():
    """The tiny preset in bf16 on the GPU, its layers compiled (inductor, dynamic lengths) and selectively
    checkpointed with the kernel's op among the kept ones, over three micro-batches of other lengths: loss and
    gradients within bf16 rounding of the same steps eager without checkpointing (that the op is kept is
    :func:`test_the_flash_kernel_is_a_kept_attention_op`'s)."""
    from cosmos_framework_ext.levers.compile_blocks import compile_blocks
    from cosmos_framework_ext.levers.selective_ac import ATTENTION_OPS, apply_selective_checkpointing

    torch._dynamo.reset()
    eager, _ = R.make_model(device="cuda", dtype=torch.bfloat16)
    fast, _ = R.make_model(device="cuda", dtype=torch.bfloat16)
    apply_selective_checkpointing(fast, list(ATTENTION_OPS))
    compile_blocks(fast)
    for n in (3, 5, 4):
        la, ga = _bf16_step(eager, R.micro_batch(3, n, n_samples=n))
        lb, gb = _bf16_step(fast, R.micro_batch(3, n, n_samples=n))
        worst = max(_rel(b, a) for a, b in zip(ga, gb))
        print(f"varlen compiled selective bf16 n={n}: loss {la.item():.5f} {lb.item():.5f} worst rel {worst:.2e}")
        assert _rel(lb, la) <= 1e-2 and worst <= 5e-2
