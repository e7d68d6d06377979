"""FSDP2 policy for H3 + LoRA: what FSDP2 and PEFT actually do, and the properties the 1-GPU port relies on.

One launch of 2 gloo ranks (tiny H3, LoRA rank 8, bf16 master, CPU offload, param_dtype bf16; the model built by
the trainer's own ``H3SFTRecipe._build_model``, so LoRA is attached before the FSDP policy's master-dtype pass, as
in a real run) checks:

- **What FSDP2 requires** (torch 2.13): a unit holding a frozen bf16 parameter and a trainable fp32 one trains
  fine; a unit holding trainable bf16 *and* fp32 parameters raises ``FSDP expects uniform original parameter
  dtype``. The rule is over trainable parameters only.
- **What PEFT does** under own adapter units: it casts the LoRA input to ``lora_A.weight.dtype`` before
  ``lora_A``'s FSDP hook gathers it, so an adapter unit that is not gathered with its block fails with a dtype
  mismatch; :func:`miles_ext.levers.fsdp_policy.apply_fsdp2` gathers it with the block (and then trains).
- **Unit layout** of ``apply_fsdp2``: one adapter unit per block holding only fp32 LoRA parameters; block, norm
  and root units hold no trainable parameter; everything (sharded params, grads) lives on the host. The adapters
  compute in the base's ``param_dtype`` (bf16), as under upstream's single policy.
- **Gradient accumulation adds under offload**: grads after micro-batches A then B equal grads(A) + grads(B)
  bitwise (the same fp32 additions). Planted bug: an accumulation that overwrites (grads(B) alone) fails it.
- **clip_offloaded_grad_norm** over sharded host gradients: the total norm equals the norm of the full
  gradients (rel 1e-6; the sum runs in another order) and the clipped shards are the full gradients times
  ``max_norm / (norm + 1e-6)``; on plain tensors it agrees with ``torch.nn.utils.clip_grad_norm_``.

The master-dtype proof (bf16 master == fp32 master) is ``test_h3_fsdp_policy_master_dtype.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from miles_ext.levers.fsdp_policy import clip_offloaded_grad_norm, parse_master_dtype, set_master_dtype
from tests.equivalence.h3_ranks import cpu_mesh, launch

WORLD = 2


def _micro_batch_loss(model: nn.Module, pairs, index: int) -> torch.Tensor:
    from miles_ext.recipe.sft import draw_micro_batch, micro_batch_loss_sum

    noised = draw_micro_batch([pairs[index]], seed=7, rollout_id=0, microbatch_id=index, dp_rank=0)
    return micro_batch_loss_sum(model, noised)


def _full_grads(params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().clone() for n, p in params.items()}


def _dtype_rule() -> dict[str, str]:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    out = {}
    for name, trainable_bf16 in (("frozen_bf16_trainable_fp32", False), ("trainable_bf16_and_fp32", True)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8))
        model[0].requires_grad_(trainable_bf16)
        fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False), mesh=cpu_mesh(),
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        try:
            model(torch.randn(2, 8)).float().sum().backward()
            out[name] = "ok" if model[1].weight.grad is not None else "no grad"
        except AssertionError as e:
            out[name] = f"AssertionError: {e}"
    return out


def _adapter_unit_without_block_gather() -> str:
    """Own adapter units built by hand, without apply_fsdp2's gather-with-block hook."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from miles_ext.levers.fsdp_policy import _adapter_linears
    from tests.equivalence.h3_tiny_run import make_lora_model, synthetic_pairs

    model = make_lora_model(master_dtype="bf16")
    kw = dict(offload_policy=CPUOffloadPolicy(pin_memory=False), mesh=cpu_mesh(),
              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                             cast_forward_inputs=False))
    for block in [m for m in model.modules() if type(m).__name__ in model._no_split_modules]:
        if _adapter_linears(block):
            fully_shard(_adapter_linears(block), **kw)
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    try:
        _micro_batch_loss(model, synthetic_pairs(1), 0).backward()
        return "ok"
    except RuntimeError as e:
        return f"RuntimeError: {e}"


