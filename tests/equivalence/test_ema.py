"""Lever 1 (COSMOS_EMA_CPU_SUBSET=1) is free: the ``cpu_subset`` EMA equals the stock ``device`` EMA.

A/B: one training trajectory of the tiny Cosmos3 preset (the trainer's real step), two :class:`EMA` objects
updated after every optimizer step with the upstream power-EMA beta: ``placement="device"`` (stock: full
fp32 clone, foreach mul + add over every parameter) and ``placement="cpu_subset"`` (the lever: fp32 host
buffers over the trainable subset, async copy + worker-thread lerp). Trainable keys must be ``torch.equal`` -- bit-exact, no tolerance. Frozen keys must equal ``net``.
Planted bugs at the end show each comparison can fail.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cosmos_framework_ext.ema import (
    EMA,
    CpuSubsetPlacement,
    _CopyHandle,
    canonical_name,
    power_ema_beta,
    power_ema_gamma,
)
from tests.equivalence import tiny_recipe as R

GAMMA = power_ema_gamma(0.1)
STEPS = 12


def run_ab(placement=CpuSubsetPlacement, beta_fn=None, skip_iteration=None, steps=STEPS, device="cpu",
           dtype=torch.float32):
    """Train ``steps`` optimizer steps; return (model, trainable names, stock EMA, lever EMA)."""
    beta_fn = beta_fn or (lambda i: power_ema_beta(i, GAMMA))
    model, trainable = R.make_model(device=device, dtype=dtype)
    opt = R.make_optimizer(model)
    stock = EMA(model, placement="device")
    lever = EMA(model, placement=placement, trainable=trainable)
    lever.attach_optimizer(opt)

    def after(i):
        stock.step(power_ema_beta(i, GAMMA))
        if i != skip_iteration:
            lever.step(beta_fn(i))

    R.train(model, opt, 0, steps, after)
    return model, trainable, stock, lever


def trainable_equal(model, trainable, stock, lever) -> bool:
    a, b = stock.state_dict()["shadow"], lever.state_dict()["shadow"]
    return all(torch.equal(a[canonical_name(n)], b[canonical_name(n)]) for n in trainable)


@pytest.fixture(scope="module")
def ab():
    return run_ab()


# ----------------------------------------------------------------------------------------- the schedule
def test_beta_schedule_matches_upstream_values():
    assert GAMMA == pytest.approx(6.93720, abs=1e-4)
    assert power_ema_beta(0, GAMMA) == 0.0  # first step re-seeds the EMA from net
    assert round(power_ema_beta(1, GAMMA), 5) == 0.00408
    assert round(power_ema_beta(10, GAMMA), 3) == 0.469
    assert round(power_ema_beta(100, GAMMA), 3) == 0.924
    # sigma_rel identity the cubic comes from
    g = GAMMA
    assert ((g + 1) / ((g + 2) ** 2 * (g + 3))) ** 0.5 == pytest.approx(0.1, rel=1e-9)


def test_bad_rate_is_refused():
    with pytest.raises(ValueError, match="outside"):
        power_ema_gamma(0.5)


# ------------------------------------------------------------------------------------------ the A/B
def test_trainable_keys_bit_exact(ab):
    model, trainable, stock, lever = ab
    assert lever.num_updates == stock.num_updates == STEPS
    assert lever.placement == "cpu_subset" and stock.placement == "device"
    assert trainable_equal(model, trainable, stock, lever)
    # and the EMA moved away from net (a test that cannot fail would prove nothing)
    net = dict(model.named_parameters())
    sd = lever.state_dict()["shadow"]
    assert any(not torch.equal(sd[n], net[n].detach()) for n in trainable)


def test_frozen_keys_equal_net_and_every_key_present(ab):
    model, trainable, stock, lever = ab
    sd = lever.state_dict()["shadow"]
    assert set(sd) == {canonical_name(k) for k in model.state_dict()}
    assert all(v.dtype == torch.float32 for v in sd.values() if v.is_floating_point())
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen
    for n in frozen:
        assert torch.equal(sd[n], dict(model.named_parameters())[n].detach().float())
    # stock's frozen entries differ from net only by fp32 rounding of x*b + (1-b)*x
    st = stock.state_dict()["shadow"]
    for n in frozen:
        torch.testing.assert_close(st[n], sd[n], rtol=0, atol=1e-5)


def test_lever_holds_only_the_subset_on_the_host(ab):
    model, trainable, stock, lever = ab
    n_train = sum(p.numel() for n, p in model.named_parameters() if n in set(trainable))
    assert sum(t.numel() for t in lever.shadow) == n_train
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in lever.shadow)
    assert lever.host_bytes >= n_train * 4


def test_save_load_continue_equals_uninterrupted():
    model_a, trainable, stock_a, lever_a = run_ab(steps=STEPS)

    # interrupted: 6 steps, checkpoint (net, optimizer, EMA with its counter), fresh objects, 6 more
    model, trainable = R.make_model()
    opt = R.make_optimizer(model)
    lever = EMA(model, placement="cpu_subset", trainable=trainable)
    R.train(model, opt, 0, 6, lambda i: lever.step(power_ema_beta(i, GAMMA)))
    state = lever.state_dict()
    assert state["num_updates"] == 6
    ckpt = {
        "net": {k: v.clone() for k, v in model.state_dict().items()},
        # keys as a compiled + checkpoint-wrapped model names them: load matches canonical names
        "ema": {"num_updates": state["num_updates"],
                "shadow": {f"_orig_mod.{k}": v for k, v in state["shadow"].items()}},
        "opt": opt.state_dict(),
    }
    lever.close()

    model2, _ = R.make_model(seed=123)  # different init: everything must come from the checkpoint
    model2.load_state_dict(ckpt["net"])
    opt2 = R.make_optimizer(model2)
    opt2.load_state_dict(ckpt["opt"])
    lever2 = EMA(model2, placement="cpu_subset", trainable=trainable)
    assert lever2.load_state_dict(ckpt["ema"]) == len(trainable)
    assert lever2.num_updates == 6  # the counter comes back with the shadow
    R.train(model2, opt2, 6, STEPS, lambda i: lever2.step(power_ema_beta(i, GAMMA)))

    a, b = lever_a.state_dict()["shadow"], lever2.state_dict()["shadow"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert lever2.num_updates == lever_a.num_updates == STEPS


def test_ema_scope_round_trip_is_exact(ab):
    model, trainable, stock, lever = ab
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ema = lever.state_dict()["shadow"]
    with lever.ema_scope():
        for n, p in model.named_parameters():
            expect = ema[n].to(p.dtype) if n in set(trainable) else before[n]
            assert torch.equal(p.detach(), expect)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n])


def test_empty_selection_is_refused():
    model, _ = R.make_model()
    with pytest.raises(ValueError, match="keys_to_select"):
        EMA(model, placement="cpu_subset", trainable=[])
    with pytest.raises(ValueError, match="placement 'gpu_subset' is not one of"):
        EMA(model, placement="gpu_subset")


def test_device_placement_round_trips_its_counter_and_refuses_a_bare_shadow(ab):
    model, trainable, stock, lever = ab
    state = stock.state_dict()
    assert state["num_updates"] == STEPS and set(state["shadow"]) == {canonical_name(k) for k in model.state_dict()}
    again = EMA(model, placement="device")
    assert again.load_state_dict(state) == len(list(model.parameters()))
    assert again.num_updates == STEPS
    assert all(torch.equal(a, b) for a, b in zip(again.shadow, stock.shadow))
    with pytest.raises(ValueError, match="num_updates"):
        again.load_state_dict(state["shadow"])


def test_upstream_worker_drives_the_cpu_subset_ema(ab):
    """``HostEmaWorker`` (the lever inside upstream's trainer) speaks upstream's updater API over :class:`EMA`."""
    from cosmos_framework_ext.upstream import EmaPlaceholder, HostEmaWorker

    model, trainable = R.make_model()
    opt = R.make_optimizer(model)
    worker = HostEmaWorker()
    R.train(model, opt, 0, STEPS,
            lambda i: worker.update_average(model, EmaPlaceholder(), power_ema_beta(i, GAMMA)))
    assert worker.ema.placement == "cpu_subset" and worker.ema.num_updates == STEPS
    _, _, stock, _ = ab  # the same trajectory (same seed, same micro-batches)
    assert trainable_equal(model, trainable, stock, worker.ema)
    keys = [canonical_name(k) for k in model.state_dict()]
    entries = worker.net_ema_entries(model, keys)
    assert set(entries) == {f"net_ema.{k}" for k in keys}  # net_ema.<k> for every net.<k>
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    worker.cache(model.parameters())
    worker.copy_to(EmaPlaceholder(), model)  # ema_scope: EMA -> net
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), entries[f"net_ema.{n}"].to(p.dtype) if p.requires_grad else before[n])
    worker.restore(model.parameters())
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    worker.ema.close()


# ------------------------------------------------------------------------------------ two ranks
def _two_rank_worker(rank: int, world: int, port: int, out: str) -> None:
    with R.gloo_rank(rank, world, port):
        model, trainable = R.make_fsdp_model()
        opt = R.make_optimizer(model)
        lever = EMA(model, placement="cpu_subset", trainable=trainable)  # tracks this rank's local shards only
        local = sum(t.numel() for t in lever.shadow)
        # every rank sees the same micro-batches, so the mean gradient equals the one-rank gradient
        R.train(model, opt, 0, STEPS, lambda i: lever.step(power_ema_beta(i, GAMMA)))
        sd = lever.full_state_dict()["shadow"]
        if rank == 0:
            torch.save({"ema": sd, "local_numel": local}, out)


def test_two_ranks_sharded_equal_one_rank(tmp_path, ab):
    out = str(tmp_path / "rank0.pt")
    torch.multiprocessing.spawn(_two_rank_worker, args=(2, R.free_port(), out), nprocs=2, join=True)
    got = torch.load(out)
    model, trainable, stock, lever = ab
    one = lever.state_dict()["shadow"]
    n_train = sum(p.numel() for n, p in model.named_parameters() if n in set(trainable))
    assert got["local_numel"] < n_train  # really sharded
    assert got["ema"].keys() == one.keys()
    # same ops on the same values; fp32 all-reduce of identical gradients ((g+g)/2) is exact
    for k in one:
        torch.testing.assert_close(got["ema"][k], one[k], rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------- on a GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-params", "bf16-params"])
def test_cuda_event_gated_copy_equals_stock_gpu_ema(dtype):
    """Stock EMA on the GPU vs the lever (pinned host, side-stream copy, worker lerp): bit-exact."""
    model, trainable, stock, lever = run_ab(device="cuda", dtype=dtype)
    assert lever.pinned_bytes == lever.host_bytes > 0
    assert all(t.is_pinned() for t in lever.shadow)
    assert trainable_equal(model, trainable, stock, lever)


# -------------------------------------------------------------------------------- planted bugs
class _Bf16Shadow(CpuSubsetPlacement):
    """Planted bug: the EMA kept in bf16."""

    def _host_lerp(self, handle, beta):
        handle.wait()
        for t, s in zip(self.shadow, self.staging):
            t.copy_((t.bfloat16() * beta + s.bfloat16() * (1 - beta)).float())


class _SlowCopy(CpuSubsetPlacement):
    """The device->host copy completes 50 ms after it is issued (as an async CUDA copy can)."""

    def _issue_copies(self, sources):
        snap = [s.clone() for s in sources]

        def later():
            time.sleep(0.05)
            for d, s in zip(self.staging, snap):
                d.copy_(s)

        th = threading.Thread(target=later)
        th.start()
        return _CopyHandle(waiter=th.join)


class _ReadsBeforeCopy(_SlowCopy):
    """Planted bug: the lerp reads the staging buffers without waiting for the copy's event."""

    def _host_lerp(self, handle, beta):
        class _NoWait:
            def wait(self):
                pass

        super()._host_lerp(_NoWait(), beta)
        handle.wait()


def test_slow_copy_gated_by_its_event_is_still_exact():
    assert trainable_equal(*run_ab(placement=_SlowCopy, steps=4))


@pytest.mark.parametrize(
    "bug",
    [
        dict(placement=_Bf16Shadow),
        dict(beta_fn=lambda i: power_ema_beta(i + 1, GAMMA)),  # wrong beta (off by one iteration)
        dict(skip_iteration=5),  # a skipped update
        dict(placement=_ReadsBeforeCopy),  # a read before the copy's event
    ],
    ids=["bf16-shadow", "wrong-beta", "skipped-update", "read-before-copy-event"],
)
def test_planted_bug_breaks_the_proof(bug):
    assert not trainable_equal(*run_ab(steps=8, **bug))
