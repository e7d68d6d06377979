"""The miles-diffusion patch table against upstream's REAL ``apply_fsdp2`` and one-rank state load, on the CPU.

``python benchmarks/upstream/miles_real_cpu.py --miles-root DIR [--stubs DIR] [--out DIR] [--configs A,B]``

``DIR`` holds a ``miles/...`` package tree of radixark/miles_diffusion's own files (never inside this repository;
``MANIFEST.onecard.json`` beside ``miles/``, if present, names each file's repository and commit). In one spawned
process, a gloo world of 1 on the CPU, for each configuration (:data:`CONFIGS`) it builds the tiny H3 the tests use
(:data:`miles_ext.recipe.presets.TINY`, seed 0; LoRA attached with upstream's own ``model_loader.apply_lora``) and:

1. **patched**: applies the patch table (:mod:`patches.miles_table`, ``MILES_ONECARD_FSDP=1``) to the real modules,
   calls upstream's ``model_loader.apply_fsdp2`` (now the patched one) with upstream's H3 plan
   (``models.diffusers.load_fsdp_parallel_plan("h3")``, ``no_split_modules`` filled from the model as upstream's
   ``DiffusersModelBackend.fsdp_parallel_plan`` does), then ``checkpoint.broadcast_full_state_to_fsdp`` with a
   full state dict of a *different* model (seed 1, LoRA weights random), then upstream's ``finish_fsdp_lazy_init``,
   then one forward + backward of a 2-pair micro-batch (:func:`miles_ext.recipe.sft.micro_batch_loss_sum`);
2. **unpatched**: the same with the table reverted (upstream's own functions).

Checks, per configuration (each fails on its planted bug, ``--plant``):

- ``load_bitwise``: every parameter's full value after the patched load equals the source state (``torch.equal``);
  the source differs from the model's initial values in every parameter, so a load that does nothing fails;
- ``units``: the wrap units are what the patch promises: one unit per ``no_split_modules`` block holding the block's
  base parameters, LoRA adapters in a unit of their own per block, the root unit holding the rest, every parameter
  in exactly one unit; each unit's mixed-precision policy is ``--diffusion-forward-dtype``/``--fsdp-reduce-dtype``;
  under ``cpu_offload`` every unit offloaded (``CPUOffloadPolicy``) and the shards in the exact-size arena; with
  ``MILES_RESIDENT_BLOCKS`` the resident blocks, the root and the adapters on the device, the rest offloaded;
- ``same_as_unpatched``: the patched run's full parameter values and buffers equal the unpatched run's (bitwise);
- ``grads_same_as_unpatched``: the loss and every trainable parameter's gradient after one forward + backward are
  bitwise equal between the patched and the unpatched run.

Upstream's unpatched code assumes CUDA, so on a CPU-only torch two torch names are shimmed **for the unpatched run
only** (recorded in the result): ``torch.cuda.current_device`` -> ``torch.device("cpu")`` (upstream's
``broadcast_full_state_to_fsdp`` moves the model to it) and, under ``cpu_offload``,
``torch.distributed.fsdp.CPUOffloadPolicy`` -> ``pin_memory=False`` by default (upstream's ``CPUOffloadPolicy()``
pins, which needs an accelerator). The patched run needs neither. ``--stubs DIR`` is put on ``sys.path`` before
``--miles-root`` for third-party modules that cannot be installed; its top-level module names are recorded.

Writes ``<date>_miles_cpu_real-upstream.{json,md}`` under ``--out`` (default ``benchmarks/results``); exits 0 when
every check passed, 1 when one failed (the result is written either way). Bad arguments are one ``error:`` line,
exit 2, before anything runs or is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.checks import free_targets, pick, result_stem, writable_dir, write_together  # noqa: E402
from patches.core.errors import ArgumentParser, UserError, cli  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FSDP_DIR = Path("miles") / "backends" / "fsdp_utils"
REQUIRED = (FSDP_DIR / "model_loader.py", FSDP_DIR / "checkpoint.py")
MANIFEST = "MANIFEST.onecard.json"


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration: what the model carries and how FSDP2 is applied."""

    name: str
    lora: bool
    master: str
    """Storage dtype of the base (``--fsdp-master-dtype``; ``_keep_in_fp32_modules`` stay fp32)."""
    forward: str
    """``--diffusion-forward-dtype`` (the FSDP ``param_dtype``)."""
    cpu_offload: bool
    resident: str = ""
    """``MILES_RESIDENT_BLOCKS`` for the patched run ('' = unset)."""


