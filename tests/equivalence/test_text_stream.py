"""The frozen text stream handed to the decoder layers detached (``[onecard] detach_text_stream = true``) trains
exactly what the stock forward trains, without the text stream's backward pass.

:func:`cosmos_framework_ext.levers.text_stream.detach_text_stream` wraps ``Cosmos3OmniTransformer._run_decoder_stack``
so that ``und_seq`` enters the layers detached while ``embed_tokens`` is frozen.

- **Exact, CPU** (tiny preset, fp32, packed micro-batches of 3 and 5 samples, dense and block-sparse attention,
  eager and each layer compiled with ``aot_eager``; every layer checkpointed whole as diffusers does, selectively with
  1 of 2 layers, and none): the loss and every trainable gradient ``torch.equal`` the stock forward's; and compiled
  with inductor (the GPU's backend) on the CPU, three packed lengths: bitwise as well.
- **Anchor:** diffusers' own model, untouched (its ``Cosmos3AttnProcessor``, no packing, no lever), on a one-sample
  micro-batch: the lever's loss and gradients agree to fp32 rounding.
- **The work it removes:** without checkpointing, no module of the text stream runs a backward (module backward
  hooks: none with the lever, every one without), while the vision stream's and ``k_norm_und_for_gen``'s still do;
  counted at the dispatcher, the backward pass runs exactly the text stream's six input-gradient matmuls per layer
  fewer under diffusers' eager checkpoint, and more than that with the checkpoint compiled inside the layer.
- **Where it must not cut:** trainable text-stream weights, and an ``embed_tokens`` made trainable before or after
  the wrapper is installed, train as the stock forward does.
- **GPU** (inductor, flex attention, selective checkpointing of 1 of 2 layers): the same comparison to a stated fp32
  tolerance (the compiled layers are not bitwise repeatable on the GPU even with nothing changed: their run-to-run
  difference, measured by ``test_compile_wrapper.py``'s GPU test, is 4.3e-7 to 4.8e-7 of a gradient's largest value).

Planted: the cut placed one step too far (the text keys detached inside the layers: ``k_norm_und_for_gen`` loses its
gradient) and a detach that ignores a trainable ``embed_tokens`` (its gradient lost) break the equality; the vision
stream detached as well is caught too.
"""

from __future__ import annotations

import pytest
import torch

from cosmos_framework_ext.levers import text_stream as T
from cosmos_framework_ext.levers.compile_blocks import compile_blocks
from cosmos_framework_ext.levers.selective_ac import ATTENTION_OPS, apply_selective_checkpointing
from cosmos_framework_ext.recipe.presets import get_preset
from tests.equivalence import tiny_recipe as R
from tests.equivalence.test_checkpoint_layers import same_training
from tests.equivalence.test_compile_blocks import _step
from tests.equivalence.test_compile_wrapper import _worst
from tests.equivalence.test_selective_ac import _Count
from tests.test_train import env  # noqa: F401 - the fixture (dataset, output root, no checkpoint paths)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")

TEXT_MODULES = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn.to_q", "self_attn.to_k",
                "self_attn.to_v", "self_attn.to_out")
"""A decoder layer's text-stream modules (every one frozen in the recipe)."""
TEXT_LINEARS = 6
"""Linear layers of the text stream per decoder layer: q, k, v, output projection, MLP up and down."""


