"""The offloaded adapters' AdamW step on the device (``miles_ext.levers.adapter_step``) changes no value.

Claims, on the tiny H3 preset with 5 transformer blocks and LoRA (fp32, one gloo rank), full CPU offload with the exact
arena (every block and the adapters on the host), 2 micro-batches per step, clip 0.05:

- CPU, where the "device" is the host and the step is stock full offload's own kernel: after 3 optimizer steps the
  adapters, both AdamW moments and the step counts are **bitwise** those of stock full offload (torch's AdamW stepping
  the host shards), with stream groups of one parameter and of many; the optimizer's state keeps the stock layout
  (the same keys in the same order, DTensor moments of the parameters' shapes and dtype on the host) and lives in the
  lever's arena; the checkpoint (:func:`miles_ext.levers.host_checkpoint.host_full_state`) has the stock layout, and
  2 steps, a save, a fresh run with the lever loading it and 1 more step give the 3 straight steps' bits;
- CUDA (the device machine): the adapters and moments after 3 steps are **bitwise** the all-resident run's (adapters,
  gradients and AdamW on the GPU: the same foreach kernel on the same values), and with
  :func:`~miles_ext.levers.adapter_step.pin_adapter_gradients` the backward makes no synchronous gradient copy.

The independent anchor is torch's own ``AdamW`` on the stock placement (CPU) and on the all-resident one (CUDA).
Planted bugs, each failing its check: a moment streamed through bf16, a parameter not written back, a stream group
skipped (CPU); the compute stream not waiting for a group's copies (CUDA, with the copies delayed on their stream).
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest
import torch

from tests.equivalence.h3_ranks import cpu_mesh, launch
from tests.equivalence.test_h3_residency import _equal

STEPS, LAYERS, MICRO = 3, 5, 2
ONE_PARAM_GROUPS = 1  # bytes: every parameter a stream group of its own
SOME_GROUPS = 48 << 10  # bytes: several parameters per group on the tiny preset


def _preset():
    from miles_ext.recipe.presets import TINY

    return dataclasses.replace(TINY, num_layers=LAYERS)


def _plant(bug: str):
    """Install a planted bug in :class:`AdapterStepOnDevice`; returns the undo."""
    from miles_ext.levers import adapter_step as a

    cls = a.AdapterStepOnDevice
    if bug == "bf16_moment":
        real = cls._copy_in

        def copy_in(self, src):  # a moment (an arena view) rounded through bf16 on its way in
            base, size = self.arena.tensors[0].data_ptr(), self.arena.nbytes
            if base <= src.data_ptr() < base + size:
                src = src.to(torch.bfloat16).to(src.dtype)
            return real(self, src)

        cls._copy_in = copy_in
        return lambda: setattr(cls, "_copy_in", real)
    if bug == "param_not_written":
        real_wb = cls._write_back

        def write_back(self, group, fetched):
            from patches.core.runtime import to_local

            before = [to_local(p).detach().clone() for p in group.params]
            real_wb(self, group, fetched)
            if self._d2h is not None:
                self._d2h.synchronize()
            for p, old in zip(group.params, before):
                to_local(p).detach().copy_(old)

        cls._write_back = write_back
        return lambda: setattr(cls, "_write_back", real_wb)
    if bug == "group_skipped":
        real_plan = cls._plan
        cls._plan = lambda self, group_bytes: real_plan(self, group_bytes)[:-1]
        return lambda: setattr(cls, "_plan", real_plan)
    if bug in ("slow_step", "slow_step_unmarked"):  # each group's step held back on the compute stream
        real_step, real_mark = cls._step, cls._used_by_compute

        def slow_step(self, group, fetched):
            torch.cuda._sleep(20_000_000)
            return real_step(self, group, fetched)

        cls._step = slow_step
        if bug == "slow_step_unmarked":  # ... and the device copies not marked as used by the compute stream
            cls._used_by_compute = lambda self, fetched: None
        return lambda: (setattr(cls, "_step", real_step), setattr(cls, "_used_by_compute", real_mark))
    if bug in ("slow_copy", "missing_wait"):
        real_wait, real_in = cls._wait, cls._copy_in

        def slow_in(self, src):  # each group's copies held back on their stream: a step that does not wait reads junk
            torch.cuda._sleep(20_000_000)
            return real_in(self, src)

        cls._copy_in = slow_in
        if bug == "missing_wait":  # ... and the compute stream does not wait for them
            cls._wait = lambda self, event: None
        return lambda: (setattr(cls, "_wait", real_wait), setattr(cls, "_copy_in", real_in))
    assert not bug
    return lambda: None


def _build(*, mode: str, lever: bool, group_bytes: int, device, mesh):
    from miles_ext.levers.adapter_step import AdapterStepOnDevice, pin_adapter_gradients
    from miles_ext.levers.fsdp_policy import apply_fsdp2
    from miles_ext.levers.lora import lora_parameters
    from tests.equivalence.h3_tiny_run import OPTIM, make_lora_model

    model = make_lora_model(_preset())
    model.enable_gradient_checkpointing()
    model.train()
    apply_fsdp2(model, param_dtype=None, reduce_dtype=torch.float32, mesh=mesh, cpu_offload=True, exact_pin=True,
                adapters_on_device=mode == "resident")
    lora = lora_parameters(model)
    opt = torch.optim.AdamW(list(lora.values()), **OPTIM)
    pinned = pin_adapter_gradients(model) if lever else 0
    step = AdapterStepOnDevice(opt, device, group_bytes=group_bytes) if lever else None
    return model, lora, opt, step, pinned


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def _train(model, opt, steps: list, pairs, device) -> None:
    from miles_ext.recipe.sft import train_step

    for slots in steps:
        train_step(model, opt, slots, pairs, seed=3, max_grad_norm=0.05, device=device)


def _layout(opt, name_of) -> dict:
    from patches.core.runtime import to_local

    return {name_of[id(p)]: [(k, type(v).__name__, v.dtype, tuple(v.shape), to_local(v).device.type, v.requires_grad)
                             for k, v in st.items()] for p, st in opt.state.items()}


def run(*, mode: str = "offload", lever: bool = False, group_bytes: int = SOME_GROUPS, bug: str = "", device=None,
        mesh=None, resume_after: int | None = None) -> dict:
    """Train :data:`STEPS` steps; adapters, moments, step counts and the state's layout after, and the checkpoint's
    layout. ``resume_after``: that many steps, a checkpoint, then a fresh model, optimizer and lever that load it and
    train the rest."""
    from miles_ext.levers.host_checkpoint import host_full_state, load_host_state
    from miles_ext.recipe.schedule import pair_schedule
    from patches.core.runtime import to_local
    from tests.equivalence.h3_tiny_run import synthetic_pairs

    undo = _plant(bug)
    dev = torch.device(device or "cpu")
    try:
        pairs = synthetic_pairs(MICRO * STEPS, _preset())
        schedule = pair_schedule(MICRO, 1, STEPS, 1)[:STEPS]
        model, lora, opt, step, pinned = _build(mode=mode, lever=lever, group_bytes=group_bytes, device=dev, mesh=mesh)
        cut = STEPS if resume_after is None else resume_after
        _train(model, opt, schedule[:cut], pairs, device)
        if resume_after is not None:
            full, optimizer = host_full_state(model, opt, lora)
            buf = io.BytesIO()
            torch.save({"lora": full, "optimizer": optimizer}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=False)
            model, lora, opt, step, pinned = _build(mode=mode, lever=lever, group_bytes=group_bytes, device=dev,
                                                    mesh=mesh)
            with torch.no_grad():
                for k, p in lora.items():
                    to_local(p).copy_(saved["lora"][k])
            load_host_state(model, opt, lora, saved["optimizer"])
            loaded = _layout(opt, {id(p): n for n, p in lora.items()})
            _train(model, opt, schedule[cut:], pairs, device)
        name_of = {id(p): n for n, p in lora.items()}
        out = {"weights": {n: _full(p) for n, p in lora.items()},
               "moments": {name_of[id(p)]: {k: _full(v) for k, v in st.items() if k != "step"}
                           for p, st in opt.state.items()},
               "steps": {name_of[id(p)]: float(st["step"]) for p, st in opt.state.items()},
               "layout": _layout(opt, name_of)}
        if resume_after is not None:
            out["layout_after_load"] = loaded
        full, optimizer = host_full_state(model, opt, lora)
        out["checkpoint"] = {n: [(k, type(v).__name__, v.dtype, tuple(v.shape)) for k, v in st.items()]
                             for n, st in optimizer["state"].items()}
        if step is not None:
            arena = step.arena.tensors
            lo, hi = arena[0].data_ptr(), arena[0].data_ptr() + step.arena.nbytes
            out["in_arena"] = all(lo <= to_local(v).data_ptr() < hi for st in opt.state.values()
                                  for k, v in st.items() if k != "step")
            out["groups"], out["stats"] = len(step.groups), dict(step.stats)
            out["pinned_grads"] = pinned
        return out
    finally:
        undo()


def _same(a: dict, b: dict) -> bool:
    return (_equal(a["weights"], b["weights"]) and a["steps"] == b["steps"]
            and a["moments"].keys() == b["moments"].keys()
            and all(_equal(a["moments"][n], b["moments"][n]) for n in a["moments"]))


def _worker(rank: int, world: int, out_dir: str) -> None:
    mesh = cpu_mesh()
    res = {"stock": run(mesh=mesh), "one": run(lever=True, group_bytes=ONE_PARAM_GROUPS, mesh=mesh),
           "some": run(lever=True, mesh=mesh), "resumed": run(lever=True, resume_after=2, mesh=mesh)}
    for bug in ("bf16_moment", "param_not_written", "group_skipped"):
        res[bug] = run(lever=True, bug=bug, mesh=mesh)
    torch.save(res, Path(out_dir) / "adapter_step.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("adapter_step")
    launch(_worker, 1, str(out))
    return torch.load(out / "adapter_step.pt", weights_only=False)


@pytest.mark.parametrize("name", ["one", "some"])
def test_the_step_on_the_device_is_bitwise_stock_full_offload(results, name):
    ref, got = results["stock"], results[name]
    assert ref["steps"] and set(ref["steps"].values()) == {float(STEPS)}
    assert _same(got, ref), f"{name}: adapters, moments or step counts differ from stock full offload"
    assert got["groups"] > 1 and got["stats"]["steps"] == STEPS
    assert results["one"]["groups"] == len(ref["weights"]) > results["some"]["groups"]


def test_the_state_keeps_the_stock_layout_in_the_arena(results):
    """The same keys in the same order, DTensor moments with the parameters' shapes and dtype on the host, living in
    the lever's arena; the checkpoint's layout unchanged; no gradient pinned on a CPU run (nothing is page-locked)."""
    for name in ("one", "some", "resumed"):
        assert results[name]["layout"] == results["stock"]["layout"], name
        assert results[name]["checkpoint"] == results["stock"]["checkpoint"], name
        assert results[name]["in_arena"], name
    assert all(kinds[1][1] == "DTensor" and kinds[0][0] == "step" for kinds in results["stock"]["layout"].values())
    assert results["some"]["pinned_grads"] == 0
    # a load puts the moments into the arena as the same DTensors at once (before any step re-wraps them)
    assert results["resumed"]["layout_after_load"] == results["stock"]["layout"]
    assert not any(kind[-1] for kinds in results["some"]["layout"].values() for kind in kinds)  # no state needs grad


def test_a_save_and_a_resume_continue_bitwise(results):
    assert _same(results["resumed"], results["stock"])


def test_the_adapters_moved(results):
    """The run trains: the adapters after 3 steps differ from their initial values (guards a vacuous comparison)."""
    from tests.equivalence.h3_tiny_run import make_lora_model
    from miles_ext.levers.lora import lora_parameters

    init = {n: p.detach() for n, p in lora_parameters(make_lora_model(_preset())).items()}
    assert any(not torch.equal(init[n], w) for n, w in results["stock"]["weights"].items())


@pytest.mark.parametrize("bug", ["bf16_moment", "param_not_written", "group_skipped"])
def test_planted_bugs_are_caught(results, bug):
    assert not _same(results[bug], results["stock"]), f"planted {bug} was not caught"


# ------------------------------------------------------------------------------- on the GPU (device machine)
def _sync_grad_copies(model, opt, pairs, schedule) -> int:
    """Synchronous device-to-host gradient copies FSDP2 makes in one step's backward (its ``non_blocking=False``
    copies of an offloaded gradient)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as c

    count = [0]
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and str(args[0]) == "cpu" and self.is_cuda and not kwargs.get("non_blocking", False):
            count[0] += 1
        return real_to(self, *args, **kwargs)

    torch.Tensor.to = to
    try:
        _train(model, opt, schedule, pairs, "cuda")
    finally:
        torch.Tensor.to = real_to
    return count[0]


