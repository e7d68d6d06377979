"""Packed-sequence attention for ``Cosmos3OmniTransformer``: several samples in one micro-batch.

diffusers' ``Cosmos3AttnProcessor`` treats the joint sequence as ONE sample (a causal text prefix, then
generation tokens that attend to everything). Upstream packs many samples into one micro-batch and keeps
them apart with variable-length attention. :class:`PackedAttnProcessor` does the same with segment masks:
the joint sequence is laid out as ``[text_1 .. text_n | vision_1 .. vision_n]``; a text token attends
causally to earlier text tokens of its own sample, a vision token to all text and vision tokens of its own
sample. With one sample the masks equal diffusers' (causal / full), so outputs match the stock processor.

These dense [L, L] masks are the reference implementation. ``[onecard].attention = "flex"`` gives the processor
:class:`~cosmos_framework_ext.levers.attention_blocksparse.BlockSparseSegments` instead (``build_packed_inputs(...,
impl="flex")``): the same rule as flex_attention block masks, O(L) mask memory, tiles of other samples skipped.

Grouped-query heads are expanded before ``scaled_dot_product_attention`` so that the masked call can use
the memory-efficient kernel (with ``enable_gqa`` and a mask PyTorch falls back to the O(L^2) math path).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from patches.core.device import to_device


ATTENTION_IMPLS = ("dense", "flex", "varlen")
"""Values of ``[onecard].attention``: dense segment masks (the reference), flex_attention block masks, or the
variable-length kernels."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PackedSegments:
    """Segment masks for one packed micro-batch, shared by every layer's processor.

    Args:
        und_segments: int64 [und_len], the sample index of each text (understanding) token.
        gen_segments: int64 [gen_len], the sample index of each vision (generation) token.
    """

    def __init__(self, und_segments: torch.Tensor, gen_segments: torch.Tensor):
        n_und = und_segments.numel()
        causal = torch.ones(n_und, n_und, dtype=torch.bool, device=und_segments.device).tril()
        # [1, 1, Lq, Lk] boolean masks, True = attend.
        self.und_mask = ((und_segments[:, None] == und_segments[None, :]) & causal)[None, None]
        all_segments = torch.cat([und_segments, gen_segments])
        self.gen_mask = (gen_segments[:, None] == all_segments[None, :])[None, None]
        self.single = bool((all_segments == all_segments[0]).all()) if all_segments.numel() else True


