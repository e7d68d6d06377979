"""The frozen text stream's keys and values from a per-caption cache (``[onecard] text_kv_cache = true``) train what
the stock forward trains, to a stated fp32 tolerance, without running the text stream in the training forward.

:mod:`cosmos_framework_ext.levers.text_kv_cache`: a pre-pass computes each caption's ``k_und`` (after ``norm_k``)
and ``v_und`` per layer once; each micro-batch gathers its samples' rows, and the decoder layers run the vision
stream alone with them.

- **The cached values are the training forward's own** (CPU, tiny preset, fp32, packed micro-batches of 3 and 5
  samples, the pre-pass packing the captions differently): equal to the keys and values the stock forward computes
  inside each layer within ``KV_RTOL`` of their largest value.
- **Trains the same** (the loss and every trainable gradient against the stock forward without the lever, within
  ``RTOL`` of their largest value; dense, block-sparse and variable-length attention; eager and each layer compiled
  with ``aot_eager``; every layer checkpointed as diffusers does, selectively 1 of 2, none), and with inductor on the
  CPU over three packed lengths: no graph compiled after the first micro-batch.
- **Anchor:** diffusers' own model, untouched (its ``Cosmos3AttnProcessor``, no packing, no lever), on a one-sample
  micro-batch.
- **The work it removes:** with the lever no text-stream projection or attention runs in the training forward; only
  the layer's own text norms and MLP are called, on zero rows (forward hooks); the vision stream's modules and
  ``k_norm_und_for_gen`` still run, and the latter still gets its gradient.
- **Where it must not run:** a trainable text-stream weight or ``embed_tokens`` is refused (recipe check and at each
  call); a text the pre-pass did not see is refused; the pre-pass refuses to run with a micro-batch's K/V installed.

Planted: the rows of a micro-batch gathered in another sample order, each layer handed the previous layer's keys and
values, and cached keys that skip ``k_norm_und_for_gen`` each break the agreement.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import pytest
import torch

from cosmos_framework_ext.levers import text_kv_cache as K
from cosmos_framework_ext.levers.compile_blocks import compile_blocks
from cosmos_framework_ext.levers.selective_ac import ATTENTION_OPS, apply_selective_checkpointing
from cosmos_framework_ext.recipe import attention
from cosmos_framework_ext.recipe.attention import PackedAttnProcessor
from cosmos_framework_ext.recipe.presets import build_transformer, get_preset
from tests.equivalence import tiny_recipe as R
from tests.equivalence.gpu_order import gpu_sleep, rehearsed, still_sleeping
from tests.equivalence.test_compile_blocks import compile_count
from tests.test_train import env  # noqa: F401 - the fixture (dataset, output root, no checkpoint paths)

KV_RTOL = 1e-6
"""Cached keys and values against the training forward's own, relative to their largest value (fp32: the pre-pass
packs the captions into other matmul row counts and attention calls)."""
RTOL = 1e-5
"""The loss and each gradient against the stock forward's, relative to its largest value (fp32)."""
N_SAMPLES = (3, 5)
TEXT_MODULES = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn.to_q", "self_attn.to_k",
                "self_attn.to_v", "self_attn.to_out")


def _model(ac: str = "none", lever: bool = True, compiled: bool = False, backend: str = "aot_eager",
           cache_cls: type = K.TextKVCache):
    """The tiny model with ``ac`` checkpointing (``"full"``, ``"selective-1"``, ``"none"``), the lever installed
    (its cache returned) or not, optionally each layer compiled."""
    model, _ = R.make_model()
    if ac == "full":
        model.enable_gradient_checkpointing()
    elif ac == "selective-1":
        apply_selective_checkpointing(model, ATTENTION_OPS, layers=1)
    cache = None
    if lever:
        t = get_preset("tiny").transformer
        cache = cache_cls(len(model.layers), t["num_key_value_heads"] * t["head_dim"], torch.float32)
        K.use_text_kv_cache(model, cache)
    if compiled:
        compile_blocks(model, backend=backend)
    return model, cache


def _forward_inputs(model, impl: str):
    """The pre-pass's micro-batch builder: the trainer's (:func:`attention.prepass_inputs`), on the CPU, flex tiles of
    16."""
    return lambda texts: attention.prepass_inputs(model.config, texts, torch.float32, "cpu", impl=impl, block=16)


def _texts(n: int) -> list[list[int]]:
    return [s[0] for s in R.micro_batch(n, 0, n_samples=n)]


def _fill(model, cache, impl: str = "dense") -> None:
    """The pre-pass over every text of the proof's micro-batches, in another order than any micro-batch's (so the
    cached rows come from other packings)."""
    texts = [t for n in N_SAMPLES for t in _texts(n)][::-1]
    cache.fill(model, model.layers[0].self_attn.processor, texts, _forward_inputs(model, impl))


def _step(model, cache, impl: str, n: int):
    """One packed step of micro-batch ``n`` (``R.packed_step``), with the cached K/V installed when ``cache``."""
    if cache is not None:
        cache.current = cache.gather(_texts(n))
    try:
        return R.packed_step(model, R.micro_batch(n, 0, n_samples=n), impl)
    finally:
        if cache is not None:
            cache.current = None