def _cuda_worker(rank: int, world: int, out_dir: str) -> None:
    from miles_ext.recipe.schedule import pair_schedule
    from tests.equivalence.h3_tiny_run import synthetic_pairs

    torch.cuda.set_device(0)
    torch.use_deterministic_algorithms(True)
    res = {"resident": run(mode="resident", device="cuda"), "stock": run(device="cuda"),
           "lever": run(lever=True, device="cuda"), "one": run(lever=True, group_bytes=ONE_PARAM_GROUPS, device="cuda"),
           "missing_wait": run(lever=True, group_bytes=ONE_PARAM_GROUPS, device="cuda", bug="missing_wait"),
           "slow_copy": run(lever=True, group_bytes=ONE_PARAM_GROUPS, device="cuda", bug="slow_copy"),
           "slow_step": run(lever=True, group_bytes=ONE_PARAM_GROUPS, device="cuda", bug="slow_step"),
           "slow_step_unmarked": run(lever=True, group_bytes=ONE_PARAM_GROUPS, device="cuda", bug="slow_step_unmarked")}
    pairs = synthetic_pairs(MICRO, _preset())
    schedule = pair_schedule(MICRO, 1, 1, 1)[:1]
    for name, lever in (("sync_copies_stock", False), ("sync_copies_lever", True)):
        model, _, opt, _, _ = _build(mode="offload", lever=lever, group_bytes=SOME_GROUPS, device=torch.device("cuda"),
                                  mesh=None)
        res[name] = _sync_grad_copies(model, opt, pairs, schedule)
    torch.save(res, Path(out_dir) / "cuda.pt")


