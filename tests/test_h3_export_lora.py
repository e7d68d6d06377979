"""``miles_ext.recipe.export_lora``: the adapter directory loads onto the base model with PEFT and with diffusers, and
gives the trained model's forward; bad input fails cleanly and writes nothing; the README's loading snippet
(:data:`README_SNIPPET`) runs as written on the adapter of a tiny trainer run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from miles_ext.recipe import export_lora
from miles_ext.recipe.h3_inputs import build_h3_inputs
from miles_ext.recipe.presets import H3_LORA_TARGETS
from miles_ext.levers.lora import attach_lora, lora_parameters
from miles_ext.recipe.presets import build_transformer, get_preset
from patches.core.errors import UserError

REPO = Path(__file__).resolve().parents[1]
RANK, ALPHA = 4, 8.0

README_SNIPPET = """\
from diffusers import MiniMaxH3Transformer3DModel
from peft import PeftModel
from miles_ext.recipe.presets import get_preset

config = get_preset("tiny").transformer_kwargs()  # your weights: MiniMaxH3Transformer3DModel.from_pretrained(...)

# PEFT: a PeftModel wrapping the base model
peft_model = PeftModel.from_pretrained(MiniMaxH3Transformer3DModel(**config), "outputs/my_adapter")

# diffusers: the adapter injected into the model itself
model = MiniMaxH3Transformer3DModel(**config)
model.load_lora_adapter("outputs/my_adapter", weight_name="pytorch_lora_weights.safetensors")
"""
"""How to load an exported adapter (README, "Loading the exported adapter"), run verbatim by
:func:`test_readme_snippet_loads_a_trained_adapter` in a folder holding ``outputs/my_adapter``."""


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
    model = attach_lora(base_model(), rank=RANK, alpha=ALPHA, target_modules=H3_LORA_TARGETS)
    with torch.no_grad():  # "training": move every adapter away from its init (B = 0 would hide bugs)
        g = torch.Generator().manual_seed(1)
        for p in lora_parameters(model).values():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ckpt = tmp_path / "iter_000000003.pt"
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


def test_comfyui_file_reproduces_the_trained_delta(trained, tmp_path):
    """Kohya/ComfyUI semantics on ComfyUI's H3 names: per module ``lora_down`` (A), ``lora_up`` (B) and ``alpha``; a
    loader applies ``delta W = (alpha / r) * up @ down`` with r = the down weight's rows. Read back by diffusers'
    converter for such files, each module's delta must be PEFT's own ``get_delta_weight`` of the trained layer
    (the full proof, with planted bugs: ``tests/equivalence/test_h3_export_lora.py``)."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_minimax_h3_lora_to_diffusers
    from safetensors.torch import load_file

    model, ckpt = trained
    export_lora.export(ckpt, tmp_path / "adapter", comfyui=True)
    sd = load_file(str(tmp_path / "adapter" / "lora_comfyui.safetensors"))
    assert all(k.startswith("diffusion_model.") for k in sd)
    for m in {k[len("diffusion_model."):-len(".alpha")] for k in sd if k.endswith(".alpha")}:
        alpha, down, up = (sd[f"diffusion_model.{m}.{k}"] for k in ("alpha", "lora_down.weight", "lora_up.weight"))
        fused = 3 if m.endswith("qkv_proj") else 1
        assert alpha.dim() == 0 and float(alpha) == fused * ALPHA and down.shape[0] == up.shape[1] == fused * RANK
    conv = _convert_non_diffusers_minimax_h3_lora_to_diffusers(sd)
    layers = dict(model.named_modules())
    modules = {k.removeprefix("transformer.").split(".lora_A.")[0] for k in conv if ".lora_A." in k}
    assert len(modules) == len(lora_parameters(model)) // 2
    for m in modules:
        delta = conv[f"transformer.{m}.lora_B.weight"] @ conv[f"transformer.{m}.lora_A.weight"]  # alpha folded
        torch.testing.assert_close(delta, layers[m].get_delta_weight("default"), rtol=1e-6, atol=1e-7)


