"""The SFT training step of the miles-diffusion H3 recipe: seeding, noising, per-pair loss, ``loss_sum``.

Upstream (radixark/miles_diffusion's code, loss hook ``prepare_sft_batch`` / ``sft_loss_formula``):

- sigma grid: ``sigmas = linspace(1, 1/N, N)`` shifted ``s*sigma / (1 + (s-1)*sigma)``, ``N = 1000`` for H3;
- a micro-batch seeds one generator with ``stable_hash("sample", seed, rollout_id, microbatch_id, dp_rank)``
  and draws, in this order, ``randint`` over the pool of grid indices (one per pair) and then ``randn`` noise;
- corruption ``x_t = (1-sigma) x0 + sigma eps``; per pair ``mean((pred - target)^2)``; no CFG;
- streams (newest upstream): the visual stream keeps the single-stream seed, other streams add their name to
  the hash; each stream has its own shifted grid; the pair loss is the sum over streams of per-stream MSE;
- the hook returns ``loss_sum`` (sum of per-pair losses); the actor backprops ``loss_sum / num_local_pairs``.

Guessed where the sources stop (none of this changes the 1-GPU == N-GPU proofs, which only need both sides to
run this same code):

- the stream name is appended as the *last* hash part: ``stable_hash("sample", seed, rollout_id,
  microbatch_id, dp_rank, "audio")``; each stream draws its own ``randint`` then ``randn`` from its generator;
- shifts: 12.0 for video and 3.0 for audio (the released H3 scheduler's values, diffusers
  ``MiniMaxH3Scheduler``); the grid is computed in fp32 on the CPU;
- H3's ``process_timestep_as_input`` is ``t = 1 - sigma`` and the prediction is the *data-ward* velocity
  (diffusers' H3 convention), so the loss compares the prediction with ``x0 - eps`` (upstream's ``eps - x0``
  target with H3's sign);
- several pairs of one micro-batch (``micro_batch_size > 1``; the H3 recipe uses 1) draw their noise one pair
  after the other, each ``randn`` of that pair's shape, and run one batch-1 forward each.

The generators live on the device the pairs are on (upstream: ``ctx.device``), so a CUDA run draws with CUDA
generators as upstream does; CPU and CUDA generators give different numbers for the same seed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch
from torch import nn

from miles_ext.levers.finite_step import NonFiniteGuard, guarded_optimizer_step
from miles_ext.recipe.h3_inputs import build_h3_inputs
from miles_ext.recipe.schedule import MicroBatchSlot
from patches.core.runtime import stable_hash

if TYPE_CHECKING:
    from miles_ext.levers.lockstep import Lockstep

__all__ = [
    "H3_FLOW_SHIFTS",
    "SftPair",
    "NoisedPair",
    "shifted_sigma_grid",
    "draw_micro_batch",
    "pair_loss",
    "micro_batch_loss_sum",
    "loss_over_local_pairs",
    "train_step",
]

NUM_TRAIN_TIMESTEPS = 1000
"""Grid size ``N`` for H3 (upstream ``convert_samples_to_train_data``)."""

H3_FLOW_SHIFTS: Mapping[str, float] = {"visual": 12.0, "audio": 3.0}
"""Per-stream ``--fsdp-flow-shift`` (guessed: the released H3 scheduler's video / audio shifts)."""


def shifted_sigma_grid(num_train_timesteps: int = NUM_TRAIN_TIMESTEPS, shift: float = 1.0) -> torch.Tensor:
    """``[N]`` fp32 sigmas: ``linspace(1, 1/N, N)`` then ``s*sigma / (1 + (s-1)*sigma)``, descending in (0, 1]."""
    if num_train_timesteps < 1 or shift <= 0:
        raise ValueError(f"need num_train_timesteps >= 1 and shift > 0, got {num_train_timesteps}, {shift}")
    sigmas = torch.linspace(1.0, 1.0 / num_train_timesteps, num_train_timesteps, dtype=torch.float32)
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


@dataclasses.dataclass(frozen=True)
class SftPair:
    """One clean training pair (already encoded; the recipe caches these)."""

    text: torch.Tensor
    """``[L, text_dim]`` caption embedding."""
    video: torch.Tensor
    """``[C, T, H, W]`` clean video latent ``x0``."""
    audio: torch.Tensor
    """``[2, C_audio, N]`` clean stereo audio latent ``x0``."""

    def to(self, device: torch.device | str) -> "SftPair":
        """This pair with every tensor on ``device``."""
        return SftPair(self.text.to(device), self.video.to(device), self.audio.to(device))


@dataclasses.dataclass(frozen=True)
class NoisedPair:
    """A pair after :func:`draw_micro_batch`: its draws and what the model sees."""

    pair: SftPair
    """The clean pair."""
    sigma_index: dict[str, int]
    """Grid index drawn per stream (``"visual"``, ``"audio"``)."""
    sigma: dict[str, float]
    """Sigma per stream (``grid[index]``)."""
    noise: dict[str, torch.Tensor]
    """``eps`` per stream, the clean latent's shape, fp32."""

    def noisy(self, stream: str) -> torch.Tensor:
        """``x_t = (1 - sigma) x0 + sigma eps`` for ``stream``."""
        x0 = self.pair.video if stream == "visual" else self.pair.audio
        s = self.sigma[stream]
        return (1.0 - s) * x0 + s * self.noise[stream]

    def target(self, stream: str) -> torch.Tensor:
        """The data-ward velocity ``x0 - eps`` H3 predicts for ``stream``."""
        x0 = self.pair.video if stream == "visual" else self.pair.audio
        return x0 - self.noise[stream]


def draw_micro_batch(
    pairs: Sequence[SftPair],
    *,
    seed: int,
    rollout_id: int,
    microbatch_id: int,
    dp_rank: int,
    grids: Mapping[str, torch.Tensor] | None = None,
) -> list[NoisedPair]:
    """The micro-batch's draws, as ``prepare_sft_batch`` makes them, on the pairs' device.

    Per stream: one generator (on ``pairs[0].video.device``) seeded ``stable_hash("sample", seed, rollout_id,
    microbatch_id, dp_rank[, stream])`` (no stream part for ``"visual"``), then ``randint(len(grid),
    (len(pairs),))``, then one ``randn`` per pair. ``grids`` defaults to :func:`shifted_sigma_grid` with :data:`H3_FLOW_SHIFTS`.
    """
    if grids is None:
        grids = {k: shifted_sigma_grid(NUM_TRAIN_TIMESTEPS, s) for k, s in H3_FLOW_SHIFTS.items()}
    device = pairs[0].video.device if pairs else torch.device("cpu")
    per_pair: list[dict[str, tuple[int, float, torch.Tensor]]] = [{} for _ in pairs]
    for stream, grid in grids.items():
        parts: tuple[object, ...] = ("sample", seed, rollout_id, microbatch_id, dp_rank)
        if stream != "visual":
            parts += (stream,)
        gen = torch.Generator(device).manual_seed(stable_hash(*parts))
        idx = torch.randint(len(grid), (len(pairs),), generator=gen, device=device).tolist()
        for k, pair in enumerate(pairs):
            x0 = pair.video if stream == "visual" else pair.audio
            eps = torch.randn(x0.shape, generator=gen, dtype=torch.float32, device=device)
            per_pair[k][stream] = (idx[k], float(grid[idx[k]]), eps)
    return [
        NoisedPair(
            pair,
            {s: v[0] for s, v in d.items()},
            {s: v[1] for s, v in d.items()},
            {s: v[2] for s, v in d.items()},
        )
        for pair, d in zip(pairs, per_pair)
    ]


def pair_loss(model: nn.Module, noised: NoisedPair, patch_size: tuple[int, int, int] = (1, 2, 2)) -> torch.Tensor:
    """One pair's loss: ``MSE(video) + MSE(audio)``, each ``mean((pred - target)^2)`` in fp32 (batch-1 forward)."""
    kwargs, pick = build_h3_inputs(
        noised.pair.text,
        noised.noisy("visual"),
        noised.noisy("audio"),
        1.0 - noised.sigma["visual"],
        audio_timestep=1.0 - noised.sigma["audio"],
        patch_size=patch_size,
    )
    video, audio = pick(model(**kwargs))
    loss = (video.float() - noised.target("visual")).square().mean()
    return loss + (audio.float() - noised.target("audio")).square().mean()


def micro_batch_loss_sum(model: nn.Module, noised: Sequence[NoisedPair], patch_size=(1, 2, 2)) -> torch.Tensor:
    """``loss_sum``: the sum of :func:`pair_loss` over the micro-batch (what upstream's loss hook returns)."""
    return torch.stack([pair_loss(model, p, patch_size) for p in noised]).sum()


def loss_over_local_pairs(loss_sum: torch.Tensor, micro_pairs: int, num_local_pairs: int) -> torch.Tensor:
    """Upstream's normalisation: ``loss_sum / num_local_pairs`` (pairs this rank trains in the optimizer step)."""
    return loss_sum / float(num_local_pairs)


Normaliser = Callable[[torch.Tensor, int, int], torch.Tensor]


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    slots: Sequence[MicroBatchSlot],
    pairs: Sequence[SftPair],
    *,
    seed: int,
    max_grad_norm: float | None = None,
    normaliser: Normaliser = loss_over_local_pairs,
    after_backward: Callable[[], None] | None = None,
    patch_size: tuple[int, int, int] = (1, 2, 2),
    device: torch.device | str | None = None,
    guard: NonFiniteGuard | None = None,
    lockstep: "Lockstep | None" = None,
) -> float:
    """One optimizer step on this rank: the micro-batches ``slots`` (accumulated), clip, step, zero grads.

    Each micro-batch draws with its slot's seed identity, runs its pairs and backprops
    ``normaliser(loss_sum, len(slot.pairs), num_local_pairs)`` with ``num_local_pairs = sum(len(slot.pairs))``;
    under FSDP2 the gradient reduce then averages over ranks. ``after_backward`` runs after the last backward,
    before clipping (to snapshot gradients). Clipping uses :func:`miles_ext.levers.fsdp_policy.clip_offloaded_grad_norm`.
    ``device``: where the pairs are moved before drawing and the forward (default: where they are).
    ``guard``: decides whether the step is taken (:mod:`miles_ext.levers.finite_step`: a non-finite ``loss_sum`` or
    gradient norm on any rank skips it, adapters and optimizer state untouched, logged and counted in ``guard``);
    default: a fresh :class:`~miles_ext.levers.finite_step.NonFiniteGuard` that prints its line.
    ``lockstep``: a :class:`miles_ext.levers.lockstep.Lockstep` on ``model``'s blocks: consecutive micro-batches, in
    groups of its ``group``, are forwarded block by block together and backpropagated in one backward (the same
    losses, normalised the same way; bitwise the same gradients).

    Returns the sum of the micro-batches' ``loss_sum`` (a float, for logging; NaN/inf for a skipped step's bad batch).
    """
    num_local_pairs = sum(len(s.pairs) for s in slots)
    micro_losses: list[float] = []

    def drawn(slot: MicroBatchSlot) -> list[NoisedPair]:
        micro = [pairs[i] if device is None else pairs[i].to(device) for i in slot.pairs]
        return draw_micro_batch(
            micro,
            seed=seed,
            rollout_id=slot.rollout_id,
            microbatch_id=slot.microbatch_id,
            dp_rank=slot.dp_rank,
        )

    size = lockstep.group if lockstep is not None else 1
    for start in range(0, len(slots), size):
        group = slots[start:start + size]
        if len(group) == 1:
            loss_sum = micro_batch_loss_sum(model, drawn(group[0]), patch_size)
            # also when non-finite: ranks stay in step
            normaliser(loss_sum, len(group[0].pairs), num_local_pairs).backward()
            micro_losses.append(float(loss_sum.detach()))
            continue
        noised = [drawn(slot) for slot in group]
        sums = lockstep.run([lambda n=n: micro_batch_loss_sum(model, n, patch_size) for n in noised])
        lockstep.backward([normaliser(ls, len(slot.pairs), num_local_pairs) for ls, slot in zip(sums, group)])
        micro_losses.extend(float(ls.detach()) for ls in sums)
    if after_backward is not None:
        after_backward()
    guarded_optimizer_step(optimizer, micro_losses, max_grad_norm, guard if guard is not None else NonFiniteGuard())
    return sum(micro_losses)
