"""Optimizer-state streaming (``COSMOS_OPTIM_STATE_OFFLOAD=1``) against stock AdamW: bit-exact, with planted bugs.

Stock and lever run the recipe's real step (packed micro-batches, grad accumulation 2, clip 0.1 with
``force_finite``, AdamW 0.9/0.95/1e-6) for 6 optimizer steps with a power EMA, from the same init:
parameters, ``optimizer.state_dict()`` (keys, dtypes, values), the EMA and a saved-then-loaded checkpoint
are ``torch.equal``. The stream groups are made tiny so that the tiny model streams in many groups.
Planted bugs: the state streamed back through bf16, one stream group skipped -- each makes the check fail.
On CUDA (run on the GPU): the same A/B with the fused kernel; the moments' device buffers come from the compute
stream's pool and at most three groups' buffers exist at once with the host far ahead of the GPU; a fetched moment's
copy waits for the compute stream's queued readers of a reused block. Planted there: the buffers allocated on the
copy stream, no wait for a write-back, the copy without waiting for the compute stream.
"""

from __future__ import annotations

import time

import pytest
import torch

from cosmos_framework_ext.levers.ema import EMA, power_ema_beta, power_ema_gamma
from cosmos_framework_ext.levers.optim_offload import OptimStateOffload
from patches.core.checkpoint import gather_full_state, load_full_state

from . import tiny_recipe as R

STEPS = 6
GROUP_BYTES = 64 << 10  # tiny preset: ~10 stream groups


def _run(lever: type[OptimStateOffload] | None, steps: int = STEPS, *, device: str = "cpu", fused: bool = False,
         model_fn=None) -> dict:
    """Train ``steps`` optimizer steps; returns params, optimizer state_dict, EMA and the checkpoint round trip."""
    model, trainable = (model_fn or R.make_model)()
    model.to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, betas=(0.9, 0.95),
                            eps=1e-6, weight_decay=0.01, fused=fused or None)
    off = lever(opt, group_bytes=GROUP_BYTES, pin=device == "cuda") if lever is not None else None  # pinned as the trainer runs it
    ema = EMA(model, placement="device")
    gamma = power_ema_gamma(0.1)
    R.train(model, opt, 0, steps, after_step=lambda i: ema.step(power_ema_beta(i, gamma)))
    return {"model": model, "opt": opt, "off": off, "ema": ema}


def _checkpoint(run: dict, tmp_path, name: str) -> dict:
    """The trainer's save path: full tensors of net and optimizer (by name), the EMA; written and read back."""
    path = tmp_path / f"{name}.pt"
    net, optim = gather_full_state(run["model"], run["opt"])
    torch.save({"model": net, "optimizer": optim, "ema": run["ema"].full_state_dict()}, path)
    return torch.load(path, map_location="cpu", weights_only=False)


