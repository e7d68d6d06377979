"""A tiny, deterministic run of the real training step (CPU, fp32), shared by the equivalence proofs.

It goes through the trainer's own code: ``build_packed_inputs`` (packed joint sequence, segment masks),
``micro_batch_loss`` (the recipe's normalisation), ``grad_clip`` and AdamW with the recipe's betas/eps.
Inputs are random latents, so no dataset or VAE is needed.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from cosmos_framework_ext.recipe import attention
from cosmos_framework_ext.recipe.attention import build_packed_inputs
from cosmos_framework_ext.recipe.presets import build_transformer, get_preset, select_trainable
from cosmos_framework_ext.recipe.loss import flow_matching_inputs, grad_clip, micro_batch_loss

KEYS = ["moe_gen", "time_embedder", "vae2llm", "llm2vae", "k_norm_und_for_gen"]
GRAD_ACCUM = 2


def make_model(seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The tiny Cosmos3 preset, random init from ``seed`` (on the CPU, then moved), trainable subset selected
    as the recipe does. Returns (model, trainable names)."""
    torch.manual_seed(seed)
    model = build_transformer(get_preset("tiny")).to(device, dtype)
    names = [n for n, _ in model.named_parameters()]
    trainable = select_trainable(names, KEYS)
    for n, p in model.named_parameters():
        p.requires_grad_(n in set(trainable))
    attention.install(model)
    return model, trainable


def plain_model() -> torch.nn.Module:
    """The independent anchor: diffusers' tiny model as it ships (its own ``Cosmos3AttnProcessor``, no packing, no
    lever), seeded as :func:`make_model`, the recipe's trainable subset marked."""
    torch.manual_seed(0)
    plain = build_transformer(get_preset("tiny"))
    names = set(make_model()[1])
    for n, p in plain.named_parameters():
        p.requires_grad_(n in names)
    return plain


def micro_batch(iteration: int, micro: int, n_samples: int = 2):
    """Deterministic packed micro-batch: per sample (text ids, clean latent [1,48,T,H,W], sigma, noise)."""
    g = torch.Generator().manual_seed(1000 * iteration + micro)
    samples = []
    for i in range(n_samples):
        t, h, w = 2 + i, 4, 2 + 2 * i
        ids = torch.randint(0, 1000, (5 + i,), generator=g).tolist()
        x0 = torch.randn(1, 48, t, h, w, generator=g)
        noise = torch.randn(1, 48, t, h, w, generator=g)
        sigma = float(torch.rand((), generator=g))
        samples.append((ids, x0, sigma, noise))
    return samples


def loss_of(model: torch.nn.Module, samples, grad_accum: int = GRAD_ACCUM, loss_fn=micro_batch_loss) -> torch.Tensor:
    """Forward one packed micro-batch and return the loss the trainer would backward.

    The micro-batch's segment masks stay on the processor until the next micro-batch replaces them, as in the
    trainer (which clears them only after ``backward``): under activation checkpointing the backward re-runs
    the forward, and without the masks that re-run would attend across samples.
    """
    ref = model.proj_in.weight  # where and in what dtype the model computes (a lookup table may live on the host)
    xt, targets = [], []
    for _, x0, sigma, noise in samples:
        a, v = flow_matching_inputs(x0.to(ref.device), noise.to(ref.device), sigma)
        xt.append(a.to(ref.dtype))
        targets.append(v)
    sigmas = torch.tensor([s[2] for s in samples])
    kwargs, segs = build_packed_inputs(model.config, [s[0] for s in samples], xt, sigmas, [24.0] * len(samples),
                                       ref.device)
    model.layers[0].self_attn.processor.segments = segs
    preds = model(**kwargs).sample
    return loss_fn(preds, targets, 10.0, grad_accum)


def packed_step(model: torch.nn.Module, samples, impl: str = "dense"):
    """One packed micro-batch forward and backward (loss scale 10, grad_accum 1) with ``impl`` attention
    (flex tiles of 16 tokens on the CPU, 128 on a GPU).

    Returns (the loss, detached; the trainable parameters' gradients, cloned), on the model's device."""
    device = next(model.parameters()).device
    xt, targets = [], []
    for _, x0, sigma, noise in samples:
        a, v = flow_matching_inputs(x0.to(device), noise.to(device), sigma)
        xt.append(a)
        targets.append(v)
    kwargs, segs = build_packed_inputs(model.config, [s[0] for s in samples], xt,
                                       torch.tensor([s[2] for s in samples]), [24.0] * len(samples),
                                       device, impl=impl, block=16 if device.type == "cpu" else 128)
    model.layers[0].self_attn.processor.segments = segs
    model.zero_grad(set_to_none=True)
    loss = micro_batch_loss(model(**kwargs).sample, targets, 10.0, 1)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, betas=(0.9, 0.95),
                             eps=1e-6, weight_decay=0.0)


def train(model, opt, start: int, stop: int, after_step: Callable[[int], None] | None = None) -> None:
    """Optimizer steps ``start .. stop-1`` of the recipe; ``after_step(iteration)`` runs after each step."""
    params = [p for p in model.parameters() if p.requires_grad]
    for iteration in range(start, stop):
        for micro in range(GRAD_ACCUM):
            loss_of(model, micro_batch(iteration, micro)).backward()
        grad_clip(params, 0.1, True)
        opt.step()
        if after_step is not None:
            after_step(iteration)
        opt.zero_grad(set_to_none=True)


# ----------------------------------------------------------------- several ranks on the CPU (h3_ranks.launch)


def make_fsdp_model() -> tuple[torch.nn.Module, list[str]]:
    """:func:`make_model`, then FSDP2 per decoder layer and at the root (CPU offload policy, as CPU FSDP2 needs)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    model, trainable = make_model()
    for layer in model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return model, trainable


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """This process as a one-rank gloo group (an in-memory store, no port), for FSDP2 at world size 1 as
    upstream applies it; a group already present is used and left alone."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
