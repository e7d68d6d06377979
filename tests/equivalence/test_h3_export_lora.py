"""``miles_ext.recipe.export_lora --comfyui``: a file on ComfyUI's (the original checkpoint's) MiniMax-H3 module names that
diffusers' own converter reads back to the trained weight deltas.

Anchor: diffusers' ``_convert_non_diffusers_minimax_h3_lora_to_diffusers`` (``loaders/lora_conversion_utils.py``,
what ``MiniMaxH3LoraLoaderMixin`` runs on such files): it splits the fused ``qkv_proj`` (shared down, up in thirds),
swaps ``mlp.fc1``'s halves, renames ``out_proj`` / ``fc2`` / ``blocks`` / ``token_refiner.blocks`` and folds each
``.alpha`` into the factors, loading at scale 1. For every trained module, ``delta W = (alpha / r) B A`` of the
checkpoint is compared with ``B' A'`` of the converted file, both computed in float64 from the fp32 factors:

- **equal to 1e-12 relative** when ``alpha / r`` is a power of two (the recipe's 128 / 64 = 2): the fold multiplies by
  a power of two, which is exact in fp32, and the only other difference is the order of a float64 sum (plus the
  exact zero blocks of the fused up);
- within **2e-7 relative** (fp32 rounding of the fold ``down * alpha / rank``) otherwise.

Also: the file has only original names (``qkv_proj`` rank 3r, alpha 3 alpha), a LoRA on every linear layer of the
model maps, q/k/v partly adapted fuse with zero blocks, and diffusers' loader (``lora_state_dict`` +
``load_lora_adapter``) gives the trained model's forward.

Planted bugs, each shown to fail the delta check: ``fc1`` halves not swapped, the fused alpha not scaled by 3, ups
stacked instead of block-diagonal, the old export on diffusers' names (which the converter refuses).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_ext.recipe import export_lora
from miles_ext.recipe.presets import H3_LORA_TARGETS
from miles_ext.levers.lora import attach_lora, lora_parameters
from tests.test_h3_export_lora import base_model, forward

RANK = 4


def all_linears() -> list[str]:
    return [n for n, m in base_model().named_modules() if isinstance(m, torch.nn.Linear)]


def trained(alpha: float, targets=H3_LORA_TARGETS):
    """The tiny H3 with every adapter moved away from its init (B = 0 would hide bugs)."""
    model = attach_lora(base_model(), rank=RANK, alpha=alpha, target_modules=list(targets))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def checkpoint_of(model, alpha: float, targets, path: Path) -> Path:
    torch.save({"lora": {k: v.detach().clone() for k, v in lora_parameters(model).items()},
                "lora_meta": {"rank": RANK, "alpha": alpha, "target_modules": list(targets)}}, path)
    return path


def comfy_file(model, alpha: float, targets, tmp_path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    ckpt = checkpoint_of(model, alpha, targets, tmp_path / "iter_000000001.pt")
    export_lora.export(ckpt, tmp_path / "adapter", comfyui=True)
    return load_file(str(tmp_path / "adapter" / "lora_comfyui.safetensors"))


def trained_deltas(model, alpha: float) -> dict[str, torch.Tensor]:
    """``(alpha / r) B A`` per adapted module, float64."""
    lora = lora_parameters(model)
    mods = sorted({k.split(".lora_A.")[0] for k in lora if ".lora_A." in k})
    return {m: (alpha / RANK) * (lora[f"{m}.lora_B.default.weight"].detach().double()
               @ lora[f"{m}.lora_A.default.weight"].detach().double())
            for m in mods}


def converted_deltas(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' converter applied to ``sd``; ``B' A'`` per module (the alpha is folded: loaded at scale 1)."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_minimax_h3_lora_to_diffusers

    conv = _convert_non_diffusers_minimax_h3_lora_to_diffusers({k: v.clone() for k, v in sd.items()})
    mods = sorted({k.removeprefix("transformer.").split(".lora_A.")[0] for k in conv if ".lora_A." in k})
    return {m: conv[f"transformer.{m}.lora_B.weight"].double() @ conv[f"transformer.{m}.lora_A.weight"].double()
            for m in mods}


def delta_problems(sd: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float) -> list[str]:
    """Empty when diffusers' converter accepts ``sd`` and gives ``want``'s deltas (any extra module: zero delta)."""
    try:
        got = converted_deltas(sd)
    except ValueError as e:
        return [f"diffusers' converter refuses the file: {str(e)[:200]}"]
    problems = [f"{m}: missing after conversion" for m in want if m not in got]
    for m, d in got.items():
        ref = want.get(m, torch.zeros_like(d))
        err = float((d - ref).abs().max()) / max(float(ref.abs().max()), 1e-30) if ref.abs().max() > 0 else float(d.abs().max())
        if d.shape != ref.shape or err > rtol:
            problems.append(f"{m}: delta differs (rel {err:.2e})")
    return problems


# ------------------------------------------------------------------------------------------------ proofs
@pytest.mark.parametrize("alpha, rtol", [(8.0, 1e-12), (6.0, 2e-7)], ids=["alpha-over-r-2", "alpha-over-r-1.5"])
def test_diffusers_converter_reproduces_every_trained_delta(tmp_path, alpha, rtol):
    model = trained(alpha)
    sd = comfy_file(model, alpha, H3_LORA_TARGETS, tmp_path)
    want = trained_deltas(model, alpha)
    assert delta_problems(sd, want, rtol) == []
    assert set(converted_deltas(sd)) == set(want)


def test_every_linear_layer_maps(tmp_path):
    targets = all_linears()
    model = trained(8.0, targets)
    sd = comfy_file(model, 8.0, targets, tmp_path)
    assert delta_problems(sd, trained_deltas(model, 8.0), 1e-12) == []
    names = {k[len("diffusion_model."):-len(".alpha")] for k in sd if k.endswith(".alpha")}
    assert {"video_patch_proj", "condition_proj", "final_layer.video_out", "final_layer.adaln_proj.linear",
            "time_embedder.proj_in", "blocks.1.adaln_proj.linear", "token_refiner.blocks.0.attn.qkv_proj"} <= names


def test_the_file_holds_only_comfyui_names_with_the_fused_rank_and_alpha(tmp_path):
    model = trained(8.0)
    sd = comfy_file(model, 8.0, H3_LORA_TARGETS, tmp_path)
    modules = sorted(k[len("diffusion_model."):-len(".alpha")] for k in sd if k.endswith(".alpha"))
    want = sorted(f"{blk}.{m}" for blk in ("blocks.0", "blocks.1", "token_refiner.blocks.0")
                  for m in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"))
    assert modules == want and len(sd) == 3 * len(want)
    assert not any(x in k for k in sd for x in ("to_q", "to_out", "ff.net", "transformer_blocks", "refiner_blocks"))
    qkv = {x: sd[f"diffusion_model.blocks.0.attn.qkv_proj.{x}{'.weight' if x != 'alpha' else ''}"]
           for x in ("lora_down", "lora_up", "alpha")}
    assert qkv["lora_down"].shape == (3 * RANK, 64) and qkv["lora_up"].shape == (3 * 64, 3 * RANK)
    assert float(qkv["alpha"]) == 24.0 and float(sd["diffusion_model.blocks.0.mlp.fc2.alpha"]) == 8.0
    up = qkv["lora_up"]
    assert not up[:64, RANK:].any() and not up[64:128, :RANK].any() and not up[64:128, 2 * RANK:].any()


def test_partly_adapted_qkv_fuses_with_zero_blocks(tmp_path):
    targets = ["attn.to_q", "attn.to_v", "ff.net.2"]
    model = trained(8.0, targets)
    sd = comfy_file(model, 8.0, targets, tmp_path)
    assert sd["diffusion_model.blocks.0.attn.qkv_proj.lora_down.weight"].shape[0] == 2 * RANK
    assert float(sd["diffusion_model.blocks.0.attn.qkv_proj.alpha"]) == 16.0
    want = trained_deltas(model, 8.0)
    assert delta_problems(sd, want, 1e-12) == []
    assert not converted_deltas(sd)["transformer_blocks.0.attn.to_k"].any()  # not trained: zero delta


def test_diffusers_loader_gives_the_trained_forward(tmp_path):
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin

    model = trained(8.0)
    comfy_file(model, 8.0, H3_LORA_TARGETS, tmp_path)
    sd, meta = MiniMaxH3LoraLoaderMixin.lora_state_dict(str(tmp_path / "adapter"), weight_name="lora_comfyui.safetensors",
                                                        return_lora_metadata=True)
    loaded = base_model()
    loaded.load_lora_adapter(sd, prefix="transformer", metadata=meta)

    want, got, plain = forward(model), forward(loaded.eval()), forward(base_model())
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(want, got))
    assert not torch.allclose(want[0], plain[0], atol=1e-3)  # the adapters do change the output


def test_bad_checkpoints_are_refused():
    a, b = torch.zeros(RANK, 8), torch.zeros(8, RANK)
    with pytest.raises(export_lora.ExportError, match="no counterpart in ComfyUI"):
        export_lora.comfyui_state_dict({"foo.lora_A.default.weight": a, "foo.lora_B.default.weight": b}, RANK, 8.0)
    with pytest.raises(export_lora.ExportError, match="rank 4 is not lora_meta's rank 2"):
        export_lora.comfyui_state_dict({"proj_in.lora_A.default.weight": a, "proj_in.lora_B.default.weight": b}, 2, 8.0)
    with pytest.raises(export_lora.ExportError, match="needs both lora_A and lora_B"):
        export_lora.comfyui_state_dict({"proj_in.lora_A.default.weight": a}, RANK, 8.0)


# ------------------------------------------------------------------------------------------ planted bugs
def _fc1_not_swapped(sd):
    for k in [k for k in sd if k.endswith("mlp.fc1.lora_up.weight")]:
        gate, value = sd[k].chunk(2)
        sd[k] = torch.cat([value, gate])
    return sd


def _qkv_alpha_not_scaled(sd):
    for k in [k for k in sd if k.endswith("qkv_proj.alpha")]:
        sd[k] = sd[k] / 3
    return sd


def _old_diffusers_names(model, alpha):
    """The export before the fix: diffusers' module names under ``diffusion_model.``."""
    out = {}
    for k, v in lora_parameters(model).items():
        m, is_a = k.split(".lora_A.")[0] if ".lora_A." in k else k.split(".lora_B.")[0], ".lora_A." in k
        out[f"diffusion_model.{m}.{'lora_down' if is_a else 'lora_up'}.weight"] = v.detach().clone()
        out[f"diffusion_model.{m}.alpha"] = torch.tensor(alpha)
    return out


