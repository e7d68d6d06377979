"""The patches against the real cosmos-framework code (CPU): targets, EMA A/B, DCP round trip, refusal.

The upstream model is too large to build here, so the tests call upstream's own ``OmniMoTModel`` methods
(``set_up_model``, ``on_before_zero_grad``, ``ema_beta``, ``ema_scope``) unbound on a small stand-in
module whose ``build_net`` returns a tiny tower with upstream's parameter names (upstream's own CPU test
pattern), and save and load through upstream's DCP ``ModelWrapper`` with ``torch.distributed.checkpoint``.
Only torch and the upstream's own dependencies are needed, not this project's diffusers version.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from cosmos_framework_ext.levers.ema import canonical_name
from cosmos_framework_ext.upstream.patches import EmaPlaceholder, HostEmaWorker
from patches.cosmos_table import patch_set
from patches.core.errors import UpstreamMismatch
from patches.core.runtime import to_local

ROOT = os.environ.get("COSMOS_FRAMEWORK_ROOT", "")
KEYS = ["moe_gen", "time_embedder", "vae2llm", "llm2vae", "k_norm_und_for_gen"]
ON = {"COSMOS_EMA_CPU_SUBSET": True, "COSMOS_VAE_CPU_OFFLOAD": True, "COSMOS_ATTN_BACKEND": "torch",
      "COSMOS_OPTIM_STATE_OFFLOAD": True, "COSMOS_FROZEN_BF16": True, "COSMOS_LATENT_CACHE": True,
      "COSMOS_DETACH_TEXT_STREAM": True}


def _om():
    from cosmos_framework.model.generator import omni_mot_model

    return omni_mot_model


class TinyBlock(torch.nn.Module):
    """One decoder layer with upstream's naming: an understanding MLP and its ``*_moe_gen`` duplicate."""

    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Linear(8, 8)
        self.mlp_moe_gen = torch.nn.Linear(8, 8)
        self.k_norm_und_for_gen = torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.mlp(x) + self.mlp_moe_gen(self.k_norm_und_for_gen(x))


class TinyTower(torch.nn.Module):
    """A stand-in for upstream's Cosmos3 tower: the parameter names ``keys_to_select`` matches, a buffer."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList([TinyBlock() for _ in range(2)])
        self.time_embedder = torch.nn.Linear(4, 8)
        self.vae2llm = torch.nn.Linear(6, 8)
        self.llm2vae = torch.nn.Linear(8, 6)
        self.register_buffer("position_scale", torch.ones(8))


class StandIn(torch.nn.Module):
    """What upstream's OmniMoTModel methods touch, with the tiny Cosmos3 preset as ``net``."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(ema=SimpleNamespace(enabled=True, rate=0.1, iteration_shift=0))
        self.parallel_dims = SimpleNamespace()
        self.precision = torch.float32

    def build_net(self, dtype=torch.float32, mp_policy=None, lora_enabled=False):
        torch.manual_seed(0)
        net = TinyTower().to(dtype)
        # the wrappers upstream applies per block: names gain _checkpoint_wrapped_module / _orig_mod
        for i, layer in enumerate(net.layers):
            net.layers[i] = torch.compile(checkpoint_wrapper(layer))
        return net

    def set_up_memory(self):
        pass

    def ema_beta(self, iteration):
        return _om().OmniMoTModel.ema_beta(self, iteration)  # upstream's own schedule


@pytest.fixture()
def om(monkeypatch):
    m = _om()
    if hasattr(m, "_get_master_dtype_and_mp_policy"):  # 5eee9ed: fp32 master, no FSDP policy on CPU
        monkeypatch.setattr(m, "_get_master_dtype_and_mp_policy", lambda config, precision: (torch.float32, None))
    return m


def set_up(om) -> StandIn:
    model = StandIn()
    om.OmniMoTModel.set_up_model(model)
    for n, p in model.net.named_parameters():  # upstream's keys_to_select: a substring match
        p.requires_grad_(any(k in n for k in KEYS))
    return model


def train_steps(om, model, steps=8):
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        with torch.no_grad():
            for p in model.net.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=g) * 0.01)
        om.OmniMoTModel.on_before_zero_grad(model, None, None, i)


def test_flags_patch_exactly_the_table_and_revert(om):
    ps = patch_set()
    before = {p.target: p.resolve()[2] for p in ps.patches}
    assert ps.apply({}) == []  # unset flags: upstream untouched
    assert {p.target: p.resolve()[2] for p in ps.patches} == before
    patched = ps.apply(ON)
    assert patched == [p.target for p in ps.patches]
    assert all(state for _, _, state in ps.status())
    ps.revert()
    assert {p.target: p.resolve()[2] for p in ps.patches} == before


