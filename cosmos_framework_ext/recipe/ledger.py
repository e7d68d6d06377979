"""The Cosmos3-Edge recipe's memory ledger (the table is :mod:`patches.core.ledger`; the command line
``python -m patches.ledger`` runs :func:`main` here).

Exact components come from the model built on the meta device and from the dtypes the trainer uses:

- weights: every parameter, in the parameter dtype (bf16 on a GPU, fp32 on the CPU);
- gradients: the trainable subset, parameter dtype;
- AdamW: ``exp_avg`` + ``exp_avg_sq`` per trainable parameter in its dtype, plus one 4-byte ``step``
  tensor per trainable tensor;
- EMA: stock = fp32 clone of every parameter on the GPU; lever = fp32 host copy of the trainable subset
  plus a staging copy in the parameter dtype, both pinned;
- VAE: its parameters in bf16, on the GPU (resident) or pinned on the host (lever 2); with the latent cache
  (lever 4) nothing: training reads latents from disk, and the VAE is on the GPU only in the pre-pass that runs
  before training, when no activations, gradients or optimizer state exist yet, and is freed after it.

Activations are modelled, not counted: ``ACT_FIXED + ACT_PER_TOKEN_LAYER_HIDDEN x tokens x layers x
hidden`` bytes with ``tokens = cap - 1`` (the fit rule is strict), full activation checkpointing. The two
constants were fitted to the measured peaks of the edge preset's ``MEMTEST`` (cap 12288) and ``EMAVAL`` (cap 6144)
runs with both levers on, over the exact static components (``docs/ledger.md`` has the runs). Allocator slack
(reserved over allocated) is taken as 10 %.
"""

from __future__ import annotations

import dataclasses

import functools
import os
import re
import sys
from typing import Any, Iterable

import torch

from patches.core.device import gpu_memory_cap_gib
from patches.core.streamsave import CHUNK_BYTES
from patches.core.errors import ArgumentParser, UserError
from patches.core import flags as flagmod
from patches.core.flags import EMA_CPU_SUBSET, FROZEN_BF16, LATENT_CACHE, OPTIM_STATE_OFFLOAD, VAE_CPU_OFFLOAD
from patches.core.ledger import Item, Ledger, parse_budget
from patches.core.runtime import GiB

from cosmos_framework_ext.recipe import config as cfgmod
from cosmos_framework_ext.recipe.config import SFTConfig
from cosmos_framework_ext.levers.attention_varlen import check_varlen
from patches.core.threads import background_threads
from cosmos_framework_ext.levers.frozen_bf16 import check_with_ema
from cosmos_framework_ext.levers.host_embeddings import check_host_embeddings
from cosmos_framework_ext.levers.text_kv_cache import check_text_kv_cache, text_stream_params
from cosmos_framework_ext.levers.text_stream import check_text_stream
from cosmos_framework_ext.levers.selective_ac import kept_attention_bytes
from cosmos_framework_ext.recipe.presets import PRESETS, build_transformer, build_vae, get_preset, select_trainable

ACT_FIXED = int(0.79 * GiB)
"""bytes: activation-phase transients that do not scale with tokens (fitted, see module docstring)."""
ACT_PER_TOKEN_LAYER_HIDDEN = 2.97
"""bytes per token x layer x hidden unit under full activation checkpointing (fitted)."""
ACT_UNCHECKPOINTED_PER_TOKEN_HIDDEN = 30.4
"""bytes per token x hidden unit that a decoder layer left out of activation checkpointing (``[onecard]
checkpoint_layers``) keeps beyond a checkpointed one: every activation its backward needs. Fitted on the H200
(2026-12-04, edge preset, cap 12288, selective, compiled): 8 layers left out added 5.32 GiB of peak allocated
(0.665 GiB a layer, plus the 0.048 GiB of kept attention outputs a checkpointed layer would hold)."""
AUTO_HEADROOM = 2 * GiB
"""bytes ``checkpoint_layers = "auto"`` leaves free below the budget beyond the ledger's reserved peak: under a cap the
caching allocator's reserved memory ran 1.25-1.28x the allocated peak on the H200, and a plan that reaches the cap
makes the allocator free and retry (the 2026-12-04 row at 20 layers reserved 22.04 of 22.06 GiB)."""
ATTENTION_OP_NAMES = {"dense": "aten._scaled_dot_product_efficient_attention.default", "flex": "flex_attention",
                      "varlen": "aten._flash_attention_forward.default"}