CONFIGS = {c.name: c for c in (
    Config("lora-fp32-offload", lora=True, master="fp32", forward="fp32", cpu_offload=True),
    Config("lora-fp32", lora=True, master="fp32", forward="fp32", cpu_offload=False),
    Config("lora-bf16-offload", lora=True, master="bf16", forward="bf16", cpu_offload=True),
    Config("lora-fp32-offload-resident1", lora=True, master="fp32", forward="fp32", cpu_offload=True, resident="1"),
    Config("full-fp32-offload", lora=False, master="fp32", forward="fp32", cpu_offload=True),
)}
PLANTS = {
    "skip-param": "the patched state load leaves one parameter unloaded",
    "flip-element": "one element of one loaded shard is flipped after the patched state load",
    "unpatched-apply": "the table's apply_fsdp2 replacement is left out (upstream's own wraps the patched run)",
    "grad-noise": "one element of one gradient of the patched run is changed after backward",
}
"""Planted bugs (``--plant``, for the tests): each must make at least one check fail."""
CHECKS = ("load_bitwise", "units", "same_as_unpatched", "grads_same_as_unpatched")


# ----------------------------------------------------------------------------------------------- the worker


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def upstream_files(root: Path) -> list[dict]:
    """Every ``.py`` under ``root/miles`` with its sha256 and bytes, and repository/commit from the manifest."""
    manifest = {}
    if (root / MANIFEST).is_file():
        manifest = json.loads((root / MANIFEST).read_text()).get("files", {})
    out = []
    for p in sorted((root / "miles").rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        entry = manifest.get(rel, {})
        out.append({"path": rel, "repo": entry.get("repo", "unknown"), "commit": entry.get("commit", "unknown"),
                    "sha256": _sha256(p), "bytes": p.stat().st_size})
    return out


def _full(t):
    import torch

    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().to("cpu").clone() if isinstance(t, torch.Tensor) else t


class _Shims:
    """The torch names shimmed for upstream's CUDA-only assumptions (unpatched run on a CPU-only torch)."""

    def __init__(self, cpu_offload: bool):
        self.cpu_offload = cpu_offload
        self.used: list[str] = []
        self._undo: list = []

    def __enter__(self):
        import torch
        from torch.distributed import fsdp

        if torch.cuda.is_available():
            return self
        orig_dev = torch.cuda.current_device
        torch.cuda.current_device = lambda: torch.device("cpu")
        self._undo.append(lambda: setattr(torch.cuda, "current_device", orig_dev))
        self.used.append("torch.cuda.current_device -> torch.device('cpu')")
        if self.cpu_offload:
            orig_policy = fsdp.CPUOffloadPolicy

            class CPUOffloadPolicy(orig_policy):  # upstream's class, pin_memory off by default
                def __init__(self, pin_memory: bool = False):
                    super().__init__(pin_memory=pin_memory)

            fsdp.CPUOffloadPolicy = CPUOffloadPolicy
            self._undo.append(lambda: setattr(fsdp, "CPUOffloadPolicy", orig_policy))
            self.used.append("torch.distributed.fsdp.CPUOffloadPolicy -> pin_memory=False by default")
        return self

    def __exit__(self, *exc):
        while self._undo:
            self._undo.pop()()


def _pairs(count: int):
    """``count`` small clean pairs of fixed sizes (text, video latent, audio latent), seeded."""
    import torch

    from miles_ext.recipe.presets import TINY
    from miles_ext.recipe.sft import SftPair

    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(1000 + i)
        out.append(SftPair(text=torch.randn(3 + i, TINY.text_dim, generator=g),
                           video=torch.randn(TINY.in_channels, 1 + i % 2, 2, 4, generator=g),
                           audio=torch.randn(2, TINY.audio_in_channels, 2, generator=g)))
    return out


def _args(cfg: Config):
    from argparse import Namespace

    from miles_ext.recipe.presets import H3_LORA_TARGETS

    return Namespace(diffusion_forward_dtype=cfg.forward, fsdp_reduce_dtype="fp32", fsdp_master_dtype=cfg.master,
                     use_lora=cfg.lora, lora_rank=8, lora_alpha=16, lora_target_modules=list(H3_LORA_TARGETS),
                     lora_init_weights="gaussian")


def _model(cfg: Config, seed: int, model_loader):
    """The tiny H3 (seed ``seed``) stored in ``cfg.master``, LoRA attached with upstream's ``apply_lora``; the LoRA
    weights are then drawn at random (gaussian init leaves ``lora_B`` zero, which would zero ``lora_A``'s grads)."""
    import torch

    from miles_ext.levers.fsdp_policy import set_master_dtype
    from miles_ext.recipe.presets import TINY, build_transformer

    torch.manual_seed(seed)
    model = build_transformer(TINY)
    set_master_dtype(model, cfg.master)
    if cfg.lora:
        model = model_loader.apply_lora(model, _args(cfg), None)
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.05)
    model.train(True)
    return model