@pytest.fixture(scope="module")
def cuda_results(tmp_path_factory):
    from tests.equivalence.h3_ranks import cuda_results as run_cuda

    return run_cuda(tmp_path_factory, _cuda_worker, "adapter_step_cuda")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")


@needs_cuda
@pytest.mark.parametrize("name", ["lever", "one"])
def test_cuda_the_step_is_bitwise_the_all_resident_run(cuda_results, name):
    assert cuda_results[name]["pinned_grads"] > 0
    assert _same(cuda_results[name], cuda_results["resident"])


@needs_cuda
def test_cuda_the_backward_makes_no_synchronous_gradient_copy(cuda_results):
    """With the gradients pinned the first micro-batch's copies do not wait (the second adds into them, as FSDP2
    does: one synchronous copy per unit instead of two)."""
    assert cuda_results["sync_copies_lever"] < cuda_results["sync_copies_stock"]


@needs_cuda
def test_cuda_a_slow_step_reads_its_own_groups_copies(cuda_results):
    """Each group's step held back on the compute stream while the next groups' copies run ahead on theirs: the values
    are still the all-resident run's (the device copies are marked as used by the compute stream, so a freed gradient
    is not handed to a later group's copy while the step reads it); without the mark they are not."""
    assert _same(cuda_results["slow_step"], cuda_results["resident"])
    assert not _same(cuda_results["slow_step_unmarked"], cuda_results["resident"])


