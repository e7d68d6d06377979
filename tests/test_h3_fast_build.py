""":func:`miles_ext.levers.fast_init.build_lora_fsdp` (the low-RAM init order shared by the trainer and
``benchmarks/h3_1gpu.py``) builds bitwise the model the trainer's ``_build_model`` order builds, spelled out step
by step here (meta build -> ``manual_seed`` -> ``attach_lora_materialised`` -> master dtype -> residency plan ->
``apply_fsdp2(exact_pin=True, resident=..., adapters_on_device=...)`` -> ``materialise(RandomInit(seed))``).

CPU, 1 gloo rank, tiny preset, LoRA rank 4, bf16 master, 1 of 4 blocks resident (the rest in the exact arena).
Planted bug: the same sequence seeded differently (the LoRA init drawn from another RNG state) is caught.
Also: every base parameter was on the meta device when sharding began, the plan callback saw the stored dtypes,
a LoRA target matching nothing is one ``UserError``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from miles_ext.recipe.presets import H3_LORA_TARGETS, build_transformer, meta_transformer
from tests.equivalence.h3_ranks import cpu_mesh, launch


def TINY_MODEL():
    return build_transformer("tiny", device="cpu")

SEED, RANK, ALPHA = 5, 4, 8


def _manual(seed: int):
    """The trainer's ``_build_model`` order, written out (no shared helper)."""
    from miles_ext.levers import fast_init
    from miles_ext.levers.fsdp_policy import apply_fsdp2, set_master_dtype

    model = meta_transformer("tiny")
    torch.manual_seed(seed)
    fast_init.attach_lora_materialised(model, rank=RANK, alpha=ALPHA, target_modules=H3_LORA_TARGETS)
    model.enable_gradient_checkpointing()
    model.train()
    set_master_dtype(model, "bf16")
    apply_fsdp2(model, cpu_offload=True, master_dtype="bf16", param_dtype=None, mesh=cpu_mesh(), exact_pin=True,
                resident=[1], adapters_on_device=True)
    fast_init.materialise(model, fast_init.RandomInit(SEED, draw_device="cpu"))
    return model


def _full(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _worker(rank: int, world: int, out_dir: str) -> None:
    from miles_ext.levers import fast_init
    from patches.core.errors import UserError

    seen = {}

    def plan(model):
        seen["dtypes"] = sorted({str(p.dtype) for n, p in model.named_parameters() if "lora_" not in n})
        seen["meta"] = all(p.is_meta for n, p in model.named_parameters() if "lora_" not in n)
        return [1]

    built = fast_init.build_lora_fsdp(TINY_MODEL, seed=SEED, lora=dict(rank=RANK, alpha=ALPHA, target_modules=H3_LORA_TARGETS),
                                      master_dtype="bf16",
                                      cpu_offload=True, source=fast_init.RandomInit(SEED, draw_device="cpu"),
                                      plan_resident=plan, mesh=cpu_mesh(), param_dtype=None)
    manual = _manual(SEED)
    res = {"shared": _full(built.model), "manual": _full(manual), "bug_seed": _full(_manual(SEED + 1)),
           "manual_arena": manual._onecard_pinned_report.requested_bytes,
           "resident": built.resident, "meta": built.meta_params_before_sharding, "tensors": built.report.tensors,
           "arena": built.model._onecard_pinned_report.requested_bytes, "seen": seen,
           "training": built.model.training,
           "times": (built.build_s, built.materialise_s)}
    try:
        fast_init.build_lora_fsdp(TINY_MODEL, seed=SEED, lora=dict(rank=RANK, alpha=ALPHA, target_modules=["nope"]),
                                  master_dtype="bf16", cpu_offload=True, mesh=cpu_mesh(), param_dtype=None)
        res["bad_target"] = None
    except UserError as e:
        res["bad_target"] = str(e)
    torch.save(res, Path(out_dir) / "build.pt")


def test_shared_build_equals_the_trainer_order_bitwise(tmp_path):
    launch(_worker, 1, str(tmp_path))
    res = torch.load(tmp_path / "build.pt", weights_only=False)
    shared, manual = res["shared"], res["manual"]
    assert shared.keys() == manual.keys() and any("lora_A" in k for k in shared)
    assert all(shared[k].dtype == manual[k].dtype and torch.equal(shared[k], manual[k]) for k in manual)
    assert {v.dtype for k, v in shared.items() if "lora_" not in k} == {torch.bfloat16, torch.float32}
    bug = [k for k in manual if not torch.equal(res["bug_seed"][k], manual[k])]  # planted: LoRA drawn from another seed
    assert bug and all("lora_A" in k for k in bug)
    assert res["resident"] == [1] and res["arena"] == res["manual_arena"] > 0  # same units offloaded (adapters not)
    assert res["meta"] == res["tensors"] > 0  # no base weight had storage before materialise
    assert res["seen"]["meta"] and "torch.bfloat16" in res["seen"]["dtypes"]  # plan counts the stored dtypes
    assert res["training"] and all(t >= 0 for t in res["times"])
    assert res["bad_target"] and "nope" in res["bad_target"]