def _trainer_model(run_dir: str) -> nn.Module:
    """The model exactly as ``miles_ext.recipe.train`` builds it (``H3SFTRecipe._build_model``, its call order and
    arguments): the base built in the bf16 master dtype, LoRA attached, gradient checkpointing, then
    ``apply_fsdp2(cpu_offload=True, master_dtype=bf16)`` with the policy's defaults -- the master-dtype pass runs
    with the adapters already in the model."""
    from miles_ext.recipe.presets import get_preset
    from miles_ext.recipe.train import H3SFTConfig, H3SFTRecipe

    recipe = H3SFTRecipe(H3SFTConfig(preset="tiny", lora_rank=8, lora_alpha=16, fsdp_cpu_offload=True, seed=0,
                                     output_dir=run_dir))
    recipe.master, recipe.preset, recipe.device = torch.bfloat16, get_preset("tiny"), torch.device("cpu")
    recipe._build_model()
    return recipe.model


def _worker(rank: int, world: int, out: str) -> None:
    from miles_ext.levers.fsdp_policy import _adapter_linears
    from miles_ext.levers.lora import lora_parameters
    from tests.equivalence.h3_tiny_run import synthetic_pairs

    res: dict[str, Any] = {"dtype_rule": _dtype_rule(), "no_block_gather": _adapter_unit_without_block_gather()}

    model = _trainer_model(str(Path(out).parent / f"run{rank}"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    res["units"] = [(mods, {n: (d, n in trainable) for n, d in params.items()}) for mods, params in fsdp_units(model)]
    lora = lora_parameters(model)
    pairs = synthetic_pairs(2)

    compute: set[tuple[torch.dtype, torch.dtype]] = set()  # (input, weight) dtypes each adapter linear computes in
    hooks = [m.register_forward_pre_hook(lambda mod, args: compute.add((args[0].dtype, mod.weight.dtype)))
             for m in _adapter_linears(model)]
    _micro_batch_loss(model, pairs, 0).backward()
    for h in hooks:
        h.remove()
    res["adapter_compute"] = compute
    res["grad_devices"] = {p.grad.to_local().device.type for p in lora.values()}
    res["param_devices"] = {p.to_local().device.type for p in model.parameters()}
    g_a = _full_grads(lora)
    model.zero_grad(set_to_none=True)
    _micro_batch_loss(model, pairs, 1).backward()
    g_b = _full_grads(lora)
    model.zero_grad(set_to_none=True)
    _micro_batch_loss(model, pairs, 0).backward()
    _micro_batch_loss(model, pairs, 1).backward()
    res["accum"] = dict(a=g_a, b=g_b, ab=_full_grads(lora))

    full = _full_grads(lora)
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in full.values()]))
    max_norm = float(ref_norm) / 3  # clipping active
    norm = clip_offloaded_grad_norm(lora.values(), max_norm)
    res["clip"] = dict(norm=float(norm), ref_norm=float(ref_norm), max_norm=max_norm, full=full,
                       clipped=_full_grads(lora))
    if rank == 0:
        torch.save(res, out)


