"""The recipe's training-step math, shared by the trainer and the equivalence tests.

Each function is one upstream rule (cosmos-framework, see NVIDIA cosmos-framework's code):
flow-matching loss normalisation, grad clipping with ``force_finite``, the warm-up + cosine schedule.
"""

from __future__ import annotations

import math

import torch

from patches.core.device import to_device


def flow_matching_inputs(
    x0: torch.Tensor, noise: torch.Tensor, sigma: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rectified-flow interpolation: ``x_t = (1 - sigma) x0 + sigma noise`` and velocity ``v = noise - x0``.

    Shapes: ``x0``, ``noise`` any equal shape (a latent, [1, 48, T, H, W]); ``sigma`` in [0, 1].
    """
    xt = (1.0 - sigma) * x0 + sigma * noise
    return xt, noise - x0


def packed_flow_matching_inputs(
    x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor, sizes: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flow_matching_inputs` of a micro-batch's samples concatenated: a handful of operations instead of a
    handful per sample.

    Sample ``i`` is ``sizes[i]`` consecutive values of ``x0`` and ``noise`` with its own ``sigmas[i]``. Every value is
    computed by the same fp32 operations as ``flow_matching_inputs(x0_i, noise_i, float(sigmas[i]))`` (a Python
    float ``s`` multiplies as the fp32 ``s``, and ``1 - s`` rounds once either way), so the results are equal bit for
    bit (``tests/equivalence/test_recipe.py``).

    Args:
        x0, noise: fp32 [sum(sizes)] on one device.
        sigmas: fp32 [len(sizes)] (a host tensor; sent to a GPU from pinned memory without a synchronize).
        sizes: values per sample.

    Returns:
        (x_t, v), each fp32 [sum(sizes)].

    Raises:
        ValueError: ``sizes`` and ``sigmas`` differ in length, or ``sizes`` does not add up to the values given.
    """
    total = sum(sizes)
    if len(sizes) != sigmas.numel() or total != x0.numel() or total != noise.numel():
        raise ValueError(f"{len(sizes)} sizes adding up to {total} for {sigmas.numel()} sigmas and "
                         f"{x0.numel()}/{noise.numel()} values")
    counts = to_device(torch.tensor(sizes, dtype=torch.long), x0.device)
    sigma = to_device(sigmas, x0.device).repeat_interleave(counts, output_size=total)
    return flow_matching_inputs(x0, noise, sigma)


def micro_batch_loss(
    preds: list[torch.Tensor], targets: list[torch.Tensor], loss_scale: float, grad_accum_iter: int
) -> torch.Tensor:
    """The loss one micro-batch backwards: ``loss_scale * mean_i(mean((pred_i - v_i)^2)) / grad_accum_iter``.

    Upstream (``flow_matching.py``; trainer ``loss / grad_accum_iter``): a per-sample mean squared error
    (computed in fp32), averaged over the micro-batch's samples -- not per token -- times the loss scale,
    then divided by the number of accumulated micro-batches. Returns a 0-d fp32 tensor.

    Raises:
        ValueError: no samples, or ``grad_accum_iter`` < 1.
    """
    if not preds or len(preds) != len(targets):
        raise ValueError(f"need one target per prediction, got {len(preds)} predictions, {len(targets)} targets")
    if grad_accum_iter < 1:
        raise ValueError(f"grad_accum_iter must be >= 1, got {grad_accum_iter}")
    per_sample = torch.stack([(p.float() - t.float()).pow(2).mean() for p, t in zip(preds, targets)])
    return loss_scale * per_sample.mean() / grad_accum_iter


@torch.no_grad()
def grad_clip(params: list[torch.nn.Parameter], max_norm: float, force_finite: bool = True) -> torch.Tensor:
    """Upstream ``GradClip`` callback: total 2-norm over all gradients; non-finite -> ``nan_to_num`` first; then clip.

    Returns the total norm before clipping (0-d tensor).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    if force_finite and not torch.isfinite(total):
        for g in grads:
            torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0)
        total = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        if hasattr(total, "full_tensor"):
            total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, total, foreach=True)
    return total


def warmup_cosine(step: int, warm_up: int, cycle_length: int, f_start: float, f_max: float, f_min: float) -> float:
    """Upstream ``LambdaWarmUpCosineScheduler`` multiplier at optimizer step ``step`` (one cycle).

    Linear ``f_start -> f_max`` over ``warm_up`` steps, then cosine ``f_max -> f_min`` until ``cycle_length``;
    ``f_min`` afterwards.
    """
    if step < warm_up:
        return f_start + (f_max - f_start) * step / max(warm_up, 1)
    t = min((step - warm_up) / max(cycle_length - warm_up, 1), 1.0)
    return f_min + 0.5 * (f_max - f_min) * (1.0 + math.cos(t * math.pi))
