"""The SFT TOML schema as typed dataclasses, read strictly.

The tables are upstream cosmos-framework's SFT TOML tables (``[job] [model] [model.ema] [optimizer]
[scheduler] [trainer] [trainer.callbacks.grad_clip] [checkpoint] [dataloader_train]``, plus the
parallelism/compile/activation-checkpointing/tokenizer sub-tables the upstream recipe carries), so a
recipe TOML runs unchanged on the upstream trainer and on the embedded one. What only the embedded
trainer needs lives in one extra table, ``[onecard]``.

Each table is one dataclass below; a nested table is a nested dataclass field, so a loaded config reads
as attributes: ``cfg.model.ema.rate``, ``cfg.trainer.callbacks.grad_clip.clip_norm``,
``cfg.dataloader_train.max_sequence_length``, ``cfg.onecard.preset``. Every field has a type, a default
and a docstring (:func:`patches.core.config.field_docs` reads them).

``${oc.env:NAME}`` in a string value is replaced by the environment variable ``NAME`` (empty when unset),
as upstream's OmegaConf resolver does.

A table or key the schema does not know, or a value of the wrong type, raises :class:`ConfigError`
(:class:`patches.core.config.ConfigError`, a :class:`patches.core.errors.UserError`) naming it and what is
accepted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping

from patches.core.config import ConfigError, from_mapping, meaning
from patches.core.errors import UserError, cli
from patches.core.io import atomic_write_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ConfigError", "SFTConfig", "from_dict", "load", "write_upstream_toml"]


def _list(*items: Any) -> Any:
    """A ``default_factory`` field holding a fresh copy of ``items`` as a list."""
    return dataclasses.field(default_factory=lambda: list(items))


def _table(cls: type) -> Any:
    """A nested-table field defaulting to ``cls()``."""
    return dataclasses.field(default_factory=cls)


# ------------------------------------------------------------------------------------------- [job]
@dataclasses.dataclass
class JobConfig:
    """``[job]``: what the run is called; the embedded trainer writes to ``OUTPUT_ROOT/project/group/name``."""

    task: str = "vfm"
    """Upstream task family."""
    experiment: str = "vision_sft_edge"
    """Upstream experiment the recipe derives from."""
    project: str = "cosmos3"
    """First folder of the run's output path."""
    group: str = "sft"
    """Second folder of the run's output path."""
    name: str = "vision_sft_edge"
    """The run's folder (checkpoints, summary.json, memory timeline)."""
    wandb_mode: str = "disabled"
    """Upstream's Weights & Biases mode (the embedded trainer logs nothing there)."""


# ----------------------------------------------------------------------------------------- [model]
@dataclasses.dataclass
class EMAConfig:
    """``[model.ema]``: the power-function EMA of the network (upstream ``OmniMoTModel.ema_beta``)."""

    enabled: bool = True
    """Keep an EMA of the weights at all."""
    rate: float = dataclasses.field(default=0.1, metadata=meaning(gt=0, lt=0.28, why="sigma_rel of the power EMA"))
    """sigma_rel of the power EMA; must lie in (0, 0.28)."""
    iteration_shift: int = dataclasses.field(default=0, metadata=meaning(ge=0))
    """Added to the iteration before beta is computed."""


@dataclasses.dataclass
class ParallelismConfig:
    """``[model.parallelism]``: upstream's FSDP mesh (the embedded trainer shards over all ranks)."""

    data_parallel_shard_degree: int = dataclasses.field(default=-1, metadata=meaning(ge=1, allowed=(-1,)))
    """Ranks a parameter is sharded over (-1: all)."""
    data_parallel_replicate_degree: int = dataclasses.field(default=1, metadata=meaning(ge=1))
    """Replicas of each shard."""
    fsdp_master_dtype: str = "bfloat16"
    """Storage dtype of the network's parameters on a GPU (upstream ``parallelism.fsdp_master_dtype``; the CPU
    always runs fp32). ``"bfloat16"`` (default): the dtype ``precision`` computes in, as upstream ed8287f
    builds ``net`` -- parameters, gradients and AdamW state bf16, nothing cast. ``"float32"``: upstream HEAD
    (since cb76f47, e.g. 5eee9ed) -- fp32 master parameters, gradients and AdamW state, computed in
    ``precision`` through FSDP2's ``MixedPrecisionPolicy`` at every world size (one rank included), gradients
    reduced in ``fsdp_reduce_dtype``. Not in upstream's TOML schema: the copy for upstream drops it (upstream
    then uses its own commit's dtypes; pass ``model.config.parallelism.fsdp_master_dtype=...`` to change them)."""
    fsdp_reduce_dtype: str = "bfloat16"
    """``MixedPrecisionPolicy.reduce_dtype`` when ``fsdp_master_dtype`` differs from ``precision``: upstream
    HEAD's Edge recipe reduces in ``"bfloat16"`` (``configs/base/defaults/model.py``); ``"float32"`` reduces in
    the master dtype. Unused with a bf16 master. Dropped from the upstream copy, as ``fsdp_master_dtype``."""


