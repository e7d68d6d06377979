"""``python -m miles_ext.recipe.export_lora <checkpoint> <out_dir> [--comfyui]``: a full PEFT adapter directory.

Reads an H3 LoRA checkpoint written by the embedded trainer (``<run>/checkpoints/iter_<rollout, 9 digits>.pt``,
the newest one named in ``checkpoints/latest_checkpoint.txt``: ``{"lora": {name: tensor}, "lora_meta": {...}}``;
names as PEFT gives them inside the diffusers model, ``<module>.lora_A.default.weight``) and writes:

- ``adapter_config.json`` -- PEFT's own ``LoraConfig`` (r, lora_alpha, target_modules, ...) with the base
  model class in PEFT's ``auto_mapping``;
- ``adapter_model.safetensors`` -- PEFT's key layout ``base_model.model.<module>.lora_A.weight``;
- ``pytorch_lora_weights.safetensors`` -- diffusers' LoRA layout ``transformer.<module>.lora_A.weight`` with
  r / lora_alpha / target_modules in its ``lora_adapter_metadata``;
- with ``--comfyui`` also ``lora_comfyui.safetensors``: the LoRA on ComfyUI's (the original checkpoint's) H3
  module names, kohya style (``diffusion_model.<module>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``):
  ``blocks.N`` / ``token_refiner.blocks.N``, a fused ``attn.qkv_proj``, ``attn.out_proj``, ``mlp.fc1`` (halves
  swapped) and ``mlp.fc2`` (:func:`comfyui_state_dict`). diffusers' own converter for such files
  (``_convert_non_diffusers_minimax_h3_lora_to_diffusers``, used by ``MiniMaxH3LoraLoaderMixin``) reads it back
  to the trained weight deltas (tested: ``tests/equivalence/test_h3_export_lora.py``).

The directory loads with ``peft.PeftModel.from_pretrained(base, out_dir)`` and with diffusers'
``model.load_lora_adapter(out_dir, weight_name="pytorch_lora_weights.safetensors")`` (the name is needed: the
directory holds two safetensors files); the loaded model's forward equals the trained model's (tested, and
``tests/test_h3_export_lora.py::README_SNIPPET`` is the README's example). Unlike
upstream's exporter (safetensors + a sidecar with only ``r`` and ``lora_alpha``), nothing is left implicit.

Bad input (no checkpoint, no LoRA tensors in it, LoRA tensors that are not one 2-D real-float ``lora_A`` /
``lora_B`` pair per module of ``lora_meta``'s rank, NaN/inf values, a ``lora_meta`` rank / alpha / target list the
trainer would refuse, an existing non-empty ``out_dir``): one ``error:`` line, exit status 2, nothing written. The directory is built under a temporary name and renamed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from miles_ext.levers.finite_step import require_finite
from miles_ext.recipe import meanings as mn
from patches.core.errors import ArgumentParser, UserError, cli
from patches.core.io import give_new_modes

LORA_MARKERS = (".lora_A.", ".lora_B.")


class ExportError(UserError):
    """The checkpoint cannot be exported (missing, no LoRA tensors, bad metadata), or ``out_dir`` is taken."""


def load_lora_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(lora tensors by PEFT-in-model name, metadata)`` from an embedded-trainer checkpoint.

    Raises:
        ExportError: missing file (or a directory), not a checkpoint, no LoRA tensors in it, a ``lora_meta`` that is not
            what the trainer writes (:func:`_check_meta`), LoRA tensors that do not form one adapter of that rank per
            module (:func:`_check_tensors`), or a LoRA tensor with NaN/inf values (a damaged checkpoint).
    """
    p = Path(path)
    if p.is_dir():
        raise ExportError(f"checkpoint {p} is a directory, not a file: pass a checkpoints/iter_<rollout>.pt in it "
                          "(the newest is named in checkpoints/latest_checkpoint.txt)")
    if not p.is_file():
        raise ExportError(f"checkpoint {p} does not exist: pass a checkpoints/iter_<rollout>.pt written by "
                          "launchers/sft_h3_t2va_1gpu.sh")
    try:
        blob = torch.load(p, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure: not one of ours
        raise ExportError(f"{p} is not a torch checkpoint ({type(e).__name__}: {e})") from None
    state = blob.get("lora") if isinstance(blob, dict) else None
    if state is not None and not isinstance(state, dict):
        raise ExportError(f"{p}: its 'lora' is a {type(state).__name__}, not a dict of tensors: it was not written by "
                          "the onecard H3 trainer; export another checkpoint")
    state = {k: v for k, v in (state or {}).items() if isinstance(k, str) and any(m in k for m in LORA_MARKERS)}
    if not state:
        raise ExportError(f"{p} holds no LoRA tensors (no '.lora_A.'/'.lora_B.' keys under 'lora'): "
                          "export needs a checkpoint of a LoRA run")
    meta = blob.get("lora_meta") or {}
    for key in ("rank", "alpha", "target_modules"):
        if not isinstance(meta, dict) or key not in meta:
            raise ExportError(f"{p} lacks lora_meta[{key!r}]: it was not written by the onecard H3 trainer")
    _check_meta(p, meta)
    state = _check_tensors(p, state, meta["rank"])
    require_finite(state, f"checkpoint {p}", error=ExportError,
                   fix="the checkpoint is damaged: export an earlier iter_<rollout>.pt of the run")
    return state, meta


_DAMAGED = "the checkpoint is damaged or not the onecard H3 trainer's: export another iter_<rollout>.pt of the run"


def _check_meta(p: Path, meta: dict[str, Any]) -> None:
    """``lora_meta``'s rank, alpha and target modules, as the trainer's ``--lora-rank`` / ``--lora-alpha`` /
    ``--lora-target-modules`` may be (:mod:`miles_ext.recipe.meanings`).

    Raises:
        ExportError: a rank that is not a whole number in the trainer's range, an alpha that is not a finite number in
            its range, or target modules that are not a non-empty list of names (a string would become a list of its
            characters in PEFT's config).
    """
    rank, alpha, targets = meta["rank"], meta["alpha"], meta["target_modules"]
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ExportError(f"{p}: lora_meta['rank'] = {rank!r} is not a whole number; {_DAMAGED}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ExportError(f"{p}: lora_meta['alpha'] = {alpha!r} is not a number; {_DAMAGED}")
    for key, value, m in (("rank", rank, mn.LORA_RANK), ("alpha", alpha, mn.LORA_ALPHA)):
        why = m.problem(value)
        if why:
            raise ExportError(f"{p}: lora_meta[{key!r}] = {value!r} {why} ({m.why}); {_DAMAGED}")
    if (not isinstance(targets, (list, tuple)) or not targets
            or not all(isinstance(t, str) and t for t in targets)):
        raise ExportError(f"{p}: lora_meta['target_modules'] = {str(targets)[:80]!r} is not a non-empty list of "
                          f"module names; {_DAMAGED}")


def _check_tensors(p: Path, state: dict[str, Any], rank: int) -> dict[str, torch.Tensor]:
    """The LoRA tensors as one adapter per module: each a dense 2-D real floating-point tensor, exactly one
    ``lora_A`` (``[rank, in]``) and one ``lora_B`` (``[out, rank]``) per module; returned as fp32 (what the files
    hold), so that the finiteness check sees the values written (an fp64 1e300 is inf in fp32).

    Raises:
        ExportError: naming the first tensor or module that breaks one of these.
    """
    kinds: dict[str, dict[str, str]] = {}
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if not isinstance(v, torch.Tensor) or v.layout != torch.strided or v.is_meta:
            what = type(v).__name__ if not isinstance(v, torch.Tensor) else f"{v.layout} / {v.device} tensor"
            raise ExportError(f"{p}: {k} is a {what}, not a dense tensor; {_DAMAGED}")
        if not v.is_floating_point():
            raise ExportError(f"{p}: {k} has dtype {v.dtype}, not a floating-point one (the trainer saves fp32 "
                              f"adapters); {_DAMAGED}")
        if v.dim() != 2:
            raise ExportError(f"{p}: {k} has shape {list(v.shape)}, not a 2-D LoRA matrix; {_DAMAGED}")
        module, kind = _module_name(k)
        if kind in kinds.setdefault(module, {}):
            raise ExportError(f"{p}: {module} has two {kind} tensors ({kinds[module][kind]} and {k}): one adapter "
                              f"per module is exported; {_DAMAGED}")
        kinds[module][kind] = k
        out[k] = v.detach().to(torch.float32)
    for module, ab in sorted(kinds.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise ExportError(f"{p}: {module} has only {sorted(ab)}, and a LoRA needs both lora_A and lora_B; "
                              f"{_DAMAGED}")
        a, b = out[ab["lora_A"]], out[ab["lora_B"]]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ExportError(f"{p}: {module}'s lora_A {list(a.shape)} and lora_B {list(b.shape)} are not of "
                              f"lora_meta's rank {rank} (lora_A [rank, in], lora_B [out, rank]); {_DAMAGED}")
    return out


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


COMFY_STANDALONE: dict[str, str] = {
    "proj_in": "video_patch_proj",
    "audio_proj_in": "audio_patch_proj",
    "context_embedder": "condition_proj",
    "time_embedder.linear_1": "time_embedder.proj_in",
    "time_embedder.linear_2": "time_embedder.proj_out",
    "norm_out.linear": "final_layer.adaln_proj.linear",
    "proj_out": "final_layer.video_out",
    "audio_proj_out": "final_layer.audio_out",
}
"""diffusers module -> the original / ComfyUI H3 module, outside the block stacks (inverse of diffusers'
``_convert_non_diffusers_minimax_h3_lora_to_diffusers``)."""

COMFY_BLOCK_STACKS: tuple[tuple[str, str], ...] = (
    (r"transformer_blocks\.(\d+)\.(.+)", "blocks"),
    (r"token_refiner\.refiner_blocks\.(\d+)\.(.+)", "token_refiner.blocks"),
)
"""diffusers block stack (regex: index, module in the block) -> the original / ComfyUI stack."""

COMFY_IN_BLOCK: dict[str, str] = {
    "attn.to_out.0": "attn.out_proj",
    "ff.net.0.proj": "mlp.fc1",
    "ff.net.2": "mlp.fc2",
    "adaln_proj.linear": "adaln_proj.linear",
}
"""diffusers module in a block -> the original / ComfyUI module (``to_q/to_k/to_v`` fuse into ``attn.qkv_proj``)."""

COMFY_QKV: tuple[str, ...] = ("attn.to_q", "attn.to_k", "attn.to_v")
"""The three projections the original H3 fuses into ``attn.qkv_proj``, in its row order."""


def comfyui_state_dict(state: dict[str, torch.Tensor], rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """The LoRA on the original / ComfyUI MiniMax-H3 module names, kohya style: ``diffusion_model.<m>.lora_down.weight``
    (``[r_m, in]``), ``.lora_up.weight`` (``[out, r_m]``), ``.alpha`` (0-d fp32); a loader applies
    ``delta W = (alpha / r_m) * up @ down`` with ``r_m`` = the down weight's rows. All fp32.

    Module map (the inverse of diffusers' ``_convert_non_diffusers_minimax_h3_lora_to_diffusers``, which reads this
    file back): ``transformer_blocks.N`` -> ``blocks.N``, ``token_refiner.refiner_blocks.N`` ->
    ``token_refiner.blocks.N``; in a block ``attn.to_out.0`` -> ``attn.out_proj``, ``ff.net.2`` -> ``mlp.fc2``,
    ``ff.net.0.proj`` -> ``mlp.fc1`` with the up weight's two row halves swapped (diffusers' SwiGLU is fused
    ``[value; gate]``, the original ``[gate; value]``), and ``attn.to_q/to_k/to_v`` -> one fused ``attn.qkv_proj``:
    downs stacked ``[A_q; A_k; A_v]`` (rank ``k*r`` for the ``k`` projections adapted), up block-diagonal
    (``B_q`` in rows ``0..d``, columns ``0..r``; ``B_k`` next; zero rows for a projection not adapted, whose delta
    is then zero), alpha ``k * alpha`` so that ``alpha / rank`` stays ``alpha / r``; the projections outside the
    blocks per :data:`COMFY_STANDALONE`. Each fused block's delta is then exactly the trained ``(alpha / r) B A``.

    Raises:
        ExportError: a module with no original H3 name, an adapter whose rank is not ``rank``, an incomplete
            A/B pair, or q/k/v projections of different output widths.
    """
    import re

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in state.items():
        module, kind = _module_name(k)
        pairs.setdefault(module, {})[kind] = v.detach().to(torch.float32)
    out: dict[str, torch.Tensor] = {}

    def put(name: str, down: torch.Tensor, up: torch.Tensor, a: float) -> None:
        out[f"diffusion_model.{name}.lora_down.weight"] = down.contiguous()
        out[f"diffusion_model.{name}.lora_up.weight"] = up.contiguous()
        out[f"diffusion_model.{name}.alpha"] = torch.tensor(float(a))

    fused: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise ExportError(f"{module} has {sorted(ab)} but a LoRA needs both lora_A and lora_B: the checkpoint is "
                              "incomplete; export another one")
        down, up = ab["lora_A"], ab["lora_B"]
        if down.shape[0] != rank or up.shape[1] != rank:
            raise ExportError(f"{module}: adapter rank {down.shape[0]} is not lora_meta's rank {rank}: the checkpoint "
                              "is inconsistent; export another one")
        if module in COMFY_STANDALONE:
            put(COMFY_STANDALONE[module], down, up, alpha)
            continue
        found = [(m, stack) for m, stack in ((re.fullmatch(p, module), stack) for p, stack in COMFY_BLOCK_STACKS) if m]
        sub = found[0][0].group(2) if found else None
        if sub not in COMFY_IN_BLOCK and sub not in COMFY_QKV:
            raise ExportError(f"{module} has no counterpart in ComfyUI's MiniMax-H3 model, so --comfyui cannot "
                              "write it: export without --comfyui (PEFT / diffusers files) or train without it")
        block = f"{found[0][1]}.{found[0][0].group(1)}"
        if sub in COMFY_QKV:
            fused.setdefault(block, {})[sub] = (down, up)
            continue
        if sub == "ff.net.0.proj":  # diffusers [value; gate] -> original [gate; value]
            value, gate = up.chunk(2, dim=0)
            up = torch.cat([gate, value], dim=0)
        put(f"{block}.{COMFY_IN_BLOCK[sub]}", down, up, alpha)

    for block, members in fused.items():
        present = [m for m in COMFY_QKV if m in members]
        widths = {members[m][1].shape[0] for m in present}
        if len(widths) != 1:
            raise ExportError(f"{block}: q/k/v projections of different widths {sorted(widths)} cannot be fused into "
                              "ComfyUI's qkv_proj; export without --comfyui")
        d = widths.pop()
        downs = torch.cat([members[m][0] for m in present], dim=0)
        up = torch.zeros(3 * d, downs.shape[0], dtype=torch.float32)
        col = 0
        for i, m in enumerate(COMFY_QKV):
            if m in members:
                up[i * d:(i + 1) * d, col:col + rank] = members[m][1]
                col += rank
        put(f"{block}.attn.qkv_proj", downs, up, alpha * len(present))
    return out


def export(checkpoint: str | Path, out_dir: str | Path, comfyui: bool = False) -> dict[str, Any]:
    """Write the adapter directory; returns a report (tensor count, shapes, files).

    Raises:
        ExportError: see :func:`load_lora_checkpoint`; ``out_dir`` is a file, or exists and is not empty; or it
            cannot be written (under a file, read-only, disk full: the ``OSError`` / safetensors error named).
            Nothing is left behind then: the temporary directory and any parent folders this call made are removed.
    """
    from peft import LoraConfig
    from safetensors import SafetensorError

    out = Path(out_dir)
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise ExportError(f"{out} is a file, not a directory: pass a new directory for the adapter")
    if out.is_dir() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty: pass a new directory")
    state, meta = load_lora_checkpoint(checkpoint)
    config = LoraConfig(r=int(meta["rank"]), lora_alpha=float(meta["alpha"]),
                        target_modules=list(meta["target_modules"]), lora_dropout=0.0, bias="none")
    made = [d for d in reversed(out.absolute().parents) if not d.exists()]  # parents this call creates, outermost first
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        files = _write_adapter(tmp, out, config, state, meta, comfyui)
    except (OSError, SafetensorError) as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()
        why = " ".join(str(e).split()) or type(e).__name__
        raise ExportError(f"cannot write the adapter to {out} ({type(e).__name__}: {why}): pass a new directory on a "
                          "writable disk with free space") from None
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    shapes = sorted({tuple(v.shape) for v in state.values()})
    return {"tensors": len(state), "shapes": shapes, "rank": meta["rank"], "alpha": meta["alpha"],
            "files": files, "out_dir": str(out)}


def _write_adapter(tmp: Path, out: Path, config: Any, state: dict[str, torch.Tensor], meta: dict[str, Any],
                   comfyui: bool) -> list[str]:
    """Write the adapter files into ``tmp``, then rename ``tmp`` onto ``out``; returns the file names."""
    from safetensors.torch import save_file

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
                  str(tmp / "lora_comfyui.safetensors"),
                  metadata=dict(metadata, layout="minimax-h3 original/ComfyUI names; attn.qkv_proj fused: rank "
                                "and alpha x the q/k/v projections adapted"))
        files.append("lora_comfyui.safetensors")
    give_new_modes(tmp)  # mkdtemp's 0700 would make the published adapter private to this user
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    return files


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m miles_ext.recipe.export_lora", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="an H3 LoRA run's checkpoints/iter_<rollout, 9 digits>.pt")
    ap.add_argument("out_dir", help="new directory for the PEFT adapter")
    ap.add_argument("--comfyui", action="store_true",
                    help="also write lora_comfyui.safetensors (ComfyUI's H3 module names, fused qkv_proj, kohya keys)")
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
