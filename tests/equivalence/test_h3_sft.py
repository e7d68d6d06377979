"""``miles_ext.sft``: the SFT draws and the loss sum (single process).

``stable_hash("sample", seed, rollout_id, microbatch_id, dp_rank)`` seeds randint over the shifted sigma grid,
then randn; the audio stream adds its name to the hash and leaves the visual draws unchanged; ``loss_sum`` is
the sum of the per-pair losses. (The 8->1 proof of the ``loss_sum / num_local_pairs`` normaliser is in
``test_h3_recipe.py``.)
"""

from __future__ import annotations

import torch

from miles_ext.presets import build_transformer
from miles_ext.recipe import stable_hash
from miles_ext.sft import (
    H3_FLOW_SHIFTS,
    SftPair,
    draw_micro_batch,
    micro_batch_loss_sum,
    pair_loss,
    shifted_sigma_grid,
)


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
