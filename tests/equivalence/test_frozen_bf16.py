"""Compact frozen storage (``COSMOS_FROZEN_BF16=1``) against stock HEAD dtypes: bit-exact, with a planted bug.

Stock is upstream HEAD's arrangement at world size 1: fp32 master parameters, FSDP2 with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` (gloo, one rank, CPU offload policy as CPU
FSDP2 needs). The lever casts the frozen parameters to bf16 before wrapping and keeps their fp32 values on
the host. Forward outputs are ``torch.equal``; after 6 optimizer steps (grad accumulation 2, clip 0.1, AdamW,
CPU-subset EMA) the parameters, the optimizer state, the EMA and the checkpoint (the trainer's full-state save,
written and read back) are ``torch.equal``, frozen entries fp32 byte for byte. A resume through
``load_full_state`` + ``refresh`` continues exactly. Planted: the fp32 values lost at save (the bf16 copy
saved, upcast) -- the check fails. Also run with the optimizer-state lever on: all levers together.
"""

from __future__ import annotations

import pytest
import torch

from cosmos_framework_ext.levers.ema import EMA, power_ema_beta, power_ema_gamma
from cosmos_framework_ext.levers.frozen_bf16 import FrozenBF16, WrappedFrozenBF16
from cosmos_framework_ext.levers.optim_offload import OptimStateOffload
from patches.core.checkpoint import gather_full_state, load_full_state

from . import tiny_recipe as R
from .test_optim_offload import _equal_trees

STEPS = 6


