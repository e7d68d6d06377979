"""Bad input to the benchmark scripts is one ``error:`` line, exit status 2, and nothing written under ``--out``;
every check runs before the GPU check and any run (``benchmarks/checks.py``). CPU only: no configuration runs."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.checks import result_stem
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.checks import pick, writable_dir, write_together  # noqa: E402
from patches.core.errors import UserError  # noqa: E402

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")


def _load(name: str, rel: str):
    spec = importlib.util.spec_from_file_location(name, REPO / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def scripts():
    return {"edge_24gb": _load("edge_24gb_inputs", "benchmarks/edge_24gb.py"),
            "edge_exact": _load("edge_exact_inputs", "benchmarks/edge_exact.py"),
            "h3_1gpu": _load("h3_1gpu_inputs", "benchmarks/h3_1gpu.py"),
            "flex_kernels": _load("flex_kernels_inputs", "benchmarks/flex_kernels.py")}


def _refused(mod, args, out: Path, capfd, mentions: str) -> str:
    """``mod.main(args + --out out)`` exits 2 with exactly one stderr line, an ``error:`` naming ``mentions``, and
    leaves ``out`` as it was (absent, or empty); argparse's own refusals exit through ``SystemExit(2)``."""
    try:
        rc = mod.main([*args, "--out", str(out)])
    except SystemExit as e:
        rc = e.code
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert mentions in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())
    return lines[0]


EDGE_24GB_BAD = [
    (["--smoke", "--only", ","], "--only"),
    (["--smoke", "--only", "nosuch"], "--only"),
    (["--only", "nosuch"], "--only"),  # the argument's own error first, not the missing GPU
    (["--smoke", "--timelines", "nosuch"], "--timelines"),
    (["--smoke", "--peak-tflops", "0"], "--peak-tflops"),
    (["--smoke", "--budget-gib", "-1"], "--budget-gib"),
    (["--smoke", "--budget-gib", "nan"], "--budget-gib"),
    (["--smoke", "--budget-gib", "inf"], "--budget-gib"),
    (["--smoke", "--peak-tflops", "inf"], "--peak-tflops"),  # an MFU of 0 and Infinity in the JSON
    (["--smoke", "--only", "stock (uncapped card)", "--timelines", "all levers"], "--timelines"),  # would keep nothing
    (["--smoke", "--steps", "1"], "--steps"),
    (["--steps", "1"], "--steps"),
    (["--grad-accum", "4"], "--grad-accum"),
    (["--smoke", "--grad-accum", "0"], "--grad-accum"),
]
FEWER = "all levers + optimizer-state streaming + selective AC + fewer checkpointed layers"
EDGE_24GB_BAD += [(["--smoke", "--only", FEWER, "--checkpoint-layers", bad], "--checkpoint-layers")
                  for bad in ("-1", "2.5", "some", "AUTO", "", "3", "99999999999999999999", "\u0663", "\u00b2", "[1]")]
EDGE_24GB_BAD += [(["--smoke", "--only", FEWER, "--checkpoint-layers", bad], "--checkpoint-layers")
                  for bad in ("1,1", "auto,1,auto", "1,", ",1", "1,,2", "1,3", "1;2", "all,2", "1,01")]  # each checked, once
EDGE_24GB_BAD += [(["--smoke", "--only", FEWER, flag, FEWER, "--checkpoint-layers", "1,2"], flag)  # one run of the row
                  for flag in ("--profile", "--queue-depth", "--timelines")]
EDGE_24GB_BAD += [(["--smoke", "--checkpoint-layers", "1"], "--checkpoint-layers"),  # no row reads it: not ignored
                  (["--smoke", "--only", "levers 1+2", "--checkpoint-layers", "auto"], "--checkpoint-layers")]

OFFLOADED = "all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached " \
    "+ activations offloaded"