def _equal_trees(a, b, where="") -> list[str]:
    """Paths where two nested dict/list/tensor trees differ (keys, dtypes, values); empty when identical."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)):
            return [f"{where}: tensor vs {type(b).__name__}"]
        a, b = (x.full_tensor() if hasattr(x, "full_tensor") else x for x in (a, b))
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        return [] if torch.equal(a.cpu(), b.cpu()) else [f"{where}: values differ"]
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))[:4]}"]
        return [d for k in a for d in _equal_trees(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _equal_trees(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def _differences(stock: dict, lever: dict, tmp_path) -> list[str]:
    out = _equal_trees(dict(stock["model"].named_parameters()), dict(lever["model"].named_parameters()), "params")
    out += _equal_trees(stock["opt"].state_dict(), lever["opt"].state_dict(), "optimizer")
    out += _equal_trees(stock["ema"].state_dict(), lever["ema"].state_dict(), "ema")
    out += _equal_trees(_checkpoint(stock, tmp_path, "stock"), _checkpoint(lever, tmp_path, "lever"), "checkpoint")
    return out


@pytest.fixture(scope="module")
def stock():
    return _run(None)


def test_lever_equals_stock_bit_for_bit(stock, tmp_path):
    lever = _run(OptimStateOffload)
    off = lever["off"]
    assert len(off.groups) >= 4 and off.stats["steps"] == STEPS
    assert not _differences(stock, lever, tmp_path)
    # between steps the moments are the arena's tensors (the host copy IS the state), same dtype as stock
    arena = {t.data_ptr() for t in off.arena.tensors}
    for p, st in lever["opt"].state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert st[k].data_ptr() in arena and st[k].dtype == p.dtype
    nbytes = sum(p.numel() * p.element_size() * 2 for p in lever["model"].parameters() if p.requires_grad)
    assert off.arena.nbytes <= nbytes + 64 * 2 * len(off.arena.tensors)  # exact size (64-byte alignment only)
    assert off.stats["d2h_bytes"] == STEPS * nbytes and off.stats["h2d_bytes"] == (STEPS - 1) * nbytes


def test_resume_through_load_state_dict_continues_exactly(stock, tmp_path):
    first = _run(OptimStateOffload, steps=3)
    ckpt = _checkpoint(first, tmp_path, "first")
    model, _ = R.make_model(seed=1)  # another init: everything must come from the checkpoint
    opt = R.make_optimizer(model)
    for g in opt.param_groups:
        g["weight_decay"] = 0.01
    off = OptimStateOffload(opt, group_bytes=GROUP_BYTES, pin=False)
    load_full_state(model, ckpt["model"], opt, ckpt["optimizer"])  # the post-hook moves the moments to the arena
    arena = {t.data_ptr() for t in off.arena.tensors}
    assert all(st["exp_avg"].data_ptr() in arena for st in opt.state.values())
    ema = EMA(model, placement="device")
    ema.load_state_dict(ckpt["ema"])
    gamma = power_ema_gamma(0.1)
    R.train(model, opt, 3, STEPS, after_step=lambda i: ema.step(power_ema_beta(i, gamma)))
    assert not _differences(stock, {"model": model, "opt": opt, "ema": ema}, tmp_path)


def test_fsdp2_one_rank_dtensor_state_equals_stock(tmp_path):
    """FSDP2 at world size 1 (as upstream HEAD wraps even one GPU): DTensor parameters and DTensor state."""
    with R.one_rank():
        a = _run(None, steps=3, model_fn=R.make_fsdp_model)
        b = _run(OptimStateOffload, steps=3, model_fn=R.make_fsdp_model)
        st = next(iter(b["opt"].state.values()))
        assert hasattr(st["exp_avg"], "device_mesh")  # DTensor state, as stock
        assert not _differences(a, b, tmp_path)


# ------------------------------------------------------------------------ LR scheduler and optimizer hooks
class PlainFunctionStep(OptimStateOffload):
    """Planted: ``optimizer.step`` replaced by a plain function (what broke upstream's scheduler build)."""

    def _install_step(self):
        super()._install_step()
        self.optimizer.step = lambda closure=None: self.step(closure)


def _scheduled(lever, order: str, steps: int = 4) -> dict:
    """AdamW over a two-group model with a LambdaLR built before (``first``) or after (``after``, as upstream's
    ``init_optimizer_scheduler`` does) the lever; a step pre-hook and a post-hook count their calls; every warning
    is recorded."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 3e-3,
                                                                   "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95))
    calls = {"pre": 0, "post": 0}
    opt.register_step_pre_hook(lambda o, a, k: calls.__setitem__("pre", calls["pre"] + 1))
    opt.register_step_post_hook(lambda o, a, k: calls.__setitem__("post", calls["post"] + 1))
    make = lambda: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)  # noqa: E731
    sched = make() if order == "first" else None
    off = lever(opt, group_bytes=128, pin=False) if lever is not None else None
    sched = sched or make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            model(torch.randn(3, 8)).square().mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    return {"params": [p.detach().clone() for p in model.parameters()], "calls": calls, "off": off,
            "lrs": [g["lr"] for g in opt.param_groups], "warnings": [str(w.message) for w in caught]}


@pytest.mark.parametrize("order", ["after", "first"], ids=["scheduler-after-the-lever", "scheduler-first"])
def test_lr_scheduler_and_step_hooks_see_a_stock_step(order):
    """Built before or after the lever, torch's LambdaLR wraps and tracks the lever's step as a stock one: the weights
    and learning rates equal stock's bit for bit, the step hooks run once per optimizer step (not per stream group),
    and no scheduler warning is raised."""
    stock, got = _scheduled(None, order), _scheduled(OptimStateOffload, order)
    assert len(got["off"].groups) > 2  # several stream groups, from both param groups
    assert all(torch.equal(a, b) for a, b in zip(stock["params"], got["params"])) and got["lrs"] == stock["lrs"]
    assert got["calls"] == stock["calls"] == {"pre": 4, "post": 4}
    assert got["warnings"] == stock["warnings"] == []


def test_planted_plain_function_step_breaks_the_scheduler_build():
    with pytest.raises(AttributeError, match="__func__"):
        _scheduled(PlainFunctionStep, "after")



def _two_groups(lever, amsgrad: tuple[bool, bool], steps: int = 3) -> dict:
    """Stock ``torch.optim.AdamW`` (or with ``lever``) over two param groups with different hyper-parameters (lr,
    betas, weight decay, ``amsgrad`` per group): group 0 holds ``a`` (4x3) and ``b`` (5), group 1 holds ``c`` (2x2)
    and ``d`` (3), ``d`` never getting a gradient. Each step's gradients are a fixed function of the step and the
    weights; one stream group per param group (``group_bytes`` 1 MiB)."""
    torch.manual_seed(0)
    a, b, c, d = (torch.nn.Parameter(torch.randn(*s)) for s in ((4, 3), (5,), (2, 2), (3,)))
    opt = torch.optim.AdamW([
        {"params": [a, b], "lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1, "amsgrad": amsgrad[0]},
        {"params": [c, d], "lr": 3e-3, "betas": (0.8, 0.95), "weight_decay": 0.0, "amsgrad": amsgrad[1]},
    ], eps=1e-6)
    off = lever(opt, group_bytes=1 << 20, pin=False) if lever is not None else None
    for step in range(steps):
        for p in (a, b, c):
            p.grad = torch.sin(p.detach() * (step + 1)) + 0.1 * step
        opt.step()
    return {"params": {"a": a, "b": b, "c": c, "d": d}, "opt": opt, "off": off}


@pytest.mark.parametrize("amsgrad, per_step", [((False, True), (12 + 5) * 4 * 2 + 4 * 4 * 3),
                                               ((True, False), (12 + 5) * 4 * 3 + 4 * 4 * 2)],
                         ids=["amsgrad-second-group", "amsgrad-first-group"])
def test_param_groups_amsgrad_and_missing_grads_equal_stock(amsgrad, per_step):
    """Two param groups with their own lr/betas/weight decay, ``amsgrad`` in one of them, and a parameter without a
    gradient in a stream group whose other parameter has one: weights and ``state_dict()`` bit-exact vs stock AdamW
    after 3 steps; ``d`` (no gradient) untouched and without state, as stock. ``max_exp_avg_sq`` of the amsgrad group
    lives in the arena between steps and streams: the bytes moved, by hand, are per step the moments that exist
    (fp32: 4 B an element; ``a``+``b`` 17 elements, ``c`` 4; three moments in the amsgrad group, two in the other),
    d2h at each of the 3 steps and h2d at the 2 steps after the first (the first initialises on the device)."""
    stock, got = _two_groups(None, amsgrad), _two_groups(OptimStateOffload, amsgrad)
    assert not _equal_trees(stock["params"], got["params"], "params")
    assert not _equal_trees(stock["opt"].state_dict(), got["opt"].state_dict(), "optimizer")
    assert got["params"]["d"] not in got["opt"].state
    off = got["off"]
    assert off.stats == {"steps": 3, "h2d_bytes": 2 * per_step, "d2h_bytes": 3 * per_step}
    arena = {t.data_ptr() for t in off.arena.tensors}
    group = 0 if amsgrad[0] else 1
    for p in got["opt"].param_groups[group]["params"]:
        st = got["opt"].state.get(p)
        if st:
            assert {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"} <= set(st)
            assert all(st[k].data_ptr() in arena for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))


# --------------------------------------------------------------------------------------- planted bugs
class ThroughBf16(OptimStateOffload):
    """Planted: the state streams back to the host through bf16."""

    def _to_host(self, dst, src):
        dst.copy_(src.to(torch.bfloat16))


class SkipsOneGroup(OptimStateOffload):
    """Planted: the last stream group never steps."""

    def _chunks_to_run(self):
        return super()._chunks_to_run()[:-1]


@pytest.mark.parametrize("bug", [ThroughBf16, SkipsOneGroup], ids=["state-through-bf16", "one-group-skipped"])
def test_planted_bug_is_detected(stock, tmp_path, bug):
    assert _differences(stock, _run(bug), tmp_path)


def test_refuses_an_optimizer_it_does_not_know():
    from patches.core.errors import UserError

    model, _ = R.make_model()
    with pytest.raises(UserError, match="COSMOS_OPTIM_STATE_OFFLOAD"):
        OptimStateOffload(torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the fused AdamW kernel and the side streams")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-master", "bf16-master"])
def test_cuda_fused_kernel_lever_equals_stock(tmp_path, dtype):
    def model_fn():
        m, t = R.make_model()
        return m.to(dtype), t

    a = _run(None, device="cuda", fused=True, model_fn=model_fn)
    b = _run(OptimStateOffload, device="cuda", fused=True, model_fn=model_fn)
    assert b["off"].pinned_bytes == b["off"].arena.nbytes > 0
    assert all(st["exp_avg"].device.type == "cpu" for st in b["opt"].state.values())
    assert not _differences(a, b, tmp_path)
    assert _differences(a, _run(ThroughBf16, device="cuda", fused=True, model_fn=model_fn), tmp_path) or dtype == torch.bfloat16



class AllocatesOnTheCopyStream(OptimStateOffload):
    """Planted: the moments' device buffers allocated on the copy stream (cached there after the step)."""

    def _device_buffer(self, like):
        with torch.cuda.stream(self._h2d):
            return torch.empty_like(like, device=self.device)


class NoRoomWait(OptimStateOffload):
    """Planted: the host never waits for a write-back, so every group's buffers can be on the device at once."""

    @staticmethod
    def _wait_for_room(written, i):
        pass


class CopiesWithoutWaiting(OptimStateOffload):
    """Planted: the copy stream writes a fetched moment without waiting for the compute stream's queued work."""

    def _fetch(self, group):
        class NoWait(torch.cuda.ExternalStream):
            def wait_stream(self, stream):
                pass

        real, self._h2d = self._h2d, NoWait(self._h2d.cuda_stream)
        try:
            return super()._fetch(group)
        finally:
            self._h2d = real


def _big_params(n: int = 6, numel: int = 1 << 20) -> list[torch.nn.Parameter]:
    """``n`` fp32 CUDA parameters of ``numel`` elements with gradients (one stream group each, at groups of
    ``2 * numel * 4`` bytes)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(numel, device="cuda", generator=g)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(numel, device="cuda", generator=g)
    return ps


def _segment_streams() -> set[int]:
    """The CUDA streams that hold a segment of the caching allocator now."""
    return {int(s["stream"]) for s in torch.cuda.memory_snapshot()}


MOMENT_NUMEL = 3 << 20
"""12 MiB fp32 moments: above the caching allocator's 10 MiB, each gets a segment of its exact size, so the reserved
memory counts the buffers that exist at once, those freed but still pending on a stream's events included (the
allocated count drops at the free, before those events)."""


def _streamed_step_with_host_ahead(lever: type[OptimStateOffload]) -> tuple[OptimStateOffload, int, int]:
    """A second optimizer step issued while the GPU sleeps 50 ms (the host far ahead of it); returns the lever, one
    group's bytes and the reserved bytes the step added at its peak."""
    ps = _big_params(numel=MOMENT_NUMEL)
    group = 2 * ps[0].numel() * 4  # exp_avg + exp_avg_sq of one parameter
    opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
    off = lever(opt, group_bytes=group, pin=True)
    opt.step()  # the first step initialises the state on the device, then streams it out
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda._sleep(50_000_000)
    opt.step()
    torch.cuda.synchronize()
    return off, group, torch.cuda.max_memory_reserved() - base