def test_ema_lever_equals_upstream_stock_updater(om):
    stock = set_up(om)  # unpatched: upstream's fp32 net_ema tower + DTensorFastEmaModelUpdater
    assert not isinstance(stock.net_ema, EmaPlaceholder)
    train_steps(om, stock)
    ps = patch_set()
    ps.apply({"COSMOS_EMA_CPU_SUBSET": True})
    try:
        lever = set_up(om)
        assert isinstance(lever.net_ema, EmaPlaceholder) and isinstance(lever.net_ema_worker, HostEmaWorker)
        assert sum(p.numel() for p in lever.net_ema.parameters()) == 0  # no fp32 tower
        assert lever.ema_exp_coefficient == pytest.approx(6.9372, abs=1e-4)
        train_steps(om, lever)
        assert lever.net_ema_worker.ema.model is lever.net and lever.net_ema_worker.ema.placement == "cpu_subset"
        ema = lever.net_ema_worker.ema.state_dict()["shadow"]
        stock_ema = {canonical_name(n): p for n, p in stock.net_ema.named_parameters()}
        trainable = [canonical_name(n) for n, p in lever.net.named_parameters() if p.requires_grad]
        assert trainable and all(torch.equal(ema[k], stock_ema[k]) for k in trainable)

        # upstream's ema_scope: EMA in, training weights back bit-exact
        before = {n: p.detach().clone() for n, p in lever.net.named_parameters()}
        with om.OmniMoTModel.ema_scope(lever):
            for n, p in lever.net.named_parameters():
                if p.requires_grad:
                    assert torch.equal(p.detach(), ema[canonical_name(n)])
        assert all(torch.equal(p.detach(), before[n]) for n, p in lever.net.named_parameters())
    finally:
        ps.revert()


def test_dcp_round_trip_restores_the_host_ema(om, tmp_path):
    import torch.distributed.checkpoint as dcp
    from cosmos_framework.checkpoint.dcp import ModelWrapper

    ps = patch_set()
    ps.apply({"COSMOS_EMA_CPU_SUBSET": True})
    try:
        model = set_up(om)
        train_steps(om, model)
        sd = ModelWrapper(model).state_dict()
        net_keys = {k[4:] for k in sd if k.startswith("net.")}
        ema_keys = {k[8:] for k in sd if k.startswith("net_ema.")}
        assert net_keys and net_keys == ema_keys  # net_ema.<k> for every net.<k>
        assert not any("_orig_mod" in k or "_checkpoint_wrapped_module" in k for k in sd)
        dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt"))
        expect = model.net_ema_worker.ema.state_dict()["shadow"]

        fresh = set_up(om)
        template = ModelWrapper(fresh).state_dict()
        dcp.load(template, checkpoint_id=str(tmp_path / "ckpt"))
        result = ModelWrapper(fresh).load_state_dict(template)
        assert not [k for k in result.unexpected_keys if k.startswith("net_ema.")]
        got = fresh.net_ema_worker.ema.state_dict()["shadow"]
        assert got.keys() == expect.keys() and all(torch.equal(got[k], expect[k]) for k in expect)
    finally:
        ps.revert()


def test_changed_signature_is_refused_by_name(om, monkeypatch):
    monkeypatch.setattr(om.OmniMoTModel, "encode", lambda self, state, extra: None)
    with pytest.raises(UpstreamMismatch, match="OmniMoTModel.encode has parameters"):
        patch_set().apply(ON)


