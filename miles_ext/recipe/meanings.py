"""What the H3 LoRA SFT recipe's numbers may mean: one definition for the trainer's flags
(:class:`miles_ext.recipe.train.H3SFTConfig`), the upstream flags the translator reads
(:mod:`miles_ext.recipe.translate`) and the checkpoint metadata the exporter reads (:mod:`miles_ext.recipe.export_lora`).

Light on purpose (no torch): the translator imports it.

The bounds and why:

- ``--lr`` in ``(0, 1]``: AdamW moves each weight by about ``lr`` a step, whatever the gradient's scale, so above 1 a
  single step is larger than the weights themselves (the recipe's is 1e-4);
- ``--lora-rank`` in ``[1, 2**16]``: a LoRA delta ``B A`` has rank at most ``min(in, out)`` of its layer, and no H3
  linear layer is 2**16 wide (the full model's widest LoRA target is 28,672); the trainer also checks the rank against
  the preset's own layers (a rank above a layer's width adds parameters and memory, no capacity);
- ``--lora-alpha`` in ``(0, 1e6]``, and the adapter step ``(alpha / rank) x lr <= 1`` (:func:`adapter_step_problem`):
  the adapter output is scaled by ``alpha / rank`` and AdamW moves ``lora_B`` by about ``lr`` a step, so the adapted
  weights move by about ``(alpha / rank) x lr`` a step: above 1 is the ``lr > 1`` case for them (the recipe's is
  128 / 64 x 1e-4 = 2e-4);
- the rollout's samples (``rollout_batch_size x n_samples_per_prompt``) at most :data:`MAX_ROLLOUT_SAMPLES`
  (checked in :func:`miles_ext.recipe.schedule.derive_batch`, which both the trainer and the translator call).
"""

from __future__ import annotations

from patches.core.config import Meaning

__all__ = ["LR", "CLIP_GRAD", "LORA_RANK", "LORA_ALPHA", "SEED", "GPU_COUNT", "NODE_COUNT", "COUNT",
           "MAX_LORA_RANK", "MAX_LORA_ALPHA", "MAX_ADAPTER_STEP", "MAX_ROLLOUT_SAMPLES", "adapter_step_problem"]

MAX_LORA_RANK = 1 << 16
"""Largest ``--lora-rank`` accepted anywhere (no H3 linear layer is this wide)."""

MAX_LORA_ALPHA = 1e6
"""Largest ``--lora-alpha`` accepted anywhere."""

MAX_ADAPTER_STEP = 1.0
"""Largest ``(alpha / rank) x lr``: about how far the adapted weights move in one AdamW step."""

MAX_ROLLOUT_SAMPLES = 1 << 20
"""Most samples one rollout may hold (``rollout_batch_size x n_samples_per_prompt``): the 1-GPU schedule holds one
record per micro-batch and the data order one index per sample in host memory, and 2**20 pairs is already about a
million 33 B forwards a rollout (weeks on one GPU); a rollout of 2**32 made the trainer run out of host memory
(killed) before it said anything."""

LR = Meaning(gt=0, le=1, why="the AdamW learning rate: AdamW moves each weight by about lr a step, so above 1 a step "
                             "is larger than the weights; the recipe's is 1e-4")
CLIP_GRAD = Meaning(gt=0, why="the global gradient-norm clip")
LORA_RANK = Meaning(ge=1, le=MAX_LORA_RANK, why="the LoRA rank; the recipe's is 64, and no H3 layer is 2**16 wide")
LORA_ALPHA = Meaning(gt=0, le=MAX_LORA_ALPHA, why="the adapter output is scaled by alpha / rank; the recipe's is 128")
SEED = Meaning(ge=0, why="a seed is a non-negative 63-bit integer")
GPU_COUNT = Meaning(ge=1, why="a GPU count")
NODE_COUNT = Meaning(ge=1, why="a node count")
COUNT = Meaning(ge=1)


def adapter_step_problem(rank: int, alpha: float, lr: float, names: tuple[str, str, str] = (
        "--lora-rank", "--lora-alpha", "--lr")) -> str | None:
    """Why ``(alpha / rank) x lr`` is refused (``None`` when it is at most :data:`MAX_ADAPTER_STEP`); ``names`` spell
    the three settings in the message. The values are assumed to have passed their own :class:`Meaning`."""
    step = alpha / rank * lr
    if step <= MAX_ADAPTER_STEP:
        return None
    r, a, lr_ = names
    return (f"{a} {alpha:g} / {r} {rank} x {lr_} {lr:g} = {step:.3g}: the adapted weights move by about "
            f"(alpha / rank) x lr a step (AdamW moves lora_B by about lr, the adapter output is scaled by alpha / "
            f"rank), and above {MAX_ADAPTER_STEP:g} a step is larger than the weights; lower {a} or {lr_} (the "
            "recipe's: 128 / 64 x 1e-4 = 0.0002)")
