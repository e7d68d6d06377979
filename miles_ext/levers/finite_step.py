"""Non-finite losses and gradients in the H3 LoRA step: the optimizer step is **skipped**, on every rank at once.

The fault this closes: one NaN/inf element in one adapter gradient made the global norm NaN, the clip scaled every
gradient by ``max_norm / NaN``, AdamW wrote NaN into every adapter within a step or two, and the checkpoint saved
them, with no message.

The rule (:class:`NonFiniteGuard`): after an optimizer step's micro-batches have been backpropagated, the step is
taken only if

- every micro-batch's ``loss_sum``, on every rank, is finite, and
- the global gradient norm (:func:`miles_ext.levers.fsdp_policy.clip_offloaded_grad_norm`, already summed over the FSDP
  shards) is finite. Any NaN/inf gradient element makes that norm NaN/inf, so the test is exact for non-finite
  elements; a norm whose square sum overflows fp32 (elements beyond ~1.8e19) also counts as non-finite.

Otherwise the gradients are dropped (``zero_grad(set_to_none=True)``) and ``optimizer.step()`` is not called: the
adapters and AdamW's moments and step counts stay bitwise what they were, so a skipped step is exactly a step that
did not happen (the next step is the one the run would have taken without the bad batch). One line says so on
stdout (``onecard: optimizer step N skipped: ...``), the run summary counts it (``nonfinite_skipped_steps`` and one
record per skip), and after ``max_consecutive`` skips in a row the run stops with :class:`NonFiniteTraining`
(upstream Cosmos' ``SkipNaNStep`` stops after 100).

Multi-rank: the decision is one ``all_reduce(MAX)`` (:func:`patches.core.runtime.agree_max`) of a 0/1 flag (this
rank saw a non-finite loss or norm) over the default process group, on the norm's device (gloo for host gradients,
as the clip's own reduction), so every rank takes the same decision and no collective is left unmatched. Every rank still runs every backward, bad or
not, for the same reason.

Why a skip and not the Cosmos path's ``force_finite`` (upstream ``GradClip``: ``nan_to_num`` every gradient, re-measure,
clip, step): AdamW still steps on the zeroed entries, moving the adapters by their old moments and advancing the step
count; a non-finite loss makes nearly every gradient NaN, so the step becomes one of stale momentum alone, which is
why upstream needs a second callback (``SkipNaNStep``, which only acts when every rank's loss is NaN) for that case.
The skip is one rule for both causes and leaves the optimizer state exact.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from patches.core.runtime import agree_max

__all__ = ["NonFiniteGuard", "NonFiniteTraining", "DEFAULT_MAX_CONSECUTIVE_SKIPS", "require_finite"]

DEFAULT_MAX_CONSECUTIVE_SKIPS = 100
"""Skipped optimizer steps in a row after which the run stops (upstream Cosmos ``SkipNaNStep.max_consecutive_nan``)."""


class NonFiniteTraining(RuntimeError):
    """Training cannot go on: too many non-finite steps in a row, or non-finite adapters about to be saved."""


def _print(line: str) -> None:
    print(line, flush=True)


@dataclasses.dataclass
class NonFiniteGuard:
    """Decides, per optimizer step, whether to take it (see the module docstring) and keeps the count."""

    max_consecutive: int = DEFAULT_MAX_CONSECUTIVE_SKIPS
    """Stop (:class:`NonFiniteTraining`) after this many skipped steps in a row; 0: never stop."""
    say: Callable[[str], None] = _print
    """Where the one-line skip message goes (the trainer passes its progress-bar-safe printer)."""
    steps_seen: int = 0
    """Optimizer steps decided so far."""
    skipped_steps: int = 0
    """Optimizer steps skipped so far."""
    consecutive: int = 0
    """Skipped steps since the last step taken."""
    skips: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """One record per skip: ``step`` (0-based index among the steps this guard decided), ``nonfinite_losses``
    (this rank's micro-batches with a non-finite ``loss_sum``), ``grad_norm`` (the global norm, a float; NaN/inf
    when that was the cause), ``other_ranks`` (True when only another rank saw the fault)."""

    def take_step(self, micro_losses: Sequence[float], grad_norm: torch.Tensor | float | None) -> bool:
        """True: take the optimizer step; False: skip it (logged and counted here). Same answer on every rank.

        Args:
            micro_losses: this rank's ``loss_sum`` per micro-batch of the step (floats).
            grad_norm: the global gradient norm (0-d tensor on the gradients' device, as the clip returns it), or
                ``None`` when no gradient exists.

        Raises:
            NonFiniteTraining: this skip is the ``max_consecutive``-th in a row.
        """
        bad_losses = sum(1 for v in micro_losses if not math.isfinite(v))
        norm = float(grad_norm) if grad_norm is not None else 0.0
        self.last_grad_norm = norm
        local_bad = bad_losses > 0 or not math.isfinite(norm)
        device = grad_norm.device if isinstance(grad_norm, torch.Tensor) else torch.device("cpu")
        any_bad = agree_max(int(local_bad), device) > 0  # every rank takes the same decision
        step = self.steps_seen
        self.steps_seen += 1
        if not any_bad:
            self.consecutive = 0
            return True
        self.skipped_steps += 1
        self.consecutive += 1
        self.skips.append({"step": step, "nonfinite_losses": bad_losses, "grad_norm": norm,
                           "other_ranks": not local_bad})
        cause = (f"non-finite loss in {bad_losses} of {len(micro_losses)} micro-batches" if bad_losses
                 else f"gradient norm {norm}" if not math.isfinite(norm) else "a non-finite loss or gradient on another rank")
        self.say(f"onecard: optimizer step {step} skipped: {cause}; adapters and AdamW state unchanged "
                 f"({self.skipped_steps} skipped so far, {self.consecutive} in a row)")
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise NonFiniteTraining(
                f"{self.consecutive} optimizer steps in a row had a non-finite loss or gradient and were skipped: "
                "training is diverging or the data is broken; lower --lr, check the dataset, or resume from an "
                "earlier checkpoint")
        return False

    def summary(self) -> dict[str, Any]:
        """``{"nonfinite_skipped_steps": int, "nonfinite_skips": [record, ...]}`` for the run summary."""
        return {"nonfinite_skipped_steps": self.skipped_steps, "nonfinite_skips": list(self.skips)}


def guarded_optimizer_step(
    optimizer: torch.optim.Optimizer,
    micro_losses: Sequence[float],
    max_grad_norm: float | None,
    guard: NonFiniteGuard,
) -> bool:
    """Clip, then ``optimizer.step()`` if ``guard`` says so; gradients are zeroed (``set_to_none``) either way.

    The norm is :func:`miles_ext.levers.fsdp_policy.clip_offloaded_grad_norm`'s (``max_grad_norm=None``: measured with
    ``max_norm=inf``, i.e. scaled by 1). Returns True when the step was taken.
    """
    from miles_ext.levers.fsdp_policy import clip_offloaded_grad_norm

    params = [p for group in optimizer.param_groups for p in group["params"]]
    has_grad = any(p.grad is not None for p in params)
    norm = clip_offloaded_grad_norm(params, math.inf if max_grad_norm is None else max_grad_norm) if has_grad else None
    take = guard.take_step(micro_losses, norm)
    if take:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return take


SAVE_FIX = "refusing to save it (the run should have skipped the step that caused it: please report this)"
"""What :func:`require_finite` says by default (a trainer about to save)."""


def require_finite(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], what: str, *,
                   fix: str = SAVE_FIX, error: type[Exception] = NonFiniteTraining) -> None:
    """Raise ``error`` (default :class:`NonFiniteTraining`) naming the first tensor of ``tensors`` with a NaN/inf
    element: ``"<what>: <name> holds NaN/inf values; <fix>"`` (before a save, or before an export)."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    for name, t in items:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise error(f"{what}: {name} holds NaN/inf values; {fix}")