"""``[onecard] attention`` -> the embedded trainer's attention op on the GPU as the selective policy sees it: a
``save_ops_regex`` that matches the run's op keeps the attention outputs (and the ledger counts them)."""
CUDA_CONTEXT = int(0.55 * GiB)
"""bytes: CUDA context + cuBLAS/cuDNN workspaces outside the caching allocator (typical on Hopper)."""
OPTIM_GROUP_BYTES = 256 << 20
"""bytes: the optimizer-state lever's stream-group size (``OptimStateOffload``'s default ``group_bytes``)."""
HOST_BASELINE = int(3.0 * GiB)
"""bytes: host RSS of a GPU run's process before the levers' buffers (torch, CUDA libraries, decoded-clip cache),
measured on the H200 machine."""
HOST_BASELINE_CPU = int(0.75 * GiB)
"""bytes: the same for a CPU run (torch without the CUDA libraries, clip cache): an estimate from the CPU smoke run's
0.80 GiB peak, not a measurement of the machine it runs on."""


HOST_TABLES = ("embed_tokens.weight", "lm_head.weight")
"""The parameters ``[onecard] host_embeddings`` keeps on the host (:mod:`cosmos_framework_ext.levers.host_embeddings`)."""


def _counts(preset_name: str, keys: list[str]) -> dict[str, int]:
    """Parameter counts and shapes of the preset (a copy of :func:`_counts_of`'s cached answer)."""
    return dict(_counts_of(preset_name, tuple(keys)))


@functools.lru_cache(maxsize=8)
def _counts_of(preset_name: str, keys: tuple[str, ...]) -> dict[str, int]:
    preset = get_preset(preset_name)
    model = build_transformer(preset, device="meta")
    names = [n for n, _ in model.named_parameters()]
    trainable = set(select_trainable(names, list(keys)))
    params = dict(model.named_parameters())
    vae = build_vae(preset, device="meta")
    return {
        "all": sum(p.numel() for p in params.values()),
        "train": sum(params[n].numel() for n in trainable),
        "train_tensors": len(trainable),
        "buffers": sum(b.numel() * 4 for b in model.buffers()),
        "vae": sum(p.numel() for p in vae.parameters()),
        "layers": preset.transformer["num_hidden_layers"],
        "hidden": preset.transformer["hidden_size"],
        "heads": preset.transformer["num_attention_heads"],
        "head_dim": preset.transformer["head_dim"],
        "layer": sum(p.numel() for p in model.layers[0].parameters()),
        "largest_train": max((params[n].numel() for n in trainable), default=0),
        "largest": max((p.numel() for p in params.values()), default=0),
        "tables": sum(params[n].numel() for n in HOST_TABLES if n in params),
        "tables_train": sorted(n for n in HOST_TABLES if n in trainable),
        "text_train": text_stream_params(sorted(trainable)),
        "kv_dim": preset.transformer["num_key_value_heads"] * preset.transformer["head_dim"],
    }


def offload_reserve_bytes(tokens: int, hidden: int) -> int:
    """Bytes one uncheckpointed decoder layer keeps for a micro-batch of ``tokens`` tokens (the fitted
    ``ACT_UNCHECKPOINTED_PER_TOKEN_HIDDEN`` bytes per token and hidden unit): the GPU line of the uncheckpointed layers,
    and the host bytes the trainer reserves per offloaded layer (at most what it moves: the small tensors that stay
    on the GPU are in it too)."""
    return int(ACT_UNCHECKPOINTED_PER_TOKEN_HIDDEN * tokens * hidden)