def _worst(a, b) -> float:
    """Largest difference of the losses and gradients of two steps, relative to each tensor's largest value; inf when
    a gradient is missing."""
    (la, ga), (lb, gb) = a, b
    if len(ga) != len(gb) or not ga:
        return float("inf")
    worst = float((la - lb).abs() / lb.abs())
    for x, y in zip(ga, gb):
        worst = max(worst, float((x - y).abs().max() / y.abs().max()))
    return worst


def _agrees(stock, lever, cache, impl: str = "dense") -> float:
    _fill(lever, cache, impl)
    return max(_worst(_step(lever, cache, impl, n), _step(stock, None, impl, n)) for n in N_SAMPLES)


# ------------------------------------------------------------------------------------------------ the values
def _forward_kv(model, n: int) -> torch.Tensor:
    """``[layers, 2, und_len, kv_dim]``: the keys (after ``norm_k``) and values the stock forward computes for micro-batch
    ``n``, read by hooks."""
    got = [[None, None] for _ in model.layers]
    hooks = [m.register_forward_hook(lambda _m, _i, out, i=i, j=j: got[i].__setitem__(j, out.detach().flatten(1)))
             for i, layer in enumerate(model.layers)
             for j, m in enumerate((layer.self_attn.norm_k, layer.self_attn.to_v))]
    try:
        _step(model, None, "dense", n)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([torch.stack(pair) for pair in got])


def test_the_cached_values_are_the_training_forwards_own():
    stock, _ = _model(lever=False)
    lever, cache = _model()
    _fill(lever, cache)
    for n in N_SAMPLES:
        want = _forward_kv(stock, n)
        got = cache.gather(_texts(n))
        assert got.shape == want.shape == (2, 2, sum(len(t) for t in _texts(n)), 32)
        assert (got - want).abs().max() <= KV_RTOL * want.abs().max()
    assert len(cache.rows) == sum(N_SAMPLES) and cache.bytes == cache.store.numel() * 4


def test_the_pre_pass_skips_texts_it_has():
    lever, cache = _model()
    _fill(lever, cache)
    before = cache.store.clone()
    assert cache.fill(lever, lever.layers[0].self_attn.processor, _texts(3), _forward_inputs(lever, "dense")) == 0
    assert torch.equal(cache.store, before)


# ------------------------------------------------------------------------------------------------ training
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-aot_eager"])
@pytest.mark.parametrize("impl", ["dense", "flex", "varlen"])
@pytest.mark.parametrize("ac", ["full", "selective-1", "none"])
def test_the_cached_text_stream_trains_the_same(ac, impl, compiled):
    torch._dynamo.reset()
    stock, _ = _model(ac, lever=False, compiled=compiled)
    lever, cache = _model(ac, compiled=compiled)
    assert _agrees(stock, lever, cache, impl) <= RTOL


def test_inductor_on_the_cpu_compiles_nothing_after_the_first_micro_batch(tmp_path, monkeypatch):
    """Inductor (the GPU's backend) on the CPU, selective checkpointing of 1 of 2 layers, three packed lengths: the
    cached keys and values, views at other offsets of one tensor each micro-batch, cost no recompile."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    stock, _ = _model("selective-1", lever=False)
    lever, cache = _model("selective-1", compiled=True, backend="inductor")
    _fill(lever, cache)
    counts = []
    for n in (3, 5, 4):
        before = compile_count()
        got = _step(lever, cache, "dense", n) if n != 4 else None
        if n == 4:  # a length the pre-pass did not see: filled now, then trained
            cache.fill(lever, lever.layers[0].self_attn.processor, _texts(4), _forward_inputs(lever, "dense"))
            before = compile_count()
            got = _step(lever, cache, "dense", n)
        counts.append(compile_count() - before)
        assert _worst(got, _step(stock, None, "dense", n)) <= RTOL
    assert counts[0] > 0 and counts[1:] == [0, 0], counts


def test_agrees_with_diffusers_own_forward():
    """The anchor: diffusers' model as it ships (its processor, no packing, no lever), one sample per micro-batch."""
    plain = R.plain_model()
    lever, cache = _model()
    lever.load_state_dict(plain.state_dict())
    samples = R.micro_batch(3, 0, n_samples=1)
    cache.fill(lever, lever.layers[0].self_attn.processor, [samples[0][0]], _forward_inputs(lever, "dense"))
    cache.current = cache.gather([samples[0][0]])
    ll, gl = R.packed_step(lever, samples)
    cache.current = None
    lp, gp = R.packed_step(plain, samples)
    assert _worst((ll, gl), (lp, gp)) <= RTOL


