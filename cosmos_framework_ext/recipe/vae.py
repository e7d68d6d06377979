"""The recipe's VAE encode: normalised Wan2.2 latents, as upstream cosmos-framework computes them.

:func:`encode_latents` is the one encode of the recipe; it brings a parked VAE (lever 2,
:mod:`cosmos_framework_ext.levers.vae_offload`) to the device for the call when one is attached.
:func:`online_latent` is the trainer's encode of one decoded window, the exact call whose output the latent cache
(lever 4) stores.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from cosmos_framework_ext.levers.vae_offload import get_offload

__all__ = ["encode_latents", "online_latent"]


def _latent_stats(vae: nn.Module, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = vae.config
    c = like.shape[1]
    if len(cfg.latents_mean) != c or len(cfg.latents_std) != c:
        raise ValueError(
            f"vae.config latents_mean/latents_std have {len(cfg.latents_mean)}/{len(cfg.latents_std)} "
            f"entries but the posterior has {c} channels"
        )
    mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, c, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, c, 1, 1, 1)
    return mean.to(like.device, like.dtype), inv_std.to(like.device, like.dtype)


def encode_latents(vae: nn.Module, video: torch.Tensor) -> torch.Tensor:
    """Normalized Wan2.2 latents of ``video``: ``(mu - latents_mean) * (1 / latents_std)``, deterministic.

    The multiply by a precomputed inverse std is upstream's (``WanVAE`` scale tuple ``(mean, 1/std)``).

    ``mu`` is the posterior mean (no sampling); ``latents_mean``/``latents_std`` come from
    ``vae.config`` (48 channels for Wan2.2). Works with or without a :class:`VAEOffload` attached: with
    one, the encode runs inside ``on_device(encode_only=True)`` (so inside the trainer's per-micro-batch
    ``on_device()`` no second move happens; standalone it moves once for this call, or not at all when
    the encoder is resident). Runs under ``torch.no_grad()``.

    Args:
        vae: ``diffusers.AutoencoderKLWan`` (Wan2.2 configuration), frozen.
        video: ``[B, 3, T, H, W]`` pixels in [-1, 1], any float dtype/device; it is cast to the VAE's
            parameter dtype and device. ``T = 4n + 1``; ``H`` and ``W`` multiples of
            ``vae.config.scale_factor_spatial`` (16 for Wan2.2).

    Returns:
        ``[B, z_dim, (T - 1) // 4 + 1, H / 16, W / 16]`` (``z_dim`` 48) in the VAE's dtype, on its device.

    Raises:
        ValueError: ``video`` is not 5-D with 3 channels, ``T`` is not ``4n + 1`` (the Wan encoder would
            silently drop the trailing frames), or ``H``/``W`` are not multiples of the spatial factor.
    """
    if video.dim() != 5 or video.shape[1] != 3:
        raise ValueError(f"video must be [B, 3, T, H, W], got shape {tuple(video.shape)}")
    t, h, w = video.shape[2:]
    tf = int(getattr(vae.config, "scale_factor_temporal", 4))
    sf = int(getattr(vae.config, "scale_factor_spatial", 16))
    if (t - 1) % tf != 0:
        raise ValueError(
            f"video has T={t} frames; the Wan VAE needs T = {tf}n + 1 (it would silently drop "
            f"{(t - 1) % tf} trailing frame(s)): trim or pad the clip"
        )
    if h % sf or w % sf:
        raise ValueError(f"video H x W = {h} x {w} must be multiples of {sf} (Wan2.2 spatial compression)")
    off = get_offload(vae)
    ctx = off.on_device(encode_only=True) if off is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        ref = next(vae.parameters())  # first parameter of the encoder: on device while encoding
        x = video.to(device=ref.device, dtype=ref.dtype)
        mu = vae.encode(x).latent_dist.mean
        mean, inv_std = _latent_stats(vae, mu)
        return (mu - mean) * inv_std


def online_latent(vae: nn.Module, video: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """The trainer's online encode of one decoded window (the latent cache stores exactly this).

    Args:
        vae: the frozen ``AutoencoderKLWan`` (with or without a ``VAEOffload`` attached).
        video: float32 ``[3, T, H, W]`` in [-1, 1] (``SftSample.video``).
        device: where the VAE encodes.
        dtype: the VAE's parameter dtype (the clip is cast to it).

    Returns:
        ``[1, z_dim, (T - 1) // 4 + 1, H / 16, W / 16]`` in ``dtype`` on ``device`` (the trainer casts it to
        fp32 after).
    """
    return encode_latents(vae, video.unsqueeze(0).to(device, dtype))