class PackedAttnProcessor:
    """Dual-pathway attention (projections as diffusers' ``Cosmos3AttnProcessor``) with per-sample masks."""

    def __init__(self) -> None:
        self.segments: PackedSegments | None = None

    @staticmethod
    def _sdpa(q, k, v, mask, is_causal):
        # q [L, H, D], k/v [S, Hkv, D] -> [L, H*D]
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return out.squeeze(0).transpose(0, 1).flatten(-2, -1)

    @staticmethod
    def _vision_qkv(attn, gen_seq, cos_gen, sin_gen):
        """The vision stream's q [gen_len, H, D], k and v [gen_len, Hkv, D]: projected, normed, rotated."""
        q_gen = attn.add_q_proj(gen_seq).view(-1, attn.num_attention_heads, attn.head_dim)
        k_gen = attn.add_k_proj(gen_seq).view(-1, attn.num_key_value_heads, attn.head_dim)
        v_gen = attn.add_v_proj(gen_seq).view(-1, attn.num_key_value_heads, attn.head_dim)
        q_gen = attn.norm_added_q(q_gen)
        k_gen = attn.norm_added_k(k_gen)
        q_gen = q_gen * cos_gen + _rotate_half(q_gen) * sin_gen
        k_gen = k_gen * cos_gen + _rotate_half(k_gen) * sin_gen
        return q_gen, k_gen, v_gen

    @staticmethod
    def _text_keys_for_vision(attn, k_und, cos_und, sin_und):
        """The text keys the vision stream reads: ``k_norm_und_for_gen`` (where the model has it) of ``k_und`` (after
        ``norm_k``) [und_len, Hkv, D], rotated."""
        k = attn.k_norm_und_for_gen(k_und) if attn.k_norm_und_for_gen is not None else k_und
        return k * cos_und + _rotate_half(k) * sin_und

    def _attend_vision(self, q_gen, all_k, all_v):
        """Vision queries over each own sample's ``[text | vision]`` keys -> [gen_len, H * D]."""
        seg = self.segments
        if hasattr(seg, "attend_gen"):  # segments that run their own kernels ("flex", "varlen"): the levers
            return seg.attend_gen(q_gen, all_k, all_v)
        multi = seg is not None and not seg.single
        return self._sdpa(q_gen, all_k, all_v, seg.gen_mask if multi else None, is_causal=False)

    def __call__(self, attn, und_seq, gen_seq, rotary_emb):
        if len(rotary_emb) == 6:  # the text keys and values from the cache (lever): the vision stream alone
            cos_und, sin_und, cos_gen, sin_gen, k_und, v_und = (t if i > 3 else t.unsqueeze(1)
                                                                for i, t in enumerate(rotary_emb))
            q_gen, k_gen, v_gen = self._vision_qkv(attn, gen_seq, cos_gen, sin_gen)
            all_k = torch.cat([self._text_keys_for_vision(attn, k_und, cos_und, sin_und), k_gen], dim=0)
            all_v = torch.cat([v_und, v_gen], dim=0)
            return und_seq, attn.to_add_out(self._attend_vision(q_gen, all_k, all_v))
        cos_und, sin_und, cos_gen, sin_gen = (t.unsqueeze(1) for t in rotary_emb)
        q_und = attn.to_q(und_seq).view(-1, attn.num_attention_heads, attn.head_dim)
        k_und = attn.to_k(und_seq).view(-1, attn.num_key_value_heads, attn.head_dim)
        v_und = attn.to_v(und_seq).view(-1, attn.num_key_value_heads, attn.head_dim)
        q_und = attn.norm_q(q_und)
        k_und = attn.norm_k(k_und)
        k_und_for_gen = self._text_keys_for_vision(attn, k_und, cos_und, sin_und)
        q_und = q_und * cos_und + _rotate_half(q_und) * sin_und
        k_und = k_und * cos_und + _rotate_half(k_und) * sin_und
        q_gen, k_gen, v_gen = self._vision_qkv(attn, gen_seq, cos_gen, sin_gen)

        all_k = torch.cat([k_und_for_gen, k_gen], dim=0)
        all_v = torch.cat([v_und, v_gen], dim=0)
        seg = self.segments
        full_out = self._attend_vision(q_gen, all_k, all_v)
        if hasattr(seg, "attend_und"):
            causal_out = seg.attend_und(q_und, k_und, v_und)
        else:
            multi = seg is not None and not seg.single
            causal_out = self._sdpa(q_und, k_und, v_und, seg.und_mask if multi else None, is_causal=True)
        return attn.to_out(causal_out), attn.to_add_out(full_out)


def install(model: torch.nn.Module) -> PackedAttnProcessor:
    """Give every attention layer of ``model`` one shared :class:`PackedAttnProcessor`; returns it."""
    proc = PackedAttnProcessor()
    for layer in model.layers:
        layer.self_attn.set_processor(proc)
    return proc


