"""``miles_ext.recipe.h3_latents``: the trainer's video latents are encoded as diffusers' own H3 code encodes them.

Anchor: diffusers' ``encode_vae_condition`` (``modular_pipelines/minimax_h3/encoders.py``), run on the same clip
through the same tiny ``AutoencoderKLMiniMaxH3`` whose config holds **non-trivial** ``latents_mean`` / ``latents_std``
(not diffusers' 0 / 1 defaults, under which a missing normalisation is invisible). That function differs from a
training encode in two documented ways, both neutralised here so the comparison can be bitwise: it *samples* the
posterior (the VAE wrapper below returns a posterior whose sample is its mean) and rounds it to float16 (the wrapper
rounds the mean to float16-exact values first, so the rounding is a no-op). What is compared, bitwise: the pixels
the VAE receives (ImageNet convention from ``uint8``) and the normalised latent it returns. The inverse is checked
against the decode step's formula ``latent * latents_std + latents_mean``. The trainer's pair encoder is checked to
go through this path, and its cache key to change with the stats.

Planted bugs, each shown to fail the check: no normalisation (the fault of the issue), the decode formula used to
encode, ``[-1, 1]`` pixels fed to the VAE, the trainer's old raw encode.
"""

from __future__ import annotations

import types
from typing import Callable

import pytest
import torch

from miles_ext.recipe import h3_latents
from miles_ext.recipe.h3_latents import (
    encode_h3_video,
    h3_pixel_stats,
    h3_vae_pixels,
    latent_stats_tag,
    normalize_h3_latents,
)
from miles_ext.recipe.presets import get_preset

C = 24


def tiny_vae(seed: int = 0, trivial: bool = False):
    """The tiny preset's ``AutoencoderKLMiniMaxH3`` with per-channel stats far from 0 / 1."""
    from diffusers.models.autoencoders.autoencoder_kl_minimax_h3 import AutoencoderKLMiniMaxH3

    g = torch.Generator().manual_seed(seed)
    mean = [0.0] * C if trivial else (torch.rand(C, generator=g) * 4 - 2).tolist()
    std = [1.0] * C if trivial else (torch.rand(C, generator=g) * 2.7 + 0.3).tolist()
    torch.manual_seed(seed)
    return AutoencoderKLMiniMaxH3(**get_preset("tiny").vae.kwargs(), latents_mean=mean, latents_std=std).eval()


class MeanPosteriorVAE(torch.nn.Module):
    """A real VAE whose posterior is its mean rounded to float16-exact values: ``sample()`` is that mean, so
    diffusers' sampled + float16-rounded conditioning encode and a mean encode see the same raw latent. Records
    the pixels it is given."""

    def __init__(self, vae):
        super().__init__()
        self.vae, self.config, self.seen = vae, vae.config, []

    def encode(self, x, return_dict=True):
        self.seen.append(x.detach().clone())
        mean = self.vae.encode(x).latent_dist.mean.to(torch.float16).float()
        post = types.SimpleNamespace(mean=mean, sample=lambda generator=None: mean.clone())
        return (post,) if not return_dict else types.SimpleNamespace(latent_dist=post)


def clip_u8(seed: int = 1, frames: int = 9, size: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, frames, size, size), generator=g, dtype=torch.uint8)


def as_decoded(u8: torch.Tensor) -> torch.Tensor:
    """What ``cosmos_framework_ext.recipe.data.decode_window`` returns for these frames: ``u8 / 127.5 - 1``, fp32."""
    return u8.to(torch.float32).div_(127.5).sub_(1.0)


def diffusers_encode(vae, u8: torch.Tensor) -> torch.Tensor:
    from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

    mean, std = h3_pixel_stats()
    return encode_vae_condition(vae, u8.unsqueeze(0), mean, std)[0]


Encode = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