# ------------------------------------------------------------------------------------------------ the work removed
def test_only_the_layers_own_text_norms_and_mlp_see_the_empty_text_stream():
    lever, cache = _model()
    _fill(lever, cache)
    calls = {"text": 0, "vision": 0}
    for layer in lever.layers:
        for name in TEXT_MODULES:
            layer.get_submodule(name).register_forward_hook(lambda *a: calls.__setitem__("text", calls["text"] + 1))
        for name in ("mlp_moe_gen", "self_attn.add_q_proj", "self_attn.k_norm_und_for_gen"):
            layer.get_submodule(name).register_forward_hook(lambda *a: calls.__setitem__("vision", calls["vision"] + 1))
    _, grads = _step(lever, cache, "dense", 3)
    # the empty text stream still passes the layer's own norms and MLP (zero rows): only those
    assert calls["text"] == 3 * len(lever.layers) and calls["vision"] == 3 * len(lever.layers)
    named = [n for n, p in lever.named_parameters() if p.requires_grad]
    k_norm = [g for n, g in zip(named, grads) if "k_norm_und_for_gen" in n]
    assert k_norm and all(g.abs().sum() > 0 for g in k_norm)


def test_the_empty_text_stream_computes_no_rows():
    """What the layers still call on the text side runs on zero rows: the projections and attention are skipped."""
    lever, cache = _model()
    _fill(lever, cache)
    rows = []
    for layer in lever.layers:
        for name in TEXT_MODULES:
            layer.get_submodule(name).register_forward_hook(lambda _m, inp, _o: rows.append(inp[0].shape[0]))
    _step(lever, cache, "dense", 5)
    assert rows and set(rows) == {0}


# ------------------------------------------------------------------------------------------------ refusals
def test_a_trainable_text_stream_weight_is_refused():
    K.check_text_kv_cache(False, ["embed_tokens.weight"])  # off: nothing to refuse
    K.check_text_kv_cache(True, ["layers.0.mlp_moe_gen.up_proj.weight", "layers.1.self_attn.k_norm_und_for_gen.weight"])
    for name in ("embed_tokens.weight", "norm.weight", "layers.1.self_attn.to_q.weight", "layers.0.mlp.up_proj.weight",
                 "layers.0.input_layernorm.weight", "layers.0.self_attn.norm_k.weight"):
        with pytest.raises(ValueError, match=f"{name} trains.*text_kv_cache = false"):
            K.check_text_kv_cache(True, ["moe_gen.x", name])


def test_a_weight_unfrozen_after_the_check_is_refused_at_the_call():
    lever, cache = _model()
    _fill(lever, cache)
    lever.layers[1].self_attn.to_v.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="layers.1.self_attn.to_v.weight requires a gradient"):
        _step(lever, cache, "dense", 3)


def test_unseen_texts_and_a_busy_cache_are_refused():
    lever, cache = _model()
    with pytest.raises(RuntimeError, match="not in the pre-pass"):
        cache.gather(_texts(3))
    _fill(lever, cache)
    cache.current = cache.gather(_texts(3))
    with pytest.raises(RuntimeError, match="K/V installed"):
        cache.fill(lever, lever.layers[0].self_attn.processor, [[1, 2]], _forward_inputs(lever, "dense"))
    cache.current = cache.gather(_texts(5))  # another micro-batch's K/V: the wrong text length
    with pytest.raises(RuntimeError, match="text tokens"):
        R.packed_step(lever, R.micro_batch(3, 0, n_samples=3))
    with pytest.raises(TypeError, match="Cosmos3OmniTransformer"):
        K.use_text_kv_cache(torch.nn.Linear(2, 2), cache)


def test_the_stack_runs_stock_without_a_micro_batch_installed():
    stock, _ = _model(lever=False)
    lever, cache = _model()
    a, b = _step(stock, None, "dense", 3), _step(lever, None, "dense", 3)
    assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


# ------------------------------------------------------------------------------------------------ planted
class _ReorderedCache(K.TextKVCache):
    """Planted: the micro-batch's rows gathered in another sample order."""

    def gather(self, texts):
        return super().gather(list(texts)[::-1])


class _PreviousLayerCache(K.TextKVCache):
    """Planted: each layer handed the previous layer's keys and values."""

    def gather(self, texts):
        return super().gather(texts).roll(1, dims=0)


@pytest.mark.parametrize("cls", [_ReorderedCache, _PreviousLayerCache], ids=["reordered", "previous-layer"])
def test_planted_wrong_rows_break_the_agreement(cls):
    stock, _ = _model(lever=False)
    lever, cache = _model(cache_cls=cls)
    assert _agrees(stock, lever, cache) > RTOL


def test_planted_keys_without_their_vision_norm_break_the_agreement(monkeypatch):
    stock, _ = _model(lever=False)
    lever, cache = _model()
    _fill(lever, cache)
    want = [_step(stock, None, "dense", n) for n in N_SAMPLES]
    plain = PackedAttnProcessor._text_keys_for_vision

    def skipped(attn, k, cos, sin):  # the cached keys rotated without k_norm_und_for_gen (its weight kept in the graph)
        return plain(type("A", (), {"k_norm_und_for_gen": None})(), k, cos, sin) + 0 * attn.k_norm_und_for_gen(k)

    monkeypatch.setattr(PackedAttnProcessor, "_text_keys_for_vision", staticmethod(skipped))
    assert max(_worst(_step(lever, cache, "dense", n), w) for n, w in zip(N_SAMPLES, want)) > RTOL


