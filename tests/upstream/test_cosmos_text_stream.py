"""``COSMOS_DETACH_TEXT_STREAM`` in upstream's own decoder stack (CPU, fp32): the same loss and gradients, bitwise.

Upstream's ``Nemotron3DenseVLTextForCausalLM`` (Cosmos3-Edge's text model class, two layers of a few dozen
channels) runs upstream's ``_impl_forward`` on a pack built by upstream's ``build_packed_sequence`` (``two_way``,
the Edge recipe's layout), the way upstream's network feeds it: the frozen ``embed_tokens`` output scattered into
a zero buffer, a trainable ``vae2llm`` stand-in's output written into the same buffer in place. Trainable: the
recipe's ``keys_to_select`` (substring match, as upstream's optimizer builder clears ``requires_grad``) and the
stand-in. The loss is a regression of the vision outputs plus a term on the text outputs (upstream's text
cross-entropy reads them), so a gradient that reached a trainable weight through the text stream would show.

- with the patch, the loss and every trainable gradient ``torch.equal`` upstream's stock run (the reference), with
  and without activation checkpointing (each layer in torch's ``checkpoint_wrapper``, as upstream's parallelize
  pass wraps them) and with the stream padded as for CUDA graphs (``pad_for_cuda_graphs``);
- the stock text stream runs a backward, the patched one none: the backward runs exactly six matmuls per layer
  fewer (the text stream's input gradients of q, k, v, o, up and down; 37 against 25 without checkpointing, 59
  against 47 with it), the text outputs no longer require a gradient; the caller's pack is left as it came;
- a trainable ``embed_tokens`` (read at each call) keeps its gradient, equal to stock;
- planted bugs, in the installed patch's own helper or wrapper, each caught: the stream passed through or detached
  into a new leaf that requires a gradient (same values; the work check fails), the vision stream detached too and
  the text stream detached although ``embed_tokens`` trains (the equality check fails).

The causal/full layout is written here (text then vision per sample, as upstream's packer lays out a text-to-video
sample); upstream's ``build_packed_sequence`` builds the pack from it.

Attention runs on ``COSMOS_ATTN_BACKEND=torch`` in both runs (upstream has no CPU backend).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode

from cosmos_framework_ext.upstream import patches as upstream_patches
from cosmos_framework_ext.upstream.patches import patched_impl_forward
from patches.cosmos_table import patch_set

ROOT = os.environ.get("COSMOS_FRAMEWORK_ROOT", "")
if ROOT and ROOT not in sys.path:
    sys.path.insert(0, ROOT)
KEYS = ["moe_gen", "time_embedder", "vae2llm", "llm2vae", "k_norm_und_for_gen"]
ATTN = {"COSMOS_ATTN_BACKEND": "torch"}
ON = {**ATTN, "COSMOS_DETACH_TEXT_STREAM": True}
TARGET = "cosmos_framework.model.generator.mot.unified_mot:_impl_forward"
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB, PATCH = 32, 2, 4, 2, 8, 64, 6
SAMPLES = ((5, 12), (3, 20), (7, 9))
"""(text tokens, vision tokens) per packed sample."""
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _unified_mot():
    from cosmos_framework.model.generator.mot import unified_mot

    return unified_mot


def build(train_embedding: bool = False, ac: bool = False) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """(upstream's Edge text model class, tiny, fp32, its layers checkpoint-wrapped with ``ac``; a ``vae2llm``
    stand-in), trainable subset marked."""
    m = _unified_mot()
    cfg = m.Nemotron3DenseVLMoTConfig(
        dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=LAYERS,
             num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, mrope_section=[2, 1, 1],
             torch_dtype="float32"),
        qk_norm_for_text=False)  # the Edge recipe's value
    cfg.use_und_k_norm_for_gen = True  # the Edge recipe's value (set after construction, as upstream does)
    torch.manual_seed(0)
    lm = m.Nemotron3DenseVLTextForCausalLM(cfg).float()
    vae2llm = torch.nn.Linear(PATCH, HIDDEN)
    if ac:
        for i, layer in enumerate(lm.model.layers):
            lm.model.layers[i] = checkpoint_wrapper(layer)
    for n, p in lm.named_parameters():
        p.requires_grad_(any(k in n for k in KEYS) or (train_embedding and "embed_tokens" in n))
    return lm, vae2llm


def step(lm: torch.nn.Module, vae2llm: torch.nn.Linear, count: Counter | None = None, pad: bool = False):
    """One forward and backward as upstream's network runs it; returns (loss, {name: grad}, pack, text outputs)."""
    from cosmos_framework.data.generator.sequence_packing.runtime import get_gen_seq, get_und_seq
    from cosmos_framework.model.generator.mot.attention import build_packed_sequence

    g = torch.Generator().manual_seed(7)
    modes, splits, lens, und, gen, pos = [], [], [], [], [], []
    at = 0
    for n_und, n_gen in SAMPLES:
        modes += ["causal", "full"]
        splits += [n_und, n_gen]
        lens.append(n_und + n_gen)
        und += range(at, at + n_und)
        gen += range(at + n_und, at + n_und + n_gen)
        pos.append(torch.arange(n_und + n_gen))
        at += n_und + n_gen
    und_idx, gen_idx = torch.tensor(und), torch.tensor(gen)
    ids = torch.randint(0, VOCAB, (len(und),), generator=g)
    patches = torch.randn(len(gen), PATCH, generator=g)
    target = torch.randn(len(gen), HIDDEN, generator=g)
    lm.zero_grad(set_to_none=True)
    vae2llm.zero_grad(set_to_none=True)
    text = lm.model.embed_tokens(ids)  # upstream's _encode_text: embeddings scattered into a zero buffer
    packed = text.new_zeros(at, HIDDEN)
    packed[und_idx] = text
    packed[gen_idx] = vae2llm(patches)  # upstream's _encode_vision: written in place
    pack, meta, _ = build_packed_sequence(
        "two_way", packed_sequence=packed, attn_modes=modes, split_lens=splits, sample_lens=lens,
        packed_und_token_indexes=und_idx, packed_gen_token_indexes=gen_idx, num_heads=HEADS, head_dim=HEAD_DIM,
        num_layers=LAYERS, is_image_batch=False, pad_for_cuda_graphs=pad)
    causal_in = pack["causal_seq"]
    position_ids = torch.cat(pos).expand(3, -1)  # mrope: (3, N)
    out, _ = lm(pack, attention_mask=meta, position_ids=position_ids)
    und_out, gen_out = get_und_seq(out)[:len(und)], get_gen_seq(out)[:len(gen)]  # padding rows left out
    loss = (gen_out - target).pow(2).mean() + 0.1 * und_out.pow(2).mean()
    with MatmulCounter(count if count is not None else Counter()):
        loss.backward()
    assert pack["causal_seq"] is causal_in, "the caller's pack was changed"
    grads = {n: p.grad for n, p in [*lm.named_parameters(), *(("vae2llm." + n, p) for n, p in
                                                              vae2llm.named_parameters())] if p.requires_grad}
    return loss.detach(), grads, pack, und_out