def encode_problems(encode: Encode, seed: int = 0) -> list[str]:
    """Empty when ``encode`` (our signature: pixels in [-1, 1]) gives diffusers' pixels and latents, bitwise."""
    u8 = clip_u8(seed + 1)
    ours_vae, ref_vae = MeanPosteriorVAE(tiny_vae(seed)), MeanPosteriorVAE(tiny_vae(seed))
    with torch.no_grad():
        want = diffusers_encode(ref_vae, u8)
        got = encode(ours_vae, as_decoded(u8))
    problems = []
    if not torch.equal(ours_vae.seen[0].float(), ref_vae.seen[0]):
        diff = float((ours_vae.seen[0].float() - ref_vae.seen[0]).abs().max())
        problems.append(f"VAE input pixels differ from diffusers' (max {diff:.3g})")
    if got.shape != want.shape or not torch.equal(got, want):
        problems.append("normalised latents differ from diffusers'")
    return problems


def test_pixel_stats_are_diffusers_imagenet_values():
    assert h3_pixel_stats() == ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def test_encode_is_diffusers_encode_bitwise():
    assert encode_problems(encode_h3_video) == []
    vae = tiny_vae()
    assert not torch.allclose(torch.tensor(vae.config.latents_mean), torch.zeros(C))  # the stats are not trivial


