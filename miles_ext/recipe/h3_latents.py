"""The H3 video latents the trainer learns on, encoded as diffusers' MiniMax-H3 pipeline encodes them.

diffusers 0.42.1 (``AutoencoderKLMiniMaxH3`` docstring, ``modular_pipelines/minimax_h3``):

- **pixels in**: ImageNet-normalised RGB over a ``[0, 1]`` base range, ``(pixel_uint8 / 255 - pixel_mean) /
  pixel_std`` with ``MiniMaxH3ModularPipeline.pixel_mean`` / ``.pixel_std`` (``encoders.encode_vae_condition``);
  not the ``[-1, 1]`` range the clip decoder gives;
- **latents out**: per-channel ``(latent - vae.config.latents_mean) / vae.config.latents_std``
  (``encode_vae_condition``'s last line), which the decode step inverts, ``latent * latents_std + latents_mean``
  (``decoders.MiniMaxH3DecodeStep``): the transformer denoises *normalised* latents, so a training target ``x0``
  must be normalised the same way. With diffusers' class defaults (mean 0, std 1, the random VAE of our presets)
  this is the identity; with a released VAE it is not.

Kept from the trainer, unlike ``encode_vae_condition`` (which encodes *conditioning anchors*): the posterior
**mean** (that function samples it under a fixed seed 42 and rounds it to float16 to reproduce the released
model's conditioning; a training target has no such constraint and the mean is deterministic).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["PIXEL_RANGE", "h3_pixel_stats", "h3_vae_pixels", "normalize_h3_latents",
           "encode_h3_video", "latent_stats_tag"]

PIXEL_RANGE = "[-1, 1] from u8 / 127.5 - 1"
"""What :func:`h3_vae_pixels` takes: the clip decoder's pixels (``cosmos_framework_ext.recipe.data.decode_window``)."""


@functools.lru_cache(maxsize=1)
def h3_pixel_stats() -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(pixel_mean, pixel_std)`` as diffusers' ``MiniMaxH3ModularPipeline`` states them (ImageNet's)."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline

    pipe = MiniMaxH3ModularPipeline()
    return tuple(pipe.pixel_mean), tuple(pipe.pixel_std)


def h3_vae_pixels(video: torch.Tensor) -> torch.Tensor:
    """The VAE input for clip pixels: ``[3, T, H, W]`` or ``[B, 3, T, H, W]`` in ``[-1, 1]`` (``u8 / 127.5 - 1``) ->
    the same shape, fp32, ``(u8 / 255 - pixel_mean) / pixel_std`` computed as diffusers computes it.

    The ``uint8`` value is recovered exactly (``round((x + 1) * 127.5)``), so the result is bitwise what
    ``encode_vae_condition`` feeds the VAE for the same frames. Raises ``ValueError`` for a wrong shape.
    """
    if video.dim() not in (4, 5) or video.shape[-4] != 3:
        raise ValueError(f"video must be [3, T, H, W] or [B, 3, T, H, W] RGB, got shape {list(video.shape)}")
    mean, std = h3_pixel_stats()
    view = (-1, 1, 1, 1) if video.dim() == 4 else (1, -1, 1, 1, 1)
    u8 = ((video.float() + 1.0) * 127.5).round_().clamp_(0, 255)
    mean_t = torch.tensor(mean, device=video.device).view(*view)
    std_t = torch.tensor(std, device=video.device).view(*view)
    return (u8.div(255.0) - mean_t) / std_t


def _stats(config, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.tensor(config.latents_mean, dtype=torch.float32, device=device)
    std = torch.tensor(config.latents_std, dtype=torch.float32, device=device)
    return mean, std


def normalize_h3_latents(latent: torch.Tensor, config) -> torch.Tensor:
    """``(latent - latents_mean) / latents_std`` per channel, fp32 (diffusers' H3 encode normalisation).

    Args:
        latent: raw VAE latent ``[C, T, H, W]`` or ``[B, C, T, H, W]``, any float dtype.
        config: the VAE's ``config`` (``latents_mean`` / ``latents_std``, ``C`` floats each).

    Raises:
        ValueError: the stats do not have one entry per channel.
    """
    mean, std = _stats(config, latent.device)
    ch = latent.shape[-4]
    if mean.numel() != ch or std.numel() != ch:
        raise ValueError(f"VAE latents_mean/latents_std have {mean.numel()}/{std.numel()} entries for a {ch}-channel "
                         "latent; load the VAE config that belongs to these weights")
    view = (-1, 1, 1, 1) if latent.dim() == 4 else (1, -1, 1, 1, 1)
    return (latent.float() - mean.view(*view)) / std.view(*view)


@torch.no_grad()
def encode_h3_video(vae: torch.nn.Module, video: torch.Tensor) -> torch.Tensor:
    """The normalised training latent of one clip: ``[3, T, H, W]`` pixels in ``[-1, 1]`` -> ``[C, T', H', W']`` fp32
    on the CPU: :func:`h3_vae_pixels`, ``vae.encode(...).latent_dist.mean``, :func:`normalize_h3_latents`."""
    param = next(vae.parameters())
    pixels = h3_vae_pixels(video.unsqueeze(0)).to(param.device, param.dtype)
    raw = vae.encode(pixels).latent_dist.mean[0].float().cpu()
    return normalize_h3_latents(raw, vae.config)


def latent_stats_tag(config) -> str:
    """A short text naming the normalisation (for cache keys): the pixel convention and the latents' stats."""
    import hashlib

    stats = repr((tuple(map(float, config.latents_mean)), tuple(map(float, config.latents_std)), h3_pixel_stats()))
    return "h3-latents-v1:" + hashlib.sha256(stats.encode()).hexdigest()[:12]