def _plan(model):
    """Upstream's H3 plan with ``no_split_modules`` from the model (what ``DiffusersModelBackend.fsdp_parallel_plan``
    returns, per upstream's own test of it)."""
    from miles.backends.fsdp_utils.models.diffusers import load_fsdp_parallel_plan

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return dataclasses.replace(load_fsdp_parallel_plan("h3"), no_split_modules=tuple(base._no_split_modules))


def _units(model) -> list[dict]:
    """Every FSDP2 unit: the module that owns it, its parameters' names, offload and mixed-precision dtypes."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(p): n for n, p in model.named_parameters()}
    seen, out = set(), []
    for mod_name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        fps = group.fsdp_params
        out.append({"module": mod_name, "params": sorted(names[id(fp.sharded_param)] for fp in fps),
                    "offloaded": sorted({bool(fp.offload_to_cpu) for fp in fps}),
                    "param_dtype": str(group.mp_policy.param_dtype), "reduce_dtype": str(group.mp_policy.reduce_dtype)})
    return out


def _check_units(model, cfg: Config, resident: int | None) -> tuple[bool, list[str], dict]:
    """The patch's promise for ``model``'s units (see the module docstring); (ok, problems, summary).
    ``resident``: ``MILES_RESIDENT_BLOCKS`` as a count (that many block units on the device, the rest offloaded)."""
    import torch

    units = _units(model)
    plan = _plan(model)
    blocks = [(n, m) for n, m in model.named_modules()  # fully_shard swaps in a subclass: match the class's bases
              if any(c.__name__ in plan.no_split_modules for c in type(m).__mro__)]
    problems = []
    by_module = {u["module"]: u for u in units}
    every = [p for u in units for p in u["params"]]
    all_params = sorted(n for n, _ in model.named_parameters())
    if sorted(every) != all_params:
        problems.append(f"{len(every)} parameters in units, {len(all_params)} in the model (each must be in one unit)")
    block_params: set[str] = set()
    adapter_units = on_device = 0
    for i, (bname, block) in enumerate(blocks):
        own = sorted(f"{bname}.{n}" for n, _ in block.named_parameters())
        block_params.update(own)
        base = [n for n in own if "lora_" not in n]
        lora = [n for n in own if "lora_" in n]
        unit = by_module.get(bname)
        if unit is None or unit["params"] != base:
            problems.append(f"block {bname}: its unit holds {None if unit is None else len(unit['params'])} params, "
                            f"want its {len(base)} base params")
            continue
        if resident is None and unit["offloaded"] != [cfg.cpu_offload]:
            problems.append(f"block {bname}: offloaded {unit['offloaded']}, want {cfg.cpu_offload}")
        on_device += unit["offloaded"] == [False]
        if lora:
            match = [u for u in units if u["params"] == lora]
            if len(match) != 1:
                problems.append(f"block {bname}: its {len(lora)} adapter params are not one unit of their own")
            else:
                adapter_units += 1
                want = cfg.cpu_offload and resident is None
                if match[0]["offloaded"] != [want]:
                    problems.append(f"block {bname} adapters: offloaded {match[0]['offloaded']}, want {want}")
    if resident is not None and cfg.cpu_offload and on_device != resident:
        problems.append(f"MILES_RESIDENT_BLOCKS={resident}: {on_device} block units on the device, want {resident}")
    root = by_module.get("")
    rest = sorted(set(all_params) - block_params)
    if root is None or root["params"] != rest:
        problems.append(f"root unit holds {None if root is None else len(root['params'])} params, want {len(rest)}")
    elif root["offloaded"] != [cfg.cpu_offload and resident is None]:
        problems.append(f"root: offloaded {root['offloaded']}, want {cfg.cpu_offload and resident is None}")
    want_pd = str({"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.forward])
    for u in units:
        if (u["param_dtype"], u["reduce_dtype"]) != (want_pd, str(torch.float32)):
            problems.append(f"unit {u['module'] or '<root>'}: mp {u['param_dtype']}/{u['reduce_dtype']}, want {want_pd}/fp32")
            break
    report = getattr(model, "_onecard_pinned_report", None)
    if cfg.cpu_offload and (report is None or report.requested_bytes <= 0):
        problems.append("cpu_offload: no exact-size arena report on the model (MILES_ONECARD_FSDP's pinned arena)")
    summary = {"units": len(units), "block_units": len(blocks), "adapter_units": adapter_units,
               "root_params": len(rest), "offloaded_units": sum(u["offloaded"] == [True] for u in units),
               "arena_requested_bytes": report.requested_bytes if report is not None else 0}
    return not problems, problems, summary


def _run(cfg: Config, mesh, model_loader, checkpoint, source: dict, plant: str, patched: bool) -> dict:
    """Apply, load ``source``, lazy-init and one forward + backward; returns values, grads, units."""
    import torch

    from miles_ext.recipe.sft import draw_micro_batch, micro_batch_loss_sum

    model = _model(cfg, 0, model_loader)
    plan = _plan(model)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    shims = _Shims(cfg.cpu_offload)
    with shims if not patched or plant == "unpatched-apply" else contextlib.nullcontext():  # upstream's own apply needs them too
        model_loader.apply_fsdp2(model, plan, mesh=mesh, cpu_offload=cfg.cpu_offload, args=_args(cfg))
        state = dict(source)
        if patched and plant == "skip-param":
            skipped = next(k for k in state if "lora_" in k or not cfg.lora)
            state[skipped] = initial[skipped]  # what the shard already held: this entry is not loaded
        checkpoint.broadcast_full_state_to_fsdp(model, state, cpu_offload=cfg.cpu_offload)
        if patched and plant == "flip-element":
            p = next(p for n, p in model.named_parameters() if "lora_" in n or not cfg.lora)
            with torch.no_grad():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.view(-1)[0].neg_().add_(1.0)
        model_loader.finish_fsdp_lazy_init(model)
        values = {k: _full(v) for k, v in model.state_dict().items()}
        buffers = {k: _full(b) for k, b in model.named_buffers()}
        noised = draw_micro_batch(_pairs(2), seed=5, rollout_id=0, microbatch_id=0, dp_rank=0)
        loss = micro_batch_loss_sum(model, noised)
        loss.backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    if patched and plant == "grad-noise":
        k = min(grads)
        grads[k].view(-1)[0] += 1.0
    units_ok, problems, summary = _check_units(model, cfg, int(cfg.resident) if cfg.resident else None)
    return {"values": values, "buffers": buffers, "grads": grads, "loss": loss.detach().clone(), "units_ok": units_ok,
            "unit_problems": problems, "unit_summary": summary, "shims": shims.used,
            "initial": initial, "trainable": sorted(grads)}


def _diff(a: dict, b: dict) -> list[str]:
    """Keys where ``a`` and ``b`` differ (missing keys, dtype or shape, or any element: ``torch.equal``)."""
    import torch

    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def _max_abs(a: dict, b: dict, keys: list[str]) -> float:
    out = 0.0
    for k in keys:
        if k in a and k in b and a[k].shape == b[k].shape:
            out = max(out, float((a[k].double() - b[k].double()).abs().max()))
    return out


def _source(cfg: Config, model_loader) -> dict:
    """The full state dict to load: the seed-1 model's, every floating entry plus seeded noise (so that it differs
    from the seed-0 model's initial values everywhere, norm weights of ones included)."""
    import torch

    g = torch.Generator().manual_seed(11)
    out = {}
    for k, v in _model(cfg, 1, model_loader).state_dict().items():
        v = v.detach().clone()
        if v.is_floating_point():
            v += (torch.randn(v.shape, generator=g) * 0.01 + 0.01).to(v.dtype)
        out[k] = v
    return out


