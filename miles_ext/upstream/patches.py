"""Implementations of the miles-diffusion patch table (:mod:`patches.miles_table`), for one GPU.

Each ``patched_*`` is a factory: it receives upstream's original function and returns the replacement, which
:class:`patches.guard.PatchSet` installs after checking the target's signature.

- :func:`patched_apply_fsdp2` (``MILES_ONECARD_FSDP``): upstream's ``apply_fsdp2`` contract (wrap
  ``parallel_plan.no_split_modules`` blocks, then the root; ``MixedPrecisionPolicy(param_dtype=
  args.diffusion_forward_dtype, reduce_dtype=args.fsdp_reduce_dtype, cast_forward_inputs=False)``;
  ``CPUOffloadPolicy`` under ``cpu_offload``) done by :func:`miles_ext.levers.fsdp_policy.apply_fsdp2` with the 1-GPU
  levers: offloaded shards in one exact-size pinned arena (:mod:`miles_ext.levers.pinned`), LoRA adapters in units of
  their own, and with ``MILES_RESIDENT_BLOCKS`` partial residency (:mod:`miles_ext.levers.residency`: N blocks and the
  root on the GPU, adapters + grads + AdamW state on the GPU, the other blocks streamed). A plan with
  ``param_dtype_patterns`` (Wan2.2's fp32 norms; H3's plan has none) is refused by name: upstream's own
  param-dtype monkeypatch is gated on torch 2.11.0 and would not see these units.
- :func:`patched_broadcast_full_state` (``MILES_ONECARD_FSDP``): at world size 1 the full state is copied straight
  into each parameter's shard where it lives (the pinned arena or the GPU), buffers go to the GPU; nothing else
  moves, so the whole model is never on the GPU at once and nothing is re-pinned. Several ranks: upstream's own.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch

from patches.core.errors import UserError
from patches.core.runtime import GiB, to_local

__all__ = ["patched_apply_fsdp2", "patched_broadcast_full_state", "resident_indices"]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
           "fp16": torch.float16, "float16": torch.float16}


def _dtype(value: Any, flag: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise UserError(f"{flag} {value!r}: onecard's FSDP application knows {sorted(_DTYPES)}") from None


def _one_rank(what: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() != 1:
        raise UserError(f"{what} is for one GPU, this run has {dist.get_world_size()} ranks: unset MILES_ONECARD_FSDP "
                        "for a multi-GPU run")


def resident_indices(model: torch.nn.Module, no_split: list[str], value: str, environ=None) -> list[int] | None:
    """The resident blocks for ``MILES_RESIDENT_BLOCKS`` = ``value``, from the one resolver
    (:func:`miles_ext.levers.residency.resolve_residency`): ``auto`` fills ``$MILES_GPU_BUDGET_GIB``, else
    ``ONECARD_GPU_MEMORY_GIB``, else the card, for :data:`~miles_ext.levers.residency.DEFAULT_PLAN_TOKENS` rows (upstream
    applies FSDP before any batch exists), and prints the plan.

    Raises:
        UserError: a count above the model's blocks, a bad ``MILES_GPU_BUDGET_GIB`` (a :class:`FlagError`), or
            ``auto`` with neither a GPU nor a budget.
    """
    from miles_ext.levers.residency import DEFAULT_PLAN_TOKENS, resolve_residency
    from patches.core.device import gpu_budget_bytes
    from patches.core.flags import miles_gpu_budget_gib

    env = environ if environ is not None else os.environ
    gib = miles_gpu_budget_gib(env)
    if gib is not None:
        budget = int(gib * GiB)
    else:
        budget = gpu_budget_bytes(torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                                  else torch.device("cpu")) or None
    res = resolve_residency(model, value, source="MILES_RESIDENT_BLOCKS", budget_bytes=budget, tokens=DEFAULT_PLAN_TOKENS,
                  no_split_modules=no_split, say=lambda line: print(line, flush=True))
    return res.indices


def patched_apply_fsdp2(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``miles.backends.fsdp_utils.model_loader.apply_fsdp2`` (see the module docstring)."""

    def apply_fsdp2(model, parallel_plan, mesh=None, cpu_offload=False, args=None):
        from miles_ext.levers.fsdp_policy import apply_fsdp2 as onecard_apply
        from patches.core.flags import MILES_RESIDENT_BLOCKS

        _one_rank("MILES_ONECARD_FSDP")
        if getattr(parallel_plan, "param_dtype_patterns", None):
            raise UserError("this model's FSDP plan has param_dtype_patterns, which onecard's FSDP application does "
                            "not carry: unset MILES_ONECARD_FSDP for this model")
        no_split = list(parallel_plan.no_split_modules or ())
        value = MILES_RESIDENT_BLOCKS.value()
        resident = None
        if value and cpu_offload:
            try:
                resident = resident_indices(model, no_split, str(value))
            except UserError as e:  # inside a Ray actor the traceback buries it: print the one line first
                print(f"error: {e}", file=sys.stderr, flush=True)
                raise
        onecard_apply(
            model, cpu_offload=bool(cpu_offload), mesh=mesh,
            param_dtype=_dtype(getattr(args, "diffusion_forward_dtype", "bf16"), "--diffusion-forward-dtype"),
            reduce_dtype=_dtype(getattr(args, "fsdp_reduce_dtype", "fp32"), "--fsdp-reduce-dtype"),
            resident=resident, adapters_on_device=resident is not None, exact_pin=True, no_split_modules=no_split,
        )
        return model

    return apply_fsdp2


def patched_broadcast_full_state(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``miles.backends.fsdp_utils.checkpoint.broadcast_full_state_to_fsdp`` (module docstring)."""

    def broadcast_full_state_to_fsdp(model, full_state, *, cpu_offload):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() != 1:
            return original(model, full_state, cpu_offload=cpu_offload)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        current = model.state_dict()
        missing = sorted(set(current) - set(full_state))
        if missing:
            raise UserError(f"the initial state lacks {len(missing)} of the model's entries (e.g. {missing[:3]})")
        with torch.no_grad():
            for name, dst in current.items():
                src = full_state[name]
                local = to_local(dst)
                if src.is_meta:
                    raise UserError(f"{name}: the initial state is on the meta device; onecard's state load copies "
                                    "real tensors only")
                local.copy_(src.reshape(local.shape) if src.numel() == local.numel() else src[: local.shape[0]])
            for module in model.modules():
                for key, buf in list(module._buffers.items()):
                    if buf is not None and buf.device != device:
                        module._buffers[key] = buf.to(device)

    return broadcast_full_state_to_fsdp