@dataclasses.dataclass
class CompileConfig:
    """``[model.compile]``: upstream's ``torch.compile`` settings; the embedded trainer compiles each decoder
    layer on a GPU (cosmos_framework_ext.levers.compile_blocks; the CPU runs eagerly)."""

    enabled: bool = True
    """Compile the network (the embedded trainer: each decoder layer, on a GPU)."""
    compile_dynamic: bool = True
    """Compile with dynamic shapes (true: every size symbolic from the first compile; false: PyTorch's automatic
    dynamic shapes, one more compile at the first length change). Never one compile per micro-batch length."""


AC_MODES = ("full", "selective", "none")
"""``[model.activation_checkpointing] mode`` values (upstream's; the embedded trainer runs each)."""


@dataclasses.dataclass
class ActivationCheckpointingConfig:
    """``[model.activation_checkpointing]``: recompute activations in the backward pass."""

    mode: str = "full"
    """``full`` recomputes each checkpointed decoder layer whole in the backward pass, ``selective`` keeps the
    outputs of the ops ``save_ops_regex`` names and recomputes the rest, ``none`` keeps every activation (which
    layers are checkpointed: ``[onecard] checkpoint_layers``)."""
    save_ops_regex: list[str] = _list("fmha")
    """Upstream selective checkpointing: ops whose outputs are kept."""
    preserve_rng_state: bool = True
    """Replay the RNG state in the recomputation."""
    determinism_check: str = "default"
    """torch.utils.checkpoint's determinism check."""


@dataclasses.dataclass
class TokenizerConfig:
    """``[model.tokenizer]``: the Wan2.2 VAE."""

    vae_path: str = ""
    """Diffusers-format ``AutoencoderKLWan`` directory; empty: a random-init VAE."""


@dataclasses.dataclass
class ModelConfig:
    """``[model]``: the network and its sub-tables."""

    max_num_tokens_after_packing: int = dataclasses.field(default=45056, metadata=meaning(ge=1))
    """Upstream's packed sequence length (the embedded trainer packs to ``[dataloader_train]``'s cap)."""
    joint_attn_implementation: str = "two_way"
    """Upstream's joint attention kernel choice."""
    precision: str = "bfloat16"
    """Parameter dtype on a GPU (``bfloat16``; fp32 otherwise and always on the CPU)."""
    ema: EMAConfig = _table(EMAConfig)
    """``[model.ema]``."""
    parallelism: ParallelismConfig = _table(ParallelismConfig)
    """``[model.parallelism]``."""
    compile: CompileConfig = _table(CompileConfig)
    """``[model.compile]``."""
    activation_checkpointing: ActivationCheckpointingConfig = _table(ActivationCheckpointingConfig)
    """``[model.activation_checkpointing]``."""
    tokenizer: TokenizerConfig = _table(TokenizerConfig)
    """``[model.tokenizer]``."""


# ------------------------------------------------------------------------------ [optimizer] [scheduler]
@dataclasses.dataclass
class OptimizerConfig:
    """``[optimizer]``: AdamW over the trainable subset."""

    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.95],
                                           metadata=meaning(ge=0, lt=1, why="AdamW betas lie in [0, 1)"))
    """AdamW betas (two, each in [0, 1))."""
    eps: float = dataclasses.field(default=1.0e-6, metadata=meaning(gt=0, why="AdamW epsilon"))
    """AdamW epsilon."""
    fused: bool = True
    """Fused AdamW kernel (on a GPU)."""
    keys_to_select: list[str] = _list("moe_gen", "time_embedder", "vae2llm", "llm2vae", "k_norm_und_for_gen")
    """Upstream module keys whose parameters are trained; everything else is frozen."""
    lr: float = dataclasses.field(default=1.0e-4, metadata=meaning(gt=0, why="the peak learning rate"))
    """Peak learning rate."""
    weight_decay: float = dataclasses.field(default=0.0, metadata=meaning(ge=0, why="AdamW weight decay"))
    """AdamW weight decay."""


