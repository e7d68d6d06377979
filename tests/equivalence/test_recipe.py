"""Grad accumulation trains the same thing as data parallelism: the recipe's normalisation, proven.

Upstream backwards ``loss / grad_accum_iter`` per micro-batch, where a micro-batch loss is
``loss_scale * mean over samples of the per-sample MSE``; FSDP2 then averages over ranks. So the stock
8-GPU step (8 ranks x grad_accum 2) takes the mean over 16 micro-batch means, and one GPU with
grad_accum 16 takes the same mean. Tolerance: fp32, relative 1e-5 (the sums run in another order).
"""

from __future__ import annotations

import pytest
import torch

from cosmos_framework_ext.recipe import micro_batch_loss
from tests.equivalence import tiny_recipe as R

RTOL, ATOL = 1e-5, 1e-7


def accumulated_grads(n_micro: int, loss_fn=micro_batch_loss) -> dict[str, torch.Tensor]:
    model, _ = R.make_model()
    for m in range(n_micro):
        R.loss_of(model, R.micro_batch(0, m), grad_accum=n_micro, loss_fn=loss_fn).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_grads(n_micro: int) -> dict[str, torch.Tensor]:
    """Autograd of the written-out objective: 10 * mean_m( mean_i MSE_mi ), one graph."""
    model, _ = R.make_model()
    per_micro = []
    for m in range(n_micro):
        per_micro.append(R.loss_of(model, R.micro_batch(0, m), grad_accum=1) / 10.0)
    (10.0 * torch.stack(per_micro).mean()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def grads_close(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=RTOL, atol=ATOL) for k in a)


def test_accumulated_equals_reference_normalisation():
    assert grads_close(accumulated_grads(4), reference_grads(4))


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
def _dp_worker(rank: int, world: int, port: int, out: str) -> None:
    with R.gloo_rank(rank, world, port):
        model, _ = R.make_fsdp_model()
        # rank r trains micro-batch r, grad_accum 1; FSDP2 averages the gradients over ranks
        R.loss_of(model, R.micro_batch(0, rank), grad_accum=1).backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        if rank == 0:
            torch.save(grads, out)


def test_two_ranks_equal_one_rank_with_grad_accum(tmp_path):
    out = str(tmp_path / "g.pt")
    torch.multiprocessing.spawn(_dp_worker, args=(2, R.free_port(), out), nprocs=2, join=True)
    assert grads_close(torch.load(out), accumulated_grads(2))
