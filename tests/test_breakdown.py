"""``benchmarks/breakdown.py``: the profiled breakdown attributes each GPU event to the phase and decoder layer that
launched it and sums it per category (a hand-built trace with known answers), and ``edge_24gb.py --profile`` runs
it end to end as a CPU smoke."""

from __future__ import annotations

import contextlib
import gzip
import json

import pytest
import torch

from benchmarks import breakdown as bd
from benchmarks.checks import result_stem

MAIN, AUTOGRAD, LOADER, DEVICE_THREAD = 1, 2, 3, 4  # thread ids


def ann(name, ts, dur, tid=MAIN):
    return {"ph": "X", "cat": "user_annotation", "name": "onecard." + name, "ts": ts, "dur": dur, "tid": tid}


def kernel(name, launch_ts, ts, dur, corr, tid=MAIN, cat="kernel"):
    """A GPU event and its launch (``cudaLaunchKernel`` on ``tid`` at ``launch_ts``), linked by ``corr``."""
    return [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launch_ts, "dur": 1, "tid": tid,
             "args": {"correlation": corr}},
            {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 7, "args": {"correlation": corr}}]


def trace():
    """One micro-batch 0..1000 us: host/data 0..100, encode 100..200, forward 200..500 (layer 0 at 210..300,
    layer 1 at 300..400), backward 500..1000 (recompute of layer 1 at 510..600 on the autograd thread)."""
    ev = [ann("micro_batch", 0, 1000), ann("encode", 100, 100), ann("forward", 200, 300),
          ann("backward", 500, 500), ann("layer.0", 210, 90), ann("layer.1", 300, 100),
          ann("layer.1", 510, 90, tid=AUTOGRAD)]
    ev += kernel("Memcpy HtoD (Pinned -> Device)", 50, 60, 20, 1, cat="gpu_memcpy")  # host and data
    ev += kernel("triton_poi_fused_add_0", 120, 130, 10, 2)  # encode
    ev += kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 220, 230, 40, 3)  # forward, layer 0
    ev += kernel("triton_tem_fused_flex_attention_0", 310, 320, 50, 4)  # forward, layer 1
    # launched in the forward (layer 1) but still running at the backward's start: it is the forward's
    ev += kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 390, 505, 30, 5)
    ev += kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 520, 530, 40, 6, tid=AUTOGRAD)  # recompute of layer 1
    ev += kernel("void at::native::vectorized_elementwise_kernel<4>", 700, 710, 20, 7, tid=AUTOGRAD)  # gradient
    ev += kernel("some_custom_kernel", 800, 810, 5, 8, tid=AUTOGRAD)  # other
    ev += kernel("outside", 1100, 1110, 500, 9)  # launched after the micro-batch: not counted
    return {"traceEvents": ev}