def _model(ac: str, detach: bool, compiled: bool = False, device: str = "cpu", train_embeddings: bool = False):
    """The tiny model with ``ac`` checkpointing (``"full"``: diffusers' on every layer; ``"selective-1"``: the first
    layer selectively; ``"none"``), the lever on or off, optionally compiled per layer (``aot_eager`` on the CPU,
    inductor on a GPU)."""
    model, _ = R.make_model(device=device)
    if train_embeddings:
        model.embed_tokens.weight.requires_grad_(True)
    if ac == "full":
        model.enable_gradient_checkpointing()
    elif ac == "selective-1":
        apply_selective_checkpointing(model, ATTENTION_OPS, layers=1)
    if detach:
        T.detach_text_stream(model)
    if compiled:
        compile_blocks(model, backend="aot_eager" if device == "cpu" else "inductor")
    return model


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-aot_eager"])
@pytest.mark.parametrize("impl", ["dense", "flex"])
@pytest.mark.parametrize("ac", ["full", "selective-1", "none"])
def test_detached_text_stream_trains_the_same(ac, impl, compiled):
    torch._dynamo.reset()
    stock = _model(ac, detach=False, compiled=compiled)
    lever = _model(ac, detach=True, compiled=compiled)
    assert T.is_detached(lever) and not T.is_detached(stock)
    assert same_training(stock, lever, impl)


def test_detached_text_stream_trains_the_same_inductor_cpu(tmp_path, monkeypatch):
    """Inductor (the GPU's backend) on the CPU: the two graphs it is given differ, and still every loss and gradient is
    bitwise the stock one's (three packed lengths, selective checkpointing of 1 of 2 layers)."""
    runs = []
    for detach in (False, True):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / str(detach)))  # each compiled anew
        torch._dynamo.reset()
        model = _model("selective-1", detach=detach)
        compile_blocks(model, backend="inductor")
        runs.append([_step(model, "dense", n) for n in (3, 5, 4)])
    assert _worst(*runs) == 0.0


def test_agrees_with_diffusers_own_forward():
    """The anchor: diffusers' model as it ships (its processor, no packing, no lever), one sample per micro-batch."""
    plain = R.plain_model()
    lever = _model("none", detach=True)
    lever.load_state_dict(plain.state_dict())
    samples = R.micro_batch(3, 0, n_samples=1)
    lp, gp = R.packed_step(plain, samples)
    ll, gl = R.packed_step(lever, samples)
    assert len(gp) == len(gl) > 0
    assert torch.allclose(lp, ll, rtol=1e-6, atol=0)
    for a, b in zip(gl, gp):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def _backward_calls(model, names) -> int:
    """Module backward hooks fired for submodules of each layer named in ``names`` during one packed step."""
    calls = []
    for layer in model.layers:
        for name in names:
            layer.get_submodule(name).register_full_backward_hook(lambda *a: calls.append(1))
    _step(model, "dense", 3)
    return len(calls)


def test_the_text_stream_runs_no_backward():
    stock, lever = _model("none", detach=False), _model("none", detach=True)
    per_model = len(stock.layers) * len(TEXT_MODULES)
    assert _backward_calls(stock, TEXT_MODULES) == per_model  # the waste the lever removes
    assert _backward_calls(lever, TEXT_MODULES) == 0
    gen = ("mlp_moe_gen", "self_attn.add_q_proj", "self_attn.k_norm_und_for_gen")
    assert _backward_calls(_model("none", detach=True), gen) == len(lever.layers) * len(gen)  # still trained
    _, grads = _step(lever, "dense", 3)
    named = [n for n, p in lever.named_parameters() if p.requires_grad]
    k_norm = [g for n, g in zip(named, grads) if "k_norm_und_for_gen" in n]
    assert k_norm and all(g.abs().sum() > 0 for g in k_norm)


def _matmuls_in_backward(model) -> int:
    samples = R.micro_batch(0, 0, n_samples=3)
    loss = R.loss_of(model, samples)
    with _Count("aten.mm") as c:
        loss.backward()
    return c.n


def test_the_backward_runs_fewer_matmuls():
    """Diffusers' eager checkpoint recomputes the whole layer either way: exactly the text stream's input gradients
    fewer. With the checkpoint compiled inside the layer the partitioner also drops recompute only they needed."""
    layers = get_preset("tiny").transformer["num_hidden_layers"]
    stock, lever = _matmuls_in_backward(_model("full", False)), _matmuls_in_backward(_model("full", True))
    assert lever == stock - TEXT_LINEARS * layers, (stock, lever)
    torch._dynamo.reset()
    stock = _matmuls_in_backward(_model("selective-1", False, compiled=True))
    torch._dynamo.reset()
    lever = _matmuls_in_backward(_model("selective-1", True, compiled=True))
    assert lever < stock - TEXT_LINEARS * layers, (stock, lever)