def test_normalisation_formula_and_its_inverse():
    """``(z - mean) / std`` per channel (also batched), and the decode step's ``z * std + mean`` undoes it."""
    cfg = tiny_vae().config
    raw = torch.randn(2, C, 3, 4, 4, dtype=torch.float64)
    m = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    s = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    norm = normalize_h3_latents(raw, cfg)
    assert norm.dtype == torch.float32 and torch.equal(norm, (raw.float() - m) / s)
    assert torch.equal(normalize_h3_latents(raw[0], cfg), norm[0])
    torch.testing.assert_close(denormalize_h3_latents(norm, cfg), raw.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(denormalize_h3_latents(norm, cfg), norm * s + m, rtol=0, atol=0)
    with pytest.raises(ValueError, match="24/24 entries for a 5-channel"):
        normalize_h3_latents(torch.zeros(5, 1, 1, 1), cfg)
    with pytest.raises(ValueError, match="RGB"):
        h3_vae_pixels(torch.zeros(4, 1, 2, 2))


def test_trivial_stats_leave_the_latent_as_the_vae_gives_it():
    vae, u8 = tiny_vae(trivial=True), clip_u8()
    with torch.no_grad():
        raw = vae.encode(h3_vae_pixels(as_decoded(u8)).unsqueeze(0)).latent_dist.mean[0]
        assert torch.equal(encode_h3_video(vae, as_decoded(u8)), raw)


# ------------------------------------------------------------------------------------------ planted bugs
def _no_normalisation(vae, video):
    with torch.no_grad():
        return vae.encode(h3_vae_pixels(video.unsqueeze(0))).latent_dist.mean[0].float()


def _decode_formula(vae, video):
    return denormalize_h3_latents(_no_normalisation(vae, video), vae.config)


def _minus_one_one_pixels(vae, video):
    with torch.no_grad():
        return normalize_h3_latents(vae.encode(video.unsqueeze(0)).latent_dist.mean[0], vae.config)


@pytest.mark.parametrize("bug, needle", [
    (_no_normalisation, "latents differ"), (_decode_formula, "latents differ"),
    (_minus_one_one_pixels, "pixels differ"),
], ids=["no-normalisation", "decode-formula", "minus-one-one-pixels"])
def test_planted_bug_fails_the_check(bug, needle):
    assert any(needle in p for p in encode_problems(bug))


# --------------------------------------------------------------------------------------------- trainer
def test_trainer_pair_encoder_uses_the_diffusers_encode(monkeypatch):
    from miles_ext.recipe import data as h3data

    u8 = clip_u8(3, frames=9, size=16)
    monkeypatch.setattr(h3data, "decode_window", lambda *a, **k: as_decoded(u8))
    enc = h3data.PairEncoder(get_preset("tiny"), torch.device("cpu"), text_random=True)
    enc.vae = tiny_vae(5)
    enc.enc = types.SimpleNamespace(encode=lambda caption: torch.zeros(2, 384), description="stub")
    rec = types.SimpleNamespace(video_path="clip.mp4", caption="a clip")
    blob = enc.encode(rec, 0, 9, (16, 16))
    want = encode_h3_video(enc.vae, as_decoded(u8))
    t, h, w = blob["video"].shape[1:]
    assert torch.equal(blob["video"], want[:, :t, :h, :w])


def test_cache_key_names_the_normalisation():
    a, b = tiny_vae(0).config, tiny_vae(1).config
    assert latent_stats_tag(a) != latent_stats_tag(b) != latent_stats_tag(tiny_vae(trivial=True).config)
    assert latent_stats_tag(a) == latent_stats_tag(tiny_vae(0).config) and latent_stats_tag(a).startswith("h3-latents-v1:")
    assert h3_latents.PIXEL_RANGE


def denormalize_h3_latents(latent: torch.Tensor, config) -> torch.Tensor:
    """The inverse, ``latent * latents_std + latents_mean`` (diffusers' H3 decode step), fp32, from the config's
    lists directly (independent of the encoder's own helper)."""
    mean = torch.tensor([float(x) for x in config.latents_mean], device=latent.device)
    std = torch.tensor([float(x) for x in config.latents_std], device=latent.device)
    view = (-1, 1, 1, 1) if latent.dim() == 4 else (1, -1, 1, 1, 1)
    return latent.float() * std.view(*view) + mean.view(*view)



def test_pair_cache_key_changes_with_caption_window_and_text_weights(tmp_path, monkeypatch):
    """The H3 pair cache (``miles_ext.recipe.data``'s docstring: keyed by the clip's bytes, the window, the size, the
    caption, the preset, the text encoder and whether its weights are random): on one tiny stand-in row (a few bytes
    as the clip, no decode) with a counting stand-in encoder, the same call again is a hit; another caption, the
    other ``text_random`` and another window length after the ``frames`` cap (9 frames capped to 5, then to 9) each
    is a miss; a row whose own window is the capped one (5 frames) is a hit on the capped entry. Expected hit/miss
    counts written out per call."""
    from miles_ext.recipe import data as h3data

    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"stand-in clip bytes")
    calls = []

    class CountingEncoder:
        def __init__(self, preset, device, text_random):
            self.text_random = text_random

        def encode(self, rec, start, n, size):
            calls.append((rec.caption, start, n, self.text_random))
            i = float(len(calls))
            return {"text": torch.full((2, 4), i), "video": torch.full((3, 1, 2, 2), i),
                    "audio": torch.zeros(2, 3, 1), "encoder": f"stand-in {i}"}

    row = {"records": []}
    monkeypatch.setattr(h3data, "PairEncoder", CountingEncoder)
    monkeypatch.setattr(h3data.rows, "load_records", lambda root: row["records"])

    def run(caption="a clip", window=(0, 9), frames=5, text_random=True):
        row["records"] = [types.SimpleNamespace(video_path=clip, caption=caption, windows=(window,))]
        pairs, info = h3data.encode_pairs(get_preset("tiny"), torch.device("cpu"), tmp_path, tmp_path / "cache",
                                          frames, (32, 32), text_random, progress=False)
        return (info["cache_hits"], info["cache_misses"]), pairs[0]

    first, pair = run()
    assert first == (0, 1) and calls == [("a clip", 0, 5, True)]
    again, cached = run()
    assert again == (1, 0) and all(torch.equal(getattr(cached, f), getattr(pair, f)) for f in ("text", "video", "audio"))
    assert run(caption="another clip")[0] == (0, 1)  # caption
    assert run(text_random=False)[0] == (0, 1)  # random vs trained text-encoder weights
    assert run(frames=9)[0] == (0, 1)  # window [0, 9] instead of the capped [0, 5]
    assert run(window=(0, 5))[0] == (1, 0)  # the row's own 5 frames: the capped entry
    assert len(calls) == 4 and calls[-1] == ("a clip", 0, 9, True)
