"""The embedded reference trainer for the Cosmos3-Edge vision SFT recipe.

``python -m cosmos_framework_ext.recipe.train --sft-toml toml/vision_sft_edge_24gb.toml`` (or through
``launchers/sft_edge_24gb.sh``, which runs it under ``torchrun`` when no ``COSMOS_FRAMEWORK_ROOT`` is set).

It reproduces upstream cosmos-framework's training step (NVIDIA cosmos-framework's code) on
diffusers' ``Cosmos3OmniTransformer`` and the Wan2.2 ``AutoencoderKLWan``: packed micro-batches with the
strict fit rule, ``loss / grad_accum_iter``, AdamW (betas 0.9/0.95, eps 1e-6), warm-up + cosine, grad clip
0.1 with ``force_finite``, power EMA updated after the optimizer step, bf16 compute with activation
checkpointing. Random init unless ``[checkpoint].load_path`` names a diffusers-format checkpoint.

The recipe is :class:`CosmosSFT`, run by the shared skeleton :func:`patches.core.trainer.run` (preflight ->
lock -> build -> levers -> resume -> loop -> summary); checkpoints are
:class:`patches.core.checkpoint.CheckpointManager`'s (``checkpoints/iter_<9 digits>.pt`` +
``latest_checkpoint.txt``), each holding upstream's layout: ``model`` with ``net.<k>`` and ``net_ema.<k>`` for
every net key as full tensors at any world size (gathered on every rank, written by rank 0), plus the
optimizer (keyed by parameter name), the scheduler, the iteration, the micro-batches consumed, the EMA's
update counter and the training settings (:meth:`CosmosSFT.training_settings`; a resume with other values
is refused, except ``max_iter`` and ``save_iter``).

Environment: ``DATASET_PATH``, ``BASE_CHECKPOINT_PATH``, ``WAN_VAE_PATH``, ``OUTPUT_ROOT`` (as upstream's
launchers), ``COSMOS_EMA_CPU_SUBSET``, ``COSMOS_VAE_CPU_OFFLOAD`` and ``COSMOS_LATENT_CACHE`` (the levers; the latent cache
lives in ``ONECARD_LATENT_CACHE``), ``ONECARD_DATA_CACHE`` (where the sample dataset is prepared when no
``DATASET_PATH`` is given).

Exit status: 0 on success, 2 on bad input (one ``error:`` line naming the problem and the fix).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import functools
import json
import math
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from patches.core import flags as flagmod
from patches.core import preflight as pf
from patches.core import trainer as skeleton
from patches.core.checkpoint import CheckpointManager, gather_full_state, load_full_state, local_state
from patches.core.lock import check_unlocked
from patches.core.errors import ArgumentParser, UserError, cli
from patches.core.host_arena import pinned_bytes_total
from patches.core.runtime import GiB, agree_max, host_available, host_rss, median, rank_world, stable_hash
from patches.core.sampler import MemorySampler
from patches.core.summary import run_summary
from patches.core.threads import background_threads, cap_holds, cores
from patches.core.trainer import StepResult
from patches.core.units import gib_or_mib

from cosmos_framework_ext.recipe import attention, config as cfgmod, data as datamod
from patches.core.data import rows, sample_dataset
from patches.core.data.prefetch import prefetched
from patches.core.device import gpu_budget_bytes, pick_device, to_device
from cosmos_framework_ext.levers import packing
from cosmos_framework_ext.levers.ema import EMA, canonical_name, power_ema_beta, power_ema_gamma
from cosmos_framework_ext.levers.compile_blocks import compile_blocks
from cosmos_framework_ext.levers.host_embeddings import check_host_embeddings, park_lookup_tables
from cosmos_framework_ext.levers.text_kv_cache import TextKVCache, check_text_kv_cache, use_text_kv_cache
from cosmos_framework_ext.levers.text_stream import check_text_stream, detach_text_stream, is_detached
from cosmos_framework_ext.levers.attention_varlen import check_varlen
from cosmos_framework_ext.levers.selective_ac import apply_selective_checkpointing
from cosmos_framework_ext.levers.activation_offload import MIN_BYTES, offload_activations
from cosmos_framework_ext.recipe.ledger import (check_checkpoint_layers, check_offload_layers, cosmos_ledger,
                                                offload_reserve_bytes, resolve_checkpoint_layers,
                                                 summary_line)
from cosmos_framework_ext.recipe.presets import PRESETS, build_transformer, build_vae, get_preset, select_trainable
from cosmos_framework_ext.recipe.loss import grad_clip, micro_batch_loss, packed_flow_matching_inputs, warmup_cosine
from cosmos_framework_ext.levers.latent_cache import CacheItem, run_prepass
from cosmos_framework_ext.recipe import vae as vaemod
from cosmos_framework_ext.recipe.vae import online_latent
from patches.core.data.latents import check_folder as check_cache_folder
from cosmos_framework_ext.levers.frozen_bf16 import FrozenBF16
from cosmos_framework_ext.levers.frozen_bf16 import check_with_ema as check_frozen_with_ema
from cosmos_framework_ext.levers.optim_offload import OptimStateOffload
from cosmos_framework_ext.levers.vae_offload import offload_from_env

log = logging.getLogger("onecard.train")


# ---------------------------------------------------------------------------------------------- helpers
def _sample_noise(seed: int, iteration: int, micro: int, shapes: list[torch.Size]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Deterministic (seed, iteration, micro-batch) draw on the CPU: logit-normal sigmas [n] and Gaussian noise of
    each shape (the values depend on each shape's size only; :meth:`CosmosSFT._host_inputs` pins them)."""
    g = torch.Generator().manual_seed(((seed * 1_000_003 + iteration) * 1_009 + micro) % (1 << 63))  # any 63-bit seed
    sigmas = torch.sigmoid(torch.randn(len(shapes), generator=g))
    noise = [torch.randn(s, generator=g) for s in shapes]
    return sigmas, noise


def _flat(tensors: list[torch.Tensor], pin: bool = False) -> torch.Tensor:
    """Host ``tensors`` flattened and concatenated in order into one new 1-D tensor of their dtype, allocated in
    pinned memory when ``pin`` (one copy, where a concatenation and then ``pin_memory`` make two)."""
    out = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, pin_memory=pin)
    return torch.cat([t.reshape(-1) for t in tensors], out=out)


@dataclass
class HostInputs:
    """One micro-batch's host inputs (:meth:`CosmosSFT._host_inputs`): built for ``key`` = (iteration, micro-batch).

    Attributes:
        key: the (iteration, micro-batch) whose seeded draw this is.
        text_ids: per sample, the und token ids (caption + eos + vision start/end markers).
        sigmas: fp32 [n], one flow-matching sigma per sample (pinned on a GPU run).
        noise: fp32 [sum of the latents' sizes], each sample's Gaussian noise, flattened and concatenated in order
            (the same draws as :func:`_sample_noise`'s per-sample tensors; pinned on a GPU run).
        layout: positions, timesteps and segment indices (:func:`~cosmos_framework_ext.recipe.attention.host_layout`).
        text_kv: ``[layers, 2, und_len, kv_dim]`` in the compute dtype, the samples' cached text keys and values
            (``[onecard] text_kv_cache``; pinned on a GPU run), else ``None``.
    """

    key: tuple[int, int]
    text_ids: list[list[int]]
    sigmas: torch.Tensor
    noise: torch.Tensor
    layout: attention.HostLayout
    text_kv: torch.Tensor | None = None


def _one_line(e: BaseException) -> str:
    """An exception as one short line (torch's unpickling errors span many)."""
    return " ".join(f"{type(e).__name__}: {e}".split())[:200]


def _check_base_checkpoint(load_path: str) -> None:
    """Read ``BASE_CHECKPOINT_PATH``'s header without loading weights: an onecard ``iter_*.pt`` or a diffusers dir.

    Raises:
        UserError: a file that is not a torch checkpoint (read with ``weights_only`` and memory-mapped, so
            nothing is unpickled but tensors) or holds no ``net.*`` tensors; a folder without a
            ``Cosmos3OmniTransformer`` config.json and weights.
    """
    path = Path(load_path)
    fix = ("set BASE_CHECKPOINT_PATH to a diffusers-format Cosmos3OmniTransformer directory or an onecard "
           "iter_*.pt, or unset it for random init")
    if path.is_dir():
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"BASE_CHECKPOINT_PATH={path} has no readable config.json ({_one_line(e)}): {fix}") from None
        name = config.get("_class_name", "Cosmos3OmniTransformer") if isinstance(config, dict) else "?"
        if name != "Cosmos3OmniTransformer":
            raise UserError(f"BASE_CHECKPOINT_PATH={path} holds a {name}, not a Cosmos3OmniTransformer: {fix}")
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise UserError(f"BASE_CHECKPOINT_PATH={path} has a config.json but no *.safetensors or *.bin weights: {fix}")
        return
    if path.is_file() and path.stat().st_size == 0:
        raise UserError(f"BASE_CHECKPOINT_PATH={path} is an empty file: {fix}")
    import zipfile

    if path.is_file() and not zipfile.is_zipfile(path):
        raise UserError(f"BASE_CHECKPOINT_PATH={path} is not a torch checkpoint (not the zip archive torch.save "
                        f"writes): {fix}")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any reader error: not a checkpoint we can read
        why = _one_line(e).split(". ")[0]  # torch's first sentence; its advice on weights_only does not apply here
        raise UserError(f"BASE_CHECKPOINT_PATH={path} is not a readable torch checkpoint ({why}): {fix}") from None
    model = blob.get("model") if isinstance(blob, dict) else None
    if not isinstance(model, dict) or not any(str(k).startswith("net.") for k in model):
        raise UserError(f"BASE_CHECKPOINT_PATH={path} holds no net.* tensors: {fix}")