class MatmulCounter(TorchDispatchMode):
    """Counts the matmul kernels (``mm``/``addmm``/``bmm``) run while active into ``count``."""

    def __init__(self, count: Counter):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


def run(flags: dict, train_embedding: bool = False, ac: bool = False, pad: bool = False, planted=None,
        helper=None):
    """A fresh model through one step with ``flags`` applied; ``planted``: a factory installed over the patched
    target, ``helper``: a replacement of the installed patch's ``detached_if_frozen``. Returns (loss, grads, text
    outputs, the backward's matmul count)."""
    ps = patch_set()
    ps.apply(flags)
    saved, saved_helper = None, upstream_patches.detached_if_frozen
    try:
        if planted is not None:
            m = _unified_mot()
            saved, m._impl_forward = m._impl_forward, planted(m._impl_forward)
        if helper is not None:
            upstream_patches.detached_if_frozen = helper
        count: Counter = Counter()
        lm, vae2llm = build(train_embedding, ac)
        loss, grads, pack, und_out = step(lm, vae2llm, count, pad)
        return loss, grads, und_out, sum(count.values())
    finally:
        upstream_patches.detached_if_frozen = saved_helper
        if saved is not None:
            _unified_mot()._impl_forward = saved
        ps.revert()


def same_training(a, b) -> bool:
    """The check: the same loss and the same gradient for every trainable parameter, bit for bit."""
    (loss_a, grads_a, *_), (loss_b, grads_b, *_) = a, b
    return (torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys()
            and all(grads_b[n] is not None and torch.equal(grads_a[n], grads_b[n]) for n in grads_a))