def _sample_layout(model_config: Any, text_ids: list[list[int]], latent_shapes: list[torch.Size], sigmas: torch.Tensor,
                   fps: list[float]) -> tuple[list, list, list, list, list, list]:
    """Per sample, on the host: text and vision mRoPE positions (float), text and vision segment indices (int64),
    the vision token grid ``(T, H/p, W/p)`` and the vision tokens' timesteps (``1000 * sigma``)."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (
        get_3d_mrope_ids_text_tokens,
        get_3d_mrope_ids_vae_tokens,
    )

    p = model_config.latent_patch_size
    und_pos, gen_pos, und_seg, gen_seg, shapes, timesteps = [], [], [], [], [], []
    for i, (ids, shape) in enumerate(zip(text_ids, latent_shapes)):
        pos, nxt = get_3d_mrope_ids_text_tokens(len(ids), 0)
        und_pos.append(pos.float())
        _, _, t, h, w = shape
        gt, gh, gw = t, -(-h // p), -(-w // p)
        vpos, _ = get_3d_mrope_ids_vae_tokens(
            gt, gh, gw, temporal_offset=nxt + model_config.unified_3d_mrope_temporal_modality_margin,
            reset_spatial_indices=model_config.unified_3d_mrope_reset_spatial_ids,
            fps=fps[i] if model_config.enable_fps_modulation else None, base_fps=model_config.base_fps,
        )
        gen_pos.append(vpos.float())
        n_gen = gt * gh * gw
        und_seg.append(torch.full((len(ids),), i, dtype=torch.long))
        gen_seg.append(torch.full((n_gen,), i, dtype=torch.long))
        shapes.append((gt, gh, gw))
        timesteps.append(torch.full((n_gen,), float(sigmas[i]) * 1000.0))
    return und_pos, gen_pos, und_seg, gen_seg, shapes, timesteps


@dataclass
class HostLayout:
    """A packed micro-batch's inputs that need no latent values, built on the host (:func:`host_layout`).

    Attributes:
        input_ids: int64 [und_len], the text token ids of every sample, in order.
        position_ids: fp32 [3, und_len + gen_len], mRoPE positions (text of every sample, then vision).
        timesteps: fp32 [gen_len], ``1000 * sigma`` of each vision token's sample.
        und_segments: int64 [und_len], the sample index of each text token.
        gen_segments: int64 [gen_len], the sample index of each vision token.
        shapes: per sample, the vision token grid ``(T, H/p, W/p)``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    timesteps: torch.Tensor
    und_segments: torch.Tensor
    gen_segments: torch.Tensor
    shapes: list[tuple[int, int, int]]

    @property
    def und_len(self) -> int:
        return self.und_segments.numel()

    @property
    def gen_len(self) -> int:
        return self.gen_segments.numel()


def host_layout(model_config: Any, text_ids: list[list[int]], latent_shapes: list[torch.Size], sigmas: torch.Tensor,
                fps: list[float], pin: bool = False) -> HostLayout:
    """The host half of :func:`build_packed_inputs`: everything but the latents, from their shapes alone.

    It reads no GPU tensor, so it can run on a loader thread ahead of the micro-batch (the trainer does).

    Args:
        text_ids: per sample, the und token ids (caption + eos + vision start/end markers).
        latent_shapes: per sample, the latent's shape ``[1, 48, T, H, W]``.
        sigmas: fp32 [n] flow-matching sigma per sample (a host tensor).
        fps: per sample, frames per second of the clip.
        pin: put the tensors in pinned memory (a GPU run: they then reach it without a synchronize).
    """
    und_pos, gen_pos, und_seg, gen_seg, shapes, timesteps = _sample_layout(model_config, text_ids, latent_shapes,
                                                                           sigmas, fps)
    own = (lambda t: t.pin_memory()) if pin else (lambda t: t)
    return HostLayout(
        input_ids=own(torch.tensor([t for ids in text_ids for t in ids], dtype=torch.long)),
        position_ids=own(torch.cat(und_pos + gen_pos, dim=1)),
        timesteps=own(torch.cat(timesteps)),
        und_segments=own(torch.cat(und_seg)),
        gen_segments=own(torch.cat(gen_seg)),
        shapes=shapes,
    )