@pytest.mark.parametrize("flags", ["1", "0"], ids=["patched", "unpatched"])
def test_upstream_cpu_tests_pass(flags):
    """Upstream's own CPU tests for model, checkpoint and SFT config, run through the same wrapper as training."""
    files = [f for f in (
        "cosmos_framework/configs/toml_config/sft_config_test.py",
        "cosmos_framework/model/generator/omni_mot_model_test.py",
        "cosmos_framework/checkpoint/dcp_distill_test.py",
    ) if (Path(ROOT) / f).is_file()]
    env = dict(os.environ, COSMOS_EMA_CPU_SUBSET=flags, COSMOS_VAE_CPU_OFFLOAD=flags,
               PYTHONPATH=os.pathsep.join([ROOT, str(Path(__file__).resolve().parents[2])]))
    r = subprocess.run([sys.executable, "-m", "patches.run", "pytest", "-q", "-p", "no:cacheprovider",
                        "-c", ".pytest.toml", *files], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"patched: {'nothing' if flags == '0' else 'cosmos_framework'}" in r.stderr


def test_vae_offload_on_upstream_wan_vae_is_bit_exact():
    """Upstream's own ``WanVAE_`` (small), resident vs parked by the lever: latents ``torch.equal``."""
    from cosmos_framework.model.generator.tokenizers.wan2pt2_vae_4x16x16 import WanVAE_

    from cosmos_framework_ext.upstream.patches import UpstreamVaeOffload

    torch.manual_seed(0)
    vae = WanVAE_(dim=8, dec_dim=8, z_dim=48, num_res_blocks=1).eval().requires_grad_(False)
    wan = SimpleNamespace(model=vae, scale=(torch.randn(48), torch.rand(48) + 0.5))
    x = torch.rand(1, 3, 5, 32, 32) * 2 - 1
    with torch.no_grad():
        resident = vae.encode(x, wan.scale)
    off = UpstreamVaeOffload(wan, torch.device("cpu"))
    assert off.parked and all(off.in_arena(p) for p in vae.parameters())
    with torch.no_grad(), off.on_device():
        with off.on_device():  # nested (get_data_and_condition -> encode): one depth counter, no second move
            assert not any(off.in_arena(p) for p in vae.parameters()) and wan.scale is not off._host_scale
        parked = wan.model.encode(x, wan.scale)
    assert torch.equal(resident, parked)
    assert off.parked and wan.scale is off._host_scale and off.stats["unpark_count"] == 1


@pytest.mark.optimizer_only
def test_optimizer_state_offload_on_upstream_optimizer_cls_equals_stock():
    """Upstream's own ``_optimizer_cls`` builds AdamW; patched, its moments stream and the steps are bit-exact."""
    from cosmos_framework.utils.generator import optimizer as up

    from cosmos_framework_ext.levers.optim_offload import OptimStateOffload

    def steps(opt_cls):
        torch.manual_seed(0)
        net = TinyTower()
        opt = opt_cls([p for p in net.parameters()], "adamw", lr=1e-3, betas=(0.9, 0.95), eps=1e-6,
                      weight_decay=0.01, fused=False)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            for p in net.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return net, opt

    stock_net, stock_opt = steps(up._optimizer_cls)
    ps = patch_set()
    ps.apply({"COSMOS_OPTIM_STATE_OFFLOAD": True})
    try:
        net, opt = steps(up._optimizer_cls)
        assert isinstance(opt._onecard_state_offload, OptimStateOffload)
        assert all(torch.equal(a, b) for a, b in zip(stock_net.parameters(), net.parameters()))
        sa, sb = stock_opt.state_dict(), opt.state_dict()
        assert sa["state"].keys() == sb["state"].keys()
        assert all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in sa["state"][i])
    finally:
        ps.revert()


