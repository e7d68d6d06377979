"""``miles_ext.levers.finite_step``: a non-finite loss or gradient skips the optimizer step, on every rank, exactly.

Claims (tiny H3, LoRA rank 8, AdamW, clip 0.05, CPU, fp32):

- one NaN element planted in one adapter gradient (the issue's fault): the step is skipped, the adapters and
  AdamW's state are bitwise what they were before it, one line says so and the guard counts it; the run that
  skipped the step ends bitwise where a run that never saw that step ends (a skip is a step that did not happen);
- a non-finite ``loss_sum`` whose gradients are finite (an inf constant added to the loss) is skipped too;
- two FSDP2 ranks (gloo): a NaN in one rank's local gradient shard, or an inf loss on one rank only, makes *both*
  ranks skip, and the adapters stay finite and unchanged on both;
- ``max_consecutive`` skips in a row stop the run; the checkpoint refuses NaN tensors.

Planted bugs, each shown to fail the check above it: the unguarded step (clip + ``step()`` as before the fix)
writes NaN into the adapters; a guard that ignores the losses takes the inf-loss step; a guard that decides per
rank (no all-reduce) lets the two ranks disagree.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from miles_ext.levers import finite_step
from miles_ext.recipe import sft
from miles_ext.levers.finite_step import NonFiniteGuard, NonFiniteTraining, require_finite
from miles_ext.recipe.schedule import pair_schedule
from tests.equivalence.h3_tiny_run import rank_schedule
from tests.equivalence.h3_ranks import cpu_mesh, launch

SEED, CLIP, GBS, STEPS = 7, 0.05, 4, 3
BAD_STEP = 1


class AlwaysStep(NonFiniteGuard):
    """Planted bug: the step is always taken (the code before the fix)."""

    def take_step(self, micro_losses, grad_norm):
        super().take_step(micro_losses, grad_norm)
        return True


class IgnoresLoss(NonFiniteGuard):
    """Planted bug: only the gradient norm is looked at."""

    def take_step(self, micro_losses, grad_norm):
        return super().take_step([], grad_norm)


def _adapters(model) -> dict[str, torch.Tensor]:
    from miles_ext.levers.lora import lora_parameters

    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in lora_parameters(model).items()}


def _opt_state(opt) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]
            if p in opt.state]


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def _plant_nan_grad(model) -> None:
    """One NaN element in one adapter gradient (the local shard under FSDP2)."""
    from miles_ext.levers.lora import lora_parameters

    p = next(iter(lora_parameters(model).values()))
    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
    g.view(-1)[3] = float("nan")


def _inf_loss(real):
    """``micro_batch_loss_sum`` plus an inf constant: the loss is inf, its gradients stay finite."""
    def loss_sum(*args, **kwargs):
        return real(*args, **kwargs) + torch.tensor(float("inf"))
    return loss_sum


def single_run(steps: list[int], fault: str | None = None, guard_cls=NonFiniteGuard) -> dict[str, Any]:
    """Train the optimizer steps ``steps`` (indices into a 3-step schedule) on one process (no FSDP); step
    ``BAD_STEP`` gets ``fault`` ("grad": a NaN gradient element, "loss": an inf loss). Records the adapters and the
    AdamW state around every step."""
    from tests.equivalence.h3_tiny_run import OPTIM, make_lora_model, synthetic_pairs

    sched = pair_schedule(GBS, 2, STEPS, 1)
    pairs = synthetic_pairs(GBS * STEPS)
    model = make_lora_model(seed=SEED)
    opt = torch.optim.AdamW(list(_adapters_params(model)), **OPTIM)
    lines: list[str] = []
    guard = guard_cls(say=lines.append)
    out: dict[str, Any] = {"before": [], "after": [], "opt_before": [], "opt_after": []}
    for s in steps:
        out["before"].append(_adapters(model))
        out["opt_before"].append(_opt_state(opt))
        bad = fault if s == BAD_STEP else None
        patch = (mock.patch.object(sft, "micro_batch_loss_sum", _inf_loss(sft.micro_batch_loss_sum))
                 if bad == "loss" else contextlib.nullcontext())
        with patch:
            sft.train_step(model, opt, sched[s], pairs, seed=SEED, max_grad_norm=CLIP, guard=guard,
                           after_backward=(lambda: _plant_nan_grad(model)) if bad == "grad" else None)
        out["after"].append(_adapters(model))
        out["opt_after"].append(_opt_state(opt))
    out.update(lines=lines, skipped=guard.skipped_steps, summary=guard.summary())
    return out


def _adapters_params(model):
    from miles_ext.levers.lora import lora_parameters

    return lora_parameters(model).values()


def skip_problems(run: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """What is wrong with ``run`` (steps 0, 1 = faulty, 2) against ``reference`` (steps 0, 2): empty when the
    faulty step was skipped exactly."""
    problems = []
    if run["skipped"] != 1 or len(run["lines"]) != 1 or "skipped" not in run["lines"][0]:
        problems.append(f"skips counted {run['skipped']}, lines {run['lines']}")
    if not _equal(run["after"][1], run["before"][1]):
        problems.append("adapters changed by the faulty step")
    if not _equal(run["opt_after"][1], run["opt_before"][1]):
        problems.append("AdamW state changed by the faulty step")
    if not all(bool(torch.isfinite(t).all()) for t in run["after"][-1].values()):
        problems.append("adapters not finite")
    if not _equal(run["after"][-1], reference["after"][-1]) or not _equal(run["opt_after"][-1], reference["opt_after"][-1]):
        problems.append("the run does not end where a run without the faulty step ends")
    return problems


@pytest.fixture(scope="module")
def reference():
    return single_run([0, 2])


def test_one_nan_gradient_element_skips_the_step_exactly(reference):
    run = single_run([0, 1, 2], fault="grad")
    assert skip_problems(run, reference) == []
    assert "gradient norm nan" in run["lines"][0] and "adapters and AdamW state unchanged" in run["lines"][0]
    assert run["summary"]["nonfinite_skipped_steps"] == 1
    assert run["summary"]["nonfinite_skips"][0]["step"] == 1 and math.isnan(run["summary"]["nonfinite_skips"][0]["grad_norm"])
    assert not _equal(run["after"][0], run["before"][0])  # the good steps do train


def test_planted_unguarded_step_poisons_the_adapters(reference):
    problems = skip_problems(single_run([0, 1, 2], fault="grad", guard_cls=AlwaysStep), reference)
    assert "adapters not finite" in problems and "adapters changed by the faulty step" in problems


def test_nonfinite_loss_with_finite_gradients_is_skipped(reference):
    run = single_run([0, 1, 2], fault="loss")
    assert skip_problems(run, reference) == []
    assert "non-finite loss in 4 of 4 micro-batches" in run["lines"][0]


def test_planted_guard_ignoring_the_loss_takes_the_step(reference):
    problems = skip_problems(single_run([0, 1, 2], fault="loss", guard_cls=IgnoresLoss), reference)
    assert "adapters changed by the faulty step" in problems


def test_too_many_skips_in_a_row_stop_the_run():
    lines: list[str] = []
    guard = NonFiniteGuard(max_consecutive=2, say=lines.append)
    assert guard.take_step([float("nan")], torch.tensor(1.0)) is False
    assert guard.take_step([1.0], torch.tensor(2.0)) is True  # a good step resets the count
    assert guard.take_step([1.0], torch.tensor(float("inf"))) is False
    with pytest.raises(NonFiniteTraining, match="2 optimizer steps in a row"):
        guard.take_step([1.0], torch.tensor(float("nan")))
    assert guard.skipped_steps == 3 and len(lines) == 3
    assert NonFiniteGuard(max_consecutive=0, say=lines.append).take_step([float("nan")], None) is False


def test_the_checkpoint_refuses_nan_adapters():
    require_finite({"a": torch.ones(2), "steps": torch.tensor(3)}, "ckpt")
    with pytest.raises(NonFiniteTraining, match="ckpt: b holds NaN/inf"):
        require_finite({"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])}, "ckpt")


# ------------------------------------------------------------------------------------ two FSDP2 ranks
def multi_run(rank: int, fault: str) -> dict[str, Any]:
    """This rank's part of a 2-rank FSDP2 (CPU offload, fp32) run of 3 steps; on step ``BAD_STEP`` rank 1 plants a
    NaN in its local gradient shard ("grad") or rank 0 alone sees an inf loss ("loss")."""
    from miles_ext.levers.fsdp_policy import apply_fsdp2
    from miles_ext.levers.lora import lora_parameters
    from tests.equivalence.h3_tiny_run import OPTIM, make_lora_model, synthetic_pairs

    plan = rank_schedule(GBS, 2, rank, STEPS, 1)
    pairs = synthetic_pairs(GBS * STEPS)
    model = make_lora_model(seed=SEED)
    apply_fsdp2(model, cpu_offload=True, param_dtype=None, reduce_dtype=torch.float32, mesh=cpu_mesh())
    opt = torch.optim.AdamW(list(lora_parameters(model).values()), **OPTIM)
    guard = NonFiniteGuard(say=lambda line: None)
    before_bad = after_bad = None
    for s, slots in enumerate(plan):
        bad = s == BAD_STEP
        plant = bad and fault == "grad" and rank == 1
        inf = bad and fault.startswith("loss") and rank == 0
        if bad:
            before_bad = _adapters(model)
        with mock.patch.object(sft, "micro_batch_loss_sum", _inf_loss(sft.micro_batch_loss_sum) if inf
                               else sft.micro_batch_loss_sum):
            sft.train_step(model, opt, slots, pairs, seed=SEED, max_grad_norm=CLIP, guard=guard,
                           after_backward=(lambda: _plant_nan_grad(model)) if plant else None)
        if bad:
            after_bad = _adapters(model)
    final = _adapters(model)
    return {"skips": [r["step"] for r in guard.skips], "unchanged": _equal(before_bad, after_bad),
            "finite": all(bool(torch.isfinite(t).all()) for t in final.values())}


def _two_rank_worker(rank: int, world: int, out_dir: str) -> None:
    res = {fault: multi_run(rank, fault) for fault in ("grad", "loss")}
    with mock.patch.object(finite_step, "agree_max", lambda value, device: value):  # planted: per-rank decision
        res["loss_planted_local_decision"] = multi_run(rank, "loss")
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("h3_finite")
    launch(_two_rank_worker, 2, str(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def rank_problems(per_rank: list[dict[str, Any]]) -> list[str]:
    """Empty when both ranks skipped exactly the faulty step and kept finite, unchanged adapters."""
    problems = []
    if per_rank[0]["skips"] != per_rank[1]["skips"]:
        problems.append(f"ranks disagree: skips {per_rank[0]['skips']} vs {per_rank[1]['skips']}")
    for r, res in enumerate(per_rank):
        if res["skips"] != [BAD_STEP] or not res["unchanged"] or not res["finite"]:
            problems.append(f"rank {r}: {res}")
    return problems


@pytest.mark.parametrize("fault", ["grad", "loss"])
def test_both_ranks_skip_when_one_rank_sees_the_fault(two_ranks, fault):
    assert rank_problems([two_ranks[0][fault], two_ranks[1][fault]]) == []


def test_planted_per_rank_decision_makes_the_ranks_disagree(two_ranks):
    per_rank = [two_ranks[r]["loss_planted_local_decision"] for r in range(2)]
    assert any("ranks disagree" in p for p in rank_problems(per_rank))
