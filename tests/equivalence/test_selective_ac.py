"""Selective activation checkpointing (``[model.activation_checkpointing] mode = "selective"``) trains exactly what
``mode = "full"`` trains, and does keep the attention outputs.

:func:`cosmos_framework_ext.levers.selective_ac.apply_selective_checkpointing` checkpoints each decoder layer from
inside its forward with a selective policy (ops matching ``save_ops_regex`` kept, every other op recomputed).

- **Exact:** packed micro-batches of the tiny preset (fp32, CPU) through the dense and the block-sparse attention,
  eager and with each layer compiled (backend ``aot_eager``: the graphs inductor would be given, partitioner
  included): the loss and every gradient ``torch.equal`` those of ``mode = "full"`` (diffusers'
  ``enable_gradient_checkpointing``, the compiled layer checkpointed from outside: the trainer's path). The anchor
  is the model without checkpointing: full AC equals it too.
- **Kept:** during the backward pass of the dense path, ``mode = "full"`` runs the attention forward again (twice per
  layer: text and vision queries); ``mode = "selective"`` with the recipes' patterns runs it zero times.

Planted: a policy that keeps nothing (``save_ops_regex = []``) recomputes the attention, and the check fails; a
policy that drops a layer's output gradient (a kept op returning the wrong value) is caught by the equality.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cosmos_framework_ext.levers.compile_blocks import compile_blocks
from cosmos_framework_ext.levers.selective_ac import (ATTENTION_OPS, apply_selective_checkpointing,
                                                        kept_attention_bytes, save_policy)
from tests.equivalence import tiny_recipe as R
from tests.equivalence.test_compile_blocks import _step
from tests.test_train import env  # noqa: F401 - the fixture (dataset, output root, no checkpoint paths)

N_SAMPLES = (3, 5)


def _model(mode: str, compiled: bool, patterns=ATTENTION_OPS):
    model, _ = R.make_model()
    if mode == "full":
        model.enable_gradient_checkpointing()
    elif mode == "selective":
        assert apply_selective_checkpointing(model, patterns) == len(model.layers)
    if compiled:
        compile_blocks(model, backend="aot_eager")
    return model


class _Count(TorchDispatchMode):
    """Counts the ops dispatched while active whose name holds ``part`` (and not ``backward``)."""

    def __init__(self, part: str):
        super().__init__()
        self.part, self.n = part, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if self.part in name and "backward" not in name:
            self.n += 1
        return func(*args, **(kwargs or {}))


def reruns_in_backward(model, part: str) -> int:
    """Forward ops named ``part`` that the backward pass of one dense packed micro-batch runs (recomputed)."""
    samples = R.micro_batch(0, 0, n_samples=3)
    loss = R.loss_of(model, samples)
    with _Count(part) as c:
        loss.backward()
    return c.n


def attention_reruns_in_backward(model) -> int:
    return reruns_in_backward(model, "scaled_dot_product")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-aot_eager"])
@pytest.mark.parametrize("impl", ["dense", "flex"])
def test_selective_equals_full_checkpointing(impl, compiled):
    torch._dynamo.reset()
    full, sel, none = _model("full", compiled), _model("selective", compiled), _model("none", False)
    for n in N_SAMPLES:
        lf, gf = _step(full, impl, n)
        ls, gs = _step(sel, impl, n)
        ln, gn = _step(none, impl, n)
        assert torch.equal(lf, ls) and torch.equal(lf, ln)
        assert len(gf) == len(gs) > 0
        assert all(torch.equal(a, b) for a, b in zip(gf, gs))
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(gf, gn))  # the uncheckpointed anchor


def test_selective_keeps_the_attention_outputs():
    full, sel, none = _model("full", False), _model("selective", False), _model("none", False)
    layers = len(full.layers)
    assert attention_reruns_in_backward(full) == 2 * layers  # text and vision queries, every layer
    assert attention_reruns_in_backward(sel) == 0
    # still checkpointed: the rest of the layer (here the two MLPs' activations) runs again, as under full; not without AC
    assert reruns_in_backward(sel, "aten.relu.default") == reruns_in_backward(full, "aten.relu.default") == 2 * layers
    assert reruns_in_backward(none, "aten.relu.default") == 0


def test_planted_a_policy_that_keeps_nothing_recomputes_attention():
    planted = _model("selective", False, patterns=[])
    assert attention_reruns_in_backward(planted) > 0  # the "kept" check above would fail for it


def test_planted_a_wrong_kept_value_breaks_the_equality(monkeypatch):
    import cosmos_framework_ext.levers.selective_ac as sac

    full = _model("full", False)
    real = sac.checkpoint

    def corrupting(fn, *args, **kw):  # the layer's kept outputs slightly off: what a wrong cache would return
        out = real(fn, *args, **kw)
        return tuple(o * (1 + 1e-6) for o in out)

    monkeypatch.setattr(sac, "checkpoint", corrupting)
    sel = _model("selective", False)
    (lf, gf), (ls, gs) = _step(full, "dense", 3), _step(sel, "dense", 3)
    assert not (torch.equal(lf, ls) and all(torch.equal(a, b) for a, b in zip(gf, gs)))


def test_policy_names_and_bad_patterns():
    from torch.utils.checkpoint import CheckpointPolicy

    p = save_policy(ATTENTION_OPS)
    assert p(None, "flex_attention") is CheckpointPolicy.MUST_SAVE
    assert p(None, torch.ops.aten._scaled_dot_product_efficient_attention.default) is CheckpointPolicy.MUST_SAVE
    assert p(None, torch.ops.aten.mm.default) is CheckpointPolicy.PREFER_RECOMPUTE
    with pytest.raises(ValueError, match="not a regular expression"):
        save_policy(["("])
    with pytest.raises(ValueError, match="_repeated_blocks"):
        apply_selective_checkpointing(torch.nn.Linear(2, 2), ATTENTION_OPS)


def test_kept_attention_bytes_by_hand():
    # edge: 12,287 tokens x 28 layers x 16 heads x (128 x 2 B + 4 B)
    assert kept_attention_bytes(12287, 28, 16, 128, 2) == 12287 * 28 * 16 * 260


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("impl", ["dense", "flex"])
def test_gpu_inductor_selective_equals_full(impl):
    """On the GPU with inductor (fp32, tiny preset): the kernels of the two structures differ (inductor fuses the
    recompute into the backward differently), so equality is to fp32 rounding; the measured worst gradient
    difference is printed."""
    torch._dynamo.reset()
    full, _ = R.make_model(device="cuda")
    full.enable_gradient_checkpointing()
    compile_blocks(full)
    sel, _ = R.make_model(device="cuda")
    apply_selective_checkpointing(sel, ATTENTION_OPS)
    compile_blocks(sel)
    assert_agree_to_fp32_rounding(full, sel, impl)


def assert_agree_to_fp32_rounding(a, b, impl: str) -> None:
    """Losses within 1e-5 relative and every gradient within 1e-4 of the largest entry, on each micro-batch of
    :data:`N_SAMPLES` (two compiled structures on the GPU); the worst difference is printed."""
    for n in N_SAMPLES:
        la, ga = _step(a, impl, n)
        lb, gb = _step(b, impl, n)
        worst = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(ga, gb))
        print(f"{impl} n={n}: loss diff {(la - lb).abs().item():.3e}, worst relative grad diff {worst:.3e}")
        assert torch.allclose(la, lb, rtol=1e-5, atol=0)
        assert worst < 1e-4


def test_the_trainer_checkpoints_selectively(env):  # noqa: F811 - the fixture of tests.test_train
    """``mode = "selective"`` in the recipe TOML: the trainer's model checkpoints its layers selectively (no
    attention forward in its backward pass), and ``mode = "full"`` as diffusers does."""
    from cosmos_framework_ext.recipe import train
    from tests.test_train import small_toml

    def built(**edits):
        recipe = train.CosmosSFT(train.parse_args(["--sft-toml", str(small_toml(env, **edits))]))
        recipe.preflight()
        recipe._build_model()
        return recipe.model

    sel = built(**{'mode                = "full"': 'mode                = "selective"',
                   'save_ops_regex      = ["fmha"]': 'save_ops_regex      = ["fmha", "scaled_dot_product"]'})
    assert not sel.gradient_checkpointing and attention_reruns_in_backward(sel) == 0
    assert reruns_in_backward(sel, "aten.relu.default") == 2 * len(sel.layers)  # both MLPs still recomputed: checkpointed
    full = built()
    assert full.gradient_checkpointing and attention_reruns_in_backward(full) == 2 * len(full.layers)
