"""``miles_ext.recipe.sft``: the SFT draws and the loss sum (single process).

``stable_hash("sample", seed, rollout_id, microbatch_id, dp_rank)`` seeds randint over the shifted sigma grid,
then randn; the audio stream adds its name to the hash and leaves the visual draws unchanged; ``loss_sum`` is
the sum of the per-pair losses. (The 8->1 proof of the ``loss_sum / num_local_pairs`` normaliser is in
``test_h3_recipe.py``.)
"""

from __future__ import annotations

import torch

from miles_ext.recipe.presets import build_transformer
from patches.core.runtime import stable_hash
from miles_ext.recipe.sft import (
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


def test_pair_loss_is_video_mse_plus_audio_mse_by_hand():
    """``pair_loss`` written out from the model's outputs: mean((v - (x0_v - eps_v))^2) + mean((a - (x0_a - eps_a))^2)."""
    from miles_ext.recipe.h3_inputs import build_h3_inputs

    torch.manual_seed(0)
    model = build_transformer("tiny")
    pair = _pair(3)
    (noised,) = draw_micro_batch([pair], seed=1, rollout_id=0, microbatch_id=0, dp_rank=0)
    sv, sa = noised.sigma["visual"], noised.sigma["audio"]
    ev, ea = noised.noise["visual"], noised.noise["audio"]
    kwargs, pick = build_h3_inputs(pair.text, (1 - sv) * pair.video + sv * ev, (1 - sa) * pair.audio + sa * ea,
                                   1.0 - sv, audio_timestep=1.0 - sa)
    with torch.no_grad():
        video, audio = pick(model(**kwargs))
        want = ((video - (pair.video - ev)) ** 2).mean() + ((audio - (pair.audio - ea)) ** 2).mean()
        assert torch.allclose(pair_loss(model, noised), want, rtol=1e-6, atol=0)


# ---------------------------------------------------------------- gradient scale, anchored by hand
def _step_grads(model, slots, pairs) -> dict[str, torch.Tensor]:
    """The LoRA gradients ``train_step`` accumulates over ``slots`` (before the optimizer step)."""
    from miles_ext.levers.lora import lora_parameters
    from miles_ext.recipe.sft import train_step

    lora = lora_parameters(model)
    got: dict[str, torch.Tensor] = {}
    opt = torch.optim.SGD(list(lora.values()), lr=0.0)
    train_step(model, opt, slots, pairs, seed=SEED_H3,
               after_backward=lambda: got.update({n: p.grad.clone() for n, p in lora.items()}))
    return got


def _hand_grads(model, slots, pairs, num_local_pairs: int) -> dict[str, torch.Tensor]:
    """Autograd of the written-out objective: (sum of the slots' pair losses, each drawn with its slot's seed
    identity) / num_local_pairs, one graph."""
    from miles_ext.levers.lora import lora_parameters

    lora = lora_parameters(model)
    losses = []
    for slot in slots:
        noised = draw_micro_batch([pairs[i] for i in slot.pairs], seed=SEED_H3, rollout_id=slot.rollout_id,
                                  microbatch_id=slot.microbatch_id, dp_rank=slot.dp_rank)
        losses += [pair_loss(model, p) for p in noised]
    objective = torch.stack(losses).sum() / num_local_pairs
    grads = torch.autograd.grad(objective, list(lora.values()))
    return dict(zip(lora, grads))


SEED_H3 = 1234


def _close(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)


def test_gradient_scale_is_loss_sum_over_num_local_pairs_by_hand():
    """The recipe's step (global batch 8): on 1 rank, ``loss_sum / 8`` accumulated over 8 micro-batches of 1 pair;
    on each of 2 ranks, ``loss_sum / 4`` over 2 micro-batches of 2 pairs (FSDP2 then averages the 2 ranks: the
    mean over the step's 8 pairs, which ``test_h3_recipe.py`` proves). The topology proofs run the normaliser on
    both sides, so a scale that both share (``/ (2 num_local_pairs)``, a per-micro-batch mean) is caught here."""
    from miles_ext.levers.lora import lora_parameters
    from miles_ext.recipe.schedule import pair_schedule
    from tests.equivalence.h3_tiny_run import rank_schedule
    from tests.equivalence.h3_tiny_run import make_lora_model, synthetic_pairs

    model = make_lora_model()
    with torch.no_grad():  # move lora_B off zero so that every adapter gets a gradient
        g = torch.Generator().manual_seed(5)
        for n, p in lora_parameters(model).items():
            if ".lora_B." in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    pairs = synthetic_pairs(32)
    one_rank = pair_schedule(8, 8, 4, 1)[0]
    got = _step_grads(model, one_rank, pairs)
    assert all(float(v.abs().max()) > 0 for v in got.values())
    assert _close(got, _hand_grads(model, one_rank, pairs, 8))
    for rank in range(2):
        slots = rank_schedule(8, 2, rank, 4, 2)[0]
        assert [len(s.pairs) for s in slots] == [2, 2]
        assert _close(_step_grads(model, slots, pairs), _hand_grads(model, slots, pairs, 4))