@needs_cuda
def test_cuda_a_late_copy_is_waited_for(cuda_results):
    """Each group's host-to-device copies held back on their stream: the step waits for them, so the values are still
    the all-resident run's (the planted run below drops the wait and reads unfilled buffers)."""
    assert _same(cuda_results["slow_copy"], cuda_results["resident"])


@needs_cuda
def test_cuda_planted_missing_stream_wait_is_caught(cuda_results):
    assert not _same(cuda_results["missing_wait"], cuda_results["resident"])


# ------------------------------------------------------------------------ plain tensors, in this process (no FSDP)
def _plain(*, lever: bool, group_bytes: int = 1 << 20, steps: int = 3, hook_calls: list | None = None):
    """Five host parameters in two param groups (amsgrad and lr 1e-2 in the first; lr 3e-3 and weight decay 0.1 in the
    second), 3 steps of seeded gradients, the middle parameter of the first group without a gradient at step 2; stock
    ``AdamW`` (the independent anchor) or the lever stepping the same optimizer class on the "device" (the host)."""
    from miles_ext.levers.adapter_step import AdapterStepOnDevice

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in ((3, 4), (5,), (2, 2), (7, 3), (4,))]
    opt = torch.optim.AdamW([{"params": ps[:3], "lr": 1e-2, "amsgrad": True},
                             {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.1}], betas=(0.9, 0.95))
    if hook_calls is not None:
        opt.register_step_pre_hook(lambda *args: hook_calls.append(1))
    stepper = AdapterStepOnDevice(opt, "cpu", group_bytes=group_bytes) if lever else None
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        for i, p in enumerate(ps):
            p.grad = None if (i == 1 and s == 1) else torch.randn(p.shape, generator=g)
        opt.step()
    state = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(ps)}
    return [p.detach().clone() for p in ps], state, stepper


