"""A tiny, deterministic H3 LoRA SFT run on the CPU, shared by the equivalence proofs and smoke runs.

It goes through the recipe's own code: :func:`miles_ext.recipe.presets.build_transformer` (``tiny``),
:func:`miles_ext.levers.lora.attach_lora`, :func:`miles_ext.levers.fsdp_policy.apply_fsdp2`, :func:`miles_ext.recipe.sft.train_step`
with :func:`miles_ext.recipe.schedule.pair_schedule` / :func:`~miles_ext.recipe.schedule.rank_schedule`. The pairs are random
latents and caption embeddings (no dataset, VAE or text encoder), of varying sizes so that a pair mix-up shows.

:data:`PRELOAD` lists the heavy modules a rank launcher should import once (e.g. in a forkserver) rather than
once per rank: importing diffusers' H3 classes and PEFT costs about 9 s of CPU per process.
"""

from __future__ import annotations

import torch

from miles_ext.recipe.presets import H3_LORA_TARGETS, TINY, H3Preset
from miles_ext.recipe.schedule import MicroBatchSlot, check_schedule
from miles_ext.recipe.sft import SftPair

__all__ = ["synthetic_pairs", "make_lora_model", "OPTIM", "PRELOAD"]

OPTIM = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
"""AdamW settings of the tiny runs (the proofs do not depend on them)."""

PRELOAD: list[str] = [
    "torch",
    "torch.distributed.fsdp",
    "peft",
    "diffusers.models.transformers.transformer_minimax_h3",
    "diffusers.modular_pipelines.minimax_h3.before_denoise",
    "miles_ext.levers.fsdp_policy",
    "miles_ext.levers.lora",
    "miles_ext.recipe.sft",
    "tests.equivalence.h3_tiny_run",
]
"""Modules every rank of a tiny run imports (torch, PEFT, diffusers' H3 classes, this package)."""


def synthetic_pairs(count: int, preset: H3Preset = TINY, seed: int = 0) -> list[SftPair]:
    """``count`` clean pairs; pair ``i`` depends only on ``(seed, i)``. Sizes vary with ``i``: text 3..6 rows,
    video ``[C, 1..2, 2..4, 2..4]``, audio ``[2, C_audio, 2..3]``. All fp32 on the CPU."""
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(seed * 100_003 + i)
        t, h, w = 1 + i % 2, 2 + 2 * (i % 3 == 0), 2 + 2 * (i % 2)
        out.append(
            SftPair(
                text=torch.randn(3 + i % 4, preset.text_dim, generator=g),
                video=torch.randn(preset.in_channels, t, h, w, generator=g),
                audio=torch.randn(2, preset.audio_in_channels, 2 + i % 2, generator=g),
            )
        )
    return out


def make_lora_model(
    preset: H3Preset = TINY,
    *,
    seed: int = 0,
    master_dtype: str | None = None,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    autocast_adapter_dtype: bool = True,
    init_lora_weights: bool | str = "gaussian",
) -> torch.nn.Module:
    """The tiny H3 with LoRA, as the recipe loads it: base stored in ``master_dtype`` (``_keep_in_fp32_modules``
    fp32; ``None`` leaves everything fp32), then adapters attached (upstream order: load with ``torch_dtype``,
    then ``apply_lora``). Same ``seed`` -> same base and adapters on every rank and for either master dtype."""
    from miles_ext.levers.fsdp_policy import set_master_dtype
    from miles_ext.levers.lora import attach_lora
    from miles_ext.recipe.presets import build_transformer

    torch.manual_seed(seed)
    model = build_transformer(preset)
    if master_dtype is not None:
        set_master_dtype(model, master_dtype)
    torch.manual_seed(seed + 1)
    attach_lora(model, rank=lora_rank, alpha=lora_alpha, init_lora_weights=init_lora_weights,
                autocast_adapter_dtype=autocast_adapter_dtype, target_modules=H3_LORA_TARGETS)
    return model


def rank_schedule(
    global_batch: int,
    world_size: int,
    rank: int,
    num_steps: int,
    micro_batch_size: int,
    *,
    rollout_id: int = 0,
) -> list[list[MicroBatchSlot]]:
    """What rank ``rank`` of a ``world_size``-GPU run trains in one rollout, per optimizer step (upstream
    semantics, stated directly): the rollout's ``global_batch * num_steps`` pairs are split contiguously,
    ``k`` per rank; the rank's pairs are cut into ``num_steps`` contiguous windows, each cut into
    ``micro_batch_size`` chunks; ``microbatch_id`` counts the rank's chunks from 0; ``dp_rank = rank``.

    Raises ``ValueError`` for a schedule upstream would reject (indivisible batch, ragged micro-batch).
    """
    check_schedule(global_batch, world_size, num_steps, micro_batch_size)
    total = global_batch * num_steps
    k = total // world_size
    mine = list(range(rank * k, (rank + 1) * k))
    window = k // num_steps
    steps: list[list[MicroBatchSlot]] = []
    counter = 0
    for s in range(num_steps):
        win = mine[s * window : (s + 1) * window]
        chunks = [tuple(win[i : i + micro_batch_size]) for i in range(0, window, micro_batch_size)]
        step = []
        for i, chunk in enumerate(chunks):
            step.append(MicroBatchSlot(s, i, chunk, rollout_id, counter, rank))
            counter += 1
        steps.append(step)
    return steps

