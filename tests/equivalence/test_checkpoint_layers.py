"""Fewer checkpointed layers (``[onecard] checkpoint_layers``) train exactly what every layer checkpointed trains.

:func:`cosmos_framework_ext.levers.selective_ac.apply_selective_checkpointing` with ``layers=n`` checkpoints the
first ``n`` decoder layers (selectively, or whole with ``save_ops_regex=None``); the others keep their activations.

- **Exact:** packed micro-batches of the tiny preset (fp32, CPU), dense and block-sparse attention, eager and each
  layer compiled (``aot_eager``): with 1 of the 2 layers checkpointed (selective and whole) and with none, the loss
  and every gradient ``torch.equal`` those of every layer checkpointed (diffusers' ``enable_gradient_checkpointing``,
  the trainer's ``mode = "full"``). Anchor: the model without checkpointing agrees to fp32 rounding (the same test
  the selective proof uses).
- **Left out:** the backward pass recomputes the MLP of exactly the checkpointed layers (2 ops per layer: text and
  vision), and none of the others.
- **The plan:** ``"auto"`` picks the fewest checkpointed layers whose ledger fits the budget; ledger and trainer
  agree on it.

Planted: wrappers bound late (every checkpointed layer runs the last layer's forward) break the equality; leaving
out one layer too many is caught by the recompute count.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from cosmos_framework_ext.levers.compile_blocks import compile_blocks
from cosmos_framework_ext.levers.selective_ac import (ATTENTION_OPS, apply_selective_checkpointing,
                                                        repeated_blocks, save_policy)
from tests.equivalence import tiny_recipe as R
from tests.equivalence.test_compile_blocks import _step
from tests.equivalence.test_selective_ac import assert_agree_to_fp32_rounding, reruns_in_backward
from tests.test_train import env  # noqa: F401 - the fixture (dataset, output root, no checkpoint paths)

N_SAMPLES = (3, 5)


def _model(layers: int | None, patterns=ATTENTION_OPS, compiled: bool = False):
    """The tiny model, every layer checkpointed as ``mode = "full"`` (``layers=None``) or the first ``layers``."""
    model, _ = R.make_model()
    if layers is None:
        model.enable_gradient_checkpointing()
    else:
        assert apply_selective_checkpointing(model, patterns, layers=layers) == layers
    if compiled:
        compile_blocks(model, backend="aot_eager")
    return model


def same_training(a, b, impl: str = "dense") -> bool:
    """Whether two models give equal losses and gradients (``torch.equal``; a missing gradient is a difference) on
    every micro-batch of the proof."""
    for n in N_SAMPLES:
        out = []
        for model in (a, b):
            try:
                out.append(_step(model, impl, n))
            except AttributeError:  # a trainable parameter without a gradient (``_step`` clones each)
                return False
        (la, ga), (lb, gb) = out
        if not (torch.equal(la, lb) and len(ga) == len(gb) > 0 and all(torch.equal(x, y) for x, y in zip(ga, gb))):
            return False
    return True


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-aot_eager"])
@pytest.mark.parametrize("impl", ["dense", "flex"])
@pytest.mark.parametrize("layers,patterns", [(1, ATTENTION_OPS), (1, None), (2, None), (0, ATTENTION_OPS)],
                         ids=["1-selective", "1-whole", "2-whole", "0"])
def test_fewer_checkpointed_layers_train_the_same(impl, compiled, layers, patterns):
    torch._dynamo.reset()
    every = _model(None, compiled=compiled)
    fewer = _model(layers, patterns, compiled=compiled)
    assert same_training(every, fewer, impl)
    none, _ = R.make_model()  # the uncheckpointed anchor
    lf, gf = _step(fewer, impl, 3)
    ln, gn = _step(none, impl, 3)
    assert torch.allclose(lf, ln, rtol=1e-6, atol=0)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(gf, gn))


@pytest.mark.parametrize("layers", [0, 1, 2])
def test_only_the_checkpointed_layers_recompute(layers):
    model = _model(layers, patterns=None)
    assert reruns_in_backward(model, "aten.relu.default") == 2 * layers  # text and vision MLP per checkpointed layer


def test_planted_late_bound_wrappers_break_the_equality():
    """The bug the ``_inner=inner`` default argument prevents: each wrapper reads the loop variable when called, so
    every checkpointed layer runs the last layer's forward."""
    planted, _ = R.make_model()
    planted.disable_gradient_checkpointing()
    context_fn = functools.partial(create_selective_checkpoint_contexts, save_policy(ATTENTION_OPS))
    forwards = [m.forward for m in repeated_blocks(planted)]
    for m in repeated_blocks(planted):
        inner = m.forward

        def forward(*args, **kwargs):
            return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        m.forward = forward
    assert forwards[0] is not forwards[-1]
    assert not same_training(_model(None), planted)


