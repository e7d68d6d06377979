"""Lever 1 (COSMOS_EMA_CPU_SUBSET=1) is free: the ``cpu_subset`` EMA equals the stock ``device`` EMA.

A/B: one training trajectory of the tiny Cosmos3 preset (the trainer's real step), two :class:`EMA` objects
updated after every optimizer step with the upstream power-EMA beta: ``placement="device"`` (stock: full
fp32 clone, foreach mul + add over every parameter) and ``placement="cpu_subset"`` (the lever: fp32 host
buffers over the trainable subset, async copy + worker-thread lerp). Trainable keys must be ``torch.equal`` -- bit-exact, no tolerance. Frozen keys must equal ``net``.
Planted bugs at the end show each comparison can fail.

Both sides of the A/B share ``_lerp_`` and ``power_ema_beta``, so independent anchors pin the stock side to
upstream: gamma and beta(0..3) written out, the update rule on a 3-element parameter worked by hand for 4 steps,
and diffusers' ``EMAModel`` driven with the same betas. The CUDA tests make the lever's two stream orderings race
for real (``torch.cuda._sleep`` holds a stream), each with a planted variant that lacks the wait.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cosmos_framework_ext.levers.ema import (
    EMA,
    CpuSubsetPlacement,
    _CopyHandle,
    canonical_name,
    power_ema_beta,
    power_ema_gamma,
)
from tests.equivalence import tiny_recipe as R
from tests.equivalence.h3_ranks import launch

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


# ------------------------------------------------------------------------- independent anchors
# The A/B below compares two placements that share ``_lerp_`` and ``power_ema_beta``; these pin both to the
# upstream formulas: gamma = largest real root of g^3 + 7 g^2 + (16 - s^-2) g + (12 - s^-2) at s = 0.1,
# beta(i) = (1 - 1/(i+1))^(gamma+1) (0 for i < 1), ema = beta * ema + (1 - beta) * param after each step.
HAND_GAMMA = 6.9372039
HAND_BETAS = [0.0, 0.0040800317, 0.0400246705, 0.1019379200]  # beta(0..3)
HAND_PARAMS = [[1.0, -2.0, 0.5], [3.0, 1.0, -1.5], [-0.5, 4.0, 2.0], [2.0, 0.0, 1.0]]  # net after steps 0..3
HAND_EMA = [  # written out: ema_i = b_i * ema_(i-1) + (1 - b_i) * p_i, from ema = [0.25] * 3
    [1.0, -2.0, 0.5],  # b_0 = 0: re-seeded from net
    [2.9918399, 0.9877599, -1.4918399],  # 0.00408 * [1, -2, .5] + 0.99592 * [3, 1, -1.5]
    [-0.3602403, 3.8794361, 1.8602403],
    [1.7594020, 0.3954616, 1.0876911],
]


def _one_param_module(value) -> torch.nn.Module:
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.tensor(value))
    return m


def test_gamma_and_betas_by_hand():
    assert power_ema_gamma(0.1) == pytest.approx(HAND_GAMMA, abs=1e-7)
    assert [power_ema_beta(i, GAMMA) for i in range(4)] == pytest.approx(HAND_BETAS, rel=1e-8, abs=1e-12)


@pytest.mark.parametrize("placement", ["device", "cpu_subset"])
def test_update_rule_by_hand(placement):
    module = _one_param_module([0.25, 0.25, 0.25])
    ema = EMA(module, placement=placement, trainable=["w"] if placement == "cpu_subset" else None)
    for i, (p, want) in enumerate(zip(HAND_PARAMS, HAND_EMA)):
        with torch.no_grad():
            module.w.copy_(torch.tensor(p))
        ema.step(power_ema_beta(i, GAMMA))
        torch.testing.assert_close(ema.state_dict()["shadow"]["w"], torch.tensor(want), rtol=0, atol=2e-6)
    assert ema.num_updates == 4 and ema.last_beta == pytest.approx(HAND_BETAS[3], rel=1e-8)
    ema.close()


@pytest.mark.parametrize("placement", ["device", "cpu_subset"])
def test_update_rule_equals_diffusers_ema_model(placement):
    """diffusers' ``EMAModel`` (``s -= (1 - decay) * (s - p)``), driven with decay = beta(i) at every step: its first
    step uses decay 0, as beta(0) = 0."""
    from diffusers.training_utils import EMAModel

    g = torch.Generator().manual_seed(0)
    module = _one_param_module(torch.randn(64, generator=g).tolist())
    ema = EMA(module, placement=placement, trainable=["w"] if placement == "cpu_subset" else None)
    ref = EMAModel([module.w], decay=0.0, min_decay=0.0, update_after_step=0, use_ema_warmup=False, foreach=False)
    for i in range(6):
        with torch.no_grad():
            module.w.add_(torch.randn(64, generator=g))
        beta = power_ema_beta(i, GAMMA)
        ref.decay = ref.min_decay = beta
        ref.step([module.w])
        ema.step(beta)
        assert ref.cur_decay_value == beta
    torch.testing.assert_close(ema.state_dict()["shadow"]["w"], ref.shadow_params[0], rtol=1e-6, atol=1e-6)
    ema.close()


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
    from cosmos_framework_ext.upstream.patches import EmaPlaceholder, HostEmaWorker

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
def _two_rank_worker(rank: int, world: int, out: str) -> None:
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
    launch(_two_rank_worker, 2, out)  # gloo ranks forked from a preloaded forkserver
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


# The lever's two CUDA orderings, with the race made real: ``torch.cuda._sleep`` holds a stream for ~0.1 s, so
# a missing wait shows every time instead of once in a while. Each test also runs a planted variant without
# the wait, which must fail it.
_CUDA_SLEEP_CYCLES = 2_000_000_000  # ~1 s at ~2 GHz: far longer than the host needs to issue the next ops
_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")


class _NoPreStepWait(CpuSubsetPlacement):
    """Planted bug: the optimizer pre-step hook does not wait for the copy's event."""

    def before_optimizer_step(self):
        pass