@pytest.mark.parametrize("ac", ["full", "selective-1", "none"])
def test_trainable_text_stream_weights_stay_exact(ac):
    """The cut is at the stack's entry: a trainable weight inside the text stream makes the stream after it need a
    gradient again, and its gradient is the stock one."""
    def model(detach):
        m = _model(ac, detach)
        for layer in m.layers:
            for name in ("self_attn.to_k", "mlp", "input_layernorm"):
                layer.get_submodule(name).requires_grad_(True)
        return m

    assert same_training(model(False), model(True))


def test_a_trainable_embedding_keeps_its_gradient():
    """With ``embed_tokens`` trainable at call time the wrapper passes the stream as it comes: the stock training."""
    stock = _model("none", detach=False, train_embeddings=True)
    lever = _model("none", detach=True, train_embeddings=True)
    assert same_training(stock, lever)


def test_an_embedding_unfrozen_after_wrapping_keeps_its_gradient():
    """The wrapper reads ``embed_tokens``' flag at each call, not when it was installed."""
    stock = _model("none", detach=False, train_embeddings=True)
    lever = _model("none", detach=True)
    lever.embed_tokens.weight.requires_grad_(True)
    assert same_training(stock, lever)


# ------------------------------------------------------------------------------------------------ planted bugs
def test_planted_detach_ignoring_a_trainable_embedding_is_caught():
    stock = _model("none", detach=False, train_embeddings=True)
    planted = _model("none", detach=False, train_embeddings=True)
    inner = planted._run_decoder_stack
    planted._run_decoder_stack = lambda u, g, r: inner(u.detach(), g, r)  # the bug: no check of embed_tokens
    assert not same_training(stock, planted)


def test_planted_text_keys_detached_are_caught():
    """The cut one step too far: the text keys detached inside the layers, so ``k_norm_und_for_gen``'s gradient is
    lost."""
    stock = _model("none", detach=False)
    planted = _model("none", detach=True)
    for layer in planted.layers:
        norm = layer.self_attn.k_norm_und_for_gen
        inner = norm.forward
        norm.forward = lambda x, _inner=inner: _inner(x).detach()
    assert not same_training(stock, planted)


def test_planted_vision_stream_detached_is_caught():
    stock = _model("none", detach=False)
    planted = _model("none", detach=False)
    inner = planted._run_decoder_stack
    planted._run_decoder_stack = lambda u, g, r: inner(u.detach(), g.detach(), r)
    assert not same_training(stock, planted)


# ------------------------------------------------------------------------------------------------ the contract
def test_wrapping_twice_wraps_once():
    model = _model("none", detach=True)
    once = model._run_decoder_stack
    T.detach_text_stream(model)
    assert model._run_decoder_stack is once


def test_not_a_cosmos_transformer_is_refused():
    with pytest.raises(TypeError, match="Cosmos3OmniTransformer"):
        T.detach_text_stream(torch.nn.Linear(2, 2))


def test_a_trainable_embedding_is_refused_by_the_check():
    T.check_text_stream(False, ["embed_tokens.weight"])  # off: nothing to check
    T.check_text_stream(True, ["layers.0.mlp_moe_gen.up_proj.weight"])
    with pytest.raises(ValueError, match="embed_tokens.weight trains.*detach_text_stream = false"):
        T.check_text_stream(True, ["proj_in.weight", "embed_tokens.weight"])


