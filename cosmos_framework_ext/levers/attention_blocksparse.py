"""Block-sparse packed attention: the segment rule of :mod:`cosmos_framework_ext.recipe.attention` as flex_attention block masks.

The dense path (:class:`~cosmos_framework_ext.recipe.attention.PackedSegments`) keeps the samples of a packed micro-batch
apart with boolean ``[L, L]`` masks, so the attention kernel computes every one of the ``L x L`` scores although
a sample attends only to its own few hundred tokens (at the 24 GB recipe's cap, 12 k x 12 k scores for ~350-token
samples). :class:`BlockSparseSegments` states the same rule for ``torch.nn.attention.flex_attention``:

- text (understanding) queries, keys ``[text_1 .. text_n]``: ``seg[q] == seg[k] and q >= k`` (causal within
  the own sample);
- vision (generation) queries, keys ``[text_1 .. text_n | vision_1 .. vision_n]``: ``seg[q] == seg[k]`` (all
  text and vision tokens of the own sample).

Each rule is a ``mask_mod`` over the per-token sample index (int64 ``[L]``, O(L) memory) plus a
:class:`~torch.nn.attention.flex_attention.BlockMask` that lists, per ``block x block`` tile, whether it is
skipped (no pair of its tokens shares a sample), *full* (every pair attends: the mask_mod is not evaluated) or
*partial* (the mask_mod decides per token). The block lists are built here from per-block sample sets in
O(L + (L / block)^2) memory, without materialising an ``[L, L]`` mask (``create_block_mask`` evaluates the
mask_mod on the whole grid, 150 M pairs at 12 k tokens); they equal ``create_block_mask``'s (proved in
``tests/equivalence/test_attention_blocksparse.py``). At the recipe's cap (12 k tokens, 33 samples) the block
masks and sample ids take ~0.3 MB, the dense masks ~135 MB.

Kernels:

- CUDA: ``torch.compile(flex_attention)`` (the fused Triton kernel; skipped tiles cost nothing). Compiled with
  PyTorch's automatic dynamic shapes, so a new micro-batch length recompiles at most once, not every time.
- CPU: PyTorch 2.13's ``flex_attention`` raises ``NotImplementedError`` for inputs that require grad on the CPU.
  The CPU path calls the same operator (``torch._higher_order_ops.flex_attention``) eagerly: its math
  implementation evaluates the mask_mod on the full grid (O(L^2), the CPU runs only tests and smoke runs) and
  has a backward. The block lists are used by the compiled kernels only; the proof checks them separately.

Grouped-query heads: ``enable_gqa`` (the kernel maps query head ``h`` to key head ``h // (Hq / Hkv)``, as
``repeat_interleave`` does on the dense path), so keys and values are not expanded.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

__all__ = ["DEFAULT_BLOCK", "BlockSparseSegments", "compiled_flex", "flex_attend", "segment_block_mask"]

DEFAULT_BLOCK = 128
"""Tile edge in tokens (flex_attention's default sparse block size; its CUDA kernels need a multiple of 128)."""


def _block_sets(segments: torch.Tensor, n_segments: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which samples each tile of ``block`` tokens holds, and whether the tile is one complete sample run.

    Args:
        segments: int64 [L], the sample index of each token (values in ``[0, n_segments)``).

    Returns:
        (has, whole): bool [ceil(L / block), n_segments], True where the tile holds a token of that sample;
        bool [ceil(L / block)], True where the tile is complete (``block`` tokens) and all of one sample.
    """
    n = segments.numel()
    n_blocks = -(-n // block)
    tile = torch.arange(n, device=segments.device) // block
    has = torch.zeros(n_blocks, n_segments, dtype=torch.bool, device=segments.device)
    has.index_put_((tile, segments), torch.ones((), dtype=torch.bool, device=segments.device))  # no host scalar copy
    # tokens per tile: block, the last tile's remainder (computed on the device: a Python value written into a
    # GPU tensor is a host-to-device copy that waits for the GPU's queue)
    complete = (n - torch.arange(n_blocks, device=segments.device) * block).clamp(max=block)
    whole = (has.sum(-1) == 1) & (complete == block)
    return has, whole


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [Qb, KVb] tiles -> (int32 [1, 1, Qb] count per row, int32 [1, 1, Qb, KVb] their columns first, in order)."""
    t = tiles.to(torch.int32)
    return t.sum(-1)[None, None].to(torch.int32), torch.argsort(t, dim=-1, descending=True, stable=True)[None, None].to(torch.int32)


def segment_block_mask(
    q_segments: torch.Tensor,
    kv_segments: torch.Tensor,
    mask_mod: Callable,
    causal: bool,
    block: int = DEFAULT_BLOCK,
    n_segments: int | None = None,
) -> BlockMask:
    """A flex_attention :class:`BlockMask` for "a query attends to keys of its own sample" (causal or not).

    A tile is listed when some query and key in it share a sample (and, causal, the key tile does not lie
    after the query tile); it is *full* when both tiles are complete runs of the same sample (and, causal, the
    key tile lies strictly before the query tile), else *partial* (``mask_mod`` decides per token).

    Args:
        q_segments: int64 [Lq], the sample index of each query token.
        kv_segments: int64 [Lkv], the sample index of each key token (causal: the same tokens as the queries).
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool`` for the partial tiles, the exact token rule.
        causal: whether key ``k`` may be seen by query ``q`` only when ``k <= q`` (same index space).
        block: tile edge in tokens.
        n_segments: the number of samples, if known (every segment index is below it); else read from the
            segments (a device-to-host read: on a GPU it waits for the queued work).

    Returns:
        BlockMask of shape [1, 1, Lq, Lkv]; memory O(Lq + Lkv + (Lq / block) * (Lkv / block)).
    """
    if n_segments is not None:
        n_seg = max(int(n_segments), 1)
    else:
        n_seg = int(max(int(q_segments.max()), int(kv_segments.max()))) + 1 if q_segments.numel() else 1
    q_has, q_whole = _block_sets(q_segments, n_seg, block)
    k_has, k_whole = _block_sets(kv_segments, n_seg, block)
    shared = (q_has.to(torch.float32) @ k_has.to(torch.float32).T) > 0  # [Qb, KVb], exact: counts are small ints
    same_whole = shared & q_whole[:, None] & k_whole[None, :]  # one sample on both sides, complete tiles
    if causal:
        qi = torch.arange(q_has.shape[0], device=shared.device)[:, None]
        kj = torch.arange(k_has.shape[0], device=shared.device)[None, :]
        listed = shared & (kj <= qi)
        full = same_whole & (kj < qi)
    else:
        listed = shared
        full = same_whole
    partial = listed & ~full
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(q_segments.numel(), kv_segments.numel()))


class BlockSparseSegments:
    """Block masks for one packed micro-batch, shared by every layer's processor (the flex twin of ``PackedSegments``).

    Args:
        und_segments: int64 [und_len], the sample index of each text (understanding) token (non-decreasing).
        gen_segments: int64 [gen_len], the sample index of each vision (generation) token (non-decreasing).
        block: tile edge in tokens (:data:`DEFAULT_BLOCK`; tests use smaller tiles to exercise many tiles).
        n_segments: the number of samples (segment indices are below it), so the masks are built without reading
            the segments back to the host; ``None`` reads them.

    Attributes:
        und_mask: BlockMask [1, 1, und_len, und_len], text queries over text keys.
        gen_mask: BlockMask [1, 1, gen_len, und_len + gen_len], vision queries over ``[text | vision]`` keys.
    """

    def __init__(self, und_segments: torch.Tensor, gen_segments: torch.Tensor, block: int = DEFAULT_BLOCK,
                 n_segments: int | None = None):
        und = und_segments
        all_segments = torch.cat([und_segments, gen_segments])
        gen = gen_segments

        def und_rule(b, h, q_idx, kv_idx):
            return (und[q_idx] == und[kv_idx]) & (q_idx >= kv_idx)

        def gen_rule(b, h, q_idx, kv_idx):
            return gen[q_idx] == all_segments[kv_idx]

        self.backend: str | None = None
        """:func:`flex_attend`'s ``backend`` (``None``: compiled on a GPU, eager operator on the CPU)."""
        self.und_mask = segment_block_mask(und, und, und_rule, causal=True, block=block, n_segments=n_segments)
        self.gen_mask = segment_block_mask(gen, all_segments, gen_rule, causal=False, block=block, n_segments=n_segments)

    def attend_und(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Text attention: q [und_len, H, D], k/v [und_len, Hkv, D] -> [und_len, H * D]."""
        return flex_attend(q, k, v, self.und_mask, self.backend)

    def attend_gen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Vision attention: q [gen_len, H, D], k/v [und_len + gen_len, Hkv, D] -> [gen_len, H * D]."""
        return flex_attend(q, k, v, self.gen_mask, self.backend)


def _at_lengths(m: BlockMask, q_len: int, kv_len: int) -> BlockMask:
    """``m`` with its sequence lengths taken from the tensors' shapes.

    A BlockMask keeps its lengths as Python ints, which a compiled function guards on (one recompile per
    micro-batch length). Rebuilt from the query/key shapes inside the compiled region, the lengths are the
    same numbers in eager mode and symbolic sizes under ``torch.compile``; the tile tensors are graph inputs.
    """
    return BlockMask((q_len, kv_len), m.kv_num_blocks, m.kv_indices, m.full_kv_num_blocks, m.full_kv_indices,
                     m.q_num_blocks, m.q_indices, m.full_q_num_blocks, m.full_q_indices, BLOCK_SIZE=m.BLOCK_SIZE,
                     mask_mod=m.mask_mod)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
          kernel_options: dict | None = None) -> torch.Tensor:
    """``flex_attention`` of q [1, H, Lq, D] over k/v [1, Hkv, Lkv, D] (the function that is compiled);
    ``kernel_options``: inductor's, :data:`KERNEL_OPTIONS` when ``None`` (``benchmarks/flex_kernels.py`` times others)."""
    return flex_attention(q, k, v, block_mask=_at_lengths(block_mask, q.shape[-2], k.shape[-2]), enable_gqa=True,
                          kernel_options=KERNEL_OPTIONS if kernel_options is None else kernel_options)


KERNEL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}
"""Inductor's flex kernel options. Below 128 query tokens inductor would pick its flex *decoding* kernel, which
has no fp32 configuration for head_dim 128 on Hopper (``NoValidChoicesError``); the main
kernel serves every length. A micro-batch whose query count crosses 128 still recompiles once: inductor guards
on that comparison whatever the option says."""

