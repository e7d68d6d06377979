"""Stock vs levers for the Cosmos3-Edge 24 GB recipe, in ONE run on one GPU (or a CPU smoke of the same code).

    python benchmarks/edge_24gb.py [--budget-gib 22.06] [--steps 3] [--grad-accum 8] [--out benchmarks/results]
    python benchmarks/edge_24gb.py --smoke --out /tmp/bench      # CPU, tiny preset: tests the benchmark itself

The ``edge`` preset at cap 12288 (``benchmarks/edge_24gb.toml``: EMA on; ``grad_accum_iter`` set by
``--grad-accum``, default 8; the first ``--warmup`` steps, default 1, are warm-up and not measured) runs under
these configurations, one after another in this
process (``--only`` picks some, ``--list`` names them all):

1. ``stock (uncapped card)``: EMA as a full fp32 clone on the GPU, VAE resident and encoding online, dense-mask
   attention, no compile;
2. ``levers 1+2``: ``COSMOS_EMA_CPU_SUBSET=1 COSMOS_VAE_CPU_OFFLOAD=1``, card capped at ``--budget-gib``
   (``torch.cuda.set_per_process_memory_fraction``) -- the recipe as it shipped before lever 4;
3. ``+ latent cache``: also ``COSMOS_LATENT_CACHE=1`` (its pre-pass runs cold into a fresh
   ``ONECARD_LATENT_CACHE``; later configurations find every entry);
4. ``+ block-sparse attention``: also ``[onecard] attention = "flex"``;
5. ``all levers``: also ``[model.compile] enabled = true``;
6. ``all levers + optimizer-state streaming``: also ``COSMOS_OPTIM_STATE_OFFLOAD=1`` (the exact lever: the
   AdamW moments in pinned host memory, streamed to the GPU for the optimizer step only).

Optional (``--only``): ``all levers + optimizer-state streaming + selective AC`` (also
``[model.activation_checkpointing] mode = "selective"``: the attention outputs kept, not recomputed); the same
``+ fewer checkpointed layers`` (``[onecard] checkpoint_layers``: ``--checkpoint-layers``, default ``"auto"``);
the same ``+ host inputs on the main thread`` (each micro-batch's noise, positions and segment indices built on the
main thread, as before they moved to the loader threads: the A/B of that change); the same ``+ C++ wrapper``
(``[onecard] compile_wrapper = "cpp"``: the compiled layers' kernels launched by inductor's C++ wrapper); the same
``+ text stream detached`` (``[onecard] detach_text_stream = true``: no backward through the frozen text stream),
and that row ``+ lookup tables on the host`` (``[onecard] host_embeddings``: the GiB the tables free goes to fewer
checkpointed layers), ``+ variable-length attention`` (``[onecard] attention = "varlen"``) and ``+ text K/V cache``
(``[onecard] text_kv_cache = true``: the text stream's keys and values from a per-caption cache, the text stream not
run), and the last two ``+ background threads capped`` (``[onecard] background_threads = "auto"``: the loader threads'
and the EMA lerp's CPU operators on a share of the cores each, not all of them each);
``12 GB card: all levers + optimizer-state streaming + lookup tables on the host`` (``[onecard] host_embeddings``,
full checkpointing, its own cap of 11.0 GiB); ``stock`` (capped: expected out of memory), ``EMA lever``, ``VAE lever``.

Configurations 4 and 5 need the trainer's packed-attention setting (``[onecard] attention = "flex"``, or
``[model.attention] impl``: ``ATTENTION_PLACES``); a trainer whose schema has neither reports them as
``skipped``.

**Reported per configuration:** median s per micro-batch and per optimizer step (the upper median, an element of
the list, over the steps after the warm-up), each measured micro-batch's seconds in order (JSON ``micro_batch_s``: the outliers a median hides) beside its tokens
(``tokens_per_micro_batch``, the same order: a slow micro-batch is told from a long one), every step's loss (JSON
``losses``, the warm-up's included: rows of one process train the same samples), s per sample
(measured micro-batch time / samples), peak allocated and reserved GiB, the ledger's prediction,
model FLOPs utilisation, the latent cache's pre-pass (s, hits, misses, bytes; **not** part of any step time),
the EMA's time on the critical path, VAE park + unpark per micro-batch, host RSS (the run's peak, and the peak
through its final checkpoint save with what the save adds: :func:`save_host`) and pinned bytes, the Python garbage
collector's pauses in the measured steps (JSON ``gc``: they stop the thread that launches the GPU's work), the pinned
blocks the measured steps had CUDA page-lock and the ms spent doing it (JSON ``pinned_allocator_measured``:
:func:`pinned_allocator`; ``null`` on the CPU), and the
change of s/sample against configuration 1. A configuration that runs out of memory is reported as such
with the peak it reached. ``--profile`` runs named rows once more under the profiler (:mod:`benchmarks.breakdown`);
``--queue-depth`` runs them once more with marks through the last step, unprofiled: how far the GPU runs behind
the host at each phase and decoder layer (:mod:`benchmarks.queue_depth`). Writes ``<date>_cosmos_<gpu>_edge24gb.json`` and ``.md`` (the results' naming scheme,
``benchmarks/checks.py:result_stem``; and the ``--timelines`` as ``<stem>-<config>-memory.{csv,png}``) into ``--out``
once every row has run, atomically (both or neither); ``--smoke`` names its files ``..._cpu_edge24gb-smoke*``, so a
smoke never replaces GPU results. Bad arguments (an unknown or empty ``--only``,
a count or GiB/TFLOP/s value out of range, an ``--out`` that is a file) are one ``error:`` line, exit status 2,
before the GPU check and any run (``benchmarks/checks.py``).

**Model FLOPs** (:func:`model_flops`; recompute from activation checkpointing is *not* counted, so this is
model, not hardware, FLOPs utilisation). ``6 x N_trainable x tokens`` is wrong for this partially frozen,
two-pathway model: text (understanding) tokens run through the frozen ``und`` weights, vision (generation)
tokens through the trainable ``moe_gen``/``add_*`` weights, and text tokens never attend to vision tokens, so
nothing trainable lies upstream of a text activation: the backward pass *needs* no gradient through the ``und``
weights (the trainer runs none with ``[onecard] detach_text_stream = true``; without it autograd computes that
unused backward too, and like the recompute it is not counted here). Per micro-batch, with ``N_p`` the matmul parameters a token of pathway ``p`` passes
(2-D weights, counted from the model built on the meta device: :func:`pathway_params`), ``T_p`` its tokens,
``g_p`` = 1 when pathway ``p``'s activations require grad (a trainable weight upstream of them), and
``N_p^train`` its trainable part::

    linear   = sum_p T_p * (2 N_p            forward
                            + 2 N_p g_p      backward: activation gradients (frozen weights: only these)
                            + 2 N_p^train)   backward: weight gradients
    attention = sum_layers sum_samples d * (4 * u (u + 1) / 2           text queries, causal, forward only
                                            + (4 + 8 g_gen) * v (u + v))  vision queries see the whole sample

with ``u``/``v`` a sample's text/vision tokens and ``d`` = heads x head_dim (query width): ``QK^T`` and ``PV``
are 2 x 2·d FLOPs per (query, key) pair forward, their backward twice that. For ``keys_to_select`` of the
recipe this is ``2 N_und T_und + 6 N_gen T_gen + attention``. Utilisation = model FLOPs / measured micro-batch
seconds / peak; the optimizer step (once per ``grad_accum_iter`` micro-batches) is outside the micro-batch
time. **Peak:** ``--peak-tflops``, default for an H100/H200 989 TFLOP/s dense BF16 (NVIDIA's H100/H200 SXM
datasheet: 1,979 TFLOP/s with 2:4 sparsity, half that dense; the project's measured GPU limits give
only a measured 750-776 TFLOP/s for a bf16 GEMM 8192^3, reported beside it as the achievable ceiling).

Random weights: the timings and memory are those of the real architecture, the losses mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks import breakdown as bd  # noqa: E402
from benchmarks import queue_depth as qd  # noqa: E402
from benchmarks.checks import (at_least, at_most_card, folder_arg, free_targets, pick, positive, result_stem,  # noqa: E402
                               writable_dir, write_together)
from cosmos_framework_ext.levers import packing  # noqa: E402
from cosmos_framework_ext.recipe import train
from patches.core import trainer as skeleton  # noqa: E402
from patches.core.errors import ArgumentParser, UserError, cli  # noqa: E402
from patches.core.flags import whole_number_arg  # noqa: E402
from patches.core.io import atomic_write  # noqa: E402
from patches.core.runtime import GiB, median  # noqa: E402

EMA, VAE, CACHE, OPT = "COSMOS_EMA_CPU_SUBSET", "COSMOS_VAE_CPU_OFFLOAD", "COSMOS_LATENT_CACHE", "COSMOS_OPTIM_STATE_OFFLOAD"
ATTENTION_PLACES = (("onecard", "attention"), ("model.attention", "impl"))
"""Where the trainer's schema may hold the packed-attention choice, as (table, key), first found wins: the
``attn`` lever put it in ``[onecard] attention``; the issue proposed ``[model.attention] impl`` (marked option)."""
ATTENTION_FLEX = "flex"
"""The value that selects block-sparse (flex_attention) packed attention."""
ATTENTION_VARLEN = "varlen"
"""The value that selects variable-length (FlashAttention-2) packed attention."""
from benchmarks.checks import H100_H200_DENSE_BF16_TFLOPS  # noqa: E402  (the datasheet figure both benchmarks use)
MEASURED_GEMM_TFLOPS = 776.0
"""The project's measured limits: bf16 GEMM 8192^3 on its H200, 750-776 TFLOP/s (the achievable ceiling)."""


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmark configuration."""

    name: str
    """Row name."""
    flags: dict
    """Lever environment flags."""
    capped: bool
    """Cap the card at ``--budget-gib``."""
    attention: str = ""
    """``[model.attention] impl`` to set (empty: leave the trainer's default, the dense-mask reference)."""
    compile: bool = False
    """``[model.compile] enabled``."""
    selective: bool = False
    """``[model.activation_checkpointing] mode = "selective"``, keeping the attention outputs (:data:`SELECTIVE_OPS`)."""
    checkpoint_layers: str = ""
    """``[onecard] checkpoint_layers`` to set (empty: the trainer's default, every layer)."""
    host_embeddings: bool = False
    """``[onecard] host_embeddings = true``."""
    cap_gib: float | None = None
    """This row's card cap in GiB instead of ``--budget-gib`` (a smaller card)."""
    compile_wrapper: str = ""
    """``[onecard] compile_wrapper`` to set (empty: the trainer's default, inductor's Python wrapper)."""
    detach_text_stream: bool = False
    """``[onecard] detach_text_stream = true`` (no backward pass through the frozen text stream)."""
    text_kv_cache: bool = False
    """``[onecard] text_kv_cache = true`` (the frozen text stream's keys and values from a per-caption cache)."""
    offload_layers: int = 0
    """``[onecard] offload_layers`` to set (0: none; ``--offload-layers`` replaces it where it is set)."""
    background_threads: str = ""
    """``[onecard] background_threads`` to set (empty: the trainer's default, no cap)."""
    inputs_on_main_thread: bool = False
    """Build every micro-batch's host inputs on the main thread (the trainer's path before they moved to the loader
    threads: the A/B of that change)."""


PROBED = " (queue depth)"
"""Suffix of the ``--queue-depth`` row's name (its last step carries :mod:`benchmarks.queue_depth`'s marks)."""
PROFILED = " (profiled)"
"""Suffix of the ``--profile`` row's name (the profiler and its synchronizes slow that row: its times are not
the configuration's)."""
OFF = {EMA: "0", VAE: "0", CACHE: "0", OPT: "0"}
CONFIGS = [
    Config("stock (uncapped card)", OFF, False),
    Config("levers 1+2", {EMA: "1", VAE: "1", CACHE: "0", OPT: "0"}, True),
    Config("+ latent cache", {EMA: "1", VAE: "1", CACHE: "1", OPT: "0"}, True),
    Config("+ block-sparse attention", {EMA: "1", VAE: "1", CACHE: "1", OPT: "0"}, True, attention=ATTENTION_FLEX),
    Config("all levers", {EMA: "1", VAE: "1", CACHE: "1", OPT: "0"}, True, attention=ATTENTION_FLEX, compile=True),
    Config("all levers + optimizer-state streaming", {EMA: "1", VAE: "1", CACHE: "1", OPT: "1"}, True,
           attention=ATTENTION_FLEX, compile=True),
]
TWELVE_GB_CAP_GIB = 11.0
"""The 12 GB card's cap (an RTX 3060/4070 class card's usable memory, GiB)."""
SELECTIVE_OPS = ["fmha", "flex_attention", "scaled_dot_product", "flash_attention"]
"""``save_ops_regex`` of the selective rows: upstream's default plus the embedded trainer's attention ops."""
OFFLOADED_LAYERS = 4
"""``[onecard] offload_layers`` of the offloaded row: at 0.57 GB a layer each way (measured) and about 55 GB/s, four
layers' copies to the host take about as long as the forward of the layers after them on an H100 (six outlast it)."""
SMOKE_OFFLOADED_LAYERS = 1
"""``[onecard] offload_layers`` of the offloaded rows in ``--smoke`` (the tiny preset has 2 decoder layers)."""
OPTIONAL = [
    Config("all levers + optimizer-state streaming + selective AC", {EMA: "1", VAE: "1", CACHE: "1", OPT: "1"}, True,
           attention=ATTENTION_FLEX, compile=True, selective=True),
    Config("all levers + optimizer-state streaming + selective AC + fewer checkpointed layers",
           {EMA: "1", VAE: "1", CACHE: "1", OPT: "1"}, True, attention=ATTENTION_FLEX, compile=True, selective=True,
           checkpoint_layers="auto"),
    Config("all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + host inputs on the "
           "main thread", {EMA: "1", VAE: "1", CACHE: "1", OPT: "1"}, True, attention=ATTENTION_FLEX, compile=True,
           selective=True, checkpoint_layers="auto", inputs_on_main_thread=True),
    Config("all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + C++ wrapper",
           {EMA: "1", VAE: "1", CACHE: "1", OPT: "1"}, True, attention=ATTENTION_FLEX, compile=True, selective=True,
           checkpoint_layers="auto", compile_wrapper="cpp"),
    Config("all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached",
           {EMA: "1", VAE: "1", CACHE: "1", OPT: "1"}, True, attention=ATTENTION_FLEX, compile=True, selective=True,
           checkpoint_layers="auto", detach_text_stream=True),
    Config("all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached "
           "+ lookup tables on the host", {EMA: "1", VAE: "1", CACHE: "1", OPT: "1"}, True, attention=ATTENTION_FLEX,
           compile=True, selective=True, checkpoint_layers="auto", detach_text_stream=True, host_embeddings=True),
    Config("all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached "
           "+ activations offloaded", {EMA: "1", VAE: "1", CACHE: "1", OPT: "1"}, True, attention=ATTENTION_FLEX,
           compile=True, selective=True, checkpoint_layers="auto", detach_text_stream=True,
           offload_layers=OFFLOADED_LAYERS),
    Config("all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached "
           "+ lookup tables on the host + activations offloaded", {EMA: "1", VAE: "1", CACHE: "1", OPT: "1"}, True,
           attention=ATTENTION_FLEX, compile=True, selective=True, checkpoint_layers="auto", detach_text_stream=True,
           host_embeddings=True, offload_layers=OFFLOADED_LAYERS),
    Config("all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached "
           "+ variable-length attention", {EMA: "1", VAE: "1", CACHE: "1", OPT: "1"}, True,
           attention=ATTENTION_VARLEN, compile=True, selective=True, checkpoint_layers="auto",
           detach_text_stream=True),
    Config("all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached "
           "+ lookup tables on the host + variable-length attention", {EMA: "1", VAE: "1", CACHE: "1", OPT: "1"}, True,
           attention=ATTENTION_VARLEN, compile=True, selective=True, checkpoint_layers="auto", detach_text_stream=True,
           host_embeddings=True),
    Config("all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached "
           "+ lookup tables on the host + variable-length attention + text K/V cache",
           {EMA: "1", VAE: "1", CACHE: "1", OPT: "1"}, True, attention=ATTENTION_VARLEN, compile=True, selective=True,
           checkpoint_layers="auto", detach_text_stream=True, host_embeddings=True, text_kv_cache=True),
    Config("all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached "
           "+ lookup tables on the host + variable-length attention + background threads capped",
           {EMA: "1", VAE: "1", CACHE: "1", OPT: "1"}, True, attention=ATTENTION_VARLEN, compile=True, selective=True,
           checkpoint_layers="auto", detach_text_stream=True, host_embeddings=True, background_threads="auto"),
    Config("all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached "
           "+ lookup tables on the host + variable-length attention + text K/V cache + background threads capped",
           {EMA: "1", VAE: "1", CACHE: "1", OPT: "1"}, True, attention=ATTENTION_VARLEN, compile=True, selective=True,
           checkpoint_layers="auto", detach_text_stream=True, host_embeddings=True, text_kv_cache=True,
           background_threads="auto"),
    Config("12 GB card: all levers + optimizer-state streaming + lookup tables on the host",
           {EMA: "1", VAE: "1", CACHE: "1", OPT: "1"}, True, attention=ATTENTION_FLEX, compile=True,
           host_embeddings=True, cap_gib=TWELVE_GB_CAP_GIB),
    Config("stock", OFF, True),
    Config("EMA lever", {EMA: "1", VAE: "0", CACHE: "0", OPT: "0"}, True),
    Config("VAE lever", {EMA: "0", VAE: "1", CACHE: "0", OPT: "0"}, True),
]


# ---------------------------------------------------------------------------------------------- FLOPs
_GEN = ("moe_gen", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "proj_in", "proj_out", "time_embedder")
"""Name parts of the parameters a vision (generation) token passes; every other matmul weight is text's."""
_UNUSED = ("embed_tokens", "lm_head")
"""A lookup (no FLOPs) and the LM head, which the diffusion forward does not run."""


def pathway_params(preset_name: str, keys_to_select: list[str]) -> dict:
    """Matmul parameters per token of each pathway, from the model built on the meta device.

    Returns ``{"und": N, "gen": N, "und_train": N, "gen_train": N, "layers": L, "d_attn": heads x head_dim}``
    (2-D weights only; norms, biases and the embedding lookup are left out: < 0.1 % of the FLOPs).
    """
    from cosmos_framework_ext.recipe.presets import build_transformer, get_preset, select_trainable

    preset = get_preset(preset_name)
    model = build_transformer(preset, device="meta")
    names = dict(model.named_parameters())
    trainable = set(select_trainable(list(names), keys_to_select))
    out = {"und": 0, "gen": 0, "und_train": 0, "gen_train": 0}
    for n, p in names.items():
        if p.dim() != 2 or any(u in n for u in _UNUSED):
            continue
        path = "gen" if any(g in n for g in _GEN) else "und"
        out[path] += p.numel()
        if n in trainable:
            out[f"{path}_train"] += p.numel()
    t = preset.transformer
    out["layers"] = t["num_hidden_layers"]
    out["d_attn"] = t["num_attention_heads"] * t["head_dim"]
    return out


def model_flops(samples: list[tuple[int, int]], p: dict) -> float:
    """Model FLOPs of one packed micro-batch's forward + backward (formula: module docstring).

    Args:
        samples: ``(text_tokens, vision_tokens)`` per sample (``SftSample.und_tokens``/``gen_tokens``).
        p: :func:`pathway_params`.
    """
    g_gen = 1 if p["gen_train"] else 0  # proj_in is the gen stream's first op: trainable -> its activations need grad
    g_und = 1 if p["und_train"] else 0  # text activations need grad only below a trainable text weight
    t_und = sum(u for u, _ in samples)
    t_gen = sum(v for _, v in samples)
    linear = (t_und * (2 * p["und"] + 2 * p["und"] * g_und + 2 * p["und_train"])
              + t_gen * (2 * p["gen"] + 2 * p["gen"] * g_gen + 2 * p["gen_train"]))
    attn = p["layers"] * p["d_attn"] * sum(4 * u * (u + 1) / 2 + (4 + 8 * g_gen) * v * (u + v) for u, v in samples)
    return float(linear + attn)


def peak_flops(device: str, override_tflops: float | None) -> tuple[float | None, str]:
    """``(peak FLOP/s, where it comes from)`` for the card: ``--peak-tflops``, else 989 TFLOP/s on an H100/H200."""
    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    if "H200" in device or "H100" in device:
        return H100_H200_DENSE_BF16_TFLOPS * 1e12, "NVIDIA H100/H200 SXM datasheet, dense BF16"
    return None, "unknown card: pass --peak-tflops"


# ---------------------------------------------------------------------------------------------- one run
def attention_place() -> tuple[str, str] | None:
    """``(table, key)`` of the packed-attention choice in the trainer's schema, or ``None`` (the ``attn`` lever)."""
    from cosmos_framework_ext.recipe.config import SFTConfig

    for table, key in ATTENTION_PLACES:
        cls = SFTConfig
        for part in table.split("."):
            field = {f.name: f for f in dataclasses.fields(cls)}.get(part)
            cls = field.default_factory if field is not None and dataclasses.is_dataclass(field.default_factory) else None
            if cls is None:
                break
        if cls is not None and key in {f.name for f in dataclasses.fields(cls)}:
            return table, key
    return None


def save_host(s: dict) -> dict:
    """The host memory of the run's final checkpoint save, from its summary's memory phases: ``host_rss_save_gib`` (peak
    in the ``checkpoint`` phase), ``host_rss_train_gib`` (peak in every other phase), ``save_adds_host_gib`` (the
    difference), and ``checkpoint_gb`` (the file's size, GB; the file is then deleted)."""
    phases = (s.get("memory") or {}).get("phases") or {}
    save = (phases.get("checkpoint") or {}).get("host_rss_bytes")
    train = max((v.get("host_rss_bytes") or 0 for k, v in phases.items() if k != "checkpoint"), default=0)
    out = {"host_rss_save_gib": save / GiB if save else None, "host_rss_train_gib": train / GiB if train else None,
           "save_adds_host_gib": (save - train) / GiB if save and train else None, "checkpoint_gb": None}
    ckpt = Path(s["checkpoint"]) if s.get("checkpoint") else None
    if ckpt is not None and ckpt.is_file():
        out["checkpoint_gb"] = ckpt.stat().st_size / 1e9
        ckpt.unlink()  # six rows of edge checkpoints do not fit a 64 GiB disk
    return out


def recipe_toml(cfg: Config, grad_accum: int, steps: int, dest: Path, checkpoint_layers: str = "",
                offload_layers: int | None = None) -> Path:
    """``edge_24gb.toml`` with this configuration's grad_accum_iter, compile, attention, checkpointed-layer and
    lookup-table settings (and the same values for the CPU smoke's ``cpu_*`` keys); ``checkpoint_layers`` (the
    ``--checkpoint-layers`` override) replaces the row's own where the row sets one, and ``offload_layers`` (the
    ``--offload-layers`` override) the row's offloaded layers where the row offloads."""
    text = (HERE / "edge_24gb.toml").read_text()
    subs = [
        (r"(?m)^grad_accum_iter\s*=.*$", f"grad_accum_iter         = {grad_accum}"),
        (r"(?m)^cpu_grad_accum_iter\s*=.*$", f"cpu_grad_accum_iter     = {grad_accum}"),
        (r"(?m)^cpu_max_iter\s*=.*$", f"cpu_max_iter            = {steps}"),
        (r"(?m)^(\[model\.compile\]\s*\nenabled\s*=\s*)\S+", rf"\g<1>{'true' if cfg.compile else 'false'}"),
    ]
    if cfg.selective:
        subs += [(r'(?m)^mode\s*=\s*"full"', 'mode                = "selective"'),
                 (r"(?m)^save_ops_regex\s*=.*$", f"save_ops_regex      = {json.dumps(SELECTIVE_OPS)}")]
    for pattern, repl in subs:
        text, n = re.subn(pattern, repl, text)
        if n != 1:
            raise RuntimeError(f"edge_24gb.toml: expected one match of {pattern!r}")
    layers = (checkpoint_layers or cfg.checkpoint_layers) if cfg.checkpoint_layers else ""
    values = {"compile_blocks": cfg.compile,  # the embedded trainer compiles only when compile_blocks says so as well
              "checkpoint_layers": int(layers) if layers.isdigit() else layers,
              "host_embeddings": cfg.host_embeddings, "compile_wrapper": cfg.compile_wrapper,
              "detach_text_stream": cfg.detach_text_stream, "text_kv_cache": cfg.text_kv_cache,
              "background_threads": cfg.background_threads,
              "offload_layers": (offload_layers or cfg.offload_layers) if cfg.offload_layers else False}
    # unset: False or "" (0 checkpointed layers is a value); JSON writes these scalars as TOML does
    onecard = [f"{key} = {json.dumps(value)}" for key, value in values.items() if value is not False and value != ""]
    if onecard:
        lines = "\n".join(onecard)
        text = text.replace("[onecard]\n", f"[onecard]\n{lines}\n", 1) if "[onecard]\n" in text \
            else text + f"\n[onecard]\n{lines}\n"
    place = attention_place()
    if cfg.attention and place is not None:
        table, key = place
        line = f'{key} = "{cfg.attention}"'
        if f"[{table}]\n" in text:
            text = text.replace(f"[{table}]\n", f"[{table}]\n{line}\n", 1)
        else:
            text += f"\n[{table}]\n{line}\n"
    path = dest / f"{slug(cfg.name)}.toml"
    path.write_text(text)
    return path


def layers_cell(row: dict) -> str:
    """The table's checkpointed-layers cell: the count, and the offloaded layers taken from it (``"17 + 4 offloaded"``)."""
    n, off = row.get("checkpoint_layers"), (row.get("offload") or {}).get("layers", 0)
    if n is None:
        return "–"
    return f"{n - off} + {off} offloaded" if off else str(n)


def offload_layers_check(offload: int | None, checkpoint_layers: str | None, preset: str, running: list[str]) -> None:
    """``--offload-layers`` (``offload``, already a whole number) checked before any row runs: at most the preset's
    decoder layers, only with an offloaded row among ``running`` (the names of every row the run runs), and, for
    those rows, not more layers (``offload``, else :data:`OFFLOADED_LAYERS`, :data:`SMOKE_OFFLOADED_LAYERS` in the smoke)
    than a numeric ``checkpoint_layers`` (``--checkpoint-layers``, as :func:`checkpoint_layers_arg` returned it).

    Raises:
        UserError: any of these (one line naming the fix).
    """
    from cosmos_framework_ext.recipe.presets import get_preset

    layers = get_preset(preset).transformer["num_hidden_layers"]
    offloading = [c.name for c in OPTIONAL + CONFIGS if c.offload_layers and c.name in running]
    if offload is not None:
        if offload > layers:
            raise UserError(f"--offload-layers {offload} is above the {layers} decoder layers of the {preset} preset: "
                            f"pass 1 to {layers} (at most the row's checkpointed layers)")
        if not offloading:
            raise UserError("--offload-layers applies only to the rows named '... activations offloaded' (--list shows "
                            "them): add one to --only (or --profile, --queue-depth), or drop --offload-layers")
    if offloading and checkpoint_layers is not None and checkpoint_layers.isdigit():
        k, n = offload or (SMOKE_OFFLOADED_LAYERS if preset == "tiny" else OFFLOADED_LAYERS), int(checkpoint_layers)
        if k > n:
            fix = f"--offload-layers {n} or less, or " if n else ""
            more = f"--checkpoint-layers {k} or more" if k <= layers else "fewer offloaded layers"
            raise UserError(f"the row {offloading[0]!r} would offload {k} of the {n} layers --checkpoint-layers {n} "
                            f"checkpoints (offloaded layers are taken from the checkpointed ones): pass {fix}{more}")


def checkpoint_layers_arg(value: str, preset: str, only: list[str]) -> str:
    """``--checkpoint-layers`` checked before any row runs: ``"all"``, ``"auto"`` or 0 to the preset's decoder layers
    in ASCII digits (returned without leading zeros), and only with a row that reads it in ``--only``, ``--profile``
    or ``--queue-depth`` (``only``: the names of every row the run runs).

    Raises:
        UserError: anything else (one line naming the fix).
    """
    from cosmos_framework_ext.recipe.presets import get_preset

    layers = get_preset(preset).transformer["num_hidden_layers"]
    if value not in ("all", "auto") and not (re.fullmatch(r"0*[0-9]{1,4}", value) and int(value) <= layers):
        raise UserError(f"--checkpoint-layers {value!r} is not a number of decoder layers from 0 to {layers} (the "
                        f"{preset} preset), \"all\" or \"auto\": pass e.g. {max(layers - 8, 0)}, or several "
                        f"separated by commas without spaces (e.g. auto,{max(layers - 8, 0)})")
    readers = [c.name for c in OPTIONAL + CONFIGS if c.checkpoint_layers]
    if not any(name in readers for name in only):
        rows = f"row {readers[0]!r}" if len(readers) == 1 else f"rows that leave layers out ({len(readers)}: the ones named " \
            "'... fewer checkpointed layers ...', --list shows them)"
        raise UserError(f"--checkpoint-layers applies only to the {rows}: add one to --only (or --profile, "
                        "--queue-depth), or drop --checkpoint-layers")
    return value if value in ("all", "auto") else str(int(value))


def checkpoint_layers_list(value: str, preset: str, only: list[str]) -> list[str]:
    """``--checkpoint-layers`` as its comma-separated values, each checked by :func:`checkpoint_layers_arg`: the rows
    that read it run once per value, in order, in one process (their micro-batches paired).

    Raises:
        UserError: a value :func:`checkpoint_layers_arg` refuses, or one given twice (one line naming the fix).
    """
    from cosmos_framework_ext.recipe.presets import get_preset

    values = [checkpoint_layers_arg(v, preset, only) for v in value.split(",")]
    layers = str(get_preset(preset).transformer["num_hidden_layers"])
    counts = [layers if v == "all" else v for v in values]  # "all" is every layer: the same run as that number
    twice = sorted({v for v in counts if counts.count(v) > 1})
    if twice:
        raise UserError(f"--checkpoint-layers {value!r} names {twice[0]} layers twice (\"all\" is {layers} on the "
                        f"{preset} preset): give each number of layers once")
    return values


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def measured_part(warmup: int, grad_accum: int) -> tuple[slice, slice]:
    """Which of a row's micro-batch times and optimizer-step times are measured: those after its first ``warmup``
    steps (``grad_accum`` micro-batches each). ``--steps`` > ``--warmup`` is checked before any row runs."""
    warm = warmup * grad_accum
    return slice(warm, None), slice(warmup, None)


def replay_samples(recipe: train.CosmosSFT) -> list[list[tuple[int, int]]]:
    """``(text, vision)`` tokens of every micro-batch the run consumed, from a fresh loader with the same seed
    (the loader is deterministic; nothing is decoded)."""
    src = recipe.loader.source
    loader = packing.PackingLoader(src, cap=recipe.cap, rank=recipe.rank, world_size=recipe.world,
                                   seed=recipe.cfg.onecard.seed)
    it = iter(loader)
    return [[(s.und_tokens, s.gen_tokens) for s in next(it)] for _ in range(recipe.consumed)]


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")
"""``torch.cuda.memory_stats`` counters a row reports (over its run, warm-up and save included): a retry frees
cached blocks and waits for the device, so a capped row that retries loses the host's lead on the GPU."""


def allocator_counts() -> dict[str, int]:
    """The :data:`ALLOCATOR_COUNTS` of the current CUDA device now (cumulative since the process started)."""
    st = torch.cuda.memory_stats()
    return {k: int(st.get(k, 0)) for k in ALLOCATOR_COUNTS}


def counter_delta(before: dict | None, after: dict | None) -> dict | None:
    """``after - before``, counter by counter (two readings of cumulative counters; a counter missing from ``before``
    counts from 0); ``None`` if either reading is."""
    if before is None or after is None:
        return None
    return {k: v - before.get(k, 0) for k, v in after.items()}


def allocator_delta(before: dict[str, int]) -> dict[str, int]:
    """The :data:`ALLOCATOR_COUNTS` since ``before`` (an :func:`allocator_counts` reading)."""
    return counter_delta(before, allocator_counts())


def pinned_allocator() -> dict[str, float] | None:
    """The pinned host allocator's growth counters now (cumulative since the process started): ``num_host_alloc``
    (blocks it asked CUDA for), ``host_alloc_ms`` (ms spent in those calls: each page-locks its block while it holds
    the driver), from ``torch.cuda.host_memory_stats``; ``None`` where this torch has no such statistics."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    st = stats()
    return {"num_host_alloc": int(st.get("num_host_alloc", 0)),
            "host_alloc_ms": st.get("host_alloc_time.total", 0) / 1e3}


def reserved_by_stream() -> list[dict]:
    """The caching allocator's segments of the current CUDA device now, summed per stream, largest first:
    ``[{"stream": "default" | "side <k>", "reserved_gib": float, "allocated_gib": float}]`` ("default": stream 0,
    the one the trainer computes on; side streams numbered in the order of their ids). A free block serves only
    allocations on its own stream, so memory a side stream keeps cached is reserved but out of reach of the
    training stream's activations."""
    per: dict[int, list[int]] = {}
    device = torch.cuda.current_device()
    for seg in torch.cuda.memory_snapshot():
        if int(seg.get("device", device)) != device:
            continue
        tot = per.setdefault(int(seg["stream"]), [0, 0])
        tot[0] += int(seg["total_size"])
        tot[1] += int(seg["allocated_size"])
    side = iter(range(1, len(per) + 1))
    out = [{"stream": "default" if k == 0 else f"side {next(side)}", "reserved_gib": round(r / GiB, 3),
            "allocated_gib": round(a / GiB, 3)} for k, (r, a) in sorted(per.items())]
    return sorted(out, key=lambda d: -d["reserved_gib"])


def run_one(cfg: Config, args: argparse.Namespace, tmp: Path, flops_p: dict | None, peak: float | None,
            profile: bool = False, probe: bool = False, run: int = 1, layers: str | None = None) -> dict:
    """Run one configuration and return its row; ``profile``: the row named ``<config> (profiled)``, with
    micro-batches 1-3 of its last step profiled (:mod:`benchmarks.breakdown`, row key ``breakdown``); ``probe``: the
    row named ``<config> (queue depth)``, its last step marked (:mod:`benchmarks.queue_depth`, row key
    ``queue_depth``); ``run`` > 1: the configuration's ``run``-th run in this process (``<config> (run <k>)``);
    ``layers``: the row's ``[onecard] checkpoint_layers`` when ``--checkpoint-layers`` names several values
    (``<config> (checkpoint_layers <layers>)``), else the one ``--checkpoint-layers`` value or the row's own."""
    cuda = torch.cuda.is_available()
    suffix = PROFILED if profile else PROBED if probe else f" (run {run})" if run > 1 else ""
    if layers is not None:
        suffix = f" (checkpoint_layers {layers})" + suffix
    given = layers or (args.checkpoint_layers[0] if args.checkpoint_layers else "")
    os.environ.update(cfg.flags, OUTPUT_ROOT=str(tmp / "out" / slug(cfg.name + suffix)))  # each row its own folder
    cap_gib = cfg.cap_gib or args.budget_gib
    if cfg.capped and cuda:
        os.environ["ONECARD_GPU_MEMORY_GIB"] = str(cap_gib)
    else:
        os.environ.pop("ONECARD_GPU_MEMORY_GIB", None)
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
    row: dict = {"config": cfg.name + suffix, "capped_gib": cap_gib if cfg.capped and cuda else None,
                 "attention": cfg.attention or "default (dense masks)", "compile": cfg.compile}
    if cfg.attention and attention_place() is None:
        row.update(status="skipped: the trainer's schema has no packed-attention setting")
        return row
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    toml = recipe_toml(cfg, args.grad_accum, args.steps, tmp, given,
                       args.offload_layers or (SMOKE_OFFLOADED_LAYERS if args.smoke else None))
    # the final checkpoint is written (and deleted after the row): the row's host peak is through a save
    recipe = train.CosmosSFT(train.parse_args(["--sft-toml", str(toml), "--max-iter", str(args.steps)]))
    if cfg.inputs_on_main_thread:
        recipe.prepare_ahead = False
    prof = None
    if profile:  # micro-batches 1..3 of the last step (0 alone when grad_accum_iter is 1: a smoke)
        ga = args.grad_accum
        prof = bd.ProfiledMicroBatches(recipe, args.steps - 1, range(min(1, ga - 1), min(4, ga)),
                                       tmp / "traces" / f"{slug(cfg.name)}.json", sync=not args.profile_without_sync)
    pauses = qd.GcPauses(recipe, first=args.warmup)  # the measured steps; installed first: inside the probe's wrapper
    marks = qd.QueueDepth(recipe, args.steps - 1) if probe else None
    step_s: list[float] = []
    step = recipe.train_step
    pinned: dict[str, dict | None] = {}  # the pinned allocator at the first measured step's start and after the last

    def timed_step(it: int):
        if cuda and len(step_s) == args.warmup:
            pinned["before"] = pinned_allocator()
        result = step(it)
        step_s.append(result.seconds)
        if cuda:
            pinned["after"] = pinned_allocator()
        return result

    recipe.train_step = timed_step
    t0 = time.perf_counter()
    before = allocator_counts() if cuda else {}
    try:
        s = skeleton.run(recipe)
    except torch.OutOfMemoryError as e:
        row.update(status="out of memory", peak_gpu_gib=torch.cuda.max_memory_allocated() / GiB,
                   peak_gpu_reserved_gib=torch.cuda.max_memory_reserved() / GiB, error=str(e).split("\n")[0][:300],
                   allocator=allocator_delta(before))
        row["wall_s"] = time.perf_counter() - t0
        return row
    ga = recipe.ga
    measured, measured_steps = measured_part(args.warmup, ga)
    times = recipe.micro_times[measured]
    batches = replay_samples(recipe)[measured]
    n_samples = sum(len(b) for b in batches)
    vae = s["vae_offload"]
    cache = s.get("latent_cache")
    row.update(
        status="ok", steps=s["steps"], grad_accum_iter=ga, preset=s["preset"], cap=s["cap"],
        peak_gpu_gib=s["peak_gpu_allocated_gib"], peak_gpu_reserved_gib=s["peak_gpu_reserved_gib"],
        predicted_gpu_gib=s["ledger"]["predicted_gpu_allocated_gib"],
        # the trainer's own median (the upper one: an element of the list), over the measured steps only
        s_per_micro_batch=median(times), s_per_step=median(step_s[measured_steps]), warmup_steps=args.warmup,
        s_per_sample=sum(times) / n_samples if n_samples else None,
        micro_batch_s=[round(t, 4) for t in times], measured_samples=n_samples,
        tokens_per_micro_batch=[sum(u + v for u, v in b) for b in batches],
        ema_critical_path_s=(s["ema"] or {}).get("critical_path_s_median"),
        vae_park_unpark_s_per_micro_batch=(
            (vae["park_seconds"] + vae["unpark_seconds"]) / max(vae["unpark_count"], 1) if vae else None),
        prepass_s=cache["seconds"] if cache else None,
        prepass=None if not cache else {k: cache[k] for k in ("entries", "hits", "misses", "corrupt", "bytes_on_disk",
                                                             "encode_seconds")},
        peak_host_rss_gib=s["peak_host_rss_gib"], pinned_gib=s["pinned_bytes"] / GiB,
        **save_host(s),
        samples_per_step=s["samples_per_optimizer_step"], losses=s.get("losses"),  # every step's, warm-up included
        checkpoint_layers=s.get("checkpoint_layers"), offload=s.get("offload"),
        host_tables_gib=(s.get("host_tables") or {}).get("host_bytes", 0) / GiB,
        host_inputs_built=s.get("host_inputs_built"),
        background_threads=s.get("background_threads"),
        compile_note=s.get("compile"),
        allocator=allocator_delta(before) if cuda else None,
        # pinned blocks the measured steps had CUDA page-lock (a loader thread's call holds the driver's lock)
        pinned_allocator_measured=counter_delta(pinned.get("before"), pinned.get("after")),
        # where the reserved memory sits at the row's end (under the cap: the sums equal the peak reserved)
        reserved_by_stream=reserved_by_stream() if cuda else None,
    )
    if flops_p is not None and times:
        flops = sum(model_flops(b, flops_p) for b in batches)
        row["model_tflops_per_micro_batch"] = flops / len(times) / 1e12
        row["model_tflop_per_s"] = flops / sum(times) / 1e12
        row["mfu"] = flops / sum(times) / peak if peak else None
        row["mfu_vs_measured_gemm"] = flops / sum(times) / (MEASURED_GEMM_TFLOPS * 1e12) if cuda else None
    if row["peak_gpu_gib"]:
        row["ledger_error_pct"] = 100.0 * (row["predicted_gpu_gib"] - row["peak_gpu_gib"]) / row["peak_gpu_gib"]
    if prof is not None:
        row["breakdown"] = prof.result
    if marks is not None:
        row["queue_depth"] = marks.result
    row["gc"] = pauses.result
    row["wall_s"] = time.perf_counter() - t0
    del recipe
    return row


def keep_timeline(name: str, tmp: Path, dest: Path) -> list[Path]:
    """Copy the run's memory.csv / memory.png to ``dest/<config>.memory.{csv,png}`` (each atomically); returns the
    copies."""
    copies = []
    for f in (tmp / "out" / slug(name)).rglob("memory.*"):
        copies.append(atomic_write(dest / f"{slug(name)}.{f.name}", lambda p, f=f: shutil.copyfile(f, p)))
    return copies


def markdown(rows: list[dict], device: str, budget: float, ga: int, peak_note: str) -> str:
    def f(v, fmt, scale=1.0):
        return "–" if v is None else format(v * scale, fmt)

    base = next((r for r in rows if r["config"] == CONFIGS[0].name and r.get("s_per_sample")), None)
    warm = next((r["warmup_steps"] for r in rows if r.get("warmup_steps")), 1)
    head = (f"{time.strftime('%Y-%m-%d')}, {device}, torch {torch.__version__}; preset {next((r['preset'] for r in rows if 'preset' in r), '?')}, "
            f"cap {next((r['cap'] for r in rows if 'cap' in r), '?')}, grad_accum_iter {ga}, EMA on; capped rows: card limited to {budget} GiB unless the row says. MFU: model FLOPs "
            f"(fwd + bwd, no recompute) / micro-batch time / peak ({peak_note}); in brackets against the measured "
            f"bf16 GEMM ceiling {MEASURED_GEMM_TFLOPS:.0f} TFLOP/s. Medians: the upper median over the measured steps, "
            f"each row's first {warm} optimizer step(s) not measured. Pre-pass: the latent cache's, before training, "
            "in no step time.\n\n"
            "| config | status | card cap GiB | checkpointed layers | median s/micro-batch | s/step | s/sample (vs stock) "
            "| peak alloc GiB | peak reserved GiB "
            "| ledger GiB (err) | model TFLOP/s | MFU | pre-pass s (hits/misses) | EMA crit. ms/step | "
            "VAE park+unpark ms/micro-batch | host RSS GiB | host RSS through the save GiB (+ the save) | pinned GiB |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = ""
    for r in rows:
        pred = f"{r['predicted_gpu_gib']:.2f} ({r['ledger_error_pct']:+.1f} %)" if r.get("ledger_error_pct") is not None else "–"
        sps = r.get("s_per_sample")
        vs = (f" ({100 * (sps / base['s_per_sample'] - 1):+.0f} %)" if sps and base and r is not base else "")
        mfu = r.get("mfu")
        mfu_s = "–" if mfu is None else f"{100 * mfu:.1f} %" + (
            f" ({100 * r['mfu_vs_measured_gemm']:.1f} %)" if r.get("mfu_vs_measured_gemm") is not None else "")
        pre = r.get("prepass")
        pre_s = "–" if not pre else f"{r['prepass_s']:.1f} ({pre['hits']}/{pre['misses']})"
        body += (f"| {r['config']} | {r['status']} | {f(r.get('capped_gib'), '.2f')} | {layers_cell(r)} | "
                 f"{f(r.get('s_per_micro_batch'), '.3f')} | "
                 f"{f(r.get('s_per_step'), '.2f')} | {f(sps, '.4f')}{vs} | {f(r.get('peak_gpu_gib'), '.2f')} | "
                 f"{f(r.get('peak_gpu_reserved_gib'), '.2f')} | {pred} | {f(r.get('model_tflop_per_s'), '.1f')} | "
                 f"{mfu_s} | {pre_s} | {f(r.get('ema_critical_path_s'), '.1f', 1e3)} | "
                 f"{f(r.get('vae_park_unpark_s_per_micro_batch'), '.1f', 1e3)} | {f(r.get('peak_host_rss_gib'), '.1f')} | "
                 f"{f(r.get('host_rss_save_gib'), '.1f')} ({f(r.get('save_adds_host_gib'), '+.2f')}) | "
                 f"{f(r.get('pinned_gib'), '.2f')} |\n")
    for r in rows:
        if r.get("breakdown"):
            plain = next((x for x in rows if x["config"] + PROFILED == r["config"]), None)
            body += (f"\n### Where the time goes: {r['config']}\n\n"
                     + bd.markdown_table(r["breakdown"], plain.get("s_per_micro_batch") if plain else None))
    for r in rows:
        if r.get("queue_depth"):
            body += f"\n### How far the GPU runs behind the host: {r['config']}\n\n" + qd.markdown_table(r["queue_depth"])
    return head + body


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); bad input: one ``error:`` line, exit 2, nothing written."""
    return cli(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-gib", type=float, default=22.06, help="card cap of the capped rows (GiB)")
    ap.add_argument("--steps", type=whole_number_arg(1, 1000, "optimizer steps"), default=3,
                    help="optimizer steps per configuration (more than --warmup; at most 1000)")
    ap.add_argument("--warmup", type=whole_number_arg(1, 100, "warm-up optimizer steps"), default=1,
                    help="optimizer steps at the start of each configuration that are not measured (1-100, default 1)")
    ap.add_argument("--grad-accum", type=whole_number_arg(1, 4096, "micro-batches per optimizer step"), default=8,
                    help="grad_accum_iter (>= 8 on the GPU, at most 4096; default 8)")
    ap.add_argument("--out", type=folder_arg, default=HERE / "results")
    ap.add_argument("--only", default=None, help="comma-separated config names to run (default: the six main ones; --list names all)")
    ap.add_argument("--list", action="store_true", help="list the configuration names and exit")
    ap.add_argument("--timelines", default=None,
                    help="comma-separated config names whose memory timeline (CSV + PNG) to keep in --out "
                    "(\"\": none; default: \"all levers\" when it runs)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the card's dense bf16 peak in TFLOP/s (default: 989 on an H100/H200)")
    ap.add_argument("--profile", default=None,
                    help="comma-separated config names to run once more each, profiled: where the micro-batch time "
                    "goes (benchmarks/breakdown.py; own rows, \"<config> (profiled)\", and a gzipped trace each)")
    ap.add_argument("--profile-without-sync", action="store_true",
                    help="the --profile rows mark their phases without device synchronizes: the GPU runs behind the "
                    "host as unprofiled, and the breakdown's \"GPU idle while\" line is the critical path as training has it")
    ap.add_argument("--repeat", type=whole_number_arg(1, 5, "runs of each configuration"), default=1,
                    help="run each --only configuration this many times, one after another in this process (1-5; "
                    "rows after the first named \"<config> (run <k>)\"): whether a row's place in the process "
                    "changes its times")
    ap.add_argument("--queue-depth", default=None,
                    help="comma-separated config names to run once more each, with marks through the last step: how "
                    "far the GPU runs behind the host at each phase and layer, unprofiled (benchmarks/queue_depth.py; "
                    "own rows, \"<config> (queue depth)\")")
    ap.add_argument("--checkpoint-layers", default=None,
                    help="[onecard] checkpoint_layers of the \"fewer checkpointed layers\" rows (a number of decoder "
                    "layers, \"all\" or \"auto\"; default auto); several, comma-separated (e.g. auto,15,13): each "
                    "such row runs once per value, in one process, \"<config> (checkpoint_layers <value>)\"; every "
                    "other row checkpoints every layer")
    ap.add_argument("--offload-layers", type=whole_number_arg(1, 28, "offloaded decoder layers"), default=None,
                    help=f"[onecard] offload_layers of the \"activations offloaded\" row (default {OFFLOADED_LAYERS}; at "
                    "most its checkpointed layers)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU smoke of the benchmark itself (tiny preset; no GPU needed; any grad_accum)")
    args = ap.parse_args(argv)
    every = CONFIGS + OPTIONAL
    if args.list:
        print("\n".join(c.name + ("  (optional: --only)" if c in OPTIONAL else "") for c in every))
        return 0
    # every check before the GPU check, the model build and any write under --out
    names = [c.name for c in every]
    only = pick("--only", args.only, names) if args.only is not None else []
    timelines = pick("--timelines", args.timelines if args.timelines is not None else "all levers", names,
                     allow_none=True)
    profiles = pick("--profile", args.profile, names) if args.profile is not None else []
    probes = pick("--queue-depth", args.queue_depth, names) if args.queue_depth is not None else []
    if args.profile_without_sync and not profiles:
        raise UserError("--profile-without-sync changes how the --profile rows are profiled, and none is named: add "
                        "--profile CONFIG, or drop --profile-without-sync")
    at_least("--steps", args.steps, args.warmup + 1, f"{args.warmup} warm-up (--warmup) + at least 1 measured")
    at_least("--grad-accum", args.grad_accum, 1 if args.smoke else 8,
             "micro-batches per optimizer step" if args.smoke else "the GPU run; any >= 1 with --smoke")
    positive("--budget-gib", args.budget_gib, "GiB")
    preset, running = "tiny" if args.smoke else "edge", [c.name for c in every if c.name in only + profiles + probes]
    if args.checkpoint_layers is not None:
        args.checkpoint_layers = checkpoint_layers_list(args.checkpoint_layers, preset, running)
        readers = {c.name for c in every if c.checkpoint_layers}
        for flag, named in (("--profile", profiles), ("--queue-depth", probes), ("--timelines", timelines)):
            clash = [n for n in named if n in readers]
            if clash and len(args.checkpoint_layers) > 1:
                raise UserError(f"{flag} runs or keeps the row {clash[0]!r} once, and --checkpoint-layers names "
                                f"{len(args.checkpoint_layers)} values: give --checkpoint-layers one value, or drop "
                                f"{flag}")
    for n in args.checkpoint_layers or [None]:
        offload_layers_check(args.offload_layers, n, preset, running)
    positive("--peak-tflops", args.peak_tflops, "TFLOP/s")
    writable_dir("--out", args.out)
    # <date>_cosmos_<gpu>_edge24gb, a smoke's ending in -smoke: a smoke never replaces the GPU results
    stem = result_stem("cosmos", "edge24gb", "cpu" if args.smoke or not torch.cuda.is_available()
                       else torch.cuda.get_device_name(), smoke=args.smoke)
    chosen = [c for c in every if c.name in only] if only else CONFIGS
    ran = {c.name for c in chosen}
    if args.timelines is None:  # the default names a row that --only may leave out: keep what runs
        timelines = [t for t in timelines if t in ran]
    idle = [t for t in timelines if t not in ran]
    if idle:
        raise UserError(f"--timelines {','.join(idle)!r}: not among the configurations this run runs "
                        f"({', '.join(c.name for c in chosen)}); add it to --only or drop it from --timelines")
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the tiny preset on the CPU even on a GPU machine
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise UserError("this benchmark needs a CUDA GPU (or --smoke for the CPU smoke with the tiny preset)")
    # every file this run will write, checked before any row runs: the results, the kept timelines, the traces
    free_targets("--out", args.out, [f"{stem}.json", f"{stem}.md"]
                 + [f"{stem}-{slug(t)}-memory.{ext}" for t in timelines for ext in ("csv", "png")]
                 + [f"{stem}-{slug(n)}-profile-trace.json.gz" for n in profiles])
    if any(c.capped for c in chosen + [c for c in every if c.name in profiles + probes]):
        at_most_card("--budget-gib", args.budget_gib)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    device = torch.cuda.get_device_name() if cuda else "cpu"
    peak, peak_note = peak_flops(device, args.peak_tflops)
    keys = ["moe_gen", "time_embedder", "vae2llm", "llm2vae", "k_norm_und_for_gen"]
    flops_p = pathway_params("edge" if cuda else "tiny", keys)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        os.environ["ONECARD_LATENT_CACHE"] = str(tmp / "latents")  # cold for the first cache row, warm after
        # each --only row (--repeat times), then each --profile row, then each --queue-depth row
        several = args.checkpoint_layers if args.checkpoint_layers and len(args.checkpoint_layers) > 1 else [None]
        runs = ([(c, {"run": k, "layers": n}) for c in chosen for k in range(1, args.repeat + 1)
                 for n in (several if c.checkpoint_layers else [None])]
                + [(next(c for c in every if c.name == n), {"profile": True}) for n in profiles]
                + [(next(c for c in every if c.name == n), {"probe": True}) for n in probes])
        for cfg, how in runs:
            rows.append(run_one(cfg, args, tmp, flops_p, peak, **how))
            # kept in tmp until every row has run: all or nothing
            if how.get("run") == 1 and how.get("layers") is None and cfg.name in timelines:
                keep_timeline(cfg.name, tmp, tmp / "timelines")
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("breakdown", "queue_depth")}), flush=True)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        meta = {"device": device, "torch": torch.__version__, "grad_accum_iter": args.grad_accum,
                "steps": args.steps, "peak_tflops": None if peak is None else peak / 1e12, "peak_source": peak_note,
                "pathway_params": flops_p, "rows": rows}
        md = markdown(rows, device, args.budget_gib, args.grad_accum, peak_note)
        write_together({args.out / f"{stem}.json": json.dumps(meta, indent=2) + "\n", args.out / f"{stem}.md": md})
        for f in sorted((tmp / "timelines").glob("*")):
            name = f"{stem}-{f.name.replace('.memory', '-memory')}"
            atomic_write(args.out / name, lambda p, f=f: shutil.copyfile(f, p))
        for name in profiles:  # the raw Chrome trace of each --profile row, gzipped, next to the results
            trace = tmp / "traces" / f"{slug(name)}.json"
            if trace.exists():
                atomic_write(args.out / f"{stem}-{slug(name)}-profile-trace.json.gz",
                             lambda p, t=trace: p.write_bytes(gzip.compress(t.read_bytes(), 6)))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
