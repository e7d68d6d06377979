"""Grad accumulation trains the same thing as data parallelism: the recipe's normalisation, proven.

Upstream backwards ``loss / grad_accum_iter`` per micro-batch, where a micro-batch loss is
``loss_scale * mean over samples of the per-sample MSE``; FSDP2 then averages over ranks. So the stock
8-GPU step (8 ranks x grad_accum 2) takes the mean over 16 micro-batch means, and one GPU with
grad_accum 16 takes the same mean. Tolerance: fp32, relative 1e-5 (the sums run in another order).

Independent anchors (the A/B above shares the code under test on both sides, so these pin the code itself to
upstream's formulas): the interpolation and velocity target by hand and against diffusers'
``FlowMatchEulerDiscreteScheduler``; the timestep fed (1000 sigma); the micro-batch loss on hand-written
numbers; and every gradient reference written out from per-sample MSEs computed here, never from
``micro_batch_loss``. Micro-batches of unequal sample counts (3 + 1) separate the recipe's rule (mean over
micro-batch means) from a plain mean over all samples; the proof also holds with activation checkpointing on.
"""

from __future__ import annotations

import pytest
import torch

from cosmos_framework_ext.recipe.attention import build_packed_inputs
from cosmos_framework_ext.recipe.loss import (flow_matching_inputs, grad_clip, micro_batch_loss,
                                              packed_flow_matching_inputs, warmup_cosine)
from tests.equivalence import tiny_recipe as R
from tests.equivalence.h3_ranks import launch

RTOL, ATOL = 1e-5, 1e-7


def accumulated_grads(n_micro: int, loss_fn=micro_batch_loss) -> dict[str, torch.Tensor]:
    model, _ = R.make_model()
    for m in range(n_micro):
        R.loss_of(model, R.micro_batch(0, m), grad_accum=n_micro, loss_fn=loss_fn).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def per_sample_mse(model, samples) -> torch.Tensor:
    """[n] the per-sample MSE of one packed micro-batch, written out here (not ``micro_batch_loss``)."""
    return R.loss_of(model, samples, loss_fn=lambda preds, targets, _scale, _ga: torch.stack(
        [((p.float() - t.float()) ** 2).mean() for p, t in zip(preds, targets)]))


def grads_of(objective: torch.Tensor, model) -> dict[str, torch.Tensor]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    gs = torch.autograd.grad(objective, [p for _, p in named], retain_graph=True, allow_unused=True)
    return {n: g for (n, _), g in zip(named, gs) if g is not None}


def reference_grads(n_micro: int) -> dict[str, torch.Tensor]:
    """Autograd of the written-out objective: 10 * mean_m( mean_i MSE_mi ), one graph."""
    model, _ = R.make_model()
    per_micro = [per_sample_mse(model, R.micro_batch(0, m)).mean() for m in range(n_micro)]
    return grads_of(10.0 * torch.stack(per_micro).mean(), model)


def grads_close(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=RTOL, atol=ATOL) for k in a)


def test_accumulated_equals_reference_normalisation():
    assert grads_close(accumulated_grads(4), reference_grads(4))


# ------------------------------------------------------------------------------- independent anchors
def test_flow_matching_inputs_by_hand():
    x0, eps = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0])
    xt, v = flow_matching_inputs(x0, eps, 0.25)
    assert torch.equal(xt, torch.tensor([1.5, 1.25]))  # 0.75 * x0 + 0.25 * eps
    assert torch.equal(v, torch.tensor([2.0, -3.0]))  # eps - x0


SIGMAS = [0.5, 1e-30, 2.0**-26, 1 - 2.0**-24, 0.1234567, 0.999, 3e-8]
"""Sigmas of the packed flow-matching check: ordinary ones and those where ``1 - s`` rounds (tiny, next to 1)."""


def _packed_vs_per_sample(sigma_of=lambda s, i: s, device="cpu"):
    g = torch.Generator().manual_seed(5)
    sizes = [7, 1, 40, 16, 3, 96, 5]
    sigmas = torch.tensor(SIGMAS)
    x0 = [torch.randn(n, generator=g).to(device) for n in sizes]
    eps = [torch.randn(n, generator=g).to(device) for n in sizes]
    xt, v = packed_flow_matching_inputs(torch.cat(x0), torch.cat(eps), sigmas, sizes)
    ref = [flow_matching_inputs(a, e, float(sigma_of(sigmas, i)[i])) for i, (a, e) in enumerate(zip(x0, eps))]
    return (torch.equal(xt, torch.cat([r[0] for r in ref])) and torch.equal(v, torch.cat([r[1] for r in ref])))