def _head_model(lever: type | None, seed: int = 0):
    """The tiny preset in fp32 (the master), optionally compact-frozen, then FSDP2 with upstream HEAD's policy.

    :class:`WrappedFrozenBF16` goes in upstream's order: every parameter trainable while the model is wrapped, the
    trainable subset marked after (upstream's optimizer build), then the lever."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model, trainable = R.make_model(seed=seed)
    wrapped = lever is not None and issubclass(lever, WrappedFrozenBF16)
    frozen = lever(model, torch.bfloat16) if lever is not None and not wrapped else None
    if wrapped:
        model.requires_grad_(True)
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False),
          "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)}
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    if wrapped:
        for n, p in model.named_parameters():
            p.requires_grad_(n in trainable)
        frozen = lever(model, torch.bfloat16)
    return model, trainable, frozen


def _run(lever, steps=STEPS, optim_lever=False) -> dict:
    model, trainable, frozen = _head_model(lever)
    opt = R.make_optimizer(model)
    off = OptimStateOffload(opt, group_bytes=64 << 10, pin=False) if optim_lever else None
    ema = EMA(model, placement="cpu_subset", trainable=trainable, pin=False)
    gamma = power_ema_gamma(0.1)
    with torch.no_grad():
        first = R.loss_of(model, R.micro_batch(99, 0)).detach().clone()
    R.train(model, opt, 0, steps, after_step=lambda i: ema.step(power_ema_beta(i, gamma)))
    return {"model": model, "opt": opt, "ema": ema, "frozen": frozen, "off": off, "first_loss": first}


def _saved(run: dict, tmp_path, name: str) -> dict:
    net, optim = gather_full_state(run["model"], run["opt"])
    path = tmp_path / f"{name}.pt"
    torch.save({"model": net, "optimizer": optim, "ema": run["ema"].full_state_dict()}, path)
    return torch.load(path, map_location="cpu", weights_only=False)


def _differences(a: dict, b: dict, tmp_path) -> list[str]:
    out = _equal_trees(_saved(a, tmp_path, "a"), _saved(b, tmp_path, "b"), "checkpoint")
    pa = {n: p for n, p in a["model"].named_parameters() if p.requires_grad}
    pb = {n: p for n, p in b["model"].named_parameters() if p.requires_grad}
    return out + _equal_trees(pa, pb, "trainable")


@pytest.fixture(scope="module")
def group():
    with R.one_rank():
        yield


@pytest.fixture(scope="module")
def stock(group):
    return _run(None)


@pytest.mark.parametrize("lever", [FrozenBF16, WrappedFrozenBF16], ids=["before-wrap", "after-wrap"])
def test_forward_identical_and_frozen_storage_is_bf16(stock, group, lever):
    from patches.core.torch_internals import fsdp_param_groups

    model, trainable, frozen = _head_model(lever)
    ref, _, _ = _head_model(None)
    params = dict(model.named_parameters())  # the sharded (stored) parameters, before any forward
    assert frozen.names and set(frozen.names) == {n for n, p in params.items() if not p.requires_grad}
    assert all(params[n].dtype == torch.bfloat16 for n in frozen.names)
    stored = {id(fp.sharded_param): fp._sharded_param_data.dtype for g in fsdp_param_groups(model)
              for fp in g.fsdp_params}
    assert all(stored[id(params[n])] == torch.bfloat16 for n in frozen.names)  # FSDP2's own storage: no fp32 left
    assert all(params[n].dtype == torch.float32 for n in trainable)
    assert frozen.device_bytes_saved == sum(params[n].numel() * 2 for n in frozen.names)
    sd, sd_ref = model.state_dict(), ref.state_dict()
    with torch.no_grad():
        out = R.loss_of(model, R.micro_batch(99, 0))
        out_ref = R.loss_of(ref, R.micro_batch(99, 0))
    assert torch.equal(out, out_ref)
    assert all(sd[n].dtype == torch.float32 and torch.equal(to_full(sd[n]), to_full(sd_ref[n])) for n in frozen.names)


def to_full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize("lever", [FrozenBF16, WrappedFrozenBF16], ids=["before-wrap", "after-wrap"])
def test_training_equals_stock_bit_for_bit(stock, group, tmp_path, lever):
    run = _run(lever)
    assert torch.equal(stock["first_loss"], run["first_loss"])
    assert not _differences(stock, run, tmp_path)


@pytest.mark.parametrize("lever", [FrozenBF16, WrappedFrozenBF16], ids=["before-wrap", "after-wrap"])
def test_all_levers_with_optimizer_streaming_equal_stock(stock, group, tmp_path, lever):
    assert not _differences(stock, _run(lever, optim_lever=True), tmp_path)


def _dcp_files(model, where) -> dict[str, object]:
    """The DCP files of ``model.state_dict()``: data files' bytes, and the metadata's entries (the one thing a
    save writes differently each time is its random ``save_id``)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(model.state_dict(), checkpoint_id=str(where))
    meta = dcp.FileSystemReader(str(where)).read_metadata()
    files: dict[str, object] = {f.name: f.read_bytes() for f in sorted(where.iterdir()) if f.name != ".metadata"}
    files[".metadata"] = (meta.state_dict_metadata, meta.storage_data, meta.planner_data)
    return files


def test_wrapped_dcp_checkpoint_is_stocks_byte_for_byte_and_loads_back(stock, group, tmp_path):
    """Upstream's checkpoint route: ``torch.distributed.checkpoint`` over ``state_dict()`` (what its DCP
    ``ModelWrapper`` reads) writes the same files as stock after the same training; a fresh model of another init
    loads them through a ``state_dict()`` template and trains on exactly as stock does."""
    import torch.distributed.checkpoint as dcp

    lever = _run(WrappedFrozenBF16, steps=3)
    ref = _run(None, steps=3)
    assert _dcp_files(lever["model"], tmp_path / "lever") == _dcp_files(ref["model"], tmp_path / "stock")

    def resumed(kind):
        model, _, frozen = _head_model(kind, seed=1)
        template = model.state_dict()
        dcp.load(template, checkpoint_id=str(tmp_path / "stock"))
        model.load_state_dict(template)
        opt = R.make_optimizer(model)
        R.train(model, opt, 3, STEPS)
        return {"model": model, "opt": opt, "frozen": frozen}

    a, b = resumed(None), resumed(WrappedFrozenBF16)
    assert b["frozen"].names
    assert not _equal_trees(a["model"].state_dict(), b["model"].state_dict(), "resumed")