# ------------------------------------------------------------------------------------------------ the trainer
def test_the_trainer_trains_the_same_with_the_cache(env):  # noqa: F811 - the fixture of tests.test_train
    """The embedded trainer, CPU smoke recipe: the losses with ``text_kv_cache = true`` equal the ones without within
    ``RTOL``, and the summary reports the cache."""
    from cosmos_framework_ext.recipe import train
    from tests.test_train import small_toml

    def losses(value: str):
        toml = small_toml(env, **{"[onecard]\n": f"[onecard]\ntext_kv_cache = {value}\n"})
        out = train.run(train.parse_args(["--sft-toml", str(toml), "--no-save"]))
        return out

    stock, lever = losses("false"), losses("true")
    assert stock["text_kv_cache"] is None
    info = lever["text_kv_cache"]
    assert info["captions"] > 0 and info["tokens"] > 0 and info["host_bytes"] > 0
    assert info["prepass_peak_gpu_bytes"] is None  # measured on a GPU only
    assert info["micro_batches"] == lever["steps"] * 1 > 0  # every micro-batch's stack ran from the cache (ga 1)
    a, b = stock["losses"], lever["losses"]
    assert len(a) == len(b) > 0
    assert all(abs(x - y) <= RTOL * abs(x) for x, y in zip(a, b)), (a, b)


def test_the_trainer_refuses_a_trainable_text_weight(env):  # noqa: F811
    from cosmos_framework_ext.recipe import train
    from patches.core.errors import UserError
    from tests.test_train import small_toml

    toml = small_toml(env, **{"[onecard]\n": "[onecard]\ntext_kv_cache = true\n",
                              'keys_to_select = ["moe_gen"': 'keys_to_select = ["mlp.up_proj", "moe_gen"'})
    recipe = train.CosmosSFT(train.parse_args(["--sft-toml", str(toml)]))
    with pytest.raises(UserError, match="mlp.up_proj.weight trains"):
        recipe.preflight()