class _TinySft(torch.nn.Module):
    """Three named pathways, so that upstream's ``keys_to_select`` picks a trainable subset as in the recipe."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.ModuleDict({"moe_gen": torch.nn.Linear(8, 16), "und": torch.nn.Linear(16, 16),
                                        "time_embedder": torch.nn.Linear(16, 4)})

    def forward(self, x):
        n = self.net
        return n["time_embedder"](torch.relu(n["und"](torch.relu(n["moe_gen"](x)))))


def _upstream_steps(steps: int = 4) -> dict:
    """Upstream's own ``build_optimizer`` (-> ``_optimizer_cls``) then ``build_lr_scheduler`` (LambdaLR per optimizer),
    the order of its ``init_optimizer_scheduler``, and its trainer's step: 2 accumulated micro-batches,
    ``GradScaler(enabled=False).step(opt)`` (plain ``opt.step()``), ``update()``, ``scheduler.step()``."""
    import warnings

    from cosmos_framework.utils.generator import optimizer as up

    model = _TinySft()
    opt = up.build_optimizer(model, "AdamW", lr=5e-4, betas=[0.9, 0.95], eps=1e-6, weight_decay=0.1, fused=True,
                             keys_to_select=["moe_gen", "time_embedder"], lr_multipliers={},
                             disable_weight_decay_for_1d_params=True)
    sched = up.build_lr_scheduler(opt, "LambdaCosine", warm_up_steps=[2], cycle_lengths=[10], f_start=[0.0],
                                  f_max=[1.0], f_min=[0.0], verbosity_interval=0)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    calls = []
    for o in opt:
        o.register_step_pre_hook(lambda *_: calls.append(1))
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            for _ in range(2):
                (model(torch.randn(4, 8, generator=g)).square().mean() / 2).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "opt": opt, "hooks": len(calls),
            "warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]}


@pytest.mark.optimizer_only
def test_optimizer_state_offload_through_upstreams_optimizer_and_scheduler_builders():
    """Upstream's builders with the patch on: the scheduler is built after the lever (as upstream's trainer does),
    the steps equal stock bit for bit, the step hooks run once per step and the scheduler warns of nothing."""
    from cosmos_framework_ext.levers.optim_offload import OptimStateOffload

    stock = _upstream_steps()
    ps = patch_set()
    ps.apply({"COSMOS_OPTIM_STATE_OFFLOAD": True})
    try:
        got = _upstream_steps()
    finally:
        ps.revert()
    assert all(isinstance(o._onecard_state_offload, OptimStateOffload) for o in got["opt"])
    assert got["params"].keys() == stock["params"].keys()
    assert all(torch.equal(got["params"][k], stock["params"][k]) for k in stock["params"])
    assert got["hooks"] == stock["hooks"] > 0 and got["warnings"] == stock["warnings"] == []


@pytest.mark.optimizer_only
def test_changed_optimizer_cls_signature_is_refused(monkeypatch):
    from cosmos_framework.utils.generator import optimizer as up

    monkeypatch.setattr(up, "_optimizer_cls", lambda params, optimizer_type, lr: None)
    with pytest.raises(UpstreamMismatch, match="_optimizer_cls has parameters"):
        patch_set().apply({"COSMOS_OPTIM_STATE_OFFLOAD": True})


# ----------------------------------------------------------------------------- lever 6 in upstream's order
class _FrozenStandIn(torch.nn.Module):
    """What upstream's ``init_optimizer_scheduler`` and DCP ``ModelWrapper`` touch: ``net`` built in the fp32 master
    dtype and wrapped with FSDP2 (bf16 policy, one gloo rank) before anything is marked trainable, as ``build_net``
    does at ``5eee9ed``."""

    def __init__(self, seed: int = 0):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        super().__init__()
        torch.manual_seed(seed)
        self.config = SimpleNamespace(ema=SimpleNamespace(enabled=False))
        self.precision = torch.bfloat16
        net = _TinySft()
        kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False),
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        for m in net.net.values():
            fully_shard(m, **kw)
        self.net = fully_shard(net, **kw)

    def forward(self, x):
        return self.net(x)


def _upstream_frozen_run(tmp_path, name: str, steps: int = 3) -> dict:
    """Upstream's ``init_optimizer_scheduler`` (its ``build_optimizer`` marks ``keys_to_select``, then
    ``build_lr_scheduler``) over :class:`_FrozenStandIn`, ``steps`` steps of 2 micro-batches, then upstream's DCP
    ``ModelWrapper`` state saved with ``torch.distributed.checkpoint``."""
    import torch.distributed.checkpoint as dcp
    from cosmos_framework.checkpoint.dcp import ModelWrapper
    from cosmos_framework.utils.generator import optimizer as up
    from cosmos_framework.utils.lazy_config import LazyCall as L

    model = _FrozenStandIn()
    opt_cfg = L(up.build_optimizer)(optimizer_type="AdamW", lr=5e-4, betas=[0.9, 0.95], eps=1e-6, weight_decay=0.1,
                                    fused=True, keys_to_select=["moe_gen", "time_embedder"], lr_multipliers={},
                                    disable_weight_decay_for_1d_params=True)
    sched_cfg = L(up.build_lr_scheduler)(lr_scheduler_type="LambdaCosine", warm_up_steps=[2], cycle_lengths=[10],
                                         f_start=[0.0], f_max=[1.0], f_min=[0.0], verbosity_interval=0)
    opt, sched = _om().OmniMoTModel.init_optimizer_scheduler(model, opt_cfg, sched_cfg)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        for _ in range(2):
            loss = model(torch.randn(4, 8, generator=g)).float().square().mean() / 2
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        sched.step()
        opt.zero_grad()
    sd = ModelWrapper(model).state_dict()
    dcp.save(sd, checkpoint_id=str(tmp_path / name))
    meta = dcp.FileSystemReader(str(tmp_path / name)).read_metadata()
    files = {f.name: f.read_bytes() for f in (tmp_path / name).iterdir() if f.name != ".metadata"}
    return {"model": model, "losses": losses, "files": files, "meta": meta.state_dict_metadata,
            "frozen": getattr(model, "_onecard_frozen", None)}


def _checkpoint_differences(stock: dict, lever: dict) -> list[str]:
    out = [] if all(torch.equal(a, b) for a, b in zip(stock["losses"], lever["losses"])) else ["losses"]
    out += [] if lever["files"] == stock["files"] else ["DCP data files"]
    return out + ([] if lever["meta"] == stock["meta"] else ["DCP metadata (dtypes, shapes, chunks)"])


def test_frozen_bf16_in_upstreams_order_equals_stock_and_saves_the_same_checkpoint(om, tmp_path):
    """Lever 6 through upstream's own ``init_optimizer_scheduler`` and DCP ``ModelWrapper``: frozen parameters held
    bf16 after upstream marked them, the same losses and the same checkpoint files as stock; a fresh model loads
    them back through upstream's ``ModelWrapper.load_state_dict`` with its device copies recast."""
    import torch.distributed.checkpoint as dcp
    from cosmos_framework.checkpoint.dcp import ModelWrapper

    from cosmos_framework_ext.levers.frozen_bf16 import WrappedFrozenBF16

    from tests.equivalence import tiny_recipe as R

    with R.one_rank():
        stock = _upstream_frozen_run(tmp_path, "stock")
        ps = patch_set()
        ps.apply({"COSMOS_FROZEN_BF16": True})
        try:
            lever = _upstream_frozen_run(tmp_path, "lever")
            frozen = lever["frozen"]
            assert isinstance(frozen, WrappedFrozenBF16) and frozen.names
            params = dict(lever["model"].net.named_parameters())
            assert all(params[n].dtype == torch.bfloat16 and not params[n].requires_grad for n in frozen.names)
            assert all(p.dtype == torch.float32 for p in params.values() if p.requires_grad)
            assert not _checkpoint_differences(stock, lever)

            fresh = _FrozenStandIn(seed=5)
            for n, p in fresh.net.named_parameters():  # the recipe's selection, then the lever as the patch runs it
                p.requires_grad_("moe_gen" in n or "time_embedder" in n)
            fresh_frozen = WrappedFrozenBF16(fresh.net, torch.bfloat16)
            template = ModelWrapper(fresh).state_dict()
            dcp.load(template, checkpoint_id=str(tmp_path / "stock"))
            ModelWrapper(fresh).load_state_dict(template)
            got = ModelWrapper(fresh).state_dict()
            want = ModelWrapper(stock["model"]).state_dict()
            assert all(torch.equal(to_local(got[k]), to_local(want[k])) for k in want)
            fresh_params = dict(fresh.net.named_parameters())
            assert all(torch.equal(to_local(fresh_params[n]), fresh_frozen.host[n].to(torch.bfloat16))
                       for n in fresh_frozen.names)
        finally:
            ps.revert()