def test_categories_of_known_kernel_names():
    assert bd.categorize("triton_tem_fused_flex_attention_backward_1") == "attention"
    assert bd.categorize("pytorch_flash::flash_fwd_kernel") == "attention"
    assert bd.categorize("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n") == "GEMM"
    assert bd.categorize("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "GEMM"
    assert bd.categorize("triton_tem_fused_mm_3") == "GEMM"
    assert bd.categorize("triton_red_fused__to_copy_mean_pow_1") == "fused elementwise (Triton)"
    assert bd.categorize("Memcpy DtoH (Device -> Pinned)") == "memcpy / memset"
    assert bd.categorize("void at::native::reduce_kernel<512, 1>") == "elementwise / reduce (eager)"
    assert bd.categorize("some_custom_kernel") == "other"


def test_events_go_to_the_phase_and_layer_that_launched_them():
    b = bd.breakdown(trace())
    assert b["micro_batches"] == 1
    assert b["wall_s"] == pytest.approx(1000e-6)
    ph = b["phases"]
    assert ph["host and data"]["kernels_s"] == {"memcpy / memset": pytest.approx(20e-6)}
    assert ph["host and data"]["wall_s"] == pytest.approx(100e-6)
    assert ph["encode"]["kernels_s"] == {"fused elementwise (Triton)": pytest.approx(10e-6)}
    assert ph["forward"]["kernels_s"] == {"GEMM": pytest.approx(70e-6), "attention": pytest.approx(50e-6)}
    assert ph["backward"]["kernels_s"] == {"GEMM": pytest.approx(40e-6),
                                           "elementwise / reduce (eager)": pytest.approx(20e-6),
                                           "other": pytest.approx(5e-6)}
    # busy while the host was in the backward (500..1000): 505..570 (the forward's GEMM still running, then the
    # recompute GEMM), 710..730, 810..815
    assert ph["backward"]["gpu_busy_s"] == pytest.approx(90e-6)
    assert ph["backward"]["idle_s"] == pytest.approx(410e-6)
    assert ph["forward"]["gpu_busy_s"] == pytest.approx(90e-6)  # 230..270, 320..370: the GEMM it launched at 390 runs later
    assert b["recompute_s"] == pytest.approx(40e-6)
    assert b["layers"] == {"forward_s": [pytest.approx(40e-6), pytest.approx(80e-6)],
                           "recompute_s": [0.0, pytest.approx(40e-6)],
                           "forward_wall_s": [pytest.approx(90e-6), pytest.approx(100e-6)]}
    assert b["gpu_busy_s"] == pytest.approx(210e-6)  # the union: the forward GEMM still running at 505..535 overlaps the recompute GEMM by 5 us; the event launched outside is not counted
    assert b["categories_s"]["GEMM"] == pytest.approx(110e-6)
    assert b["top_kernels"][0]["name"] == "sm90_xmma_gemm_bf16bf16_bf16f32" and b["top_kernels"][0]["count"] == 2
    # GPU idle 790 us of 1000, by where the main thread was: 0..60 and 80..100 (host and data), 100..130 and
    # 140..200 (encode), 200..230, 270..320 and 370..500 (forward), 500..505, 570..710, 730..810, 815..1000 (backward)
    assert b["gpu_idle_while"] == {"host and data": pytest.approx(80e-6), "encode": pytest.approx(90e-6),
                                   "forward": pytest.approx(210e-6), "backward": pytest.approx(410e-6),
                                   "between micro-batches": 0.0}
    md = bd.markdown_table(b, unprofiled_s=0.0009)
    assert "host and data 0.1 ms, encode 0.1 ms, forward 0.2 ms, backward 0.4 ms, between micro-batches 0.0 ms" in md
    assert "| backward | 0.5 | 0.1 | 0.4 |" in md and "| forward | 0.3 | 0.1 | 0.2 |" in md
    for p in ph:  # the table's idle column is the idle-while line
        assert ph[p]["idle_s"] == pytest.approx(b["gpu_idle_while"][p])
    assert "unprofiled median 0.9 ms" in md and "Decoder layers (2)" in md


def test_overlapping_events_count_once_in_busy_time():
    t = trace()
    t["traceEvents"] += kernel("triton_poi_fused_mul_1", 221, 235, 10, 99)  # inside the GEMM's 230..270
    t["traceEvents"] += kernel("triton_poi_fused_mul_2", 222, 260, 30, 98)  # 260..290: 10 us of it overlap the GEMM
    b = bd.breakdown(t)
    assert b["phases"]["forward"]["gpu_busy_s"] == pytest.approx(110e-6)  # 230..290 and 320..370, each overlap once
    assert b["phases"]["forward"]["kernels_s"]["fused elementwise (Triton)"] == pytest.approx(40e-6)


def test_gpu_idle_is_split_where_the_host_was_across_micro_batches():
    """Unsynchronized phases: a kernel launched in one phase runs into the next, the GPU idles between two
    micro-batches, and a kernel runs past the last micro-batch's end (only the profiled span counts)."""
    ev = [ann("micro_batch", 0, 100), ann("forward", 10, 40), ann("backward", 50, 50),
          ann("micro_batch", 130, 100), ann("forward", 140, 40), ann("backward", 180, 50)]
    ev += kernel("gemm_a", 12, 20, 45, 1)        # launched in the forward, runs 20..65 (into the backward)
    ev += kernel("gemm_b", 60, 70, 50, 2)        # 70..120: past the first micro-batch's end
    ev += kernel("gemm_c", 185, 200, 60, 3)      # 200..260: past the profiled span's end (230)
    b = bd.breakdown({"traceEvents": ev})
    # idle: 0..20 (10 host and data, 10 forward), 65..70 (backward), 120..130 (between), 130..200 (10 host and data,
    # 40 forward, 20 backward); per micro-batch: halves
    assert b["gpu_idle_while"] == {"host and data": pytest.approx(10e-6), "encode": 0.0,
                                   "forward": pytest.approx(25e-6), "backward": pytest.approx(12.5e-6),
                                   "between micro-batches": pytest.approx(5e-6)}


def test_idle_after_the_last_gpu_event_counts_and_every_gap_sums_to_the_idle_time():
    # GPU busy 10..20 of 0..100; the host is in the forward 0..50, then nowhere named
    assert bd._idle_while([(10, 20)], (0, 100), [(0, 50, "forward")], "between") == {"forward": 40.0, "between": 50.0}
    # no GPU event at all: the whole span is idle; an event before the span changes nothing
    assert bd._idle_while([(-30, -10)], (0, 60), [(0, 60, "forward")], "between") == {"forward": 60.0, "between": 0.0}


@pytest.mark.parametrize("sync", [True, False])
def test_phases_synchronize_only_when_asked(monkeypatch, sync):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))

    class Mem:
        @contextlib.contextmanager
        def phase(self, name):
            yield

    with bd._Phases(Mem(), torch.device("cuda"), sync).phase("forward"):
        pass
    assert len(calls) == (2 if sync else 0)