def no_text_backward(stock, patched) -> bool:
    """The check on the work: the patched text outputs need no gradient and its backward runs fewer matmuls."""
    return stock[2].requires_grad and not patched[2].requires_grad and patched[3] < stock[3]


# ------------------------------------------------------------------------------------------------ the proof

def test_the_patch_is_in_the_table_and_reverts():
    ps = patch_set()
    assert TARGET in ps.apply(ON)
    assert getattr(_unified_mot()._impl_forward, "_onecard_patch", None) == "text.impl_forward"
    ps.revert()
    assert getattr(_unified_mot()._impl_forward, "_onecard_patch", None) is None


@pytest.mark.parametrize("ac, pad", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "checkpointed", "padded", "checkpointed-padded"])
def test_upstream_trains_the_same_with_the_text_stream_detached(ac, pad):
    stock, patched = run(ATTN, ac=ac, pad=pad), run(ON, ac=ac, pad=pad)
    assert all(g is not None for g in stock[1].values()) and any("vae2llm" in n for n in stock[1])
    assert same_training(stock, patched)
    assert no_text_backward(stock, patched), (stock[3], patched[3])
    # exactly the text stream's input-gradient matmuls of every layer (q, k, v, o, up, down) are gone
    assert stock[3] - patched[3] == 6 * LAYERS, (stock[3], patched[3])


def test_a_trainable_embedding_keeps_its_gradient():
    stock, patched = run(ATTN, train_embedding=True), run(ON, train_embedding=True)
    assert stock[1]["model.embed_tokens.weight"] is not None
    assert same_training(stock, patched)
    assert patched[2].requires_grad  # the stream was passed as it came


# ---------------------------------------------------------------------------------------------- planted bugs

def _passes_through(stream, embed_weight):
    return stream


def _new_leaf(stream, embed_weight):
    return stream if embed_weight.requires_grad else stream.detach().requires_grad_()


def _ignores_the_embedding(stream, embed_weight):
    return stream.detach()


def _detaches_vision_too(original):
    inner = patched_impl_forward(original)
    return lambda self, pack, *a, **k: inner(self, {**pack, "full_only_seq": pack["full_only_seq"].detach()}, *a, **k)


@pytest.mark.parametrize("helper", [_passes_through, _new_leaf], ids=["passed-through", "new-leaf"])
def test_planted_bug_fails_the_work_check(helper):
    stock, planted = run(ATTN), run(ON, helper=helper)
    assert same_training(stock, planted)  # the same values: only the work check can see it
    assert not no_text_backward(stock, planted)


def test_planted_embedding_ignored_fails_the_equality_check():
    stock = run(ATTN, train_embedding=True)
    assert not same_training(stock, run(ON, train_embedding=True, helper=_ignores_the_embedding))


def test_planted_vision_detached_fails_the_equality_check():
    assert not same_training(run(ATTN), run(ATTN, planted=_detaches_vision_too))
