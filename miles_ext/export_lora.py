"""``python -m miles_ext.export_lora <checkpoint> <out_dir> [--comfyui]``: a full PEFT adapter directory.

Reads an H3 LoRA checkpoint written by the embedded trainer (``<run>/checkpoints/iter_<rollout, 9 digits>.pt``,
the newest one named in ``checkpoints/latest_checkpoint.txt``: ``{"lora": {name: tensor}, "lora_meta": {...}}``;
names as PEFT gives them inside the diffusers model, ``<module>.lora_A.default.weight``) and writes:

- ``adapter_config.json`` -- PEFT's own ``LoraConfig`` (r, lora_alpha, target_modules, ...) with the base
  model class in PEFT's ``auto_mapping``;
- ``adapter_model.safetensors`` -- PEFT's key layout ``base_model.model.<module>.lora_A.weight``;
- ``pytorch_lora_weights.safetensors`` -- diffusers' LoRA layout ``transformer.<module>.lora_A.weight`` with
  r / lora_alpha / target_modules in its ``lora_adapter_metadata``;
- with ``--comfyui`` also ``lora_comfyui.safetensors``: ``diffusion_model.<module>.lora_down.weight`` /
  ``.lora_up.weight`` / ``.alpha`` (the kohya-style naming ComfyUI loads).

The directory loads with ``peft.PeftModel.from_pretrained(base, out_dir)`` and with diffusers'
``model.load_lora_adapter(out_dir, weight_name="pytorch_lora_weights.safetensors")`` (the name is needed: the
directory holds two safetensors files); the loaded model's forward equals the trained model's (tested, and
``tests/test_h3_export_lora.py::README_SNIPPET`` is the README's example). Unlike
upstream's exporter (safetensors + a sidecar with only ``r`` and ``lora_alpha``), nothing is left implicit.

Bad input (no checkpoint, no LoRA tensors in it, an existing non-empty ``out_dir``): one ``error:`` line,
exit status 2, nothing written. The directory is built under a temporary name and renamed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from patches.core.errors import UserError, cli

LORA_MARKERS = (".lora_A.", ".lora_B.")


class ExportError(UserError):
    """The checkpoint cannot be exported (missing, no LoRA tensors, bad metadata), or ``out_dir`` is taken."""


def load_lora_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(lora tensors by PEFT-in-model name, metadata)`` from an embedded-trainer checkpoint.

    Raises:
        ExportError: missing file, not a checkpoint, or no LoRA tensors in it.
    """
    p = Path(path)
    if not p.is_file():
        raise ExportError(f"checkpoint {p} does not exist: pass a checkpoints/iter_<rollout>.pt written by "
                          "launchers/sft_h3_t2va_1gpu.sh")
    try:
        blob = torch.load(p, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure: not one of ours
        raise ExportError(f"{p} is not a torch checkpoint ({type(e).__name__}: {e})") from None
    state = blob.get("lora") if isinstance(blob, dict) else None
    state = {k: v for k, v in (state or {}).items() if any(m in k for m in LORA_MARKERS)}
    if not state:
        raise ExportError(f"{p} holds no LoRA tensors (no '.lora_A.'/'.lora_B.' keys under 'lora'): "
                          "export needs a checkpoint of a LoRA run")
    meta = blob.get("lora_meta") or {}
    for key in ("rank", "alpha", "target_modules"):
        if key not in meta:
            raise ExportError(f"{p} lacks lora_meta[{key!r}]: it was not written by the onecard H3 trainer")
    return state, meta


def _module_name(key: str) -> tuple[str, str]:
    """``"<m>.lora_A.default.weight"`` -> (``"<m>"``, ``"lora_A"``)."""
    for kind in ("lora_A", "lora_B"):
        marker = f".{kind}."
        if marker in key:
            return key.split(marker)[0], kind
    raise ExportError(f"not a LoRA key: {key}")


def peft_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's saved layout: ``base_model.model.<m>.lora_A.weight`` (adapter name dropped), contiguous fp32."""
    out = {}
    for k, v in state.items():
        module, kind = _module_name(k)
        out[f"base_model.model.{module}.{kind}.weight"] = v.detach().to(torch.float32).contiguous()
    return out


def comfyui_state_dict(state: dict[str, torch.Tensor], rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """Kohya-style keys for ComfyUI: ``diffusion_model.<m>.lora_down/lora_up.weight`` and ``.alpha``."""
    out = {}
    for k, v in state.items():
        module, kind = _module_name(k)
        out[f"diffusion_model.{module}.{'lora_down' if kind == 'lora_A' else 'lora_up'}.weight"] = (
            v.detach().to(torch.float32).contiguous())
        out[f"diffusion_model.{module}.alpha"] = torch.tensor(float(alpha))
    del rank
    return out


def export(checkpoint: str | Path, out_dir: str | Path, comfyui: bool = False) -> dict[str, Any]:
    """Write the adapter directory; returns a report (tensor count, shapes, files).

    Raises:
        ExportError: see :func:`load_lora_checkpoint`; ``out_dir`` exists and is not empty.
    """
    from peft import LoraConfig
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty: pass a new directory")
    state, meta = load_lora_checkpoint(checkpoint)
    config = LoraConfig(r=int(meta["rank"]), lora_alpha=float(meta["alpha"]),
                        target_modules=list(meta["target_modules"]), lora_dropout=0.0, bias="none")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        config.save_pretrained(str(tmp))
        cfg_path = tmp / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text())
        cls = meta.get("base_model_class", "MiniMaxH3Transformer3DModel")
        cfg["auto_mapping"] = {"base_model_class": cls, "parent_library": "diffusers"}  # PEFT's own field
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        metadata = {"format": "pt", "lora_rank": str(meta["rank"]), "lora_alpha": str(meta["alpha"])}
        save_file(peft_state_dict(state), str(tmp / "adapter_model.safetensors"), metadata=metadata)
        # diffusers' own LoRA file (keys "transformer.<m>.lora_A.weight"), read by load_lora_adapter and
        # pipelines' load_lora_weights; the alpha travels in diffusers' metadata key.
        # keys prefixed with the component, as diffusers' pipeline-level LoRA files carry them
        lora_meta = {f"transformer.{k}": sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
        dmeta = dict(metadata, lora_adapter_metadata=json.dumps(lora_meta, sort_keys=True, default=str))
        save_file({k.replace("base_model.model.", "transformer.", 1): v for k, v in peft_state_dict(state).items()},
                  str(tmp / "pytorch_lora_weights.safetensors"), metadata=dmeta)
        files = ["adapter_config.json", "adapter_model.safetensors", "pytorch_lora_weights.safetensors"]
        if comfyui:
            save_file(comfyui_state_dict(state, int(meta["rank"]), float(meta["alpha"])),
                      str(tmp / "lora_comfyui.safetensors"), metadata=metadata)
            files.append("lora_comfyui.safetensors")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    shapes = sorted({tuple(v.shape) for v in state.values()})
    return {"tensors": len(state), "shapes": shapes, "rank": meta["rank"], "alpha": meta["alpha"],
            "files": files, "out_dir": str(out)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m miles_ext.export_lora", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="an H3 LoRA run's checkpoints/iter_<rollout, 9 digits>.pt")
    ap.add_argument("out_dir", help="new directory for the PEFT adapter")
    ap.add_argument("--comfyui", action="store_true", help="also write lora_comfyui.safetensors (kohya-style keys)")
    args = ap.parse_args(argv)
    return cli(lambda: _export_and_report(args.checkpoint, args.out_dir, args.comfyui))


def _export_and_report(checkpoint: str, out_dir: str, comfyui: bool) -> int:
    report = export(checkpoint, out_dir, comfyui)
    print(f"exported {report['tensors']} LoRA tensors (rank {report['rank']}, alpha {report['alpha']}) to "
          f"{report['out_dir']}: {', '.join(report['files'])}")
    print("shapes: " + ", ".join("x".join(map(str, s)) for s in report["shapes"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