def _resume(lever, tmp_path) -> dict:
    """3 steps, the trainer's save, a fresh model of another init loaded from it, 3 more steps."""
    ckpt = _saved(_run(lever, steps=3), tmp_path, "first")
    model, trainable, frozen = _head_model(lever, seed=1)  # another init: all from the checkpoint
    opt = R.make_optimizer(model)
    load_full_state(model, ckpt["model"], opt, ckpt["optimizer"])
    if frozen is not None:
        frozen.refresh()
    ema = EMA(model, placement="cpu_subset", trainable=trainable, pin=False)
    ema.load_state_dict(ckpt["ema"])
    gamma = power_ema_gamma(0.1)
    R.train(model, opt, 3, STEPS, after_step=lambda i: ema.step(power_ema_beta(i, gamma)))
    return {"model": model, "opt": opt, "ema": ema}


def test_resume_reloads_fp32_and_device_copies(group, tmp_path):
    """Lever resume == stock resume (both through ``load_full_state``; the lever then ``refresh``-es)."""
    assert not _differences(_resume(None, tmp_path), _resume(FrozenBF16, tmp_path), tmp_path)


def test_module_load_state_dict_keeps_fp32_on_the_host(group):
    """A warm start through ``model.load_state_dict`` (the trainer's base-checkpoint load), before wrapping."""
    src, _ = R.make_model(seed=3)
    model, _ = R.make_model(seed=0)
    frozen = FrozenBF16(model, torch.bfloat16)
    model.load_state_dict(src.state_dict())
    ref = src.state_dict()
    for n in frozen.names:
        assert torch.equal(model.state_dict()[n], ref[n])  # fp32 values, exact
        assert torch.equal(dict(model.named_parameters())[n], ref[n].to(torch.bfloat16))  # device copy = cast


# --------------------------------------------------------------------------------------- planted bug
class LosesFp32(FrozenBF16):
    """Planted: the fp32 values are lost at save (the bf16 device copy is saved, upcast)."""

    def _saved_value(self, name, live):
        return live.float()


def test_planted_fp32_lost_at_save_is_detected(stock, group, tmp_path):
    assert _differences(stock, _run(LosesFp32), tmp_path)


class WrappedLosesFp32(WrappedFrozenBF16):
    """Planted, after wrapping: the fp32 values are lost at save (the bf16 device copy is saved, upcast)."""

    def _saved_value(self, name, live):
        return to_full(live).float()


def test_planted_wrapped_fp32_lost_at_save_is_detected(stock, group, tmp_path):
    assert _differences(stock, _run(WrappedLosesFp32), tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: FSDP2 on the GPU, fused AdamW, side streams")
def test_cuda_head_dtypes_all_levers_equal_stock(tmp_path):
    """On the GPU (one NCCL rank, as the trainer at HEAD dtypes): fp32 master, FSDP2 MixedPrecisionPolicy(bf16),
    fused AdamW; stock vs compact frozen storage + optimizer-state streaming, 4 steps: bit-exact, state on the
    host between steps."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from patches.core.runtime import to_local

    def run(levers: bool):
        model, trainable = R.make_model()
        model.cuda()
        frozen = FrozenBF16(model, torch.bfloat16) if levers else None
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for layer in model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, betas=(0.9, 0.95),
                                eps=1e-6, fused=True)
        off = OptimStateOffload(opt, group_bytes=64 << 10) if levers else None
        ema = EMA(model, placement="cpu_subset", trainable=trainable)
        gamma = power_ema_gamma(0.1)
        R.train(model, opt, 0, 4, after_step=lambda i: ema.step(power_ema_beta(i, gamma)))
        if off is not None:
            assert all(to_local(st["exp_avg"]).device.type == "cpu" for st in opt.state.values())
            assert off.pinned_bytes > 0 and frozen.device_bytes_saved > 0
        return {"model": model, "opt": opt, "ema": ema}

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert not _differences(run(False), run(True), tmp_path)
    finally:
        if owned:
            dist.destroy_process_group()