def _stacked_not_block_diagonal(model, alpha):
    """Fused ups stacked with every B in the first r columns (each projection then sees A_q only)."""
    sd = export_lora.comfyui_state_dict(dict(lora_parameters(model)), RANK, alpha)
    for k in [k for k in sd if k.endswith("qkv_proj.lora_up.weight")]:
        up = sd[k]
        d = up.shape[0] // 3
        sd[k] = torch.zeros_like(up)
        for i in range(3):
            sd[k][i * d:(i + 1) * d, :RANK] = up[i * d:(i + 1) * d, i * RANK:(i + 1) * RANK]
    return sd


@pytest.mark.parametrize("bug", ["fc1-not-swapped", "qkv-alpha-not-scaled", "ups-stacked", "old-diffusers-names"])
def test_planted_bug_fails_the_delta_check(tmp_path, bug):
    model = trained(8.0)
    sd = comfy_file(model, 8.0, H3_LORA_TARGETS, tmp_path)
    bad = {"fc1-not-swapped": lambda: _fc1_not_swapped(sd), "qkv-alpha-not-scaled": lambda: _qkv_alpha_not_scaled(sd),
           "ups-stacked": lambda: _stacked_not_block_diagonal(model, 8.0),
           "old-diffusers-names": lambda: _old_diffusers_names(model, 8.0)}[bug]()
    assert delta_problems(bad, trained_deltas(model, 8.0), 1e-12), bug
