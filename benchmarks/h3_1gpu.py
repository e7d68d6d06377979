"""MiniMax-H3 33 B LoRA on one GPU: all-resident vs full offload vs partial residency, at several clip sizes.

    python benchmarks/h3_1gpu.py [--modes resident,offload,partial] [--clips 17x320x192,81x480x832]
        [--probe-largest] [--resident-blocks auto] [--gpu-budget-gib 40] [--steps 1] [--micro-batches 2]
        [--out benchmarks/results]
    python benchmarks/h3_1gpu.py --smoke      # CPU: tiny preset, gloo, every mode at one tiny clip (tested;
                                              # results in outputs/h3_1gpu_smoke/ unless --out)
    python benchmarks/h3_1gpu.py --print-commands [--probe-largest] [--gpu-budget-gib 40] [--out DIR]
    python benchmarks/h3_1gpu.py --merge DIR  # DIR/*/h3_1gpu.json -> DIR/h3_1gpu.json + DIR/h3_1gpu.md

Every configuration runs in a fresh child process (so host peak = that child's ``VmHWM``, and a GPU OOM ends
only that configuration) and builds the ``full`` transformer with the trainer's low-RAM init order,
:func:`miles_ext.levers.fast_init.build_lora_fsdp` (the order of ``miles_ext.recipe.train``'s ``_build_model``): parameters on the
meta device, LoRA rank 64 / alpha 128 on the H3 targets (seed 0), gradient checkpointing, bf16 master, the residency
plan, :func:`miles_ext.levers.fsdp_policy.apply_fsdp2` with the exact pinned arena, then
:func:`miles_ext.levers.fast_init.materialise` writes every base tensor straight into its final storage (random init seeded
per parameter, drawn on the GPU; no full-model copy on the host):

- ``resident``: no offload (the 66 GB of bf16 weights on the card);
- ``offload``: ``--fsdp-cpu-offload`` as the trainer runs it, shards in the exact pinned arena;
- ``partial``: ``--resident-blocks`` (``auto``: the memory model for ``--gpu-budget-gib``) blocks on the card,
  the rest streamed with prefetch, adapters + grads + AdamW on the card, exact pinned arena.

then one warm-up optimizer step and ``--steps`` timed ones, each ``--micro-batches`` accumulated micro-batches
of one synthetic pair of the clip's latent shape (``F x H x W`` pixels -> video latent ``24 x ((F-1)/4+1) x H/16 x
W/16``, 256 text rows, silent audio): the recipe's own :func:`miles_ext.recipe.sft.train_step` (AdamW, clip 1.0).

Reported per configuration (json keys): ``s_per_step`` (median of the timed steps), ``gpu_peak_gib`` (peak
allocated over the steps); host memory (GiB): ``host_peak_init_gib`` (``VmHWM`` at the end of init),
``host_steady_gib`` (``VmRSS`` after the timed steps), ``host_peak_gib`` (``VmHWM`` at the end);
``pinned_requested_bytes`` (offloaded shard bytes) vs ``pinned_locked_bytes`` (measured,
:func:`miles_ext.levers.pinned.locked_bytes`); init time (s): ``init_s`` = ``init_build_s`` (``init_meta_shard_s``: meta
build + LoRA + plan + sharding + arena allocation, plus ``init_materialise_s``) + ``init_rest_s`` (process group,
synthetic data, ``.to(device)``, optimizer); ``import_s`` (imports, outside ``init_s``); ``init_path``,
``base_init``, ``meta_params_before_sharding`` (= ``base_tensors``: no base weight had storage before it got its
final one); ``resident_blocks``, ``residency_plan``, ``optimizer_device``; ``cap_gib`` (the ``--cap-gib`` /
``ONECARD_GPU_MEMORY_GIB`` the card ran under, ``null`` uncapped); the PCIe floor: ``h2d_gb_s`` (measured pinned
host-to-device bandwidth, :func:`pinned_h2d_gb_s`), ``h2d_bytes_per_step`` (the offloaded shards' bytes x 2 copies
per micro-batch x micro-batches, :func:`pcie_floor`) and ``pcie_floor_s`` (their quotient: no step that streams
those bytes over that link can be shorter than resident + this; ``null`` on the CPU; with ``--lockstep N``,
:mod:`miles_ext.levers.lockstep`, 2 copies per group of N micro-batches, and ``lockstep``, ``lockstep_deferred``);
``optimizer_step_s`` (the timed step's ``optimizer.step()``, device work included); ``preset``,
``model_tflop_per_step`` (:func:`model_flop_per_micro_batch` x micro-batches) and ``mfu`` (over the 989 TFLOP/s
dense-bf16 datasheet peak, :func:`mfu`; ``null`` on the CPU). ``--probe-largest`` adds the largest
480x832 clip (121, 161, 201, 241 frames tried in order) whose resident run completes. Writes ``h3_1gpu.json`` and a
markdown table ``h3_1gpu.md`` into ``--out`` (atomically, both or neither; bad arguments, an empty selection or no
GPU without ``--smoke`` are one ``error:`` line and exit status 2 before any run); random weights: timings and memory are the real architecture's,
losses mean nothing.

GPU commands, each within a 10-minute command (``--print-commands`` prints them for the chosen ``--modes`` /
``--clips`` / ``--probe-largest`` / ``--gpu-budget-gib`` / ``--cap-gib``): one configuration per command with
``--timeout-s 540`` (a configuration that runs longer becomes a failed row; the command still writes its json), each
into its own ``--out`` folder, then ``--merge`` the folder. The default matrix, ending with the 24 GB card: full
offload at the recipe's clip (:data:`RECIPE_CLIP`) with the card capped at 22.06 GiB, as it is and with the
checkpointed block inputs that do not fit recomputed (``--recompute-inputs auto``,
:mod:`miles_ext.levers.input_recompute`; rows record ``recompute_block_inputs``, ``recomputed_forwards``,
``input_recompute_plan`` and ``predicted_peak_gib``)::

    ulimit -l unlimited; python benchmarks/h3_1gpu.py --modes resident --clips 17x320x192 --steps 1 --micro-batches 2 --lora-rank 64 --timeout-s 540 --out outputs/h3_1gpu_runs/17x320x192_resident
    ulimit -l unlimited; python benchmarks/h3_1gpu.py --modes offload --clips 17x320x192 --steps 1 --micro-batches 2 --lora-rank 64 --timeout-s 540 --out outputs/h3_1gpu_runs/17x320x192_offload
    ulimit -l unlimited; python benchmarks/h3_1gpu.py --modes partial --clips 17x320x192 --steps 1 --micro-batches 2 --lora-rank 64 --resident-blocks auto --gpu-budget-gib 40 --timeout-s 540 --out outputs/h3_1gpu_runs/17x320x192_partial
    ulimit -l unlimited; python benchmarks/h3_1gpu.py --modes resident --clips 81x480x832 --steps 1 --micro-batches 2 --lora-rank 64 --timeout-s 540 --out outputs/h3_1gpu_runs/81x480x832_resident
    ulimit -l unlimited; python benchmarks/h3_1gpu.py --modes offload --clips 81x480x832 --steps 1 --micro-batches 2 --lora-rank 64 --timeout-s 540 --out outputs/h3_1gpu_runs/81x480x832_offload
    ulimit -l unlimited; python benchmarks/h3_1gpu.py --modes partial --clips 81x480x832 --steps 1 --micro-batches 2 --lora-rank 64 --resident-blocks auto --gpu-budget-gib 40 --timeout-s 540 --out outputs/h3_1gpu_runs/81x480x832_partial
    ulimit -l unlimited; python benchmarks/h3_1gpu.py --modes resident --clips 107x768x1344 --steps 1 --micro-batches 2 --lora-rank 64 --timeout-s 540 --out outputs/h3_1gpu_runs/107x768x1344_resident
    ulimit -l unlimited; python benchmarks/h3_1gpu.py --modes offload --clips 107x768x1344 --steps 1 --micro-batches 2 --lora-rank 64 --timeout-s 540 --out outputs/h3_1gpu_runs/107x768x1344_offload
    ulimit -l unlimited; python benchmarks/h3_1gpu.py --modes partial --clips 107x768x1344 --steps 1 --micro-batches 2 --lora-rank 64 --resident-blocks auto --gpu-budget-gib 40 --timeout-s 540 --out outputs/h3_1gpu_runs/107x768x1344_partial
    ulimit -l unlimited; python benchmarks/h3_1gpu.py --modes offload --clips 107x768x1344 --steps 1 --micro-batches 2 --lora-rank 64 --cap-gib 22.06 --timeout-s 540 --out outputs/h3_1gpu_runs/107x768x1344_offload_cap22.06
    ulimit -l unlimited; python benchmarks/h3_1gpu.py --modes offload --clips 107x768x1344 --steps 1 --micro-batches 2 --lora-rank 64 --recompute-inputs auto --cap-gib 22.06 --timeout-s 540 --out outputs/h3_1gpu_runs/107x768x1344_offload_cap22.06_recomputeauto
    python benchmarks/h3_1gpu.py --merge outputs/h3_1gpu_runs

(``--probe-largest`` puts ``--modes resident --clips {121,161,201,241}x480x832`` first; stop after the first that
fails.) ``ulimit -l unlimited``: the arena registers ~66 GB (offload; less for partial). Measured on an H200
(2026-11-30, ``--steps 2``): 38-125 s per configuration, imports and init included, so several configurations can
share one command (``--modes a,b,c`` with a ``--timeout-s`` that fits). ``--sync-h2d`` runs partial residency
without :mod:`miles_ext.levers.h2d_prefetch` (FSDP2's own copy on the compute stream): the same-run baseline of that lever.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.checks import (H100_H200_DENSE_BF16_TFLOPS, at_least, at_most_card, folder_arg, free_targets, pick, positive, writable_dir,  # noqa: E402
                               write_together)
from patches.core.errors import ArgumentParser, UserError, cli  # noqa: E402
from patches.core.flags import is_whole_number  # noqa: E402

MODES = ("resident", "offload", "partial")
PROBE_FRAMES = (121, 161, 201, 241)
RECIPE_CLIP = "107x768x1344"
"""The clip size of upstream miles-diffusion's own one-GPU H3 recipe (27,580 tokens)."""
DEFAULT_CLIPS = f"17x320x192,81x480x832,{RECIPE_CLIP}"
CARD_24GB_GIB = 22.06
"""A 24 GB card's usable memory (GiB): the cap of the 24 GB configurations."""
SMOKE_BUDGET_GIB = 4.0
"""The GPU budget ``--recompute-inputs auto`` plans for in a CPU smoke run without ``--cap-gib`` (GiB)."""
ALLOC_CONF = "expandable_segments:True"
"""``PYTORCH_CUDA_ALLOC_CONF`` of every configuration unless the environment sets one (as the launchers do): under a
22.06 GiB cap the default allocator left 1.9 GiB reserved but unusable for a 1.48 GiB block (H200, 2026-12-04).
Each row records it (``alloc_conf``)."""
H2D_PROBE_BYTES = 256 << 20
"""Bytes of the pinned buffer :func:`pinned_h2d_gb_s` copies to the GPU (256 MiB: large enough for the link's
steady rate, small against the host figures)."""
UNSHARDS_PER_MICRO_BATCH = 2
"""Host-to-device copies of a streamed unit per micro-batch: its forward, and its backward (FSDP2 reshards after the
forward, and the checkpointed recompute runs inside the backward's unshard)."""