class _NoReadyWait(CpuSubsetPlacement):
    """Planted bug: the side stream copies without waiting for the optimizer step's event."""

    def _issue_copies(self, sources):
        done = torch.cuda.Event()
        with torch.cuda.stream(self._copy_stream):
            for dst, src in zip(self.staging, sources):
                dst.copy_(src, non_blocking=True)
            done.record()
        self._copy_done = done
        return _CopyHandle(event=done)


class _LerpWithoutEvent(CpuSubsetPlacement):
    """Planted bug: the host lerp reads the staging buffers without waiting for the copy's event."""

    def _host_lerp(self, handle, beta):
        class _NoWait:
            def wait(self):
                pass

        super()._host_lerp(_NoWait(), beta)
        handle.wait()


def _cuda_ema(placement):
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, bias=False).cuda()  # 4 MiB: the copy takes real time too
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ema = EMA(model, placement=placement)
    ema.attach_optimizer(opt)
    return model.weight, opt, ema


def _sgd_step(p, opt, grad: float) -> None:
    p.grad = torch.full_like(p, grad)
    opt.step()


@_needs_cuda
@pytest.mark.parametrize("placement, exact", [(CpuSubsetPlacement, True), (_NoPreStepWait, False)],
                         ids=["lever", "planted-no-pre-step-wait"])
def test_cuda_race_next_optimizer_step_waits_for_the_copy(placement, exact):
    """The side stream is held before the D2H copy; the next optimizer step writes the parameters right after
    ``ema.step``. The EMA (beta 0: it becomes the copied values) must hold the values from before that write."""
    p, opt, ema = _cuda_ema(placement)
    _sgd_step(p, opt, 1.0)
    before = p.detach().cpu()
    with torch.cuda.stream(ema._impl._copy_stream):
        torch.cuda._sleep(_CUDA_SLEEP_CYCLES)
    ema.step(0.0)
    _sgd_step(p, opt, 5.0)  # the pre-step hook must hold this write until the copy has landed
    ema.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(ema.shadow[0], before) is exact
    assert not torch.equal(p.detach().cpu(), before)
    ema.close()