EDGE_24GB_BAD += [(["--smoke", "--only", OFFLOADED, "--offload-layers", bad], "--offload-layers")
                  for bad in ("0", "-1", "2.5", "x", "", "29", "3")]  # 3: above the smoke's tiny preset (2 layers)
EDGE_24GB_BAD += [(["--smoke", "--only", FEWER, "--offload-layers", "1"], "--offload-layers"),  # no row reads it
                  # more offloaded than checkpointed layers: before any row runs (the smoke offloads 1 by default)
                  (["--smoke", "--only", f"{FEWER},{OFFLOADED}", "--checkpoint-layers", "0"], "--checkpoint-layers"),
                  (["--smoke", "--only", OFFLOADED, "--offload-layers", "2", "--checkpoint-layers", "1"],
                   "--offload-layers 1 or less"),
                  (["--smoke", "--only", FEWER, "--profile", OFFLOADED, "--checkpoint-layers", "1", "--offload-layers",
                    "2"], "--offload-layers")]


def test_edge_24gb_checkpoint_layers_values(scripts):
    arg = scripts["edge_24gb"].checkpoint_layers_arg
    assert arg("007", "edge", [FEWER]) == "7" and arg("28", "edge", [FEWER]) == "28"
    assert arg("auto", "tiny", [FEWER]) == "auto" and arg("0", "tiny", [FEWER]) == "0"
    several = scripts["edge_24gb"].checkpoint_layers_list
    assert several("auto,15,013", "edge", [FEWER]) == ["auto", "15", "13"] and several("2", "tiny", [FEWER]) == ["2"]
    assert several("all,27", "edge", [FEWER]) == ["all", "27"] and arg("00001", "tiny", [FEWER]) == "1"


@pytest.mark.parametrize("args,flag", EDGE_24GB_BAD)
def test_edge_24gb_refuses(scripts, tmp_path, capfd, args, flag):
    _refused(scripts["edge_24gb"], args, tmp_path / "out", capfd, flag)


EDGE_EXACT_BAD = [
    (["--only", "nosuch"], "--only"),  # before the GPU check
    (["--smoke", "--only", ","], "--only"),
    (["--smoke", "--only", "HEAD dtypes, reference"], "--only"),  # the row names hold commas: keys only
    (["--steps", "1"], "--steps"),
    (["--smoke", "--grad-accum", "0"], "--grad-accum"),
    (["--smoke", "--head-cap-gib", "0"], "--head-cap-gib"),
    (["--smoke", "--seed-cap-gib", "-2"], "--seed-cap-gib"),
    (["--smoke", "--head-cap-gib", "inf"], "--head-cap-gib"),
]


@pytest.mark.parametrize("args,flag", EDGE_EXACT_BAD)
def test_edge_exact_refuses(scripts, tmp_path, capfd, args, flag):
    _refused(scripts["edge_exact"], args, tmp_path / "out", capfd, flag)


def test_edge_exact_only_takes_every_key(scripts):
    assert pick("--only", ",".join(scripts["edge_exact"].KEYS), scripts["edge_exact"].KEYS)


H3_BAD = [
    (["--modes", ","], "--modes"),
    (["--modes", "resident,fast"], "--modes"),
    (["--clips", ","], "--clips"),
    (["--clips", "81x480"], "--clips"),
    (["--smoke", "--steps", "0"], "--steps"),
    (["--smoke", "--micro-batches", "0"], "--micro-batches"),
    (["--smoke", "--lora-rank", "0"], "--lora-rank"),
    (["--smoke", "--timeout-s", "0"], "--timeout-s"),
    (["--smoke", "--gpu-budget-gib", "-1"], "--gpu-budget-gib"),
    (["--smoke", "--resident-blocks", "many"], "--resident-blocks"),
    (["--steps", "0"], "--steps"),  # before the GPU check
    (["--smoke", "--modes", "resident,offload", "--sync-h2d"], "--sync-h2d"),  # it changes only partial
    (["--smoke", "--modes", "partial", "--prefetch-h2d"], "--prefetch-h2d"),  # it changes only offload
    (["--smoke", "--sync-h2d", "--prefetch-h2d"], "keep one"),
    (["--merge", ""], "--merge"),  # an empty name must not start the benchmark
    (["--merge", " ", "--smoke"], "--merge"),
]