def build_packed_inputs(
    model_config: Any,
    text_ids: list[list[int]],
    latents: list[torch.Tensor],
    sigmas: torch.Tensor,
    fps: list[float],
    device: torch.device,
    impl: str = "dense",
    block: int | None = None,
    ids_device: torch.device | None = None,
    layout: HostLayout | None = None,
) -> tuple[dict[str, Any], Any]:
    """Forward kwargs of ``Cosmos3OmniTransformer`` for one packed micro-batch.

    Layout ``[text_1 .. text_n | vision_1 .. vision_n]``; each sample's positions restart at 0 (text mRoPE
    ids, then vision ids offset by ``unified_3d_mrope_temporal_modality_margin``, fps-modulated), as the
    diffusers pipeline builds them for one sample.

    Args:
        text_ids: per sample, the und token ids (caption + eos + vision start/end markers).
        latents: per sample, the noisy latent [1, 48, T, H, W] (model dtype, on ``device``).
        sigmas: fp32 [n] flow-matching sigma per sample; the timestep fed is ``1000 * sigma``.
        fps: per sample, frames per second of the clip.
        impl: ``"dense"``: :class:`PackedSegments` (boolean [L, L] masks, the reference); ``"flex"``:
            :class:`~cosmos_framework_ext.levers.attention_blocksparse.BlockSparseSegments` (block masks, O(L) memory);
            ``"varlen"``: :class:`~cosmos_framework_ext.levers.attention_varlen.VarlenSegments` (sample boundaries).
        block: flex tile edge in tokens (default :data:`~cosmos_framework_ext.levers.attention_blocksparse.DEFAULT_BLOCK`).
        ids_device: where ``input_ids`` go (default ``device``; the host for ``[onecard] host_embeddings``).
        layout: :func:`host_layout` of the same ``text_ids``, latent shapes, ``sigmas`` and ``fps``, if already
            built (the trainer builds it on a loader thread); ``None`` builds it here.

    Returns:
        (forward kwargs, segments to set on the processor).

    Raises:
        ValueError: ``impl`` is not one of :data:`ATTENTION_IMPLS`.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl {impl!r} is not one of {list(ATTENTION_IMPLS)}")
    device = torch.device(device)
    if layout is None:
        layout = host_layout(model_config, text_ids, [x.shape for x in latents], sigmas, fps, pin=device.type == "cuda")
    und_len, gen_len = layout.und_len, layout.gen_len
    # built on the host, sent from pinned memory without a synchronize (a plain .to from pageable memory waits
    # for everything the GPU has queued): the host can prepare this micro-batch while the GPU computes the last
    put = functools.partial(to_device, device=device)
    seq = torch.arange(und_len, und_len + gen_len, device=device)
    ids = layout.input_ids
    kwargs = dict(
        input_ids=ids if ids_device is not None and torch.device(ids_device) != device else put(ids),
        text_indexes=torch.arange(und_len, device=device),
        position_ids=put(layout.position_ids),
        und_len=und_len,
        sequence_length=und_len + gen_len,
        vision_tokens=latents,
        vision_token_shapes=layout.shapes,
        vision_sequence_indexes=seq,
        vision_mse_loss_indexes=seq,
        vision_timesteps=put(layout.timesteps),
        vision_noisy_frame_indexes=[torch.arange(s[0], device=device) for s in layout.shapes],
    )
    if impl == "varlen":  # the boundaries, from the host segment indices (not sent themselves)
        from cosmos_framework_ext.levers.attention_varlen import VarlenSegments

        return kwargs, VarlenSegments(layout.und_segments, layout.gen_segments, device)
    und_segments, gen_segments = put(layout.und_segments), put(layout.gen_segments)
    if impl == "flex":
        from cosmos_framework_ext.levers.attention_blocksparse import DEFAULT_BLOCK, BlockSparseSegments

        return kwargs, BlockSparseSegments(und_segments, gen_segments, block or DEFAULT_BLOCK,
                                           n_segments=len(text_ids))
    return kwargs, PackedSegments(und_segments, gen_segments)


def prepass_inputs(model_config: Any, texts: list[list[int]], dtype: torch.dtype, device: torch.device | str,
                   impl: str = "dense", block: int | None = None,
                   ids_device: torch.device | None = None) -> tuple[dict[str, Any], Any]:
    """One micro-batch of the text K/V cache's pre-pass (:mod:`cosmos_framework_ext.levers.text_kv_cache`): ``texts``
    packed as the trainer packs samples (:func:`build_packed_inputs`), each with a one-token stand-in latent
    (zeros ``[1, latent_channel, 1, p, p]`` in ``dtype``, sigma 0.5, the base fps). The text stream does not read the
    vision tokens, so its keys and values are the caption's. Returns the forward kwargs and the processor's
    segments."""
    p, c = model_config.latent_patch_size, model_config.latent_channel
    latents = [torch.zeros(1, c, 1, p, p, dtype=dtype, device=device) for _ in texts]
    return build_packed_inputs(model_config, texts, latents, torch.full((len(texts),), 0.5),
                               [model_config.base_fps] * len(texts), device, impl=impl, block=block,
                               ids_device=ids_device)