@_needs_cuda
@pytest.mark.parametrize("placement, exact", [(CpuSubsetPlacement, True), (_NoReadyWait, False)],
                         ids=["lever", "planted-copy-without-ready-event"])
def test_cuda_race_copy_waits_for_the_optimizer_step(placement, exact):
    """The training stream is held before the optimizer step; the copy issued by ``ema.step`` right after must
    still see the step's values."""
    p, opt, ema = _cuda_ema(placement)
    _sgd_step(p, opt, 0.0)  # warm-up: the first launches load kernels and can outlast the sleep below
    ema.step(0.0)
    ema.synchronize()
    torch.cuda.synchronize()
    old = p.detach().cpu()
    torch.cuda._sleep(_CUDA_SLEEP_CYCLES)  # on the current (training) stream
    _sgd_step(p, opt, 1.0)
    ema.step(0.0)
    ema.synchronize()
    torch.cuda.synchronize()
    after = p.detach().cpu()
    assert not torch.equal(after, old)
    assert torch.equal(ema.shadow[0], after) is exact
    ema.close()


@_needs_cuda
@pytest.mark.parametrize("placement, exact", [(CpuSubsetPlacement, True), (_LerpWithoutEvent, False)],
                         ids=["lever", "planted-lerp-without-copy-event"])
def test_cuda_race_host_lerp_waits_for_the_copy_event(placement, exact):
    """The side stream is held before the D2H copy; the worker's lerp must wait for the copy's event."""
    p, opt, ema = _cuda_ema(placement)
    # The staging buffers are uninitialised host memory, which may be a freed arena of the previous test that
    # holds exactly these values (measured on the H200: the planted variant then passed). NaN makes a lerp
    # that reads before the copy visible.
    for s in ema._impl.staging:
        s.fill_(float("nan"))
    _sgd_step(p, opt, 1.0)
    with torch.cuda.stream(ema._impl._copy_stream):
        torch.cuda._sleep(_CUDA_SLEEP_CYCLES)
    ema.step(0.0)
    ema.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(ema.shadow[0], p.detach().cpu()) is exact
    ema.close()


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


class _ReadsBeforeCopy(_LerpWithoutEvent, _SlowCopy):
    """Planted bug: the lerp reads the staging buffers without waiting for the (slow) copy's event."""


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


def test_resume_broadcast_takes_host_ema_leaves(monkeypatch):
    """Resume with ``dcp_load_dedup``: upstream broadcasts every loaded tensor over the world group. The host EMA's
    ``net_ema.*`` leaves are CPU tensors, which a CUDA-only (NCCL) group cannot move (the H200 resume at 5eee9ed
    failed so). The patched leaf broadcast skips them at world size 1, leaves them to upstream under a host
    backend, and hands device leaves to upstream unchanged. Planted: upstream's own function on the same leaf
    raises as it did on the GPU."""
    import torch.distributed as dist

    from cosmos_framework_ext.upstream.patches import patched_broadcast_tensor_leaf

    calls = []

    def upstream_leaf(value):  # stand-in with upstream's failure: an NCCL-only group and a host tensor
        if value.device.type == "cpu" and "gloo" not in backend[0]:
            raise RuntimeError("No backend type associated with device type cpu")
        calls.append(value)

    backend = ["nccl"]
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend[0])
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    leaf = torch.arange(6, dtype=torch.float32)
    before = leaf.clone()
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        upstream_leaf(leaf)  # the planted (unpatched) path
    patched = patched_broadcast_tensor_leaf(upstream_leaf)
    assert patched(leaf) is None and calls == [] and torch.equal(leaf, before)
    backend[0] = "cpu:gloo,cuda:nccl"
    patched(leaf)
    assert len(calls) == 1 and calls[0] is leaf  # a host backend: upstream's broadcast, untouched
    meta = torch.empty(3, device="meta")  # stands for a device leaf: always upstream's
    backend[0] = "nccl"
    patched(meta)
    assert calls[-1] is meta
