"""Packed latents by one gather (``[onecard] latent_gather = true``): the transformer's per-sample packing loops,
each replaced by one indexed copy.

``Cosmos3OmniTransformer`` packs a micro-batch's vision latents with three helpers that loop over its samples:
``_patchify_and_pack_latents`` (per sample: pad, reshape, permute ``cthpwq -> thwpqc``, reshape; then a cat),
``_apply_timestep_embeds_to_noisy_tokens`` (per sample: the noisy frames' token indices, built with a handful of
small ops; then one ``scatter_add``) and ``_unpatchify_and_unpack_latents`` (per sample: zeros, slice, reshape,
permute back, crop, an indexed write). At the 24 GB recipe's cap a micro-batch holds about 33 samples, so these
loops issue about 650 small GPU operations in the forward and about 300 autograd nodes in the backward, each a
kernel launch from the host. On a GPU whose forward waits for the host's launches that is time on the critical path.

Every one of those operations only moves values (permutes, pads with zeros, crops, indexes), so each helper is
one indexed copy over the whole micro-batch, with an index built on the host from the latent shapes alone (on a
loader thread, ahead of the micro-batch: :func:`gather_plan`):

- pack: ``packed = cat(latents, [0])[patch_index]`` (padding reads the appended zero);
- timestep embeds: the same ``scatter_add`` with the same index when every frame is noisy (the trainer's case:
  the index is then ``0 .. N-1``), built from one ``arange`` instead of a loop;
- unpack: ``flat = packed.reshape(-1)[unpatch_index]``, split into each sample's ``[1, C, T, H, W]``.

A copy does no arithmetic, so the forward's values are the loops' values bit for bit; the backward of a copy
through a permutation (``index_select``'s index_add into zeros: each element receives exactly one value) is the
loops' backward bit for bit as well (``tests/equivalence/test_latent_gather.py``). The helpers fall back to
diffusers' own loops whenever no plan is set, the latents' shapes are not the plan's, or not every frame is noisy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from patches.core.device import to_device

__all__ = ["GatherPlan", "LatentGather", "gather_plan", "install"]


@dataclasses.dataclass
class GatherPlan:
    """One micro-batch's gather indices (:func:`gather_plan`), on the host (pinned) or on the device.

    Attributes:
        latent_shapes: per sample, the latent's ``(1, C, T, H, W)``.
        patch_index: int32 [tokens x p*p*C]: for each packed value, its position in the concatenated latents
            (``cat`` of each flattened latent), or their total size for a padded position (an appended zero).
        unpatch_index: int32 [sum of C*T*H*W]: for each value of the unpacked latents (concatenated), its position
            in the flattened packed predictions.
        tokens: vision tokens of the micro-batch (rows of the packed latents).
    """

    latent_shapes: list[tuple[int, ...]]
    patch_index: torch.Tensor
    unpatch_index: torch.Tensor
    tokens: int

    def to(self, device: torch.device) -> "GatherPlan":
        """The plan with its indices on ``device`` (from pinned memory without a synchronize on a GPU)."""
        return GatherPlan(self.latent_shapes, to_device(self.patch_index, device), to_device(self.unpatch_index, device),
                          self.tokens)


def gather_plan(latent_shapes: list[torch.Size | tuple[int, ...]], patch: int, pin: bool = False) -> GatherPlan:
    """The indices that pack ``latent_shapes`` as ``_patchify_and_pack_latents`` does and unpack the predictions as
    ``_unpatchify_and_unpack_latents`` does with every frame noisy; host tensors only (a loader thread may build it).

    Args:
        latent_shapes: per sample ``(1, C, T, H, W)`` (each latent's shape, in the micro-batch's order).
        patch: the transformer's ``latent_patch_size`` p (H and W are padded to multiples of it).
        pin: put the indices in pinned memory (a GPU run).

    Raises:
        ValueError: a shape that is not ``(1, C, T, H, W)``, channels that differ between samples, or more than
            2**31 - 1 values (int32 indices).
    """
    p = patch
    shapes = [tuple(int(d) for d in s) for s in latent_shapes]
    if not shapes or any(len(s) != 5 or s[0] != 1 for s in shapes) or len({s[1] for s in shapes}) != 1:
        raise ValueError(f"latent shapes must be (1, C, T, H, W) with one C, got {shapes}")
    total = sum(math.prod(s) for s in shapes)
    if total + 1 > 2**31 - 1:
        raise ValueError(f"{total} latent values do not fit int32 indices")
    patch_parts, unpatch_parts = [], []
    offset = token = 0
    for _, c, t, h, w in shapes:
        hp, wp = -(-h // p), -(-w // p)
        # pack: [t, hp, wp, pi, qi, c] <- latent[c, t, hp*p + pi, wp*p + qi] (the permute cthpwq -> thwpqc)
        ti = torch.arange(t).view(t, 1, 1, 1, 1, 1)
        hi = (torch.arange(hp) * p).view(1, hp, 1, 1, 1, 1) + torch.arange(p).view(1, 1, 1, p, 1, 1)
        wi = (torch.arange(wp) * p).view(1, 1, wp, 1, 1, 1) + torch.arange(p).view(1, 1, 1, 1, p, 1)
        ci = torch.arange(c).view(1, 1, 1, 1, 1, c)
        src = offset + ((ci * t + ti) * h + hi) * w + wi
        patch_parts.append(torch.where((hi < h) & (wi < w), src, total).reshape(-1))  # padding reads the zero
        # unpack: out[c, t, y, x] <- packed row token + (t*hp + y//p)*wp + x//p, column ((y%p)*p + x%p)*c + ch
        y = torch.arange(h).view(1, 1, h, 1)
        x = torch.arange(w).view(1, 1, 1, w)
        row = token + (torch.arange(t).view(1, t, 1, 1) * hp + y // p) * wp + x // p
        col = ((y % p) * p + x % p) * c + torch.arange(c).view(c, 1, 1, 1)
        unpatch_parts.append((row * (p * p * c) + col).reshape(-1))
        offset += c * t * h * w
        token += t * hp * wp
    own = (lambda a: a.pin_memory()) if pin else (lambda a: a)
    return GatherPlan(shapes, own(torch.cat(patch_parts).to(torch.int32)),
                      own(torch.cat(unpatch_parts).to(torch.int32)), token)


class LatentGather:
    """The three packing helpers of one ``Cosmos3OmniTransformer``, by gather while :attr:`plan` is set.

    Installed by :func:`install` as instance attributes (the class's methods stay untouched); the trainer sets
    :attr:`plan` (on the compute device) before each micro-batch's forward and clears it after its backward. Set a
    plan only for a forward whose ``vision_noisy_frame_indexes`` are ``0 .. T-1`` for every sample, as the trainer's
    are: the helpers tell "every frame" from "some frames" by the count of indices only (T indices below T are
    every frame, but in the order given).
    """

    def __init__(self, model: torch.nn.Module):
        self.plan: GatherPlan | None = None
        self.gathered = 0
        """Micro-batches packed by the gather (the rest by diffusers' loops)."""
        self._orig: dict[str, Callable[..., Any]] = {
            name: getattr(model, name) for name in
            ("_patchify_and_pack_latents", "_apply_timestep_embeds_to_noisy_tokens", "_unpatchify_and_unpack_latents")}
        model._patchify_and_pack_latents = self.pack
        model._apply_timestep_embeds_to_noisy_tokens = self.timestep_embeds
        model._unpatchify_and_unpack_latents = self.unpack

    def _plan_for(self, shapes: list[tuple[int, ...]]) -> GatherPlan | None:
        plan = self.plan
        return plan if plan is not None and plan.latent_shapes == shapes else None

    def pack(self, tokens_vision: list[torch.Tensor]):
        """``_patchify_and_pack_latents``: (packed [tokens, p*p*C], per sample (T, H, W))."""
        plan = self._plan_for([tuple(x.shape) for x in tokens_vision])
        if plan is None:
            return self._orig["_patchify_and_pack_latents"](tokens_vision)
        first = tokens_vision[0]
        flat = torch.cat([x.reshape(-1) for x in tokens_vision] + [first.new_zeros(1)])
        packed = flat.index_select(0, plan.patch_index).view(plan.tokens, -1)
        self.gathered += 1
        return packed, [tuple(s[2:]) for s in plan.latent_shapes]

    def timestep_embeds(self, packed_tokens: torch.Tensor, packed_timestep_embeds: torch.Tensor,
                        noisy_frame_indexes: list[torch.Tensor], token_shapes: list[tuple[int, ...]]) -> torch.Tensor:
        """``_apply_timestep_embeds_to_noisy_tokens``: with every frame noisy its index is ``0 .. N-1``."""
        every_frame = len(noisy_frame_indexes) == len(token_shapes) and all(
            n.numel() == s[0] for n, s in zip(noisy_frame_indexes, token_shapes))
        n = sum(math.prod(s) for s in token_shapes)
        if self.plan is None or not every_frame or n != packed_tokens.shape[0]:
            return self._orig["_apply_timestep_embeds_to_noisy_tokens"](
                packed_tokens, packed_timestep_embeds, noisy_frame_indexes, token_shapes)
        index = torch.arange(n, device=packed_tokens.device).unsqueeze(-1).expand(-1, packed_tokens.shape[1])
        return packed_tokens.scatter_add(dim=0, index=index, src=packed_timestep_embeds)

    def unpack(self, packed_mse_preds: torch.Tensor, token_shapes_vision: list[tuple[int, ...]],
               noisy_frame_indexes_vision: list[torch.Tensor], original_latent_shapes: list[tuple[int, int, int]]):
        """``_unpatchify_and_unpack_latents``: per sample ``[1, C, T, H, W]`` (views of one gathered buffer)."""
        plan = self.plan
        every_frame = all(n.numel() == s[0] for n, s in zip(noisy_frame_indexes_vision, token_shapes_vision))
        if (plan is None or not every_frame or [tuple(s[2:]) for s in plan.latent_shapes] != list(original_latent_shapes)
                or packed_mse_preds.shape[0] != plan.tokens):
            return self._orig["_unpatchify_and_unpack_latents"](
                packed_mse_preds, token_shapes_vision, noisy_frame_indexes_vision, original_latent_shapes)
        flat = packed_mse_preds.reshape(-1).index_select(0, plan.unpatch_index)
        return [part.view(shape) for part, shape in
                zip(flat.split([math.prod(s) for s in plan.latent_shapes]), plan.latent_shapes)]


def install(model: torch.nn.Module) -> LatentGather:
    """Give ``model`` (a ``Cosmos3OmniTransformer``) the gather helpers; returns their holder (set its ``plan``)."""
    return LatentGather(model)