_COMPILED: dict[str, Callable] = {}


def compiled_flex(backend: str = "inductor") -> Callable:
    """``torch.compile`` of the flex call, built once per backend, with automatic dynamic shapes (the first
    length change recompiles once with the lengths symbolic; later lengths reuse it)."""
    if backend not in _COMPILED:
        _COMPILED[backend] = torch.compile(_flex, backend=backend)
    return _COMPILED[backend]


def _cpu_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """The flex_attention operator's eager math implementation (differentiable on the CPU); q/k/v [1, H, L, D]."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_op
    from torch.nn.attention.flex_attention import _apply_kernel_options, _identity

    options = _apply_kernel_options(q, k, v, False, None, None)
    block_mask = _at_lengths(block_mask, q.shape[-2], k.shape[-2])
    out, _, _ = flex_op(q, k, v, _identity, block_mask.as_tuple(), 1.0 / math.sqrt(q.shape[-1]), options)
    return out


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                backend: str | None = None) -> torch.Tensor:
    """Block-sparse attention of one packed sequence.

    Args:
        q: [Lq, H, D] queries (any float dtype; bf16 on the GPU).
        k: [Lkv, Hkv, D] keys, ``H % Hkv == 0`` (grouped-query heads are handled by ``enable_gqa``).
        v: [Lkv, Hkv, D] values.
        block_mask: from :func:`segment_block_mask`, shape [1, 1, Lq, Lkv].
        backend: ``None``: on a GPU the inductor-compiled kernel, on the CPU the operator's eager math
            (differentiable); a ``torch.compile`` backend name forces the compiled call (on the CPU only
            without grad: PyTorch 2.13 has no CPU flex backward).

    Returns:
        [Lq, H * D], softmax scale ``1 / sqrt(D)`` (as ``scaled_dot_product_attention``'s default).
    """
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if backend is None and q.device.type == "cpu":
        out = _cpu_flex(q, k, v, block_mask)
    else:
        out = compiled_flex(backend or "inductor")(q, k, v, block_mask)
    return out.squeeze(0).transpose(0, 1).flatten(-2, -1)