@pytest.fixture(scope="module")
def res(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("h3_fsdp") / "res.pt"
    launch(_worker, WORLD, str(out))
    return torch.load(out)


def test_fsdp2_requires_uniform_dtype_among_trainable_params_only(res):
    assert res["dtype_rule"]["frozen_bf16_trainable_fp32"] == "ok"
    assert "uniform original parameter dtype" in res["dtype_rule"]["trainable_bf16_and_fp32"]


def test_peft_reads_adapter_dtype_before_the_adapter_unit_gathers(res):
    assert "same dtype" in res["no_block_gather"]


def test_adapters_have_their_own_fp32_units(res):
    units = res["units"]
    adapter_units = [u for u in units if any(".lora_" in n for n in u[1])]
    assert len(adapter_units) == 3  # 1 token-refiner block + 2 transformer blocks
    for mods, params in units:
        lora = [n for n in params if ".lora_A." in n or ".lora_B." in n]
        if lora:
            assert len(lora) == len(params) == 12  # 6 targets x (A, B), nothing else
            assert all(d == torch.float32 and trainable for d, trainable in params.values())
        else:
            assert not any(trainable for _, trainable in params.values())
    block_units = [u for u in units if u[0][0].startswith("transformer_blocks.") and not any(".lora_" in n for n in u[1])]
    assert block_units and all(d == torch.bfloat16 for u in block_units for d, _ in u[1].values())
    root = next(u for u in units if u[0] == ["<root>"])
    assert root[1]["proj_out.weight"][0] == torch.float32  # _keep_in_fp32_modules stored fp32
    assert root[1]["context_embedder.weight"][0] == torch.bfloat16


def test_adapters_compute_in_the_base_param_dtype(res):
    """Upstream's single policy: adapters stored fp32 (above) but gathered and computed at ``param_dtype`` bf16,
    like the base they sit in."""
    assert res["adapter_compute"] == {(torch.bfloat16, torch.bfloat16)}


def test_everything_is_offloaded_to_the_host(res):
    assert res["grad_devices"] == {"cpu"} and res["param_devices"] == {"cpu"}


def _adds(a, b, ab) -> bool:
    return all(torch.equal(ab[k], a[k] + b[k]) for k in a)


def test_gradient_accumulation_adds_under_offload(res):
    a, b, ab = res["accum"]["a"], res["accum"]["b"], res["accum"]["ab"]
    assert all(float(a[k].abs().max()) > 0 for k in a if ".lora_B." in k)
    assert _adds(a, b, ab)


def test_planted_overwrite_breaks_the_accumulation_check(res):
    a, b = res["accum"]["a"], res["accum"]["b"]
    assert not _adds(a, b, b)  # an accumulation that kept only the last micro-batch


def test_clip_offloaded_grad_norm_over_sharded_host_grads(res):
    c = res["clip"]
    assert abs(c["norm"] - c["ref_norm"]) <= 1e-6 * c["ref_norm"]
    coef = c["max_norm"] / (c["norm"] + 1e-6)
    for k, g in c["full"].items():
        torch.testing.assert_close(c["clipped"][k], g * coef, rtol=1e-6, atol=0)


def test_clip_offloaded_grad_norm_matches_torch_on_plain_tensors():
    torch.manual_seed(0)
    a = [nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn(p.shape)
        q.grad = p.grad.clone()
    n1 = clip_offloaded_grad_norm(a, 0.5)
    n2 = torch.nn.utils.clip_grad_norm_(b, 0.5)
    torch.testing.assert_close(n1, n2, rtol=1e-6, atol=0)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    with pytest.raises(RuntimeError, match="non-finite"):
        a[0].grad[0, 0] = float("nan")
        clip_offloaded_grad_norm(a, 0.5, error_if_nonfinite=True)


@pytest.mark.parametrize("bad", ["fp16", "float32", torch.float16, "bfloat16"])
def test_master_dtype_outside_fp32_bf16_is_refused(bad):
    with pytest.raises(ValueError, match="fp32 or bf16"):
        parse_master_dtype(bad)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        set_master_dtype(nn.Linear(2, 2), bad)


def test_master_dtype_keeps_fp32_modules_and_buffers():
    from miles_ext.recipe.presets import build_transformer

    model = set_master_dtype(build_transformer("tiny"), "bf16")
    assert model.rope.inv_freq.dtype == torch.float32
    assert model.time_embedder.linear_1.weight.dtype == torch.float32
    assert model.audio_proj_in.weight.dtype == torch.float32
    assert model.transformer_blocks[0].attn.to_q.weight.dtype == torch.bfloat16
    assert model.norm_out.linear.weight.dtype == torch.bfloat16
    assert parse_master_dtype("bf16") is torch.bfloat16 and parse_master_dtype(torch.float32) is torch.float32


def fsdp_units(model: nn.Module) -> list[tuple[list[str], dict[str, torch.dtype]]]:
    """For inspection and tests: every FSDP2 unit of ``model`` as (its module names, {parameter name: stored
    dtype}), root first. Reads FSDP2's per-unit state (private attributes of torch 2.11 .. 2.13)."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    pnames = {id(p): n for n, p in model.named_parameters()}
    out: list[tuple[list[str], dict[str, torch.dtype]]] = []
    seen: set[int] = set()
    for m in model.modules():
        if not isinstance(m, FSDPModule) or id(m) in seen:
            continue
        state = m._get_fsdp_state()
        seen.update(id(x) for x in state._modules)
        groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13; 2.11 has one _fsdp_param_group
        if groups is None:
            groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        params = {pnames.get(id(fp.sharded_param), "?"): fp.sharded_param.dtype for g in groups for fp in g.fsdp_params}
        out.append(([names.get(id(x), "?") for x in state._modules], params))
    return out

