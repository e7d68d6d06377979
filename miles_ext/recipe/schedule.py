"""The 8-GPU miles-diffusion batch schedule replayed on fewer GPUs by gradient accumulation.

Semantics (radixark/miles_diffusion's code):

- ``global_batch_size = rollout_batch_size * n_samples_per_prompt // num_steps_per_rollout`` (no world-size
  term); ``global_batch_size % dp_size == 0``; ``--micro-batch-size`` and ``--n-samples-per-prompt`` default 1.
- DP split: contiguous, ``train_data[r*k:(r+1)*k]``; per rank, contiguous windows of
  ``num_local_pairs / num_steps_per_rollout`` pairs per optimizer step, cut into ``micro_batch_size`` chunks;
  no ragged last micro-batch.
- Each rank backprops ``loss_sum / num_local_pairs`` per micro-batch; FSDP2 averages over ranks.
- ``prepare_sft_batch`` seeds with ``stable_hash("sample", seed, rollout_id, microbatch_id, dp_rank)``,
  ``microbatch_id`` a per-rank counter over the rollout's micro-batches.

:func:`pair_schedule` orders the M-GPU run's micro-batches so that micro-batch *j* of each step trains the pairs rank
*j* of the N-GPU run trains, drawn with that rank's seed identity.
"""

from __future__ import annotations

import dataclasses

from miles_ext.recipe.meanings import MAX_ROLLOUT_SAMPLES

__all__ = ["MicroBatchSlot", "derive_batch", "pair_schedule"]


# ------------------------------------------------------------------------------------- batch schedule
@dataclasses.dataclass(frozen=True)
class MicroBatchSlot:
    """One micro-batch: which pairs it trains and the seed identity of its draws."""

    step: int
    """Optimizer step within the rollout (0-based)."""
    index: int
    """Position within that step on the rank that runs it (accumulation order)."""
    pairs: tuple[int, ...]
    """Indices into the rollout's train pairs (``0 .. global_batch * num_steps - 1``)."""
    rollout_id: int
    """Rollout the pairs come from (first part of the seed identity)."""
    microbatch_id: int
    """Per-rank counter over the rollout's micro-batches, from 0, *on the rank of the N-GPU run that trains
    these pairs*."""
    dp_rank: int
    """That rank."""

    @property
    def seed_identity(self) -> tuple[int, int, int]:
        """``(rollout_id, microbatch_id, dp_rank)``: with the run seed, what ``stable_hash("sample", ...)`` hashes."""
        return (self.rollout_id, self.microbatch_id, self.dp_rank)


def derive_batch(
    rollout_batch_size: int,
    dp_size: int,
    *,
    n_samples_per_prompt: int = 1,
    num_steps_per_rollout: int | None = None,
    global_batch_size: int | None = None,
) -> tuple[int, int]:
    """Upstream's batch-size derivation (S1 ``miles/utils/arguments.py``) -> ``(global_batch_size, num_steps)``.

    If ``num_steps_per_rollout`` is set, ``gbs = rollout_batch_size * n_samples_per_prompt // num_steps`` and an
    explicit ``global_batch_size`` must agree; ``gbs`` must be divisible by ``dp_size``; an unset ``gbs``
    defaults to ``dp_size``; an unset ``num_steps`` is then ``rollout samples // gbs``. Stricter than upstream,
    which floors: the rollout's samples must split exactly into optimizer steps (else pairs are dropped). A rollout
    of more than :data:`miles_ext.recipe.meanings.MAX_ROLLOUT_SAMPLES` samples is refused.

    Raises ``ValueError`` naming the violated rule.
    """
    samples = rollout_batch_size * n_samples_per_prompt
    if min(rollout_batch_size, n_samples_per_prompt, dp_size) < 1:
        raise ValueError("rollout batch size, samples per prompt and dp size must be >= 1")
    if samples > MAX_ROLLOUT_SAMPLES:
        raise ValueError(
            f"rollout_batch_size {rollout_batch_size} x n_samples_per_prompt {n_samples_per_prompt} = {samples} "
            f"samples a rollout is more than {MAX_ROLLOUT_SAMPLES} (2**20, about a million forwards a rollout; the "
            "schedule is held in host memory): use a smaller rollout and more rollouts"
        )
    if num_steps_per_rollout is not None:
        if num_steps_per_rollout < 1 or samples % num_steps_per_rollout:
            raise ValueError(
                f"rollout_batch_size x n_samples_per_prompt = {samples} is not divisible by "
                f"num_steps_per_rollout = {num_steps_per_rollout}; pick a divisor"
            )
        gbs = samples // num_steps_per_rollout
        if global_batch_size is not None and global_batch_size != gbs:
            raise ValueError(
                f"--global-batch-size {global_batch_size} contradicts rollout_batch_size x n_samples_per_prompt / "
                f"num_steps_per_rollout = {gbs}; drop one of them"
            )
    else:
        gbs = global_batch_size if global_batch_size is not None else dp_size
    if gbs < 1 or gbs % dp_size:
        raise ValueError(f"global batch {gbs} is not divisible by the GPU count {dp_size}")
    if samples % gbs:
        raise ValueError(f"rollout samples {samples} are not a multiple of the global batch {gbs}")
    return gbs, samples // gbs


def check_schedule(global_batch: int, gpus: int, num_steps: int, micro_batch_size: int) -> int:
    if min(global_batch, gpus, num_steps, micro_batch_size) < 1:
        raise ValueError("global batch, GPU count, steps and micro-batch size must all be >= 1")
    if global_batch % gpus:
        raise ValueError(f"global batch {global_batch} is not divisible by the GPU count {gpus}")
    per_rank = global_batch // gpus
    if per_rank % micro_batch_size:
        raise ValueError(
            f"{per_rank} pairs per rank per step do not split into micro-batches of {micro_batch_size} "
            "(a ragged last micro-batch is forbidden upstream)"
        )
    return per_rank


def pair_schedule(
    global_batch: int,
    from_gpus: int,
    num_steps: int,
    micro_batch_size: int,
    *,
    rollout_id: int = 0,
) -> list[list[MicroBatchSlot]]:
    """The 1-GPU schedule that trains exactly what a ``from_gpus``-GPU run trains, per optimizer step.

    Step ``s`` accumulates ``global_batch / micro_batch_size`` micro-batches, ordered by source rank ``j`` then
    by that rank's local index ``i``. Micro-batch ``(j, i)`` trains pairs
    ``j*k + s*b + i*m .. + m`` (``b = global_batch / from_gpus`` pairs per rank per step, ``k = b * num_steps``
    pairs per rank per rollout, ``m = micro_batch_size``) -- rank ``j``'s pairs under the contiguous DP split --
    and draws with ``microbatch_id = s * (b / m) + i`` and ``dp_rank = j``, i.e. ``stable_hash("sample", seed,
    rollout_id, microbatch_id, j)``, exactly rank ``j``'s draws. ``MicroBatchSlot.index`` is the position in the
    1-GPU step. Raises ``ValueError`` as :func:`rank_schedule`.
    """
    b = check_schedule(global_batch, from_gpus, num_steps, micro_batch_size)
    k = b * num_steps
    per_rank_mb = b // micro_batch_size
    steps = []
    for s in range(num_steps):
        step = []
        for j in range(from_gpus):
            for i in range(per_rank_mb):
                lo = j * k + s * b + i * micro_batch_size
                pairs = tuple(range(lo, lo + micro_batch_size))
                step.append(MicroBatchSlot(s, len(step), pairs, rollout_id, s * per_rank_mb + i, j))
        steps.append(step)
    return steps
