"""``miles_ext.recipe.schedule``'s 8->1 schedule: one GPU trains what N GPUs train (MiniMax-H3 LoRA SFT, N ranks x 1
micro-batch == 1 rank x N accumulated), and the schedule / seeding units it rests on.

The N-rank side is upstream's semantics, stated independently (:func:`tests.equivalence.h3_tiny_run.rank_schedule`):
contiguous DP split, per-rank windows, ``microbatch_id`` counted per rank, ``dp_rank`` = rank, every rank
backprops ``loss_sum / num_local_pairs`` and FSDP2 averages over ranks. The 1-rank side runs
:func:`miles_ext.recipe.schedule.pair_schedule`: micro-batch j of a step trains rank j's pairs with rank j's seed
identity. Both sides: the tiny H3 preset with LoRA (rank 8, gaussian init), FSDP2 with CPU offload, fp32
throughout (master, compute and reduce), grad clip 0.05 (:func:`miles_ext.levers.fsdp_policy.clip_offloaded_grad_norm`;
active: the step-1 norm is about 0.09, so the sharded norm is exercised too), the recipe's batch (rollout 32,
4 steps per rollout -> global batch 8, micro-batch 1). N = 8, 4 and 2; 3 steps each.

Claims (relative error per tensor: ``max|a - b| <= rtol * max|a|``):

- LoRA gradients after step 1 (before clipping): rtol 1e-6.
- LoRA weights after 3 steps with SGD + momentum: rtol 1e-6. The weights are then a fixed linear function of
  the gradients, so the gradient-level agreement carries over.
- LoRA weights after 3 steps with AdamW (the recipe's optimizer, eps 1e-8): rtol 2e-4. Adam normalises every
  element by its own gradient history, so the error that matters is the *per-element* relative error of the
  gradients; for elements many orders of magnitude below their tensor's largest one, the 1e-7 per-tensor
  rounding noise is a much larger relative error. Measured: 1e-5 .. 4e-5 (SGD: 3e-7; gradients: 1.4e-7 ..
  1.9e-7); the planted data bugs are ~2 (see below for the scale bug).

Why a tolerance at all: the sum over the step's 8 pairs is formed in a different order. On N ranks each rank
accumulates its share in autograd and gloo's reduce-scatter adds the N partial sums; on 1 rank autograd
accumulates all 8 in sequence. fp32 addition is not associative, so the results differ in the last bits
(measured 1.4e-7 .. 1.9e-7 for the gradients; the 1/8 scale is a power of two and exact either way). The
lora_A gradients of step 1 are exactly zero on both sides (lora_B starts at zero) and are compared exactly.

Planted bugs on the 1-rank side, each of which must break the proof: a world-size term in the global batch
(the 8-GPU per-rank batch kept on 1 GPU), a per-micro-batch mean instead of ``loss_sum / num_local_pairs``,
and the naive seed mapping of a plain 1-GPU run (``microbatch_id`` counted over the 1-GPU step, ``dp_rank``
0) with the right pairs. All three break the gradient check by orders of magnitude. The per-micro-batch mean
only scales the gradients (x8); the active clip and Adam's scale invariance hide a scale from the weights, so
that bug is visible in the gradients only -- which is why the gradients, not just the weights, are compared.

Independent anchor: both sides run the same normaliser, so a scale they share (``loss_sum / (2 num_local_pairs)``)
would pass the proof; the step-1 gradients of the 8- and 2-rank runs and of their emulations are therefore also
compared (rtol 1e-6) with the mean over the step's 8 pair losses written out in one process
(``test_h3_sft.py`` pins the per-rank ``loss_sum / num_local_pairs`` by hand too).

Ranks are real processes in a gloo group (:func:`tests.equivalence.h3_ranks.launch`: forkserver, free port).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_ext.recipe.schedule import MicroBatchSlot, derive_batch, pair_schedule
from tests.equivalence.h3_tiny_run import rank_schedule
from patches.core.runtime import stable_hash
from tests.equivalence.h3_ranks import cpu_mesh, launch

ROLLOUT, STEPS_PER_ROLLOUT, MBS, SEED = 32, 4, 1, 1234
GBS, _ = derive_batch(ROLLOUT, 8, num_steps_per_rollout=STEPS_PER_ROLLOUT)  # 8: no world-size term
STEPS = 3
WORLDS = (8, 4, 2)
OPTIMIZERS = ("adamw", "sgd")
RTOL = {"grads": 1e-6, "sgd": 1e-6, "adamw": 2e-4}
SGD = dict(lr=0.5, momentum=0.9)
MAX_GRAD_NORM = 0.05
BUGS = ("bug_world_size_term", "bug_per_micro_batch_mean", "bug_seed_mapping")

Plan = list[list[MicroBatchSlot]]


# ------------------------------------------------------------------------------------------ one run
def run(plan: Plan, *, optim: str = "adamw", normaliser=None) -> dict[str, dict[str, torch.Tensor]]:
    """Train ``plan`` (this rank's micro-batch slots per step) on a fresh FSDP2 (CPU offload, fp32) tiny H3 with
    LoRA. Returns full (unsharded) LoRA weights before training (``init``), gradients after step 1 before
    clipping (``grads``) and weights after the last step (``weights``). Collective: every rank must call it."""
    from miles_ext.levers.fsdp_policy import apply_fsdp2
    from miles_ext.levers.lora import lora_parameters
    from miles_ext.recipe.sft import loss_over_local_pairs, train_step
    from tests.equivalence.h3_tiny_run import OPTIM, make_lora_model, synthetic_pairs

    pairs = synthetic_pairs(GBS * STEPS_PER_ROLLOUT)
    model = make_lora_model()
    apply_fsdp2(model, cpu_offload=True, param_dtype=None, reduce_dtype=torch.float32, mesh=cpu_mesh())
    lora = lora_parameters(model)
    params = list(lora.values())
    opt = torch.optim.AdamW(params, **OPTIM) if optim == "adamw" else torch.optim.SGD(params, **SGD)
    out: dict[str, dict[str, torch.Tensor]] = {"grads": {}}
    out["init"] = {n: p.full_tensor().detach().clone() for n, p in lora.items()}

    def snapshot_grads() -> None:
        if not out["grads"]:
            out["grads"] = {n: p.grad.full_tensor().clone() for n, p in lora.items()}

    for slots in plan:
        train_step(model, opt, slots, pairs, seed=SEED, max_grad_norm=MAX_GRAD_NORM,
                   normaliser=normaliser or loss_over_local_pairs, after_backward=snapshot_grads)
    out["weights"] = {n: p.full_tensor().detach().clone() for n, p in lora.items()}
    return out


def _n_rank_worker(rank: int, world: int, out_dir: str) -> None:
    plan = rank_schedule(GBS, world, rank, STEPS_PER_ROLLOUT, MBS)[:STEPS]
    result = {o: run(plan, optim=o) for o in OPTIMIZERS}
    if rank == 0:
        torch.save(result, Path(out_dir) / f"world{world}.pt")


# --------------------------------------------------------------------------------------- planted bugs
def _per_micro_batch_mean(loss_sum: torch.Tensor, micro_pairs: int, num_local_pairs: int) -> torch.Tensor:
    """Planted bug: each micro-batch's own mean instead of ``loss_sum / num_local_pairs``."""
    return loss_sum / micro_pairs


def _world_size_term_plan() -> Plan:
    """Planted bug: global batch = micro_batch_size x world_size x per-rank accumulation (world 1, and the 8-GPU
    recipe's accumulation of 1), i.e. the 8-GPU per-rank batch kept on 1 GPU: 1 pair per optimizer step."""
    gbs_bug = MBS * 1 * 1
    return rank_schedule(gbs_bug, 1, 0, ROLLOUT // gbs_bug, MBS)[:STEPS]


def _naive_seed_plan(world: int) -> Plan:
    """Planted bug: the right pairs, but a plain 1-GPU run's seed identity (counter over its micro-batches,
    dp_rank 0)."""
    plan = pair_schedule(GBS, world, STEPS_PER_ROLLOUT, MBS)[:STEPS]
    counter = iter(range(10**6))
    return [[dataclasses.replace(s, microbatch_id=next(counter), dp_rank=0) for s in step] for step in plan]


def _one_rank_worker(rank: int, world: int, out_dir: str) -> None:
    results: dict[str, Any] = {
        f"emulate{n}": {o: run(pair_schedule(GBS, n, STEPS_PER_ROLLOUT, MBS)[:STEPS], optim=o) for o in OPTIMIZERS}
        for n in WORLDS
    }
    results["bug_world_size_term"] = run(_world_size_term_plan())
    results["bug_per_micro_batch_mean"] = run(pair_schedule(GBS, 8, STEPS_PER_ROLLOUT, MBS)[:STEPS],
                                              normaliser=_per_micro_batch_mean)
    results["bug_seed_mapping"] = run(_naive_seed_plan(8))
    torch.save(results, Path(out_dir) / "world1.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("h3_topology")
    timings = {}
    for world in (*WORLDS, 1):
        t0 = time.perf_counter()
        launch(_one_rank_worker if world == 1 else _n_rank_worker, world, str(out))
        timings[world] = round(time.perf_counter() - t0, 1)
    print("\nseconds per launch (world: s):", timings)
    res: dict[str, Any] = {f"world{w}": torch.load(out / f"world{w}.pt") for w in WORLDS}
    res.update(torch.load(out / "world1.pt"))
    for w in WORLDS:
        ref, got = res[f"world{w}"], res[f"emulate{w}"]
        print(f"world {w}: grads rel {rel_err(ref['adamw']['grads'], got['adamw']['grads']):.1e}, weights rel "
              + ", ".join(f"{o} {rel_err(ref[o]['weights'], got[o]['weights']):.1e}" for o in OPTIMIZERS))
    return res


def rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of max|a - b| / max|a| (0 where both are exactly equal, inf on key or dtype mismatch)."""
    if a.keys() != b.keys() or any(a[k].dtype != b[k].dtype for k in a):
        return float("inf")
    worst = 0.0
    for k in a:
        diff = float((a[k] - b[k]).abs().max())
        if diff:
            scale = float(a[k].abs().max())
            worst = max(worst, diff / scale if scale else float("inf"))
    return worst


# ------------------------------------------------------------------------------------------- proofs
@pytest.mark.parametrize("world", WORLDS)
def test_one_rank_equals_n_ranks_gradients_after_one_step(results, world):
    ref, got = results[f"world{world}"]["adamw"]["grads"], results[f"emulate{world}"]["adamw"]["grads"]
    assert len(ref) == 36 and all(v.dtype == torch.float32 for v in ref.values())
    assert all(float(v.abs().max()) > 0 for k, v in ref.items() if ".lora_B." in k)
    assert rel_err(ref, got) <= RTOL["grads"]
    assert all(torch.equal(ref[k], got[k]) for k in ref if ".lora_A." in k)  # exactly zero on both sides


@pytest.mark.parametrize("optim", OPTIMIZERS)
@pytest.mark.parametrize("world", WORLDS)
def test_one_rank_equals_n_ranks_weights_after_three_steps(results, world, optim):
    ref, got = results[f"world{world}"][optim], results[f"emulate{world}"][optim]
    assert all(torch.equal(ref["init"][k], got["init"][k]) for k in ref["init"])  # same start
    # every adapter moved (lora_A only from step 2 on), so the comparison is not vacuous
    assert all(not torch.equal(ref["init"][k], ref["weights"][k]) for k in ref["init"])
    assert rel_err(ref["weights"], got["weights"]) <= RTOL[optim]


@pytest.mark.parametrize("bug", BUGS)
def test_planted_bug_breaks_the_proof(results, bug):
    ref, got = results["world8"]["adamw"], results[bug]
    # every bug already shows in the first step's gradients
    assert rel_err(ref["grads"], got["grads"]) > 1000 * RTOL["grads"]
    # A per-micro-batch mean is a pure scale (x8) of the gradients: the active clip rescales both sides to the
    # same norm and Adam is scale-invariant, so the weights barely show it (measured 9e-6). That is why the proof
    # compares gradients, not only weights. The data bugs also show in the weights.
    if bug != "bug_per_micro_batch_mean":
        assert rel_err(ref["weights"], got["weights"]) > 100 * RTOL["adamw"]


def _hand_step_grads(world: int) -> dict[str, torch.Tensor]:
    """Step 1's gradient written out, in one process without FSDP: (sum over the step's 8 pairs of their pair
    loss, each drawn with the seed identity of the rank that trains it under ``world`` ranks) / 8."""
    from miles_ext.levers.lora import lora_parameters
    from miles_ext.recipe.sft import draw_micro_batch, pair_loss
    from tests.equivalence.h3_tiny_run import make_lora_model, synthetic_pairs

    pairs = synthetic_pairs(GBS * STEPS_PER_ROLLOUT)
    model = make_lora_model()
    losses = []
    for rank in range(world):
        for slot in rank_schedule(GBS, world, rank, STEPS_PER_ROLLOUT, MBS)[0]:
            noised = draw_micro_batch([pairs[i] for i in slot.pairs], seed=SEED, rollout_id=slot.rollout_id,
                                      microbatch_id=slot.microbatch_id, dp_rank=slot.dp_rank)
            losses += [pair_loss(model, x) for x in noised]
    assert len(losses) == GBS == 8
    lora = lora_parameters(model)
    return dict(zip(lora, torch.autograd.grad(torch.stack(losses).sum() / 8, list(lora.values()))))


@pytest.mark.parametrize("world", (8, 2))
def test_gradient_scale_equals_the_hand_computed_mean_over_pairs(results, world):
    """Independent anchor: both sides of the topology proof run ``loss_over_local_pairs``, so a scale they share
    would pass it. The real N-rank FSDP2 gradients and their 1-rank emulation must both equal the mean over the
    step's pairs computed by hand (loss_sum / num_local_pairs per rank, then FSDP2's mean over ranks)."""
    hand = _hand_step_grads(world)
    for got in (results[f"world{world}"]["adamw"]["grads"], results[f"emulate{world}"]["adamw"]["grads"]):
        assert rel_err(hand, got) <= RTOL["grads"]


def test_emulations_of_different_topologies_differ(results):
    """The seed identity includes dp_rank: 8-, 4- and 2-GPU runs draw different noise, so the proof needs the
    emulated topology, not just 'some' schedule."""
    a, b = results["emulate8"]["adamw"]["grads"], results["emulate4"]["adamw"]["grads"]
    assert rel_err(a, b) > 1e-2


# -------------------------------------------------------------------------------- schedule unit tests
@pytest.mark.parametrize("gbs,world,nsteps,mbs", [(8, 8, 4, 1), (8, 4, 4, 1), (8, 2, 4, 2), (12, 3, 2, 2), (16, 8, 3, 2)])
def test_pair_schedule_is_the_n_rank_schedule_regrouped(gbs, world, nsteps, mbs):
    emulated = pair_schedule(gbs, world, nsteps, mbs)
    ranks = [rank_schedule(gbs, world, r, nsteps, mbs) for r in range(world)]
    for s in range(nsteps):
        want = [(x.pairs, x.seed_identity) for r in range(world) for x in ranks[r][s]]
        assert [(x.pairs, x.seed_identity) for x in emulated[s]] == want
        assert [x.index for x in emulated[s]] == list(range(gbs // mbs))
    every = sorted(p for step in emulated for x in step for p in x.pairs)
    assert every == list(range(gbs * nsteps))  # each pair exactly once per rollout


def test_recipe_grouping_matches_the_upstream_parity_caveat():
    """Upstream doc §2: 8 ranks x 1 micro-batch put pairs {s, 4+s, ..., 28+s} into step s."""
    sched = pair_schedule(8, 8, 4, 1)
    assert [x.pairs[0] for x in sched[1]] == [1, 5, 9, 13, 17, 21, 25, 29]
    assert [x.seed_identity for x in sched[1]][:2] == [(0, 1, 0), (0, 1, 1)]
    assert [x.pairs for x in rank_schedule(8, 1, 0, 4, 1)[1]] == [(i,) for i in range(8, 16)]  # plain 1 GPU


@pytest.mark.parametrize("args", [(9, 8, 4, 1), (8, 8, 4, 2), (0, 1, 1, 1)])
def test_schedules_refuse_what_upstream_refuses(args):
    with pytest.raises(ValueError):
        pair_schedule(*args)


def test_stable_hash_is_63_bit_and_deterministic():
    h = stable_hash("sample", 1234, 0, 3, 5)
    assert h == stable_hash("sample", 1234, 0, 3, 5) and 0 <= h < 2**63
    assert h != stable_hash("sample", 1234, 0, 5, 3)
    assert torch.Generator().manual_seed(h).initial_seed() == h
