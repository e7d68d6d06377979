"""Packed forward inputs of ``MiniMaxH3Transformer3DModel`` for one text-to-audio-video (t2va) training pair.

H3 runs one stack of blocks over **one packed 1-D sequence**; the caller builds the layout. For a t2va pair
without keyframes the layout is the one diffusers' own t2va pipeline builds at inference time,
``[text | target audio | target video]`` (``MiniMaxH3PrepareLayoutStep.build_packed_sequence``), and the
row -> timestep plan is diffusers' ``MiniMaxH3SetTimestepsStep.build_row_timesteps``. Both are *reused* from
the installed diffusers so that training packs exactly what inference packs:

- text rows: rotary time ``0 .. L-1``, tag 1 (text); they inherit the video timestep (no output head reads them);
- audio rows: stereo, packed **channel-major** (all latents of channel 0, then channel 1), rotary time
  ``L + n`` per latent, width pinned to the two ends of the video's width grid, tag 2;
- video rows: the latent patchified ``(1, 2, 2)`` frame-major then row-major, rotary time from H3's
  non-uniform frame clock starting at ``L``, aspect-normalised ``(h, w)`` grid, tag 0.

Timestep convention (diffusers ``MiniMaxH3Scheduler``): the model consumes ``t = 1 - sigma`` unscaled in
``[0, 1]``, where ``t = 1`` is *clean*, and predicts a *data-ward* velocity ``x0 - noise``.

Batch size is 1: "H3 packed forward supports batch size 1" (upstream ``configs/h3.py``); several pairs run
as several forwards.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

__all__ = ["AUDIO_CHANNELS", "H3PairLayout", "build_h3_inputs", "patchify_video", "unpatchify_video"]

AUDIO_CHANNELS = 2
"""MiniMax-H3's soundtrack is stereo (diffusers ``MINIMAX_H3_AUDIO_CHANNELS``)."""