@pytest.mark.parametrize("args,flag", H3_BAD)
def test_h3_refuses(scripts, tmp_path, capfd, args, flag):
    _refused(scripts["h3_1gpu"], args, tmp_path / "out", capfd, flag)


FLEX_BAD = [
    (["--only", "nosuch"], "--only"),  # before the GPU check
    (["--only", ","], "--only"),
    (["--iters", "0"], "--iters"),
    (["--iters", "1001"], "--iters"),
    (["--tokens", "100"], "--tokens"),
    (["--tokens", "2079"], "--tokens"),  # the layout's largest sample would not fit: no sample at all
    (["--tokens", str(1 << 21)], "--tokens"),
    (["--tokens", "-5"], "--tokens"),
]


@pytest.mark.parametrize("args,flag", FLEX_BAD)
def test_flex_kernels_refuses(scripts, tmp_path, capfd, args, flag):
    _refused(scripts["flex_kernels"], args, tmp_path / "out", capfd, flag)


def test_flex_kernels_layout_fills_the_cap_and_default_comes_first(scripts):
    mod = scripts["flex_kernels"]
    text, vision = mod.layout(12288)
    total = sum(text) + sum(vision)
    assert 12288 - 160 - 80 * 24 < total <= 12288 and len(text) == len(vision) > 1
    assert all(60 <= t <= 160 for t in text) and all(v % 80 == 0 and 80 <= v <= 1920 for v in vision)
    assert mod.parse_args(["--only", "tma"]).names == ["default", "tma"]
    assert mod.parse_args(["--only", "tma,default"]).names == ["default", "tma"]
    assert len(mod.layout(mod.MIN_TOKENS)[0]) >= 1 and mod.parse_args(["--tokens", str(mod.MIN_TOKENS)])


def test_flex_kernels_writes_both_files_and_marks_an_unfinished_run(scripts, tmp_path):
    mod = scripts["flex_kernels"]
    args = mod.parse_args(["--only", "tma", "--out", str(tmp_path)])
    row = {"config": "default", "kernel_options": {}, "fwd_ms": 0.8, "fwd_bwd_ms": 2.6,
           "max_rel_diff": {"out_text": 0.0}, "bitwise_default": True, "wall_s": 1.0}
    shape = {"samples": 2, "text_tokens": 200, "vision_tokens": 1000}
    mod.write(args, [row], shape, complete=False, gpu="NVIDIA H100 80GB HBM3")
    (js,) = tmp_path.glob("*_cosmos_h100_flex-kernels.json")
    assert json.loads(js.read_text())["complete"] is False and "incomplete" in js.with_suffix(".md").read_text()
    mod.write(args, [row, dict(row, config="tma")], shape, complete=True, gpu="NVIDIA H100 80GB HBM3")
    doc = json.loads(js.read_text())
    assert doc["complete"] is True and [r["config"] for r in doc["rows"]] == ["default", "tma"]
    assert "| tma | 0.80 | 2.60 |" in js.with_suffix(".md").read_text()


