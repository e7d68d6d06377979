"""Packing several samples into one micro-batch changes nothing about each sample's prediction.

diffusers' ``Cosmos3AttnProcessor`` runs one sample per sequence; the embedded trainer packs many, kept apart
by segment masks (``cosmos_framework_ext.recipe.attention``). Proofs: with one sample the packed processor equals
the stock one; with two samples packed, each sample's prediction equals running it alone (fp32, rtol 1e-5:
the attention kernel reduces over a longer, masked key axis).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3AttnProcessor

from cosmos_framework_ext.recipe import attention
from cosmos_framework_ext.recipe.loss import flow_matching_inputs
from tests.equivalence import tiny_recipe as R


def predict(model, samples, segments=True, fps=None):
    xt = [flow_matching_inputs(x0, e, s)[0] for _, x0, s, e in samples]
    kwargs, segs = attention.build_packed_inputs(
        model.config, [s[0] for s in samples], xt, torch.tensor([s[2] for s in samples]),
        fps or [24.0] * len(samples), torch.device("cpu"),
    )
    proc = model.layers[0].self_attn.processor
    if isinstance(proc, attention.PackedAttnProcessor):
        proc.segments = segs if segments else None
    with torch.no_grad():
        return model(**kwargs).sample


def test_one_sample_equals_stock_processor():
    model, _ = R.make_model()
    sample = R.micro_batch(0, 0, n_samples=1)
    ours = predict(model, sample)
    for layer in model.layers:
        layer.self_attn.set_processor(Cosmos3AttnProcessor())
    stock = predict(model, sample)
    torch.testing.assert_close(ours[0], stock[0], rtol=1e-5, atol=1e-6)


def test_packed_samples_equal_each_alone():
    model, _ = R.make_model()
    a, b = R.micro_batch(0, 0, n_samples=2)
    packed = predict(model, [a, b])
    torch.testing.assert_close(packed[0], predict(model, [a])[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed[1], predict(model, [b])[0], rtol=1e-5, atol=1e-6)


def test_packed_samples_of_different_fps_equal_each_alone():
    """Each sample's vision positions are modulated by its own clip's fps (upstream's fps modulation)."""
    model, _ = R.make_model()
    assert model.config.enable_fps_modulation
    a, b = R.micro_batch(0, 0, n_samples=2)
    packed = predict(model, [a, b], fps=[24.0, 30.0])
    torch.testing.assert_close(packed[0], predict(model, [a], fps=[24.0])[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed[1], predict(model, [b], fps=[30.0])[0], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(predict(model, [b], fps=[24.0])[0], packed[1], rtol=1e-5, atol=1e-6)  # fps matters


def test_planted_missing_masks_leak_between_samples():
    model, _ = R.make_model()
    a, b = R.micro_batch(0, 0, n_samples=2)
    leaky = predict(model, [a, b], segments=False)
    assert not torch.allclose(leaky[0], predict(model, [a])[0], rtol=1e-5, atol=1e-6)