PREFETCH_DEPTH = 2
"""Micro-batches the loader threads prepare ahead (so at most this many of them run CPU operators at once)."""
_VAE_STATS = ("latents_mean", "latents_std")


def _check_vae_dir(vae_path: str, preset) -> dict[str, Any]:
    """``WAN_VAE_PATH``'s config.json against the preset's architecture; returns the config.

    Its ``latents_mean``/``latents_std`` may differ from the preset's (they are the VAE's own and are used);
    everything else must match, because the weights are loaded into the preset's architecture.

    Raises:
        UserError: not a folder, no readable config.json, another class, an architecture key that differs, or
            statistics of the wrong length.
    """
    path = Path(vae_path)
    if not path.is_dir():
        raise UserError(
            f"WAN_VAE_PATH={path} is a file: the embedded trainer reads diffusers-format directories "
            "(config.json + weights); upstream's Wan2.2_VAE.pth is read by the upstream trainer only"
        )
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"WAN_VAE_PATH={path} has no readable config.json ({_one_line(e)}): point it at a "
                        "diffusers-format AutoencoderKLWan directory") from None
    if not isinstance(config, dict):
        raise UserError(f"WAN_VAE_PATH={path}: config.json holds a {type(config).__name__}, not an object: point it at a "
                        "diffusers-format AutoencoderKLWan directory")
    name = config.get("_class_name", "AutoencoderKLWan")
    if name != "AutoencoderKLWan":
        raise UserError(f"WAN_VAE_PATH={path} holds a {name}, not an AutoencoderKLWan (Wan2.2)")

    def norm(v: Any) -> Any:
        return [norm(x) for x in v] if isinstance(v, (list, tuple)) else v

    differ = [f"{k} {config.get(k)!r} (preset {preset.name!r}: {v!r})" for k, v in preset.vae.items()
              if k not in _VAE_STATS and norm(config.get(k)) != norm(v)]
    if differ:
        raise UserError(f"WAN_VAE_PATH={path} is not the preset's VAE architecture: {'; '.join(differ[:3])}; use "
                        f"the Wan2.2 VAE of preset {preset.name!r}, or unset WAN_VAE_PATH")
    z = preset.vae["z_dim"]
    for k in _VAE_STATS:
        values = config.get(k)
        if not (isinstance(values, list) and len(values) == z
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in values)):
            raise UserError(f"WAN_VAE_PATH={path}: config.json {k} must list {z} numbers (one per latent channel)")
        if not all(math.isfinite(x) for x in values) or (k == "latents_std" and not all(x > 1e-6 for x in values)):
            raise UserError(f"WAN_VAE_PATH={path}: config.json {k} must hold finite numbers"
                            + (" above 1e-6 (latents are divided by it)" if k == "latents_std" else "")
                            + f", not {[x for x in values if not (math.isfinite(x) and (k != 'latents_std' or x > 1e-6))][:3]}")
    return config


def _load_base(model: torch.nn.Module, load_path: str, skip: list[str], dtype: torch.dtype) -> str:
    """Load base weights (diffusers directory or onecard ``iter_*.pt``) into ``model``; returns a note."""
    path = Path(load_path)
    if not path.exists():
        raise UserError(
            f"base checkpoint {path} does not exist: set BASE_CHECKPOINT_PATH to a diffusers-format "
            "Cosmos3OmniTransformer directory or an onecard iter_*.pt, or unset it for random init"
        )
    if path.is_dir():
        from diffusers import Cosmos3OmniTransformer

        try:
            loaded = Cosmos3OmniTransformer.from_pretrained(path, torch_dtype=dtype)
        except Exception as e:  # noqa: BLE001 - report any loader failure as one line
            raise UserError(f"cannot load {path} as a diffusers Cosmos3OmniTransformer: {e}") from None
        state = loaded.state_dict()
    else:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        state = {k[len("net."):]: v for k, v in blob.get("model", {}).items() if k.startswith("net.")}
        if not state:
            raise UserError(f"{path} holds no net.* tensors: pass an onecard checkpoint or a diffusers directory")
    state = {k: v for k, v in state.items() if not any(s in f"net.{k}" for s in skip)}
    problem = _base_state_problem(state, model.state_dict())
    if problem:
        raise UserError(f"BASE_CHECKPOINT_PATH={path}: {problem}: pass a checkpoint of the preset's architecture, "
                        "or unset it for random init")
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise UserError(f"BASE_CHECKPOINT_PATH={path} holds non-finite values (NaN or inf) in {len(bad)} tensor(s), "
                        f"e.g. {bad[0]}: training from it would be NaN; pass a finite checkpoint")
    missing, _ = model.load_state_dict(state, strict=False)
    return f"loaded {len(state)} tensors from {path} ({len(missing)} left at random init)"


