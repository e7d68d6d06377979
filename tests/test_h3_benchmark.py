"""``benchmarks/h3_1gpu.py --smoke``: every mode (resident, offload, partial) runs on the CPU (tiny preset, gloo) in
its own child process and reports what the GPU run reports; bad arguments are one error line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "h3_1gpu.py"


def test_smoke_runs_every_mode_and_reports(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--lora-rank", "4", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads((tmp_path / "h3_1gpu.json").read_text())
    assert [r["mode"] for r in results] == ["resident", "offload", "partial"]
    keys = {"s_per_step", "gpu_peak_gib", "host_peak_gib", "pinned_requested_bytes", "pinned_locked_bytes", "init_s",
            "resident_blocks", "optimizer_device", "host_peak_init_gib", "host_steady_gib", "init_build_s",
            "init_materialise_s", "init_rest_s"}
    for r in results:
        assert r["ok"] and keys <= r.keys() and r["s_per_step"] > 0 and r["host_peak_gib"] > 0
        # the trainer's low-RAM init: every base parameter was on the meta device until materialise wrote it
        assert r["init_path"] == "fast_init.build_lora_fsdp" and r["base_init"].startswith("random init (seed 0")
        assert r["meta_params_before_sharding"] == r["base_tensors"] > 0
        assert abs(r["init_build_s"] + r["init_rest_s"] - r["init_s"]) < 1e-6
        assert abs(r["init_meta_shard_s"] + r["init_materialise_s"] - r["init_build_s"]) < 1e-6
        assert 0 < r["host_peak_init_gib"] <= r["host_peak_gib"]
    by = {r["mode"]: r for r in results}
    assert by["resident"]["pinned_requested_bytes"] == 0 and by["offload"]["pinned_requested_bytes"] > 0
    assert 0 < by["partial"]["pinned_requested_bytes"] < by["offload"]["pinned_requested_bytes"]
    assert by["partial"]["resident_blocks"] == 1
    assert "| 9x16x16 | partial | none | 1 |" in (tmp_path / "h3_1gpu.md").read_text()
    for r in results:  # the PCIe floor: the offloaded shards twice per micro-batch; no bandwidth on the CPU
        assert r["cap_gib"] is None and r["h2d_gb_s"] is None and r["pcie_floor_s"] is None
        assert r["h2d_bytes_per_step"] == r["pinned_requested_bytes"] * 2 * 2
        # the bytes gathered in the timed step, counted at each offloaded unit's gather: the model's, on the CPU too
        assert r["h2d_bytes_counted_per_step"] == r["h2d_bytes_per_step"]


def test_bad_arguments_are_one_error_line():
    for args in (["--modes", "resident,fast"], ["--clips", "81x480"]):
        out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and out.stderr.startswith("error:"), out.stderr


def _bench(*args, timeout=60):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def test_print_commands_one_configuration_each_under_the_command_limit_and_in_the_docstring():
    out = _bench("--print-commands", "--gpu-budget-gib", "40", "--probe-largest")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    runs = [x for x in lines if "--modes" in x]
    assert len(runs) == 4 + 3 * 3 + 2 and lines[-1] == "python benchmarks/h3_1gpu.py --merge outputs/h3_1gpu_runs"
    capped = [x for x in runs if "--cap-gib" in x]  # the 24 GB card: full offload at the recipe's clip, capped,
    assert len(capped) == 2 and all("--modes offload --clips 107x768x1344" in c and "--cap-gib 22.06" in c
                                    for c in capped)
    assert ["--recompute-inputs auto" in c for c in capped] == [False, True]  # plain, then with the lever
    outs = set()
    for cmd in runs:
        args = cmd.split("; ", 1)[1].split()
        modes, clips = args[args.index("--modes") + 1], args[args.index("--clips") + 1]
        assert "," not in modes and "," not in clips
        assert float(args[args.index("--timeout-s") + 1]) <= 540
        assert ("--gpu-budget-gib" in args) == (modes == "partial")
        assert ("--cap-gib" in args) == (cmd in capped)
        outs.add(args[args.index("--out") + 1])
    assert len(outs) == len(runs)  # one result folder per command
    doc = SCRIPT.read_text()
    for cmd in _bench("--print-commands", "--gpu-budget-gib", "40").stdout.splitlines():
        assert "    " + cmd + "\n" in doc, cmd  # the docstring lists exactly what --print-commands prints
    bad = _bench("--print-commands", "--smoke")
    assert bad.returncode == 2 and bad.stderr.startswith("error:")


def test_merge_combines_per_command_results(tmp_path):
    row = {"ok": False, "error": "timed out after 540 s"}
    (tmp_path / "b").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "h3_1gpu.json").write_text(json.dumps([dict(row, mode="resident", clip="81x480x832")]))
    (tmp_path / "a" / "h3_1gpu.json").write_text(json.dumps([dict(row, mode="offload", clip="17x320x192"),
                                                            dict(row, mode="resident", clip="17x320x192")]))
    out = _bench("--merge", str(tmp_path))
    assert out.returncode == 0, out.stderr
    merged = json.loads((tmp_path / "h3_1gpu.json").read_text())
    assert [(r["clip"], r["mode"]) for r in merged] == [("17x320x192", "resident"), ("17x320x192", "offload"),
                                                        ("81x480x832", "resident")]
    assert (tmp_path / "h3_1gpu.md").read_text().count("timed out") == 3
    empty = _bench("--merge", str(tmp_path / "a" / "nothing"))
    assert empty.returncode == 2 and empty.stderr.startswith("error:")


def _module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("h3_1gpu_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pcie_floor_counts_each_streamed_byte_twice_per_micro_batch():
    bench = _module()
    assert bench.pcie_floor(10**9, 2, 50.0) == (4 * 10**9, 4 * 10**9 / 50e9)
    assert bench.pcie_floor(0, 2, 50.0) == (0, 0.0)  # every block resident: nothing streams
    assert bench.pcie_floor(10**9, 3, None) == (6 * 10**9, None)  # no measured bandwidth (CPU): no floor
    # lockstep: twice per group of micro-batches (3 in groups of 2: 2 groups)
    assert bench.pcie_floor(10**9, 2, 50.0, lockstep=2) == (2 * 10**9, 2 * 10**9 / 50e9)
    assert bench.pcie_floor(10**9, 3, None, lockstep=2) == (4 * 10**9, None)
    assert bench.pcie_floor(10**9, 2, None, lockstep=5) == (2 * 10**9, None)

    import torch

    assert bench.pinned_h2d_gb_s(torch.device("cpu")) is None


def _timing_out(monkeypatch):
    """The benchmark module with every child run timing out at once; returns ``(module, env of the last child)``."""
    bench = _module()
    seen: dict = {}

    def timeout(cmd, **kw):
        seen.update(kw["env"])
        raise subprocess.TimeoutExpired(cmd, 1)

    monkeypatch.setattr(bench.subprocess, "run", timeout)
    return bench, seen


def test_a_failed_row_still_records_its_cap(monkeypatch):
    bench, seen = _timing_out(monkeypatch)
    monkeypatch.delenv("ONECARD_GPU_MEMORY_GIB", raising=False)
    row = bench.child("offload", "107x768x1344", [], 1.0, cap_gib=22.06)
    assert row["ok"] is False and row["cap_gib"] == 22.06 and seen["ONECARD_GPU_MEMORY_GIB"] == "22.06"
    assert "| 107x768x1344 | offload | 22.06 | | 0 | failed: timed out" in bench.table([row])
    assert bench.child("offload", "107x768x1344", [], 1.0)["cap_gib"] is None


def test_bad_cap_is_one_error_line(tmp_path):
    for value in ("nan", "-1", "0", "inf"):
        out = _bench("--smoke", "--cap-gib", value, "--out", str(tmp_path))
        assert out.returncode == 2 and out.stderr.startswith("error:") and "--cap-gib" in out.stderr, out.stderr
        assert not list(tmp_path.iterdir())
    import os

    env = dict(os.environ, ONECARD_GPU_MEMORY_GIB="lots")  # an inherited cap that means nothing
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=120, cwd=REPO, env=env)
    assert out.returncode == 2 and out.stderr.startswith("error:") and "ONECARD_GPU_MEMORY_GIB" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


def test_merge_refuses_a_row_with_a_meaningless_cap(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "h3_1gpu.json").write_text(json.dumps([{"ok": False, "mode": "offload", "clip": "9x16x16",
                                                              "cap_gib": -3}]))
    out = _bench("--merge", str(tmp_path))
    assert out.returncode == 2 and "cap_gib = -3" in out.stderr and not (tmp_path / "h3_1gpu.json").exists()


def test_table_prints_the_cap_and_floor_in_decimal_units():
    bench = _module()
    row = {"ok": True, "mode": "offload", "clip": "107x768x1344", "cap_gib": 22.06, "resident_blocks": 0,
           "s_per_step": 38.27, "gpu_peak_gib": 20.5, "host_peak_init_gib": 65.8, "host_steady_gib": 69.0,
           "host_peak_gib": 69.1, "pinned_requested_bytes": 10**10, "pinned_locked_bytes": 10**10,
           "h2d_bytes_per_step": 4 * 10**10, "h2d_gb_s": 50.0, "pcie_floor_s": 0.8, "init_s": 40,
           "init_meta_shard_s": 39, "init_materialise_s": 1, "init_rest_s": 0, "optimizer_device": "cpu"}
    assert "| 107x768x1344 | offload | 22.06 | none | 0 | 38.27 | 20.5 |" in bench.table([row])
    assert "| 40.0 | 0.80 (50.0) |" in bench.table([row])
    lever = dict(row, recompute_block_inputs=18, predicted_peak_gib=20.86)  # the lever's row: its count and the model
    assert "| 22.06 | none | 18 | 38.27 | 20.5 (20.9) |" in bench.table([lever])


def test_merge_refuses_a_zero_cap_or_bandwidth(tmp_path):
    for key in ("cap_gib", "h2d_gb_s"):
        (tmp_path / key / "run").mkdir(parents=True)  # --merge reads DIR/*/h3_1gpu.json
        (tmp_path / key / "run" / "h3_1gpu.json").write_text(json.dumps([{"ok": False, "mode": "offload",
                                                                         "clip": "9x16x16", key: 0}]))
        out = _bench("--merge", str(tmp_path / key))
        assert out.returncode == 2 and f"{key} = 0 is not a finite positive number" in out.stderr, out.stderr
        assert not (tmp_path / key / "h3_1gpu.md").exists()


def test_print_commands_with_a_cap_caps_every_run_and_adds_no_second_24gb_run():
    out = _bench("--print-commands", "--cap-gib", "22.06", "--modes", "offload,resident")
    assert out.returncode == 0, out.stderr
    runs = [x for x in out.stdout.splitlines() if "--modes" in x]
    assert len(runs) == 3 * 2 and all("--cap-gib 22.06" in x for x in runs)


def test_smoke_rows_say_whether_the_adapters_are_prefetched_with_their_block(tmp_path):
    """``--prefetch-h2d``: the row counts the adapter units some block's forward prefetch gathers (read from the model),
    none with ``--late-adapters``; ``--recompute-inputs auto`` plans the smoke run's budget and records its plan."""
    rows = {}
    for name, extra in (("now", []), ("late", ["--late-adapters"])):
        out = _bench("--smoke", "--modes", "offload", "--lora-rank", "4", "--prefetch-h2d", "--recompute-inputs",
                     "auto", *extra, "--out", str(tmp_path / name), timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        rows[name] = json.loads((tmp_path / name / "h3_1gpu.json").read_text())[0]
    assert rows["now"]["adapters_prefetched"] > 0 and rows["late"]["adapters_prefetched"] == 0
    for r in rows.values():
        assert r["recompute_block_inputs"] == 0 and "input recompute auto: 0 block inputs" in r["input_recompute_plan"]
        assert r["predicted_peak_gib"] > 0
    assert {r["h2d"] for r in rows.values()} == {"sync"}  # on the CPU no side stream is attached: the wiring is all


def test_table_marks_only_rows_whose_adapters_were_gathered_late():
    bench = _module()
    base = {"ok": True, "mode": "offload", "clip": "81x480x832", "cap_gib": None, "resident_blocks": 0, "s_per_step": 9.8,
            "gpu_peak_gib": 10.0, "host_peak_init_gib": 65.8, "host_steady_gib": 69.0, "host_peak_gib": 69.0,
            "pinned_requested_bytes": 10**10, "pinned_locked_bytes": 10**10, "init_s": 40, "init_meta_shard_s": 39,
            "init_materialise_s": 1, "init_rest_s": 0, "optimizer_device": "cpu", "h2d": "prefetch"}
    assert "(adapters late)" in bench.table([dict(base, adapters_prefetched=0)])
    assert "(adapters late)" in bench.table([dict(base, adapters_prefetched=False)])  # the rows written on 2026-12-04
    assert "(adapters late)" not in bench.table([dict(base, adapters_prefetched=50)])
    assert "(adapters late)" not in bench.table([base])  # rows from before the count existed
    assert "(adapters late)" not in bench.table([dict(base, h2d="sync", adapters_prefetched=0)])


def test_oom_summary_reads_the_figures_in_gib():
    bench = _module()
    err = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of "
           "139.80 GiB of which 117.38 GiB is free. 22.06 GiB allowed; Of the allocated memory 21.25 GiB is allocated "
           "by PyTorch, and 236.65 MiB is reserved by PyTorch but unallocated.")
    assert bench.oom_summary(err) == "out of memory: 21.25 GiB allocated, 0.50 GiB more asked, 22.06 GiB allowed"
    assert bench.oom_summary("RuntimeError: something else") is None
    assert bench.oom_summary("torch.OutOfMemoryError: CUDA out of memory.") == "out of memory"