def _check_pool_and_bound(off: OptimStateOffload, group: int, added: int) -> None:
    assert off.stats["steps"] == 2
    assert _segment_streams() <= {torch.cuda.current_stream().cuda_stream, 0}, "a buffer was allocated on a side stream"
    assert added <= 3 * group + (2 << 20), f"{added / group:.1f} groups' state on the device at once (at most 3)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side streams")
def test_cuda_state_buffers_stay_on_the_compute_stream_and_three_groups_at_most():
    """The moments' device buffers come from the compute stream's pool (a copy stream's cached blocks would be
    reserved but out of reach of the activations), and at most three groups' buffers exist at once even when
    the host runs far ahead of the GPU."""
    _check_pool_and_bound(*_streamed_step_with_host_ahead(OptimStateOffload))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side streams")
@pytest.mark.parametrize("bug", [AllocatesOnTheCopyStream, NoRoomWait], ids=["buffers-on-the-copy-stream", "no-room-wait"])
def test_cuda_planted_pool_and_bound_bugs_are_detected(bug):
    with pytest.raises(AssertionError):
        _check_pool_and_bound(*_streamed_step_with_host_ahead(bug))


def _reused_block_read(lever: type[OptimStateOffload]) -> tuple[float, float]:
    """A block the compute stream freed while a queued kernel still reads it, then a streamed step whose fetched
    moment is its best fit; returns (what the kernel read, what it should read)."""
    ps = _big_params(2)
    opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
    lever(opt, group_bytes=2 * ps[0].numel() * 4, pin=True)
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    x = torch.full((ps[0].numel(),), 7.0, device="cuda")  # the size of one moment: its block is the best fit
    torch.cuda._sleep(500_000_000)  # the reader queued far behind (hundreds of ms), so an unordered copy lands first
    total = x.sum()  # queued behind the sleep; reads x's block
    del x  # freed: the compute stream may reuse the block at once (its reader is queued on the same stream)
    opt.step()
    return total.item(), 7.0 * ps[0].numel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side streams")
