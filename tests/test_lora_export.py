"""LoRA export: the adapter directory loads onto the base model with PEFT and with diffusers, and gives
the trained model's forward; bad input fails cleanly and writes nothing."""

from __future__ import annotations

import json

import pytest
import torch

from miles_ext import export_lora
from miles_ext.h3_inputs import build_h3_inputs
from miles_ext.lora import H3_LORA_TARGETS, attach_lora, lora_parameters
from miles_ext.presets import build_transformer, get_preset

RANK, ALPHA = 4, 8.0


def base_model():
    torch.manual_seed(0)
    return build_transformer(get_preset("tiny")).eval()


def forward(model):
    g = torch.Generator().manual_seed(3)
    kwargs, pick = build_h3_inputs(torch.randn(5, 384, generator=g), torch.randn(24, 2, 4, 4, generator=g),
                                   torch.randn(2, 32, 3, generator=g), 0.4)
    with torch.no_grad():
        return pick(model(**kwargs))


@pytest.fixture()
def trained(tmp_path):
    model = attach_lora(base_model(), rank=RANK, alpha=ALPHA)
    with torch.no_grad():  # "training": move every adapter away from its init (B = 0 would hide bugs)
        g = torch.Generator().manual_seed(1)
        for p in lora_parameters(model).values():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ckpt = tmp_path / "iter_0000003.pt"
    torch.save({"lora": {k: v.detach().clone() for k, v in lora_parameters(model).items()},
                "lora_meta": {"rank": RANK, "alpha": ALPHA, "target_modules": list(H3_LORA_TARGETS),
                              "base_model_class": "MiniMaxH3Transformer3DModel"}}, ckpt)
    return model, ckpt


def test_export_then_peft_load_reproduces_the_trained_forward(trained, tmp_path):
    from peft import PeftModel

    model, ckpt = trained
    report = export_lora.export(ckpt, tmp_path / "adapter", comfyui=True)
    assert report["tensors"] == len(lora_parameters(model))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == RANK and cfg["lora_alpha"] == ALPHA and set(cfg["target_modules"]) == set(H3_LORA_TARGETS)
    assert cfg["auto_mapping"]["base_model_class"] == "MiniMaxH3Transformer3DModel"
    loaded = PeftModel.from_pretrained(base_model(), str(tmp_path / "adapter")).eval()
    want, got = forward(model), forward(loaded)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert not torch.equal(forward(base_model())[0], want[0])  # the adapters do change the output


def test_export_then_diffusers_load_lora_adapter(trained, tmp_path):
    model, ckpt = trained
    export_lora.export(ckpt, tmp_path / "adapter")
    base = base_model()
    base.load_lora_adapter(str(tmp_path / "adapter"), weight_name="pytorch_lora_weights.safetensors",
                           prefix="transformer")
    want, got = forward(model), forward(base.eval())
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(want, got))


def test_comfyui_keys(trained, tmp_path):
    from safetensors.torch import load_file

    _, ckpt = trained
    export_lora.export(ckpt, tmp_path / "adapter", comfyui=True)
    keys = load_file(str(tmp_path / "adapter" / "lora_comfyui.safetensors"))
    assert any(k.startswith("diffusion_model.") and k.endswith(".lora_down.weight") for k in keys)
    assert any(k.endswith(".alpha") for k in keys)


def test_checkpoint_without_lora_is_one_error_and_nothing_written(tmp_path, capsys):
    bad = tmp_path / "full.pt"
    torch.save({"model": {"w": torch.zeros(2)}}, bad)
    assert export_lora.main([str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no LoRA tensors" in err[0]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    assert export_lora.main([str(tmp_path / "missing.pt"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