def patchify_video(latent: torch.Tensor, patch_size: tuple[int, int, int]) -> torch.Tensor:
    """``[C, T, H, W]`` -> rows ``[T/pt * H/ph * W/pw, C*pt*ph*pw]``, frame-major then row-major (diffusers'
    ``patchify_video_latents``). Raises ``ValueError`` if a dimension is not divisible by the patch."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    if latent.ndim != 4:
        raise ValueError(f"video latent must be [C, T, H, W], got shape {list(latent.shape)}")
    return patchify_video_latents(latent[None], patch_size)


def unpatchify_video(rows: torch.Tensor, shape: tuple[int, int, int, int], patch_size: tuple[int, int, int]) -> torch.Tensor:
    """Inverse of :func:`patchify_video`: rows ``[N, C*pt*ph*pw]`` -> ``[C, T, H, W]`` (``shape``)."""
    c, t, h, w = shape
    pt, ph, pw = patch_size
    x = rows.reshape(t // pt, h // ph, w // pw, c, pt, ph, pw)
    return x.permute(3, 0, 4, 1, 5, 2, 6).reshape(c, t, h, w)


@dataclasses.dataclass(frozen=True)
class H3PairLayout:
    """Where one pair's rows sit in the packed sequence (all sizes in rows)."""

    num_text_rows: int
    """Text rows (``L``)."""
    num_audio_rows: int
    """Audio rows: ``AUDIO_CHANNELS * num_audio_latents``."""
    num_video_rows: int
    """Video rows: ``T/pt * H/ph * W/pw``."""
    video_shape: tuple[int, int, int, int]
    """``[C, T, H, W]`` of the video latent."""
    audio_shape: tuple[int, int, int]
    """``[AUDIO_CHANNELS, C_audio, N]`` of the audio latent."""
    patch_size: tuple[int, int, int]
    """The transformer's ``(t, h, w)`` patch."""

    @property
    def sequence_length(self) -> int:
        """Rows of the packed sequence."""
        return self.num_text_rows + self.num_audio_rows + self.num_video_rows

    def split(self, output: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The model output -> ``(video [C, T, H, W], audio [S, C_audio, N])`` in latent layout.

        ``output`` is the ``MiniMaxH3TransformerOutput`` or the ``(sample, audio_sample)`` tuple of a batch-1
        forward. The predictions keep the output heads' dtype (fp32 unless the heads were cast).
        """
        video_rows, audio_rows = (output.sample, output.audio_sample) if hasattr(output, "sample") else output
        video = unpatchify_video(video_rows[0], self.video_shape, self.patch_size)
        s, c, n = self.audio_shape
        audio = audio_rows[0].reshape(s, n, c).permute(0, 2, 1)
        return video, audio


def _check_h3_inputs(text_embeds: torch.Tensor, audio_latent: torch.Tensor, patch_size: tuple[int, int, int],
                     t_video: float, t_audio: float) -> None:
    """:func:`build_h3_inputs`'s checks of the text and audio shapes, the temporal patch and the two timesteps (the
    video latent's shape is :func:`patchify_video`'s).

    Raises:
        ValueError: the first thing that does not match, named with its shape or value.
    """
    if text_embeds.ndim != 2:
        raise ValueError(f"text_embeds must be [L, text_dim], got shape {list(text_embeds.shape)}")
    if audio_latent.ndim != 3 or audio_latent.shape[0] != AUDIO_CHANNELS or audio_latent.shape[2] < 1:
        raise ValueError(
            f"audio_latent must be [{AUDIO_CHANNELS}, C_audio, N>=1] (stereo, channel-major), "
            f"got shape {list(audio_latent.shape)}"
        )
    if patch_size[0] != 1:
        raise ValueError(f"only a temporal patch of 1 is supported (H3 uses (1, 2, 2)), got {patch_size}")
    for name, value in (("timestep", t_video), ("audio_timestep", t_audio)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1] (H3 consumes t = 1 - sigma unscaled), got {value}")


def build_h3_inputs(
    text_embeds: torch.Tensor,
    video_latent: torch.Tensor,
    audio_latent: torch.Tensor,
    timestep: float | torch.Tensor,
    *,
    patch_size: tuple[int, int, int] = (1, 2, 2),
    audio_timestep: float | torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], Callable[[Any], tuple[torch.Tensor, torch.Tensor]]]:
    """Forward kwargs for one t2va pair, and a function that picks the video / audio predictions.

    Args:
        text_embeds: ``[L, text_dim]`` text conditioning (any float dtype; the model casts it to
            ``context_embedder``'s dtype).
        video_latent: ``[C, T, H, W]`` noisy video latent (C = the transformer's ``in_channels``); ``T, H, W``
            divisible by ``patch_size``.
        audio_latent: ``[2, C_audio, N]`` noisy stereo audio latent (C_audio = ``audio_in_channels``), packed
            channel-major. N >= 1.
        timestep: the video rows' timestep ``t = 1 - sigma`` in ``[0, 1]`` (1 = clean).
        patch_size: the transformer's ``config.patch_size``.
        audio_timestep: the audio rows' timestep; defaults to ``timestep``. Text rows always take ``timestep``.

    Returns:
        ``(kwargs, pick)``: ``model(**kwargs)`` runs the batch-1 packed forward on ``video_latent``'s device;
        ``pick(output)`` returns ``(video [C, T, H, W], audio [2, C_audio, N])`` predictions (data-ward velocity).

    Raises:
        ValueError: a shape does not match the layout above, or a timestep is outside ``[0, 1]``.
    """
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
    )
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        MINIMAX_H3_AUDIO_TAG,
        MINIMAX_H3_TEXT_TAG,
        MINIMAX_H3_VIDEO_TAG,
    )

    t_video = float(timestep)
    t_audio = t_video if audio_timestep is None else float(audio_timestep)
    _check_h3_inputs(text_embeds, audio_latent, patch_size, t_video, t_audio)
    video_rows = patchify_video(video_latent, patch_size)

    device = video_latent.device
    num_text = text_embeds.shape[0]
    c, t, h, w = video_latent.shape
    position_ids, token_tags, video_idx, audio_idx, text_idx, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_token_tags=torch.full((num_text,), MINIMAX_H3_TEXT_TAG, dtype=torch.long),
        num_latent_frames=t,
        latent_height=h,
        latent_width=w,
        num_audio_latents=audio_latent.shape[2],
        patch_size=patch_size,
        audio_channels=AUDIO_CHANNELS,
        audio_tag=MINIMAX_H3_AUDIO_TAG,
        video_tag=MINIMAX_H3_VIDEO_TAG,
    )
    unique_t, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_idx, audio_idx, 0, 0, num_text, t_video, t_audio, t_video, t_audio
    )
    audio_rows = audio_latent.permute(0, 2, 1).reshape(-1, audio_latent.shape[1])
    kwargs = dict(
        hidden_states=video_rows[None],
        audio_hidden_states=audio_rows[None],
        encoder_hidden_states=text_embeds.to(device)[None],
        timestep=unique_t.to(device),
        timestep_indices=timestep_indices.to(device),
        token_tags=token_tags.to(device),
        position_ids=position_ids.to(device),
        video_indices=video_idx.to(device),
        audio_indices=audio_idx.to(device),
        text_indices=text_idx.to(device),
        return_dict=False,
    )
    layout = H3PairLayout(
        num_text_rows=num_text,
        num_audio_rows=audio_rows.shape[0],
        num_video_rows=video_rows.shape[0],
        video_shape=(c, t, h, w),
        audio_shape=tuple(audio_latent.shape),  # type: ignore[arg-type]
        patch_size=tuple(patch_size),  # type: ignore[arg-type]
    )
    return kwargs, layout.split