def test_the_trainer_refuses_a_cache_the_host_cannot_hold(env, monkeypatch):  # noqa: F811
    """Preflight: the ledger's text K/V lines, times the ranks on the host, against the host memory available; the
    same recipe passes with room for one rank's cache and is refused with room for less, or for one of two ranks."""
    from cosmos_framework_ext.recipe import train
    from patches.core.errors import UserError
    from tests.test_train import small_toml

    toml = small_toml(env, **{"[onecard]\n": "[onecard]\ntext_kv_cache = true\n"})
    recipe = train.CosmosSFT(train.parse_args(["--sft-toml", str(toml)]))
    monkeypatch.setattr(train, "host_available", lambda: 2**50)
    recipe.preflight()
    need = sum(i.host_bytes for i in recipe.ledger.items if i.name.startswith("text K/V"))
    assert need > 0
    monkeypatch.setattr(train, "host_available", lambda: need)
    recipe._check_text_kv_host()  # exactly enough
    monkeypatch.setattr(train, "host_available", lambda: need - 1)
    with pytest.raises(UserError, match=r"text_kv_cache needs .* of host memory.*text_kv_cache = false"):
        recipe._check_text_kv_host()
    monkeypatch.setattr(train, "host_available", lambda: 2 * need - 1)
    recipe._check_text_kv_host()
    monkeypatch.setattr(train, "agree_max", lambda value, device: 2**20)  # another rank's host is 1 MiB short
    with pytest.raises(UserError, match=r"does not fit another rank's host \(1\.0 MiB short\)"):
        recipe._check_text_kv_host()
    monkeypatch.setattr(train, "agree_max", lambda value, device: value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(UserError, match="2 ranks on this host"):
        recipe._check_text_kv_host()
    monkeypatch.setattr(train, "host_available", lambda: 0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(UserError, match=r"needs \d+\.\d MiB .* but 0\.0 MiB"):  # through preflight, before any work
        train.CosmosSFT(train.parse_args(["--sft-toml", str(toml)])).preflight()


def test_validate_only_counts_the_ranks_of_one_host(env, monkeypatch):  # noqa: F811
    """``--validate-only`` checks for the launch in one process: the ranks on this host are ``NPROC_PER_NODE``, not
    the world (``NNODES`` hosts hold a cache per rank each)."""
    from cosmos_framework_ext.recipe import train
    from patches.core.errors import UserError
    from tests.test_train import small_toml

    toml = small_toml(env, **{"[onecard]\n": "[onecard]\ntext_kv_cache = true\n"})
    monkeypatch.setenv("NPROC_PER_NODE", "1")
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setattr(train, "host_available", lambda: 2**50)
    recipe = train.CosmosSFT(train.parse_args(["--sft-toml", str(toml), "--validate-only"]))
    recipe.preflight()
    assert recipe.world == 2
    need = sum(i.host_bytes for i in recipe.ledger.items if i.name.startswith("text K/V"))
    monkeypatch.setattr(train, "host_available", lambda: need)
    recipe._check_text_kv_host()  # one rank on this host
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    with pytest.raises(UserError, match="2 ranks on this host"):
        recipe._check_text_kv_host()


def test_host_available_reads_a_cgroup_limit(tmp_path):
    from patches.core.runtime import host_available

    free = host_available(str(tmp_path / "none"))  # no cgroup files: MemAvailable
    assert free > 0
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("123\n")
    assert abs(host_available(str(tmp_path)) - free) < 2**30  # no limit
    (tmp_path / "memory.max").write_text(f"{2**20 + 123}\n")
    assert host_available(str(tmp_path)) == 2**20  # the limit leaves 1 MiB
    (tmp_path / "memory.current").write_text(f"{2**21}\n")
    assert host_available(str(tmp_path)) == 0  # over the limit


def _agree_rank(rank: int, world: int, out: str) -> None:
    from patches.core.runtime import agree_max

    with open(f"{out}/{rank}", "w") as fh:
        fh.write(str(agree_max([5 * 2**32, -7][rank])))


def test_the_ranks_agree_on_the_largest_shortfall(tmp_path):
    """Two gloo ranks, one 20 GiB short of host memory and one not (-7 bytes): both see 20 GiB, so both stop (byte
    counts past 2**31 kept whole)."""
    from patches.core.runtime import agree_max
    from tests.equivalence.h3_ranks import launch

    assert agree_max(-3) == -3  # no process group: its own value
    launch(_agree_rank, 2, str(tmp_path))
    assert [(tmp_path / str(r)).read_text() for r in (0, 1)] == [str(5 * 2**32)] * 2


def test_the_line_names_the_pre_pass_gpu_peak_where_measured():
    cache = K.TextKVCache(2, 4, torch.float32)
    cache.rows[(1, 2, 3)] = (0, 3)
    cache.store = torch.zeros(2, 2, 3, 4)
    assert cache.line() == "text K/V cache: 1 captions, 3 tokens, 0.0 MiB on the host, pre-pass 0.0 s"
    cache.prepass_peak_bytes = 3 * 2**30
    assert cache.line().endswith("pre-pass 0.0 s, GPU peak 3.00 GiB")


def test_sizes_print_in_gib_or_mib():
    from patches.core.units import gib_or_mib

    assert gib_or_mib(3 * 2**30) == "3.00 GiB" and gib_or_mib(2**30) == "1.00 GiB"
    assert gib_or_mib(2**30 - 2**20) == "1023.0 MiB" and gib_or_mib(0) == "0.0 MiB"


def test_every_text_an_access_can_yield_is_listed(env):  # noqa: F811
    """``SampleSource.all_text_ids`` holds the text of every access the loader makes (two epochs of the smoke data)."""
    from cosmos_framework_ext.recipe import train
    from tests.test_train import small_toml

    recipe = train.CosmosSFT(train.parse_args(["--sft-toml", str(small_toml(env))]))
    recipe.preflight()
    listed = {tuple(t) for t in recipe.source.all_text_ids()}
    seen = {tuple(recipe.source.sample(i, e).text_ids) for e in range(6) for i in range(len(recipe.source))}
    assert seen <= listed
    assert any(recipe.source.sample(i, e).caption_dropped for e in range(6) for i in range(len(recipe.source)))


def test_the_ledger_prices_the_cache_on_the_host():
    from cosmos_framework_ext.recipe import config as cfgmod
    from cosmos_framework_ext.recipe.ledger import TEXT_KV_IN_FLIGHT, cosmos_ledger

    def items(on: bool, keys=("moe_gen",), tokens=None):
        cfg = cfgmod.from_dict({"optimizer": {"keys_to_select": list(keys)}, "onecard": {"text_kv_cache": on}})
        return {i.name: i for i in cosmos_ledger(cfg, "edge", {}, text_tokens=tokens).items}

    assert "text K/V cache (lever)" not in items(False)
    assert items(True)["text K/V cache (lever)"].host_bytes == 0  # unpriced without the dataset's counts
    priced = items(True, tokens=(1000, 50))
    cache, flight = priced["text K/V cache (lever)"], priced["text K/V micro-batches in flight (lever)"]
    per_token = 28 * 2 * 8 * 128 * 2  # edge: layers x (k, v) x kv heads x head dim x bf16
    assert per_token == 112 * 1024 and cache.gpu_bytes == 0
    assert flight.gpu_bytes == 50 * per_token  # the next micro-batch's copy, on the GPU while this one trains
    assert not cache.pinned and flight.pinned  # the store is pageable, the gathered micro-batches pinned
    assert cache.host_bytes == 1000 * per_token and flight.host_bytes == TEXT_KV_IN_FLIGHT * 50 * per_token
    with pytest.raises(ValueError, match="to_k.weight trains"):
        items(True, keys=("moe_gen", "to_k"))
    cfg = cfgmod.from_dict({"optimizer": {"keys_to_select": ["moe_gen"]}, "onecard": {"text_kv_cache": True},
                            "model": {"parallelism": {"fsdp_master_dtype": "float32"}}})
    fp32_master = {i.name: i for i in cosmos_ledger(cfg, "edge", {}, text_tokens=(1000, 50)).items}
    assert fp32_master["text K/V cache (lever)"].host_bytes == 1000 * per_token  # the compute dtype's, bf16


def test_every_layer_parameter_is_the_text_or_the_vision_streams():
    """The allowlist against the model: each layer parameter the text stream alone reads is classed as text, each one
    the vision stream reads is not."""
    model, _ = R.make_model()
    names = [n for n, _ in model.named_parameters()]
    text = set(K.text_stream_params(names))
    for n in names:
        part = n.split(".", 2)[2] if n.startswith("layers.") else ""
        vision = part.startswith(("mlp_moe_gen.", "input_layernorm_moe_gen.", "post_attention_layernorm_moe_gen.",
                                  "self_attn.add_", "self_attn.to_add_out.", "self_attn.norm_added_",
                                  "self_attn.k_norm_und_for_gen."))
        if n.startswith("layers."):
            assert (n in text) != vision, n
        else:
            assert (n in text) == (n.split(".")[0] in ("embed_tokens", "norm")), n
    assert any(".mlp.up_proj." in n for n in text) and "norm.weight" in text and "norm_moe_gen.weight" not in text


def _qk_norm_model():
    """The tiny preset with a text ``norm_k`` that is an RMSNorm (``qk_norm_for_text = true``; the model then has no
    ``k_norm_und_for_gen``): the pre-pass must read the keys after ``norm_k``."""
    import dataclasses

    preset = get_preset("tiny")
    preset = dataclasses.replace(preset, transformer=dict(preset.transformer, qk_norm_for_text=True,
                                                          use_und_k_norm_for_gen=False))
    torch.manual_seed(0)
    model = build_transformer(preset)
    for n, p in model.named_parameters():
        p.requires_grad_("moe_gen" in n or "add_q_proj" in n)
    for layer in model.layers:  # norm_k away from the identity, so that reading before it would differ
        torch.nn.init.uniform_(layer.self_attn.norm_k.weight, 0.5, 1.5)
    attention.install(model)
    return model


def test_a_text_key_norm_is_read_after_it():
    stock, lever = _qk_norm_model(), _qk_norm_model()
    assert lever.layers[0].self_attn.k_norm_und_for_gen is None
    t = get_preset("tiny").transformer
    cache = K.TextKVCache(len(lever.layers), t["num_key_value_heads"] * t["head_dim"], torch.float32)
    K.use_text_kv_cache(lever, cache)
    assert _agrees(stock, lever, cache) <= RTOL


def test_the_pre_pass_sees_the_warm_started_weights(env, monkeypatch):  # noqa: F811
    """A base checkpoint whose text-stream weights differ from the seeded init: the losses with the cache equal the
    ones without (the pre-pass runs after the warm start; run before it, the cache would hold the init's keys)."""
    from cosmos_framework_ext.recipe import train
    from tests.test_train import small_toml

    torch.manual_seed(123)
    base = build_transformer(get_preset("tiny"))
    text = set(K.text_stream_params(n for n, _ in base.named_parameters()))
    state = {f"net.{k}": (v * 1.5 if k in text else v) for k, v in base.state_dict().items()}
    torch.save({"model": state}, env / "base.pt")
    monkeypatch.setenv("BASE_CHECKPOINT_PATH", str(env / "base.pt"))

    def run(value: str):
        toml = small_toml(env, **{"[onecard]\n": f"[onecard]\ntext_kv_cache = {value}\n"})
        return train.run(train.parse_args(["--sft-toml", str(toml), "--no-save"]))["losses"]

    a, b = run("false"), run("true")
    assert len(a) == len(b) > 0
    assert all(abs(x - y) <= RTOL * abs(x) for x, y in zip(a, b)), (a, b)


def test_fsdp2_at_one_rank_trains_the_same():
    """FSDP2 per decoder layer and at the root (one gloo rank, as upstream shards even one GPU): the pre-pass runs the
    sharded layers through their hooks, and the cached step agrees with the sharded stock step."""
    with R.one_rank():
        stock, _ = R.make_fsdp_model()
        lever, _ = R.make_fsdp_model()
        t = get_preset("tiny").transformer
        cache = K.TextKVCache(len(lever.layers), t["num_key_value_heads"] * t["head_dim"], torch.float32)
        K.use_text_kv_cache(lever, cache)
        worst = _agrees(stock, lever, cache)
    assert worst <= RTOL


# ------------------------------------------------------------------ the upload's stream order (CUDA, told by events)
def test_the_upload_elsewhere_is_a_plain_copy():
    cache = K.TextKVCache(2, 4, torch.float32)
    kv = torch.randn(2, 2, 5, 4)
    out = cache.upload(kv, "cpu")
    assert torch.equal(out, kv) and cache._stream is None


def _pinned_kv(value: float) -> torch.Tensor:
    """A gathered micro-batch's shape (2 layers, 1024 text tokens, kv_dim 1024), fp32 (16 MiB), pinned."""
    return torch.full((2, 2, 1024, 1024), value, pin_memory=True)


def _warm(cache: K.TextKVCache) -> None:
    """An empty allocator cache (no stale block of an earlier test), then two uploads read on the compute stream: the
    stream exists, and two blocks of an upload's size and the readers' stay cached, so no ``cudaMalloc`` comes after
    the sleeps below where the code is right (a blocking allocation would decide the order, not the code; with one
    block, the upload after a freed one still awaiting its reader would need a new one). Every pinned tensor is made
    before the sleeps too."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    outs = [cache.upload(_pinned_kv(0.0), "cuda") for _ in range(2)]
    cache.ready()  # one stream: the second copy's event covers the first
    for out in outs:
        out.double().sum()
    del out, outs
    torch.cuda.synchronize()


def _upload_done_while_compute_sleeps(cache: K.TextKVCache, cycles: int) -> bool:
    """Whether the uploaded bytes are on the GPU 0.1 s after the upload while the compute stream still sleeps: a
    third stream, which waits for nothing, reads them back (whatever stream the copy was queued on)."""
    _warm(cache)
    kv = _pinned_kv(1.0)
    back = torch.empty_like(kv).pin_memory()
    reader = torch.cuda.Stream()
    torch.cuda.synchronize()
    slept = gpu_sleep(cycles)
    out = cache.upload(kv, "cuda")
    time.sleep(0.1)
    with torch.cuda.stream(reader):
        back.copy_(out, non_blocking=True)
    reader.synchronize()
    still_sleeping(slept, cycles)
    done = torch.equal(back, kv)
    cache.ready()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), kv)  # the same bytes
    return done


class OnTheComputeStream(K.TextKVCache):
    """Planted: the copy queued on the compute stream, behind its work (the path before the side stream)."""

    def upload(self, kv, device):
        if self._stream is None:
            self._stream = torch.cuda.current_stream()
        return kv.to(device, non_blocking=True)


def _cache(cls: type[K.TextKVCache] = K.TextKVCache) -> Callable[[], K.TextKVCache]:
    return lambda: cls(2, 1024, torch.float32, pin=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side stream")
def test_cuda_the_upload_overlaps_the_compute_streams_queued_work():
    assert rehearsed(_upload_done_while_compute_sleeps, _cache())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side stream")
def test_cuda_planted_upload_on_the_compute_stream_is_told_by_the_bytes():
    assert not rehearsed(_upload_done_while_compute_sleeps, _cache(OnTheComputeStream))


def _sum_after_a_slow_copy(cache: K.TextKVCache, cycles: int) -> tuple[float, float]:
    """The copy queued behind 0.5 s on the cache's stream, then :meth:`TextKVCache.ready` and a compute-stream kernel
    reading the upload; returns (what it read, what it should read)."""
    _warm(cache)
    kv = _pinned_kv(3.0)
    slept = gpu_sleep(cycles, cache._stream)
    out = cache.upload(kv, "cuda")
    cache.ready()
    total = out.double().sum()
    still_sleeping(slept, cycles)
    return total.item(), 3.0 * kv.numel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side stream")
def test_cuda_the_compute_stream_waits_for_the_copy():
    got, want = rehearsed(_sum_after_a_slow_copy, _cache())
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side stream")
def test_cuda_planted_no_wait_for_the_copy_is_detected(monkeypatch):
    monkeypatch.setattr(torch.cuda.Stream, "wait_event", lambda self, event: None)
    got, want = rehearsed(_sum_after_a_slow_copy, _cache())
    assert got != want


class _ReadsV(torch.nn.Module):
    """A stand-in decoder layer: returns ``gen + sum(v)`` of the values handed to it in the rotary tuple."""

    def __init__(self):
        super().__init__()
        self.self_attn = type("Attn", (), {"num_key_value_heads": 8, "head_dim": 128})()

    def forward(self, und, gen, rot):
        return und, gen + rot[5].double().sum()


class _Stack(torch.nn.Module):
    """The part of a Cosmos3 transformer :func:`use_text_kv_cache` wraps: ``layers`` and ``_run_decoder_stack``."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_ReadsV(), _ReadsV()])
        self.gradient_checkpointing = False
        self.norm_moe_gen = torch.nn.Identity()

    def _run_decoder_stack(self, und_seq, gen_seq, rotary_emb):
        raise AssertionError("the stock stack ran with the cache's K/V installed")


def _stack_read_after_a_slow_copy(cache: K.TextKVCache, cycles: int) -> tuple[float, float]:
    """The wrapped stack run at once after an upload whose copy is queued behind 0.5 s; returns (what its layers read,
    what they should read)."""
    model = _Stack()
    K.use_text_kv_cache(model, cache)
    _warm(cache)
    kv = _pinned_kv(2.0)
    und = torch.zeros(1024, 1, device="cuda")
    gen = torch.zeros((), dtype=torch.float64, device="cuda")
    torch.cuda.synchronize()
    slept = gpu_sleep(cycles, cache._stream)
    cache.current = cache.upload(kv, "cuda")
    _, out = model._run_decoder_stack(und, gen, (None,) * 4)
    cache.current = None
    still_sleeping(slept, cycles)
    return out.item(), 2.0 * kv[:, 1].numel()


def test_the_stand_in_stack_reads_the_values_on_the_cpu():
    """The stand-in stack above, on the CPU: each layer reads its own values (the CUDA test's arithmetic)."""
    model = _Stack()
    cache = K.TextKVCache(2, 1024, torch.float32)
    K.use_text_kv_cache(model, cache)
    cache.current = torch.full((2, 2, 1024, 1024), 2.0)
    _, out = model._run_decoder_stack(torch.zeros(1024, 1), torch.zeros((), dtype=torch.float64), (None,) * 4)
    assert out.item() == 2.0 * cache.current[:, 1].numel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side stream")
def test_cuda_the_decoder_stack_waits_for_the_copy():
    got, want = rehearsed(_stack_read_after_a_slow_copy, _cache())
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side stream")
def test_cuda_planted_stack_without_waiting_is_detected(monkeypatch):
    monkeypatch.setattr(K.TextKVCache, "ready", lambda self: None)
    got, want = rehearsed(_stack_read_after_a_slow_copy, _cache())
    assert got != want


def _reused_block_read(cache: K.TextKVCache, cycles: int) -> tuple[float, float]:
    """An upload read by a compute kernel queued behind 0.5 s, freed at once, then the next upload of the same size
    (where the freed block is reusable at once, as without ``record_stream``, the allocator hands it out: of equal
    free blocks the lowest address); returns (what the kernel read, what it should read)."""
    _warm(cache)
    first = _pinned_kv(7.0)
    second = _pinned_kv(1.0)
    out = cache.upload(first, "cuda")
    cache.ready()
    total = torch.zeros((), dtype=torch.float64, device="cuda")
    torch.cuda.synchronize()
    slept = gpu_sleep(cycles)
    total += out.sum(dtype=torch.float64)  # queued behind the sleep; reads out's block (no new allocation after it)
    del out  # freed while its reader is still queued
    cache.upload(second, "cuda")  # its copy runs at once on the cache's stream, into the other warm block if right
    cache.ready()
    still_sleeping(slept, cycles)
    return total.item(), 7.0 * first.numel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side stream")
def test_cuda_a_freed_upload_is_not_overwritten_before_its_last_reader():
    got, want = rehearsed(_reused_block_read, _cache())
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side stream")
def test_cuda_planted_no_record_stream_is_detected(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    got, want = rehearsed(_reused_block_read, _cache())
    assert got != want


class FromTheComputePool(K.TextKVCache):
    """Planted: the device tensor allocated on the compute stream (its pool), the copy on the side stream."""

    def upload(self, kv, device):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        out = torch.empty(kv.shape, dtype=kv.dtype, device=device)
        with torch.cuda.stream(self._stream):
            out.copy_(kv, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        self._copied = (torch.device(device), copied)
        out.record_stream(torch.cuda.current_stream())
        return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side stream")
def test_cuda_planted_upload_from_the_compute_pool_is_detected():
    got, want = rehearsed(_reused_block_read, _cache(FromTheComputePool))
    assert got != want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the GPU's peak statistics")
def test_cuda_the_pre_pass_peak_is_its_own():
    """The pre-pass's peak is measured from its own start (a larger earlier peak is not reported) and is the peak:
    a transient 256 MiB allocated and freed inside its forward (a hook on the first layer) is in it, though nothing of
    it stays allocated after the pre-pass."""
    model, _ = R.make_model(device="cuda")
    t = get_preset("tiny").transformer
    cache = K.TextKVCache(len(model.layers), t["num_key_value_heads"] * t["head_dim"], torch.float32)
    K.use_text_kv_cache(model, cache)
    transient = 256 * 2**20

    in_use = []

    def transient_in_the_forward(*_):
        in_use.append(torch.cuda.memory_allocated())
        torch.empty(transient, dtype=torch.uint8, device="cuda")  # allocated and freed at once

    model.layers[0].register_forward_hook(transient_in_the_forward)
    earlier = torch.empty(2**30, dtype=torch.uint8, device="cuda")  # 1 GiB, freed before the pre-pass
    del earlier
    texts = [t for n in N_SAMPLES for t in _texts(n)]
    inputs = functools.partial(attention.prepass_inputs, model.config, dtype=torch.float32,
                               device=torch.device("cuda"), impl="dense")
    assert cache.fill(model, model.layers[0].self_attn.processor, texts, inputs) > 0
    peak = cache.prepass_peak_bytes
    assert peak is not None and peak < 2**30
    assert in_use and peak >= max(in_use) + transient  # the memory in use when the transient came, plus it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the GPU's peak statistics")
def test_cuda_planted_peak_read_after_the_pre_pass_is_detected(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", torch.cuda.memory_allocated)
    with pytest.raises(AssertionError):
        test_cuda_the_pre_pass_peak_is_its_own()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the GPU's peak statistics")
def test_cuda_planted_peak_not_reset_is_detected(monkeypatch):
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    with pytest.raises(AssertionError):
        test_cuda_the_pre_pass_peak_is_its_own()