def test_planted_one_layer_too_few_is_counted():
    assert reruns_in_backward(_model(0, patterns=None), "aten.relu.default") != 2 * 1


def test_bad_layer_counts():
    model, _ = R.make_model()
    for bad in (-1, len(model.layers) + 1):
        with pytest.raises(ValueError, match=r"must be in \[0, 2\]"):
            apply_selective_checkpointing(model, ATTENTION_OPS, layers=bad)


# ------------------------------------------------------------------------------------------------ the plan
def _cfg(mode: str = "selective", layers="auto"):
    from cosmos_framework_ext.recipe import config as cfgmod

    return cfgmod.from_dict({"model": {"activation_checkpointing": {"mode": mode,
                                                                      "save_ops_regex": ["flex_attention"]}},
                             "onecard": {"checkpoint_layers": layers, "attention": "flex"}})


FLAGS = {"COSMOS_EMA_CPU_SUBSET": True, "COSMOS_VAE_CPU_OFFLOAD": True, "COSMOS_LATENT_CACHE": True,
         "COSMOS_OPTIM_STATE_OFFLOAD": True}


def test_auto_picks_the_fewest_checkpointed_layers_that_fit():
    from cosmos_framework_ext.recipe.ledger import AUTO_HEADROOM, cosmos_ledger, resolve_checkpoint_layers
    from patches.core.runtime import GiB

    cfg = _cfg()
    every = cosmos_ledger(cfg, "edge", FLAGS, checkpoint_layers=28)
    none = cosmos_ledger(cfg, "edge", FLAGS, checkpoint_layers=0)
    assert none.gpu_allocated > every.gpu_allocated
    assert AUTO_HEADROOM == 2 * GiB
    for budget in (every.gpu_reserved, (every.gpu_reserved + none.gpu_reserved) // 2, none.gpu_reserved, 1000 * GiB):
        n = resolve_checkpoint_layers(cfg, "edge", FLAGS, budget + AUTO_HEADROOM)
        assert cosmos_ledger(cfg, "edge", FLAGS, checkpoint_layers=n).fits(budget)
        assert n == 0 or not cosmos_ledger(cfg, "edge", FLAGS, checkpoint_layers=n - 1).fits(budget)
    middle = resolve_checkpoint_layers(cfg, "edge", FLAGS, (every.gpu_reserved + none.gpu_reserved) // 2 + AUTO_HEADROOM)
    assert 0 < middle < 28
    # nothing fits once the headroom is kept: every layer, as without the lever
    assert resolve_checkpoint_layers(cfg, "edge", FLAGS, every.gpu_reserved + AUTO_HEADROOM - 1) == 28
    assert resolve_checkpoint_layers(cfg, "edge", FLAGS, none.gpu_reserved + AUTO_HEADROOM) == 0
    assert resolve_checkpoint_layers(cfg, "edge", FLAGS, none.gpu_reserved) > 0  # the headroom is kept


def test_the_plan_by_value():
    from cosmos_framework_ext.recipe.ledger import cosmos_ledger, resolve_checkpoint_layers
    from patches.core.errors import UserError
    from patches.core.runtime import GiB

    assert resolve_checkpoint_layers(_cfg(layers="all"), "edge", FLAGS, 100 * GiB) == 28
    assert resolve_checkpoint_layers(_cfg(layers=5), "edge", FLAGS, 1) == 5
    assert resolve_checkpoint_layers(_cfg(layers=28), "edge", FLAGS, 1) == 28
    assert resolve_checkpoint_layers(_cfg(layers=0), "edge", FLAGS, 1) == 0
    assert resolve_checkpoint_layers(_cfg(), "edge", FLAGS, None) == 28
    assert resolve_checkpoint_layers(_cfg(), "edge", FLAGS, 100 * GiB, device_type="cpu") == 28
    assert resolve_checkpoint_layers(_cfg(mode="none"), "edge", FLAGS, 100 * GiB) == 28
    with pytest.raises(UserError, match="above the 28 decoder layers"):
        resolve_checkpoint_layers(_cfg(layers=29), "edge", FLAGS, None)
    # the ledger prices each left-out layer, and the kept attention of the checkpointed ones only
    a, b = (cosmos_ledger(_cfg(), "edge", FLAGS, cap=12288, checkpoint_layers=n) for n in (28, 27))
    names = {i.name for i in b.items}
    assert "activations of uncheckpointed layers" in names and "activations of uncheckpointed layers" not in {
        i.name for i in a.items}
    kept = lambda led: next(i.gpu_bytes for i in led.items if i.name.startswith("kept attention"))  # noqa: E731
    assert kept(a) - kept(b) == 12287 * 16 * (128 * 2 + 4)


def test_config_values():
    from cosmos_framework_ext.recipe.config import ConfigError

    assert _cfg(layers=0).onecard.checkpoint_layers == 0
    for bad in ("some", -1, 2.5, True, "AUTO", [1]):
        with pytest.raises(ConfigError, match="checkpoint_layers") as e:
            _cfg(layers=bad)
        assert "must be >= 0" in str(e.value) or "expected int or one of ['all', 'auto']" in str(e.value), str(e.value)


def test_the_trainer_checkpoints_the_first_layers(env):  # noqa: F811 - the fixture of tests.test_train
    from cosmos_framework_ext.recipe import train
    from tests.test_train import small_toml

    def built(extra: str, **edits):
        path = small_toml(env, **edits)
        path.write_text(path.read_text().replace("[onecard]\n", f"[onecard]\n{extra}\n", 1))
        recipe = train.CosmosSFT(train.parse_args(["--sft-toml", str(path)]))
        recipe.preflight()
        recipe._build_model()
        return recipe

    # mode full with a pattern that names the attention: full recomputes it anyway (the pattern is selective's)
    full_one = built("checkpoint_layers = 1",
                     **{'save_ops_regex      = ["fmha"]': 'save_ops_regex      = ["scaled_dot_product"]'})
    assert full_one.checkpoint_layers == 1 and not full_one.model.gradient_checkpointing
    assert reruns_in_backward(full_one.model, "aten.relu.default") == 2
    assert reruns_in_backward(full_one.model, "scaled_dot_product") == 2  # whole layer: attention recomputed too
    first, second = full_one.model.layers  # the FIRST layer is the checkpointed one (its forward wrapped)
    assert "forward" in vars(first) and "forward" not in vars(second)
    sel = built("checkpoint_layers = 1", **{'mode                = "full"': 'mode                = "selective"',
                                            'save_ops_regex      = ["fmha"]': 'save_ops_regex      = ["scaled_dot_product"]'})
    assert reruns_in_backward(sel.model, "scaled_dot_product") == 0
    assert reruns_in_backward(sel.model, "aten.relu.default") == 2
    every = built("checkpoint_layers = \"auto\"")  # on the CPU: every layer, diffusers' own checkpointing
    assert every.checkpoint_layers == 2 and every.model.gradient_checkpointing


def test_the_trainers_ledger_prices_the_resolved_count(env, monkeypatch):  # noqa: F811
    """The plan's ledger is the ledger of the count ``"auto"`` resolved to (a GPU run's; faked here)."""
    from cosmos_framework_ext.recipe import train
    from tests.test_train import small_toml

    path = small_toml(env)
    path.write_text(path.read_text().replace("[onecard]\n", "[onecard]\ncheckpoint_layers = \"auto\"\n", 1))
    monkeypatch.setattr(train, "resolve_checkpoint_layers", lambda *a, **k: 1)
    recipe = train.CosmosSFT(train.parse_args(["--sft-toml", str(path)]))
    recipe.preflight()
    assert recipe.checkpoint_layers == 1
    assert any(i.name == "activations of uncheckpointed layers" and "1 of 2 layers" in i.note for i in recipe.ledger.items)


@pytest.mark.parametrize("onecard,mode,needle", [
    ("checkpoint_layers = 29", "selective", "is above the 28 decoder layers"),
    ("checkpoint_layers = 3", "none", "which checkpoints no layer"),
    ("host_embeddings = true", "full", "embed_tokens.weight trains"),
], ids=["too-many", "mode-none", "trainable-table"])
def test_the_ledger_command_refuses_what_the_trainer_refuses(tmp_path, capsys, onecard, mode, needle):
    from cosmos_framework_ext.recipe import ledger
    from tests.test_train import RECIPE

    text = RECIPE.read_text().replace("[onecard]\n", f"[onecard]\n{onecard}\n", 1)
    text = text.replace('mode                = "full"', f'mode                = "{mode}"')
    if "host_embeddings" in onecard:
        text = text.replace('keys_to_select = [', 'keys_to_select = ["embed_tokens", ', 1)
    path = tmp_path / "r.toml"
    path.write_text(text)
    assert ledger.main(["--toml", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_the_ledger_command_resolves_auto(tmp_path, capsys, monkeypatch):
    from cosmos_framework_ext.recipe import ledger
    from tests.test_train import RECIPE

    for flag in FLAGS:
        monkeypatch.setenv(flag, "1")
    text = RECIPE.read_text().replace("[onecard]\n", "[onecard]\ncheckpoint_layers = \"auto\"\n", 1)
    path = tmp_path / "r.toml"
    path.write_text(text.replace('mode                = "full"', 'mode                = "selective"'))
    assert ledger.main(["--toml", str(path), "--budget-gib", "22.06"]) == 0
    out = capsys.readouterr().out
    import re

    n = int(re.search(r"checkpoint_layers (\d+),", out.splitlines()[0]).group(1))  # the plan "auto" resolved to
    assert 0 < n < 28 and f"{28 - n} of 28 layers keep every activation" in out


def trainer_refuses(env, onecard: str, needle: str) -> None:  # noqa: F811
    """The trainer's preflight of the small recipe with ``onecard`` lines added to ``[onecard]`` raises a
    ``UserError`` matching ``needle``."""
    from cosmos_framework_ext.recipe import train
    from patches.core.errors import UserError
    from tests.test_train import small_toml

    path = small_toml(env)
    path.write_text(path.read_text().replace("[onecard]\n", f"[onecard]\n{onecard}\n", 1))
    recipe = train.CosmosSFT(train.parse_args(["--sft-toml", str(path)]))
    with pytest.raises(UserError, match=needle):
        recipe.preflight()


def test_the_trainer_refuses_too_many_layers(env):  # noqa: F811
    trainer_refuses(env, "checkpoint_layers = 3", "checkpoint_layers = 3 is above the 2 decoder layers")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("impl", ["dense", "flex"])
def test_gpu_inductor_fewer_checkpointed_layers(impl):
    """On the GPU with inductor (fp32, tiny preset), 1 of 2 layers checkpointed against both: inductor compiles the
    two structures into different kernels, so equality is to fp32 rounding; the worst difference is printed."""
    torch._dynamo.reset()
    every, _ = R.make_model(device="cuda")
    apply_selective_checkpointing(every, ATTENTION_OPS)
    compile_blocks(every)
    fewer, _ = R.make_model(device="cuda")
    apply_selective_checkpointing(fewer, ATTENTION_OPS, layers=1)
    compile_blocks(fewer)
    assert_agree_to_fp32_rounding(every, fewer, impl)