# ------------------------------------------------------------------------------ upstream's patch, its wrapper
def test_the_upstream_patch_hands_the_stack_a_detached_text_stream():
    """``COSMOS_DETACH_TEXT_STREAM``'s wrapper of upstream's ``_impl_forward`` (no upstream needed; its proof against
    upstream's own model is ``tests/upstream/test_cosmos_text_stream.py``): a copy of the pack with ``causal_seq``
    detached goes in while ``embed_tokens`` is frozen, every other key and argument as they came, the caller's pack
    unchanged; an unfrozen embedding or a stream without a gradient passes through as it came."""
    from types import SimpleNamespace

    from cosmos_framework_ext.upstream.patches import patched_impl_forward

    seen = []
    wrapped = patched_impl_forward(lambda self, pack, *a, **k: seen.append((pack, a, k)) or "out")
    text_model = SimpleNamespace(embed_tokens=torch.nn.Embedding(4, 3).requires_grad_(False))
    x = torch.randn(5, 3, requires_grad=True) * 2
    pack = {"causal_seq": x[:2], "full_only_seq": x[2:], "_causal_seq_offsets": torch.tensor([0, 2])}
    assert wrapped(text_model, pack, "mask", position_ids=7) == "out"
    got, args, kwargs = seen[-1]
    assert not got["causal_seq"].requires_grad and torch.equal(got["causal_seq"], x[:2])
    assert got["full_only_seq"] is pack["full_only_seq"] and got["_causal_seq_offsets"] is pack["_causal_seq_offsets"]
    assert (args, kwargs) == (("mask",), {"position_ids": 7})
    assert pack["causal_seq"].requires_grad and got is not pack  # the caller's pack as it came
    text_model.embed_tokens.weight.requires_grad_(True)  # read at each call
    wrapped(text_model, pack, "mask")
    assert seen[-1][0] is pack
    text_model.embed_tokens.weight.requires_grad_(False)
    no_grad = {"causal_seq": torch.randn(2, 3), "full_only_seq": torch.randn(3, 3)}
    wrapped(text_model, no_grad, "mask")
    assert seen[-1][0] is no_grad


# ------------------------------------------------------------------------------------------------ GPU
GPU_RTOL = 1e-5
"""The GPU comparison's tolerance on each gradient (its largest difference over its largest value) and on the loss
(fp32; about 20x the compiled layers' measured run-to-run difference, 4.3e-7 to 4.8e-7)."""


def _gpu_worst(a, b) -> float:
    """:func:`tests.equivalence.test_compile_wrapper._worst` with the losses compared to :data:`GPU_RTOL` instead of
    bitwise (the lever changes the compiled graph, so inductor may fuse the forward differently)."""
    if len(a) != len(b) or any(not torch.isclose(la, lb, rtol=GPU_RTOL, atol=0) for (la, _), (lb, _) in zip(a, b)):
        return float("inf")
    return _worst([(lb, ga) for (_, ga), (lb, _) in zip(a, b)], b)


def test_the_gpu_comparison_can_fail():
    one = (torch.tensor(1.0), [torch.ones(3)])
    assert _gpu_worst([one], [one]) == 0.0
    assert _gpu_worst([(torch.tensor(1.0 + 3 * GPU_RTOL), [torch.ones(3)])], [one]) == float("inf")
    assert _gpu_worst([(torch.tensor(1.0), [torch.ones(3) * (1 + 3 * GPU_RTOL)])], [one]) > GPU_RTOL
    assert _gpu_worst([(torch.tensor(1.0), [torch.tensor([1.0, float("nan"), 1.0])])], [one]) == float("inf")
    assert _gpu_worst([one, one], [one]) == float("inf")


@cuda
def test_cuda_detached_text_stream_trains_the_same(tmp_path, monkeypatch):
    def run(name: str, detach: bool):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / name))  # each run compiled anew
        torch._dynamo.reset()
        model = _model("selective-1", detach=detach, compiled=True, device="cuda")
        return [_step(model, "flex", n) for n in (3, 5, 4)]

    stock, lever = run("stock", False), run("lever", True)
    diff = _gpu_worst(stock, lever)
    print(f"GPU: detached text stream against stock {diff:.3g} (tolerance {GPU_RTOL}; the compiled layers' own run "
          "to run difference, measured in test_compile_wrapper.py: 4.3e-7 to 4.8e-7)")
    assert diff <= GPU_RTOL