@pytest.mark.parametrize("group_bytes", [1, 1 << 20], ids=["one-parameter-groups", "one-group-per-param-group"])
def test_plain_parameters_param_groups_amsgrad_and_a_missing_gradient_step_as_stock(group_bytes):
    """Each param group steps with its own hyper-parameters, amsgrad's third moment streams with the others, a
    parameter without a gradient in the middle of a stream group is skipped as stock skips it (its step count too)."""
    ref_w, ref_s, _ = _plain(lever=False)
    got_w, got_s, stepper = _plain(lever=True, group_bytes=group_bytes)
    assert all(torch.equal(a, b) for a, b in zip(ref_w, got_w))
    assert ref_s.keys() == got_s.keys() and ref_s[1]["step"] == 2 and ref_s[0]["step"] == 3
    for i in ref_s:
        assert list(ref_s[i]) == list(got_s[i]) and all(torch.equal(ref_s[i][k], got_s[i][k]) for k in ref_s[i]), i
    assert "max_exp_avg_sq" in got_s[0] and "max_exp_avg_sq" not in got_s[3]
    assert [g.group_index for g in stepper.groups] == ([0, 0, 0, 1, 1] if group_bytes == 1 else [0, 1])


def test_stream_groups_are_cut_where_the_next_parameter_would_pass_the_budget():
    """Group bytes count the parameter, its gradient and its moments (fp32: 4 x 4 bytes per value; 5 with amsgrad); a
    group exactly at the budget is kept whole."""
    from miles_ext.levers.adapter_step import AdapterStepOnDevice

    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (4, 4, 8)]
    opt = torch.optim.AdamW(ps)
    stepper = AdapterStepOnDevice(opt, "cpu", group_bytes=128)  # 4 values x 4 bytes x (param, grad, 2 moments) = 64
    assert [[p.numel() for p in g.params] for g in stepper.groups] == [[4, 4], [8]]
    assert [g.nbytes for g in stepper.groups] == [128, 128]


@pytest.mark.parametrize("setting", [dict(fused=True), dict(capturable=True), dict(foreach=True)])
def test_fused_and_capturable_are_refused_foreach_is_stepped(setting):
    from miles_ext.levers.adapter_step import AdapterStepOnDevice
    from patches.core.errors import UserError

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], **setting)
    if "foreach" in setting:
        AdapterStepOnDevice(opt, "cpu")
        return
    with pytest.raises(UserError, match="fused and capturable keep their state"):
        AdapterStepOnDevice(opt, "cpu")


def test_a_failing_step_leaves_the_param_groups_as_they_were():
    from miles_ext.levers.adapter_step import AdapterStepOnDevice

    ps = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.AdamW(ps)
    stepper = AdapterStepOnDevice(opt, "cpu", group_bytes=1)
    for p in ps:
        p.grad = torch.ones_like(p)

    def boom(optimizer):
        raise RuntimeError("planted failure in the step")

    stepper._raw_step = boom
    with pytest.raises(RuntimeError, match="planted failure"):
        opt.step()
    assert opt.param_groups[0]["params"] == ps and all(a is b for a, b in zip(opt.param_groups[0]["params"], ps))


def test_step_hooks_run_once_per_optimizer_step_not_per_stream_group():
    calls: list = []
    _, _, stepper = _plain(lever=True, group_bytes=1, hook_calls=calls)
    assert len(stepper.groups) == 5 and len(calls) == 3
