"""``benchmarks/edge_24gb.py`` runs end to end as a CPU smoke (tiny preset), and its model-FLOPs formula is the
one its docstring derives (checked by hand on a small case)."""

from __future__ import annotations

import json

import pytest

from benchmarks.checks import result_stem


@pytest.fixture(scope="module")
def bench(edge_bench):
    return edge_bench


def test_model_flops_by_hand(bench):
    p = {"und": 10, "gen": 20, "und_train": 0, "gen_train": 20, "layers": 2, "d_attn": 4}
    # text: forward only (2 * 10 per token); vision: fwd + activation grads + weight grads (6 * 20 per token)
    linear = 3 * 2 * 10 + 5 * 6 * 20
    # text queries causal (3 * 4 / 2 pairs), vision queries see all 3 + 5 keys; fwd 4 d per pair, bwd 8 d
    attn = 2 * 4 * (4 * 3 * 4 / 2 + 12 * 5 * 8)
    assert bench.model_flops([(3, 5)], p) == linear + attn
    frozen = dict(p, gen_train=0)  # nothing trainable: forward only
    assert bench.model_flops([(3, 5)], frozen) == 3 * 2 * 10 + 5 * 2 * 20 + 2 * 4 * (4 * 3 * 4 / 2 + 4 * 5 * 8)


def test_edge_pathways_split_the_tower(bench):
    p = bench.pathway_params("tiny", ["moe_gen", "time_embedder", "vae2llm", "llm2vae", "k_norm_und_for_gen"])
    assert p["und_train"] == 0 and p["gen_train"] == p["gen"] > 0 and p["und"] > 0


