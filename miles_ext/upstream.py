"""Implementations of the miles-diffusion patch table (:mod:`patches.miles_table`), for one GPU.

Each ``patched_*`` is a factory: it receives upstream's original function and returns the replacement, which
:class:`patches.guard.PatchSet` installs after checking the target's signature.

- :func:`patched_apply_fsdp2` (``MILES_ONECARD_FSDP``): upstream's ``apply_fsdp2`` contract (wrap
  ``parallel_plan.no_split_modules`` blocks, then the root; ``MixedPrecisionPolicy(param_dtype=
  args.diffusion_forward_dtype, reduce_dtype=args.fsdp_reduce_dtype, cast_forward_inputs=False)``;
  ``CPUOffloadPolicy`` under ``cpu_offload``) done by :func:`miles_ext.fsdp_policy.apply_fsdp2` with the 1-GPU
  levers: offloaded shards in one exact-size pinned arena (:mod:`miles_ext.pinned`), LoRA adapters in units of
  their own, and with ``MILES_RESIDENT_BLOCKS`` partial residency (:mod:`miles_ext.residency`: N blocks and the
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

__all__ = ["patched_apply_fsdp2", "patched_broadcast_full_state", "resident_count"]

PLAN_TOKENS = 16384
"""Packed rows per micro-batch that ``MILES_RESIDENT_BLOCKS=auto`` plans activations for (81 x 480 x 832 video is
~8.2 k rows plus text and audio; double that for headroom)."""

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


def resident_count(model: torch.nn.Module, no_split: list[str], value: str, environ=None) -> int:
    """N for ``MILES_RESIDENT_BLOCKS`` = ``value`` (``auto`` or a number): ``auto`` plans with the memory model
    (:func:`miles_ext.residency.plan_resident_blocks`) for ``$MILES_GPU_BUDGET_GIB`` (default: the card's total
    memory) and :data:`PLAN_TOKENS`, and prints the plan.

    Raises:
        UserError: a number above the model's block count (one line naming ``MILES_RESIDENT_BLOCKS`` and the count;
            only checkable once the model is known), a bad ``MILES_GPU_BUDGET_GIB`` (a :class:`FlagError`), or
            ``auto`` with neither a GPU nor a budget.
    """
    from miles_ext.residency import block_bytes, plan_resident_blocks
    from patches.core.flags import MILES_GPU_BUDGET_GIB, miles_gpu_budget_gib

    env = environ if environ is not None else os.environ
    sizes, root, adapters = block_bytes(model, no_split)
    if value != "auto":
        n = int(value)
        if n > len(sizes):
            raise UserError(f"MILES_RESIDENT_BLOCKS={n} but this model has {len(sizes)} FSDP blocks "
                            f"({', '.join(no_split)}): set MILES_RESIDENT_BLOCKS to at most {len(sizes)}, or auto")
        return n
    gib = miles_gpu_budget_gib(env)
    try:
        budget = gib * GiB if gib is not None else float(torch.cuda.get_device_properties(0).total_memory)
    except (AssertionError, RuntimeError):
        raise UserError(f"MILES_RESIDENT_BLOCKS=auto without a GPU: set {MILES_GPU_BUDGET_GIB}") from None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(base, "config", None)
    hidden = int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "num_attention_heads", 1) * getattr(
        cfg, "attention_head_dim", 1))
    ffn = int(getattr(cfg, "ffn_dim", 4 * hidden) or 4 * hidden)
    plan = plan_resident_blocks(sizes, root, adapters, budget_bytes=int(budget), tokens=PLAN_TOKENS, hidden=hidden,
                                ffn_dim=ffn)
    print(f"onecard: {plan.line()}", flush=True)
    return plan.resident_blocks


def patched_apply_fsdp2(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement for ``miles.backends.fsdp_utils.model_loader.apply_fsdp2`` (see the module docstring)."""

    def apply_fsdp2(model, parallel_plan, mesh=None, cpu_offload=False, args=None):
        from miles_ext.fsdp_policy import apply_fsdp2 as onecard_apply
        from miles_ext.residency import select_resident
        from patches.core.flags import MILES_RESIDENT_BLOCKS

        _one_rank("MILES_ONECARD_FSDP")
        if getattr(parallel_plan, "param_dtype_patterns", None):
            raise UserError("this model's FSDP plan has param_dtype_patterns, which onecard's FSDP application does "
                            "not carry: unset MILES_ONECARD_FSDP for this model")
        no_split = list(parallel_plan.no_split_modules or ())
        value = MILES_RESIDENT_BLOCKS.value()
        resident = None
        if value and cpu_offload:
            blocks = sum(1 for m in model.modules() if type(m).__name__ in set(no_split))
            try:
                resident = select_resident(blocks, resident_count(model, no_split, str(value)))
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
