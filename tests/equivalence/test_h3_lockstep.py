"""Lockstep micro-batches (``miles_ext.levers.lockstep``) change no value and gather each offloaded block once per
group instead of once per micro-batch.

Claims, on the tiny H3 preset with 5 transformer blocks and LoRA (fp32, CPU, one gloo rank), 2 optimizer steps
(AdamW, clip 0.05), the independent reference being the recipe's sequential accumulation
(:func:`miles_ext.recipe.sft.train_step` without the lever) of the same model:

- at 2 and at 3 micro-batches per step in one lockstep group the LoRA gradients of step 1, the per-micro-batch losses
  and the LoRA weights after 2 steps are **bitwise** the sequential run's: without FSDP, under FSDP2 with every unit
  on the device, and under full CPU offload (exact arena), in fp32 and with the recipe's bf16 base and bf16 adapter
  compute (fp32 reduce);
- under full offload each block unit (and its adapter unit) is gathered twice per lockstep group (forward, backward)
  instead of twice per micro-batch, never more units are gathered at one moment than in the sequential step (when
  one micro-batch's backward runs ahead of the other's, at most one more block), and every unit is sharded again,
  with its own reshard settings, after the step;
- a micro-batch that raises stops the group: the caller gets its exception, no lockstep thread is left, every unit's
  reshard setting is back.

Also when the steps run in a fresh thread (its autograd sequence numbers start at 0, below the workers' graphs).

Planted bugs, each failing its own check: the forward's deferral missing (the gather count), the backward started at
the caller's losses (the gather count in a fresh thread), the units' settings
not restored after a micro-batch failed (the settings check), the micro-batches' gradients summed by autograd in bf16
(the bf16 gradients), the losses returned in finishing order (the
per-micro-batch losses).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.equivalence.h3_ranks import cpu_mesh, launch
from tests.equivalence.test_h3_residency import _equal

STEPS, LAYERS = 2, 5
FSDP = {"none": None, "resident": dict(cpu_offload=False), "offload": dict(cpu_offload=True, exact_pin=True)}


def _preset():
    from miles_ext.recipe.presets import TINY

    return dataclasses.replace(TINY, num_layers=LAYERS)


def _plant(bug: str):
    """Planted bugs (undone by the caller's ``finally``): returns the undo."""
    from miles_ext.levers import lockstep as ls

    cls = ls.Lockstep
    if bug == "no_forward_defer":
        real = cls._pre_hook

        def pre(self, module, args):
            real(self, module, args)
            for g in self._unit_groups.get(id(module), ()):  # every caller reshards as configured
                if self._saved_mesh.get(id(g)) is not None:
                    g.post_forward_mesh_info = self._saved_mesh[id(g)]

        cls._pre_hook = pre
        return lambda: setattr(cls, "_pre_hook", real)
    if bug == "not_restored":
        real_r = cls._restore_mesh
        cls._restore_mesh = lambda self: self._saved_mesh.clear()
        return lambda: setattr(cls, "_restore_mesh", real_r)
    if bug == "shared_grad":
        real_own = cls._own_gradients
        cls._own_gradients = lambda self, unit, w: None  # every call uses the parameter itself: autograd sums
        return lambda: setattr(cls, "_own_gradients", real_own)
    if bug == "caller_roots":
        real_bw = cls.backward

        def backward(self, losses):  # the engine started at the caller's losses (the order before the fix)
            self._roots = []
            return real_bw(self, losses)

        cls.backward = backward
        return lambda: setattr(cls, "backward", real_bw)
    if bug == "finish_order":
        real_run = cls.run
        cls.run = lambda self, fns: list(reversed(real_run(self, fns)))
        return lambda: setattr(cls, "run", real_run)
    assert not bug
    return lambda: None


class _GatherCount:
    """Counts, per FSDP2 param group, the gathers (sharded to unsharded), and the most groups gathered at one moment
    (``peak``)."""

    def __init__(self):
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        self.cls, self.counts, self.peak = FSDPParamGroup, {}, 0
        self.real = {n: getattr(FSDPParamGroup, n) for n in ("_to_unsharded", "_to_sharded")}
        counts, real, gathered = self.counts, self.real, set()

        def to_unsharded(group):  # reached only by a wait_for_unshard with an unshard pending (FSDP2's or staged)
            counts[id(group)] = counts.get(id(group), 0) + 1
            gathered.add(id(group))
            self.peak = max(self.peak, len(gathered))
            return real["_to_unsharded"](group)

        def to_sharded(group):
            gathered.discard(id(group))
            return real["_to_sharded"](group)

        FSDPParamGroup._to_unsharded = to_unsharded
        FSDPParamGroup._to_sharded = to_sharded

    def undo(self):
        for n, f in self.real.items():
            setattr(self.cls, n, f)


def _skewed(real_run):
    """``Lockstep.run`` whose later micro-batches first make 20,000 unrelated autograd nodes in their thread. Autograd
    orders ready nodes by a per-thread sequence number, so their backward then runs ahead of micro-batch 0's: a block's
    post-backward for micro-batch 1 comes before micro-batch 0's backward of that block (the order the backward's
    deferral is for)."""

    def run(self, fns):
        def burnt(fn, k):
            def go():
                if k:
                    x = torch.zeros((), requires_grad=True)
                    for _ in range(20000):
                        x = x + 1.0
                return fn()
            return go
        return real_run(self, [burnt(fn, k) for k, fn in enumerate(fns)])
    return run


def run(micro: int, fsdp: str, group: int, *, mesh=None, bug: str = "", skew: bool = False, device=None,
        dtype=torch.float32, fresh_thread: bool = False, **fsdp_kw) -> dict:
    """Train 2 steps of ``micro`` micro-batches with lockstep groups of ``group`` (1: sequential); step-1 grads,
    per-micro-batch losses of step 1, final weights, gathers per unit over both steps, and the units' state after.
    ``fresh_thread``: the steps run in a new thread, whose autograd sequence numbers start at 0 (as a trainer's main
    thread that made few autograd nodes: the recipe's normalisation then numbers its nodes below every worker's)."""
    from miles_ext.levers.fsdp_policy import apply_fsdp2
    from miles_ext.levers.lockstep import Lockstep, _groups, lockstep_units
    from miles_ext.levers.lora import lora_parameters
    from miles_ext.recipe.schedule import pair_schedule
    from miles_ext.recipe.sft import train_step
    from tests.equivalence.h3_tiny_run import OPTIM, make_lora_model, synthetic_pairs

    from miles_ext.levers import lockstep as ls

    undo = _plant(bug)
    counter = None
    real_run = ls.Lockstep.run
    if skew:
        ls.Lockstep.run = _skewed(real_run)
    try:
        pairs = synthetic_pairs(micro * STEPS, _preset())
        model = make_lora_model(_preset(), master_dtype=None if dtype == torch.float32 else "bf16")
        model.enable_gradient_checkpointing()
        model.train()
        if FSDP[fsdp] is not None:
            apply_fsdp2(model, param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32,
                        mesh=mesh, **FSDP[fsdp], **fsdp_kw)
        elif device is not None:
            model.to(device)
        lever = Lockstep(model, group) if group > 1 else None
        lora = lora_parameters(model)
        opt = torch.optim.AdamW(list(lora.values()), **OPTIM)
        out: dict = {"grads": {}, "losses": []}

        def full(t):
            return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()

        def snap() -> None:
            if not out["grads"]:
                out["grads"] = {n: full(p.grad) for n, p in lora.items()}

        def normaliser(loss_sum, micro_pairs, num_local_pairs):
            if len(out["losses"]) < micro:  # step 1's (step 2's follow from step 1's weights)
                out["losses"].append(float(loss_sum.detach()))
            return loss_sum / float(num_local_pairs)

        units = [g for u in lockstep_units(model) for g in _groups(u)]
        settings = [(g.post_forward_mesh_info, g.reshard_after_backward) for g in units]
        counter = _GatherCount()
        def steps() -> None:
            for slots in pair_schedule(micro, 1, STEPS, 1)[:STEPS]:
                train_step(model, opt, slots, pairs, seed=3, max_grad_norm=0.05, after_backward=snap, lockstep=lever,
                           normaliser=normaliser, device=device)

        if fresh_thread:
            import threading

            failed: list[BaseException] = []
            t = threading.Thread(target=lambda: _capture(steps, failed))
            t.start()
            t.join()
            if failed:
                raise failed[0]
        else:
            steps()
        out["gathers"] = sorted(counter.counts.get(id(g), 0) for g in units) if units else []
        out["peak_gathered"] = counter.peak
        out["restored"] = [(g.post_forward_mesh_info, g.reshard_after_backward) for g in units] == settings
        out["sharded"] = all(not g.is_unsharded for g in units)
        out["weights"] = {n: full(p) for n, p in lora.items()}
        out["deferred"] = lever.deferred if lever else 0
        return out
    finally:
        ls.Lockstep.run = real_run
        if counter is not None:
            counter.undo()
        undo()


def _capture(fn, failed: list) -> None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - re-raised by the caller's thread
        failed.append(e)


def aborted(*, mesh=None, bug: str = "") -> dict:
    """A lockstep group whose first micro-batch raises in block 2's forward (full offload), after the lever left block 2
    gathered for the second: what the caller gets, whether the second micro-batch's thread was stopped, and whether
    every unit's reshard setting is back."""
    import threading

    from miles_ext.levers.fsdp_policy import apply_fsdp2
    from miles_ext.levers.lockstep import Lockstep, _groups, lockstep_units
    from miles_ext.recipe.sft import draw_micro_batch, micro_batch_loss_sum
    from tests.equivalence.h3_tiny_run import make_lora_model, synthetic_pairs

    undo = _plant(bug)
    try:
        pairs = synthetic_pairs(2, _preset())
        model = make_lora_model(_preset())
        model.enable_gradient_checkpointing()
        model.train()
        apply_fsdp2(model, param_dtype=None, reduce_dtype=torch.float32, mesh=mesh, **FSDP["offload"])
        lever = Lockstep(model, 2)
        units = [g for u in lockstep_units(model) for g in _groups(u)]
        settings = [g.post_forward_mesh_info for g in units]

        def fail(module, args):
            if threading.current_thread().name.endswith("-0"):  # after block 2 was left gathered for micro-batch 1
                raise RuntimeError("planted failure in micro-batch 0")

        model.transformer_blocks[2].register_forward_pre_hook(fail)
        fns = [lambda p=p, k=k: micro_batch_loss_sum(model, draw_micro_batch(
            [p], seed=3, rollout_id=0, microbatch_id=k, dp_rank=0)) for k, p in enumerate(pairs)]
        try:
            lever.run(fns)
            raised = ""
        except RuntimeError as e:
            raised = str(e)
        return {"raised": raised, "restored": [g.post_forward_mesh_info for g in units] == settings,
                "threads": [t.name for t in threading.enumerate() if t.name.startswith("onecard-lockstep")]}
    finally:
        undo()


def _worker(rank: int, world: int, out_dir: str) -> None:
    res = {}
    for fsdp in FSDP:
        mesh = cpu_mesh() if FSDP[fsdp] is not None else None
        for micro, group in ((2, 1), (2, 2), (3, 1), (3, 3)):
            res[(fsdp, micro, group)] = run(micro, fsdp, group, mesh=mesh)
    for micro, group in ((2, 1), (2, 2), (3, 1), (3, 3)):
        res[("bf16", micro, group)] = run(micro, "offload", group, mesh=cpu_mesh(), dtype=torch.bfloat16)
    res["shared_grad"] = run(2, "offload", 2, mesh=cpu_mesh(), dtype=torch.bfloat16, bug="shared_grad")
    res["skewed"] = run(2, "offload", 2, mesh=cpu_mesh(), skew=True)
    res["fresh"] = run(2, "offload", 2, mesh=cpu_mesh(), fresh_thread=True)
    res["caller_roots"] = run(2, "offload", 2, mesh=cpu_mesh(), fresh_thread=True, bug="caller_roots")
    for bug in ("no_forward_defer", "finish_order"):
        res[bug] = run(2, "offload", 2, mesh=cpu_mesh(), bug=bug)
    res["aborted"] = aborted(mesh=cpu_mesh())
    res["not_restored"] = aborted(mesh=cpu_mesh(), bug="not_restored")
    torch.save(res, Path(out_dir) / "lockstep.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("lockstep")
    launch(_worker, 1, str(out))
    return torch.load(out / "lockstep.pt")


@pytest.mark.parametrize("fsdp", list(FSDP))
def test_two_micro_batches_in_lockstep_are_bitwise_the_sequential_step(results, fsdp):
    ref, got = results[(fsdp, 2, 1)], results[(fsdp, 2, 2)]
    assert any(g.abs().sum() > 0 for g in ref["grads"].values())
    assert _equal(got["grads"], ref["grads"]), f"{fsdp}: step-1 LoRA gradients differ"
    assert got["losses"] == ref["losses"], f"{fsdp}: per-micro-batch losses differ"
    assert _equal(got["weights"], ref["weights"]), f"{fsdp}: weights after {STEPS} steps differ"


@pytest.mark.parametrize("fsdp", list(FSDP))
def test_three_micro_batches_in_lockstep_are_bitwise_the_sequential_step(results, fsdp):
    ref, got = results[(fsdp, 3, 1)], results[(fsdp, 3, 3)]
    assert _equal(got["grads"], ref["grads"]) and got["losses"] == ref["losses"]
    assert _equal(got["weights"], ref["weights"])


@pytest.mark.parametrize("micro", [2, 3])
def test_bf16_compute_in_lockstep_is_bitwise_the_sequential_step(results, micro):
    """bf16 base and bf16 adapter compute (the recipe's dtypes): each micro-batch's bf16 gradient reaches the fp32
    sharded gradient on its own, in order, as in the sequential step."""
    ref, got = results[("bf16", micro, 1)], results[("bf16", micro, micro)]
    assert any(g.abs().sum() > 0 for g in ref["grads"].values())
    assert _equal(got["grads"], ref["grads"]) and got["losses"] == ref["losses"]
    assert _equal(got["weights"], ref["weights"])


def test_the_placements_agree(results):
    assert _equal(results[("offload", 2, 2)]["grads"], results[("none", 2, 1)]["grads"])


def test_each_offloaded_unit_is_gathered_twice_per_group(results):
    """Forward and backward once per group: over 2 steps, 2 micro-batches per step in one group gather each block and
    adapter unit 4 times (sequential: 8), 3 in one group 4 times (sequential: 12)."""
    units = len(results[("offload", 2, 1)]["gathers"])
    assert units > 2 * LAYERS  # the transformer blocks, their adapter units, the refiner and output-norm blocks
    assert results[("offload", 2, 1)]["gathers"] == [4 * STEPS] * units
    assert results[("offload", 3, 1)]["gathers"] == [6 * STEPS] * units
    assert results[("offload", 2, 2)]["gathers"] == [2 * STEPS] * units
    assert results[("offload", 3, 3)]["gathers"] == [2 * STEPS] * units
    assert results[("offload", 2, 2)]["deferred"] > 0


def test_a_fresh_caller_thread_still_gathers_each_unit_once_per_group_in_the_backward(results):
    """The steps run in a new thread: the recipe's normalisation (``loss_sum / num_local_pairs``, on the caller's
    thread) numbers its nodes below the workers' graphs. Each unit is still gathered twice per group (the backward
    starts at the workers' results), with the same bits."""
    got, ref = results["fresh"], results[("offload", 2, 1)]
    assert got["gathers"] == results[("offload", 2, 2)]["gathers"] == [2 * STEPS] * len(ref["gathers"])
    assert _equal(got["grads"], ref["grads"]) and _equal(got["weights"], ref["weights"])
    assert got["losses"] == ref["losses"]


def test_planted_backward_from_the_callers_losses_is_caught(results):
    """The engine started at the caller's losses: one micro-batch's whole backward runs first and every unit is
    gathered again for the other (what the H200 showed at 50 blocks)."""
    assert results["caller_roots"]["gathers"] != results["fresh"]["gathers"]


def test_no_more_units_are_gathered_at_once_than_in_the_sequential_step(results):
    for micro in (2, 3):
        assert results[("offload", micro, micro)]["peak_gathered"] == results[("offload", micro, 1)]["peak_gathered"]


def test_a_backward_that_reaches_one_micro_batch_first_regathers_instead_of_keeping_units(results):
    """Micro-batch 1's backward run ahead (``_skewed``): no unit is kept gathered for micro-batch 0 (which would hold
    every block at once on the card); the backward gathers again, forward still once per group; at most one more
    block and its adapter unit gathered at a moment (where micro-batch 0's backward starts while 1's ends); the same
    bits."""
    got, ref = results["skewed"], results[("offload", 2, 1)]
    assert got["peak_gathered"] <= ref["peak_gathered"] + 2
    assert results[("offload", 2, 2)]["gathers"] < got["gathers"] <= ref["gathers"]
    assert _equal(got["grads"], ref["grads"]) and _equal(got["weights"], ref["weights"])


@pytest.mark.parametrize("key", [("offload", 2, 2), ("offload", 3, 3), ("resident", 2, 2), ("none", 2, 2)])
def test_units_are_sharded_and_their_settings_restored_after_the_step(results, key):
    assert results[key]["restored"] and results[key]["sharded"]


def test_planted_missing_forward_deferral_is_caught(results):
    assert results["no_forward_defer"]["gathers"] != results[("offload", 2, 2)]["gathers"]


def test_a_failing_micro_batch_stops_the_group_and_restores_every_unit(results):
    got = results["aborted"]
    assert got["raised"] == "planted failure in micro-batch 0"
    assert got["restored"] and got["threads"] == []


def test_planted_settings_not_restored_is_caught(results):
    assert not results["not_restored"]["restored"]


def test_planted_gradients_summed_by_autograd_are_caught(results):
    """Without the per-call aliases autograd sums the two micro-batches' bf16 gradients in bf16 before FSDP2's fp32
    reduce: not the sequential step."""
    assert not _equal(results["shared_grad"]["grads"], results[("bf16", 2, 1)]["grads"])


def test_planted_losses_out_of_order_are_caught(results):
    assert results["finish_order"]["losses"] != results[("offload", 2, 1)]["losses"]


def _two_rank_worker(rank: int, world: int, out_dir: str) -> None:
    from miles_ext.levers.fsdp_policy import apply_fsdp2
    from miles_ext.levers.lockstep import Lockstep
    from tests.equivalence.h3_tiny_run import make_lora_model

    model = make_lora_model(_preset())
    apply_fsdp2(model, param_dtype=None, reduce_dtype=torch.float32, mesh=cpu_mesh(), cpu_offload=False)
    try:
        Lockstep(model, 2)
        error = ""
    except ValueError as e:
        error = str(e)
    if rank == 0:
        torch.save({"error": error}, Path(out_dir) / "two_ranks.pt")


def test_two_ranks_are_refused(tmp_path):
    """The gradients of micro-batches 1..N-1 are added into the local shard as a one-rank reduce does: over two ranks
    that would skip the reduce, so the lever refuses FSDP2 units sharded over more than one rank."""
    launch(_two_rank_worker, 2, str(tmp_path))
    assert "world size 1 only" in torch.load(tmp_path / "two_ranks.pt")["error"]


# ------------------------------------------------------------------------------- on the GPU (device machine)
def _cuda_worker(rank: int, world: int, out_dir: str) -> None:
    torch.cuda.set_device(0)
    torch.use_deterministic_algorithms(True)
    res = {}
    for name, kw in (("offload_sync", dict(h2d_prefetch=False)), ("offload_prefetch", dict(h2d_prefetch=True))):
        for group in (1, 2):
            res[(name, group)] = run(2, "offload", group, device="cuda", **kw)
    for group in (1, 2):
        res[("none", group)] = run(2, "none", group, device="cuda")
        res[("bf16_prefetch", group)] = run(2, "offload", group, device="cuda", dtype=torch.bfloat16, h2d_prefetch=True)
    res["fresh_prefetch"] = run(2, "offload", 2, device="cuda", h2d_prefetch=True, fresh_thread=True)
    torch.save(res, Path(out_dir) / "cuda.pt")


@pytest.fixture(scope="module")
def cuda_results(tmp_path_factory):
    from tests.equivalence.h3_ranks import cuda_results as run_cuda

    return run_cuda(tmp_path_factory, _cuda_worker, "lockstep_cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("name", ["offload_sync", "offload_prefetch", "none", "bf16_prefetch"])
def test_cuda_two_micro_batches_in_lockstep_are_bitwise_the_sequential_step(cuda_results, name):
    ref, got = cuda_results[(name, 1)], cuda_results[(name, 2)]
    assert any(g.abs().sum() > 0 for g in ref["grads"].values())
    assert _equal(got["grads"], ref["grads"]) and got["losses"] == ref["losses"]
    assert _equal(got["weights"], ref["weights"])
    if name != "none":
        assert got["gathers"] == [2 * STEPS] * len(got["gathers"]) and ref["gathers"] == [4 * STEPS] * len(got["gathers"])
        assert got["peak_gathered"] <= ref["peak_gathered"] and got["sharded"] and got["restored"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_cuda_a_fresh_caller_thread_gathers_each_unit_once_per_group(cuda_results):
    got, ref = cuda_results["fresh_prefetch"], cuda_results[("offload_prefetch", 1)]
    assert got["gathers"] == [2 * STEPS] * len(got["gathers"])
    assert _equal(got["grads"], ref["grads"]) and _equal(got["weights"], ref["weights"])


def test_a_result_without_gradient_and_a_loss_left_out_do_not_reach_the_backward():
    """In this process, no FSDP: of two lockstep micro-batches the first returns its loss sum, the second a number that
    needs no gradient (a metric); and a run of two losses backpropagated through the first alone. Both backward passes
    start at what needs them and give the gradients of a plain backward of the same loss, bitwise."""
    from miles_ext.levers.lockstep import Lockstep
    from miles_ext.levers.lora import lora_parameters
    from miles_ext.recipe.sft import draw_micro_batch, micro_batch_loss_sum
    from tests.equivalence.h3_tiny_run import make_lora_model, synthetic_pairs

    pairs = synthetic_pairs(2, _preset())
    model = make_lora_model(_preset())
    model.train()
    lora = lora_parameters(model)

    def loss(k):
        return micro_batch_loss_sum(model, draw_micro_batch([pairs[k]], seed=3, rollout_id=0, microbatch_id=k, dp_rank=0))

    def grads():
        out = {n: p.grad.clone() for n, p in lora.items() if p.grad is not None}
        for p in lora.values():
            p.grad = None
        return out

    (loss(0) / 2.0).backward()
    ref = grads()
    lever = Lockstep(model, 2)
    first, metric = lever.run([lambda: loss(0), lambda: torch.tensor(1.5)])
    lever.backward([first / 2.0])
    assert float(metric) == 1.5 and _equal(grads(), ref)
    first, second = lever.run([lambda: loss(0), lambda: loss(1)])
    lever.backward([first / 2.0])  # the second micro-batch's result is not used by the losses
    assert _equal(grads(), ref)