def test_flex_kernels_out_that_is_a_file_or_empty_and_no_gpu(scripts, tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = scripts["flex_kernels"].main(["--only", "tma", "--out", ""])
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: --out is empty"), err
    (tmp_path / "file").write_text("keep")
    _refused(scripts["flex_kernels"], ["--only", "tma"], tmp_path / "file" / "below", capfd, "--out")
    assert (tmp_path / "file").read_text() == "keep"
    if not torch.cuda.is_available():
        _refused(scripts["flex_kernels"], ["--only", "tma"], tmp_path / "out", capfd, "CUDA GPU")


@pytest.mark.parametrize("name", ["edge_24gb", "edge_exact", "h3_1gpu"])
def test_an_empty_out_is_refused(scripts, tmp_path, capfd, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    try:
        rc = scripts[name].main(["--smoke", "--out", ""])
    except SystemExit as e:  # argparse's type check
        rc = e.code
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2 and "--out" in err[-1] and "empty" in err[-1], err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["edge_24gb", "edge_exact", "h3_1gpu"])
def test_out_that_is_a_file_is_refused_before_any_run(scripts, tmp_path, capfd, name):
    (tmp_path / "file").write_text("keep")
    for out in (tmp_path / "file", tmp_path / "file" / "below"):
        rc = scripts[name].main(["--smoke", "--out", str(out)])
        err = capfd.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("error: --out") and "is a file" in err[0], err
    assert (tmp_path / "file").read_text() == "keep"


@NO_CUDA
@pytest.mark.parametrize("name,args", [("edge_24gb", []), ("edge_exact", []),
                                       ("h3_1gpu", ["--modes", "resident", "--clips", "17x320x192"])])
def test_no_gpu_is_one_line_after_the_argument_checks(scripts, tmp_path, capfd, name, args):
    line = _refused(scripts[name], args, tmp_path / "out", capfd, "CUDA GPU")
    assert "--smoke" in line


@pytest.mark.parametrize("script,args", [("benchmarks/h3_1gpu.py", ["--clips", ","]),
                                         ("benchmarks/edge_24gb.py", ["--smoke", "--only", ","])])
def test_command_line_prints_one_line_and_no_traceback(tmp_path, script, args):
    out = subprocess.run([sys.executable, str(REPO / script), *args, "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith("error: "), out.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", ["benchmarks/metrics_cost.py", "benchmarks/save_host.py", "benchmarks/h3_1gpu.py"])
@pytest.mark.parametrize("out", ["", " "])
def test_a_blank_out_is_one_line_not_the_current_folder(tmp_path, script, out):
    res = subprocess.run([sys.executable, str(REPO / script), "--out", out], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2 and res.stdout == "", res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--out" in lines[0] and "empty" in lines[0], lines
    assert not list(tmp_path.iterdir())


def test_h3_merge_of_a_broken_result_is_one_line_and_writes_nothing(scripts, tmp_path, capfd):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "h3_1gpu.json").write_text("{not json")
    assert scripts["h3_1gpu"].main(["--merge", str(tmp_path)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --merge") and "h3_1gpu.json" in err[0], err
    (tmp_path / "a" / "h3_1gpu.json").write_text(json.dumps([{"mode": "resident"}]))  # no clip
    assert scripts["h3_1gpu"].main(["--merge", str(tmp_path)]) == 2
    assert len(capfd.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "h3_1gpu.json").exists() and not (tmp_path / "h3_1gpu.md").exists()


def _h3_row(**kw):
    row = {"mode": "partial", "clip": "17x320x192", "ok": True, "h2d": "prefetch", "resident_blocks": 3,
           "optimizer_device": "cuda", "s_per_step": 1.0, "gpu_peak_gib": 1.0, "host_peak_init_gib": 1.0,
           "host_steady_gib": 1.0, "host_peak_gib": 1.0, "pinned_requested_bytes": 1, "pinned_locked_bytes": 1,
           "init_s": 1.0, "init_meta_shard_s": 1.0, "init_materialise_s": 0.0, "init_rest_s": 0.0}
    row.update(kw)
    return row


@pytest.mark.parametrize("bad", [dict(h2d=[1]), dict(h2d="fast"), dict(mode="bogus"), dict(mode=5),
                                 dict(s_per_step=None), dict(s_per_step=float("nan")), dict(init_s=True),
                                 dict(resident_blocks=KeyError)])
def test_h3_merge_refuses_malformed_rows(scripts, tmp_path, capfd, bad):
    row = _h3_row(**bad)
    if row["resident_blocks"] is KeyError:
        del row["resident_blocks"]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "h3_1gpu.json").write_text(json.dumps([row]))
    assert scripts["h3_1gpu"].main(["--merge", str(tmp_path)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --merge") and "h3_1gpu.json" in err[0], err
    assert not (tmp_path / "h3_1gpu.json").exists()


def test_h3_merge_labels_rows_and_refuses_a_folder_in_the_way(scripts, tmp_path, capfd):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "h3_1gpu.json").write_text(json.dumps([_h3_row(), _h3_row(h2d="sync")]))
    assert scripts["h3_1gpu"].main(["--merge", str(tmp_path)]) == 0
    md = (tmp_path / "h3_1gpu.md").read_text()
    assert "| partial (H2D prefetch) |" in md and "| partial |" in md
    (tmp_path / "h3_1gpu.md").unlink()
    (tmp_path / "h3_1gpu.md").mkdir()
    capfd.readouterr()
    assert scripts["h3_1gpu"].main(["--merge", str(tmp_path)]) == 2
    assert "is in the way" in capfd.readouterr().err


def test_h3_printed_sync_commands_keep_the_flag_and_their_own_folders(scripts, capfd):
    assert scripts["h3_1gpu"].main(["--print-commands", "--modes", "partial,resident", "--clips", "81x480x832",
                                    "--sync-h2d", "--out", "runs dir"]) == 0
    lines = capfd.readouterr().out.strip().splitlines()
    partial = next(ln for ln in lines if "--modes partial" in ln)
    resident = next(ln for ln in lines if "--modes resident" in ln)
    assert "--sync-h2d" in partial and partial.endswith("--out 'runs dir/81x480x832_partial_sync'")
    assert "--sync-h2d" not in resident and resident.endswith("--out 'runs dir/81x480x832_resident'")
    assert lines[-1] == "python benchmarks/h3_1gpu.py --merge 'runs dir'"
    assert scripts["h3_1gpu"].main(["--print-commands", "--modes", "offload", "--clips", "17x320x192",
                                    "--prefetch-h2d", "--out", "r"]) == 0
    first = capfd.readouterr().out.splitlines()[0]
    assert "--prefetch-h2d" in first and first.endswith("--out r/17x320x192_offload_prefetch")


# ---------------------------------------------------------------------------------------------- the helpers
def test_pick_names_the_problem():
    assert pick("--x", " b, a ,b", ["a", "b"]) == ["b", "a"]
    assert pick("--x", ",", ["a"], allow_none=True) == []
    with pytest.raises(UserError, match="selects nothing"):
        pick("--x", " , ", ["a"])
    with pytest.raises(UserError, match="'c'.*a, b"):
        pick("--x", "a,c", ["a", "b"])


def test_writable_dir_creates_nothing(tmp_path):
    assert writable_dir("--out", tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert list(tmp_path.iterdir()) == []  # the write probe is gone too
    (tmp_path / "f").write_text("")
    with pytest.raises(UserError, match="is a file"):
        writable_dir("--out", tmp_path / "f" / "x")


def test_write_together_is_both_or_neither(tmp_path):
    a, b = tmp_path / "r.json", tmp_path / "r.md"
    write_together({a: "old json", b: "old md"})
    with pytest.raises(TypeError):
        write_together({a: "new json", b: object()})  # the second fails while being written
    assert (a.read_text(), b.read_text()) == ("old json", "old md")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md"]  # no temporaries left
    write_together({a: "new json", b: "new md"})
    assert (a.read_text(), b.read_text()) == ("new json", "new md")


# ---------------------------------------------------------------------------------------------- memtimeline
MEMTIMELINE = REPO / "benchmarks" / "upstream" / "memtimeline.py"


class _Runs:
    def __reduce__(self):
        return (print, ("UNPICKLED CODE RAN",))


@pytest.mark.parametrize("payload,words", [
    ([1, 2], "holds list"),
    ({"segments": []}, "without a device_traces list"),
    ({"device_traces": []}, "no device traces"),
    ({"device_traces": [[1]]}, "not a list of event dicts"),
    ({"device_traces": [[{"action": "alloc", "addr": 1, "size": "big"}]]}, "malformed event"),
    (_Runs(), "plain data only"),
    (b"garbage", "cannot read snapshot"),
])
def test_memtimeline_refuses_what_is_not_a_snapshot(tmp_path, payload, words):
    f = tmp_path / "snap.pickle"
    f.write_bytes(b"not a pickle" if payload == b"garbage" else pickle.dumps(payload))
    out = subprocess.run([sys.executable, str(MEMTIMELINE), str(f)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and out.stdout == "" and "UNPICKLED" not in out.stderr, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], out.stderr


def test_memtimeline_device_out_of_range_and_a_good_snapshot(tmp_path):
    f = tmp_path / "snap.pickle"
    f.write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 1, "size": 8, "time_us": 0}]]}))
    for dev in ("1", "-1"):
        out = subprocess.run([sys.executable, str(MEMTIMELINE), str(f), "--device", dev], capture_output=True,
                             text=True, timeout=30)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --device"), out.stderr
    out = subprocess.run([sys.executable, str(MEMTIMELINE), str(f)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and json.loads(out.stdout)["peak_bytes"] == 8, out.stderr


def test_edge_exact_smoke_subset_writes_both_files(tmp_path, small_dataset):
    env = {k: v for k, v in os.environ.items()
           if k not in ("BASE_CHECKPOINT_PATH", "WAN_VAE_PATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["DATASET_PATH"] = str(small_dataset)
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "edge_exact.py"), "--smoke", "--only",
                          "head-reference", "--steps", "2", "--grad-accum", "1", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    stem = result_stem("cosmos", "edge-exact", "cpu", smoke=True)
    rows = json.loads((tmp_path / "out" / f"{stem}.json").read_text())["rows"]
    assert [r["config"] for r in rows] == ["HEAD dtypes, reference"] and rows[0]["status"] == "ok"
    assert "| HEAD dtypes, reference |" in (tmp_path / "out" / f"{stem}.md").read_text()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"{stem}.json", f"{stem}.md"]


@pytest.mark.parametrize("name,what", [("edge_24gb", "edge24gb"), ("edge_exact", "edge-exact")])
def test_a_folder_where_a_result_goes_is_refused_before_any_run(scripts, tmp_path, capfd, name, what):
    """A folder named like the result file would make the final write fail after every run: refused up front."""
    stem = result_stem("cosmos", what, "cpu", smoke=True)
    out = tmp_path / "out"
    (out / f"{stem}.json").mkdir(parents=True)
    rc = scripts[name].main(["--smoke", "--out", str(out)])
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: --out") and "in the way" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == [f"{stem}.json"]


def test_metrics_cost_refuses_zero_steps_and_measures_the_metrics_call(tmp_path, capfd, monkeypatch):
    """``--steps 0`` is one line, exit 2, nothing written; a short run writes both files, and its event file holds
    every step's scalars (7 on a CPU: about 45 bytes each). Planted: a run whose scalars never reach the writer
    leaves an event file of its header only, and the byte count sees it."""
    mod = _load("metrics_cost_inputs", "benchmarks/metrics_cost.py")
    from patches.core.errors import cli

    assert cli(lambda: mod.main(["--steps", "0", "--out", str(tmp_path / "o")])) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["error: --steps = 0 must be >= 1"] and not (tmp_path / "o").exists()

    def run() -> dict:
        for p in tmp_path.glob("*metrics-cost*"):
            p.unlink()
        assert mod.main(["--steps", "50", "--out", str(tmp_path)]) == 0
        (js,) = tmp_path.glob("*_core_*_metrics-cost.json")
        assert js.with_suffix(".md").is_file()
        return json.loads(js.read_text())

    rows = run()
    assert rows["steps"] == 50 and rows["event_bytes_per_step"] > 6 * 40

    real = mod._Run

    class Dropped(real):  # planted: the scalars are dropped before the writer
        def __init__(self, metrics, device):
            super().__init__(metrics, device)
            if metrics is not None:
                metrics.log = lambda step, scalars: None

    monkeypatch.setattr(mod, "_Run", Dropped)
    assert run()["event_bytes_per_step"] < 40


@pytest.mark.parametrize("argv, line", [
    (["--layers", "0"], "error: --layers = 0 must be >= 1"),
    (["--layers", "29"], "error: --layers 29: the edge preset has 28 decoder layers; use 1 to 28"),
    (["--preset", "tiny", "--layers", "3"], "error: --layers 3: the tiny preset has 2 decoder layers; use 1 to 2"),
])
def test_save_host_refuses_layers_the_preset_lacks(tmp_path, capfd, argv, line):
    mod = _load("save_host_inputs", "benchmarks/save_host.py")
    from patches.core.errors import cli

    assert cli(lambda: mod.main([*argv, "--out", str(tmp_path / "o")])) == 2
    assert capfd.readouterr().err.strip().splitlines() == [line] and not (tmp_path / "o").exists()


def test_save_host_measures_both_writers_through_the_trainers_save(tmp_path):
    """The tiny preset (its largest tensor's fp32 entry, 7.5 MiB, fits one piece): both modes save through the
    trainer's ``state_dict`` and ``CheckpointManager``, each in its own process, and write one row each."""
    mod = _load("save_host_run", "benchmarks/save_host.py")
    assert mod.main(["--preset", "tiny", "--layers", "2", "--out", str(tmp_path)]) == 0
    (js,) = tmp_path.glob("*_cosmos_cpu_save-host-smoke.json")
    rows = json.loads(js.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["pieces", "whole"] and js.with_suffix(".md").is_file()
    assert rows[0]["chunk_bytes"] == 64 * 2**20 and rows[1]["chunk_bytes"] == 2**40
    assert all(r["file_gib"] > 0 and r["largest_fp32_entry_mib"] == 30528 * 64 * 4 / 2**20 for r in rows)


def test_save_host_a_failed_save_ends_the_measurement_and_the_run_with_one_line(tmp_path, capfd, monkeypatch):
    """A save that fails (here: the checkpoint folder is a file) ends its process instead of leaving the memory
    sampler running for ever; the parent reports a failed measurement as one ``error:`` line and writes nothing."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "save_host.py"), "--preset", "tiny", "--layers", "1",
                        "--child", "pieces", str(afile)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode != 0 and "NotADirectoryError" in r.stderr
    mod = _load("save_host_fail", "benchmarks/save_host.py")
    from patches.core.errors import cli

    monkeypatch.setattr(mod.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, "", "Traceback ...\nOSError: [Errno 28] No space left on device\n"))
    assert cli(lambda: mod.main(["--preset", "tiny", "--out", str(tmp_path / "o")])) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the pieces measurement failed in its own process: OSError: "
                                                "[Errno 28] No space left on device")
    assert not (tmp_path / "o").exists()


def test_save_host_refuses_a_temporary_folder_without_room_for_the_save(tmp_path, capfd, monkeypatch):
    mod = _load("save_host_room", "benchmarks/save_host.py")
    from patches.core.errors import cli

    real = shutil.disk_usage
    monkeypatch.setattr(mod.shutil, "disk_usage", lambda p: real(p)._replace(free=2**20))
    assert cli(lambda: mod.main(["--preset", "tiny", "--out", str(tmp_path / "o")])) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 0.0 GiB free and each save writes about" in err[0] and "set TMPDIR" in err[0]
