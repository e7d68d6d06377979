"""Model presets for the embedded Cosmos3-Edge trainer, and the upstream ``keys_to_select`` mapping.

The transformer is diffusers' :class:`~diffusers.Cosmos3OmniTransformer`; the ``edge`` preset reproduces
upstream's Cosmos3-Edge tower (Nemotron-2B-Dense-VL backbone: hidden 2048, 28 layers, 16 heads x 128,
8 KV heads, relu2 MLP 9216, vocab 131072, ``k_norm_und_for_gen``). Built on the meta device it has
3,361,198,784 parameters, the upstream count to the parameter, and its generation pathway
1,414,921,408 (upstream: 1,414,924,992).

The VAE is diffusers' :class:`~diffusers.AutoencoderKLWan` in the Wan2.2 4x16x16 configuration
(z_dim 48, residual blocks, patch 2; 704.7 M parameters at full size).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

# Wan2.2 latent statistics (per channel, 48 channels), as published with the Wan2.2 VAE.
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]


@dataclasses.dataclass(frozen=True)
class EdgePreset:
    """One size of the Cosmos3-Edge recipe: transformer config, VAE config and video geometry."""

    name: str
    """Preset name, ``edge`` (full size, GPU) or ``tiny`` (CPU tests and the CPU main job)."""
    transformer: dict[str, Any]
    """Keyword arguments for ``diffusers.Cosmos3OmniTransformer``."""
    vae: dict[str, Any]
    """Keyword arguments for ``diffusers.AutoencoderKLWan`` (Wan2.2 layout)."""
    resolution_4x3: tuple[int, int]
    """(width, height) in pixels for clips closer to 4:3 (upstream resolution bucket "256": 320x256)."""
    resolution_16x9: tuple[int, int]
    """(width, height) in pixels for clips closer to 16:9 (upstream: 320x192)."""
    max_frames: int
    """Longest window in frames (4n+1) the sample dataset cuts."""


_EDGE_TRANSFORMER = dict(
    hidden_size=2048,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=9216,
    hidden_act="relu2",
    vocab_size=131072,
    qk_norm_for_text=False,
    use_und_k_norm_for_gen=True,
    rope_theta=1.0e8,
    latent_channel=48,
    latent_patch_size=2,
    patch_latent_dim=192,
)

_WAN22_VAE = dict(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    temperal_downsample=[False, True, True],
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
    latents_mean=WAN22_LATENTS_MEAN,
    latents_std=WAN22_LATENTS_STD,
)

PRESETS: dict[str, EdgePreset] = {
    "edge": EdgePreset(
        name="edge",
        transformer=_EDGE_TRANSFORMER,
        vae=_WAN22_VAE,
        resolution_4x3=(320, 256),
        resolution_16x9=(320, 192),
        max_frames=93,
    ),
    "tiny": EdgePreset(
        name="tiny",
        transformer=dict(
            _EDGE_TRANSFORMER,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=30528,  # >= the bundled MiniLM WordPiece vocabulary (30522)
            rope_axes_dim=[4, 2, 2],
        ),
        vae=dict(_WAN22_VAE, base_dim=8, decoder_base_dim=8, num_res_blocks=1),
        resolution_4x3=(64, 48),
        resolution_16x9=(64, 32),
        max_frames=17,
    ),
}


def get_preset(name: str) -> EdgePreset:
    """Return the preset called ``name``; raises ``ValueError`` naming the known presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}: use one of {sorted(PRESETS)}") from None


# Upstream keys_to_select (a substring match on cosmos-framework parameter names) -> regexes over
# diffusers Cosmos3OmniTransformer parameter names selecting the same generation pathway.
UPSTREAM_KEY_MAP: dict[str, tuple[str, ...]] = {
    "moe_gen": (
        r"(^|\.)mlp_moe_gen\.",
        r"(^|\.)input_layernorm_moe_gen\.",
        r"(^|\.)post_attention_layernorm_moe_gen\.",
        r"(^|\.)norm_moe_gen\.",
        r"\.self_attn\.(add_q_proj|add_k_proj|add_v_proj|to_add_out|norm_added_q|norm_added_k)\.",
    ),
    "time_embedder": (r"(^|\.)time_embedder\.",),
    "vae2llm": (r"(^|\.)proj_in\.",),
    "llm2vae": (r"(^|\.)proj_out\.",),
    "k_norm_und_for_gen": (r"\.self_attn\.k_norm_und_for_gen\.",),
}


def select_trainable(names: list[str], keys_to_select: list[str]) -> list[str]:
    """Names of the parameters ``keys_to_select`` trains, in the order given.

    An upstream key from :data:`UPSTREAM_KEY_MAP` selects its mapped diffusers parameters; any other
    key is a plain substring match, as upstream's ``OptimizersContainer`` does.

    Raises:
        ValueError: ``keys_to_select`` is empty, or a key matches no parameter.
    """
    if not keys_to_select:
        raise ValueError(
            "keys_to_select is empty: set [optimizer].keys_to_select in the TOML (the recipe trains "
            "moe_gen, time_embedder, vae2llm, llm2vae, k_norm_und_for_gen)"
        )
    selected: set[str] = set()
    for key in keys_to_select:
        patterns = [re.compile(p) for p in UPSTREAM_KEY_MAP.get(key, ())]
        hits = {n for n in names if (any(p.search(n) for p in patterns) if patterns else key in n)}
        if not hits:
            raise ValueError(
                f"keys_to_select entry {key!r} matches no parameter of the model: known upstream keys are "
                f"{sorted(UPSTREAM_KEY_MAP)}, any other entry must be a substring of a parameter name"
            )
        selected |= hits
    return [n for n in names if n in selected]


def build_transformer(preset: EdgePreset, device: Any = None, dtype: Any = None):
    """Build ``Cosmos3OmniTransformer`` for ``preset`` (random init; ``device="meta"`` allocates nothing)."""
    import torch
    from diffusers import Cosmos3OmniTransformer

    with torch.device(device or "cpu"):
        model = Cosmos3OmniTransformer(**preset.transformer)
    if dtype is not None:
        model.to(dtype)
    return model


def build_vae(preset: EdgePreset, device: Any = None, dtype: Any = None):
    """Build the Wan2.2-configuration ``AutoencoderKLWan`` for ``preset``, frozen and in eval mode."""
    import torch
    from diffusers import AutoencoderKLWan

    with torch.device(device or "cpu"):
        vae = AutoencoderKLWan(**preset.vae)
    vae.requires_grad_(False).eval()
    if dtype is not None:
        from diffusers.utils import logging as dlog

        level = dlog.get_verbosity()
        dlog.set_verbosity_error()  # Wan declares no fp32-only modules; silence the generic cast warning
        try:
            vae.to(dtype)
        finally:
            dlog.set_verbosity(level)
    return vae