def test_the_allocator_setting_defaults_and_a_given_one_is_kept(monkeypatch):
    bench, seen = _timing_out(monkeypatch)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    bench.child("offload", "9x16x16", ["--recompute-inputs=3"], 1.0)
    assert seen["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    row = bench.child("offload", "9x16x16", ["--recompute-inputs=3"], 1.0)
    assert seen["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    assert row["recompute_block_inputs"] == "3"  # a failed row records the setting it ran with


@pytest.mark.parametrize("args, needle", [
    (["--print-commands", "--modes", "offload,resident", "--recompute-inputs", "auto"], "use --modes offload with it"),
    (["--print-commands", "--modes", "offload", "--recompute-inputs", "26"], "(25)"),
    (["--smoke", "--modes", "offload", "--recompute-inputs", "2"], "tiny preset's 2 transformer blocks (1)"),
    (["--print-commands", "--modes", "offload", "--recompute-inputs", "9" * 5000], "--recompute-inputs '999"),
    (["--print-commands", "--modes", "offload", "--recompute-inputs", "half"], "use auto, a whole number"),
    (["--print-commands", "--modes", "offload", "--gpu-budget-gib", "10"], "add partial to --modes"),
    (["--print-commands", "--cap-gib", "2000"], "at most 1024 GiB"),
    (["--print-commands", "--resident-blocks", "9" * 5000], "--resident-blocks '999"),
    (["--print-commands", "--resident-blocks", "none"], "use auto or a whole number of blocks"),
    (["--print-commands", "--modes", "offload", "--late-adapters"], "add --prefetch-h2d"),
    (["--print-commands", "--modes", "offload", "--lockstep", "0"], "micro-batches per lockstep group"),
    (["--print-commands", "--modes", "offload", "--lockstep", "2", "--recompute-inputs", "1"], "do not combine"),
    (["--print-commands", "--modes", "partial", "--adapter-step"], "--adapter-step acts on the adapters full offload"),
    (["--print-commands", "--modes", "offload,resident", "--pin-adapter-gradients"], "use --modes offload with it"),
], ids=["auto-not-only-offload", "more-than-25", "more-than-tiny", "huge", "word", "budget-without-partial",
        "cap-over-1024", "resident-huge", "resident-none", "late-without-prefetch", "lockstep-0",
        "lockstep-with-recompute", "adapter-step-partial", "pin-gradients-resident"])
def test_bad_recompute_and_budget_arguments_are_one_error_line(tmp_path, args, needle):
    out = _bench(*args, "--out", str(tmp_path / "out"))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], out.stderr
    assert not (tmp_path / "out").exists()


def test_print_commands_carry_the_lockstep_into_each_command_and_folder():
    out = _bench("--print-commands", "--modes", "offload", "--clips", "81x480x832", "--lockstep", "2",
                 "--prefetch-h2d")
    assert out.returncode == 0, out.stderr
    runs = [x for x in out.stdout.splitlines() if "--modes" in x]
    assert len(runs) == 1  # no capped recipe-clip rows: those are the recompute lever's
    assert "--lockstep 2" in runs[0] and runs[0].endswith("81x480x832_offload_lockstep2_prefetch")


def test_model_flops_count_the_blocks_attention_and_mlp_weights_of_diffusers_h3():
    """The analytic per-block weight count equals diffusers' block's attention and MLP linears (the independent anchor,
    on the meta model), and the formula by hand: 4 W T + 12 T^2 d per block."""
    import dataclasses

    from torch import nn

    from miles_ext.recipe.presets import FULL, TINY, meta_transformer

    bench = _module()
    for preset in (TINY, dataclasses.replace(TINY, num_layers=3)):
        block = meta_transformer(preset).transformer_blocks[0]
        weights = sum(m.weight.numel() for n, m in block.named_modules()
                      if isinstance(m, nn.Linear) and n.split(".")[0] in ("attn", "ff"))
        d = preset.num_attention_heads * preset.attention_head_dim
        assert bench.model_flop_per_micro_batch(preset, 7) == preset.num_layers * (4 * weights * 7 + 12 * 49 * d)
    assert bench.model_flop_per_micro_batch(FULL, 1) == 50 * (4 * 385_351_680 + 12 * 7168)
    assert bench.mfu(989e12, 1.0) == 1.0 and bench.mfu(989e12, 2.0, peak_tflops=989.0) == 0.5
    assert bench.mfu(1.0, None) is None and bench.mfu(1.0, 0.0) is None


def test_adapter_step_rows_stream_the_step_and_count_what_a_lockstep_step_gathers(tmp_path):
    """``--adapter-step --pin-adapter-gradients --lockstep 2`` on the CPU smoke: the row says the step is streamed on
    its device (the host, here) and pins nothing (no page-locked shards on the CPU); the bytes counted in the timed
    step are one gather per unit per lockstep group (half the sequential step's); the flags reach the printed commands."""
    out = _bench("--smoke", "--modes", "offload", "--lora-rank", "4", "--adapter-step", "--pin-adapter-gradients",
                 "--lockstep", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    (r,) = json.loads((tmp_path / "h3_1gpu.json").read_text())
    assert r["adapter_step"] is True and r["optimizer_device"] == "cpu (streamed)" and r["pinned_adapter_gradients"] == 0
    assert r["h2d_bytes_counted_per_step"] == r["h2d_bytes_per_step"] == r["pinned_requested_bytes"] * 2
    cmds = _bench("--print-commands", "--modes", "offload", "--clips", "17x320x192", "--adapter-step",
                  "--pin-adapter-gradients")
    runs = [x for x in cmds.stdout.splitlines() if "--modes" in x]
    assert runs and all("--adapter-step" in x and "--pin-adapter-gradients" in x for x in runs)
    assert all(x.endswith("_adapterstep_pinnedgrads") for x in runs), runs  # folders of their own, not the baseline's
    # the table's mode says which adapter levers ran; "pinned" only where gradients were pinned (none on the CPU)
    row = next(x for x in (tmp_path / "h3_1gpu.md").read_text().splitlines() if x.startswith("| 9x16x16"))
    assert "(adapter step)" in row and "pinned" not in row
    bench = _module()
    assert "(pinned gradients)" in bench.table([{**r, "pinned_adapter_gradients": 12}])
    assert "(pinned gradients)" in bench.table([{**r, "pin_adapter_gradients": True, "pinned_adapter_gradients": None}])