def test_a_trace_without_the_marks_is_refused():
    with pytest.raises(ValueError, match="onecard.micro_batch"):
        bd.breakdown({"traceEvents": kernel("x", 0, 1, 1, 1)})


def test_profile_smoke_adds_a_profiled_row(edge_bench, tmp_path, edge_smoke_env):
    name = "all levers + optimizer-state streaming + selective AC"  # on the CPU: eager, dense-mask fallback as the trainer runs it
    assert edge_bench.main(["--smoke", "--steps", "2", "--grad-accum", "2", "--only", name, "--profile", name,
                       "--profile-without-sync", "--out", str(tmp_path)]) == 0
    stem = result_stem("cosmos", "edge24gb", "cpu", smoke=True)
    rows = json.loads((tmp_path / f"{stem}.json").read_text())["rows"]
    assert [r["config"] for r in rows] == [name, name + " (profiled)"]
    assert "breakdown" not in rows[0]
    b = rows[1]["breakdown"]
    from cosmos_framework_ext.recipe.presets import get_preset

    layers = get_preset("tiny").transformer["num_hidden_layers"]
    assert b["micro_batches"] == 1 and len(b["layers"]["forward_s"]) == layers
    assert all(b["phases"][p]["wall_s"] > 0 for p in ("encode", "forward", "backward"))
    assert b["synchronized_phases"] is False and sum(b["gpu_idle_while"].values()) <= b["wall_s"] * (1 + 1e-9)
    md = (tmp_path / f"{stem}.md").read_text()
    assert f"Where the time goes: {name} (profiled)" in md and "(phases not synchronized)" in md
    trace = tmp_path / f"{stem}-{edge_bench.slug(name)}-profile-trace.json.gz"
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]


@pytest.mark.parametrize("value", ["nosuch", "stock,nosuch", ","])
def test_profile_names_known_configurations(edge_bench, tmp_path, value, capsys):
    assert edge_bench.main(["--smoke", "--grad-accum", "1", "--profile", value, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--profile" in err and not list(tmp_path.iterdir())


def test_host_side_launches_waits_and_ops_per_phase():
    t = trace()
    t["traceEvents"] += [
        {"ph": "X", "cat": "cpu_op", "name": "FSDP::pre_forward", "ts": 205, "dur": 4, "tid": MAIN},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 450, "dur": 20, "tid": MAIN},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": 600, "dur": 3, "tid": AUTOGRAD},
        {"ph": "X", "cat": "cpu_op", "name": "aten::_local_scalar_dense", "ts": 620, "dur": 2, "tid": MAIN},  # CPU .item()
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1200, "dur": 50, "tid": MAIN},  # after the micro-batch
        ann("forward", 1150, 200),  # a phase mark outside every micro-batch (an optimizer call's): ignored
    ]
    b = bd.breakdown(t)
    h = b["host"]
    assert h["forward"]["launches"] == 3 and h["backward"]["launches"] == 3 and h["encode"]["launches"] == 1
    assert h["host and data"]["launches"] == 1
    assert h["forward"]["syncs"] == {"count": 1, "s": pytest.approx(20e-6)}
    assert h["backward"]["syncs"] == {"count": 1, "s": pytest.approx(3e-6)}
    assert h["forward"]["ops"] == [{"name": "FSDP::pre_forward", "count": 1, "s": pytest.approx(4e-6)}]
    assert all(o["name"] != "aten::mm" for p in h.values() for o in p["ops"])
    assert b["phases"]["forward"]["wall_s"] == pytest.approx(300e-6)
    assert b["layers"]["forward_wall_s"] == [pytest.approx(90e-6), pytest.approx(100e-6)]
    md = bd.markdown_table(b)
    assert "| forward | 3 | 1 | 0.0 | `FSDP::pre_forward` ×1 0.0 |  |" in md
    assert "Forward wall per layer 0.1–0.1 ms" in md


