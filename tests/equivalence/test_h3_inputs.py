"""``miles_ext.recipe.h3_inputs``: the packed t2va layout of one pair (single process).

Modality tags, text positions, per-row timesteps, the inverse of the packing, refusals of bad shapes, and a
batch-1 forward of the tiny H3 on the packed inputs.
"""

from __future__ import annotations

import pytest
import torch

from miles_ext.recipe.h3_inputs import build_h3_inputs, patchify_video, unpatchify_video
from miles_ext.recipe.presets import build_transformer


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
    "text,video,audio,t,kw,match",
    [
        ((5,), (24, 2, 4, 4), (2, 32, 3), 0.5, {}, r"text_embeds must be \[L, text_dim\]"),
        ((5, 384), (24, 2, 4, 4), (1, 32, 3), 0.5, {}, r"audio_latent must be \[2, C_audio, N>=1\]"),
        ((5, 384), (24, 2, 4, 4), (2, 32, 0), 0.5, {}, r"audio_latent must be"),
        ((5, 384), (24, 2, 3, 4), (2, 32, 3), 0.5, {}, r"divisible"),
        ((5, 384), (24, 2, 4, 4), (2, 32, 3), 1.5, {}, r"^timestep must be in \[0, 1\].*got 1.5"),
        ((5, 384), (24, 2, 4, 4), (2, 32, 3), -0.25, {}, r"^timestep must be in \[0, 1\]"),
        ((5, 384), (24, 2, 4, 4), (2, 32, 3), 0.5, {"audio_timestep": 1.01}, r"^audio_timestep must be in \[0, 1\]"),
        ((5, 384), (24, 2, 4, 4), (2, 32, 3), 0.5, {"patch_size": (2, 2, 2)}, r"temporal patch of 1"),
    ],
    ids=["text-1d", "audio-mono", "audio-empty", "video-odd-height", "t-above-1", "t-below-0", "audio-t-above-1",
         "temporal-patch-2"],
)
def test_packed_inputs_refuse_bad_shapes(text, video, audio, t, kw, match):
    """Each bad input is refused by its own check, named in the message."""
    with pytest.raises(ValueError, match=match):
        build_h3_inputs(torch.zeros(text), torch.zeros(video), torch.zeros(audio), t, **kw)


def test_packed_inputs_accept_the_timestep_bounds():
    """t = 0 and t = 1 (pure noise and clean) are inside the range."""
    for t in (0.0, 1.0):
        kwargs, _ = build_h3_inputs(torch.zeros(5, 384), torch.zeros(24, 2, 4, 4), torch.zeros(2, 32, 3), t,
                                    audio_timestep=1.0 - t)
        assert kwargs["hidden_states"].shape[0] == 1


def test_packed_forward_runs_batch_one():
    torch.manual_seed(0)
    model = build_transformer("tiny")
    kw, pick = build_h3_inputs(torch.randn(4, 384), torch.randn(24, 1, 2, 4), torch.randn(2, 32, 2), 0.3)
    v, a = pick(model(**kw))
    assert v.shape == (24, 1, 2, 4) and a.shape == (2, 32, 2) and v.dtype == torch.float32