def _activation_items(cfg: SFTConfig, c: dict[str, Any], tokens: int, b: int, device_type: str,
                      checkpoint_layers: int | None) -> tuple[list[Item], int]:
    """The activation lines (on the GPU, or the host on a CPU run) and the checkpointed layers they price: the fitted
    full-checkpointing model, the layers left out of checkpointing, and selective checkpointing's kept attention
    outputs of the checkpointed layers."""
    ac = cfg.model.activation_checkpointing
    on_gpu = lambda n: (n, 0) if device_type == "cuda" else (0, n)  # noqa: E731 - activations live where compute runs
    act = ACT_FIXED + int(ACT_PER_TOKEN_LAYER_HIDDEN * tokens * c["layers"] * c["hidden"])
    items = [Item("activations + transients", *on_gpu(act),
                  note=f"{tokens:,} tokens x {c['layers']} layers x {c['hidden']} hidden, full AC (fitted)")]
    ckpt_layers = c["layers"] if ac.mode == "none" else _checkpoint_layers(cfg, c["layers"], checkpoint_layers)
    if ac.mode == "none" or ckpt_layers < c["layers"]:
        plain = c["layers"] - ckpt_layers
        extra = offload_reserve_bytes(tokens, c["hidden"]) * plain
        items.append(Item("activations of uncheckpointed layers", *on_gpu(extra),
                          note=f"{plain} of {c['layers']} layers keep every activation ([onecard] checkpoint_layers "
                          f"{ckpt_layers}; fitted)" if ac.mode != "none" else "mode none: every layer (fitted)"))
    op = ATTENTION_OP_NAMES[cfg.onecard.attention]
    if ac.mode == "selective" and ckpt_layers and any(re.search(p, op) for p in ac.save_ops_regex):
        kept = kept_attention_bytes(tokens, ckpt_layers, c["heads"], c["head_dim"], b)
        items.append(Item("kept attention outputs (selective AC)", *on_gpu(kept),
                          note=f"{ckpt_layers} layers x {tokens:,} tokens x {c['heads']} heads x (head_dim {c['head_dim']} + lse)"))
    offloaded = min(cfg.onecard.offload_layers, ckpt_layers) if ac.mode != "none" else 0
    if offloaded:  # on the GPU each is priced as a checkpointed layer: its copies in flight hold about as much
        host = offload_reserve_bytes(tokens, c["hidden"]) * offloaded
        items.append(Item("offloaded layers' activations", 0, host, pinned=device_type == "cuda",
                          note=f"{offloaded} of the {ckpt_layers} checkpointed layers keep every activation on the "
                          "host instead ([onecard] offload_layers; fitted per layer as uncheckpointed)"))
        # they all come back when the backward reaches the last checkpointed layer: by then the uncheckpointed layers
        # have freed theirs; the ones they leave no room for are priced as uncheckpointed
        back = max(0, offloaded - (c["layers"] - ckpt_layers))
        if back:
            items.append(Item("offloaded layers copied back early", *on_gpu(offload_reserve_bytes(tokens, c["hidden"]) * back),
                note=f"{back} offloaded layers back on the GPU before as many uncheckpointed layers freed theirs"))
    return items, ckpt_layers