def test_smoke_run_writes_the_table(bench, tmp_path, edge_smoke_env):
    only = "stock (uncapped card),+ latent cache"
    assert bench.main(["--smoke", "--steps", "2", "--grad-accum", "1", "--only", only, "--out", str(tmp_path)]) == 0
    stem = result_stem("cosmos", "edge24gb", "cpu", smoke=True)  # a smoke never writes a GPU result's name
    rows = json.loads((tmp_path / f"{stem}.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok", "ok"]
    stock, cached = rows
    assert stock["prepass"] is None and cached["prepass"]["misses"] == cached["prepass"]["entries"] > 0
    assert cached["prepass_s"] > 0 and all(r["s_per_sample"] > 0 and r["model_tflop_per_s"] > 0 for r in rows)
    assert all(len(r["micro_batch_s"]) == 1 and r["micro_batch_s"][0] > 0 for r in rows)  # step 2 of 2 (ga 1)
    assert all(len(r["tokens_per_micro_batch"]) == len(r["micro_batch_s"]) for r in rows)  # index for index
    assert all(len(r["losses"]) == 2 and all(x > 0 for x in r["losses"]) for r in rows)  # every step's, warm-up too
    assert all(r["host_rss_save_gib"] > 0 and r["checkpoint_gb"] > 0 for r in rows)  # each row saved once...
    assert not list(tmp_path.rglob("iter_*.pt"))  # ...and deleted its checkpoint
    md = (tmp_path / f"{stem}.md").read_text()
    assert "| + latent cache | ok |" in md and "s/sample" in md and "MFU" in md and "through the save" in md
    assert bench.main(["--smoke", "--grad-accum", "1", "--only", "nonesuch", "--out", str(tmp_path)]) == 2
    assert bench.main(["--grad-accum", "4", "--smoke", "--steps", "1", "--out", str(tmp_path)]) == 2


def test_save_host_is_the_checkpoint_phase_above_the_rest(bench, tmp_path):
    ckpt = tmp_path / "iter_000000003.pt"
    ckpt.write_bytes(bytes(1000))
    g = 1 << 30
    s = {"memory": {"phases": {"checkpoint": {"host_rss_bytes": 5 * g}, "forward": {"host_rss_bytes": 3 * g},
                               "optimizer": {"host_rss_bytes": 4 * g}}}, "checkpoint": str(ckpt)}
    assert bench.save_host(s) == {"host_rss_save_gib": 5.0, "host_rss_train_gib": 4.0, "save_adds_host_gib": 1.0,
                                  "checkpoint_gb": 1e-6}
    assert not ckpt.exists()
    assert bench.save_host({"memory": {"phases": {}}, "checkpoint": None})["save_adds_host_gib"] is None


def test_compiled_configuration_turns_the_embedded_compile_on(bench, tmp_path):
    """``[model.compile] enabled`` alone leaves the embedded trainer eager (``[onecard] compile_blocks`` defaults to
    false until the compiled path has run on a GPU): the benchmark's compiled row must set both."""
    from cosmos_framework_ext.recipe.config import load as load_sft_config

    by_name = {c.name: c for c in bench.CONFIGS}
    on = load_sft_config(bench.recipe_toml(by_name["all levers"], 8, 3, tmp_path))
    off = load_sft_config(bench.recipe_toml(by_name["levers 1+2"], 8, 3, tmp_path))
    assert on.model.compile.enabled and on.onecard.compile_blocks
    assert not off.model.compile.enabled and not off.onecard.compile_blocks


def test_each_rows_onecard_keys_reach_its_toml(bench, tmp_path):
    """Every ``[onecard]`` setting a row names is in the TOML it runs (0 checkpointed layers is a setting too)."""
    from cosmos_framework_ext.recipe.config import load as load_sft_config

    rows = {c.name: c for c in bench.CONFIGS + bench.OPTIONAL}
    fastest = "all levers + optimizer-state streaming + selective AC + fewer checkpointed layers"
    cfg = load_sft_config(bench.recipe_toml(rows[fastest], 8, 3, tmp_path, "0"))
    o = cfg.onecard
    assert (o.compile_blocks, o.checkpoint_layers, o.host_embeddings, o.compile_wrapper) == (True, 0, False, "python")
    assert not o.detach_text_stream
    o = load_sft_config(bench.recipe_toml(rows[fastest + " + C++ wrapper"], 8, 3, tmp_path, "0")).onecard
    assert (o.compile_blocks, o.checkpoint_layers, o.host_embeddings, o.compile_wrapper) == (True, 0, False, "cpp")
    o = load_sft_config(bench.recipe_toml(rows[fastest + " + text stream detached"], 8, 3, tmp_path, "0")).onecard
    assert (o.compile_blocks, o.checkpoint_layers, o.detach_text_stream, o.compile_wrapper) == (True, 0, True, "python")
    twelve = load_sft_config(bench.recipe_toml(rows[next(n for n in rows if n.startswith("12 GB"))], 8, 3, tmp_path))
    assert twelve.onecard.host_embeddings and twelve.onecard.checkpoint_layers == "all"
    assert load_sft_config(bench.recipe_toml(rows[fastest], 8, 3, tmp_path, "auto")).onecard.checkpoint_layers == "auto"


def test_the_offloaded_rows_set_their_layers(bench, tmp_path):
    from cosmos_framework_ext.recipe.config import load as load_sft_config

    rows = {c.name: c for c in bench.CONFIGS + bench.OPTIONAL}
    offloaded = [n for n in rows if n.endswith("+ activations offloaded")]
    assert len(offloaded) == 2 and bench.OFFLOADED_LAYERS == 4
    for name in offloaded:
        o = load_sft_config(bench.recipe_toml(rows[name], 8, 3, tmp_path)).onecard
        assert o.offload_layers == 4 and o.checkpoint_layers == "auto" and o.detach_text_stream
        assert load_sft_config(bench.recipe_toml(rows[name], 8, 3, tmp_path, "", 6)).onecard.offload_layers == 6
    plain = rows[offloaded[0].removesuffix(" + activations offloaded")]
    assert load_sft_config(bench.recipe_toml(plain, 8, 3, tmp_path, "", 6)).onecard.offload_layers == 0  # not read
    assert bench.layers_cell({"checkpoint_layers": 21, "offload": {"layers": 4}}) == "17 + 4 offloaded"
    assert bench.layers_cell({"checkpoint_layers": 21, "offload": None}) == "21"
    assert bench.layers_cell({}) == "–"


def test_smoke_offloaded_row(bench, tmp_path, edge_smoke_env):
    name = "all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached " \
        "+ activations offloaded"
    assert bench.main(["--smoke", "--steps", "2", "--grad-accum", "1", "--only", name, "--out", str(tmp_path)]) == 0
    stem = result_stem("cosmos", "edge24gb", "cpu", smoke=True)
    row, = json.loads((tmp_path / f"{stem}.json").read_text())["rows"]
    assert row["status"] == "ok" and row["checkpoint_layers"] == 2 and row["offload"]["layers"] == 1  # the smoke: 1
    assert row["offload"]["tensors_per_micro_batch"] > 0 and row["offload"]["bytes_per_micro_batch"] > 0  # copies ran
    assert "| 1 + 1 offloaded |" in (tmp_path / f"{stem}.md").read_text()


def test_reserved_by_stream_sums_the_segments_per_stream(bench, monkeypatch):
    """The allocator's segments summed per stream, the default stream named, side streams numbered in order of
    their id, largest reservation first."""
    gib = 1 << 30
    segs = [{"stream": 0, "total_size": 2 * gib, "allocated_size": gib},
            {"device": 1, "stream": 0, "total_size": 9 * gib, "allocated_size": 9 * gib},  # another card: not counted
            {"stream": 77, "total_size": 7 * gib // 2, "allocated_size": 0},
            {"stream": 0, "total_size": gib, "allocated_size": gib // 2},
            {"stream": 55, "total_size": gib // 4, "allocated_size": gib // 4}]
    monkeypatch.setattr(bench.torch.cuda, "memory_snapshot", lambda: segs)
    monkeypatch.setattr(bench.torch.cuda, "current_device", lambda: 0)
    assert bench.reserved_by_stream() == [
        {"stream": "side 2", "reserved_gib": 3.5, "allocated_gib": 0.0},
        {"stream": "default", "reserved_gib": 3.0, "allocated_gib": 1.5},
        {"stream": "side 1", "reserved_gib": 0.25, "allocated_gib": 0.25}]


def test_smoke_several_checkpoint_layers_in_one_process(bench, tmp_path, edge_smoke_env):
    """``--checkpoint-layers 2,1``: the row that reads it runs once per value, named by it; a row that does not read
    it runs once."""
    fewer = "all levers + optimizer-state streaming + selective AC + fewer checkpointed layers"
    assert bench.main(["--smoke", "--steps", "2", "--grad-accum", "1", "--only", f"+ latent cache,{fewer}",
                       "--checkpoint-layers", "2,1", "--out", str(tmp_path)]) == 0
    stem = result_stem("cosmos", "edge24gb", "cpu", smoke=True)
    rows = json.loads((tmp_path / f"{stem}.json").read_text())["rows"]
    assert [(r["config"], r["status"], r["checkpoint_layers"]) for r in rows] == [
        ("+ latent cache", "ok", 2), (f"{fewer} (checkpoint_layers 2)", "ok", 2),
        (f"{fewer} (checkpoint_layers 1)", "ok", 1)]


def test_pinned_allocator_reads_the_growth_counters(bench, monkeypatch):
    """The pinned allocator's block count and its CUDA call time (µs in torch's statistics, ms in the row), and the
    difference of two readings; ``None`` where torch has no host statistics or a reading is missing."""
    stats = {"num_host_alloc": 3, "host_alloc_time.total": 2500, "num_host_free": 9}
    monkeypatch.setattr(bench.torch.cuda, "host_memory_stats", lambda: dict(stats), raising=False)
    before = bench.pinned_allocator()
    assert before == {"num_host_alloc": 3, "host_alloc_ms": 2.5}
    stats.update({"num_host_alloc": 5, "host_alloc_time.total": 84_500})
    assert bench.counter_delta(before, bench.pinned_allocator()) == {"num_host_alloc": 2, "host_alloc_ms": 82.0}
    assert bench.counter_delta(None, before) is None and bench.counter_delta(before, None) is None
    assert bench.counter_delta({"a": 1}, {"a": 4, "b": 2}) == {"a": 3, "b": 2}  # a counter new since before: from 0
    monkeypatch.delattr(bench.torch.cuda, "host_memory_stats")
    assert bench.pinned_allocator() is None


def test_the_capped_rows_cap_the_background_threads_and_only_they(bench, tmp_path):
    from cosmos_framework_ext.recipe.config import load as load_sft_config

    capped = [c for c in bench.OPTIONAL if c.name.endswith("+ background threads capped")]
    assert len(capped) == 2
    for c in capped:
        twin = next(o for o in bench.OPTIONAL if o.name == c.name.removesuffix(" + background threads capped"))
        assert load_sft_config(bench.recipe_toml(c, 8, 3, tmp_path)).onecard.background_threads == "auto"
        assert load_sft_config(bench.recipe_toml(twin, 8, 3, tmp_path)).onecard.background_threads == "all"