def pinned_h2d_gb_s(device, nbytes: int = H2D_PROBE_BYTES, repeats: int = 3) -> float | None:
    """Measured host-to-device bandwidth (GB/s, 1e9 bytes) of a pinned ``nbytes`` buffer: the best of ``repeats``
    timed copies (CUDA events) after one warm-up; ``None`` on a CPU ``device``."""
    import torch

    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    best = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    return nbytes / best / 1e9


def pcie_floor(streamed_bytes: int, micro_batches: int, gb_s: float | None,
               lockstep: int = 1) -> tuple[int, float | None]:
    """(bytes copied host-to-device per optimizer step, the copy's lower bound in s at ``gb_s``): every streamed
    unit's bytes (``streamed_bytes``, the offloaded shards) :data:`UNSHARDS_PER_MICRO_BATCH` times per micro-batch, or
    per group of ``lockstep`` micro-batches (:mod:`miles_ext.levers.lockstep`: ``ceil(micro_batches / lockstep)``
    groups). The bound is ``None`` without a measured bandwidth."""
    per_step = streamed_bytes * UNSHARDS_PER_MICRO_BATCH * -(-micro_batches // max(1, lockstep))
    return per_step, (per_step / (gb_s * 1e9) if gb_s else None)


def model_flop_per_micro_batch(preset, tokens: int) -> float:
    """Model FLOPs of one micro-batch (one pair, ``tokens`` packed rows) of the frozen-base LoRA step, forward and
    backward without the checkpoint's recompute (the MFU convention, PaLM appendix B, less the weight gradients a
    frozen base does not compute): per transformer block, each attention and MLP weight ``2`` FLOPs per row in the
    forward and ``2`` in the backward's input gradient (``4 W T``), and attention's two ``T x T`` products,
    ``4 T^2 d`` forward and twice that backward (``12 T^2 d``, ``d`` = heads x head width). Left out: the AdaLN
    projections (they see the few timestep rows, not the tokens), the token refiner (text rows only), embeddings,
    heads and the LoRA adapters (rank 64: under 2 % of the block weights). ``W = 4 h d + 3 h f`` (q, k, v, out; the
    gated MLP's ``2f x h`` and ``h x f``; ``h`` hidden, ``f`` ffn width): 385.4 M per block on the full preset."""
    d = preset.num_attention_heads * preset.attention_head_dim
    weights = 4 * preset.hidden_size * d + 3 * preset.hidden_size * preset.ffn_dim
    return float(preset.num_layers * (4 * weights * tokens + 12 * tokens ** 2 * d))


def mfu(flop_per_step: float, s_per_step: float | None, peak_tflops: float = H100_H200_DENSE_BF16_TFLOPS) -> float | None:
    """Model FLOPs utilisation: ``flop_per_step / s_per_step`` over the datasheet peak (dense bf16, TFLOP/s);
    ``None`` without a time."""
    if not s_per_step:
        return None
    return flop_per_step / s_per_step / (peak_tflops * 1e12)


def parse_clip(text: str) -> tuple[int, int, int]:
    """``"FxHxW"`` -> (frames, height, width); ``ValueError`` otherwise."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(is_whole_number(p) and int(p) > 0 for p in parts):
        raise ValueError(f"clip {text!r}: use FRAMESxHEIGHTxWIDTH, e.g. 81x480x832")
    return int(parts[0]), int(parts[1]), int(parts[2])


def synthetic_pair(preset, clip: tuple[int, int, int], spatial: int, temporal: int, text_rows: int, seed: int = 0):
    """One clean pair with the latent shapes of ``clip`` (random values; fp32 on the CPU)."""
    import torch

    from miles_ext.recipe.sft import SftPair

    f, h, w = clip
    t, lh, lw = (f - 1) // temporal + 1, max(2, h // spatial), max(2, w // spatial)
    lh, lw = lh - lh % 2, lw - lw % 2
    g = torch.Generator().manual_seed(seed)
    return SftPair(text=torch.randn(text_rows, preset.text_dim, generator=g),
                   video=torch.randn(preset.in_channels, t, lh, lw, generator=g),
                   audio=torch.zeros(2, preset.audio_in_channels, max(2, 4 * t)))


class GatheredBytes:
    """Counts the bytes of ``model``'s offloaded FSDP2 shards gathered to the device while :attr:`counting` (each
    offloaded unit's ``_to_unsharded``, reached once per gather that copies its host shards, whichever stream copies
    them): the host-to-device bytes a step really moved, next to :func:`pcie_floor`'s model of them. :meth:`undo`
    restores FSDP2."""

    def __init__(self, model):
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        from patches.core import torch_internals

        sizes = {id(g): sum(fp._sharded_param_data.numel() * fp._sharded_param_data.element_size()
                            for fp in g.fsdp_params) for g in torch_internals.fsdp_param_groups(model)
                 if any(fp.offload_to_cpu for fp in g.fsdp_params)}
        self.cls, self.real, self.bytes, self.counting = FSDPParamGroup, FSDPParamGroup._to_unsharded, 0, False
        real = self.real

        def to_unsharded(group):
            if self.counting:
                self.bytes += sizes.get(id(group), 0)
            return real(group)

        FSDPParamGroup._to_unsharded = to_unsharded

    def undo(self) -> None:
        self.cls._to_unsharded = self.real


def run_one(mode: str, clip: str, a: argparse.Namespace) -> dict:
    """One configuration in this process (the child); returns its result dict."""
    import torch

    from miles_ext.levers import fast_init, input_recompute
    from miles_ext.levers.fsdp_policy import prefetched_adapter_units
    from miles_ext.levers.h2d_prefetch import attached
    from miles_ext.levers.lora import lora_parameters
    from miles_ext.levers.pinned import locked_bytes, pinned_report
    from patches.core.runtime import proc_status_kib
    from miles_ext.recipe.presets import H3_LORA_TARGETS, build_transformer, get_preset
    from miles_ext.recipe.schedule import pair_schedule
    from miles_ext.levers.residency import block_bytes, resolve_residency
    from patches.core.device import gpu_budget_bytes, gpu_memory_cap_gib, pick_device
    from patches.core.flags import parse_resident_blocks
    from miles_ext.recipe.sft import train_step
    from patches.core.runtime import GiB, free_port, host_rss, median

    ti = time.perf_counter()
    for name in ("accelerate", "peft", "diffusers.models.transformers.transformer_minimax_h3"):
        importlib.import_module(name)  # import time reported apart (import_s), not inside init_s
    import_s = time.perf_counter() - ti
    cuda = torch.cuda.is_available() and not a.smoke
    device = pick_device(0) if cuda else torch.device("cpu")  # capped at ONECARD_GPU_MEMORY_GIB (--cap-gib)
    cap_gib = gpu_memory_cap_gib() if cuda else None
    t0 = time.perf_counter()
    rss_start = host_rss()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.distributed.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=0, world_size=1)
    preset = get_preset("tiny" if a.smoke else "full")
    mesh = None
    if not cuda:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,))
    pair = synthetic_pair(preset, parse_clip(clip), 4 if a.smoke else 16, 2 if a.smoke else 4, 4 if a.smoke else 256)
    tokens = pair.video[0].numel() // 4 + pair.text.shape[0] + pair.audio.shape[-1]
    offload = mode != "resident"
    plan_terms = {}

    def plan_resident(model):
        """``partial``: the resident block indices (``auto``: the memory model on the meta model's stored dtypes)."""
        if mode != "partial":
            return None
        budget = (int(a.gpu_budget_gib * GiB) if a.gpu_budget_gib else
                  (gpu_budget_bytes(torch.device("cuda", 0)) if cuda else int(1 * GiB)))
        value = parse_resident_blocks(a.resident_blocks, "--resident-blocks")
        if isinstance(value, int):
            value = min(value, len(block_bytes(model)[0]))
        res = resolve_residency(model, value, source="--resident-blocks", budget_bytes=budget, tokens=tokens,
                      act_bytes=2 if cuda else 4, reserve_gib=0.0 if a.smoke else 3.0,
                      say=lambda line: print(line, flush=True))
        if res.plan is not None:
            plan_terms["line"] = res.plan.line()
        return res.indices

    # the trainer's low-RAM init order (miles_ext.recipe.train's _build_model): meta build, LoRA, master dtype, residency
    # plan, FSDP2 with the exact arena, then every base tensor written straight into its final storage
    rss_before_build = host_rss()
    built = fast_init.build_lora_fsdp(lambda: build_transformer(preset, device="cpu"), seed=0,
                                      lora=dict(rank=a.lora_rank, alpha=2 * a.lora_rank, target_modules=H3_LORA_TARGETS),
                                      master_dtype="bf16" if cuda else "fp32", cpu_offload=offload,
                                      source=fast_init.RandomInit(0, draw_device=None if cuda else "cpu"),
                                      plan_resident=plan_resident, mesh=mesh,
                                      param_dtype=torch.bfloat16 if cuda else None,
                                      h2d_prefetch=False if a.sync_h2d else (True if a.prefetch_h2d else None),
                                      prefetch_adapters=not a.late_adapters)
    model, resident = built.model, built.resident
    recompute, rplan = input_recompute.resolve_count(
        model, a.recompute_inputs, source="--recompute-inputs", full_offload=mode == "offload",
        budget_bytes=gpu_budget_bytes(device) if cuda else int((a.cap_gib or SMOKE_BUDGET_GIB) * GiB), tokens=tokens,
        act_bytes=2 if cuda else 4,
        prefetch=mode == "offload" and a.prefetch_h2d, say=lambda line: print(line, flush=True))
    lever = input_recompute.enable(model, recompute)
    from miles_ext.levers.lockstep import Lockstep

    lock = Lockstep(model, a.lockstep) if a.lockstep > 1 else None
    if cuda and not offload:
        model.to(device)
    lora = lora_parameters(model)
    opt = torch.optim.AdamW(list(lora.values()), lr=1e-4)
    stepper = None
    from miles_ext.levers.adapter_step import AdapterStepOnDevice, pin_adapter_gradients

    if a.adapter_step:  # the offloaded adapters' AdamW on the device (miles_ext.levers.adapter_step)

        stepper = AdapterStepOnDevice(opt, device)
    pinned_grads = pin_adapter_gradients(model) if a.pin_adapter_gradients else 0
    init_s = time.perf_counter() - t0
    status = proc_status_kib(("VmHWM", "VmRSS"))
    host_peak_init, host_after_init = status["VmHWM"] * 1024 / GiB, status["VmRSS"] * 1024 / GiB
    opt_times: list[float] = []
    real_step = opt.step

    def timed_step(*args, **kwargs):
        """The optimizer step alone, device work included (``optimizer_step_s``)."""
        if cuda:
            torch.cuda.synchronize(device)
        ts = time.perf_counter()
        out = real_step(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize(device)
        opt_times.append(time.perf_counter() - ts)
        return out

    opt.step = timed_step
    pairs = [pair] * (a.micro_batches * (a.steps + 1))
    sched = pair_schedule(a.micro_batches, a.micro_batches, a.steps + 1, 1)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    gathered = GatheredBytes(model)
    try:
        for i, slots in enumerate(sched):
            gathered.counting = i > 0  # the timed steps
            ts = time.perf_counter()
            train_step(model, opt, slots, pairs, seed=0, max_grad_norm=1.0, device=device, lockstep=lock)
            if cuda:
                torch.cuda.synchronize(device)
            if i > 0:
                times.append(time.perf_counter() - ts)
    finally:
        gathered.undo()
    rep = pinned_report(model)
    locked = locked_bytes()
    status = proc_status_kib(("VmHWM", "VmRSS"))
    gb_s = pinned_h2d_gb_s(device)  # after the host figures are read: its pinned buffer is in none of them
    h2d_bytes, floor_s = pcie_floor(rep.requested_bytes if rep else 0, a.micro_batches, gb_s, a.lockstep)
    opt_dev = (f"{device.type} (streamed)" if stepper is not None else
               next(iter(opt.state.values()))["exp_avg"].device.type if opt.state else "none")
    flop = model_flop_per_micro_batch(preset, tokens) * a.micro_batches
    torch.distributed.destroy_process_group()
    build_s = built.build_s + built.materialise_s
    return {"mode": mode, "clip": clip, "tokens": tokens, "resident_blocks": len(resident) if resident is not None
            else (0 if offload else "all"), "s_per_step": median(times), "s_per_step_all": times,
            "gpu_peak_gib": torch.cuda.max_memory_allocated(device) / GiB if cuda else 0.0,
            "host_peak_gib": status["VmHWM"] * 1024 / GiB,
            "host_peak_init_gib": host_peak_init, "host_after_init_gib": host_after_init,
            "host_steady_gib": status["VmRSS"] * 1024 / GiB,
            "host_start_gib": rss_start / GiB, "host_before_build_gib": rss_before_build / GiB,
            "pinned_requested_bytes": rep.requested_bytes if rep else 0, "pinned_locked_bytes": locked["total"],
            "locked": locked, "import_s": import_s, "init_s": init_s, "init_build_s": build_s, "init_meta_shard_s": built.build_s,
            "init_materialise_s": built.materialise_s, "init_rest_s": init_s - build_s,
            "init_path": "fast_init.build_lora_fsdp", "base_init": built.report.source,
            "base_tensors": built.report.tensors, "base_bytes": built.report.bytes,
            "meta_params_before_sharding": built.meta_params_before_sharding,
            "residency_plan": plan_terms.get("line"), "optimizer_device": opt_dev,
            "h2d": "prefetch" if attached(model) else "sync",
            "h2d_prefetch": getattr(model, "_onecard_h2d_prefetch", None),
            "h2d_staged": sum(p.staged for p in attached(model)), "h2d_dropped": sum(p.dropped for p in attached(model)),
            "adapters_prefetched": prefetched_adapter_units(model),
            "cap_gib": cap_gib, "h2d_gb_s": gb_s, "h2d_bytes_per_step": h2d_bytes, "pcie_floor_s": floor_s,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "gpu_reserved_peak_gib": torch.cuda.max_memory_reserved(device) / GiB if cuda else 0.0,
            "recompute_block_inputs": recompute, "recomputed_forwards": lever.recomputed if lever else 0,
            "lockstep": a.lockstep, "lockstep_deferred": lock.deferred if lock else 0,
            "adapter_step": stepper is not None, "pin_adapter_gradients": a.pin_adapter_gradients,
            "pinned_adapter_gradients": pinned_grads,
            "h2d_bytes_counted_per_step": gathered.bytes // max(1, len(times)),
            "optimizer_step_s": median(opt_times[1:]) if len(opt_times) > 1 else None,
            "preset": preset.name, "model_tflop_per_step": flop / 1e12,
            "mfu": mfu(flop, median(times)) if cuda else None,
            "input_recompute_plan": rplan.line() if rplan else None,
            "predicted_peak_gib": rplan.total_bytes / GiB if rplan else None,
            "ok": True}


def child(mode: str, clip: str, argv: list[str], timeout: float, cap_gib: float | None = None) -> dict:
    """Run one configuration in a fresh process (the card capped at ``cap_gib`` GiB through
    ``ONECARD_GPU_MEMORY_GIB`` when given, else as the environment says); an OOM or crash is a result with
    ``ok: False`` that still records the cap and the ``--recompute-inputs`` setting."""
    setting = next((x.split("=", 1)[1] for x in argv if x.startswith("--recompute-inputs=")), "0")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", mode, clip, *argv]
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    if cap_gib is not None:
        env["ONECARD_GPU_MEMORY_GIB"] = f"{cap_gib:g}"
    from patches.core.device import gpu_memory_cap_gib

    cap = gpu_memory_cap_gib(environ=env)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "clip": clip, "cap_gib": cap, "recompute_block_inputs": setting, "ok": False,
                "error": f"timed out after {timeout:.0f} s"}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
    return {"mode": mode, "clip": clip, "cap_gib": cap, "recompute_block_inputs": setting, "ok": False,
            "error": " | ".join(tail)}


def oom_summary(error: str) -> str | None:
    """A CUDA out-of-memory error's figures in one phrase (``out of memory: X GiB allocated, Y more asked, Z
    allowed``), or ``None`` when ``error`` is no such error."""
    import re

    if "OutOfMemoryError" not in error and "out of memory" not in error:
        return None

    def gib(pattern: str) -> str | None:
        m = re.search(pattern, error)
        if not m:
            return None
        return f"{float(m.group(1)) / (1024 if m.group(2) == 'MiB' else 1):.2f} GiB"

    asked = gib(r"Tried to allocate ([\d.]+) (GiB|MiB)")
    allocated = gib(r"([\d.]+) (GiB|MiB) is allocated by PyTorch")
    allowed = gib(r"([\d.]+) (GiB|MiB) allowed")
    parts = [f"{allocated} allocated" if allocated else "", f"{asked} more asked" if asked else "",
             f"{allowed} allowed" if allowed else ""]
    return "out of memory: " + ", ".join(p for p in parts if p) if any(parts) else "out of memory"


def table(results: list[dict]) -> str:
    """The results as a markdown table (init split: model = meta build + LoRA + FSDP2 + materialise, rest = process
    group, synthetic data, ``.to(device)``, optimizer; host GiB: peak through init / steady after the timed steps /
    peak overall)."""
    rows = ["| clip | mode | card cap GiB | resident blocks | inputs recomputed | s/step | GPU peak GiB (predicted) "
            "| host GiB init peak / steady / peak | pinned asked GB | locked GB | H2D GB/step (model / counted) | PCIe floor s (GB/s) "
            "| init s (model + materialise / rest) | optimizer | MFU |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cap(r):
        return "none" if r.get("cap_gib") is None else f"{r['cap_gib']:g}"

    for r in results:
        if not r.get("ok"):
            why = oom_summary(r.get("error", "")) or r.get("error", "")[:80]
            rows.append(f"| {r['clip']} | {r['mode']} | {cap(r)} | | {r.get('recompute_block_inputs', '')} | failed: "
                        f"{why} | | | | | | | | | |")
            continue
        h2d = "" if "h2d_bytes_per_step" not in r else f"{r['h2d_bytes_per_step'] / 1e9:.1f}"
        if r.get("h2d_bytes_counted_per_step") is not None:
            h2d += f" / {r['h2d_bytes_counted_per_step'] / 1e9:.1f}"
        floor = ("" if r.get("pcie_floor_s") is None else f"{r['pcie_floor_s']:.2f} ({r['h2d_gb_s']:.1f})")
        mode = r["mode"] + {"prefetch": " (H2D prefetch)", "sync": ""}.get(r.get("h2d"), "")
        if (r["mode"] == "offload" and r.get("h2d") == "prefetch"  # partial keeps its adapters on the card
                and r.get("adapters_prefetched") in (0, False)):  # False: rows of 2026-12-04
            mode += " (adapters late)"
        if r.get("lockstep", 1) > 1:
            mode += f" (lockstep {r['lockstep']})"
        if r.get("adapter_step"):
            mode += " (adapter step)"
        pinned = r.get("pinned_adapter_gradients")  # how many; rows before it was counted carry only the flag
        if pinned or (pinned is None and r.get("pin_adapter_gradients")):
            mode += " (pinned gradients)"
        blocks = "none" if r["mode"] == "offload" else r["resident_blocks"]
        predicted = "" if r.get("predicted_peak_gib") is None else f" ({r['predicted_peak_gib']:.1f})"
        rows.append(f"| {r['clip']} | {mode} | {cap(r)} | {blocks} | {r.get('recompute_block_inputs', 0)} | "
                    f"{r['s_per_step']:.2f} | {r['gpu_peak_gib']:.1f}{predicted} | {r['host_peak_init_gib']:.1f} / {r['host_steady_gib']:.1f} / "
                    f"{r['host_peak_gib']:.1f} | {r['pinned_requested_bytes'] / 1e9:.2f} | "
                    f"{r['pinned_locked_bytes'] / 1e9:.2f} | {h2d} | {floor} | {r['init_s']:.0f} ({r['init_meta_shard_s']:.0f} + "
                    f"{r['init_materialise_s']:.0f} / {r['init_rest_s']:.0f}) | {r['optimizer_device']} | "
                    f"{_mfu_cell(r)} |")
    return "\n".join(rows) + "\n"


def _mfu_cell(r: dict) -> str:
    """A row's MFU in percent: its own ``mfu``; for a GPU row written before rows carried it, computed from its
    ``tokens`` on the full preset (``model_flop_per_micro_batch``, 2 micro-batches per step as every such row ran);
    empty on the CPU."""
    value = r.get("mfu")
    if value is None and "mfu" not in r and r.get("h2d_gb_s") and r.get("tokens"):
        from miles_ext.recipe.presets import get_preset

        value = mfu(model_flop_per_micro_batch(get_preset("full"), int(r["tokens"])) * 2, r.get("s_per_step"))
    return "" if value is None else f"{100 * value:.1f} %"


COMMAND_LIMIT_S = 600
"""One GPU command's wall limit (the device tool's per-command limit)."""
CHILD_TIMEOUT_S = 540
"""``--timeout-s`` of a printed command: the configuration is killed (a failed row, the json still written) before
the command reaches :data:`COMMAND_LIMIT_S` (60 s left for the parent's start and the write)."""
RUNS_DIR = "outputs/h3_1gpu_runs"
"""Default parent folder of the printed commands' ``--out`` (one sub-folder per configuration; ``--merge`` it)."""


def gpu_commands(modes: list[str], clips: list[str], probe: bool, a: argparse.Namespace, out: str) -> list[str]:
    """One shell command per (clip, mode) configuration, each within :data:`COMMAND_LIMIT_S`; with ``probe``, first
    the resident probes of the 480x832 clips (:data:`PROBE_FRAMES`, in order: stop at the first failure); last the
    ``--merge`` of every result into ``out``'s table."""
    opts = f"--steps {a.steps} --micro-batches {a.micro_batches} --lora-rank {a.lora_rank}"
    if a.cap_gib:
        opts += f" --cap-gib {a.cap_gib:g}"
    recompute = str(a.recompute_inputs).strip().lower()
    if recompute not in ("0", "none", ""):
        opts += f" --recompute-inputs {recompute}"
    if a.lockstep > 1:
        opts += f" --lockstep {a.lockstep}"
    if a.adapter_step:
        opts += " --adapter-step"
    if a.pin_adapter_gradients:
        opts += " --pin-adapter-gradients"
    sync = " --sync-h2d" if a.sync_h2d else ""
    pre = (" --prefetch-h2d" + (" --late-adapters" if a.late_adapters else "")) if a.prefetch_h2d else ""
    configs = [(m, c) for c in clips for m in modes]
    if probe:
        configs = [("resident", f"{f}x480x832") for f in PROBE_FRAMES] + configs
    cmds = ["# --probe-largest: the first 4 commands probe resident 480x832 clips; stop probing after the first that "
            "fails"] if probe else []
    for m, c in configs:
        extra, tag = "", f"{c}_{m}" + (f"_recompute{recompute}" if recompute not in ("0", "none", "") else "") + (
            f"_lockstep{a.lockstep}" if a.lockstep > 1 else "")
        if m == "partial":
            extra = f" --resident-blocks {a.resident_blocks}" + (f" --gpu-budget-gib {a.gpu_budget_gib:g}"
                                                                 if a.gpu_budget_gib else "") + sync
            tag += "_sync" if sync else ""
        if m == "offload" and pre:
            extra, tag = pre, tag + ("_prefetch_late" if a.late_adapters else "_prefetch")
        if m == "offload":
            tag += ("_adapterstep" if a.adapter_step else "") + ("_pinnedgrads" if a.pin_adapter_gradients else "")
        cmds.append(f"ulimit -l unlimited; python benchmarks/h3_1gpu.py --modes {m} --clips {c} {opts}{extra} "
                    f"--timeout-s {CHILD_TIMEOUT_S} --out {shlex.quote(f'{out}/{tag}')}")
    if not a.cap_gib and "offload" in modes and a.lockstep == 1:  # the 24 GB card: full offload at the recipe's clip under its cap,
        given = f"_recompute{recompute}" if recompute not in ("0", "none", "") else ""
        ptag = ("_prefetch_late" if a.late_adapters else "_prefetch") if pre else ""
        ptag += ("_adapterstep" if a.adapter_step else "") + ("_pinnedgrads" if a.pin_adapter_gradients else "")
        for r, tag in (("", given), (" --recompute-inputs auto", "_recomputeauto")):  # plain, then with the lever
            if r and given:
                continue  # --recompute-inputs already in opts
            cmds.append(f"ulimit -l unlimited; python benchmarks/h3_1gpu.py --modes offload --clips {RECIPE_CLIP} "
                        f"{opts}{r} --cap-gib {CARD_24GB_GIB:g}{pre} --timeout-s {CHILD_TIMEOUT_S} "
                        f"--out {shlex.quote(f'{out}/{RECIPE_CLIP}_offload_cap{CARD_24GB_GIB:g}{tag}{ptag}')}")
    cmds.append(f"python benchmarks/h3_1gpu.py --merge {shlex.quote(str(out))}")
    return cmds


_ROW_NUMBERS = ("s_per_step", "gpu_peak_gib", "host_peak_init_gib", "host_steady_gib", "host_peak_gib",
                "pinned_requested_bytes", "pinned_locked_bytes", "init_s", "init_meta_shard_s",
                "init_materialise_s", "init_rest_s")


def _check_row(r: dict) -> None:
    """One result row as :func:`run_one` writes it (``ValueError`` / ``KeyError`` / ``TypeError`` otherwise): a
    known mode and ``h2d``, an ``FxHxW`` clip, and for an ``ok`` row every number the table prints, finite."""
    parse_clip(str(r["clip"]))
    if r["mode"] not in MODES:
        raise ValueError(f"mode {r['mode']!r} is none of {', '.join(MODES)}")
    if r.get("h2d", "sync") not in ("sync", "prefetch"):
        raise ValueError(f"h2d {r.get('h2d')!r} is neither sync nor prefetch")
    if r.get("ok"):
        for k in _ROW_NUMBERS:
            v = r[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{k} = {v!r} is not a finite number")
        r["resident_blocks"], r["optimizer_device"]  # noqa: B018 (KeyError when missing)
    for k in ("cap_gib", "h2d_gb_s", "pcie_floor_s", "h2d_bytes_per_step"):  # absent from rows before 2026-12-03
        v = r.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf
                              or (k in ("cap_gib", "h2d_gb_s") and v == 0)):
            raise ValueError(f"{k} = {v!r} is not a finite {'positive' if k in ('cap_gib', 'h2d_gb_s') else 'non-negative'} number")


def merge(folder: Path) -> list[dict]:
    """Every ``<folder>/*/h3_1gpu.json`` (the printed commands' results), clip by clip in :data:`MODES` order, written
    to ``<folder>/h3_1gpu.json`` and ``<folder>/h3_1gpu.md`` (together, atomically: both or neither).

    Raises:
        UserError: no ``*/h3_1gpu.json`` under ``folder``, or one that is not a list of result rows (each with a
            ``mode`` and a ``FxHxW`` ``clip``); nothing is written then.
    """
    results = []
    for f in sorted(folder.glob("*/h3_1gpu.json")):
        try:
            rows = json.loads(f.read_text())
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise ValueError("not a list of result rows")
            for r in rows:
                _check_row(r)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"--merge {folder}: {f} is not a results file of this benchmark ({e}); "
                            "remove it or run its command again") from None
        results += rows
    if not results:
        raise UserError(f"--merge {folder}: no result rows in */h3_1gpu.json under it (a missing folder, no "
                        "files, or empty lists): run the printed commands first")
    free_targets("--merge", folder, ("h3_1gpu.json", "h3_1gpu.md"))
    results.sort(key=lambda r: (parse_clip(r["clip"]), MODES.index(r["mode"]) if r["mode"] in MODES else 9))
    write_together({folder / "h3_1gpu.json": json.dumps(results, indent=2), folder / "h3_1gpu.md": table(results)})
    return results


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); bad input: one ``error:`` line, exit 2, nothing written."""
    return cli(lambda: _main(argv))


def _parser() -> ArgumentParser:
    """The command line's options (module docstring)."""
    ap = ArgumentParser(prog="python benchmarks/h3_1gpu.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of resident, offload, partial")
    ap.add_argument("--clips", default=DEFAULT_CLIPS, help="comma list of FRAMESxHEIGHTxWIDTH")
    ap.add_argument("--probe-largest", action="store_true", help="add the largest 480x832 clip the resident run holds")
    ap.add_argument("--resident-blocks", default="auto", help="partial mode: auto or a number of blocks")
    ap.add_argument("--gpu-budget-gib", type=float, default=None, help="partial auto: GPU budget (default: the card)")
    ap.add_argument("--cap-gib", type=float, default=None,
                    help=f"cap the card at this many GiB for every configuration (ONECARD_GPU_MEMORY_GIB; e.g. "
                         f"{CARD_24GB_GIB:g} for a 24 GB card); each row records its cap")
    ap.add_argument("--recompute-inputs", default="0",
                    help="block inputs recomputed instead of kept (miles_ext.levers.input_recompute): a number, or auto "
                         "(offload only: the fewest that fit the card, or --cap-gib, less 1 GiB)")
    ap.add_argument("--lockstep", type=int, default=1,
                    help="micro-batches forwarded block by block together, each streamed block copied once per group "
                         "(miles_ext.levers.lockstep); 1: one micro-batch at a time")
    ap.add_argument("--adapter-step", action="store_true",
                    help="offload: the offloaded adapters' AdamW step on the GPU, streamed "
                         "(miles_ext.levers.adapter_step)")
    ap.add_argument("--pin-adapter-gradients", action="store_true",
                    help="offload: the offloaded adapters' gradients copied to pinned host memory without a wait "
                         "(miles_ext.levers.adapter_step.pin_adapter_gradients)")
    ap.add_argument("--steps", type=int, default=1, help="timed optimizer steps after one warm-up step")
    ap.add_argument("--micro-batches", type=int, default=2, help="accumulated micro-batches per optimizer step")
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per configuration")
    ap.add_argument("--out", type=folder_arg, default=None, help="results folder (default benchmarks/results; with --smoke "
                    f"outputs/h3_1gpu_smoke; with --print-commands the parent of one folder per command, default "
                    f"{RUNS_DIR})")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny preset, one tiny clip, every mode")
    ap.add_argument("--prefetch-h2d", action="store_true",
                    help="offload: the side-stream prefetch under full offload too (off there by default: measured "
                         "slower on the H200)")
    ap.add_argument("--late-adapters", action="store_true",
                    help="offload with --prefetch-h2d: gather each block's offloaded adapters when the block starts "
                         "(the order before 2026-12-04, its copy behind the next block's on the side stream) instead "
                         "of prefetching them with the block: the same-run baseline of that change")
    ap.add_argument("--sync-h2d", action="store_true",
                    help="partial: FSDP2's own host-to-device copy on the compute stream (no side-stream "
                         "prefetch, miles_ext.levers.h2d_prefetch): the stock-torch baseline of the same mode")
    ap.add_argument("--print-commands", action="store_true",
                    help=f"print one GPU command per (clip, mode), each under {COMMAND_LIMIT_S} s, and the --merge")
    ap.add_argument("--merge", metavar="DIR", help="combine DIR/*/h3_1gpu.json into DIR/h3_1gpu.json + .md")
    ap.add_argument("--one", nargs=2, metavar=("MODE", "CLIP"), help=argparse.SUPPRESS)
    return ap