def _one(cfg: Config, mesh, plant: str) -> dict:
    import torch

    from miles.backends.fsdp_utils import checkpoint, model_loader
    from patches.miles_table import patch_set

    source = _source(cfg, model_loader)
    before_env = os.environ.get("MILES_RESIDENT_BLOCKS")
    ps = patch_set()
    if cfg.resident:
        os.environ["MILES_RESIDENT_BLOCKS"] = cfg.resident
    else:  # the patched apply reads it: a value from the caller's environment must not leak in
        os.environ.pop("MILES_RESIDENT_BLOCKS", None)
    targets = ps.apply({"MILES_ONECARD_FSDP": True, "MILES_RESIDENT_BLOCKS": cfg.resident})
    if plant == "unpatched-apply":  # the planted bug: apply_fsdp2's replacement left out
        model_loader.apply_fsdp2 = model_loader.apply_fsdp2.__wrapped__
    try:
        patched = _run(cfg, mesh, model_loader, checkpoint, source, plant, patched=True)
    finally:
        ps.revert()  # puts upstream's originals back (also after the planted "unpatched-apply")
        if before_env is None:
            os.environ.pop("MILES_RESIDENT_BLOCKS", None)
        else:
            os.environ["MILES_RESIDENT_BLOCKS"] = before_env
    if getattr(model_loader.apply_fsdp2, "_onecard_patch", None) or getattr(checkpoint.broadcast_full_state_to_fsdp,
                                                                            "_onecard_patch", None):
        raise RuntimeError("the patch table did not revert: the unpatched run would not be upstream's own")
    unpatched = _run(cfg, mesh, model_loader, checkpoint, source, plant, patched=False)

    untouched = [k for k in source if source[k].is_floating_point() and torch.equal(source[k], patched["initial"][k])]
    load_diff = _diff({k: patched["values"][k] for k in source}, source)
    value_diff = _diff(patched["values"], unpatched["values"]) + _diff(patched["buffers"], unpatched["buffers"])
    grad_diff = _diff(patched["grads"], unpatched["grads"])
    loss_same = bool(torch.equal(patched["loss"], unpatched["loss"]))
    if patched["trainable"] != unpatched["trainable"]:
        grad_diff.append("<the trainable parameters differ>")
    checks = {
        "load_bitwise": not load_diff and not untouched,
        "units": patched["units_ok"],
        "same_as_unpatched": not value_diff,
        "grads_same_as_unpatched": not grad_diff and loss_same and bool(patched["grads"]),
    }
    return {
        "config": dataclasses.asdict(cfg), "patched_targets": targets, "checks": checks,
        "parameters": len(patched["values"]), "state_entries": len(source),
        "trainable_parameters": len(patched["trainable"]),
        "source_equal_to_initial": untouched, "load_mismatches": load_diff[:10],
        "value_mismatches_vs_unpatched": value_diff[:10],
        "grad_mismatches_vs_unpatched": grad_diff[:10],
        "grad_max_abs_diff": _max_abs(patched["grads"], unpatched["grads"], grad_diff),
        "loss_patched": float(patched["loss"]), "loss_unpatched": float(unpatched["loss"]), "loss_bitwise": loss_same,
        "units_patched": patched["unit_summary"], "unit_problems": patched["unit_problems"],
        "units_unpatched": unpatched["unit_summary"],
        "unpatched_shims": unpatched["shims"], "patched_shims": patched["shims"],
    }


