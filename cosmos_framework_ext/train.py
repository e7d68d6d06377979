"""The embedded reference trainer for the Cosmos3-Edge vision SFT recipe.

``python -m cosmos_framework_ext.train --sft-toml toml/vision_sft_edge_24gb.toml`` (or through
``launchers/sft_edge_24gb.sh``, which runs it under ``torchrun`` when no ``COSMOS_FRAMEWORK_ROOT`` is set).

It reproduces upstream cosmos-framework's training step (``shared/upstream/cosmos_framework.md`` §1-§6) on
diffusers' ``Cosmos3OmniTransformer`` and the Wan2.2 ``AutoencoderKLWan``: packed micro-batches with the
strict fit rule, ``loss / grad_accum_iter``, AdamW (betas 0.9/0.95, eps 1e-6), warm-up + cosine, grad clip
0.1 with ``force_finite``, power EMA updated after the optimizer step, bf16 compute with activation
checkpointing. Random init unless ``[checkpoint].load_path`` names a diffusers-format checkpoint.

Environment: ``DATASET_PATH``, ``BASE_CHECKPOINT_PATH``, ``WAN_VAE_PATH``, ``OUTPUT_ROOT`` (as upstream's
launchers), ``COSMOS_EMA_CPU_SUBSET`` and ``COSMOS_VAE_CPU_OFFLOAD`` (the levers), ``ONECARD_DATA_CACHE``
(where the sample dataset is prepared when no ``DATASET_PATH`` is given).

Exit status: 0 on success, 2 on bad input (one ``error:`` line naming the problem and the fix).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from patches.core import flags as flagmod
from patches.core.host_arena import pinned_bytes_total
from patches.core.sampler import MemorySampler

from . import attention, config as cfgmod, data as datamod, packing
from .ledger import cosmos_ledger, summary_line
from .ema import CpuSubsetEMA, StockEMA, canonical_name, power_ema_beta, power_ema_gamma
from .presets import build_transformer, build_vae, get_preset, select_trainable
from .recipe import clip_grad_norm, flow_matching_inputs, micro_batch_loss, warmup_cosine
from .vae_offload import VAEOffload, encode_latents

log = logging.getLogger("onecard.train")
GiB = float(2**30)


class UserError(ValueError):
    """Bad input the user can fix (a missing path, a conflicting setting)."""


# ----------------------------------------------------------------------------------------------- utils
def _rank_world() -> tuple[int, int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def _host_rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _atomic_write_bytes(path: Path, write) -> None:
    """Write through ``write(tmp_path)`` then rename over ``path``: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _atomic_write_json(path: Path, obj: Any) -> None:
    _atomic_write_bytes(path, lambda p: p.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n"))


def _sample_noise(seed: int, iteration: int, micro: int, shapes: list[torch.Size]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Deterministic (seed, iteration, micro-batch) draw: logit-normal sigmas [n] and Gaussian noise."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + iteration) * 1_009 + micro)
    sigmas = torch.sigmoid(torch.randn(len(shapes), generator=g))
    noise = [torch.randn(s, generator=g) for s in shapes]
    return sigmas, noise


# ----------------------------------------------------------------------------------------- checkpoints
def _checkpoint_dir(out_dir: Path) -> Path:
    return out_dir / "checkpoints"


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete checkpoint in ``out_dir`` (named in ``latest_checkpoint.txt``), or None."""
    marker = _checkpoint_dir(out_dir) / "latest_checkpoint.txt"
    if not marker.is_file():
        return None
    path = _checkpoint_dir(out_dir) / marker.read_text().strip()
    return path if path.is_file() else None


def save_checkpoint(out_dir: Path, iteration: int, state: dict[str, Any]) -> Path:
    """Write ``iter_<9 digits>.pt`` atomically (temp name + rename), then point ``latest_checkpoint.txt`` at it."""
    path = _checkpoint_dir(out_dir) / f"iter_{iteration:09d}.pt"
    _atomic_write_bytes(path, lambda p: torch.save(state, p))
    _atomic_write_bytes(_checkpoint_dir(out_dir) / "latest_checkpoint.txt", lambda p: p.write_text(path.name + "\n"))
    return path


# ---------------------------------------------------------------------------------------------- setup
def _resolve_device(local_rank: int) -> torch.device:
    """The rank's GPU, or the CPU; ``ONECARD_GPU_MEMORY_GIB`` caps the GPU (simulates a smaller card).

    Raises:
        UserError: ``ONECARD_GPU_MEMORY_GIB`` is not a positive number or exceeds the card.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    raw = os.environ.get("ONECARD_GPU_MEMORY_GIB", "")
    if raw:
        total = torch.cuda.get_device_properties(device).total_memory
        try:
            gib = float(raw)
        except ValueError:
            gib = -1.0
        if not 0 < gib * GiB <= total:
            raise UserError(
                f"ONECARD_GPU_MEMORY_GIB={raw!r} must be a number of GiB in (0, {total / GiB:.2f}] for this card"
            )
        torch.cuda.set_per_process_memory_fraction(gib * GiB / total, device)
    return device


def prefetched(batches, workers: int = 2, depth: int = 2):
    """Yield ``batches`` in order while decoding the next ``depth`` micro-batches' videos on threads.

    PyAV releases the GIL while decoding, so the decode of the next micro-batch overlaps this one's
    forward and backward. Decode errors surface when the batch is reached.
    """
    import collections
    import concurrent.futures

    def load(batch):
        for s in batch:
            s.load_video()
        return batch

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="onecard-decode") as pool:
        queue: collections.deque = collections.deque()
        it = iter(batches)
        while True:
            while len(queue) < depth:
                try:
                    queue.append(pool.submit(load, next(it)))
                except StopIteration:
                    break
            if not queue:
                return
            yield queue.popleft().result()


def _load_base(model: torch.nn.Module, load_path: str, skip: list[str], dtype: torch.dtype) -> str:
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
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise UserError(f"{path} does not match the preset's architecture: unexpected keys {unexpected[:3]}...")
    return f"loaded {len(state)} tensors from {path} ({len(missing)} left at random init)"


def _load_vae_weights(vae: torch.nn.Module, vae_path: str) -> str:
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
    except Exception as e:  # noqa: BLE001
        raise UserError(f"cannot load {path} as a diffusers AutoencoderKLWan: {e}") from None
    vae.load_state_dict(loaded.state_dict())
    return f"VAE weights from {path}"


# ------------------------------------------------------------------------------------------------ run
def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train as ``args`` and the environment say; returns the summary (also written as ``summary.json``).

    Background helpers (memory sampler, EMA worker) are stopped whether the run ends or raises.
    """
    with contextlib.ExitStack() as stack:
        return _run(args, stack)


def _run(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, Any]:
    cfg = cfgmod.load(args.sft_toml)
    env_flags = flagmod.read_all()
    ema_lever = env_flags[flagmod.EMA_CPU_SUBSET.name]
    vae_lever = env_flags[flagmod.VAE_CPU_OFFLOAD.name]
    rank, world, local_rank = _rank_world()
    device = _resolve_device(local_rank)
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    main_rank = rank == 0

    preset_name = cfg.get("onecard", "preset")
    if preset_name == "auto":
        preset_name = "edge" if device.type == "cuda" else "tiny"
    try:
        preset = get_preset(preset_name)
        # Validate everything the user controls before anything is built or written.
        names = [n for n, _ in build_transformer(preset, device="meta").named_parameters()]
        trainable = select_trainable(names, cfg.get("optimizer", "keys_to_select"))
        if cfg.get("model.ema", "enabled"):
            power_ema_gamma(cfg.get("model.ema", "rate"))
    except ValueError as e:
        raise UserError(f"{cfg.source}: {e}") from None
    for var, value in (("DATASET_PATH", os.environ.get("DATASET_PATH", "")),
                       ("BASE_CHECKPOINT_PATH", cfg.get("checkpoint", "load_path")),
                       ("WAN_VAE_PATH", cfg.get("model.tokenizer", "vae_path"))):
        if value and not Path(value).exists():
            raise UserError(f"{var}={value} does not exist: point it at an existing path, or unset it "
                            f"({'the sample dataset is used' if var == 'DATASET_PATH' else 'random init is used'})")
    max_iter = cfg.get("trainer", "max_iter")
    ga = cfg.get("trainer", "grad_accum_iter")
    cap = cfg.get("dataloader_train", "max_sequence_length")
    smoke = ""
    if device.type == "cpu" and preset.name == "tiny":
        oc = cfg["onecard"]
        max_iter = oc["cpu_max_iter"] or max_iter
        ga = oc["cpu_grad_accum_iter"] or ga
        cap = oc["cpu_max_sequence_length"] or cap
        smoke = f" (CPU smoke: [onecard] cpu_* values replace the recipe's, cap {cap}, grad_accum_iter {ga})"
    max_iter = args.max_iter or max_iter
    if main_rank:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no GPU found)"
        print(
            f"onecard: preset {preset.name} on {where}, {world} rank(s), max_iter {max_iter}{smoke}; "
            f"{flagmod.EMA_CPU_SUBSET.name}={int(ema_lever)} {flagmod.VAE_CPU_OFFLOAD.name}={int(vae_lever)}",
            flush=True,
        )
    ledger = cosmos_ledger(cfg, preset.name, env_flags, world_size=world, device_type=device.type, cap=cap)
    if main_rank:
        budget = None
        if device.type == "cuda":
            budget = (int(float(os.environ.get("ONECARD_GPU_MEMORY_GIB") or 0) * GiB)
                      or torch.cuda.get_device_properties(device).total_memory)
        print(ledger.format(budget), flush=True)
    if args.validate_only:
        return {"validated": True}

    seed = cfg.get("onecard", "seed")
    out_root = Path(os.environ.get("OUTPUT_ROOT") or "outputs/train")
    job = cfg["job"]
    out_dir = out_root / job["project"] / job["group"] / job["name"]

    # ---- data
    dataset_path = os.environ.get("DATASET_PATH", "")
    if dataset_path:
        ds_root = Path(dataset_path)
    else:
        ds_root = datamod.default_sample_dataset_root(preset)
        if main_rank:
            datamod.prepare_sample_dataset(ds_root, preset)
        if world > 1:
            torch.distributed.barrier()
    records = datamod.load_records(ds_root)
    tokenizer = datamod.CaptionTokenizer()
    source = datamod.SampleSource(
        records, tokenizer, preset,
        max_caption_tokens=cfg.get("dataloader_train", "max_caption_tokens"),
        seed=seed, cfg_dropout=cfg.get("onecard", "cfg_dropout"),
    )
    loader = packing.PackingLoader(source, cap=cap, rank=rank, world_size=world, seed=seed)

    # ---- model
    dtype = torch.bfloat16 if (device.type == "cuda" and cfg.get("model", "precision") == "bfloat16") else torch.float32
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = build_transformer(preset, device=device)
    finally:
        torch.set_default_dtype(prev)
    init_note = "random init (no BASE_CHECKPOINT_PATH): weights are NOT a trained Cosmos3-Edge"
    load_path = cfg.get("checkpoint", "load_path")
    tset = set(trainable)
    for n, p in model.named_parameters():
        p.requires_grad_(n in tset)
    n_total = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for n, p in model.named_parameters() if n in tset)
    if cfg.get("model.activation_checkpointing", "mode") == "full":
        model.enable_gradient_checkpointing()
    proc = attention.install(model)
    model.train()

    if world > 1:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        kw = {} if device.type == "cuda" else {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
        for layer in model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)

    # ---- VAE
    vae_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vae = build_vae(preset, dtype=vae_dtype)
    vae_note = "random-init VAE (no WAN_VAE_PATH)"
    vae_path = cfg.get("model.tokenizer", "vae_path")
    if vae_path:
        vae_note = _load_vae_weights(vae, vae_path)
    offload = None
    if vae_lever:
        offload = VAEOffload(vae, device)
    else:
        vae.to(device)

    # ---- optimizer, schedule, EMA
    params = [p for n, p in model.named_parameters() if n in tset]
    opt = torch.optim.AdamW(
        params, lr=cfg.get("optimizer", "lr"), betas=tuple(cfg.get("optimizer", "betas")),
        eps=cfg.get("optimizer", "eps"), weight_decay=cfg.get("optimizer", "weight_decay"),
        fused=bool(cfg.get("optimizer", "fused") and device.type == "cuda"),
    )
    sc = cfg["scheduler"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, sc["warm_up_steps"][0], sc["cycle_lengths"][0], sc["f_start"][0],
                                     sc["f_max"][0], sc["f_min"][0]),
    )
    ema_cfg = cfg["model.ema"]
    ema: CpuSubsetEMA | StockEMA | None = None
    gamma = 0.0
    if ema_cfg["enabled"]:
        gamma = power_ema_gamma(ema_cfg["rate"])
        if ema_lever:
            ema = CpuSubsetEMA(model, trainable)
            ema.attach_optimizer(opt)
            stack.callback(ema.close)
        else:
            ema = StockEMA(model)
    elif ema_lever and main_rank:
        print("onecard: COSMOS_EMA_CPU_SUBSET=1 has no effect: [model.ema].enabled = false in this TOML")

    # ---- resume (same job) or warm start
    start_iter, consumed = 0, 0
    ckpt = latest_checkpoint(out_dir)
    if ckpt is not None:
        blob = torch.load(ckpt, map_location="cpu", weights_only=False)
        net = {k[4:]: v for k, v in blob["model"].items() if k.startswith("net.")}
        model.load_state_dict(net)
        if ema is not None:
            ema_state = {k[8:]: v for k, v in blob["model"].items() if k.startswith("net_ema.")}
            ema.load_state_dict(ema_state)
            ema.num_updates = blob.get("ema_num_updates", 0)
        opt.load_state_dict(blob["optimizer"])
        sched.load_state_dict(blob["scheduler"])
        start_iter, consumed = blob["iteration"], blob["micro_batches_consumed"]
        init_note = f"resumed from {ckpt} at iteration {start_iter}"
    elif load_path:
        init_note = _load_base(model, load_path, cfg.get("checkpoint", "keys_to_skip_loading"), dtype)
        if isinstance(ema, StockEMA):
            ema = StockEMA(model)
        elif isinstance(ema, CpuSubsetEMA):
            ema.load_state_dict({canonical_name(n): p.detach() for n, p in model.named_parameters()})
    if main_rank:
        print(f"onecard: model {n_total:,} params, trainable {n_train:,} ({len(trainable)} tensors) by "
              f"keys_to_select {cfg.get('optimizer', 'keys_to_select')}; {dtype}; {init_note}")
        print(f"onecard: {vae_note}; VAE {'parked on host (lever)' if offload else 'resident on ' + str(device)}; "
              f"EMA {'off' if ema is None else ('CPU subset (lever)' if ema_lever else 'stock full fp32 clone on ' + str(device))}; "
              f"dataset {ds_root} ({len(records)} rows); cap {cap}, grad_accum_iter {ga}")

    if start_iter >= max_iter:
        if main_rank:
            print(f"onecard: nothing to do: {ckpt} is already at iteration {start_iter} >= max_iter {max_iter}; "
                  "pass --max-iter N (N > that) to train further")
        return json.loads((out_dir / "summary.json").read_text()) if (out_dir / "summary.json").is_file() else {}
    loss_scale = cfg.get("onecard", "loss_scale")
    gc = cfg["trainer.callbacks.grad_clip"]
    it = iter(loader)
    for _ in range(consumed):  # fast-forward to where the checkpoint stopped (decoding is lazy)
        next(it)
    it = prefetched(it, workers=max(1, min(8, (os.cpu_count() or 2) - 1)))

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    mem = MemorySampler(device, interval_s=float(os.environ.get("ONECARD_SAMPLE_S") or 0.5)).start()
    stack.callback(mem.stop)
    peak_rss = _host_rss()
    step_times: list[float] = []
    samples_per_step: list[int] = []
    ema_wait_s: list[float] = []
    micro_times: list[float] = []
    last_loss = float("nan")
    beta = 0.0
    ckpt_path: Path | None = None
    from tqdm import tqdm

    bar = tqdm(total=max_iter, initial=start_iter, disable=not main_rank, dynamic_ncols=True, file=sys.stdout)
    for iteration in range(start_iter, max_iter):
        t0 = time.perf_counter()
        n_samples = 0
        loss_sum = 0.0
        for micro in range(ga):
            tm = time.perf_counter()
            batch = next(it)
            consumed += 1
            n_samples += len(batch)
            with mem.phase("encode"), (offload.on_device() if offload else contextlib.nullcontext()), torch.no_grad():
                x0 = [encode_latents(vae, s.video.unsqueeze(0).to(device, vae_dtype)).float() for s in batch]
            sigmas, noise = _sample_noise(seed, iteration, micro, [x.shape for x in x0])
            xt, targets = [], []
            for x, e, sg in zip(x0, noise, sigmas):
                a, v = flow_matching_inputs(x, e.to(device), float(sg))
                xt.append(a.to(dtype))
                targets.append(v)
            text = [s.text_ids + [tokenizer.eos_id, tokenizer.vision_start_id, tokenizer.vision_end_id] for s in batch]
            kwargs, proc.segments = attention.build_packed_inputs(
                model.config, text, xt, sigmas, [s.record.fps for s in batch], device
            )
            with mem.phase("forward"):
                preds = model(**kwargs).sample
                loss = micro_batch_loss(preds, targets, loss_scale, ga)
            with mem.phase("backward"):
                loss.backward()
            loss_sum += float(loss.detach())
            proc.segments = None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            micro_times.append(time.perf_counter() - tm)
        # EMA on the critical path: for the lever, waiting for the previous host lerp (if the micro-batches
        # did not hide it) plus issuing the copies; for stock, the GPU update itself.
        wait = ema.synchronize() if isinstance(ema, CpuSubsetEMA) else 0.0
        with mem.phase("optimizer"):
            clip_grad_norm(params, gc["clip_norm"], gc["force_finite"])
            opt.step()
            sched.step()
        if ema is not None:
            beta = power_ema_beta(iteration, gamma, ema_cfg["iteration_shift"])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            te = time.perf_counter()
            with mem.phase("ema"):
                ema.step(model, beta)
                if isinstance(ema, StockEMA) and device.type == "cuda":
                    torch.cuda.synchronize(device)
            ema_wait_s.append(wait + time.perf_counter() - te)
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_times.append(time.perf_counter() - t0)
        samples_per_step.append(n_samples)
        last_loss = loss_sum
        peak_rss = max(peak_rss, _host_rss())
        peak_gib = torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else 0.0
        bar.set_postfix(step=iteration + 1, loss=f"{last_loss:.4f}", s_step=f"{step_times[-1]:.2f}",
                        peak_gib=f"{peak_gib:.2f}", ema_beta=f"{beta:.4f}" if ema is not None else "off",
                        refresh=False)
        bar.update(1)
        done = iteration + 1
        if not args.no_save and (done % cfg.get("checkpoint", "save_iter") == 0 or done == max_iter):
            with mem.phase("checkpoint"):
                ckpt_path = _save(out_dir, done, consumed, model, ema, opt, sched, main_rank)
    bar.close()
    if ema is not None:
        ema.synchronize()
    mem.stop()
    timeline = mem.write(out_dir) if main_rank else {}

    summary = {
        "preset": preset.name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": world,
        "steps": max_iter - start_iter,
        "final_iteration": max_iter,
        "grad_accum_iter": ga,
        "cap": cap,
        "samples_per_optimizer_step": samples_per_step,
        "drops": loader.dropped_count,
        "last_loss": last_loss,
        "ema": None if ema is None else {"kind": type(ema).__name__, "last_beta": beta, "gamma": gamma,
                                         "num_updates": ema.num_updates,
                                         "critical_path_s_median": _median(ema_wait_s)},
        "vae_offload": None if offload is None else dict(offload.stats),
        "s_per_step_median": _median(step_times[1:] or step_times),
        "s_per_micro_batch_median": _median(micro_times[ga:] or micro_times),
        "ledger": summary_line(ledger),
        "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else 0.0,
        "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved(device) / GiB if device.type == "cuda" else 0.0,
        "peak_host_rss_gib": peak_rss / GiB,
        "pinned_bytes": pinned_bytes_total(),
        "checkpoint": str(ckpt_path) if ckpt_path else None,
        "flags": env_flags,
        "memory": mem.peaks(),
        "timeline": {k: str(v) for k, v in timeline.items()},
        "init": init_note,
    }
    if main_rank:
        _atomic_write_json(out_dir / "summary.json", summary)
        print(f"onecard: summary {out_dir / 'summary.json'}")
        print(json.dumps({k: summary[k] for k in ("steps", "drops", "peak_gpu_gib", "peak_host_rss_gib",
                                                   "pinned_bytes", "checkpoint")}))
    return summary


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[len(s) // 2]


def _save(out_dir, iteration, consumed, model, ema, opt, sched, main_rank) -> Path | None:
    state = {f"net.{canonical_name(k)}": v.detach().cpu() for k, v in model.state_dict().items()}
    if ema is not None:
        state.update({f"net_ema.{k}": v for k, v in ema.state_dict(model).items()})
    blob = {
        "model": state,
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "iteration": iteration,
        "micro_batches_consumed": consumed,
        "ema_num_updates": 0 if ema is None else ema.num_updates,
    }
    if not main_rank:
        return None
    return save_checkpoint(out_dir, iteration, blob)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m cosmos_framework_ext.train", description=__doc__.split("\n")[0])
    ap.add_argument("--sft-toml", required=True, help="recipe TOML (upstream SFT schema + [onecard])")
    ap.add_argument("--max-iter", type=int, default=0, help="override [trainer].max_iter (0 = keep)")
    ap.add_argument("--no-save", action="store_true", help="write no checkpoint (benchmarks)")
    ap.add_argument("--validate-only", action="store_true",
                    help="check the TOML, flags and paths, print the memory ledger, and exit (0 ok, 2 bad input)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        run(args)
    except (cfgmod.ConfigError, flagmod.FlagError, datamod.DatasetError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
