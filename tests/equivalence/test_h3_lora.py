"""``miles_ext.levers.lora``: LoRA adapters as the recipe attaches them (single process).

fp32, trainable adapters on a bf16 base with the *same* initial values as on an fp32 base (planted contrast:
plain PEFT rounds them), the recipe's defaults (rank 64, alpha 128, the H3 targets), and a ``ValueError`` that
names the fix when the targets match nothing.
"""

from __future__ import annotations

import pytest
import torch

from miles_ext.recipe.presets import H3_LORA_TARGETS
from miles_ext.levers.lora import attach_lora, lora_parameters, matched_target_modules
from miles_ext.recipe.presets import build_transformer


def _lora(dtype: torch.dtype, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_transformer("tiny", dtype=dtype)
    torch.manual_seed(1)
    return attach_lora(model, rank=8, alpha=16, **kw, target_modules=H3_LORA_TARGETS)


def test_lora_defaults_are_the_recipe():
    model = attach_lora(build_transformer("tiny"), target_modules=H3_LORA_TARGETS)
    layer = model.transformer_blocks[0].attn.to_q
    assert layer.r["default"] == 64 and layer.lora_alpha["default"] == 128 and layer.scaling["default"] == 2.0
    assert len(matched_target_modules(build_transformer("tiny"), H3_LORA_TARGETS)) == 3 * 6
    assert len(lora_parameters(model)) == 2 * 3 * 6  # lora_A and lora_B per adapted linear
    assert set(lora_parameters(model)) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(torch.equal(p, torch.zeros_like(p)) for n, p in lora_parameters(model).items() if ".lora_B." in n)


def test_lora_on_bf16_base_is_fp32_trainable_and_initialised_as_on_fp32():
    ref, got = lora_parameters(_lora(torch.float32)), lora_parameters(_lora(torch.bfloat16))
    assert len(got) == 36
    assert all(p.dtype == torch.float32 and p.requires_grad for p in got.values())
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_trainer_order_keeps_adapters_fp32():
    """As ``miles_ext.recipe.train`` builds the model: the base built in the bf16 master dtype, LoRA attached, then the FSDP
    policy's master-dtype pass (``apply_fsdp2(master_dtype=...)`` runs ``set_master_dtype`` first) with the
    adapters already in the model. They must stay fp32, trainable, with the fp32-base init; the base is bf16."""
    from miles_ext.levers.fsdp_policy import set_master_dtype

    ref = lora_parameters(_lora(torch.float32))
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build_transformer("tiny")
    finally:
        torch.set_default_dtype(prev)
    torch.manual_seed(1)
    attach_lora(model, rank=8, alpha=16, target_modules=H3_LORA_TARGETS)
    set_master_dtype(model, "bf16")
    got = lora_parameters(model)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in got.values())
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert model.transformer_blocks[0].attn.to_q.base_layer.weight.dtype == torch.bfloat16


def test_planted_plain_peft_init_on_bf16_differs():
    from peft import LoraConfig, get_peft_model

    ref = lora_parameters(_lora(torch.float32))
    torch.manual_seed(0)
    model = build_transformer("tiny", dtype=torch.bfloat16)
    torch.manual_seed(1)
    get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(H3_LORA_TARGETS),
                                     init_lora_weights="gaussian"))
    plain = lora_parameters(model)
    assert all(p.dtype == torch.float32 for p in plain.values())
    assert not all(torch.equal(ref[k], plain[k]) for k in ref)


def test_lora_can_keep_base_dtype_when_asked():
    got = lora_parameters(_lora(torch.bfloat16, autocast_adapter_dtype=False))
    assert {p.dtype for p in got.values()} == {torch.bfloat16}


def test_lora_targets_matching_nothing_raise_with_the_fix():
    with pytest.raises(ValueError, match=r"match no nn.Linear.*pass names .* of its linear layers, e.g."):
        attach_lora(build_transformer("tiny"), target_modules=["attn.to_qkv"])
