"""LoRA adapters on MiniMax-H3 with PEFT, as the miles-diffusion recipe attaches them (fp32, trainable).

Upstream (radixark/miles_diffusion's code): ``get_peft_model(model, LoraConfig(r, lora_alpha,
target_modules, init_lora_weights))`` (the H3 targets are the recipe's, ``miles_ext.recipe.presets.H3_LORA_TARGETS``); ``get_peft_model``'s default ``autocast_adapter_dtype=True`` upcasts adapters created on a
bf16 base to fp32, so the trainable parameters are uniformly fp32. The H3 recipe uses rank 64, alpha 128.

PEFT matches a target ``"attn.to_q"`` against every module whose name *ends with* ``.attn.to_q``, so the
token-refiner blocks (which have the same ``attn`` / ``ff`` layout) get adapters too, exactly as PEFT does
upstream with the same target list.

**One thing PEFT alone gets wrong for a 1-GPU port.** On a bf16 base, PEFT draws the adapter init in fp32, then
moves the adapter to the base layer's dtype (bf16 -- this *rounds* it) and only then upcasts it back to fp32.
So the same seed gives a different ``lora_A`` on a bf16 master than on the 8-GPU recipe's fp32 master. :func:`attach_lora` therefore replays PEFT's
initialisation on a zero-storage fp32 *shadow* of the target layers, with the same RNG state, and copies
those exact fp32 values into the real adapters: the adapters are then bitwise what an fp32 base would get,
whatever the master dtype. (The replay is checked: it must consume exactly the RNG that the real
injection consumed, else ``RuntimeError``.)
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["attach_lora", "lora_parameters", "matched_target_modules"]


def _init_arg(init_lora_weights: bool | str) -> bool | str:
    """Upstream's ``--lora-init-weights`` value -> PEFT's ``init_lora_weights`` ("kaiming-uniform" is ``True``)."""
    return True if init_lora_weights == "kaiming-uniform" else init_lora_weights


def _lora_config(rank: int, alpha: float, target_modules: Sequence[str], init_lora_weights: bool | str):
    from peft import LoraConfig

    return LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(target_modules), init_lora_weights=_init_arg(init_lora_weights)
    )


def matched_target_modules(model: nn.Module, target_modules: Sequence[str]) -> list[str]:
    """Names of the ``nn.Linear`` modules of ``model`` that PEFT would adapt for ``target_modules``
    (PEFT's own matcher: exact name or ``.``-suffix match), in ``named_modules`` order."""
    from peft.tuners.tuners_utils import check_target_module_exists

    config = _lora_config(1, 1, target_modules, False)
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and check_target_module_exists(config, name)
    ]


def _shadow(model: nn.Module, names: list[str]) -> nn.Module:
    """A module tree with the same names as ``model`` at ``names`` (same order), each an fp32 ``nn.Linear`` of the
    same shape whose weight is a stride-0 view of one zero: PEFT sees an fp32 CPU base and allocates nothing
    but the adapters."""
    root = nn.Module()
    modules = dict(model.named_modules())
    for name in names:
        real = modules[name]
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        lin = nn.Linear(1, 1, bias=False, device="meta")
        lin.in_features, lin.out_features = real.in_features, real.out_features
        lin.weight = nn.Parameter(
            torch.zeros((), dtype=torch.float32).expand(real.out_features, real.in_features), requires_grad=False
        )
        parent.add_module(leaf, lin)
    return root


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The LoRA adapter parameters of ``model`` by name (``...lora_A.default.weight`` / ``lora_B``)."""
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


def attach_lora(
    model: nn.Module,
    *,
    target_modules: Sequence[str],
    rank: int = 64,
    alpha: float = 128,
    init_lora_weights: bool | str = "gaussian",
    autocast_adapter_dtype: bool = True,
) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place and return ``model`` (the diffusers model, not a PeftModel).

    Only the adapters are left trainable (PEFT marks every base parameter ``requires_grad=False``). With
    ``autocast_adapter_dtype=True`` (PEFT's ``get_peft_model`` default, the recipe's setting) every adapter is
    fp32 and its initial values do not depend on the base dtype (see the module docstring). With ``False`` the
    adapters keep the base dtype (upstream's ``load_lora_adapter`` path: bf16 adapters on a bf16 base).

    Args:
        model: a ``MiniMaxH3Transformer3DModel`` (any ``nn.Module`` works); its base dtype may be fp32 or bf16.
        rank: LoRA rank ``r`` (recipe: 64).
        alpha: ``lora_alpha``; the adapter output is scaled by ``alpha / rank`` (recipe: 128, i.e. 2.0).
        target_modules: PEFT target names (the H3 recipe's: ``miles_ext.recipe.presets.H3_LORA_TARGETS``).
        init_lora_weights: upstream ``--lora-init-weights``: ``"gaussian"`` (default: A ~ N(0, 1/r), B = 0),
            ``"kaiming-uniform"`` / ``True`` (PEFT default), ``False``, or any PEFT init name.
        autocast_adapter_dtype: upcast bf16/fp16 adapters to fp32 (PEFT's flag).

    Raises:
        ValueError: ``target_modules`` matches no ``nn.Linear`` in ``model`` (message names the fix), or
            ``rank < 1``.
    """
    from peft import get_peft_model

    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    names = matched_target_modules(model, target_modules)
    if not names:
        example = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:4]
        raise ValueError(
            f"LoRA target_modules {list(target_modules)} match no nn.Linear in {type(model).__name__}; "
            f"pass names (or '.'-suffixes) of its linear layers, e.g. {example}"
        )
    config = _lora_config(rank, alpha, target_modules, init_lora_weights)
    modules = dict(model.named_modules())
    needs_replay = autocast_adapter_dtype and any(modules[n].weight.dtype != torch.float32 for n in names)

    rng_before = torch.get_rng_state()
    get_peft_model(model, config, autocast_adapter_dtype=autocast_adapter_dtype)
    if needs_replay:
        rng_after = torch.get_rng_state()
        torch.set_rng_state(rng_before)
        shadow = _shadow(model, names)
        get_peft_model(shadow, _lora_config(rank, alpha, target_modules, init_lora_weights))
        if not torch.equal(torch.get_rng_state(), rng_after):
            raise RuntimeError("fp32 LoRA init replay drew a different amount of randomness than PEFT; cannot "
                               "guarantee master-dtype-independent adapters")
        real = lora_parameters(model)
        for name, value in lora_parameters(shadow).items():
            with torch.no_grad():
                real[name].copy_(value.to(real[name].device))
    for p in lora_parameters(model).values():
        if autocast_adapter_dtype and p.dtype != torch.float32:
            raise RuntimeError(f"LoRA adapter is {p.dtype} after PEFT autocast; expected float32")
        p.requires_grad_(True)
    return model