def cosmos_ledger(
    cfg: SFTConfig,
    preset_name: str,
    flags: dict[str, bool],
    world_size: int = 1,
    device_type: str = "cuda",
    cap: int | None = None,
    grad_accum_iter: int | None = None,
    checkpoint_layers: int | None = None,
    text_tokens: tuple[int, int] | None = None,
) -> Ledger:
    """The ledger of one rank of the Cosmos3-Edge recipe.

    Args:
        cfg: the recipe TOML.
        preset_name: ``edge`` or ``tiny``.
        flags: lever flags by env-variable name (:func:`patches.core.flags.read_all`).
        world_size: ranks; FSDP2 shards weights, gradients and optimizer state evenly.
        device_type: ``cuda`` (bf16 parameters when the TOML says bfloat16) or ``cpu`` (fp32).
        cap: packing cap to size activations for (default: the TOML's ``max_sequence_length``).
        grad_accum_iter: shown in the title (default: the TOML's; the CPU smoke run replaces it).
        checkpoint_layers: decoder layers activation-checkpointed (default: ``[onecard] checkpoint_layers`` when it
            is a number, every layer for ``"all"`` and ``"auto"``; :func:`resolve_checkpoint_layers` resolves
            ``"auto"``).
        text_tokens: for ``[onecard] text_kv_cache``, ``(distinct text tokens the cache holds, text tokens of one
            micro-batch)``, from the dataset (the trainer counts them); ``None``: the cache's host line is left
            unpriced and says so.

    Raises:
        ValueError: unknown preset, or ``keys_to_select`` empty / matching nothing; a setting the trainer refuses
            too (the lookup tables on the host, the detached text stream, the text K/V cache, ``attention = "varlen"`` computing in fp32
            on a GPU, more background threads than the cores).
        UserError: ``COSMOS_FROZEN_BF16=1`` with the stock device EMA (:func:`frozen_bf16.check_with_ema`), which
            the trainer refuses too.
    """
    if world_size < 1:
        raise ValueError(f"world size {world_size} must be >= 1")
    bf16 = device_type == "cuda" and cfg.model.precision == "bfloat16"
    b = 2 if bf16 else 4
    # upstream HEAD's dtypes: fp32 master (weights, gradients, AdamW state), compute in bf16 through FSDP2
    mb = 4 if (bf16 and cfg.model.parallelism.fsdp_master_dtype == "float32") else b
    mixed = mb != b
    ema_on, ema_lever = cfg.model.ema.enabled, flags.get(EMA_CPU_SUBSET.name, False)
    frozen_lever = flags.get(FROZEN_BF16.name, False) and mixed
    check_with_ema(frozen_lever, ema_on, ema_lever)  # the trainer's own refusal, so DRYRUN does not price it
    c = _counts(preset_name, cfg.optimizer.keys_to_select)  # builds the model on the meta device (seconds)
    _check_as_the_trainer(cfg, c, preset_name, world_size, mixed, checkpoint_layers, device_type, bf16)
    cap = cap or cfg.dataloader_train.max_sequence_length
    at = _At(c=c, b=b, mb=mb, dt="bf16" if mb == 2 else "fp32", world=world_size, cuda=device_type == "cuda",
             tables_on_host=cfg.onecard.host_embeddings and device_type == "cuda" and world_size == 1 and not mixed)
    acts, ckpt_layers = _activation_items(cfg, c, cap - 1, b, device_type, checkpoint_layers)
    items = [_weights_item(at, frozen_lever)]
    if mixed:
        unsharded = (c["all"] - c["layers"] * c["layer"] + 2 * c["layer"]) * b
        items.append(Item("FSDP2 bf16 compute copies", unsharded,
                          note="root unit + 2 decoder layers gathered in bf16 (MixedPrecisionPolicy)"))
    items += _optimizer_items(at, flags.get(OPTIM_STATE_OFFLOAD.name, False), acts)
    items += _ema_and_vae_items(at, ema_on, ema_lever, flags)
    items += acts
    items += _host_items(at, ema_on)
    if cfg.onecard.text_kv_cache:
        items += _text_kv_items(at, text_tokens)
    outside = [Item("CUDA context", CUDA_CONTEXT if at.cuda else 0, note="outside the allocator budget")]
    levers = [f.name + "=1" for f in (EMA_CPU_SUBSET, VAE_CPU_OFFLOAD, LATENT_CACHE, OPTIM_STATE_OFFLOAD, FROZEN_BF16)
              if flags.get(f.name)]
    if at.tables_on_host:
        levers.append("host_embeddings")
    if cfg.model.activation_checkpointing.mode != "none" and ckpt_layers < c["layers"]:
        levers.append(f"checkpoint_layers {ckpt_layers}")
    title = (f"memory ledger: preset {preset_name}, cap {cap}, grad_accum_iter {grad_accum_iter or cfg.trainer.grad_accum_iter}, "
             f"EMA {'on' if ema_on else 'off'}, {', '.join(levers) or 'no levers'}, {world_size} rank(s), {device_type}, "
             f"master {at.dt}" + (" (compute bf16)" if mixed else ""))
    # one checkpoint file: full net (stored dtype), net_ema fp32 for every net key, AdamW moments of the trainable subset
    ckpt = c["all"] * mb + c["buffers"] + (c["all"] * 4 if ema_on else 0) + c["train"] * 2 * mb + c["train_tensors"] * 8
    return Ledger(title, items, outside, checkpoint_bytes=ckpt)


def _check_as_the_trainer(cfg: SFTConfig, c: dict[str, int], preset_name: str, world_size: int, mixed: bool,
                          checkpoint_layers: int | None, device_type: str, bf16: bool) -> None:
    """The settings the trainer refuses, refused here too, so that DRYRUN prices no run the trainer would not start.

    Raises:
        ValueError: the lookup tables on the host, the detached text stream or the text K/V cache with a trainable
            weight they need frozen; offloaded layers the trainer refuses; ``attention = "varlen"`` in fp32 on a GPU;
            more background threads than the cores.
    """
    check_host_embeddings(cfg.onecard.host_embeddings, c["tables_train"], world_size, mixed)
    check_text_stream(cfg.onecard.detach_text_stream, c["tables_train"])
    check_text_kv_cache(cfg.onecard.text_kv_cache, c["text_train"])
    check_offload_layers(cfg, preset_name, world_size, mixed, checkpoint_layers)
    check_varlen(cfg.onecard.attention, device_type, torch.bfloat16 if bf16 else torch.float32)
    try:
        background_threads(cfg.onecard.background_threads, 1, gpu=device_type == "cuda")
    except ValueError as e:
        raise ValueError(f"{cfg.source}: [onecard] {e}") from None