def test_checkpoint_without_lora_is_one_error_and_nothing_written(tmp_path, capsys):
    bad = tmp_path / "full.pt"
    torch.save({"model": {"w": torch.zeros(2)}}, bad)
    assert export_lora.main([str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no LoRA tensors" in err[0]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    assert export_lora.main([str(tmp_path / "missing.pt"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_export_error_is_a_user_error():
    assert issubclass(export_lora.ExportError, UserError)


def test_readme_snippet_loads_a_trained_adapter(tmp_path, monkeypatch, capfd, h3_dataset):
    """A tiny launcher run, the README's export command, then :data:`README_SNIPPET` exactly as written: it
    prints and warns nothing, both loaders hold the checkpoint's LoRA tensors, and on the same base they give
    the same forward, which the adapter changes."""
    from tests.datasets import first_rows

    data = first_rows(h3_dataset, tmp_path / "data", 2)  # the launcher's sample dataset, two clips: a quick run
    env = dict(os.environ, OUTPUT_ROOT=str(tmp_path / "outputs"), DATASET_PATH=str(data), PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("MILES_DIFFUSION_ROOT", None)
    r = subprocess.run(["bash", str(REPO / "launchers" / "sft_h3_t2va_1gpu.sh"), "--rollout-batch-size", "8",
                        "--num-steps-per-rollout", "1"], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = "outputs/h3_t2va_sft/checkpoints/iter_000000001.pt"
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    assert export_lora.main([ckpt, "outputs/my_adapter"]) == 0  # README's export command, in this process
    assert "exported 36 LoRA tensors (rank 64, alpha 128" in capfd.readouterr().out
    ns: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(README_SNIPPET, "README_SNIPPET", "exec"), ns)
    out, err = capfd.readouterr()
    assert out == "" and err == "" and not caught, (out, err, [str(w.message) for w in caught])

    trained = torch.load(tmp_path / ckpt, weights_only=False)["lora"]
    peft_model, model = ns["peft_model"], ns["model"]
    via_peft = {k.removeprefix("base_model.model."): v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    via_diffusers = {k.replace(".default_0.", ".default."): v for k, v in model.state_dict().items() if ".lora_" in k}
    for got in (via_peft, via_diffusers):
        assert got.keys() == trained.keys() and all(torch.equal(got[k], trained[k]) for k in trained)
    base = {k: v for k, v in peft_model.get_base_model().state_dict().items() if ".lora_" not in k}
    assert not model.load_state_dict(base, strict=False).unexpected_keys  # the same base under both adapters
    want = forward(peft_model.eval())
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(want, forward(model.eval())))
    with peft_model.disable_adapter():
        assert not torch.allclose(forward(peft_model)[0], want[0])  # the trained adapter changes the output


def test_readme_shows_the_tested_snippet_verbatim():
    """The adapter-loading code in README is the text the test above executes, not a paraphrase."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert README_SNIPPET.strip() in readme


def test_exported_folder_has_the_modes_of_any_new_output(trained, tmp_path):
    """The folder is built by ``mkdtemp`` (0700): once published it must be readable as ``mkdir``/``open`` make
    outputs under the umask, not private to the exporting user."""
    import os
    import stat

    mask = os.umask(0)
    os.umask(mask)
    out = tmp_path / "modes"
    export_lora.export(trained[1], out, comfyui=True)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask
    assert {stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {0o666 & ~mask}


def test_every_exported_tensor_is_fp32_from_a_bf16_checkpoint(tmp_path):
    """The module docstrings promise PEFT's layout "contiguous fp32" (:func:`export_lora.peft_state_dict`, also the
    diffusers file) and ComfyUI's "All fp32" (:func:`export_lora.comfyui_state_dict`). A checkpoint whose LoRA tensors
    are bf16 (a run that kept its adapters in bf16) must still give fp32 tensors in all three files, holding the bf16
    values exactly (bf16 -> fp32 is exact): a standalone module (``proj_in`` -> ``video_patch_proj``), a plain block
    module (``ff.net.2`` -> ``mlp.fc2``) and the fused ``qkv_proj`` (downs stacked ``[A_q; A_k; A_v]``)."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(5)
    mods = ["proj_in", "transformer_blocks.0.ff.net.2",
            *(f"transformer_blocks.0.attn.to_{x}" for x in "qkv")]
    lora = {}
    for m in mods:
        lora[f"{m}.lora_A.default.weight"] = torch.randn(RANK, 8, generator=g).to(torch.bfloat16)
        lora[f"{m}.lora_B.default.weight"] = torch.randn(6, RANK, generator=g).to(torch.bfloat16)
    ckpt = tmp_path / "iter_000000001.pt"
    torch.save({"lora": lora, "lora_meta": {"rank": RANK, "alpha": ALPHA, "target_modules": ["proj_in", "to_q"]}},
               ckpt)
    export_lora.export(ckpt, tmp_path / "adapter", comfyui=True)
    files = {f: load_file(str(tmp_path / "adapter" / f)) for f in
             ("adapter_model.safetensors", "pytorch_lora_weights.safetensors", "lora_comfyui.safetensors")}
    for f, sd in files.items():
        assert sd and {str(v.dtype) for v in sd.values()} == {"torch.float32"}, (f, {k: v.dtype for k, v in sd.items()})
    peft, diff, comfy = files.values()
    for m in mods:
        for kind in ("lora_A", "lora_B"):
            src = lora[f"{m}.{kind}.default.weight"].float()
            assert torch.equal(peft[f"base_model.model.{m}.{kind}.weight"], src)
            assert torch.equal(diff[f"transformer.{m}.{kind}.weight"], src)
    assert torch.equal(comfy["diffusion_model.video_patch_proj.lora_down.weight"],
                       lora["proj_in.lora_A.default.weight"].float())
    assert torch.equal(comfy["diffusion_model.blocks.0.mlp.fc2.lora_up.weight"],
                       lora["transformer_blocks.0.ff.net.2.lora_B.default.weight"].float())
    assert torch.equal(comfy["diffusion_model.blocks.0.attn.qkv_proj.lora_down.weight"],
                       torch.cat([lora[f"transformer_blocks.0.attn.to_{x}.lora_A.default.weight"].float()
                                  for x in "qkv"]))
    # the layout functions themselves keep their contract for a bf16 state given to them directly (the loader
    # casts to fp32 first, so the end-to-end files alone would not show a layout function that kept bf16)
    assert {v.dtype for v in export_lora.peft_state_dict(lora).values()} == {torch.float32}
    assert {v.dtype for v in export_lora.comfyui_state_dict(lora, RANK, ALPHA).values()} == {torch.float32}