@dataclasses.dataclass
class SchedulerConfig:
    """``[scheduler]``: upstream's ``LambdaWarmUpCosineScheduler`` (the first cycle is used)."""

    cycle_lengths: list[int] = dataclasses.field(default_factory=lambda: [1000], metadata=meaning(ge=1))
    """Optimizer steps per cosine cycle."""
    f_max: list[float] = dataclasses.field(default_factory=lambda: [1.0], metadata=meaning(ge=0))
    """Peak multiplier of the learning rate."""
    f_min: list[float] = dataclasses.field(default_factory=lambda: [0.0], metadata=meaning(ge=0))
    """Final multiplier."""
    f_start: list[float] = dataclasses.field(default_factory=lambda: [0.0], metadata=meaning(ge=0))
    """Multiplier at step 0 (warm-up start)."""
    verbosity_interval: int = dataclasses.field(default=0, metadata=meaning(ge=0))
    """Upstream's scheduler logging interval."""
    warm_up_steps: list[int] = dataclasses.field(default_factory=lambda: [50], metadata=meaning(ge=0))
    """Linear warm-up steps."""


# --------------------------------------------------------------------------------------- [trainer]
@dataclasses.dataclass
class CompileTokenizerCallback:
    """``[trainer.callbacks.compile_tokenizer]``: upstream compiles the VAE after a few iterations."""

    compile_after_iterations: int = dataclasses.field(default=3, metadata=meaning(ge=0))
    """Iterations before the VAE is compiled."""
    enabled: bool = False
    """Whether upstream compiles the VAE."""


@dataclasses.dataclass
class GradClipCallback:
    """``[trainer.callbacks.grad_clip]``: upstream ``GradClip``."""

    clip_norm: float = dataclasses.field(default=0.1, metadata=meaning(gt=0, why="the total gradient norm is clipped to it"))
    """Total gradient 2-norm is clipped to this."""
    force_finite: bool = True
    """Replace non-finite gradient entries by 0 before clipping."""


@dataclasses.dataclass
class CallbacksConfig:
    """``[trainer.callbacks]``: a parent table only (its sub-tables hold the keys)."""

    compile_tokenizer: CompileTokenizerCallback = _table(CompileTokenizerCallback)
    """``[trainer.callbacks.compile_tokenizer]``."""
    grad_clip: GradClipCallback = _table(GradClipCallback)
    """``[trainer.callbacks.grad_clip]``."""


@dataclasses.dataclass
class TrainerConfig:
    """``[trainer]``: the loop."""

    distributed_parallelism: str = "fsdp"
    """Upstream's parallelism (FSDP2 over the ranks)."""
    grad_accum_iter: int = dataclasses.field(default=2, metadata=meaning(ge=1))
    """Micro-batches per optimizer step."""
    logging_iter: int = dataclasses.field(default=1, metadata=meaning(ge=1))
    """Upstream's logging interval."""
    max_iter: int = dataclasses.field(default=500, metadata=meaning(ge=0))
    """Optimizer steps to train up to."""
    callbacks: CallbacksConfig = _table(CallbacksConfig)
    """``[trainer.callbacks.*]``."""


# ---------------------------------------------------------------------- [checkpoint] [dataloader_train]
@dataclasses.dataclass
class CheckpointConfig:
    """``[checkpoint]``: the base weights and how often to save."""

    keys_to_skip_loading: list[str] = _list("net_ema.")
    """Key substrings not loaded from the base checkpoint."""
    load_path: str = ""
    """Base checkpoint (diffusers directory or an onecard ``iter_*.pt``); empty: random init."""
    save_iter: int = dataclasses.field(default=100, metadata=meaning(ge=1))
    """A checkpoint every this many optimizer steps (and at the end)."""


@dataclasses.dataclass
class DataloaderConfig:
    """``[dataloader_train]``: packing."""

    max_sequence_length: int = dataclasses.field(default=45056, metadata=meaning(ge=1))
    """Token cap of one packed micro-batch (the strict fit rule)."""
    max_caption_tokens: int = dataclasses.field(default=2048, metadata=meaning(ge=0))
    """Captions are truncated to this many tokens."""