def test_packed_flow_matching_equals_each_sample_bit_for_bit():
    """The trainer's one-pass flow matching over the concatenated latents against the per-sample call with a Python
    float sigma (the formula checked by hand above)."""
    assert _packed_vs_per_sample()


def test_planted_a_sample_noised_with_its_neighbours_sigma_breaks_it():
    assert not _packed_vs_per_sample(sigma_of=lambda s, i: s.roll(1))


@pytest.mark.parametrize("sizes, n", [([3, 4], 6), ([3], 7), ([3, 4, 1], 7)], ids=["short", "one-sigma-short", "extra"])
def test_packed_flow_matching_refuses_sizes_that_do_not_fit(sizes, n):
    with pytest.raises(ValueError, match="sizes"):
        packed_flow_matching_inputs(torch.zeros(n), torch.zeros(n), torch.tensor([0.5, 0.25]), sizes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_cuda_packed_flow_matching_equals_each_sample_bit_for_bit():
    assert _packed_vs_per_sample(device="cuda")


def test_flow_matching_agrees_with_diffusers_scheduler():
    """diffusers' flow-matching scheduler noises as ``scale_noise`` and integrates the velocity in ``step``: our
    x_t must be its ``scale_noise``, and one Euler step with our target must land on the path at the next sigma."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    sched.set_timesteps(10)
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(1, 4, 2, 3, generator=g), torch.randn(1, 4, 2, 3, generator=g)
    t, sigma, sigma_next = sched.timesteps[3], float(sched.sigmas[3]), float(sched.sigmas[4])
    xt, v = flow_matching_inputs(x0, eps, sigma)
    torch.testing.assert_close(xt, sched.scale_noise(x0, t[None], eps), rtol=0, atol=1e-6)
    landed = sched.step(v, t, xt).prev_sample
    torch.testing.assert_close(landed, (1 - sigma_next) * x0 + sigma_next * eps, rtol=0, atol=1e-5)


def test_timestep_fed_is_1000_sigma():
    model, _ = R.make_model()
    samples = R.micro_batch(0, 0, n_samples=2)
    xt = [flow_matching_inputs(x0, e, s)[0] for _, x0, s, e in samples]
    kwargs, _ = build_packed_inputs(model.config, [s[0] for s in samples], xt, torch.tensor([0.25, 0.5]),
                                    [24.0, 24.0], torch.device("cpu"))
    n0 = kwargs["vision_token_shapes"][0]
    n0 = n0[0] * n0[1] * n0[2]
    assert set(kwargs["vision_timesteps"][:n0].tolist()) == {250.0}
    assert set(kwargs["vision_timesteps"][n0:].tolist()) == {500.0}


def test_micro_batch_loss_by_hand():
    """Sample A: diffs [1, 2] -> MSE 2.5; sample B: diffs [2, 0, 0] -> MSE 4/3. Mean over samples 23/12, x10
    = 19.1667, / grad_accum 2 = 9.5833 (a per-token mean would give 9.0, a sum over samples 19.1667)."""
    preds = [torch.tensor([1.0, 3.0]), torch.tensor([2.0, 0.0, 0.0])]
    targets = [torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0, 0.0])]
    assert float(micro_batch_loss(preds, targets, 10.0, 2)) == pytest.approx(9.583333, rel=1e-6)
    assert float(micro_batch_loss(preds, targets, 10.0, 1)) == pytest.approx(19.166667, rel=1e-6)


def test_grad_clip_by_hand_and_against_torch():
    """Upstream's ``GradClip``: non-finite gradients are zeroed first (``force_finite``), then the total 2-norm is
    clipped as torch's ``clip_grad_norm_`` does."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, float("nan")]), torch.tensor([4.0])
    assert float(grad_clip([a, b], 1.0, force_finite=True)) == 5.0  # nan -> 0, |(3, 0, 4)| = 5
    torch.testing.assert_close(a.grad, torch.tensor([3.0, 0.0]) / (5.0 + 1e-6))
    torch.testing.assert_close(b.grad, torch.tensor([4.0]) / (5.0 + 1e-6))
    g = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.zeros(5)) for _ in range(3)]
    ref = [torch.nn.Parameter(torch.zeros(5)) for _ in range(3)]
    for p, q in zip(ours, ref):
        p.grad = torch.randn(5, generator=g)
        q.grad = p.grad.clone()
    torch.testing.assert_close(grad_clip(ours, 0.5), torch.nn.utils.clip_grad_norm_(ref, 0.5))
    assert all(torch.allclose(p.grad, q.grad, rtol=1e-6, atol=0) for p, q in zip(ours, ref))