@dataclasses.dataclass(frozen=True)
class _At:
    """What every line of one ledger is priced at: the model's counts (:func:`_counts`), the compute and master
    bytes per parameter (``b``, ``mb``; ``dt`` names the master's), the ranks, the device and where the tables live."""

    c: dict[str, int]
    b: int
    mb: int
    dt: str
    world: int
    cuda: bool
    tables_on_host: bool

    def shard(self, n: int) -> int:
        """One rank's part of ``n`` (FSDP2 shards evenly; ceil division)."""
        return -(-n // self.world)


def _weights_item(at: _At, frozen_lever: bool) -> Item:
    """The parameters on the GPU: every one in the master dtype, or the frozen ones as bf16 (lever 6), or all but
    the lookup tables (``host_embeddings``)."""
    c, frozen = at.c, at.c["all"] - at.c["train"]
    if frozen_lever:
        return Item("weights (frozen bf16, lever)", at.shard(frozen) * at.b + at.shard(c["train"]) * at.mb + c["buffers"],
                    at.shard(frozen) * 4, note=f"{frozen:,} frozen bf16 on the GPU (fp32 on the host), "
                    f"{c['train']:,} trainable {at.dt}")
    if at.tables_on_host:
        return Item("weights (lookup tables on the host, lever)", (c["all"] - c["tables"]) * at.mb + c["buffers"],
                    c["tables"] * at.mb, note=f"{c['all']:,} params {at.dt}; embed_tokens + lm_head "
                    f"({c['tables']:,}) on the host")
    return Item("weights", at.shard(c["all"]) * at.mb + c["buffers"], note=f"{c['all']:,} params {at.dt}"
                + (f", 1/{at.world} shard" if at.world > 1 else ""))


def _optimizer_items(at: _At, optim_lever: bool, acts: list[Item]) -> list[Item]:
    """Gradients and AdamW's moments (streamed by lever 5: only the groups in flight, and only beyond ``acts``)."""
    c, mb, dt = at.c, at.mb, at.dt
    state = at.shard(c["train"]) * 2 * mb
    items = [Item("gradients", at.shard(c["train"]) * mb, note=f"trainable {c['train']:,} params {dt}")]
    if optim_lever:  # the groups in flight live only inside the optimizer step, after every activation is freed
        in_flight = min(state, 3 * max(OPTIM_GROUP_BYTES, 2 * mb * c["largest_train"]))
        beyond = max(0, in_flight - sum(i.gpu_bytes for i in acts))
        items.append(Item("AdamW state (streamed, lever)", beyond + c["train_tensors"] * 4, state, pinned=True,
                          note=f"exp_avg + exp_avg_sq {dt} in a pinned host arena; <= 3 stream groups "
                          f"({in_flight / GiB:.2f} GiB) on the GPU in the optimizer step only, when the activations "
                          "are freed"))
    else:
        items.append(Item("AdamW state", state + c["train_tensors"] * 4,
                          note=f"exp_avg + exp_avg_sq {dt}, step fp32 x {c['train_tensors']} tensors"))
    return items


def _ema_and_vae_items(at: _At, ema_on: bool, ema_lever: bool, flags: dict[str, bool]) -> list[Item]:
    """The EMA (stock fp32 clone, or lever 1's host subset) and the VAE (resident, parked, or gone after lever 4's
    pre-pass)."""
    c = at.c
    if ema_on and ema_lever:
        ema = Item("EMA (CPU subset, lever)", 0, at.shard(c["train"]) * (4 + at.mb), pinned=True,
                   note=f"fp32 trainable subset + {at.dt} staging, pinned host")
    elif ema_on:
        ema = Item("EMA (stock, fp32 clone)", at.shard(c["all"]) * 4, note="every parameter, fp32, on the GPU")
    else:
        ema = Item("EMA", 0, note="disabled in the TOML")
    vae_bytes = c["vae"] * (2 if at.cuda else 4)
    if flags.get(LATENT_CACHE.name, False):
        vae = Item("Wan2.2 VAE (latent cache, lever 4)", 0,
                   note=f"{c['vae']:,} params: on the GPU only in the pre-pass before training, then freed")
    elif flags.get(VAE_CPU_OFFLOAD.name, False):
        vae = Item("Wan2.2 VAE (parked, lever)", 0, vae_bytes, pinned=True,
                   note=f"{c['vae']:,} params, on the GPU only while a micro-batch encodes")
    else:
        vae = Item("Wan2.2 VAE (resident)", vae_bytes, note=f"{c['vae']:,} params")
    return [ema, vae]


TEXT_KV_IN_FLIGHT = 3
"""Micro-batches whose gathered text keys and values are alive at once: the one training and the loader's two ahead
(:func:`patches.core.data.prefetch.prefetched`, depth 2)."""


def _text_kv_items(at: _At, text_tokens: tuple[int, int] | None) -> list[Item]:
    """``[onecard] text_kv_cache``: the cache (every distinct text's keys and values, compute dtype, pageable) and the
    gathered micro-batches in flight (pinned on a GPU run), on the host; on the GPU, the next micro-batch's keys and
    values, copied on a side stream while this one trains (:meth:`TextKVCache.upload`). The training micro-batch's
    own replace the text stream's, which the activations line prices."""
    per_token = at.c["layers"] * 2 * at.c["kv_dim"] * at.b
    if text_tokens is None:
        return [Item("text K/V cache (lever)", 0, note=f"{per_token / 1024:.1f} KiB per distinct text token: the "
                     "trainer prices it from the dataset's captions")]
    tokens, per_micro = text_tokens
    return [Item("text K/V cache (lever)", 0, tokens * per_token,
                 note=f"{tokens:,} distinct text tokens, {per_token / 1024:.1f} KiB each, pageable"),
            Item("text K/V micro-batches in flight (lever)", per_micro * per_token if at.cuda else 0,
                 TEXT_KV_IN_FLIGHT * per_micro * per_token, pinned=at.cuda,
                 note=f"{TEXT_KV_IN_FLIGHT} gathered micro-batches of about {per_micro:,} text tokens"
                 + ("; the next one's copy on the GPU" if at.cuda else ""))]


def _host_items(at: _At, ema_on: bool) -> list[Item]:
    """The host process itself and what a checkpoint save adds to it."""
    c = at.c
    if at.cuda:
        items = [Item("host process baseline", 0, HOST_BASELINE,
                      note="torch + CUDA libraries + clip cache (measured on an H200 machine)")]
    else:
        items = [Item("host process baseline", 0, HOST_BASELINE_CPU, note="torch + clip cache (estimate, CPU run)")]
    if at.world == 1:  # the live tensors, written one storage at a time (patches.core.streamsave)
        items.append(Item("checkpoint save (streamed)", 0, min(c["largest"] * 4, CHUNK_BYTES),
                          note=f"at a save only: one piece of at most {CHUNK_BYTES // 2**20} MiB at a time"))
    else:  # full copies of net, net_ema and the moments, gathered on every rank
        items.append(Item("checkpoint save (gathered)", 0, c["all"] * at.mb + (c["all"] * 4 if ema_on else 0)
                          + c["train"] * 2 * at.mb, note="at a save only: full host copies of net, net_ema, moments"))
    return items


def _checkpoint_layers(cfg: SFTConfig, layers: int, given: int | None) -> int:
    """The checkpointed layers the ledger prices: ``given``, else ``[onecard] checkpoint_layers`` when a number, else
    every layer.

    Raises:
        ValueError: a count outside 0..``layers``.
    """
    n = given if given is not None else cfg.onecard.checkpoint_layers
    if not isinstance(n, int):
        return layers
    if not 0 <= n <= layers:
        raise ValueError(f"checkpoint layers {n} must be in [0, {layers}] (the preset's decoder layers)")
    return n


def check_checkpoint_layers(cfg: SFTConfig, preset_name: str) -> None:
    """``[onecard] checkpoint_layers`` against the preset and the checkpointing mode (before any work).

    Raises:
        UserError: a number above the preset's decoder layers, or a positive number with ``mode = "none"``
            (which checkpoints no layer); each names the fix.
    """
    layers = get_preset(preset_name).transformer["num_hidden_layers"]
    value = cfg.onecard.checkpoint_layers
    if not isinstance(value, int):
        return
    if value > layers:
        raise UserError(f"{cfg.source}: [onecard].checkpoint_layers = {value} is above the {layers} decoder layers of "
                        f"preset {preset_name}: use 0 to {layers}, \"all\" or \"auto\"")
    if value > 0 and cfg.model.activation_checkpointing.mode == "none":
        raise UserError(f"{cfg.source}: [onecard].checkpoint_layers = {value} with [model.activation_checkpointing] "
                        "mode = \"none\", which checkpoints no layer: set mode = \"full\" or \"selective\", or drop "
                        "checkpoint_layers")


def check_offload_layers(cfg: SFTConfig, preset_name: str, world_size: int = 1, mixed: bool = False,
                         checkpoint_layers: int | None = None) -> None:
    """``[onecard] offload_layers`` against the preset, the checkpointing and the ranks (before any work; again with
    ``checkpoint_layers``, the resolved count, once ``"auto"`` is planned).

    Raises:
        UserError: more offloaded layers than the checkpointed ones (or than the preset's layers), offloaded layers
            with ``mode = "none"``, or with FSDP2 (several ranks, or a master dtype other than the compute dtype);
            each names the fix.
    """
    k = cfg.onecard.offload_layers
    if not k:
        return
    layers = get_preset(preset_name).transformer["num_hidden_layers"]
    where = f"{cfg.source}: [onecard].offload_layers = {k}"
    if cfg.model.activation_checkpointing.mode == "none":
        raise UserError(f"{where} with [model.activation_checkpointing] mode = \"none\": the offloaded layers are "
                        "taken from the checkpointed ones; set mode = \"selective\" (or \"full\") or drop offload_layers")
    given = cfg.onecard.checkpoint_layers
    n = checkpoint_layers if checkpoint_layers is not None else (given if isinstance(given, int) else layers)
    if k > n:
        raise UserError(f"{where} is above the {n} checkpointed decoder layers (preset {preset_name}, "
                        f"[onecard] checkpoint_layers = {given!r}): use at most {n}")
    if world_size > 1 or mixed:
        raise UserError(f"{where} needs one rank with the parameters stored in the compute dtype (no FSDP2): run "
                        "one process with fsdp_master_dtype equal to the precision, or drop offload_layers")


def resolve_checkpoint_layers(cfg: SFTConfig, preset_name: str, flags: dict[str, bool], budget: int | None, *,
                              world_size: int = 1, device_type: str = "cuda", cap: int | None = None) -> int:
    """``[onecard] checkpoint_layers`` as a number of decoder layers: ``"all"`` is every layer, a number itself,
    ``"auto"`` the fewest (at least ``[onecard] offload_layers``, which are taken from them) whose ledger fits
    ``budget - AUTO_HEADROOM`` bytes (reserved peak, :meth:`Ledger.fits`);
    every layer when none fits, on a CPU or without a budget, and with ``mode = "none"`` (nothing checkpointed).

    Raises:
        UserError: what :func:`check_checkpoint_layers` refuses.
    """
    check_checkpoint_layers(cfg, preset_name)
    layers = get_preset(preset_name).transformer["num_hidden_layers"]
    value = cfg.onecard.checkpoint_layers
    if isinstance(value, int):
        return value
    if value == "all" or device_type != "cuda" or not budget or cfg.model.activation_checkpointing.mode == "none":
        return layers
    for n in range(cfg.onecard.offload_layers, layers + 1):  # fewer: faster, more memory; the first that fits
        if cosmos_ledger(cfg, preset_name, flags, world_size, device_type, cap,
                         checkpoint_layers=n).fits(budget - AUTO_HEADROOM):
            return n
    return layers


def what_closes_the_gap(
    cfg: SFTConfig, preset_name: str, flags: dict[str, bool], budget: int, world_size: int = 1
) -> str:
    """One line naming what makes the run fit ``budget`` bytes: more checkpointed layers (when ``[onecard]
    checkpoint_layers`` leaves some out), else the lever flag(s) not yet on, else a lower cap with the levers on."""
    base = cosmos_ledger(cfg, preset_name, flags, world_size).gpu_reserved
    layers = get_preset(preset_name).transformer["num_hidden_layers"]
    given = cfg.onecard.checkpoint_layers
    if isinstance(given, int) and given < layers and cfg.model.activation_checkpointing.mode != "none":
        for n in range(given + 1, layers + 1):
            if cosmos_ledger(cfg, preset_name, flags, world_size, checkpoint_layers=n).fits(budget):
                return (f"to fit: raise [onecard] checkpoint_layers from {given} to {n} (or set \"auto\": the fewest "
                        "that fit the card)")
    e, v, c, o, f = (EMA_CPU_SUBSET.name, VAE_CPU_OFFLOAD.name, LATENT_CACHE.name, OPTIM_STATE_OFFLOAD.name,
                     FROZEN_BF16.name)
    for turn_on in ([e], [v], [c], [e, v], [e, c], [e, v, o], [e, c, o], [e, v, o, f], [e, c, o, f]):
        if all(flags.get(x) for x in turn_on):
            continue
        trial = dict(flags, **{x: True for x in turn_on})
        led = cosmos_ledger(cfg, preset_name, trial, world_size)
        if led.fits(budget):
            saved = (base - led.gpu_reserved) / GiB
            missing = [x for x in turn_on if not flags.get(x)]
            return f"to fit: set {' '.join(x + '=1' for x in missing)} (saves {saved:.2f} GiB)"
    best = dict(flags, **{x: True for x in (e, c, o)})
    cap = cfg.dataloader_train.max_sequence_length
    missing = [x for x in (e, c, o) if not flags.get(x)]
    while cap > 1024:
        cap -= 1024
        if cosmos_ledger(cfg, preset_name, best, world_size, cap=cap).fits(budget):
            first = f"set {' '.join(x + '=1' for x in missing)} and " if missing else ""
            return (f"to fit: {first}lower [dataloader_train].max_sequence_length to {cap}, then raise grad_accum_iter "
                    f"to what `python -m cosmos_framework_ext.recipe.plan --cap {cap} ...` prints")
    return "no lever or cap makes this fit: the static components alone exceed the budget; use a larger card"


def summary_line(ledger: Ledger) -> dict[str, Any]:
    """The ledger's totals for a summary JSON (GiB)."""
    return {"predicted_gpu_allocated_gib": ledger.gpu_allocated / GiB,
            "predicted_gpu_reserved_gib": ledger.gpu_reserved / GiB,
            "predicted_pinned_gib": ledger.pinned_bytes / GiB}


def main(argv: Iterable[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m patches.ledger", description="Will this recipe fit the card? (memory ledger)")
    ap.add_argument("--toml", required=True, help="recipe TOML")
    ap.add_argument("--budget-gib", default=None,
                    help="usable GPU memory in GiB (default: $BUDGET_GIB, else $ONECARD_GPU_MEMORY_GIB, else 22.06: a "
                    "24 GB A10G)")
    ap.add_argument("--preset", default="edge", choices=sorted(PRESETS), help="model preset to size (default edge)")
    ap.add_argument("--world-size", type=flagmod.whole_number_arg(1, flagmod.MAX_WORLD_SIZE, "ranks"), default=1,
                    help=f"ranks (NPROC_PER_NODE x NNODES), 1 to {flagmod.MAX_WORLD_SIZE}; default 1")
    args = ap.parse_args(list(argv) if argv is not None else None)
    try:
        if args.budget_gib is not None:
            budget = parse_budget(args.budget_gib)
        elif (os.environ.get("BUDGET_GIB") or "").strip():
            budget = parse_budget(os.environ["BUDGET_GIB"].strip(), "BUDGET_GIB")
        else:  # the card cap a run would use, read and refused as the run reads it; else a 24 GB card's 22.06
            cap = gpu_memory_cap_gib()
            budget = int(cap * GiB) if cap is not None else parse_budget("22.06")
        gpu_memory_cap_gib()  # a bad card cap is refused here too, as the trainer would refuse it
        cfg = cfgmod.load(args.toml)
        cfgmod.check_honoured(cfg, args.world_size)  # what the trainer refuses, refused here too
        env_flags = flagmod.read_all()
        layers = resolve_checkpoint_layers(cfg, args.preset, env_flags, budget, world_size=args.world_size)
        ledger = cosmos_ledger(cfg, args.preset, env_flags, world_size=args.world_size, checkpoint_layers=layers)
    except (ValueError, flagmod.FlagError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(ledger.format(budget))
    if ledger.fits(budget):
        return 0
    print(what_closes_the_gap(cfg, args.preset, env_flags, budget, world_size=args.world_size))
    return 1


if __name__ == "__main__":
    sys.exit(main())