# --------------------------------------------------------------------------------------- [onecard]
@dataclasses.dataclass
class OnecardConfig:
    """``[onecard]``: settings only the embedded trainer reads (the launcher strips them for upstream)."""

    preset: str = "auto"
    """``edge``, ``tiny``, or ``auto`` (edge on a GPU, tiny without one)."""
    loss_scale: float = dataclasses.field(default=10.0, metadata=meaning(gt=0, why="the flow-matching loss scale"))
    """Upstream flow-matching loss scale."""
    seed: int = dataclasses.field(default=0, metadata=meaning(ge=0, why="a seed is a non-negative 63-bit integer"))
    """Seed of the init, the data order and the noise."""
    cfg_dropout: float = dataclasses.field(default=0.1, metadata=meaning(ge=0, le=1, why="a probability"))
    """Caption dropout probability (classifier-free guidance)."""
    cpu_max_iter: int = dataclasses.field(default=0, metadata=meaning(ge=0))
    """CPU smoke (tiny preset, no GPU): > 0 replaces ``[trainer].max_iter``, and the run says so."""
    cpu_grad_accum_iter: int = dataclasses.field(default=0, metadata=meaning(ge=0))
    """CPU smoke: > 0 replaces ``[trainer].grad_accum_iter``."""
    cpu_max_sequence_length: int = dataclasses.field(default=0, metadata=meaning(ge=0))
    """CPU smoke: > 0 replaces ``[dataloader_train].max_sequence_length``."""
    attention: Literal["dense", "flex", "varlen"] = "dense"
    """Packed attention of the embedded trainer. ``dense``: boolean [L, L] segment masks with
    ``scaled_dot_product_attention`` (the reference; mask memory O(L^2), every L x L score computed). ``flex``:
    the same rule as ``torch.nn.attention.flex_attention`` block masks (mask memory O(L), tiles of other samples
    skipped; cosmos_framework_ext.levers.attention_blocksparse). Equal outputs and gradients within 1e-6 relative in
    fp32 (tests/equivalence/test_attention_blocksparse.py). ``varlen``: FlashAttention-2's variable-length kernels
    over each sample's own tokens (cosmos_framework_ext.levers.attention_varlen; bf16/fp16 on a GPU: another kernel,
    proved in tests/equivalence/test_attention_varlen.py)."""
    compile_blocks: bool = False
    """Whether the embedded trainer obeys ``[model.compile] enabled`` on a GPU (each decoder layer compiled, packed
    lengths dynamic: cosmos_framework_ext.levers.compile_blocks). Off by default, so that a TOML written for upstream
    (which sets ``[model.compile] enabled = true``) runs the eager reference; the 24 GB recipes turn it on
    (proofs: tests/equivalence/test_compile_blocks.py, on the CPU and on a GPU). Upstream's trainer reads only
    ``[model.compile]``."""
    compile_wrapper: Literal["python", "cpp"] = "python"
    """The code that launches each compiled layer's kernels (inductor's wrapper). ``python`` (default): inductor's
    Python wrapper. ``cpp``: its C++ wrapper (``torch.compile`` option ``cpp_wrapper``), the same kernels launched
    with less host time per kernel (a forward that is launch-bound waits less), a longer first compile. The same
    values: bitwise on the CPU, within a stated fp32 tolerance on the GPU
    (tests/equivalence/test_compile_wrapper.py). Needs ``compile_blocks = true`` and ``[model.compile]
    enabled = true``."""
    checkpoint_layers: int | Literal["all", "auto"] = dataclasses.field(default="all", metadata=meaning(ge=0))
    """How many decoder layers (the first ones) ``[model.activation_checkpointing]`` checkpoints; the others keep
    every activation their backward needs and recompute nothing (faster, more GPU memory; the same gradients:
    cosmos_framework_ext.levers.selective_ac). ``"all"`` (default): every layer. ``"auto"``: as few as the memory
    ledger says fit the card (``ONECARD_GPU_MEMORY_GIB``, else the card's memory; every layer on a CPU). An integer:
    that many, at most the preset's layers (28 for edge). Ignored when ``mode = "none"``."""
    offload_layers: int = dataclasses.field(default=0, metadata=meaning(ge=0))
    """Of the checkpointed decoder layers, how many (the first ones) are instead run once and keep their saved
    activations in pinned host memory until their backward: copied to the host in the forward pass, back in the
    backward pass, on their own CUDA streams (cosmos_framework_ext.levers.activation_offload; the same gradients,
    proof tests/equivalence/test_activation_offload.py). Each saves its recompute for PCIe traffic and pinned host
    memory (0.71 GiB reserved per edge-preset layer at cap 12288). 0 (default): none. At most the checkpointed layers
    (``checkpoint_layers``); one rank, parameters stored in the compute dtype (no FSDP2)."""
    host_embeddings: bool = False
    """Keep the frozen text-token embedding (``embed_tokens``, a lookup) and ``lm_head`` (which the diffusion
    forward never runs) on the host, the lookup done there and its rows copied to the GPU: 1.0 GiB of GPU memory
    for the edge preset, the same values (cosmos_framework_ext.levers.host_embeddings). One rank with the
    parameters stored in the compute dtype only (no FSDP2), and only while both are frozen."""
    detach_text_stream: bool = False
    """Hand the decoder layers the frozen text (understanding) stream detached: no backward pass through it (and, in
    layers compiled with their checkpoint inside, no recompute of what only that backward reads), the same gradients
    (cosmos_framework_ext.levers.text_stream; proof tests/equivalence/test_text_stream.py). Needs ``embed_tokens``
    frozen (refused otherwise); any other ``keys_to_select`` stays exact."""
    text_kv_cache: bool = False
    """Read the frozen text (understanding) stream's keys and values from a per-caption cache instead of running the
    text stream in every layer: a pre-pass computes them once per distinct caption into host memory (112 KiB per text
    token for the edge preset), and each micro-batch's rows reach the GPU with it
    (cosmos_framework_ext.levers.text_kv_cache; proof tests/equivalence/test_text_kv_cache.py, exact to a stated fp32
    tolerance, not bitwise). Needs every text-stream weight and ``embed_tokens`` frozen (refused otherwise). The
    embedded trainer only."""
    background_threads: int | Literal["all", "auto"] = dataclasses.field(
        default="all", metadata=meaning(ge=1, why='"all", "auto" or a count of at least 1 each'))
    """Intra-op CPU threads of each background thread of the training loop (the loader threads that build the next
    micro-batches' host inputs, the EMA's host lerp), so that their CPU operators leave cores to the thread that
    launches the GPU's work (patches.core.threads). ``"all"`` (default): PyTorch's default, one per core, for each.
    ``"auto"``: on a GPU run, the cores less two shared among the loader threads at work at once and the EMA worker
    (at least 1 each); on a CPU run no cap. An integer: that many each, from 1 to the cores this process may run on
    (more is refused). The same values whatever the count (proof tests/equivalence/test_background_threads.py).
    The embedded trainer only."""
    keep_checkpoints: int = dataclasses.field(default=2, metadata=meaning(ge=0))
    """Checkpoints kept in ``<run dir>/checkpoints`` after each save, the new one included (0: all). Each edge-preset
    checkpoint holds ``net``, an fp32 ``net_ema`` and the AdamW state (tens of GB), so the default keeps the newest and
    one to fall back to; older ones are deleted only after the new one is complete."""