def test_warmup_cosine_by_hand():
    """The recipe's schedule (warm-up 50, cycle 1000, f 0 -> 1 -> 0) and one with non-zero ends."""
    assert [warmup_cosine(s, 50, 1000, 0.0, 1.0, 0.0) for s in (0, 25, 50, 525, 1000, 2000)] == pytest.approx(
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0], abs=1e-12)  # 525: halfway through the cosine, (525-50)/(1000-50) = 0.5
    assert warmup_cosine(5, 10, 110, 0.2, 1.0, 0.1) == pytest.approx(0.6)  # 0.2 + 0.8 * 5/10
    assert warmup_cosine(60, 10, 110, 0.2, 1.0, 0.1) == pytest.approx(0.55)  # 0.1 + 0.45 * (1 + cos(pi/2))


def test_unequal_micro_batches_follow_the_recipe_rule():
    """3 + 1 samples: the recipe's rule 10 * (mean(m1, m2, m3) + m4) / 2, not the plain mean 10 * (m1+m2+m3+m4) / 4."""
    micro = [R.micro_batch(0, 0, n_samples=3), R.micro_batch(0, 1, n_samples=1)]
    model, _ = R.make_model()
    for samples in micro:
        R.loss_of(model, samples, grad_accum=2).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_model, _ = R.make_model()
    m = torch.cat([per_sample_mse(ref_model, samples) for samples in micro])
    recipe = grads_of(10.0 * ((m[0] + m[1] + m[2]) / 3 + m[3]) / 2, ref_model)
    plain = grads_of(10.0 * (m[0] + m[1] + m[2] + m[3]) / 4, ref_model)
    assert not grads_close(recipe, plain)  # the two rules really differ here
    assert grads_close(got, recipe)


def test_activation_checkpointing_gives_the_same_gradients():
    """The trainer's recipe runs with full activation checkpointing: the backward re-runs each layer's forward,
    which must still see the micro-batch's segment masks."""
    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        model, _ = R.make_model()
        if checkpointing:
            model.enable_gradient_checkpointing()
        model.train()
        for m in range(2):
            R.loss_of(model, R.micro_batch(0, m)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    assert grads_close(grads(True), grads(False))


# ------------------------------------------------------------------------------------- planted bugs
def _per_token_mean(preds, targets, loss_scale, grad_accum):
    """Planted bug: a per-token mean over the whole micro-batch instead of the per-sample mean."""
    num = sum(((p - t) ** 2).sum() for p, t in zip(preds, targets))
    den = sum(p.numel() for p in preds)
    return loss_scale * num / den / grad_accum


def _no_accum_division(preds, targets, loss_scale, grad_accum):
    """Planted bug: forgetting ``/ grad_accum_iter``."""
    return micro_batch_loss(preds, targets, loss_scale, 1)


@pytest.mark.parametrize("bug", [_per_token_mean, _no_accum_division], ids=["per-token-mean", "no-accum-division"])
def test_planted_wrong_normalisation_breaks_the_proof(bug):
    assert not grads_close(accumulated_grads(4, loss_fn=bug), reference_grads(4))


# ------------------------------------------------- 2 ranks x grad_accum 1  ==  1 rank x grad_accum 2
def _dp_worker(rank: int, world: int, out: str) -> None:
    model, _ = R.make_fsdp_model()
    # rank r trains micro-batch r, grad_accum 1; FSDP2 averages the gradients over ranks
    R.loss_of(model, R.micro_batch(0, rank), grad_accum=1).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    if rank == 0:
        torch.save(grads, out)


def test_two_ranks_equal_one_rank_with_grad_accum(tmp_path):
    out = str(tmp_path / "g.pt")
    launch(_dp_worker, 2, out)  # gloo ranks forked from a preloaded forkserver
    assert grads_close(torch.load(out), accumulated_grads(2))