# ------------------------------------------------------------------------------------------------ the trainer
def test_the_trainer_detaches_when_the_recipe_says_so(env):  # noqa: F811 - the fixture of tests.test_train
    from cosmos_framework_ext.recipe import train
    from tests.test_train import small_toml

    def built(value: str):
        toml = small_toml(env, **{"detach_text_stream = true": f"detach_text_stream = {value}"})  # the recipe's key
        recipe = train.CosmosSFT(train.parse_args(["--sft-toml", str(toml)]))
        recipe.preflight()
        recipe._build_model()
        return recipe.model

    assert T.is_detached(built("true")) and not T.is_detached(built("false"))


def test_the_trainer_refuses_a_trainable_embedding(env):  # noqa: F811
    from cosmos_framework_ext.recipe import train
    from patches.core.errors import UserError
    from tests.test_train import small_toml

    toml = small_toml(env, **{'keys_to_select = ["moe_gen"': 'keys_to_select = ["embed_tokens", "moe_gen"'})
    recipe = train.CosmosSFT(train.parse_args(["--sft-toml", str(toml)]))
    with pytest.raises(UserError, match="embed_tokens.weight trains"):
        recipe.preflight()


def test_the_ledger_refuses_a_trainable_embedding():
    from cosmos_framework_ext.recipe import config as cfgmod
    from cosmos_framework_ext.recipe.ledger import cosmos_ledger

    def cfg(keys):
        return cfgmod.from_dict({"optimizer": {"keys_to_select": keys}, "onecard": {"detach_text_stream": True}})

    assert cosmos_ledger(cfg(["moe_gen"]), "tiny", {}).gpu_allocated > 0
    with pytest.raises(ValueError, match="embed_tokens.weight trains"):
        cosmos_ledger(cfg(["moe_gen", "embed_tokens"]), "tiny", {})


def test_the_upstream_toml_copy_names_the_flag_the_recipe_key_needs_there(tmp_path, monkeypatch, capsys):
    """The launcher drops ``[onecard]`` for upstream's trainer: a recipe that sets ``detach_text_stream`` gets one
    line naming ``COSMOS_DETACH_TEXT_STREAM``, unless that flag is already on."""
    from pathlib import Path

    from cosmos_framework_ext.recipe import config

    recipe = Path(__file__).resolve().parents[2] / "toml" / "vision_sft_edge_24gb.toml"
    monkeypatch.delenv("COSMOS_DETACH_TEXT_STREAM", raising=False)
    assert config._main(["upstream-toml", str(recipe), str(tmp_path / "a.toml")]) == 0
    assert "set COSMOS_DETACH_TEXT_STREAM=1" in capsys.readouterr().err
    assert "detach_text_stream" not in (tmp_path / "a.toml").read_text()
    monkeypatch.setenv("COSMOS_DETACH_TEXT_STREAM", "1")
    assert config._main(["upstream-toml", str(recipe), str(tmp_path / "b.toml")]) == 0
    assert "COSMOS_DETACH_TEXT_STREAM" not in capsys.readouterr().err


def test_the_upstream_toml_copy_of_a_bad_recipe_is_one_line_and_writes_nothing(tmp_path, capsys):
    """A recipe that fails the schema is refused before the copy is written (one ``error:`` line, exit 2)."""
    from pathlib import Path

    from cosmos_framework_ext.recipe import config

    text = (Path(__file__).resolve().parents[2] / "toml" / "vision_sft_edge_24gb.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("grad_accum_iter         = 61", "grad_accum_iter         = 0"))
    assert config._main(["upstream-toml", str(bad), str(tmp_path / "c.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "grad_accum_iter" in err[0], err
    assert not (tmp_path / "c.toml").exists()