def _worker(root: str, stubs: str | None, names: list[str], plant: str, out_file: str, port: int) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run, also on a machine with a GPU
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    for p in ([root] + ([stubs] if stubs else []))[::-1]:
        sys.path.insert(0, p)
    sys.path.insert(0, str(REPO))  # onecard's packages, ahead of nothing upstream ships
    import logging

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    logging.getLogger("miles").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        import miles.backends.fsdp_utils.model_loader as ml

        origin = str(Path(ml.__file__).resolve())
        if not origin.startswith(str(Path(root).resolve())):
            raise RuntimeError(f"miles imported from {origin}, not from --miles-root {root}")
        mesh = init_device_mesh("cpu", (1,))
        rows = [_one(CONFIGS[n], mesh, plant) for n in names]
        loaded = sorted(m for m in sys.modules if m == "miles" or m.startswith("miles."))
        Path(out_file).write_text(json.dumps({"rows": rows, "miles_modules": loaded}, indent=2))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------- the CLI


def _stub_names(stubs: Path | None) -> list[str]:
    if stubs is None:
        return []
    return sorted({p.stem if p.is_file() else p.name for p in stubs.iterdir()
                   if (p.is_file() and p.suffix == ".py") or (p.is_dir() and (p / "__init__.py").is_file())})


