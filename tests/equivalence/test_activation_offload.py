"""Offloaded layers (``[onecard] offload_layers``) train exactly what the same layers kept on the GPU train.

:func:`cosmos_framework_ext.levers.activation_offload.offload_activations` sends the saved tensors of the first
decoder layers to (pinned) host memory in the forward pass and copies them back for the backward pass.

- **Exact:** packed micro-batches of the tiny preset (fp32, CPU), dense and block-sparse attention, eager and each
  layer compiled (``aot_eager``): with 1 of 2 layers offloaded (the other checkpointed selectively) and with both,
  the loss and every gradient ``torch.equal`` those of the same layers left uncheckpointed on the device. Anchor:
  every layer checkpointed (diffusers' ``enable_gradient_checkpointing``, itself proven equal to fewer checkpointed
  layers in ``test_checkpoint_layers.py``) gives the same, ``torch.equal``.
- **Moved:** the offloaded layers' activations went through the host (tensors and bytes counted), never a parameter,
  and the copies back started at the trigger layer's backward or at the layer's own.
- **Planted:** a chunk cursor that does not advance (every tensor of a layer copied to the same host bytes) breaks
  the equality.

The copies on their CUDA streams are tested on a GPU (``test_cuda_offload_matches_resident``), compiled with
inductor.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from cosmos_framework_ext.levers import activation_offload as ao
from cosmos_framework_ext.levers.compile_blocks import compile_blocks
from cosmos_framework_ext.levers.selective_ac import ATTENTION_OPS, apply_selective_checkpointing
from tests.equivalence import tiny_recipe as R
from tests.equivalence.test_checkpoint_layers import same_training
from tests.equivalence.test_compile_blocks import _step
from tests.test_train import env  # noqa: F401 - the fixture (dataset, output root, no checkpoint paths)


def _model(offloaded: int, checkpointed_to: int = 2, *, offload: bool = True, compiled: bool = False,
           trigger: int | None = None, device: str = "cpu", min_bytes: int = 0):
    """The tiny model: layers ``[0, offloaded)`` offloaded (or, with ``offload=False``, left uncheckpointed on the
    device), layers ``[offloaded, checkpointed_to)`` checkpointed selectively, the rest uncheckpointed."""
    model, _ = R.make_model(device=device)
    apply_selective_checkpointing(model, ATTENTION_OPS, layers=checkpointed_to, skip=offloaded)
    off = ao.offload_activations(model, offloaded, trigger=trigger, min_bytes=min_bytes) if offload else None
    if compiled:
        compile_blocks(model, backend="aot_eager" if device == "cpu" else "inductor")
    return model, off


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-aot_eager"])
@pytest.mark.parametrize("impl", ["dense", "flex"])
@pytest.mark.parametrize("offloaded,trigger", [(1, None), (1, 1), (1, 0), (2, None)],
                         ids=["1", "1-trigger", "1-trigger-at-itself", "2"])
def test_offloaded_layers_train_the_same(impl, compiled, offloaded, trigger):
    torch._dynamo.reset()
    resident, _ = _model(offloaded, offload=False, compiled=compiled)
    moved, off = _model(offloaded, compiled=compiled, trigger=trigger)
    assert same_training(resident, moved, impl)
    assert off.moved[0] > 0 and off.moved[1] > 0  # the last micro-batch's activations went through the host
    every, _ = R.make_model()
    every.enable_gradient_checkpointing()
    assert same_training(every, moved, impl)  # the anchor


@pytest.mark.parametrize("trigger,before", [(1, ("forward done",)), (None, ("forward done", "unpack"))],
                         ids=["at-the-trigger", "at-its-own-backward"])
def test_what_moves_and_when(trigger, before):
    model, off = _model(1, trigger=trigger)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed, fetched, stages = [], [], []
    pack, fetch, unpack = off.pack, off.fetch, off.unpack

    def spy_pack(t):
        out = pack(t)
        if isinstance(out, ao._OffloadedTensor):
            packed.append(t.untyped_storage().data_ptr())
        return out

    def spy_unpack(p):
        if isinstance(p, ao._OffloadedTensor) and "unpack" not in stages:
            stages.append("unpack")
        return unpack(p)

    def spy_fetch(i):
        fetched.append((i, tuple(stages)))
        return fetch(i)

    off.pack, off.fetch, off.unpack = spy_pack, spy_fetch, spy_unpack
    samples = R.micro_batch(0, 0, n_samples=3)
    loss = R.loss_of(model, samples)
    stages.append("forward done")
    assert packed and not params & set(packed)  # activations moved, no parameter
    n, nbytes = off.moved
    assert n == len(packed) and nbytes > 0 and off.host_bytes >= nbytes
    chunks = [(a.tensors[0].data_ptr(), a.nbytes) for a in off._chunks[0].arenas]
    away = off._saved[0]
    assert len(away) == n and all(any(p <= a.host.data_ptr() < p + size for p, size in chunks) for a in away)  # copies
    loss.backward()
    assert fetched and fetched[0] == (0, before)
    loss = R.loss_of(model, samples)  # the next pass counts its own tensors
    assert off.moved == (n, nbytes)
    loss.backward()
    # no grad: nothing saved, nothing moved
    off.moved = (0, 0)
    with torch.no_grad():
        R.loss_of(model, samples)
    assert off.moved == (0, 0)


def test_pack_keeps_parameters_and_buffers_where_they_are():
    model, off = _model(1)
    model.register_buffer("table", torch.ones(64, 64))
    off.begin()
    off._layer = 0
    weight = next(model.parameters())
    assert off.pack(model.table) is model.table and off.pack(weight) is weight
    alias = weight.detach()  # another tensor on the parameter's storage (what a compiled graph saves)
    assert off.pack(alias) is alias
    assert isinstance(off.pack(torch.ones(64, 64)), ao._OffloadedTensor) and off.moved[0] == 1
    off._layer = None
    t = torch.ones(64, 64)
    assert off.pack(t) is t  # outside an offloaded layer's call


def test_a_graph_of_an_earlier_pass_is_refused():
    model, off = _model(1)
    samples = R.micro_batch(0, 0, n_samples=2)
    old = R.loss_of(model, samples)
    R.loss_of(model, samples)  # a second forward before the first backward: its chunk bytes reused
    with pytest.raises(RuntimeError, match="one backward per forward pass"):
        old.backward()


def test_small_tensors_stay():
    """Under :data:`MIN_BYTES` (every tensor of the tiny preset) nothing moves, and the training is the same."""
    resident, _ = _model(1, offload=False)
    kept, off = _model(1, min_bytes=ao.MIN_BYTES)
    assert same_training(resident, kept, "dense")
    assert off.moved == (0, 0)


def test_the_model_lists_and_saves_its_layers_as_before():
    model, _ = _model(2)
    R.loss_of(model, R.micro_batch(0, 0, n_samples=2)).backward()  # after a pass too
    plain, _ = R.make_model()
    assert [type(m) for m in model.layers] == [type(m) for m in plain.layers]
    assert list(model.state_dict()) == list(plain.state_dict())
    assert len(model.layers) == 2 and model.layers[0] is list(model.layers)[0]


def test_planted_cursor_that_does_not_advance_breaks_the_equality(monkeypatch):
    def carve(self, nbytes, pin):
        if not self.arenas:
            self.arenas.append(ao.HostArena([((1 << 24,), torch.uint8)], pin=pin))
        return self.arenas[0].tensors[0][:nbytes]

    monkeypatch.setattr(ao._Chunks, "carve", carve)
    resident, _ = _model(1, offload=False)
    planted, off = _model(1)
    assert not same_training(resident, planted, "dense")


def test_chunks_are_reused_grow_and_shrink_to_one():
    c = ao._Chunks("test")
    a = c.carve(10, pin=False)
    b = c.carve(100, pin=False)
    assert a.numel() == 10 and b.numel() == 100 and len(c.arenas) == 1
    assert b.data_ptr() - a.data_ptr() == ao.ALIGN  # aligned after the first
    assert c.used == ao.ALIGN + 100
    c.rewind()
    assert c.carve(10, pin=False).data_ptr() == a.data_ptr() and len(c.arenas) == 1  # reused
    big = c.carve(ao.CHUNK_BYTES, pin=False)  # no room left in the first chunk: a second one
    assert len(c.arenas) == 2 and big.numel() == ao.CHUNK_BYTES and c.nbytes == 2 * ao.CHUNK_BYTES
    c.rewind()  # the pass spread over two chunks: one chunk of its bytes, rounded up
    assert len(c.arenas) == 1 and c.nbytes == ao.CHUNK_BYTES + ao.ROUND_BYTES
    x, y = c.carve(10, pin=False), c.carve(ao.CHUNK_BYTES, pin=False)
    assert len(c.arenas) == 1 and y.data_ptr() - x.data_ptr() == ao.ALIGN
    c.rewind()
    assert c.nbytes == ao.CHUNK_BYTES + ao.ROUND_BYTES and c.peak == ao.ALIGN + ao.CHUNK_BYTES


def test_a_reserved_chunk_is_held_from_the_start():
    c = ao._Chunks("test")
    c.reserve(1000, pin=False)
    c.reserve(5000, pin=False)  # once: a layer's chunks exist
    assert c.nbytes == 1000
    assert c.carve(900, pin=False).numel() == 900 and len(c.arenas) == 1
    c.carve(200, pin=False)
    assert len(c.arenas) == 2  # past the reserve: grown
    model, _ = R.make_model()
    off = ao.offload_activations(model, 2, reserve=4096)
    assert off.host_bytes == 2 * 4096


def test_bad_arguments():
    model, _ = R.make_model()
    for bad in (-1, 3):
        with pytest.raises(ValueError, match=r"offloaded layers .* must be in \[0, 2\]"):
            ao.offload_activations(model, bad)
    with pytest.raises(ValueError, match=r"trigger layer 2 must be in \[0, 1\]"):
        ao.offload_activations(model, 1, trigger=2)
    with pytest.raises(TypeError, match="Cosmos3OmniTransformer"):
        ao.offload_activations(torch.nn.Linear(2, 2), 1)
    ao.offload_activations(model, 1)
    with pytest.raises(ValueError, match="already offloaded"):
        ao.offload_activations(model, 1)
    full, _ = R.make_model()
    full.enable_gradient_checkpointing()
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        ao.offload_activations(full, 1)
    wrapped, _ = R.make_model()
    apply_selective_checkpointing(wrapped, ATTENTION_OPS, layers=2)
    with pytest.raises(ValueError, match="decoder layer 0 is checkpointed"):
        ao.offload_activations(wrapped, 1)
    caller = ao._Caller.__new__(ao._Caller)  # no layer yet (copy, pickle): an AttributeError, not a recursion
    with pytest.raises(AttributeError):
        caller.anything
    model, _ = R.make_model()
    with pytest.raises(ValueError, match=r"offloaded layers 3 must be in \[0, 2\]"):
        apply_selective_checkpointing(model, ATTENTION_OPS, layers=2, skip=3)
    assert apply_selective_checkpointing(model, ATTENTION_OPS, layers=2, skip=1) == 1


class _SavesAtTheEnd(torch.autograd.Function):
    """``relu(x @ w)`` saving ``x``, ``w`` and the output once its forward is done, as a compiled layer does."""

    @staticmethod
    def forward(ctx, x, w):
        y = torch.relu(x @ w)
        ctx.save_for_backward(x, w, y)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, w, y = ctx.saved_tensors
        gy = gy * (y > 0)
        return gy @ w.t(), x.t() @ gy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("layers", ["eager", "saved-at-the-end", "copies-out-late"])
def test_cuda_stream_order_with_the_gpu_behind(layers):
    """The stream order under load: the GPU runs far behind the host (a queue of large matmuls before each pass),
    the saved tensors are large (256 MiB), two offloaded "layers", each fetched at its own backward (no lead), three
    passes through the same chunks. A copy to the host that does not wait for the kernel that wrote its tensor (eager:
    tensors saved while their kernels are queued), or a copy back that does not wait for the copy to the host
    (copies-out-late: the copy stream is held about 50 ms before the second layer's copies, the compute stream is
    not), gives other gradients; equal to the run without offloading, ``torch.equal``."""
    torch.backends.cuda.matmul.allow_tf32 = False
    n, dev = 8192, "cuda"
    g = torch.Generator(dev).manual_seed(0)
    model = torch.nn.Module()
    model.w1 = torch.nn.Parameter(torch.randn(n, n, device=dev, generator=g) / 90)
    model.w2 = torch.nn.Parameter(torch.randn(n, n, device=dev, generator=g) / 90)
    busy = torch.randn(n, n, device=dev, generator=g) / 90
    first = ((lambda x: _SavesAtTheEnd.apply(x, model.w1)) if layers == "saved-at-the-end"
             else (lambda x: torch.relu(x @ model.w1)))

    def step(off, x):
        model.zero_grad(set_to_none=True)
        for _ in range(8):
            busy @ busy  # the GPU behind the host, as in training
        if off is not None:
            off.begin()
        with off.layer(0) if off is not None else contextlib.nullcontext():
            y = first(x)
        if off is not None and layers == "copies-out-late":
            with torch.cuda.stream(off._d2h):
                torch.cuda._sleep(100_000_000)  # about 50 ms of clock cycles on the copy stream only
        with off.layer(1) if off is not None else contextlib.nullcontext():
            z = (y @ model.w2) * y
        z.square().mean().backward()
        return model.w1.grad.clone(), model.w2.grad.clone()

    off = ao.ActivationOffload(model, [0, 1], min_bytes=0, reserve=3 * n * n * 4 + 4096)
    for i in range(3):
        x = torch.randn(n, n, device=dev, generator=g)
        want = step(None, x)
        got = step(off, x)
        torch.cuda.synchronize()
        worst = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(want, got))
        print(f"offload stream order {layers} pass {i}: moved {off.moved[0]} tensors, worst rel {worst:.2e}")
        assert off.moved[0] >= 3 and all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-inductor"])
def test_cuda_offload_matches_resident(compiled):
    """On a GPU, the copies on their streams: the same losses and gradients as the layers left on the GPU (inductor
    compiles both the same way; a tolerance of the compiled layers' own run-to-run difference, as the other CUDA
    proofs use)."""
    torch._dynamo.reset()
    resident, _ = _model(1, offload=False, compiled=compiled, device="cuda")
    moved, off = _model(1, compiled=compiled, trigger=1, device="cuda")
    for n in (3, 5, 4):
        la, ga = R.packed_step(resident, R.micro_batch(n, 0, n_samples=n), "flex")
        lb, gb = R.packed_step(moved, R.micro_batch(n, 0, n_samples=n), "flex")
        worst = max(((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item() for a, b in zip(ga, gb))
        print(f"offload cuda compiled={compiled} n={n}: loss {la.item():.6f} {lb.item():.6f} worst rel {worst:.2e}")
        torch.testing.assert_close(la, lb, rtol=1e-6, atol=0)
        assert worst <= 1e-5
    assert off.moved[0] > 0


# ------------------------------------------------------------------------------------------------ the plan
def _cfg(offload, layers="auto", mode: str = "selective"):
    from cosmos_framework_ext.recipe import config as cfgmod

    return cfgmod.from_dict({"model": {"activation_checkpointing": {"mode": mode,
                                                                      "save_ops_regex": ["flex_attention"]}},
                             "onecard": {"checkpoint_layers": layers, "offload_layers": offload, "attention": "flex"}})


FLAGS = {"COSMOS_EMA_CPU_SUBSET": True, "COSMOS_VAE_CPU_OFFLOAD": True, "COSMOS_LATENT_CACHE": True,
         "COSMOS_OPTIM_STATE_OFFLOAD": True}


def test_config_values():
    from cosmos_framework_ext.recipe.config import ConfigError

    assert _cfg(0).onecard.offload_layers == 0 and _cfg(3).onecard.offload_layers == 3
    for bad in (-1, 2.5, True, "auto", "4"):
        with pytest.raises(ConfigError, match="offload_layers"):
            _cfg(bad)


@pytest.mark.parametrize("offload,layers,mode,world,mixed,needle", [
    (5, 4, "selective", 1, False, "is above the 4 checkpointed decoder layers"),
    (29, "all", "selective", 1, False, "is above the 28 checkpointed decoder layers"),
    (1, "auto", "none", 1, False, 'mode = "none"'),
    (1, "all", "selective", 2, False, "one rank"),
    (1, "all", "selective", 1, True, "one rank"),
], ids=["above-checkpointed", "above-layers", "mode-none", "ranks", "fp32-master"])
def test_refused(offload, layers, mode, world, mixed, needle):
    from cosmos_framework_ext.recipe.ledger import check_offload_layers
    from patches.core.errors import UserError

    with pytest.raises(UserError, match=needle) as e:
        check_offload_layers(_cfg(offload, layers, mode), "edge", world, mixed)
    assert "offload_layers" in str(e.value) and "\n" not in str(e.value)
    check_offload_layers(_cfg(0, layers, mode), "edge", world, mixed)  # 0: nothing to check


def test_refused_once_auto_is_resolved():
    from cosmos_framework_ext.recipe.ledger import check_offload_layers
    from patches.core.errors import UserError

    check_offload_layers(_cfg(4), "edge", checkpoint_layers=4)
    with pytest.raises(UserError, match="is above the 3 checkpointed decoder layers"):
        check_offload_layers(_cfg(4), "edge", checkpoint_layers=3)


def test_the_ledger_prices_the_host_chunks():
    from cosmos_framework_ext.recipe.ledger import cosmos_ledger, offload_reserve_bytes, resolve_checkpoint_layers
    from patches.core.runtime import GiB

    plain, off = (cosmos_ledger(_cfg(k), "edge", FLAGS, cap=12288, checkpoint_layers=21) for k in (0, 4))
    line = next(i for i in off.items if i.name == "offloaded layers' activations")
    assert line.pinned and line.gpu_bytes == 0 and line.host_bytes == 4 * offload_reserve_bytes(12287, 2048)
    assert 0.70 * GiB < offload_reserve_bytes(12287, 2048) < 0.72 * GiB
    assert off.gpu_allocated == plain.gpu_allocated  # on the GPU: priced as checkpointed
    assert off.host_bytes == plain.host_bytes + line.host_bytes and off.pinned_bytes == plain.pinned_bytes + line.host_bytes
    assert "offloaded layers' activations" not in {i.name for i in plain.items}
    # all offloaded layers come back at the last checkpointed layer's backward: beyond the uncheckpointed layers'
    # room, priced on the GPU (4 offloaded, 2 uncheckpointed layers: 2 priced as uncheckpointed)
    early = lambda led: next((i.gpu_bytes for i in led.items if i.name == "offloaded layers copied back early"), 0)  # noqa: E731
    assert early(off) == 0
    tight = cosmos_ledger(_cfg(4), "edge", FLAGS, cap=12288, checkpoint_layers=26)
    assert early(tight) == 2 * offload_reserve_bytes(12287, 2048)
    assert tight.gpu_allocated == cosmos_ledger(_cfg(0), "edge", FLAGS, cap=12288, checkpoint_layers=26).gpu_allocated \
        + early(tight)
    # "auto" counts the offloaded layers among the checkpointed ones: never fewer than them
    assert resolve_checkpoint_layers(_cfg(6), "edge", FLAGS, 1000 * GiB) == 6
    assert resolve_checkpoint_layers(_cfg(0), "edge", FLAGS, 1000 * GiB) == 0


def _built(env, extra: str):
    from cosmos_framework_ext.recipe import train
    from tests.test_train import small_toml

    path = small_toml(env, **{'mode                = "full"': 'mode                = "selective"',
                              'save_ops_regex      = ["fmha"]': 'save_ops_regex      = ["scaled_dot_product"]'})
    path.write_text(path.read_text().replace("[onecard]\n", f"[onecard]\n{extra}\n", 1))
    recipe = train.CosmosSFT(train.parse_args(["--sft-toml", str(path)]))
    recipe.preflight()
    recipe._build_model()
    return recipe


def test_the_trainer_offloads_the_first_layers(env, capsys):  # noqa: F811
    recipe = _built(env, "offload_layers = 1")
    assert recipe.checkpoint_layers == 2 and recipe.act_offload is not None
    assert recipe.act_offload.offloaded == [0] and recipe.act_offload.trigger == 1
    first, second = recipe.model.layers
    assert "forward" not in vars(first) and "forward" in vars(second)  # layer 0 offloaded, layer 1 checkpointed
    assert "1 of 2 decoder layers activation-checkpointed" in capsys.readouterr().out
    from tests.equivalence.test_selective_ac import reruns_in_backward

    assert reruns_in_backward(recipe.model, "aten.relu.default") == 2  # the checkpointed layer's text and vision MLP
    assert _built(env, "").act_offload is None


def test_the_trainer_refuses_more_than_auto_resolved(env, monkeypatch):  # noqa: F811
    from cosmos_framework_ext.recipe import train
    from patches.core.errors import UserError
    from tests.test_train import small_toml

    path = small_toml(env)
    path.write_text(path.read_text().replace("[onecard]\n", "[onecard]\ncheckpoint_layers = \"auto\"\n"
                                             "offload_layers = 2\n", 1))
    monkeypatch.setattr(train, "resolve_checkpoint_layers", lambda *a, **k: 1)  # a GPU's plan, faked
    recipe = train.CosmosSFT(train.parse_args(["--sft-toml", str(path)]))
    with pytest.raises(UserError, match="offload_layers = 2 is above the 1 checkpointed decoder layers"):
        recipe.preflight()


def test_the_trainer_refuses_more_than_the_checkpointed_layers(env):  # noqa: F811
    from tests.equivalence.test_checkpoint_layers import trainer_refuses

    trainer_refuses(env, "checkpoint_layers = 1\noffload_layers = 2",
                    "offload_layers = 2 is above the 1 checkpointed decoder layers")


def test_the_upstream_toml_copy_says_upstream_does_not_offload(tmp_path, capsys):
    from pathlib import Path

    from cosmos_framework_ext.recipe import config

    text = (Path(__file__).resolve().parents[2] / "toml" / "vision_sft_edge_24gb.toml").read_text()
    src = tmp_path / "r.toml"
    src.write_text(text.replace("[onecard]\n", "[onecard]\noffload_layers = 4\n", 1) if "[onecard]\n" in text
                   else text + "\n[onecard]\noffload_layers = 4\n")
    assert config._main(["upstream-toml", str(src), str(tmp_path / "a.toml")]) == 0
    err = capsys.readouterr().err
    assert "offload_layers = 4, which only the embedded trainer runs" in err
    assert "offload_layers" not in (tmp_path / "a.toml").read_text()
    assert config._main(["upstream-toml", str(Path(__file__).resolve().parents[2] / "toml" / "vision_sft_edge_24gb.toml"),
                         str(tmp_path / "b.toml")]) == 0
    assert "offload_layers" not in capsys.readouterr().err