def _base_state_problem(state: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """Why ``state`` (``net.`` stripped) cannot load into a model whose ``state_dict()`` (or meta-device parameter
    shapes) is ``expected``: a value that is not a tensor, a key the model lacks, or another shape."""
    for k, v in state.items():
        if not isinstance(v, torch.Tensor):
            return f"net.{k} is a {type(v).__name__}, not a tensor"
        if k not in expected:
            return f"net.{k} is not a parameter or buffer of the preset's architecture"
        want = tuple(expected[k].shape)
        if tuple(v.shape) != want:
            return f"net.{k} has shape {list(v.shape)}, the preset's is {list(want)}"
    return None


def _load_vae_weights(vae: torch.nn.Module, vae_path: str) -> str:
    """Load a diffusers-format ``AutoencoderKLWan`` directory into ``vae``, with its own latent statistics.

    The weights go into ``vae`` (the preset's architecture, already checked against the directory's config
    by :func:`_check_vae_dir`) and so do the config's ``latents_mean``/``latents_std``, which
    :func:`~cosmos_framework_ext.levers.vae_offload.encode_latents` normalises with. Returns a note.
    """
    path = Path(vae_path)
    if not path.exists():
        raise UserError(
            f"VAE checkpoint {path} does not exist: set WAN_VAE_PATH to a diffusers-format AutoencoderKLWan "
            "(Wan2.2) directory, or unset it for a random-init VAE"
        )
    if not path.is_dir():
        raise UserError(
            f"VAE checkpoint {path} is a file: the embedded trainer reads diffusers-format directories "
            "(config.json + weights); upstream's Wan2.2_VAE.pth is read by the upstream trainer only"
        )
    from diffusers import AutoencoderKLWan

    try:
        loaded = AutoencoderKLWan.from_pretrained(path)
        vae.load_state_dict(loaded.state_dict())
    except Exception as e:  # noqa: BLE001
        raise UserError(f"cannot load {path} as the preset's diffusers AutoencoderKLWan: {_one_line(e)}") from None
    own = {k: [float(x) for x in loaded.config[k]] for k in _VAE_STATS}
    changed = [k for k in _VAE_STATS if own[k] != [float(x) for x in vae.config[k]]]
    vae.register_to_config(**own)
    return (f"VAE weights and latents_mean/latents_std from {path}"
            + (f" (its {' and '.join(changed)} differ from the preset's)" if changed else ""))


def _launch_world() -> int:
    """The world size the launcher's torchrun will start: ``NPROC_PER_NODE`` x ``NNODES`` (default 1 x 1)."""
    world = 1
    for var in ("NPROC_PER_NODE", "NNODES"):
        raw = os.environ.get(var) or "1"
        if not flagmod.is_whole_number(raw) or int(raw) < 1:
            raise UserError(f"{var}={raw} is not a whole number >= 1")
        world *= int(raw)
    procs = int(os.environ.get("NPROC_PER_NODE") or "1")
    if torch.cuda.is_available() and procs > torch.cuda.device_count():
        raise UserError(f"NPROC_PER_NODE={procs} is more than this node's {torch.cuda.device_count()} GPUs: start at "
                        "most one rank per GPU")
    if procs > 1024:
        raise UserError(f"NPROC_PER_NODE={procs} is more than 1024 ranks on one node: give the ranks this node runs")
    return world


def _shard(model: torch.nn.Module, device: torch.device, mp_policy: Any = None) -> None:
    """FSDP2 per decoder layer and at the root (CPU offload policy on the CPU, as CPU FSDP2 needs), with
    ``mp_policy`` (upstream HEAD's ``MixedPrecisionPolicy``) on every unit when given. Without a process group
    (one process, no torchrun) a one-rank group is made, as upstream wraps even one GPU."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                             store=torch.distributed.HashStore(), rank=0, world_size=1)
    kw = {} if device.type == "cuda" else {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)


# ------------------------------------------------------------------------------------------- the recipe
def build_recipe_vae(cfg: Any, preset: Any, device: torch.device) -> tuple[torch.nn.Module, torch.dtype, str]:
    """The recipe's frozen Wan2.2 VAE on the host: ``(vae, dtype, note)``.

    bf16 when training on a GPU, fp32 on the CPU; random init from its own seed (``[onecard] seed`` mixed with
    ``"vae"``, independent of the transformer's draws, so the pre-pass command builds the same VAE without the
    transformer), or ``WAN_VAE_PATH``'s weights.
    """
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(stable_hash("vae", cfg.onecard.seed))
    vae = build_vae(preset, dtype=dtype)
    note = "random-init VAE (no WAN_VAE_PATH)"
    if cfg.model.tokenizer.vae_path:
        note = _load_vae_weights(vae, cfg.model.tokenizer.vae_path)
    return vae, dtype, note


class CosmosSFT(skeleton.Recipe):
    """The Cosmos3-Edge vision SFT recipe on the shared trainer skeleton.

    Args:
        args: the command line (:func:`parse_args`).
    """

    unit = "iteration"
    recipe_name = "cosmos3-edge"
    checkpoint_keys = ("model", "optimizer", "scheduler", "iteration", "micro_batches_consumed")
    checkpoint_types = {"model": dict, "optimizer": dict, "scheduler": dict, "iteration": int,
                        "micro_batches_consumed": int}
    prepare_ahead = True
    """With the latent cache, build each micro-batch's host inputs on a loader thread (the same values: the proof
    sets it False for the main-thread path)."""

    def checkpoint_problem(self, state: Any) -> str | None:
        """The skeleton's checks, and ``model`` holding ``net.*`` tensors."""
        problem = super().checkpoint_problem(state)
        if problem is None and not any(str(k).startswith("net.") for k in state["model"]):
            problem = "its 'model' holds no net.* tensors"
        return problem
    more_hint = "pass --max-iter N (N > that) to train further"
    adjustable_settings = frozenset({"[trainer].max_iter", "[checkpoint].save_iter"})

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.trained = False
        self.ema: EMA | None = None
        self.mem: MemorySampler | None = None
        self._it: Iterator | None = None

    # ------------------------------------------------------------ 1. inputs (also --validate-only)
    def preflight(self) -> None:
        """Read the TOML and flags, pick the device, check everything the user controls, print the ledger.

        Checked, each as one error: the TOML (schema, preset, trainable keys, EMA rate, step counts), the
        lever flags, ``--max-iter``, every path named, ``OUTPUT_ROOT`` writable (a temporary file made and
        removed), ``BASE_CHECKPOINT_PATH``'s header, ``WAN_VAE_PATH``'s config, every dataset row, and every
        video the rows name (its first and last needed frame decode).

        Raises:
            UserError: bad TOML, flag, path, setting or dataset (nothing has been written).
        """
        self.cfg = cfgmod.load(self.args.sft_toml)
        self.flags = flagmod.read_all()
        self.ema_lever = self.flags[flagmod.EMA_CPU_SUBSET.name]
        self.vae_lever = self.flags[flagmod.VAE_CPU_OFFLOAD.name]
        self.cache_lever = self.flags[flagmod.LATENT_CACHE.name]
        self.sample_s = flagmod.sample_interval_s()
        self.rank, self.world, local_rank = rank_world()
        self.device = pick_device(local_rank)
        if self.args.validate_only:  # one process checks for the ranks the launcher's torchrun will start
            self.world = _launch_world()
        elif self.world > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.main_rank = self.rank == 0
        precision = self.cfg.model.precision
        self.dtype = torch.bfloat16 if (self.device.type == "cuda" and precision == "bfloat16") else torch.float32
        self._resolve_master_dtype()
        self._check_preset()
        self._check_honoured()
        check_checkpoint_layers(self.cfg, self.preset.name)  # before the dataset and the model ("auto": the plan)
        check_offload_layers(self.cfg, self.preset.name, self.world, self.mixed)
        try:
            check_varlen(self.cfg.onecard.attention, self.device.type, self.dtype)
        except ValueError as e:
            raise UserError(f"{self.cfg.source}: {e}") from None
        self._resolve_background_threads()
        self._check_paths()
        self._resolve_schedule()
        job = self.cfg.job
        self.run_dir = Path(os.environ.get("OUTPUT_ROOT") or "outputs/train") / job.project / job.group / job.name
        pf.check_writable(self.run_dir, "OUTPUT_ROOT")
        if self.main_rank:
            check_unlocked(self.run_dir)  # a second run stops here, not after its dataset and model checks
        if self.cache_lever:  # lever 4 writes the latent cache in its pre-pass, after the model is built
            check_cache_folder(flagmod.latent_cache_dir(), flagmod.LATENT_CACHE_DIR)
        pf.check_at_least(self.cfg.onecard.keep_checkpoints, 0, "[onecard] keep_checkpoints", "0 keeps every checkpoint")
        self.checkpoints = CheckpointManager(self.run_dir, write=self.main_rank, keep=self.cfg.onecard.keep_checkpoints)
        if self.cfg.checkpoint.load_path:
            _check_base_checkpoint(self.cfg.checkpoint.load_path)
        if self.cfg.model.tokenizer.vae_path:
            _check_vae_dir(self.cfg.model.tokenizer.vae_path, self.preset)
        self._load_dataset()
        self._check_source()
        self._check_trainable()  # last: the model's names come from building it on the meta device (seconds)
        self._print_plan()

    def _resolve_master_dtype(self) -> None:
        """``[model.parallelism]`` fsdp_master_dtype/fsdp_reduce_dtype -> the storage dtype and FSDP2 policy (HEAD),
        and the two levers that act on them (checked here, before anything is built).

        Raises:
            UserError: ``COSMOS_FROZEN_BF16=1`` with the stock device EMA (it would average the bf16 copies).
        """
        par = self.cfg.model.parallelism
        self.optim_lever = self.flags[flagmod.OPTIM_STATE_OFFLOAD.name]
        self.frozen_lever = self.flags[flagmod.FROZEN_BF16.name]
        dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
        self.master_dtype = dtypes[par.fsdp_master_dtype] if self.device.type == "cuda" else self.dtype
        self.reduce_dtype = dtypes[par.fsdp_reduce_dtype]
        self.mixed = self.master_dtype != self.dtype  # upstream HEAD: fp32 master, compute in precision via FSDP2
        check_frozen_with_ema(self.frozen_lever and self.mixed, self.cfg.model.ema.enabled, self.ema_lever)

    def _load_dataset(self) -> None:
        """Every row of ``DATASET_PATH`` (or of the sample dataset, prepared once by rank 0) and every video."""
        dataset_path = os.environ.get("DATASET_PATH", "")
        if dataset_path:
            self.ds_root = Path(dataset_path)
        else:
            self.ds_root = sample_dataset.default_sample_dataset_root(self.preset)
            if self.main_rank:
                sample_dataset.prepare_sample_dataset(self.ds_root, self.preset)
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
        self.records = rows.load_records(self.ds_root)
        if not self.args.videos_checked:  # the launcher's validate step decoded them once for all ranks
            rows.check_videos_decode(self.records)
        jsonl = (self.ds_root / rows.JSONL_RELPATH).read_bytes()
        self.dataset_sha = hashlib.sha256(jsonl).hexdigest()[:16]

    def _check_preset(self) -> None:
        """The preset and the EMA rate (cheap: no model is built)."""
        cfg = self.cfg
        name = cfg.onecard.preset
        if name == "auto":
            name = "edge" if self.device.type == "cuda" else "tiny"
        if name not in PRESETS:
            raise UserError(f"{cfg.source}: [onecard].preset = {cfg.onecard.preset!r} is unknown: use one of "
                            f"{['auto', *sorted(PRESETS)]} (auto: edge on a GPU, tiny on a CPU)")
        try:
            self.preset = get_preset(name)
            if cfg.model.ema.enabled:
                power_ema_gamma(cfg.model.ema.rate)
        except ValueError as e:
            raise UserError(f"{cfg.source}: {e}") from None

    def _resolve_background_threads(self) -> None:
        """``[onecard] background_threads`` as each background thread's cap (:attr:`background_threads`; ``None``:
        uncapped): the loader threads at work at once and, with lever 1, the EMA's host lerp share the cores
        (``"auto"`` on a GPU run only: on the CPU it leaves them uncapped). A cap
        the OpenMP runtime does not take (another parallel backend, the runtime not found) is dropped, and the run
        says so."""
        setting = self.cfg.onecard.background_threads
        try:
            cap = background_threads(setting, PREFETCH_DEPTH + int(self.cfg.model.ema.enabled and self.ema_lever),
                                     gpu=self.device.type == "cuda")
        except ValueError as e:
            raise UserError(f"{self.cfg.source}: [onecard] {e}") from None
        if cap is not None and not cap_holds(cap):
            if self.main_rank:
                print(f"onecard: [onecard] background_threads = {json.dumps(setting)} not applied: PyTorch's CPU "
                      "operators here do not run on an OpenMP runtime this process can set per thread; the background "
                      "threads keep PyTorch's default", flush=True)
            cap = None
        self.background_threads = cap

    def _check_honoured(self) -> None:
        """:func:`~cosmos_framework_ext.recipe.config.check_honoured` for this run's ranks (the ledger command runs
        the same check)."""
        cfgmod.check_honoured(self.cfg, self.world)

    def _check_trainable(self) -> None:
        """``keys_to_select`` against the preset's parameter names (the model built on the meta device), and an
        onecard ``BASE_CHECKPOINT_PATH``'s tensors against the same model's names and shapes (read memory-mapped)."""
        cfg = self.cfg
        try:
            meta = build_transformer(self.preset, device="meta")
            names = [n for n, _ in meta.named_parameters()]
            self.trainable = select_trainable(names, cfg.optimizer.keys_to_select)
            check_host_embeddings(cfg.onecard.host_embeddings, self.trainable, self.world, self.mixed)
            check_text_stream(cfg.onecard.detach_text_stream, self.trainable)
            check_text_kv_cache(cfg.onecard.text_kv_cache, self.trainable)
        except ValueError as e:
            raise UserError(f"{cfg.source}: {e}") from None
        path = Path(cfg.checkpoint.load_path) if cfg.checkpoint.load_path else None
        if path is not None and path.is_file():
            blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            skip = cfg.checkpoint.keys_to_skip_loading
            state = {k[4:]: v for k, v in blob["model"].items()
                     if k.startswith("net.") and not any(s in k for s in skip)}
            problem = _base_state_problem(state, meta.state_dict())
            if problem:
                raise UserError(f"BASE_CHECKPOINT_PATH={path}: {problem}: pass a checkpoint of the preset's "
                                f"architecture ({self.preset.name!r}), or unset it for random init")

    def _check_paths(self) -> None:
        """Every path the environment or the TOML names must exist."""
        for var, value in (("DATASET_PATH", os.environ.get("DATASET_PATH", "")),
                           ("BASE_CHECKPOINT_PATH", self.cfg.checkpoint.load_path),
                           ("WAN_VAE_PATH", self.cfg.model.tokenizer.vae_path)):
            if value and not Path(value).exists():
                raise UserError(f"{var}={value} does not exist: point it at an existing path, or unset it "
                                f"({'the sample dataset is used' if var == 'DATASET_PATH' else 'random init is used'})")

    def _resolve_schedule(self) -> None:
        """max_iter, grad_accum_iter and the cap: the recipe's, the CPU smoke's, or ``--max-iter``."""
        cfg = self.cfg
        max_iter, self.ga, self.cap = cfg.trainer.max_iter, cfg.trainer.grad_accum_iter, cfg.dataloader_train.max_sequence_length
        self.smoke = ""
        if self.device.type == "cpu" and self.preset.name == "tiny":
            oc = cfg.onecard
            max_iter = oc.cpu_max_iter or max_iter
            self.ga = oc.cpu_grad_accum_iter or self.ga
            self.cap = oc.cpu_max_sequence_length or self.cap
            used = [k for k in ("cpu_max_iter", "cpu_grad_accum_iter", "cpu_max_sequence_length") if getattr(oc, k)]
            self.smoke = (f" (CPU smoke: [onecard] {', '.join(used)} replace the recipe's values, cap {self.cap}, "
                          f"grad_accum_iter {self.ga})" if used else
                          f" (CPU, tiny preset: no [onecard] cpu_* value is set, so the recipe's whole schedule runs, "
                          f"cap {self.cap}, grad_accum_iter {self.ga}; set cpu_max_iter, cpu_grad_accum_iter and "
                          "cpu_max_sequence_length for a short smoke run)")
        pf.check_at_least(self.args.max_iter, 0, "--max-iter", "pass a step count >= 1, or 0 to keep [trainer].max_iter")
        self.max_steps = self.args.max_iter or max_iter
        src = cfg.source
        pf.check_at_least(self.max_steps, 1, f"{src}: [trainer].max_iter", "train at least one iteration")
        pf.check_at_least(self.ga, 1, f"{src}: [trainer].grad_accum_iter (or [onecard].cpu_grad_accum_iter)")
        pf.check_at_least(self.cap, 1, f"{src}: [dataloader_train].max_sequence_length")
        pf.check_at_least(cfg.dataloader_train.max_caption_tokens, 1, f"{src}: [dataloader_train].max_caption_tokens")
        pf.check_at_least(cfg.checkpoint.save_iter, 1, f"{src}: [checkpoint].save_iter")
        pf.check_at_least(cfg.onecard.seed, 0, f"{src}: [onecard].seed")
        if not 0.0 <= cfg.onecard.cfg_dropout <= 1.0:
            raise UserError(f"{src}: [onecard].cfg_dropout = {cfg.onecard.cfg_dropout} must be in [0, 1]")

    def _text_tokens(self) -> tuple[int, int]:
        """For the ledger's text K/V lines: (distinct text tokens of every access the loader can yield, the text tokens
        of a micro-batch filled to the cap at the largest text share among the rows' first-epoch accesses; an
        estimate)."""
        texts = self.source.all_text_ids()
        tokens = sum(len(self._und_ids(t)) for t in texts)
        share = max(len(self._und_ids(self.source.sample(i, 0).text_ids)) / self.source.token_count(i, 0)
                    for i in range(len(self.source)))
        return tokens, math.ceil(self.cap * share)

    def _check_text_kv_host(self) -> None:
        """Refuse a text K/V cache that cannot fit the host: the ledger's text K/V lines (the store and the micro-batches
        in flight, priced from the dataset's captions), times the ranks on this host (torchrun's ``LOCAL_WORLD_SIZE``;
        ``NPROC_PER_NODE`` for ``--validate-only``, which checks for the launch), against the host memory available
        now (:func:`patches.core.runtime.host_available`). The ranks agree on the verdict (the largest shortfall over
        them), so none goes on to build while another stops.

        Raises:
            UserError: more than available on some rank's host; the message names the sizes and the fixes.
        """
        if os.environ.get("LOCAL_WORLD_SIZE"):
            ranks = int(os.environ["LOCAL_WORLD_SIZE"])
        elif self.args.validate_only:
            ranks = int(os.environ.get("NPROC_PER_NODE") or "1")
        else:
            ranks = 1
        need = ranks * sum(i.host_bytes for i in self.ledger.items if i.name.startswith("text K/V"))
        free = host_available()
        nccl = self.world > 1 and self.device.type == "cuda"
        worst = agree_max(need - free, self.device if nccl else "cpu")
        if worst <= 0:
            return
        each = f" ({ranks} ranks on this host, one cache each)" if ranks > 1 else ""
        where = (f"needs {gib_or_mib(need)} of host memory for the captions' keys and values{each}, but "
                 f"{gib_or_mib(free)} is available" if need > free
                 else f"does not fit another rank's host ({gib_or_mib(worst)} short)")
        raise UserError(f"{self.cfg.source}: [onecard] text_kv_cache {where}: set text_kv_cache = false, or train on "
                        "fewer or shorter captions, or free host memory")

    def _print_plan(self) -> None:
        """The run's one-line plan and its memory ledger (rank 0)."""
        dev = self.device
        budget = gpu_budget_bytes(dev) if dev.type == "cuda" else None
        self.checkpoint_layers = resolve_checkpoint_layers(self.cfg, self.preset.name, self.flags, budget,
                                                           world_size=self.world, device_type=dev.type, cap=self.cap)
        # the ledger re-checks offload_layers against the resolved count (check_offload_layers)
        self.ledger = cosmos_ledger(self.cfg, self.preset.name, self.flags, world_size=self.world,
                                    device_type=dev.type, cap=self.cap, grad_accum_iter=self.ga,
                                    checkpoint_layers=self.checkpoint_layers,
                                    text_tokens=self._text_tokens() if self.cfg.onecard.text_kv_cache else None)
        if self.cfg.onecard.text_kv_cache:
            self._check_text_kv_host()
        if not self.main_rank:
            return
        where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (no GPU found)"
        print(f"onecard: preset {self.preset.name} on {where}, {self.world} rank(s), max_iter {self.max_steps}{self.smoke}; "
              f"{flagmod.EMA_CPU_SUBSET.name}={int(self.ema_lever)} {flagmod.VAE_CPU_OFFLOAD.name}={int(self.vae_lever)} "
              f"{flagmod.LATENT_CACHE.name}={int(self.cache_lever)} {flagmod.OPTIM_STATE_OFFLOAD.name}={int(self.optim_lever)} "
              f"{flagmod.FROZEN_BF16.name}={int(self.frozen_lever)}; parameters stored {self.master_dtype}, computed "
              f"{self.dtype}" + (f" (FSDP2 MixedPrecisionPolicy, reduce {self.reduce_dtype})" if self.mixed else ""),
              flush=True)
        ac = self.cfg.model.activation_checkpointing
        layers = self.preset.transformer["num_hidden_layers"]
        k = self.cfg.onecard.offload_layers
        if ac.mode != "none" and (self.checkpoint_layers < layers or k):
            print(f"onecard: {self.checkpoint_layers - k} of {layers} decoder layers activation-checkpointed ({ac.mode}), "
                  f"the other {layers - self.checkpoint_layers + k} keep their activations ([onecard] checkpoint_layers "
                  f"= {self.cfg.onecard.checkpoint_layers!r})"
                  + (f", on the host for the first {k} ([onecard] offload_layers = {k})" if k else ""), flush=True)
        print(self.ledger.format(budget), flush=True)

    # ------------------------------------------------------------ 2. the stock recipe
    def build(self, stack: contextlib.ExitStack) -> None:
        """Data, model, VAE (on the host until the levers place it), optimizer and schedule (inputs checked)."""
        self._stack = stack
        self.consumed = 0
        self.inputs_built = {"loader_threads": 0, "main_thread": 0}
        """Where this process built its micro-batches' host inputs (:meth:`_host_inputs`), counted."""
        self._build_data()
        self._build_model()
        self._build_vae()
        self._build_optimizer()

    def _check_source(self) -> None:
        """The rows as samples (captions tokenised) against the packing cap, before anything is built.

        Raises:
            PackingError: no sample fits the cap even with its caption dropped, or none fits with its caption (only
                the ``cfg_dropout`` copies would train). Rows that fit only without their caption are said in one
                line.
        """
        cfg = self.cfg
        self.tokenizer = datamod.CaptionTokenizer()
        self.source = source = datamod.SampleSource(self.records, self.tokenizer, self.preset,
                                                    max_caption_tokens=cfg.dataloader_train.max_caption_tokens,
                                                    seed=cfg.onecard.seed, cfg_dropout=cfg.onecard.cfg_dropout)
        packing.check_some_sample_fits(source, self.cap)
        with_caption = [source.min_token_count(i, dropped=False) for i in range(len(source))]
        too_big = [i for i, n in enumerate(with_caption) if not packing.fits(0, n, self.cap)]
        if too_big and len(too_big) == len(source):
            raise packing.PackingError(
                f"the packing cap {self.cap} is below every sample with its caption (the smallest has "
                f"{min(with_caption)} tokens): only the caption-dropped copies ([onecard] cfg_dropout) would train; "
                f"raise the cap above {min(with_caption)} or lower [dataloader_train] max_caption_tokens")
        if too_big and self.main_rank:
            print(f"onecard: {len(too_big)} of {len(source)} rows fit the packing cap {self.cap} only with their "
                  f"caption dropped (e.g. row {too_big[0] + 1}, {with_caption[too_big[0]]} tokens): they train only in "
                  "the caption-dropped accesses; raise the cap or lower max_caption_tokens", flush=True)

    def _build_data(self) -> None:
        """The packing loader over the samples :meth:`preflight` checked; counts the captions cut to fit."""
        cfg = self.cfg
        seed = cfg.onecard.seed
        source = self.source
        self.loader = packing.PackingLoader(source, cap=self.cap, rank=self.rank, world_size=self.world, seed=seed)
        self.captions_truncated = source.truncated_captions()
        if self.captions_truncated and self.main_rank:
            print(f"onecard: {self.captions_truncated} of {len(self.records)} captions are longer than "
                  f"max_caption_tokens {cfg.dataloader_train.max_caption_tokens} with their duration/fps/size "
                  "suffix: each is cut to fit and keeps its suffix", flush=True)

    def _build_model(self) -> None:
        """The transformer (seeded random init), its trainable subset, checkpointing, packed attention, FSDP2."""
        cfg, device = self.cfg, self.device
        torch.manual_seed(cfg.onecard.seed)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.master_dtype)  # = self.dtype unless upstream HEAD's fp32 master is asked for
        try:
            model = build_transformer(self.preset, device=device)
        finally:
            torch.set_default_dtype(prev)
        tset = set(self.trainable)
        for n, p in model.named_parameters():
            p.requires_grad_(n in tset)
        self.n_total = sum(p.numel() for p in model.parameters())
        self.n_train = sum(p.numel() for n, p in model.named_parameters() if n in tset)
        ac = cfg.model.activation_checkpointing
        offloaded = cfg.onecard.offload_layers if ac.mode != "none" else 0
        some = self.checkpoint_layers < len(model.layers) or offloaded  # lever: layers that keep their activations
        if ac.mode == "full" and not some:
            model.enable_gradient_checkpointing()
        elif ac.mode != "none":  # lever: the ops save_ops_regex names kept, the rest recomputed (before compile)
            apply_selective_checkpointing(model, ac.save_ops_regex if ac.mode == "selective" else None,
                                          preserve_rng_state=ac.preserve_rng_state, determinism_check=ac.determinism_check,
                                          layers=self.checkpoint_layers, skip=offloaded)
        self.host_tables = park_lookup_tables(model, device) if cfg.onecard.host_embeddings else None
        self.proc = attention.install(model)
        if cfg.onecard.detach_text_stream:  # lever: no backward through the frozen text stream
            detach_text_stream(model)
        self.text_kv = None
        if cfg.onecard.text_kv_cache:  # lever: the frozen text stream's keys and values from a per-caption cache
            t = self.preset.transformer
            self.text_kv = TextKVCache(len(model.layers), t["num_key_value_heads"] * t["head_dim"], self.dtype,
                                       pin=device.type == "cuda")
            use_text_kv_cache(model, self.text_kv)
        self.act_offload = None
        if offloaded:  # lever: the first layers' activations on the host; copies back from the last checkpointed one's backward
            trigger = max(self.checkpoint_layers - 1, offloaded) if offloaded < len(model.layers) else None
            reserve = offload_reserve_bytes(self.cap - 1, self.preset.transformer["hidden_size"]) if (
                device.type == "cuda") else 0  # pinned once, before training (the ledger's host line)
            self.act_offload = offload_activations(  # on a CPU every saved tensor moves: the smoke runs the copies
                model, offloaded, trigger=trigger, reserve=reserve, min_bytes=MIN_BYTES if device.type == "cuda" else 0)
        model.train()
        self.compile_note = "eager"
        cpp = cfg.onecard.compile_wrapper == "cpp"
        if cfg.onecard.compile_blocks and cfg.model.compile.enabled and device.type == "cuda":  # each decoder layer
            n = compile_blocks(model, dynamic=cfg.model.compile.compile_dynamic, wrapper=cfg.onecard.compile_wrapper)
            self.compile_note = (f"{n} decoder layers compiled (dynamic={cfg.model.compile.compile_dynamic}"
                                 f"{', C++ wrapper' if cpp else ''})")
        elif cfg.onecard.compile_blocks and cfg.model.compile.enabled:  # asked for, on a CPU: say why not
            unused = '; compile_wrapper = "cpp" is unused' if cpp else ""
            self.compile_note = f"eager (the layers are compiled on a GPU only{unused})"
        # Lever: frozen parameters stored as their compute-dtype cast (before FSDP2 records the dtypes).
        self.frozen = FrozenBF16(model, self.dtype) if (self.frozen_lever and self.mixed) else None
        if self.world > 1 or self.mixed:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            policy = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=self.reduce_dtype) if self.mixed else None
            _shard(model, device, policy)
        self.model = model
        self.params = [p for n, p in model.named_parameters() if n in tset]
        self.init_note = "random init (no BASE_CHECKPOINT_PATH): weights are NOT a trained Cosmos3-Edge"

    def _build_vae(self) -> None:
        """The frozen Wan2.2 VAE on the host (:func:`build_recipe_vae`)."""
        self.vae, self.vae_dtype, self.vae_note = build_recipe_vae(self.cfg, self.preset, self.device)

    def _build_optimizer(self) -> None:
        """AdamW over the trainable subset and upstream's warm-up + cosine schedule."""
        o, sc = self.cfg.optimizer, self.cfg.scheduler
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                     weight_decay=o.weight_decay, fused=bool(o.fused and self.device.type == "cuda"))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: warmup_cosine(s, sc.warm_up_steps[0], sc.cycle_lengths[0], sc.f_start[0],
                                              sc.f_max[0], sc.f_min[0]),
        )

    # ------------------------------------------------------------ 3. the levers
    def attach_levers(self, stack: contextlib.ExitStack) -> None:
        """Place the VAE (latent cache, lever 4; parked on the host, lever 2; or resident) and the EMA (CPU subset,
        lever 1, or device)."""
        self.latents = self.cache_report = None
        if self.cache_lever:  # lever 4: the VAE is on the device only inside the pre-pass, then freed
            self.latents, report = run_prepass(self.vae, self.device, datamod.cache_items(self.records, self.preset),
                                               encode=vaemod.online_latent, rank=self.rank, world_size=self.world,
                                               progress=self.main_rank)
            self.cache_report = report.to_dict()
            if self.main_rank:
                print(f"onecard: {report.line()}", flush=True)
                if self.vae_lever:
                    print("onecard: COSMOS_VAE_CPU_OFFLOAD=1 has no effect with COSMOS_LATENT_CACHE=1: training "
                          "never encodes", flush=True)
            self.vae = self.offload = None
            self.vae_on_device = contextlib.nullcontext
        else:
            self.offload = offload_from_env(self.vae, self.device)
            self.vae_on_device = self.offload.on_device if self.offload is not None else contextlib.nullcontext
        ema_cfg = self.cfg.model.ema
        self.gamma = 0.0
        self.ema_note = "off"
        if ema_cfg.enabled:
            self.gamma = power_ema_gamma(ema_cfg.rate)
            placement = "cpu_subset" if self.ema_lever else "device"
            self.ema = EMA(self.model, placement=placement, trainable=self.trainable, threads=self.background_threads)
            self.ema.attach_optimizer(self.opt)
            stack.callback(self.ema.close)
            self.ema_note = "CPU subset (lever)" if self.ema_lever else f"stock full fp32 clone on {self.device}"
        elif self.ema_lever and self.main_rank:
            print("onecard: COSMOS_EMA_CPU_SUBSET=1 has no effect: [model.ema].enabled = false in this TOML")
        self.optim_offload = OptimStateOffload(self.opt) if self.optim_lever else None
        if self.optim_offload is not None:
            stack.callback(self.optim_offload.close)
        if self.frozen is not None:
            stack.callback(self.frozen.close)
        elif self.frozen_lever and self.main_rank:
            print(f"onecard: COSMOS_FROZEN_BF16=1 has no effect: parameters are stored in {self.master_dtype}, the "
                  f"dtype they compute in ({self._why_not_mixed()})")

    def _why_not_mixed(self) -> str:
        """Why parameters compute in the dtype they are stored in (so ``COSMOS_FROZEN_BF16`` has nothing to do)."""
        if self.device.type != "cuda":
            return "no bf16 compute on the CPU: the lever acts on a GPU run only"
        if self.cfg.model.precision != "bfloat16":
            return f"[model].precision = \"{self.cfg.model.precision}\": the lever needs bf16 compute"
        return ("set [model.parallelism] fsdp_master_dtype = \"float32\" for upstream HEAD's dtypes, where frozen "
                "fp32 parameters compute in bf16")

    # ------------------------------------------------------------ 4. checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Upstream's layout: ``model`` holds ``net.<k>`` and ``net_ema.<k>`` for every net key, full-shape.

        At world size > 1 every rank gathers the full tensors (a collective) and rank 0 writes them, so a
        checkpoint holds whole tensors at any world size, keyed by name (the optimizer state too). A resume
        still needs the world size it was written at: the world size splits the data (see
        :meth:`training_settings`). The skeleton calls it inside :meth:`save_scope` (the memory phase of the save).
        """
        # one rank: the live tensors, copied to the host one at a time as the file is written (no second whole
        # copy of net, EMA and optimizer in host memory); several ranks gather full copies
        net, optim = local_state(self.model, self.opt) if self.world == 1 else gather_full_state(self.model, self.opt)
        trained = set(self.trainable)
        bad = [k for k, v in net.items() if canonical_name(k) in trained and not bool(torch.isfinite(v).all())]
        if bad:  # every rank holds the same full tensors, so every rank stops here alike
            raise UserError(f"the trained weights hold NaN or inf after iteration {self.done} ({len(bad)} tensor(s), "
                            f"e.g. net.{canonical_name(bad[0])}): the run diverged and this checkpoint is not "
                            "written (the previous one is kept); lower [optimizer].lr or [onecard].loss_scale, or "
                            "set [trainer.callbacks.grad_clip] force_finite = true")
        model = {f"net.{canonical_name(k)}": v for k, v in net.items()}
        ema = (self.ema.full_state_dict(copy=self.world > 1) if self.ema is not None
               else {"num_updates": 0, "shadow": {}})
        model.update({f"net_ema.{k}": v for k, v in ema["shadow"].items()})
        return {
            "model": model,
            "optimizer": optim,
            "scheduler": self.sched.state_dict(),
            "iteration": self.done,
            "micro_batches_consumed": self.consumed,
            "ema_num_updates": ema["num_updates"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> int:
        """Resume the same job: net, EMA (with its counter), optimizer, schedule and data position.

        Full tensors are sliced to this rank's shards locally (no collective); an optimizer state keyed by
        parameter index (written before it was keyed by name, at one rank) is loaded as it is.
        """
        net = {k[4:]: v for k, v in state["model"].items() if k.startswith("net.")}
        by_name = {canonical_name(k): k for k in self.model.state_dict()}
        optim = state["optimizer"]
        named = all(isinstance(k, str) for k in optim.get("state", {}))
        try:
            load_full_state(self.model, {by_name.get(k, k): v for k, v in net.items()},
                            *((self.opt, optim) if named else ()))
        except (KeyError, ValueError) as e:
            raise UserError(f"the checkpoint in {self.checkpoints.dir} does not fit this model ({e}): use another "
                            "OUTPUT_ROOT or [job].name, or the settings it was trained with") from None
        if not named:
            self.opt.load_state_dict(optim)
        if self.frozen is not None:  # load_full_state wrote the frozen fp32 values into the host copies
            self.frozen.refresh()
        if self.ema is not None:
            shadow = {k[8:]: v for k, v in state["model"].items() if k.startswith("net_ema.")}
            self.ema.load_state_dict({"num_updates": state.get("ema_num_updates", 0), "shadow": shadow})
        self.sched.load_state_dict(state["scheduler"])
        self.consumed = state["micro_batches_consumed"]
        return state["iteration"]

    def on_resume(self, path: Path, step: int) -> None:
        self.init_note = f"resumed from {path} at iteration {step}"
        self._print_model()

    def training_settings(self) -> dict[str, Any]:
        """What decides the trajectory: model, data, optimizer, schedule, loss, EMA, world size (not the levers,
        which are proven not to change it); ``max_iter`` and ``save_iter`` may change on a resume."""
        c = self.cfg
        o, sc, gc, ema, oc = c.optimizer, c.scheduler, c.trainer.callbacks.grad_clip, c.model.ema, c.onecard
        return {
            "[onecard].preset": self.preset.name, "world size (NPROC_PER_NODE x NNODES)": self.world,
            "[model].precision": str(self.dtype).replace("torch.", ""),
            "[model.parallelism].fsdp_master_dtype": str(self.master_dtype).replace("torch.", ""),
            "[model.parallelism].fsdp_reduce_dtype": str(self.reduce_dtype).replace("torch.", "") if self.mixed else None,
            "[optimizer].keys_to_select": list(o.keys_to_select), "[optimizer].lr": o.lr,
            "[optimizer].betas": list(o.betas), "[optimizer].eps": o.eps, "[optimizer].weight_decay": o.weight_decay,
            "[scheduler].warm_up_steps": list(sc.warm_up_steps), "[scheduler].cycle_lengths": list(sc.cycle_lengths),
            "[scheduler].f_start": list(sc.f_start), "[scheduler].f_max": list(sc.f_max), "[scheduler].f_min": list(sc.f_min),
            "[trainer].grad_accum_iter": self.ga, "[dataloader_train].max_sequence_length": self.cap,
            "[dataloader_train].max_caption_tokens": c.dataloader_train.max_caption_tokens,
            "[trainer.callbacks.grad_clip].clip_norm": gc.clip_norm,
            "[trainer.callbacks.grad_clip].force_finite": gc.force_finite,
            "[model.ema].enabled": ema.enabled, "[model.ema].rate": ema.rate,
            "[model.ema].iteration_shift": ema.iteration_shift,
            "[onecard].seed": oc.seed, "[onecard].loss_scale": oc.loss_scale, "[onecard].cfg_dropout": oc.cfg_dropout,
            "dataset (sha256 of video_dataset_file.jsonl)": self.dataset_sha,
            "WAN_VAE_PATH": c.model.tokenizer.vae_path,
            "[trainer].max_iter": self.max_steps, "[checkpoint].save_iter": c.checkpoint.save_iter,
        }

    def warm_start_source(self) -> str:
        path = self.cfg.checkpoint.load_path
        return f"the base checkpoint (BASE_CHECKPOINT_PATH / [checkpoint].load_path) {path}" if path else ""

    def warm_start(self) -> None:
        """Base weights from ``[checkpoint].load_path`` (the EMA re-seeded from them), else random init."""
        load_path = self.cfg.checkpoint.load_path
        if load_path:
            self.init_note = _load_base(self.model, load_path, self.cfg.checkpoint.keys_to_skip_loading, self.dtype)
            if self.ema is not None:
                net = {canonical_name(n): p.detach() for n, p in self.model.named_parameters()}
                self.ema.load_state_dict({"num_updates": 0, "shadow": net})
        self._print_model()

    def _print_model(self) -> None:
        if not self.main_rank:
            return
        print(f"onecard: model {self.n_total:,} params, trainable {self.n_train:,} ({len(self.trainable)} tensors) by "
              f"keys_to_select {self.cfg.optimizer.keys_to_select}; {self.dtype}; {self.init_note}")
        vae = ("not on the GPU in training: latents from the cache (lever 4)" if self.latents is not None
               else "parked on host (lever)" if self.offload is not None else f"resident on {self.device}")
        print(f"onecard: {self.vae_note}; VAE {vae}; EMA {self.ema_note}; dataset {self.ds_root} "
              f"({len(self.records)} rows); cap {self.cap}, grad_accum_iter {self.ga}")
        text = "; text stream detached ([onecard] detach_text_stream)" if is_detached(self.model) else ""
        if self.text_kv is not None:
            text += "; text keys and values from a per-caption cache ([onecard] text_kv_cache)"
        print(f"onecard: attention {self.cfg.onecard.attention} ([onecard].attention); blocks {self.compile_note}{text}")

    def checkpoint_bytes(self) -> int:
        """One checkpoint file: net, fp32 net_ema and the AdamW moments (the ledger's estimate, after preflight)."""
        ledger = getattr(self, "ledger", None)
        return ledger.checkpoint_bytes if ledger is not None else 0

    def save_scope(self):
        """The whole save (state and file) is the memory timeline's ``checkpoint`` phase: its host peak is the save's."""
        return self.mem.phase("checkpoint")

    def save_due(self, done: int) -> bool:
        return not self.args.no_save and (done % self.cfg.checkpoint.save_iter == 0 or done == self.max_steps)

    def saves_between(self, start: int, end: int) -> int:
        """Every ``save_iter`` and the last step, by arithmetic (:meth:`save_due`)."""
        if self.args.no_save or end <= start:
            return 0
        every = self.cfg.checkpoint.save_iter
        regular = end // every - start // every
        return regular + (0 if end % every == 0 or end != self.max_steps else 1)

    # ------------------------------------------------------------ 5. the loop
    def _fill_text_kv(self) -> None:
        """The text K/V cache's pre-pass (``[onecard] text_kv_cache``): every text the loader can yield, through the
        model as it stands now (after a warm start or a resume), each with a one-token stand-in latent."""
        forward_inputs = functools.partial(
            attention.prepass_inputs, self.model.config, dtype=self.dtype, device=self.device, impl=self.cfg.onecard.attention,
            ids_device=torch.device("cpu") if self.host_tables is not None else None)

        n = self.text_kv.fill(self.model, self.proc, (self._und_ids(ids) for ids in self.source.all_text_ids()),
                              forward_inputs, progress=self.main_rank)  # resets the GPU's peak: _begin resets it again
        if self.main_rank and n:
            print(f"onecard: {self.text_kv.line()}", flush=True)

    def _und_ids(self, text_ids: list[int]) -> list[int]:
        """A sample's und token ids: its ``text_ids``, then EOS and the vision start/end markers."""
        tok = self.tokenizer
        return text_ids + [tok.eos_id, tok.vision_start_id, tok.vision_end_id]

    def _begin(self) -> None:
        """Before the first step of this process: the text K/V pre-pass, data position, prefetch, peak reset, memory
        sampler."""
        if self.text_kv is not None:
            self._fill_text_kv()
        it = iter(self.loader)
        for _ in range(self.consumed):  # fast-forward to where the checkpoint stopped (decoding is lazy)
            next(it)
        pin = self.device.type == "cuda"

        def cached(item):  # lever 4: the threads read latents instead of decoding videos (pinned: async to the GPU)
            k, batch = item
            latents = [self.latents.get(CacheItem(s.video_path, s.window, s.size)) for s in batch]
            shapes = [x.shape for x in latents]
            flat = _flat(latents, pin)  # one copy to the GPU, not one per sample
            # the micro-batch's host inputs too (noise, sigmas, positions, segments): off the main thread
            host = self._host_inputs(*divmod(k, self.ga), batch, shapes) if self.prepare_ahead else None
            return batch, (flat, shapes), host

        def decoded(item):  # the next micro-batches' videos decode on the threads
            _, batch = item
            for s in batch:
                s.load_video()
            return batch, None, None

        self._it = prefetched(enumerate(it, start=self.consumed), cached if self.latents is not None else decoded,
                              workers=max(1, min(8, cores() - 1)), depth=PREFETCH_DEPTH,
                              threads=self.background_threads)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.mem = MemorySampler(self.device, interval_s=self.sample_s).start()
        self._stack.callback(self.mem.stop)
        self.peak_rss = host_rss()
        self.micro_times: list[float] = []
        """Seconds per micro-batch: on a GPU the time between consecutive micro-batch ends on the GPU's stream (the
        host runs ahead: it prepares the next micro-batch while the GPU still computes this one); on the CPU the wall
        time."""
        self.ema_wait_s: list[float] = []
        self.trained = True

    def train_step(self, step: int) -> StepResult:
        """``grad_accum_iter`` packed micro-batches, the optimizer step, the EMA update."""
        if self._it is None:
            self._begin()
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.ga + 1)] if cuda else []
        if cuda:
            ends[0].record()
        n_samples, losses = 0, []
        for micro in range(self.ga):
            n, loss = self._micro_batch(step, micro)
            n_samples += n
            losses.append(loss)
            if cuda:
                ends[micro + 1].record()
        self._optimizer_step(step)
        self._sync()
        seconds = time.perf_counter() - t0
        if cuda:
            self.micro_times += [a.elapsed_time(b) / 1e3 for a, b in zip(ends, ends[1:])]
        loss_sum = 0.0
        for loss in losses:  # read once the step is done: no micro-batch waits for the GPU (the same float sum)
            loss_sum += float(loss)
        self.done = step + 1
        self.peak_rss = max(self.peak_rss, host_rss())
        peak_gib = torch.cuda.max_memory_allocated(self.device) / GiB if self.device.type == "cuda" else 0.0
        ema_beta = f"{self.ema.last_beta:.4f}" if self.ema is not None else "off"
        self.log_metrics(self.done, loss=loss_sum, lr=self.last_lr, grad_norm=float(self.last_grad_norm),
                         step_s=seconds, samples_per_s=n_samples / seconds if seconds > 0 else None)
        return StepResult(loss=loss_sum, samples=n_samples, seconds=seconds,
                          postfix={"peak_gib": f"{peak_gib:.2f}", "ema_beta": ema_beta})

    def _host_inputs(self, iteration: int, micro: int, batch: list, shapes: list[torch.Size]) -> HostInputs:
        """Micro-batch ``micro`` of step ``iteration``'s host inputs: the seeded sigmas and noise (pinned on a GPU
        run) and :func:`~cosmos_framework_ext.recipe.attention.host_layout`. It touches no GPU tensor and no
        trainer state, so a loader thread may build it ahead (:meth:`_begin`) while the GPU computes."""
        cuda = self.device.type == "cuda"
        sigmas, noise = _sample_noise(self.cfg.onecard.seed, iteration, micro, shapes)
        noise = _flat(noise, pin=cuda)  # the same draws, concatenated
        if cuda:
            sigmas = sigmas.pin_memory()
        text = [self._und_ids(s.text_ids) for s in batch]
        layout = attention.host_layout(self.model.config, text, shapes, sigmas, [s.record.fps for s in batch], pin=cuda)
        text_kv = self.text_kv.gather(text) if self.text_kv is not None else None
        return HostInputs((iteration, micro), text, sigmas, noise, layout, text_kv)

    def _micro_batch(self, iteration: int, micro: int) -> tuple[int, torch.Tensor]:
        """Encode, noise, forward and backward one packed micro-batch; returns (samples, the loss as a 0-d tensor).

        Nothing here waits for the GPU: host tensors reach it from pinned memory, and the loss is read only after
        the optimizer step (:meth:`train_step`), so the host prepares the next micro-batch while the GPU computes.
        With the latent cache the host inputs come ready from a loader thread (:meth:`_host_inputs`), built for
        the (iteration, micro-batch) this call trains; any other key is rebuilt here, the same way."""
        t0 = time.perf_counter()
        batch, stored, host = next(self._it)
        self.consumed += 1
        device, mem = self.device, self.mem
        with mem.phase("encode"), self.vae_on_device(), torch.no_grad():
            if stored is not None:  # lever 4: the stored output of the same online_latent call, concatenated
                flat, shapes = stored
                x0 = to_device(flat, device).float()
            else:
                encoded = [online_latent(self.vae, s.video, device, self.vae_dtype).float() for s in batch]
                shapes = [x.shape for x in encoded]
                x0 = torch.cat([x.reshape(-1) for x in encoded])
        if host is not None and host.key == (iteration, micro):
            self.inputs_built["loader_threads"] += 1
        else:
            host = self._host_inputs(iteration, micro, batch, shapes)
            self.inputs_built["main_thread"] += 1
        sizes = [math.prod(s) for s in shapes]  # each sample's values in the concatenated latents
        xt_flat, v_flat = packed_flow_matching_inputs(x0, to_device(host.noise, device), host.sigmas, sizes)
        xt = [a.view(s) for a, s in zip(xt_flat.to(self.dtype).split(sizes), shapes)]
        targets = [v.view(s) for v, s in zip(v_flat.split(sizes), shapes)]
        kwargs, self.proc.segments = attention.build_packed_inputs(
            self.model.config, host.text_ids, xt, host.sigmas, [s.record.fps for s in batch], device,
            impl=self.cfg.onecard.attention, layout=host.layout,
            ids_device=torch.device("cpu") if self.host_tables is not None else None,
        )
        if self.text_kv is not None:  # lever: this micro-batch's cached text keys and values, copied on a side stream
            self.text_kv.current = self.text_kv.upload(host.text_kv, device)
        with mem.phase("forward"):
            preds = self.model(**kwargs).sample
            loss = micro_batch_loss(preds, targets, self.cfg.onecard.loss_scale, self.ga)
        with mem.phase("backward"):
            loss.backward()
        self.proc.segments = None
        if self.text_kv is not None:
            self.text_kv.current = None
        if device.type != "cuda":
            self.micro_times.append(time.perf_counter() - t0)
        return len(batch), loss.detach()

    def _optimizer_step(self, iteration: int) -> None:
        """Grad clip + AdamW + schedule, then the EMA update (its critical-path time is recorded)."""
        # EMA on the critical path: for the CPU subset, waiting for the previous host lerp (if the
        # micro-batches did not hide it) plus issuing the copies; on the device, the update itself.
        wait = self.ema.synchronize() if self.ema is not None else 0.0
        gc = self.cfg.trainer.callbacks.grad_clip
        with self.mem.phase("optimizer"):
            self.last_grad_norm = grad_clip(self.params, gc.clip_norm, gc.force_finite)
            self.last_lr = self.opt.param_groups[0]["lr"]  # the lr this step used
            self.opt.step()
            self.sched.step()
        if self.ema is not None:
            beta = power_ema_beta(iteration, self.gamma, self.cfg.model.ema.iteration_shift)
            self._sync()
            te = time.perf_counter()
            with self.mem.phase("ema"):
                self.ema.step(beta)
            self.ema_wait_s.append(wait + time.perf_counter() - te)
        self.opt.zero_grad(set_to_none=True)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------ 6. the summary
    def summary(self, start: int, results: list[StepResult], checkpoint: Path | None) -> dict[str, Any]:
        """What the run did: steps, drops, EMA, VAE offload, timings, memory peaks (and the timeline files)."""
        if self.ema is not None:
            self.ema.synchronize()
        self.mem.stop()
        timeline = self.mem.write(self.run_dir) if self.main_rank else {}
        step_times = [r.seconds for r in results]
        mem_peaks = self.mem.peaks()
        # host RSS read after each step misses the peak inside it; the sampler's 0.5 s samples catch most of it
        peak_rss = max(self.peak_rss, mem_peaks.get("host_rss_bytes") or 0)
        return run_summary(
            recipe=self.recipe_name, preset=self.preset.name, device=self.device, world_size=self.world,
            unit=self.unit, steps=self.max_steps - start, optimizer_steps_total=self.max_steps, resumed_from=start,
            reached=self.max_steps, losses=[r.loss for r in results],
            s_per_step_median=median(step_times[1:] or step_times), peak_host_rss_gib=peak_rss / GiB,
            pinned_bytes=pinned_bytes_total(), checkpoint=checkpoint,
            grad_accum_iter=self.ga,
            cap=self.cap,
            samples_per_optimizer_step=[r.samples for r in results],
            drops=self.loader.dropped_count,
            captions_truncated=self.captions_truncated,
            ema=self._ema_summary(),
            vae_offload=None if self.offload is None else dict(self.offload.stats),
            master_dtype=str(self.master_dtype).replace("torch.", ""),
            optim_offload=None if self.optim_offload is None else dict(
                self.optim_offload.stats, groups=len(self.optim_offload.groups), pinned_bytes=self.optim_offload.pinned_bytes),
            frozen_bf16=None if self.frozen is None else {
                "tensors": len(self.frozen.names), "device_bytes_saved": self.frozen.device_bytes_saved,
                "host_bytes": self.frozen.host_bytes},
            latent_cache=self.cache_report,
            text_kv_cache=None if self.text_kv is None else {
                "captions": len(self.text_kv.rows), "tokens": self.text_kv.store.shape[2],
                "host_bytes": self.text_kv.bytes, "prepass_s": self.text_kv.seconds,
                "prepass_peak_gpu_bytes": self.text_kv.prepass_peak_bytes, "micro_batches": self.text_kv.micro_batches},
            s_per_micro_batch_median=median(self.micro_times[self.ga:] or self.micro_times),
            ledger=summary_line(self.ledger),
            flags=self.flags,
            memory=mem_peaks,
            timeline={k: str(v) for k, v in timeline.items()},
            init=self.init_note,
            attention=self.cfg.onecard.attention,
            compile=self.compile_note,
            text_stream_detached=is_detached(self.model),
            checkpoint_layers=self.checkpoint_layers,
            host_inputs_built=dict(self.inputs_built),
            background_threads=self.background_threads,
            host_tables=None if self.host_tables is None else {"names": self.host_tables.names,
                                                               "host_bytes": self.host_tables.host_bytes},
            offload=None if self.act_offload is None else {
                "layers": len(self.act_offload.offloaded), "host_bytes": self.act_offload.host_bytes,
                "tensors_per_micro_batch": self.act_offload.moved[0],
                "bytes_per_micro_batch": self.act_offload.moved[1]},
        )

    def _ema_summary(self) -> dict[str, Any] | None:
        if self.ema is None:
            return None
        return {"kind": type(self.ema).__name__, "placement": self.ema.placement, "last_beta": self.ema.last_beta,
                "gamma": self.gamma, "num_updates": self.ema.num_updates,
                "critical_path_s_median": median(self.ema_wait_s)}


