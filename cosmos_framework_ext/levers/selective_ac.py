"""Selective activation checkpointing: each decoder layer is recomputed in the backward pass, except the outputs of
the ops named by ``[model.activation_checkpointing] save_ops_regex``, which are kept from the forward.

``mode = "full"`` (diffusers' ``enable_gradient_checkpointing``) recomputes the whole layer, attention included, in
the backward pass. ``mode = "selective"`` checkpoints the same layers with PyTorch's selective checkpointing
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``): an op whose name (``str(op)``, e.g.
``"flex_attention"``, ``"aten._scaled_dot_product_efficient_attention.default"``, ``"aten.mm.default"``) matches one
of the regexes is ``MUST_SAVE``, every other op ``PREFER_RECOMPUTE`` (torchtitan's policy). Upstream
cosmos-framework names its kept ops the same way (its default ``["fmha"]`` for its fused attention kernels); the
embedded trainer's attention ops are ``flex_attention``, ``scaled_dot_product`` and (variable-length)
``aten._flash_attention_forward``, so the recipes list those.

The checkpoint is put *inside* each layer's forward, so with ``[model.compile]`` on the compiled region holds the
checkpoint and the policy, and the partitioner sees them (the way upstream and torchtitan order AC and compile);
``mode = "full"`` checkpoints the compiled layer from outside. The math is unchanged: the same ops on the same
inputs; only which forward values are kept rather than recomputed. ``tests/equivalence/test_selective_ac.py``
proves the gradients bitwise equal to ``mode = "full"`` (tiny preset, fp32, CPU, eager and compiled with
``aot_eager``) and counts that the kept attention is not run again in the backward pass.

Memory: the kept outputs stay alive from the forward to the backward of their layer: for the attention ops, per
layer, ``tokens x heads x head_dim`` values in the compute dtype plus the log-sum-exp (``tokens x heads`` fp32)
that flex_attention returns beside them (the ledger counts this: :func:`kept_attention_bytes`).

**Fewer checkpointed layers** (``[onecard] checkpoint_layers``, Megatron-LM's "block" recompute method): only the
first ``n`` decoder layers are checkpointed (selectively, or fully with ``save_ops_regex=None``); the other layers
keep every activation their backward needs and recompute nothing. The same ops on the same inputs again:
``tests/equivalence/test_checkpoint_layers.py`` proves the gradients bitwise equal to every layer checkpointed (CPU,
eager and ``aot_eager``). ``"auto"`` (:func:`cosmos_framework_ext.recipe.ledger.resolve_checkpoint_layers`) picks the
smallest ``n`` whose memory ledger fits the card.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["ATTENTION_OPS", "apply_selective_checkpointing", "kept_attention_bytes", "repeated_blocks", "save_policy"]

ATTENTION_OPS = ("flex_attention", "scaled_dot_product", "flash_attention")
"""Regexes that match the embedded trainer's attention ops (block-sparse, dense and variable-length)."""


def save_policy(save_ops_regex: Sequence[str]):
    """The selective-checkpoint policy: ``MUST_SAVE`` for an op whose ``str(op)`` matches one of
    ``save_ops_regex`` (``re.search``), else ``PREFER_RECOMPUTE``.

    Raises:
        ValueError: a pattern that is not a valid regular expression (names it).
    """
    pats = []
    for p in save_ops_regex:
        try:
            pats.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"save_ops_regex {p!r} is not a regular expression ({e})") from None

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = str(op)
        return CheckpointPolicy.MUST_SAVE if any(p.search(name) for p in pats) else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` whose class ``model._repeated_blocks`` names (the decoder layers), in module order.

    Raises:
        ValueError: ``model`` declares no repeated blocks.
    """
    names = set(getattr(model, "_repeated_blocks", ()))
    if not names:
        raise ValueError(f"{type(model).__name__} declares no _repeated_blocks to checkpoint")
    return [m for m in model.modules() if type(m).__name__ in names]


def apply_selective_checkpointing(model: torch.nn.Module, save_ops_regex: Sequence[str] | None, *,
                                  preserve_rng_state: bool = True, determinism_check: str = "default",
                                  layers: int | None = None, skip: int = 0) -> int:
    """Checkpoint the repeated blocks of ``model`` (``model._repeated_blocks``) selectively; returns how many.

    Call before :func:`~cosmos_framework_ext.levers.compile_blocks.compile_blocks` and instead of
    ``enable_gradient_checkpointing`` (which is turned off here: the layers are called directly and checkpoint
    themselves). Each checkpointed block's ``forward`` becomes ``checkpoint(forward, ..., use_reentrant=False,
    context_fn=<selective contexts of save_policy(save_ops_regex)>)``; ``save_ops_regex=None`` checkpoints the whole
    block (no policy: everything recomputed, as ``mode = "full"``).

    Args:
        layers: checkpoint only the first ``layers`` blocks (``None``: all); the others keep their activations.
        skip: of those, leave the first ``skip`` unchecked (the offloaded layers, which keep their activations on
            the host: :mod:`~cosmos_framework_ext.levers.activation_offload`); returns ``layers - skip`` then.

    Raises:
        ValueError: ``model`` has no repeated blocks, a pattern is not a regular expression, ``layers`` is
            negative or above the number of blocks, or ``skip`` is negative or above ``layers``.
    """
    blocks = repeated_blocks(model)
    if layers is not None and not 0 <= layers <= len(blocks):
        raise ValueError(f"checkpoint layers {layers} must be in [0, {len(blocks)}] (the model's decoder layers)")
    top = len(blocks) if layers is None else layers
    if not 0 <= skip <= top:
        raise ValueError(f"offloaded layers {skip} must be in [0, {top}] (the layers that would be checkpointed)")
    context_fn = (functools.partial(create_selective_checkpoint_contexts, save_policy(save_ops_regex))
                  if save_ops_regex is not None else None)
    if getattr(model, "gradient_checkpointing", False) or any(getattr(m, "gradient_checkpointing", False)
                                                              for m in model.modules()):
        model.disable_gradient_checkpointing()
    extra = {} if context_fn is None else {"context_fn": context_fn}
    chosen = blocks[skip:top]
    for m in chosen:
        inner = m.forward

        def forward(*args: Any, _inner=inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                              determinism_check=determinism_check, **extra, **kwargs)

        m.forward = forward
    return len(chosen)


def kept_attention_bytes(tokens: int, layers: int, heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes the attention ops' kept outputs hold at the peak (all layers' forward done, before the backward):
    per layer ``tokens x heads x head_dim x dtype_bytes`` for the output plus ``tokens x heads x 4`` for its fp32
    log-sum-exp."""
    return layers * tokens * heads * (head_dim * dtype_bytes + 4)