def test_an_async_copy_is_a_launch_not_a_wait_and_counts_are_per_micro_batch():
    one = trace()["traceEvents"]
    one.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 250, "dur": 5, "tid": MAIN})
    shifted = [dict(e, ts=e["ts"] + 2000, args=dict(e.get("args", {}), **(
        {"correlation": e["args"]["correlation"] + 100} if "correlation" in e.get("args", {}) else {})))
        for e in one]
    b = bd.breakdown({"traceEvents": one + shifted})  # two identical micro-batches
    assert b["micro_batches"] == 2
    fwd = b["host"]["forward"]
    assert fwd["launches"] == 4 and fwd["syncs"] == {"count": 0, "s": 0.0}  # 3 kernels + the async copy, each once


def test_profile_without_sync_needs_a_profile_row(edge_bench, tmp_path, capsys):
    assert edge_bench.main(["--smoke", "--grad-accum", "1", "--profile-without-sync", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--profile-without-sync" in err and not list(tmp_path.iterdir())


def test_ops_of_threads_beside_the_step_are_listed_apart():
    """A loader thread's op (laying out the next micro-batch) is not the phase's host work; an autograd node's
    thread is a training thread even without a mark on it."""
    t = trace()
    t["traceEvents"] += [
        {"ph": "X", "cat": "cpu_op", "name": "aten::index_put_", "ts": 20, "dur": 30, "tid": LOADER},
        {"ph": "X", "cat": "cpu_op", "name": "aten::arange", "ts": 40, "dur": 2, "tid": MAIN},
        {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: MulBackward0", "ts": 900, "dur": 8,
         "tid": DEVICE_THREAD},
    ]
    h = bd.breakdown(t)["host"]
    assert h["host and data"]["ops"] == [{"name": "aten::arange", "count": 1, "s": pytest.approx(2e-6)}]
    assert h["host and data"]["other_threads"] == [{"name": "aten::index_put_", "count": 1, "s": pytest.approx(30e-6)}]
    assert [o["name"] for o in h["backward"]["ops"]] == ["autograd::engine::evaluate_function: MulBackward0"]
    assert h["backward"]["other_threads"] == []
    md = bd.markdown_table(bd.breakdown(t))
    assert "| host and data | 1 | 0 | 0.0 | `aten::arange` ×1 0.0 | `aten::index_put_` ×1 0.0 |" in md


def test_layer_calls_are_wrapped_outside_the_compiled_region():
    """:func:`wrap_layer_calls` wraps a compiled layer's compiled call (so the wrapper runs eagerly, no graph break)
    and an uncompiled layer's ``forward``, each with its index in module order."""

    class Layer(torch.nn.Module):
        def forward(self, x):
            return x * 2

    class Model(torch.nn.Module):
        _repeated_blocks = ["Layer"]

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer()])

    model = Model()
    model.layers[0].compile(backend="eager")
    seen = []

    def wrap(call, i):
        def wrapped(*a, **k):
            seen.append((i, torch.compiler.is_compiling()))
            return call(*a, **k)
        return wrapped

    assert bd.wrap_layer_calls(model, wrap) == 2
    x = torch.ones(2)
    assert torch.equal(model.layers[1](model.layers[0](x)), 4 * x)
    assert seen == [(0, False), (1, False)]
    assert model.layers[0].__dict__.get("forward") is None  # the compiled layer: its compiled call was wrapped
