"""Low-RAM fast init (:mod:`miles_ext.levers.fast_init`): what the meta build + per-tensor materialisation
into the final storage equals, and its host peak.

Claims (CPU, gloo ranks, the tiny H3 preset with LoRA rank 4, bf16 master as the trainer stores it):

- **Checkpoint** (2 ranks, so the 1-D shards of odd-sized tensors are uneven and each rank reads only its rows): a
  diffusers-layout safetensors checkpoint, sharded with an index json, streamed into a partially resident model (1
  of 4 blocks resident, the others in the exact pinned arena) gives every base parameter **bitwise** equal to, and in
  the same dtype as, ``MiniMaxH3Transformer3DModel.from_pretrained(..., torch_dtype=bf16)`` of the same files (the
  ``_keep_in_fp32_modules`` fp32); the rope buffer too; the single-file layout under a pipeline's ``transformer/``
  as well. The LoRA adapters equal ``attach_lora`` on a real model from the same seed.
- **Random init**: the base equals :func:`reference_random_init` (below) (the same per-parameter
  generators applied to a fully built, unsharded model) **bitwise**, whatever the fill order (module order in one
  thread, reversed order in two threads) and placement (fully offloaded or partially resident). It does *not* equal
  the old constructor init (global RNG); asserted, so that the README's wording stays true.
- **Host peak** (1 rank, a mid-size preset of 147 M parameters, 0.3 GB bf16, fully offloaded into the arena): the
  peak RSS during init (``VmHWM`` after resetting it, ``/proc/self/clear_refs``) exceeds the RSS before init by at
  most 1.05 x the steady growth (RSS after init minus before, checked to be the arena's bytes). The same check fails
  for the old path (build the real model on the host, then FSDP2 + the arena copy it), which holds two copies at
  once (and whose RSS after init stays at the peak: glibc keeps the freed copy).

Planted bugs, each shown to be caught: every rank reading rows from 0 (not its own offset); keep-fp32 parameters
cast through bf16; one generator shared by all parameters (order-dependent values); the full-model host copy.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from miles_ext.levers.fast_init import RandomInit, diffusers_name
from miles_ext.recipe.presets import H3_LORA_TARGETS, meta_transformer

from tests.equivalence.h3_ranks import cpu_mesh, launch

RANK, ALPHA, SEED, LORA_SEED = 4, 8, 11, 7


def _build(source, *, resident=None, order=None, threads=1, preset="tiny"):
    """Meta build + LoRA + FSDP2 (CPU offload, exact arena) + materialise from ``source``."""
    from miles_ext.levers import fast_init
    from miles_ext.levers.fsdp_policy import apply_fsdp2, set_master_dtype

    model = meta_transformer(preset)
    torch.manual_seed(LORA_SEED)
    fast_init.attach_lora_materialised(model, rank=RANK, alpha=ALPHA, target_modules=H3_LORA_TARGETS)
    set_master_dtype(model, torch.bfloat16)
    apply_fsdp2(model, cpu_offload=True, mesh=cpu_mesh(), param_dtype=None, resident=resident,
                adapters_on_device=resident is not None, exact_pin=True)
    if order == "reversed":
        names = [fast_init.diffusers_name(n) for n, _ in model.named_parameters() if "lora_" not in n]
        order = names[::-1]
    fast_init.materialise(model, source, order=order, threads=threads)
    return model


def _full(model) -> dict[str, torch.Tensor]:
    from miles_ext.levers.fast_init import diffusers_name

    return {diffusers_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _real_reference(source=None):
    """A fully built tiny model (LoRA from LORA_SEED, bf16 master) -- with ``source``: reference_random_init."""
    from miles_ext.levers.fsdp_policy import set_master_dtype
    from miles_ext.levers.lora import attach_lora
    from miles_ext.recipe.presets import build_transformer

    torch.manual_seed(0)
    model = build_transformer("tiny")
    torch.manual_seed(LORA_SEED)
    attach_lora(model, rank=RANK, alpha=ALPHA, target_modules=H3_LORA_TARGETS)
    set_master_dtype(model, torch.bfloat16)
    if source is not None:
        reference_random_init(model, source)
    return model


def _worker(rank: int, world: int, out_dir: str) -> None:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

    from miles_ext.levers import fast_init
    from miles_ext.recipe.presets import build_transformer

    out = Path(out_dir)
    if rank == 0:
        torch.manual_seed(SEED)
        ckpt = build_transformer("tiny")
        ckpt.save_pretrained(out / "ck", max_shard_size="100KB")  # several files + index json
        ckpt.save_pretrained(out / "pipe" / "transformer")  # one file, pipeline layout
    torch.distributed.barrier()
    res: dict = {}
    ref = MiniMaxH3Transformer3DModel.from_pretrained(out / "ck", torch_dtype=torch.bfloat16)
    res["diffusers"] = {n: p.detach() for n, p in ref.named_parameters()}
    res["diffusers_buffers"] = {n: b for n, b in ref.named_buffers()}
    m = _build(fast_init.CheckpointInit(out / "ck"), resident=[1])
    res["ckpt"] = _full(m)
    res["ckpt_buffers"] = {n: b.cpu() for n, b in m.named_buffers()}
    res["ckpt_pipe"] = _full(_build(fast_init.CheckpointInit(out / "pipe"), resident=[1]))

    class FromRowZero(fast_init.CheckpointInit):  # planted: every rank reads rows from 0
        def read_rows(self, name, start, length):
            return super().read_rows(name, 0, length)

    class KeepThroughBf16(fast_init.CheckpointInit):  # planted: keep-fp32 parameters rounded through bf16
        def read_rows(self, name, start, length):
            return super().read_rows(name, start, length).to(torch.bfloat16)

    res["bug_row_zero"] = _full(_build(FromRowZero(out / "ck"), resident=[1]))
    res["bug_keep_bf16"] = _full(_build(KeepThroughBf16(out / "ck"), resident=[1]))
    lora_ref = _real_reference()
    res["lora_ref"] = {n: p.detach() for n, p in lora_ref.named_parameters() if "lora_" in n}
    res["old_init"] = {n: p.detach() for n, p in lora_ref.named_parameters() if "lora_" not in n}

    src = fast_init.RandomInit(SEED, draw_device="cpu")
    res["random_ref"] = {fast_init.diffusers_name(n): p.detach()
                         for n, p in _real_reference(src).named_parameters()}
    res["random_offload"] = _full(_build(src))
    res["random_partial_reversed"] = _full(_build(src, resident=[0, 2], order="reversed", threads=2))

    @dataclasses.dataclass(frozen=True)
    class SharedGenerator(fast_init.RandomInit):  # planted: one stream for all parameters, order-dependent
        def generator(self, name, device):
            if not hasattr(SharedGenerator, "_g"):
                SharedGenerator._g = torch.Generator(device).manual_seed(self.seed)
            return SharedGenerator._g

    res["bug_shared_generator"] = _full(_build(SharedGenerator(SEED, draw_device="cpu"), order="reversed"))
    if rank == 0:
        torch.save(res, out / "init.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("h3init")
    launch(_worker, 2, str(out))
    return torch.load(out / "init.pt", weights_only=False)


def differs(got: dict, want: dict) -> list[str]:
    """Names whose tensors differ in dtype, shape or any bit (base parameters of ``want``)."""
    return [k for k in want if k not in got or got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]


def test_checkpoint_stream_equals_diffusers_from_pretrained_bitwise(results):
    want = results["diffusers"]
    assert not differs(results["ckpt"], want) and not differs(results["ckpt_pipe"], want)
    assert {v.dtype for v in want.values()} == {torch.bfloat16, torch.float32}  # keep-fp32 modules present
    assert results["ckpt_buffers"].keys() == results["diffusers_buffers"].keys()
    assert all(torch.equal(results["ckpt_buffers"][k], v) for k, v in results["diffusers_buffers"].items())
    lora = {k: v for k, v in results["ckpt"].items() if "lora_" in k}
    assert lora.keys() == results["lora_ref"].keys() and not differs(lora, results["lora_ref"])


def test_checkpoint_check_catches_planted_bugs(results):
    want = results["diffusers"]
    assert differs(results["bug_row_zero"], want)  # rank 1's rows read from row 0
    bad = differs(results["bug_keep_bf16"], want)
    assert bad and all(want[k].dtype == torch.float32 for k in bad)  # only the keep-fp32 modules


def test_random_init_equals_reference_in_any_order_and_placement(results):
    want = results["random_ref"]
    assert not differs(results["random_offload"], want)
    assert not differs(results["random_partial_reversed"], want)
    base = [k for k in want if "lora_" not in k]
    assert differs({k: results["random_offload"][k] for k in base}, results["old_init"])  # not the old init
    assert differs(results["bug_shared_generator"], want)  # planted: order-dependent stream



def test_random_init_fill_is_the_constructors_own_init_on_the_same_generator():
    """:meth:`RandomInit.fill` draws as the owner's own constructor does: for ``nn.Linear(5, 3)`` (fan_in 5 !=
    fan_out 3) the weight then the bias filled from one generator equal ``nn.Linear``'s ``reset_parameters`` from
    the global RNG seeded alike (``kaiming_uniform_(a=sqrt(5))``, bias ``U(-1/sqrt(5), 1/sqrt(5))``), bitwise; norm
    weights are ones and biases zeros as a fresh ``LayerNorm`` / ``RMSNorm`` holds them; another parameter is
    refused by name."""
    import math

    src = RandomInit(SEED, draw_device="cpu")
    torch.manual_seed(123)
    ref = nn.Linear(5, 3)
    g = torch.Generator("cpu").manual_seed(123)
    w, b = torch.empty(3, 5), torch.empty(3)
    src.fill("x.weight", ref, "weight", w, g)
    src.fill("x.bias", ref, "bias", b, g)
    assert torch.equal(w, ref.weight) and torch.equal(b, ref.bias)
    g = torch.Generator("cpu").manual_seed(5)
    want = torch.empty(3, 5)
    nn.init.kaiming_uniform_(want, a=math.sqrt(5), generator=torch.Generator("cpu").manual_seed(5))
    src.fill("x.weight", ref, "weight", w, g)
    assert torch.equal(w, want)
    for norm in (nn.LayerNorm(4), nn.RMSNorm(4)):
        for attr, stock in norm.named_parameters():
            got = torch.full((4,), 7.0)
            src.fill(f"n.{attr}", norm, attr, got, torch.Generator("cpu").manual_seed(0))
            assert torch.equal(got, stock.detach()), (type(norm).__name__, attr)
    with pytest.raises(ValueError, match="emb.weight: no seeded initialiser for Embedding.weight"):
        src.fill("emb.weight", nn.Embedding(3, 2), "weight", torch.empty(3, 2), torch.Generator("cpu"))


def test_random_init_seeds_each_parameter_by_name():
    """Each parameter's generator is seeded ``stable_hash("h3-init", seed, name)`` (the module docstring): draws equal
    a generator seeded so by hand, and differ between two names and between two run seeds."""
    from patches.core.runtime import stable_hash

    cpu = torch.device("cpu")

    def draw(gen):
        return torch.rand(8, generator=gen)

    q, k = "blocks.0.attn.to_q.weight", "blocks.0.attn.to_k.weight"
    src = RandomInit(SEED, draw_device="cpu")
    assert torch.equal(draw(src.generator(q, cpu)),
                       draw(torch.Generator("cpu").manual_seed(stable_hash("h3-init", SEED, q))))
    assert not torch.equal(draw(src.generator(q, cpu)), draw(src.generator(k, cpu)))
    assert not torch.equal(draw(src.generator(q, cpu)), draw(RandomInit(SEED + 1).generator(q, cpu)))


@pytest.mark.parametrize("rows, world", [(5, 2), (5, 4), (7, 3), (4, 4), (3, 1)])
def test_shard_rows_follow_torch_chunk(rows, world):
    """A rank's (full shape, first row, rows) are those of its piece of ``torch.chunk(full, world)`` along dim 0
    (FSDP2's sharding): pieces of ceil(rows / world) rows, a rank past the last piece holding 0 rows at the end."""
    from types import SimpleNamespace

    from miles_ext.levers.fast_init import _shard_rows

    full = torch.arange(rows * 2).view(rows, 2)
    pieces = list(torch.chunk(full, world))
    start = 0
    for rank in range(world):
        piece = pieces[rank] if rank < len(pieces) else full[rows:]
        fp = SimpleNamespace(_orig_size=torch.Size(full.shape), sharded_param=SimpleNamespace(_local_tensor=piece),
                             mesh_info=SimpleNamespace(shard_mesh_size=world, shard_mesh_rank=rank))
        assert _shard_rows(fp) == ((rows, 2), start, piece.shape[0]), rank
        start += piece.shape[0]



def _fake_shard(full_shape, world: int, rank: int):
    """What ``_fill_one`` reads of an FSDP2 parameter: the full size, this rank's empty local shard (its piece of
    ``torch.chunk`` along dim 0) and the mesh position."""
    from types import SimpleNamespace

    local = torch.empty_like(torch.chunk(torch.empty(full_shape), world)[rank])
    return SimpleNamespace(_orig_size=torch.Size(full_shape), sharded_param=SimpleNamespace(_local_tensor=local),
                           mesh_info=SimpleNamespace(shard_mesh_size=world, shard_mesh_rank=rank))


@pytest.mark.parametrize("world", [1, 2])
def test_fill_one_writes_each_ranks_rows_of_the_full_parameter(world, tmp_path):
    """Each rank's shard holds ITS rows of the full parameter: for a random init, of the full ``nn.Linear(3, 5)``
    weight drawn by ``kaiming_uniform_(a=sqrt(5))`` from the generator seeded ``stable_hash("h3-init", seed,
    name)`` (drawn at the full shape, not the shard's); for a checkpoint, rows ``[start, start + n)`` of the stored
    tensor. Expected: ``torch.chunk(full, world)[rank]``."""
    import math

    from safetensors.torch import save_file

    from miles_ext.levers.fast_init import WEIGHTS, CheckpointInit, _fill_one
    from patches.core.runtime import stable_hash

    name, owner = "blocks.0.ff.weight", nn.Linear(3, 5)
    full = torch.empty(5, 3)
    nn.init.kaiming_uniform_(full, a=math.sqrt(5),
                             generator=torch.Generator("cpu").manual_seed(stable_hash("h3-init", SEED, name)))
    stored = torch.arange(15, dtype=torch.float32).view(5, 3)
    save_file({name: stored}, str(tmp_path / WEIGHTS))
    for rank in range(world):
        fp = _fake_shard((5, 3), world, rank)
        assert _fill_one(RandomInit(SEED, draw_device="cpu"), name, owner, "weight", fp) == \
            fp.sharded_param._local_tensor.numel() * 4
        assert torch.equal(fp.sharded_param._local_tensor, torch.chunk(full, world)[rank]), rank
        fp = _fake_shard((5, 3), world, rank)
        _fill_one(CheckpointInit(tmp_path), name, owner, "weight", fp)
        assert torch.equal(fp.sharded_param._local_tensor, torch.chunk(stored, world)[rank]), rank


# --------------------------------------------------------------------------------------------- host peak
MID = dict(num_attention_heads=8, attention_head_dim=128, hidden_size=1024, num_layers=6, ffn_dim=4096,
           time_embed_hidden_dim=256, time_embed_dim=256)
"""A mid-size H3 (147 M parameters, 0.29 GB bf16): big enough that the check's 5 % is ~15 MB."""


def _status(field: str) -> int:
    from patches.core.runtime import proc_status_kib

    return proc_status_kib((field,))[field] * 1024


def _peak_of(init) -> dict[str, int]:
    """RSS before, peak during (VmHWM reset first) and after ``init()``, which returns the model (kept alive)."""
    import gc

    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current RSS
    model = init()
    from miles_ext.levers.pinned import pinned_report

    out = {"before": before, "peak": _status("VmHWM"), "after": _status("VmRSS"),
           "arena": pinned_report(model).arena_bytes}
    del model
    gc.collect()
    return out


def _peak_worker(rank: int, world: int, out_dir: str) -> None:
    from miles_ext.levers import fast_init
    from miles_ext.levers.fsdp_policy import apply_fsdp2
    from miles_ext.levers.lora import attach_lora
    from miles_ext.recipe.presets import TINY, build_transformer

    mid = dataclasses.replace(TINY, name="mid", **MID)

    def fast():
        return _build(fast_init.RandomInit(SEED, draw_device="cpu"), preset=mid)

    def old_path():  # planted: the whole model materialised on the host, then FSDP2 + the arena copy it
        torch.manual_seed(0)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = build_transformer(mid)
        finally:
            torch.set_default_dtype(prev)
        attach_lora(model, rank=RANK, alpha=ALPHA, target_modules=H3_LORA_TARGETS)
        apply_fsdp2(model, cpu_offload=True, mesh=cpu_mesh(), param_dtype=None, master_dtype="bf16", exact_pin=True)
        return model

    _peak_of(fast)  # warm-up: first-use allocations (FSDP2, PEFT) are not the init's
    torch.save({"fast": _peak_of(fast), "old": _peak_of(old_path)}, Path(out_dir) / "peak.pt")


def within(m: dict[str, int], steady: int, tol: float = 0.05) -> bool:
    """The host target, on the init's own growth: ``peak - before <= (1 + tol) * steady``, ``steady`` the growth
    the model's final storage needs (the fast path's RSS after init minus before: the arena, measured). Not the old
    path's own RSS after init: the allocator keeps the freed full-model copy mapped, inflating its "steady" state."""
    return m["peak"] - m["before"] <= (1 + tol) * steady


def test_host_peak_during_init_is_within_five_percent_of_steady(tmp_path):
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pytest.skip("cannot reset VmHWM here (/proc/self/clear_refs)")
    launch(_peak_worker, 1, str(tmp_path))
    m = torch.load(tmp_path / "peak.pt")
    steady = m["fast"]["after"] - m["fast"]["before"]
    assert abs(steady - m["fast"]["arena"]) <= 0.05 * m["fast"]["arena"], m  # steady = the arena (0.29 GB), filled
    assert within(m["fast"], steady), m
    assert not within(m["old"], steady), m  # the planted full-model host copy is caught
    assert m["old"]["peak"] - m["old"]["before"] > 1.5 * steady, m


def reference_random_init(model: nn.Module, source: RandomInit) -> nn.Module:
    """The claim :class:`RandomInit` is tested against: every base parameter of a fully built (unsharded, real)
    ``model`` overwritten, in place, with :meth:`RandomInit.fill` from its own generator, drawn on the source's
    device in the parameter's dtype. Returns ``model``."""
    modules = dict(model.named_modules())
    device = source.device()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                continue
            owner_name, _, attr = name.rpartition(".")
            tmp = torch.empty(p.shape, dtype=p.dtype, device=device)
            source.fill(diffusers_name(name), modules[owner_name], attr, tmp, source.generator(diffusers_name(name),
                                                                                               device))
            p.copy_(tmp)
    return model

