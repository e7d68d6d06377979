"""Variable-length packed attention: the segment rule of :mod:`cosmos_framework_ext.recipe.attention` as
FlashAttention-2's variable-length kernels (PyTorch's own build, ``aten._flash_attention_forward``).

The block-sparse path (:mod:`cosmos_framework_ext.levers.attention_blocksparse`) computes every 128 x 128 tile that
holds a pair of one sample's tokens, so a tile that straddles two samples costs a whole tile, and its masks are
built for every micro-batch. A variable-length kernel takes the samples' boundaries instead (cumulative lengths,
``cu_seqlens``) and computes each sample's own scores only:

- text (understanding) queries over text keys: the samples' text runs are already contiguous in
  ``[text_1 .. text_n]``, causal within each;
- vision (generation) queries over ``[text_i | vision_i]``: the keys and values of ``[text_1 .. text_n |
  vision_1 .. vision_n]`` are gathered into ``[text_1 vision_1 | text_2 vision_2 | ...]`` (one index, built on the
  host), so that each sample's keys are one run.

The same rule as the dense masks (a text token attends causally to its own sample's text, a vision token to its
own sample's text and vision), computed by another kernel: the floating-point sums run in another order, so the
result is not bitwise the block-sparse one. ``tests/equivalence/test_attention_varlen.py`` proves the layout (on the
CPU, with the same rule computed per sample by ``scaled_dot_product_attention``'s math, against the dense masks), the
GPU branch's arguments (on the CPU, against an emulation of the operator) and the kernel (on a GPU, bf16: the
variable-length kernel's error against a float64 reference no larger than the block-sparse kernel's).

Kernels:

- CUDA, bf16 or fp16: ``aten._flash_attention_forward`` with ``cum_seq_q``/``cum_seq_k`` (grouped-query heads
  handled by the kernel; its backward is ``aten._flash_attention_backward``). The longest runs' lengths reach
  the kernel through the shape of an empty tensor, so ``torch.compile`` treats them as sizes (dynamic), not as
  constants to recompile for. Sizes that happen to be equal when a layer is first compiled share one symbol
  (PyTorch's duck sizing), so a later micro-batch where they differ could cost one more compile (counted on the CPU
  against an emulated kernel: no recompile after the warm-up, as the other paths).
- CPU (tests, smoke runs): the same call per sample with ``scaled_dot_product_attention`` (differentiable); it
  checks every run against the longest lengths the GPU kernel would be given, which there bound its tiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from patches.core.device import to_device

__all__ = ["VarlenSegments", "check_varlen", "kernel_attend", "math_attend", "varlen_attend"]

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
"""The compute dtypes the GPU kernel has (FlashAttention-2 has no fp32 form)."""


def check_varlen(impl: str, device_type: str, dtype: torch.dtype) -> None:
    """Refuse ``[onecard] attention = "varlen"`` where its kernel cannot run: a GPU run computing in fp32.

    Raises:
        ValueError: the message names the fix.
    """
    if impl == "varlen" and device_type == "cuda" and dtype not in KERNEL_DTYPES:
        name = str(dtype).removeprefix("torch.")
        raise ValueError(f"[onecard] attention = \"varlen\" runs FlashAttention-2's kernels, which have no {name} form "
                         "on the GPU: set [model] precision = \"bfloat16\", or attention = \"flex\"")


def _cumulative(lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
    """int32 [n + 1]: 0, then the running sums of ``lengths`` (a host tensor), on ``device``."""
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    return to_device(cu, device)


class VarlenSegments:
    """Sample boundaries of one packed micro-batch for the variable-length kernels, shared by every layer; built
    from the same per-token sample indices as the dense and block-sparse segments.

    Args:
        und_segments: int64 [und_len], the sample index of each text (understanding) token, a host tensor.
        gen_segments: int64 [gen_len], the sample index of each vision (generation) token, a host tensor.
        device: where the boundary tensors go (built on the host, sent from pinned memory without a synchronize).

    Attributes:
        cu_und: int32 [n + 1], cumulative text lengths.
        cu_gen: int32 [n + 1], cumulative vision lengths.
        cu_kv: int32 [n + 1], cumulative ``text + vision`` lengths (the vision call's keys).
        kv_order: int64 [und_len + gen_len], the gather from ``[text_1 .. text_n | vision_1 .. vision_n]`` to
            ``[text_1 vision_1 | text_2 vision_2 | ...]`` (a stable sort of the keys' sample indices).
        longest: an empty tensor of shape ``[max text, max vision, max text + vision, 0]``: the runs' longest
            lengths as sizes.

    Raises:
        ValueError: no token, segment indices not in runs ``0, 0, .., 1, ..`` (non-decreasing from 0), or a sample
            without a text or a vision token.
    """

    def __init__(self, und_segments: torch.Tensor, gen_segments: torch.Tensor, device: torch.device | str):
        if not und_segments.numel() or not gen_segments.numel():
            raise ValueError("a packed micro-batch needs text and vision tokens")
        for seg in (und_segments, gen_segments):
            if bool((seg.diff() < 0).any()) or int(seg[0]) != 0:
                raise ValueError("segment indices must run 0, 0, .., 1, .. (each sample's tokens together, in order)")
        n = int(max(und_segments[-1], gen_segments[-1])) + 1
        text, vision = torch.bincount(und_segments, minlength=n), torch.bincount(gen_segments, minlength=n)
        if bool((text == 0).any()) or bool((vision == 0).any()):
            raise ValueError("every sample needs at least one text and one vision token")
        device = torch.device(device)
        both = text + vision
        self.cu_und = _cumulative(text, device)
        self.cu_gen = _cumulative(vision, device)
        self.cu_kv = _cumulative(both, device)
        self.kv_order = to_device(torch.cat([und_segments, gen_segments]).argsort(stable=True), device)
        self.longest = torch.empty(int(text.max()), int(vision.max()), int(both.max()), 0, device=device)

    def attend_und(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Text attention: q [und_len, H, D], k/v [und_len, Hkv, D] -> [und_len, H * D], causal per sample."""
        m = self.longest.shape[0]
        return varlen_attend(q, k, v, self.cu_und, self.cu_und, m, m, causal=True)

    def attend_gen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Vision attention: q [gen_len, H, D], k/v [und_len + gen_len, Hkv, D] (``[text | vision]``) ->
        [gen_len, H * D], each sample's vision over its own text and vision."""
        k, v = k.index_select(0, self.kv_order), v.index_select(0, self.kv_order)
        return varlen_attend(q, k, v, self.cu_gen, self.cu_kv, self.longest.shape[1], self.longest.shape[2],
                             causal=False)


def varlen_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  max_q: int, max_k: int, causal: bool) -> torch.Tensor:
    """Attention of each run ``cu_q[i]:cu_q[i+1]`` of queries over the run ``cu_k[i]:cu_k[i+1]`` of keys.

    Args:
        q: [Lq, H, D]; k, v: [Lk, Hkv, D] with ``H % Hkv == 0`` (query head ``h`` reads key head
            ``h // (H / Hkv)``, as ``repeat_interleave`` does).
        cu_q, cu_k: int32 [n + 1] cumulative run lengths (same ``n``).
        max_q, max_k: the longest query and key run.
        causal: a query attends to keys up to its own position within the run; query and key runs must then be
            the same (the text call), where the GPU kernel's bottom-right and the CPU's top-left alignment agree.

    Returns:
        [Lq, H * D], softmax scale ``1 / sqrt(D)``.

    Raises:
        ValueError: on a GPU, a dtype other than bf16/fp16 (the kernel has no fp32 form); on the CPU, a run
            longer than ``max_q``/``max_k``, or causal runs of other lengths.
    """
    if q.is_cuda:
        if q.dtype not in KERNEL_DTYPES:
            raise ValueError(f"variable-length attention needs bf16 or fp16 on the GPU, not {q.dtype}")
        return kernel_attend(q, k, v, cu_q, cu_k, max_q, max_k, causal)
    return math_attend(q, k, v, cu_q, cu_k, max_q, max_k, causal)


def kernel_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  max_q: int, max_k: int, causal: bool) -> torch.Tensor:
    """:func:`varlen_attend` by ``aten._flash_attention_forward`` (the GPU's kernel; the tests run this call on the
    CPU against an emulation of the operator)."""
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False)[0]
    return out.flatten(-2, -1)


def math_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                max_q: int, max_k: int, causal: bool) -> torch.Tensor:
    """:func:`varlen_attend` one run at a time with ``scaled_dot_product_attention`` (the CPU's path; reads the
    boundaries on the host)."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for i in range(cu_q.numel() - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if b - a > max_q or d - c > max_k or (causal and b - a != d - c):
            raise ValueError(f"run {i}: {b - a} queries over {d - c} keys, against the longest {max_q} / {max_k}"
                             f"{' (causal runs must be equal)' if causal else ''}")
        qs, ks, vs = q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1)
        if rep > 1:
            ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        outs.append(F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=causal)[0].transpose(0, 1))
    return torch.cat(outs).flatten(-2, -1)
