"""A micro-batch's host work does not wait for the GPU, and gives the same inputs as before.

The embedded trainer prepares each packed micro-batch on the host (noise drawn from a seeded CPU generator,
positions, timesteps, segment indices, the block masks) while the GPU still computes the previous one: host
tensors reach the GPU from pinned memory with ``non_blocking`` copies, the block masks are built without reading
anything back, and the loss is read once per optimizer step. A plain ``.to(device)`` from pageable memory, an
``.item()`` or ``int()`` of a GPU tensor would make the host wait for everything queued.

- **Same values** (CPU): ``n_segments`` given or read gives the same block masks.
- **No synchronize** (GPU): building a flex micro-batch's inputs on the GPU under
  ``torch.cuda.set_sync_debug_mode("error")`` raises nothing; planted: a pageable copy raises.
"""

from __future__ import annotations

import pytest
import torch

from cosmos_framework_ext.levers.attention_blocksparse import segment_block_mask
from cosmos_framework_ext.recipe import attention
from cosmos_framework_ext.recipe.loss import flow_matching_inputs
from cosmos_framework_ext.recipe.train import _sample_noise
from patches.core.device import to_device as _to_device
from tests.equivalence import tiny_recipe as R

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")


def _inputs(device, put=_to_device):
    model, _ = R.make_model()
    samples = R.micro_batch(0, 0, n_samples=3)
    x0 = [put(s[1], device) for s in samples]
    sigmas, noise = _sample_noise(7, 3, 1, [x.shape for x in x0])
    xt = [flow_matching_inputs(x, put(e, device), float(sg))[0] for x, e, sg in zip(x0, noise, sigmas)]
    return attention.build_packed_inputs(model.config, [s[0] for s in samples], xt, sigmas, [24.0] * 3, device,
                                         impl="flex", block=16)


def test_block_masks_with_the_sample_count_equal_the_read_ones():
    und = torch.tensor([0, 0, 1, 1, 1, 2])
    gen = torch.tensor([0] * 20 + [1] * 7 + [2] * 30)
    both = torch.cat([und, gen])
    rule = lambda b, h, q, k: gen[q] == both[k]  # noqa: E731
    read = segment_block_mask(gen, both, rule, causal=False, block=16)
    given = segment_block_mask(gen, both, rule, causal=False, block=16, n_segments=3)
    for a, b in zip(read.as_tuple()[:-1], given.as_tuple()[:-1]):
        assert (torch.equal(a, b) if torch.is_tensor(a) else a == b)


@cuda
def test_a_micro_batchs_inputs_reach_the_gpu_without_a_synchronize():
    device = torch.device("cuda")
    ref, _ = _inputs(torch.device("cpu"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kwargs, segs = _inputs(device)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for k in ("input_ids", "position_ids", "vision_timesteps", "text_indexes", "vision_sequence_indexes"):
        assert torch.equal(kwargs[k].cpu(), ref[k]), k


@cuda
def test_planted_a_pageable_copy_synchronizes():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            _inputs(torch.device("cuda"), put=lambda t, d: t.to(d))
    finally:
        torch.cuda.set_sync_debug_mode(0)


@cuda
def test_a_layout_built_ahead_is_pinned_and_reaches_the_gpu_without_a_synchronize():
    """What a loader thread builds (:func:`attention.host_layout` with ``pin``) is in pinned memory, and the main
    thread's half (``build_packed_inputs(layout=...)``) sends it without waiting for the GPU."""
    device = torch.device("cuda")
    model, _ = R.make_model()
    samples = R.micro_batch(0, 0, n_samples=3)
    shapes = [s[1].shape for s in samples]
    sigmas, noise = _sample_noise(7, 3, 1, shapes)
    noise = [e.pin_memory() for e in noise]
    layout = attention.host_layout(model.config, [s[0] for s in samples], shapes, sigmas, [24.0] * 3, pin=True)
    assert all(t.is_pinned() for t in noise) and all(
        getattr(layout, f).is_pinned() for f in ("input_ids", "position_ids", "timesteps", "und_segments", "gen_segments"))
    x0 = [_to_device(s[1], device) for s in samples]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        xt = [flow_matching_inputs(x, _to_device(e, device), float(sg))[0] for x, e, sg in zip(x0, noise, sigmas)]
        kwargs, _ = attention.build_packed_inputs(model.config, [s[0] for s in samples], xt, sigmas, [24.0] * 3,
                                                  device, impl="flex", block=16, layout=layout)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(kwargs["vision_timesteps"].cpu(), layout.timesteps)