def test_frozen_bf16_refuses_the_stock_device_ema(om):
    """Upstream's fp32 ``net_ema`` tower would average the bf16 copies: refused before the optimizer is built."""
    from patches.core.errors import UserError

    model = SimpleNamespace(config=SimpleNamespace(ema=SimpleNamespace(enabled=True)), net_ema_worker=object())
    pretrained = SimpleNamespace(config=SimpleNamespace(ema=SimpleNamespace(enabled=False)),
                                 vlm_config=SimpleNamespace(pretrained_weights=SimpleNamespace(enabled=True)))
    ps = patch_set()
    ps.apply({"COSMOS_FROZEN_BF16": True})
    try:
        with pytest.raises(UserError, match="COSMOS_EMA_CPU_SUBSET=1"):
            om.OmniMoTModel.init_optimizer_scheduler(model, None, None)
        with pytest.raises(UserError, match="pretrained_weights.enabled"):  # would load past the host fp32 copies
            om.OmniMoTModel.init_optimizer_scheduler(pretrained, None, None)
    finally:
        ps.revert()


def test_planted_frozen_bf16_saving_the_bf16_copy_is_detected(om, tmp_path, monkeypatch):
    """Planted: the lever saves the bf16 device copy (upcast) instead of the host fp32 values."""
    from cosmos_framework_ext.levers.frozen_bf16 import WrappedFrozenBF16

    from tests.equivalence import tiny_recipe as R

    monkeypatch.setattr(WrappedFrozenBF16, "_saved_value", lambda self, name, live: to_local(live).float())
    with R.one_rank():
        stock = _upstream_frozen_run(tmp_path, "stock")
        ps = patch_set()
        ps.apply({"COSMOS_FROZEN_BF16": True})
        try:
            assert "DCP data files" in _checkpoint_differences(stock, _upstream_frozen_run(tmp_path, "lever"))
        finally:
            ps.revert()