def _markdown(result: dict) -> str:
    lines = [f"{result['date']}, CPU ({result['cpu_cores']} cores), torch {result['torch']}, diffusers "
             f"{result['diffusers']}, peft {result['peft']}; `benchmarks/upstream/miles_real_cpu.py`: the miles-diffusion "
             "patch table (`MILES_ONECARD_FSDP=1`) over upstream's real `model_loader.apply_fsdp2` and "
             "`checkpoint.broadcast_full_state_to_fsdp`, one gloo rank, tiny H3, against the same functions unpatched."
             + (f" **Planted bug: {result['plant']}** ({PLANTS[result['plant']]})." if result["plant"] else ""), "",
             "| configuration | LoRA | master / forward | cpu_offload | units (blocks + adapters + root) | "
             + " | ".join(CHECKS) + " |", "|---|---|---|---|---|" + "---|" * len(CHECKS)]
    for r in result["rows"]:
        c, u = r["config"], r["units_patched"]
        shape = f"{u['units']} ({u['block_units']} + {u['adapter_units']} + 1)"
        off = ("yes" + (f", resident {c['resident']}" if c["resident"] else "")) if c["cpu_offload"] else "no"
        lines.append(f"| {c['name']} | {'yes' if c['lora'] else 'no'} | {c['master']} / {c['forward']} | {off} | "
                     f"{shape} | " + " | ".join("pass" if r["checks"][k] else "**FAIL**" for k in CHECKS) + " |")
    lines += ["", f"All checks passed: **{'yes' if result['all_passed'] else 'no'}**. Comparisons are `torch.equal` "
              "(bitwise) on full tensors: parameters after the load against the source state dict (another model, "
              "seed 1, plus seeded noise in every floating entry), and patched against unpatched values, buffers, the loss and every trainable gradient "
              "after one forward + backward of a 2-pair micro-batch.", ""]
    for r in result["rows"]:
        bad = {k: r[k] for k in ("load_mismatches", "value_mismatches_vs_unpatched", "grad_mismatches_vs_unpatched",
                                 "unit_problems", "source_equal_to_initial") if r[k]}
        if bad:
            lines.append(f"- {r['config']['name']}: " + "; ".join(f"{k}: {v[:3]}" for k, v in bad.items()))
    lines += ["", "Upstream's own `apply_fsdp2` (the unpatched run), for comparison: "
              + "; ".join(f"{r['config']['name']} {r['units_unpatched']['units']} units "
                          f"({r['units_unpatched']['block_units']} blocks + root)" for r in result["rows"])
              + "; its LoRA adapters sit in their block's unit."]
    shims = sorted({s for r in result["rows"] for s in r["unpatched_shims"]})
    patched_shims = sorted({s for r in result["rows"] for s in r["patched_shims"]})
    lines += ["", "Torch names shimmed for the unpatched run, because upstream's code assumes CUDA: "
              + ("; ".join(f"`{s}`" for s in shims) if shims else "none") + ". The patched run: "
              + ("; ".join(f"`{s}`" for s in patched_shims) if patched_shims else "no shim") + ".",
              "Stubbed modules (`--stubs`): " + (", ".join(f"`{s}`" for s in result["stubbed_modules"]) or "none") + ".",
              "", "Upstream files (`--miles-root`, outside this repository):", "",
              "| file | repository | commit | sha256 |", "|---|---|---|---|"]
    for f in result["upstream_files"]:
        lines.append(f"| `{f['path']}` | {f['repo']} | `{f['commit'][:12]}` | `{f['sha256'][:16]}` |")
    for k, v in result.get("upstream_absent", {}).items():
        lines.append(f"\nNot in the tree: `{k}`: {v}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); bad input is one ``error:`` line and 2 (:func:`patches.core.errors.cli`)."""
    return cli(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--miles-root", required=True, help="folder holding upstream's miles/ package tree")
    ap.add_argument("--stubs", default=None, help="folder of stub modules for uninstallable third-party imports")
    ap.add_argument("--out", default="benchmarks/results", help="folder for the result files")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of: {', '.join(CONFIGS)} (default all)")
    ap.add_argument("--plant", default="", help="for the tests: plant one bug (" + ", ".join(PLANTS) + ")")
    ap.add_argument("--stem", default=None, help="result file stem (default <date>_miles_cpu_real-upstream)")
    args = ap.parse_args(argv)
    root = Path(args.miles_root)
    if not root.is_dir():
        raise UserError(f"--miles-root {args.miles_root}: no such folder; give the folder that holds upstream's miles/")
    missing = [str(p) for p in REQUIRED if not (root / p).is_file()]
    if missing:
        raise UserError(f"--miles-root {args.miles_root}: lacks {', '.join(missing)}; give a miles-diffusion tree")
    if REPO.resolve() in [root.resolve(), *root.resolve().parents]:
        raise UserError(f"--miles-root {args.miles_root}: inside this repository; upstream code stays outside it")
    stubs = Path(args.stubs) if args.stubs else None
    if stubs is not None and not stubs.is_dir():
        raise UserError(f"--stubs {args.stubs}: no such folder")
    names = pick("--configs", args.configs, CONFIGS)
    if args.plant:
        pick("--plant", args.plant, PLANTS)
    out = writable_dir("--out", args.out)
    stem = args.stem or result_stem("miles", "real-upstream", "cpu")
    if args.plant and not args.stem:
        stem += f"-planted-{args.plant}"
    free_targets("--out", out, [stem + ".json", stem + ".md"])

    import multiprocessing

    import diffusers
    import peft
    import torch

    from patches.core.runtime import free_port
    from patches.miles_table import SUPPORTED

    print(f"miles real upstream (CPU): {', '.join(names)} from {root}" + (f", planted {args.plant}" if args.plant else ""),
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        res_file = Path(tmp) / "rows.json"
        p = multiprocessing.get_context("spawn").Process(
            target=_worker, args=(str(root.resolve()), str(stubs.resolve()) if stubs else None, names, args.plant,
                                  str(res_file), free_port()))
        p.start()
        p.join()
        if p.exitcode != 0 or not res_file.is_file():
            print(f"error: the gloo rank exited with {p.exitcode} (see its traceback above); nothing written",
                  file=sys.stderr)
            return 1
        worker = json.loads(res_file.read_text())
    manifest = json.loads((root / MANIFEST).read_text()) if (root / MANIFEST).is_file() else {}
    rows = worker["rows"]
    result = {
        "date": stem[:10], "script": "benchmarks/upstream/miles_real_cpu.py", "device": "cpu",
        "cpu_cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "diffusers": diffusers.__version__, "peft": peft.__version__, "backend": "gloo", "world_size": 1,
        "preset": "tiny", "plant": args.plant, "patch_table_supported": SUPPORTED,
        "all_passed": all(all(r["checks"].values()) for r in rows), "rows": rows,
        "upstream_files": upstream_files(root), "upstream_absent": manifest.get("absent", {}),
        "miles_modules_imported": worker["miles_modules"], "stubbed_modules": _stub_names(stubs),
        "unpatched_shims": sorted({s for r in rows for s in r["unpatched_shims"]}),
    }
    md = _markdown(result)
    write_together({out / (stem + ".json"): json.dumps(result, indent=2) + "\n", out / (stem + ".md"): md})
    print(md)
    print(f"wrote {out / (stem + '.md')}")
    return 0 if result["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