# ------------------------------------------------------------------------------------------- entry points
def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train as ``args`` and the environment say; returns the summary (also written as ``summary.json``).

    With ``--validate-only``: check the inputs, print the ledger, return ``{"validated": True}``.
    Background helpers (memory sampler, EMA worker) are stopped whether the run ends or raises.

    Raises:
        UserError: bad input (TOML, flags, paths, dataset), before anything is written.
    """
    recipe = CosmosSFT(args)
    if args.validate_only:
        skeleton.preflight(recipe)  # the recipe's checks, then the resume's settings against the checkpoint's
        return {"validated": True}
    summary = skeleton.run(recipe)
    if recipe.main_rank and recipe.trained:
        print(json.dumps({k: summary[k] for k in ("steps", "reached", "drops", "peak_gpu_allocated_gib", "peak_host_rss_gib",
                                                   "pinned_bytes", "checkpoint")}))
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m cosmos_framework_ext.recipe.train", description=__doc__.split("\n")[0])
    ap.add_argument("--sft-toml", required=True, help="recipe TOML (upstream SFT schema + [onecard])")
    ap.add_argument("--max-iter", type=int, default=0, help="override [trainer].max_iter (0 = keep)")
    ap.add_argument("--no-save", action="store_true", help="write no checkpoint (benchmarks)")
    ap.add_argument("--videos-checked", action="store_true",
                    help="skip decoding each video's first and last needed frame (the launcher passes it to the "
                         "ranks: its --validate-only step did it once)")
    ap.add_argument("--validate-only", action="store_true",
                    help="check the TOML, flags, paths, output folder, checkpoints, dataset rows and videos, print "
                         "the memory ledger, and exit (0 ok, 2 bad input); writes nothing")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    def train() -> None:
        run(args)

    try:
        return cli(train, interrupted="checkpoints already written are kept; run the same command to resume from the "
                                      "newest (without one, it starts again from iteration 0)")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