def test_cuda_a_reused_block_is_not_overwritten_before_its_last_reader():
    """A fetched moment's copy (on the copy stream) waits for the compute stream's queued readers of its block."""
    got, want = _reused_block_read(OptimStateOffload)
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side streams")
def test_cuda_planted_copy_without_waiting_is_detected():
    got, want = _reused_block_read(CopiesWithoutWaiting)
    assert got != want


# ------------------------------------------------------------------ the stream's order, told by events (deterministic)
GPU_SLEEP_CYCLES = 1_000_000_000
"""``torch.cuda._sleep`` cycles queued on the compute stream first: about 0.5 s at an H100's or H200's clock, several
times the host's part of a streamed step, so the host is far ahead of the GPU while it issues the step."""


def _copy_done_while_compute_sleeps(lever: type[OptimStateOffload]) -> bool:
    """Whether group 0's fetch (its copy-stream event) completes within 0.1 s while the compute stream still sleeps."""
    ps = _big_params(2)
    opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
    off = lever(opt, group_bytes=2 * ps[0].numel() * 4, pin=True)
    opt.step()
    torch.cuda.synchronize()
    torch.cuda._sleep(GPU_SLEEP_CYCLES)
    _, event = off._fetch(off.groups[0])
    time.sleep(0.1)
    done = event.query()
    torch.cuda.synchronize()
    return done


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side streams")
def test_cuda_the_copy_waits_for_the_compute_streams_queued_work():
    """A fetch's copy runs after the compute stream's work queued before it (a reused block's readers among it)."""
    assert not _copy_done_while_compute_sleeps(OptimStateOffload)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side streams")