def _check_args(a: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The run's (modes, clips) after every check of the arguments, before any run and before anything under
    ``--out`` is touched. Raises :class:`UserError` (one line) for the first bad one."""
    modes = pick("--modes", a.modes, MODES)
    given = [c.strip() for c in a.clips.split(",") if c.strip()]
    if not given:
        raise UserError(f"--clips {a.clips!r} selects nothing; name at least one FRAMESxHEIGHTxWIDTH, e.g. 81x480x832")
    for c in given:
        try:
            parse_clip(c)
        except ValueError as e:
            raise UserError(f"--clips: {e}") from None
    clips = ["9x16x16"] if a.smoke else list(dict.fromkeys(given))
    at_least("--steps", a.steps, 1, "timed optimizer steps after the warm-up step")
    at_least("--micro-batches", a.micro_batches, 1, "micro-batches per optimizer step")
    at_least("--lora-rank", a.lora_rank, 1, "the LoRA rank")
    at_least("--lockstep", a.lockstep, 1, "micro-batches per lockstep group (1: off)")
    positive("--timeout-s", a.timeout_s, "seconds per configuration")
    positive("--gpu-budget-gib", a.gpu_budget_gib, "GiB")
    positive("--cap-gib", a.cap_gib, "GiB")
    if a.cap_gib is None:  # an inherited ONECARD_GPU_MEMORY_GIB caps every configuration: refuse a bad one now
        from patches.core.device import gpu_memory_cap_gib

        gpu_memory_cap_gib()
    if a.sync_h2d and a.prefetch_h2d:
        raise UserError("--sync-h2d and --prefetch-h2d ask for opposite things: keep one")
    if a.prefetch_h2d and "offload" not in modes:
        raise UserError("--prefetch-h2d turns the side-stream prefetch on under full offload (partial residency has "
                        "it by default): add offload to --modes, or drop --prefetch-h2d")
    if a.late_adapters and not a.prefetch_h2d:
        raise UserError("--late-adapters changes when the side-stream prefetch gathers the offloaded adapters: add "
                        "--prefetch-h2d (and --modes offload), or drop --late-adapters")
    for flag, on in (("--adapter-step", a.adapter_step), ("--pin-adapter-gradients", a.pin_adapter_gradients)):
        if on and modes != ["offload"]:
            raise UserError(f"{flag} acts on the adapters full offload keeps on the host (the other modes keep them "
                            f"on the card): use --modes offload with it, or drop {flag}")
    if a.sync_h2d and "partial" not in modes:
        raise UserError("--sync-h2d turns off the side-stream prefetch of partial residency, the only mode that uses "
                        "it: add partial to --modes, or drop --sync-h2d")
    from miles_ext.levers.input_recompute import parse_setting

    recompute = parse_setting(a.recompute_inputs, "--recompute-inputs")
    if recompute == "auto" and modes != ["offload"]:
        raise UserError("--recompute-inputs auto plans full offload's GPU peak: use --modes offload with it, or give a "
                        "number")
    if a.lockstep > 1 and recompute != 0:
        raise UserError("--lockstep and --recompute-inputs do not combine (the recompute recipes follow one forward at "
                        "a time): drop one of them")
    blocks = 2 if a.smoke else 50  # the transformer blocks of the preset that runs (tiny under --smoke, else full)
    if isinstance(recompute, int) and recompute > blocks // 2:
        raise UserError(f"--recompute-inputs {recompute}: at most every second of the {'tiny' if a.smoke else 'full'} "
                        f"preset's {blocks} transformer blocks ({blocks // 2})")
    from patches.core.flags import MAX_GPU_GIB, parse_resident_blocks

    for flag, v in (("--cap-gib", a.cap_gib), ("--gpu-budget-gib", a.gpu_budget_gib)):
        if v is not None and v > MAX_GPU_GIB:
            raise UserError(f"{flag} {v:g}: at most {MAX_GPU_GIB:g} GiB (ONECARD_GPU_MEMORY_GIB's limit)")
    if a.gpu_budget_gib is not None and "partial" not in modes:
        raise UserError(f"--gpu-budget-gib {a.gpu_budget_gib:g} is the budget partial residency's auto fills: add partial "
                        "to --modes, or cap the card with --cap-gib instead")
    try:
        resident = parse_resident_blocks(a.resident_blocks, "--resident-blocks")
    except UserError:
        resident = None
    if resident is None:
        shown = a.resident_blocks if len(a.resident_blocks) <= 40 else a.resident_blocks[:40] + "..."
        raise UserError(f"--resident-blocks {shown!r}: use auto or a whole number of blocks (0 = stream all)")
    return modes, clips


def _main(argv: list[str] | None) -> int:
    a = _parser().parse_args(argv)
    if a.one:
        print("RESULT " + json.dumps(run_one(a.one[0], a.one[1], a)), flush=True)
        return 0
    if a.merge is not None:
        if not a.merge.strip():
            raise UserError("--merge needs the folder of the printed commands' results, e.g. "
                            f"--merge {RUNS_DIR}; it was given an empty name")
        results = merge(Path(a.merge))
        print(table(results))
        return 0
    modes, clips = _check_args(a)  # every check before any run (and before anything under --out)
    if a.print_commands:
        if a.smoke:
            raise UserError("--print-commands lists the GPU runs; --smoke runs on the CPU: drop one of them")
        print("\n".join(gpu_commands(modes, clips, a.probe_largest, a, a.out or RUNS_DIR)))
        return 0
    # a smoke run's results are not results: they go under the ignored outputs/, not next to the committed ones
    out = writable_dir("--out", a.out if a.out is not None else (
        HERE.parent / "outputs" / "h3_1gpu_smoke" if a.smoke else HERE / "results"))  # "" refused, not the default
    free_targets("--out", out, ("h3_1gpu.json", "h3_1gpu.md"))
    if not a.smoke:
        import torch

        if not torch.cuda.is_available():
            raise UserError("the 33 B model needs a CUDA GPU; pass --smoke for the CPU smoke with the tiny preset")
        at_most_card("--cap-gib", a.cap_gib)
    passthrough = [f"--resident-blocks={a.resident_blocks}", f"--recompute-inputs={a.recompute_inputs}", f"--steps={a.steps}",
                   f"--micro-batches={a.micro_batches}", f"--lora-rank={a.lora_rank}", f"--lockstep={a.lockstep}"]
    if a.gpu_budget_gib:
        passthrough.append(f"--gpu-budget-gib={a.gpu_budget_gib}")
    if a.sync_h2d:
        passthrough.append("--sync-h2d")
    if a.prefetch_h2d:
        passthrough.append("--prefetch-h2d")
    if a.late_adapters:
        passthrough.append("--late-adapters")
    if a.adapter_step:
        passthrough.append("--adapter-step")
    if a.pin_adapter_gradients:
        passthrough.append("--pin-adapter-gradients")
    if a.smoke:  # the tiny model fits any budget: stream 3 of its 4 blocks so that partial residency streams
        passthrough = [x for x in passthrough if not x.startswith("--resident-blocks")]
        passthrough += ["--smoke", "--resident-blocks=1"]
    if a.probe_largest and not a.smoke:
        largest = None
        for f in PROBE_FRAMES:
            r = child("resident", f"{f}x480x832", passthrough, a.timeout_s, a.cap_gib)
            print(f"probe {f}x480x832 resident: {'ok' if r.get('ok') else 'failed'}", flush=True)
            if not r.get("ok"):
                break
            largest = f"{f}x480x832"
        if largest:
            clips.append(largest)
    results = []
    for c in clips:
        for m in modes:
            r = child(m, c, passthrough, a.timeout_s, a.cap_gib)
            print(json.dumps(r), flush=True)
            results.append(r)
    write_together({out / "h3_1gpu.json": json.dumps(results, indent=2), out / "h3_1gpu.md": table(results)})
    print(table(results))
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