@dataclasses.dataclass
class SFTConfig:
    """A validated SFT recipe: one attribute per TOML table (defaults filled in).

    Attributes:
        source: the TOML path it was read from (``None`` for defaults); not a TOML key.
    """

    job: JobConfig = _table(JobConfig)
    """``[job]``."""
    model: ModelConfig = _table(ModelConfig)
    """``[model]`` and its sub-tables."""
    optimizer: OptimizerConfig = _table(OptimizerConfig)
    """``[optimizer]``."""
    scheduler: SchedulerConfig = _table(SchedulerConfig)
    """``[scheduler]``."""
    trainer: TrainerConfig = _table(TrainerConfig)
    """``[trainer]`` and its callbacks."""
    checkpoint: CheckpointConfig = _table(CheckpointConfig)
    """``[checkpoint]``."""
    dataloader_train: DataloaderConfig = _table(DataloaderConfig)
    """``[dataloader_train]``."""
    onecard: OnecardConfig = _table(OnecardConfig)
    """``[onecard]``."""

    source: ClassVar[Path | None] = None


# ------------------------------------------------------------------------------------------- loading
_ENV_RE = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)\}")


def _resolve_env(value: Any) -> Any:
    """``${oc.env:NAME}`` replaced in every string of ``value`` (tables and lists walked)."""
    if isinstance(value, str):
        return _ENV_RE.sub(lambda m: os.environ.get(m.group(1), ""), value)
    if isinstance(value, list):
        return [_resolve_env(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _resolve_env(v) for k, v in value.items()}
    return value


def _table_paths(cls: type, prefix: str = "") -> list[str]:
    """Every table path of the dataclass tree under ``cls`` (``["job", "model", "model.ema", ...]``)."""
    out = []
    for f in dataclasses.fields(cls):
        tp = _nested(cls, f.name)
        if tp is not None:
            path = f"{prefix}.{f.name}" if prefix else f.name
            out += [path, *_table_paths(tp, path)]
    return out


def _nested(cls: type, name: str) -> type | None:
    """The dataclass type of field ``name`` of ``cls`` when it is a nested table, else ``None``."""
    import typing

    tp = typing.get_type_hints(cls).get(name)
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _check_tables(data: Mapping[str, Any], cls: type, where: str, prefix: str = "") -> None:
    """Refuse the first table the schema does not know, naming every known table."""
    for key, value in data.items():
        if not isinstance(value, Mapping):
            continue
        path = f"{prefix}.{key}" if prefix else key
        field = {f.name: f for f in dataclasses.fields(cls)}.get(key)
        sub = _nested(cls, key) if field is not None else None
        if field is not None and sub is None:  # a known key of another type, written as a table
            raise ConfigError(f"{where}: [{prefix}].{key} is a table here, and it takes a value: write "
                              f"{key} = <value> under [{prefix}]" if prefix else f"{where}: {key} takes a value, not a table")
        if sub is None:
            known = ", ".join(f"[{t}]" for t in _table_paths(SFTConfig))
            raise ConfigError(f"{where}: unknown table [{path}]; known tables: {known}")
        _check_tables(value, sub, where, path)


def from_dict(data: Mapping[str, Any], source: Path | None = None) -> SFTConfig:
    """Validate a parsed TOML dict against the schema, fill defaults, resolve ``${oc.env:...}``.

    Raises:
        ConfigError: unknown table or key, or a value of the wrong type.
    """
    where = str(source) if source else "config"
    loose = sorted(k for k, v in data.items() if not isinstance(v, Mapping))
    if loose:
        raise ConfigError(f"{where}: keys outside any table: {loose}; put them in a [table]")
    _check_tables(data, SFTConfig, where)
    cfg = from_mapping(SFTConfig, _resolve_env(data), where)
    if len(cfg.optimizer.betas) != 2:
        raise ConfigError(f"{where}: [optimizer].betas = {cfg.optimizer.betas!r} must hold two numbers (beta1, beta2)")
    sc = cfg.scheduler
    for key in ("cycle_lengths", "f_max", "f_min", "f_start", "warm_up_steps"):
        if not getattr(sc, key):
            raise ConfigError(f"{where}: [scheduler].{key} is empty: give one value per cycle (the first cycle is used)")
    par = cfg.model.parallelism
    for key in _NOT_UPSTREAM:
        if getattr(par, key) not in DTYPES:
            raise ConfigError(f"{where}: [model.parallelism] {key} = {getattr(par, key)!r}; use one of {list(DTYPES)}")
    ac = cfg.model.activation_checkpointing
    if ac.mode not in AC_MODES:
        raise ConfigError(f"{where}: [model.activation_checkpointing] mode = {ac.mode!r}; use one of {list(AC_MODES)}")
    for pattern in ac.save_ops_regex:  # the ledger and both trainers read them
        if not pattern.strip():
            raise ConfigError(f"{where}: [model.activation_checkpointing] save_ops_regex holds an empty pattern, which "
                              "matches every op (nothing would be recomputed): remove it")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"{where}: [model.activation_checkpointing] save_ops_regex {pattern!r} is not a regular "
                              f"expression ({e}): give Python regular expressions (e.g. \"flex_attention\")") from None
    cfg.source = source
    return cfg