def test_cuda_planted_copy_without_waiting_is_told_by_its_event():
    assert _copy_done_while_compute_sleeps(CopiesWithoutWaiting)


def _most_write_backs_pending(lever: type[OptimStateOffload]) -> int:
    """A streamed step of 6 groups issued while the compute stream sleeps; returns the most write-back events still
    pending when a group is fetched (the groups whose buffers may still be on the device, besides the two in use)."""
    ps = _big_params(6)
    opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
    off = lever(opt, group_bytes=2 * ps[0].numel() * 4, pin=True)
    opt.step()
    torch.cuda.synchronize()
    events: list = []
    pending: list[int] = []
    fetch, writeback = off._fetch, off._writeback

    def counted_fetch(group):
        pending.append(sum(1 for e in events if e is not None and not e.query()))
        return fetch(group)

    def kept_writeback(group, fetched):
        events.append(writeback(group, fetched))
        return events[-1]

    off._fetch, off._writeback = counted_fetch, kept_writeback
    torch.cuda._sleep(GPU_SLEEP_CYCLES)
    opt.step()
    torch.cuda.synchronize()
    assert len(pending) == 6 and len(events) == 6
    return max(pending)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side streams")
def test_cuda_a_group_is_fetched_only_once_the_write_back_two_before_it_ended():
    """With the host far ahead, each fetch of group ``i + 1`` waits for group ``i - 2``'s write-back: at most one
    write-back (group ``i - 1``'s) is pending, so at most three groups' buffers exist at once."""
    assert _most_write_backs_pending(OptimStateOffload) <= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side streams")
def test_cuda_planted_no_room_wait_is_told_by_the_pending_write_backs():
    assert _most_write_backs_pending(NoRoomWait) > 2