def load(path: str | Path) -> SFTConfig:
    """Read and validate an SFT TOML.

    Raises:
        ConfigError: the file is missing, a directory, or not valid TOML, lacks one of :data:`REQUIRED_TABLES`, or
            fails :func:`from_dict`.
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"SFT TOML {p} is a directory, not a file: pass a recipe .toml file (see toml/ for the "
                          "recipes)")
    if not p.is_file():
        raise ConfigError(f"SFT TOML {p} does not exist: pass an existing file (see toml/ for the recipes)")
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p} is not valid TOML: {e}") from None
    missing = [t for t in REQUIRED_TABLES if t not in data]
    if missing:  # an empty, cut-off or one-table file would otherwise train on the defaults, in silence
        raise ConfigError(f"{p} has no {', '.join(f'[{t}]' for t in missing)} table{'s' if len(missing) > 1 else ''}: a "
                          "recipe TOML states each of " + " ".join(f"[{t}]" for t in REQUIRED_TABLES)
                          + " (copy one of toml/*.toml and edit it)")
    return from_dict(data, p)


REQUIRED_TABLES = ("job", "model", "optimizer", "scheduler", "trainer", "checkpoint", "dataloader_train")
"""The tables every recipe file holds (upstream's TOML layout; ``[onecard]`` is optional): :func:`load` refuses a file
without one of them instead of filling it from the defaults."""


_NOT_UPSTREAM = ("fsdp_master_dtype", "fsdp_reduce_dtype")
"""``[model.parallelism]`` keys upstream's TOML schema does not have (Hydra overrides there): dropped from its copy."""
DTYPES = ("bfloat16", "float32")
"""Accepted values of ``[model.parallelism]`` ``fsdp_master_dtype`` and ``fsdp_reduce_dtype``."""


def check_honoured(cfg: SFTConfig, world: int = 1) -> None:
    """What the embedded trainer implements, and the numbers that only mean something together (the trainer's
    preflight and the ledger command both run it, so both refuse the same TOML).

    Args:
        cfg: the loaded recipe.
        world: the ranks the run has (the shard degree must be -1 or this).

    Raises:
        UserError: a setting the embedded trainer would not honour (``precision`` other than bfloat16/float32,
            ``distributed_parallelism`` other than fsdp, ``joint_attn_implementation`` other than two_way,
            activation checkpointing other than full/selective/none, shard/replicate degrees other than all ranks); a
            peak learning rate ``lr x max(f_max, f_start)`` above 1 or a schedule that never rises above 0;
            ``lr x weight_decay`` >= 1 (AdamW's decay factor ``1 - lr x wd`` would flip or zero the weights);
            ``compile_wrapper = "cpp"`` for layers that are not compiled; an empty ``keys_to_select`` pattern (it
            matches every parameter); a ``[job]`` project/group/name that is not one plain folder name.
    """
    c, src = cfg, cfg.source
    for where, value, ok in (("[model].precision", c.model.precision, ("bfloat16", "float32")),
                             ("[trainer].distributed_parallelism", c.trainer.distributed_parallelism, ("fsdp",)),
                             ("[model].joint_attn_implementation", c.model.joint_attn_implementation, ("two_way",)),
                             ("[model.activation_checkpointing].mode", c.model.activation_checkpointing.mode,
                              ("full", "selective", "none"))):
        if value not in ok:
            raise UserError(f"{src}: {where} = {value!r} is not implemented by the embedded trainer (it runs "
                            f"{' or '.join(map(repr, ok))}): use one of those, or run upstream's trainer "
                            "(COSMOS_FRAMEWORK_ROOT)")
    if c.onecard.compile_wrapper == "cpp" and not (c.onecard.compile_blocks and c.model.compile.enabled):
        raise UserError(f"{src}: [onecard].compile_wrapper = \"cpp\" chooses the wrapper of compiled layers, and the "
                        f"layers are not compiled ([onecard].compile_blocks = {str(c.onecard.compile_blocks).lower()}, "
                        f"[model.compile].enabled = {str(c.model.compile.enabled).lower()}): set both to true, or "
                        "drop compile_wrapper")
    par = c.model.parallelism
    if par.data_parallel_replicate_degree != 1 or par.data_parallel_shard_degree not in (-1, world):
        raise UserError(f"{src}: [model.parallelism] data_parallel_shard_degree = {par.data_parallel_shard_degree}, "
                        f"data_parallel_replicate_degree = {par.data_parallel_replicate_degree}: the embedded trainer "
                        f"shards over every rank; use -1 (or the world size, {world}) and 1")
    o, sc = c.optimizer, c.scheduler
    peak = max([*sc.f_max, *sc.f_start], default=0.0)
    if not max(sc.f_max, default=0.0) > 0:
        raise UserError(f"{src}: [scheduler].f_max = {list(sc.f_max)}: the learning rate would stay 0 and nothing would "
                        "train; give f_max > 0 (the recipe's 1.0)")
    if o.lr * peak > 1:
        raise UserError(f"{src}: the peak learning rate [optimizer].lr x max(f_max, f_start) = {o.lr:g} x {peak:g} = "
                        f"{o.lr * peak:g} is above 1 (AdamW moves each weight by about that much a step): lower it")
    if o.lr * peak * o.weight_decay >= 1:
        raise UserError(f"{src}: [optimizer].lr x weight_decay = {o.lr * peak:g} x {o.weight_decay:g} >= 1: AdamW's "
                        "decay factor 1 - lr x weight_decay would zero or flip every weight; lower weight_decay")
    if any(not k.strip() for k in o.keys_to_select):
        raise UserError(f"{src}: [optimizer].keys_to_select = {list(o.keys_to_select)} holds an empty pattern, which "
                        "matches every parameter: remove it")
    for key in ("project", "group", "name"):
        value = getattr(c.job, key)
        bad = (not value or value in (".", "..") or any(ch in value for ch in "/\\\0")
               or len(value.encode("utf-8", "surrogatepass")) > 255)
        if bad:
            raise UserError(f"{src}: [job].{key} = {value!r} must be one plain folder name (not empty, no '/', '\\' "
                            "or NUL, at most 255 bytes): the run folder is OUTPUT_ROOT/project/group/name")


def write_upstream_toml(src: str | Path, dst: str | Path) -> SFTConfig:
    """Write ``src`` without its ``[onecard]`` table and the ``[model.parallelism]`` dtype keys upstream's schema
    lacks (:data:`_NOT_UPSTREAM`; its schema forbids unknown keys) to ``dst``; returns the recipe as validated.

    The recipe is validated first (nothing is written when it fails). The text is copied line by line, so comments
    and ``${oc.env:...}`` stay as written for upstream's resolver; ``dst`` is written atomically (temporary name +
    rename).

    Raises:
        ConfigError: ``src`` is missing, unreadable or fails the schema.
    """
    cfg = load(src)
    atomic_write_text(dst, _upstream_text(src))
    return cfg


def _upstream_text(src: str | Path) -> str:
    """The text of the recipe ``src`` without what :func:`write_upstream_toml` leaves out (``src`` not validated)."""
    kept: list[str] = []
    skipping = False
    table = ""
    for line in Path(src).read_text().splitlines(keepends=True):
        header = re.match(r"\s*\[\s*([A-Za-z0-9_.]+)\s*\]", line)
        if header:
            skipping = header.group(1) == "onecard" or header.group(1).startswith("onecard.")
            table = header.group(1)
        key = re.match(r"\s*([A-Za-z0-9_]+)\s*=", line)
        onecard_only = bool(not header and key and table == "model.parallelism" and key.group(1) in _NOT_UPSTREAM)
        if not skipping and not onecard_only:
            kept.append(line)
    return "".join(kept)


def _main(argv: list[str] | None = None) -> int:
    """``python -m cosmos_framework_ext.recipe.config upstream-toml SRC DST`` (used by the launcher)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] != "upstream-toml":
        print("usage: python -m cosmos_framework_ext.recipe.config upstream-toml SRC DST", file=sys.stderr)
        return 2

    def run() -> None:
        cfg = write_upstream_toml(args[1], args[2])
        from patches.core.flags import DETACH_TEXT_STREAM

        if cfg.onecard.detach_text_stream and not DETACH_TEXT_STREAM.value(os.environ):
            print(f"onecard: {args[1]} sets [onecard] detach_text_stream = true, which upstream's trainer does not read: "
                  f"set {DETACH_TEXT_STREAM.name}=1 to detach the frozen text stream there too", file=sys.stderr)
        if cfg.onecard.text_kv_cache:
            print(f"onecard: {args[1]} sets [onecard] text_kv_cache = true, which only the embedded trainer runs: "
                  "upstream's trainer runs the text stream in every layer", file=sys.stderr)
        if cfg.onecard.background_threads != "all":
            print(f"onecard: {args[1]} sets [onecard] background_threads = {json.dumps(cfg.onecard.background_threads)}, "
                  "which only the embedded trainer reads: upstream's trainer keeps PyTorch's default CPU threads",
                  file=sys.stderr)
        if cfg.onecard.offload_layers:
            print(f"onecard: {args[1]} sets [onecard] offload_layers = {cfg.onecard.offload_layers}, which only the embedded "
                  "trainer runs: upstream's trainer recomputes those layers as its checkpointing says", file=sys.stderr)

    return cli(run)


if __name__ == "__main__":
    sys.exit(_main())
