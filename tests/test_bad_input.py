"""Bad input, each kind a tester found: one ``error:`` line naming the problem and the fix, exit status 2, nothing
written, no traceback -- and the check runs before anything expensive.

- ``MILES_GPU_BUDGET_GIB`` (abc/0/-3/nan/inf, or set without ``MILES_RESIDENT_BLOCKS=auto``) in ``patches check``,
  ``patches status`` and the H3 launcher's upstream path; ``MILES_RESIDENT_BLOCKS`` above the block count (a one-line
  UserError from the patched ``apply_fsdp2``);
- digits that are not ASCII (``'³'.isdigit()`` is True, ``int('³')`` fails) in every whole-number parser;
- ``patches status`` shows ``MILES_RESIDENT_BLOCKS``'s real value;
- ``miles_ext.recipe.train --gpu-budget-gib inf``;
- ``miles_ext.recipe.export_lora``: NaN adapters, an out path that is a file / under a file / read-only / on a full disk;
- the latent cache: disk full, a read-only shard folder, a directory where an entry belongs, a file where a shard
  folder belongs, ``ONECARD_LATENT_CACHE`` naming a file; a directory passed where a file belongs;
- the ledger / ``DRYRUN=1`` refuse ``COSMOS_FROZEN_BF16=1`` with the stock EMA as the trainer does;
- ``patches check`` with an upstream root that is not a checkout.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from .cli import run_main

REPO = Path(__file__).resolve().parents[1]
FAKE = REPO / "tests" / "fake_miles"
HEAD_TOML = REPO / "toml" / "vision_sft_edge_24gb_head.toml"  # fp32 master, bf16 compute, EMA on


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MILES_", "COSMOS_", "ONECARD_LATENT")) and k not in ("DRYRUN", "TOML_FILE")}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


IN_PROCESS = {m: m for m in ("patches.ledger", "miles_ext.recipe.export_lora", "miles_ext.recipe.train",
                              "cosmos_framework_ext.recipe.train", "cosmos_framework_ext.recipe.prepass")}
IN_PROCESS["patches"] = "patches.__main__"
"""Commands whose refusals need no process of their own: run in this process (:func:`tests.cli.run_main`), with the
upstream packages a root may put on ``sys.path`` isolated."""


def _run(args: list[str], cwd: Path = REPO, **extra: str) -> subprocess.CompletedProcess:
    if args[:2] == [sys.executable, "-m"] and args[2] in IN_PROCESS:
        return run_main(IN_PROCESS[args[2]], args[3:], _env(**extra), cwd, isolate=("cosmos_framework", "miles"))
    return subprocess.run(args, env=_env(**extra), capture_output=True, text=True, cwd=cwd, timeout=120)


def _one_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    """rc 2, exactly one ``error:`` line (containing every needle), no traceback; returns that line."""
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("error:")]
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _one_error_captured(capsys, rc: int, *needles: str) -> str:
    out = capsys.readouterr()
    lines = [ln for ln in (out.out + out.err).splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(lines) == 1, out.out + out.err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# ------------------------------------------------------------------ 1. MILES_GPU_BUDGET_GIB, checked up front
@pytest.mark.parametrize("raw", ["abc", "0", "-3", "nan", "inf", "1e999"])
def test_bad_gpu_budget_is_one_line_in_check_and_status(raw):
    env = {"MILES_ONECARD_FSDP": "1", "MILES_RESIDENT_BLOCKS": "auto", "MILES_GPU_BUDGET_GIB": raw}
    for cmd in ("check", "status"):
        line = _one_error(_run([sys.executable, "-m", "patches", cmd], **env), "MILES_GPU_BUDGET_GIB")
        assert "--gpu-budget-gib" not in line


def test_gpu_budget_without_resident_blocks_auto_is_refused():
    from patches.core.flags import FlagError, read_miles

    for blocks in ("", "3"):
        with pytest.raises(FlagError, match="MILES_GPU_BUDGET_GIB=40 .* MILES_RESIDENT_BLOCKS=auto"):
            read_miles({"MILES_ONECARD_FSDP": "1", "MILES_RESIDENT_BLOCKS": blocks, "MILES_GPU_BUDGET_GIB": "40"})
    assert read_miles({"MILES_ONECARD_FSDP": "1", "MILES_RESIDENT_BLOCKS": "auto", "MILES_GPU_BUDGET_GIB": "40"})
    _one_error(_run([sys.executable, "-m", "patches", "check"], MILES_GPU_BUDGET_GIB="40"), "MILES_RESIDENT_BLOCKS=auto")


def test_launcher_checks_the_budget_before_upstream_starts(tmp_path):
    root = tmp_path / "miles_diffusion"
    shutil.copytree(FAKE, root)
    marker = tmp_path / "started"
    (root / "train_diffusion.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    launcher = ["bash", str(REPO / "launchers" / "sft_h3_t2va_1gpu.sh")]
    base = {"MILES_DIFFUSION_ROOT": str(root), "MILES_ONECARD_FSDP": "1"}
    for extra in ({"MILES_RESIDENT_BLOCKS": "auto", "MILES_GPU_BUDGET_GIB": "nan"},
                  {"MILES_GPU_BUDGET_GIB": "24"}, {"MILES_RESIDENT_BLOCKS": "auto", "MILES_GPU_BUDGET_GIB": "-3"}):
        _one_error(_run(launcher, **base, **extra), "MILES_GPU_BUDGET_GIB")
        assert not marker.exists()


def test_sync_h2d_without_partial_residency_is_refused(tmp_path, capsys):
    from miles_ext.recipe.train import main

    for extra in ([], ["--fsdp-cpu-offload"]):
        rc = main(["--preset", "tiny", "--validate-only", "--fsdp-sync-h2d", "--output-dir", str(tmp_path / "o"),
                   *extra])
        _one_error_captured(capsys, rc, "--fsdp-sync-h2d", "--fsdp-resident-blocks")
    assert not (tmp_path / "o").exists()


def test_launcher_refuses_a_bad_resident_blocks_value(tmp_path):
    launcher = ["bash", str(REPO / "launchers" / "sft_h3_t2va_1gpu.sh"), "--output-dir", str(tmp_path / "out")]
    for bad in ("x", "-1", "2.5"):
        _one_error(_run(launcher, RESIDENT_BLOCKS=bad), f"RESIDENT_BLOCKS={bad!r}")
    _one_error(_run(launcher + ["--fsdp-resident-blocks", "3"], RESIDENT_BLOCKS="2"), "keep one")
    root = tmp_path / "miles_diffusion"
    shutil.copytree(FAKE, root)
    for var in ("RESIDENT_BLOCKS", "FROM_GPUS"):  # upstream runs its own flags: these would be ignored
        _one_error(_run(launcher, MILES_DIFFUSION_ROOT=str(root), **{var: "2"}), var, "MILES_DIFFUSION_ROOT")
    assert not (tmp_path / "out").exists()


def test_resident_blocks_above_the_block_count_is_a_one_line_user_error(capsys):
    from tests.equivalence.h3_tiny_run import make_lora_model
    from miles_ext.upstream.patches import patched_apply_fsdp2, resident_indices
    from patches.core.errors import UserError

    model = make_lora_model(seed=0)
    no_split = ["MiniMaxH3TransformerBlock", "MiniMaxH3TokenRefinerBlock", "MiniMaxH3AdaLayerNormOut"]
    with pytest.raises(UserError, match=r"MILES_RESIDENT_BLOCKS=999 but this model has \d+ FSDP blocks") as e:
        resident_indices(model, no_split, "999")
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="MILES_GPU_BUDGET_GIB='inf'"):
        resident_indices(model, no_split, "auto", {"MILES_GPU_BUDGET_GIB": "inf"})
    apply = patched_apply_fsdp2(lambda *a, **k: None)
    plan = SimpleNamespace(no_split_modules=no_split, param_dtype_patterns={})
    os.environ["MILES_RESIDENT_BLOCKS"] = "999"
    try:
        with pytest.raises(UserError):
            apply(model, plan, cpu_offload=True)
    finally:
        del os.environ["MILES_RESIDENT_BLOCKS"]
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "MILES_RESIDENT_BLOCKS=999" in err


# ------------------------------------------------------------------ 2. digits that are not ASCII
def test_non_ascii_digits_are_refused_everywhere(tmp_path):
    from patches.core.errors import UserError
    from patches.core.flags import MILES_RESIDENT_BLOCKS, FlagError, is_whole_number, parse_resident_blocks

    assert "³".isdigit() and not is_whole_number("³") and not is_whole_number("٣") and is_whole_number("07")
    with pytest.raises(FlagError, match="MILES_RESIDENT_BLOCKS='³'"):
        MILES_RESIDENT_BLOCKS.value({"MILES_RESIDENT_BLOCKS": "³"})
    with pytest.raises(UserError, match="--fsdp-resident-blocks '³'"):
        parse_resident_blocks("³", "--fsdp-resident-blocks")
    _one_error(_run([sys.executable, "-m", "patches", "status"], MILES_ONECARD_FSDP="1", MILES_RESIDENT_BLOCKS="³"),
               "MILES_RESIDENT_BLOCKS")
    _one_error(_run([sys.executable, "-m", "patches.core.ports", "check", "MASTER_PORT", "³"]), "MASTER_PORT")
    out = tmp_path / "run"
    _one_error(_run([sys.executable, "-m", "miles_ext.recipe.train", "--fsdp-cpu-offload", "--fsdp-resident-blocks", "³",
                     "--validate-only", "--output-dir", str(out)]), "--fsdp-resident-blocks")
    _one_error(_run([sys.executable, "-m", "miles_ext.recipe.train", "--validate-only", "--output-dir", str(out)],
                    MASTER_PORT="٣٣"), "MASTER_PORT")
    assert not out.exists()


# ------------------------------------------------------------------ 3. status shows the real value
@pytest.mark.parametrize("value,shown", [("auto", "auto"), ("3", "3"), ("0", "0"), ("", "(unset")])
def test_status_shows_the_resident_blocks_value(value, shown):
    r = _run([sys.executable, "-m", "patches", "status"], MILES_ONECARD_FSDP="1", MILES_RESIDENT_BLOCKS=value)
    assert r.returncode == 0, r.stderr
    assert f"MILES_RESIDENT_BLOCKS={shown}" in r.stdout


# ------------------------------------------------------------------ 4. --gpu-budget-gib inf
@pytest.mark.parametrize("budget", ["inf", "nan"])
def test_h3_trainer_refuses_a_non_finite_budget(tmp_path, budget):
    out = tmp_path / "run"
    _one_error(_run([sys.executable, "-m", "miles_ext.recipe.train", "--fsdp-cpu-offload", "--fsdp-resident-blocks", "auto",
                     "--gpu-budget-gib", budget, "--output-dir", str(out)]), "--gpu-budget-gib", "finite")
    assert not out.exists()


# ------------------------------------------------------------------ 5. export_lora
def _checkpoint(path: Path, bad: bool = False) -> Path:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 8, generator=g), torch.randn(8, 2, generator=g)
    if bad:
        b[3, 1] = float("nan")
    torch.save({"lora": {"transformer_blocks.0.attn.to_q.lora_A.default.weight": a,
                         "transformer_blocks.0.attn.to_q.lora_B.default.weight": b},
                "lora_meta": {"rank": 2, "alpha": 4.0, "target_modules": ["attn.to_q"]}}, path)
    return path


def test_export_refuses_nan_adapters(tmp_path):
    bad = _checkpoint(tmp_path / "bad.pt", bad=True)
    before = _tree(tmp_path)
    _one_error(_run([sys.executable, "-m", "miles_ext.recipe.export_lora", str(bad), str(tmp_path / "o1"), "--comfyui"]),
               "NaN/inf", "lora_B", "damaged")
    assert _tree(tmp_path) == before


def test_export_refuses_bad_paths(tmp_path, capsys):
    from miles_ext.recipe import export_lora

    good = _checkpoint(tmp_path / "good.pt")
    (tmp_path / "afile").write_text("x")
    before = _tree(tmp_path)
    for args, want in (([good, tmp_path / "afile"], "is a file, not a directory"),
                       ([good, tmp_path / "afile" / "sub" / "out"], "cannot write the adapter"),
                       ([tmp_path, tmp_path / "o2"], "is a directory, not a file")):
        _one_error_captured(capsys, export_lora.main([str(a) for a in args]), want)
        assert _tree(tmp_path) == before
    assert export_lora.main([str(good), str(tmp_path / "new" / "o3")]) == 0
    assert (tmp_path / "new" / "o3" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("fault", ["read-only", "disk-full"])
def test_export_write_failure_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, fault):
    import safetensors.torch
    import tempfile

    from miles_ext.recipe import export_lora

    good = _checkpoint(tmp_path / "good.pt")
    before = _tree(tmp_path)
    if fault == "read-only":  # root ignores chmod: fail where mkdtemp would
        def mkdtemp(*a, **k):
            raise PermissionError(errno.EROFS, "Read-only file system", str(tmp_path))
        monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    else:
        real = safetensors.torch.save_file

        def save_file(tensors, filename, metadata=None):
            if "pytorch_lora" in str(filename):
                raise safetensors.SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
            return real(tensors, filename, metadata=metadata)
        monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    rc = export_lora.main([str(good), str(tmp_path / "deep" / "out")])
    _one_error_captured(capsys, rc, "cannot write the adapter", str(tmp_path / "deep" / "out"))
    assert _tree(tmp_path) == before


# ------------------------------------------------------------------ 6. the latent cache
@pytest.fixture()
def cache(tmp_path):
    from cosmos_framework_ext.levers import latent_cache as lc

    video = tmp_path / "clip.mp4"
    video.write_bytes(b"not really a video")
    c = lc.LatentCache(tmp_path / "latents", {"dtype": "float32", "config": "{}"})
    item = lc.CacheItem(video, (0, 1), (16, 16))
    return c, item, c.path(c.key(item))


@pytest.mark.parametrize("fault", ["disk-full", "read-only", "entry-is-dir", "shard-is-file"])
def test_latent_cache_write_failures_are_one_line(cache, monkeypatch, fault):
    import tempfile

    import safetensors.torch

    from cosmos_framework_ext.levers import latent_cache as lc

    c, item, path = cache
    if fault == "disk-full":
        def save_file(*a, **k):
            Path(a[1]).write_bytes(b"half")  # a partial temporary file, as a full disk leaves one
            raise safetensors.SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
        monkeypatch.setattr(safetensors.torch, "save_file", save_file)
        want = "disk is full"
    elif fault == "read-only":  # root ignores chmod: fail where the temporary file is made
        def mkstemp(*a, **k):
            raise OSError(errno.EROFS, "Read-only file system")
        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
        want = "read-only"
    elif fault == "entry-is-dir":
        path.mkdir(parents=True)
        want = "is a directory where an entry file belongs"
    else:
        c.root.mkdir()
        path.parent.write_text("x")
        want = "is a file where a shard folder belongs"
    before = _tree(c.root) if c.root.exists() else set()
    with pytest.raises(lc.LatentCacheError) as e:
        c.store(item, torch.zeros(1, 2, 1, 1, 1))
    msg = str(e.value)
    assert "\n" not in msg and f"latent cache folder {c.root}" in msg and want in msg and "ONECARD_LATENT_CACHE" in msg
    assert (_tree(c.root) if c.root.exists() else set()) == before  # no temporary file left


def test_latent_cache_folder_that_is_a_file_and_toml_that_is_a_directory(tmp_path):
    toml = REPO / "toml" / "vision_sft_edge_24gb.toml"
    afile = tmp_path / "afile"
    afile.write_text("x")
    cli = [sys.executable, "-m", "cosmos_framework_ext.recipe.prepass", "--no-progress"]
    _one_error(_run(cli + ["--toml", str(toml)], ONECARD_LATENT_CACHE=str(afile)),
               "is a file, not a folder", "ONECARD_LATENT_CACHE")
    _one_error(_run(cli + ["--toml", str(tmp_path)]), "is a directory, not a file")
    out = tmp_path / "out"
    _one_error(_run([sys.executable, "-m", "cosmos_framework_ext.recipe.train", "--sft-toml", str(toml), "--validate-only"],
                    COSMOS_LATENT_CACHE="1", ONECARD_LATENT_CACHE=str(afile), OUTPUT_ROOT=str(out)),
               "is a file, not a folder")
    _one_error(_run([sys.executable, "-m", "patches.ledger", "--toml", str(tmp_path)]), "is a directory, not a file")
    _one_error(_run(["bash", str(REPO / "launchers" / "sft_edge_24gb.sh")], DRYRUN="1", TOML_FILE=str(tmp_path)),
               "is a directory, not a file")
    assert _tree(tmp_path) == {"afile"}


def test_trainer_prepass_write_failure_is_one_line(tmp_path, monkeypatch, sample_dataset):
    """What the trainer (and the CLI) call: run_prepass over the tiny VAE, with a full disk."""
    import safetensors.torch

    from cosmos_framework_ext.levers import latent_cache as lc
    from cosmos_framework_ext.recipe.data import cache_items
    from cosmos_framework_ext.recipe.presets import build_vae, get_preset
    from cosmos_framework_ext.recipe.vae import online_latent
    from patches.core.data.rows import load_records

    def save_file(*a, **k):
        raise safetensors.SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    tiny = get_preset("tiny")
    torch.manual_seed(0)
    vae = build_vae(tiny)
    from patches.core.data.rows import SampleRecord

    r = load_records(sample_dataset)[0]
    rec = SampleRecord(0, 1, r.video, r.video_path, "a", r.fps, r.width, r.height, ((0, 5),))
    with pytest.raises(lc.LatentCacheError, match="latent cache folder .* disk is full"):
        lc.run_prepass(vae, torch.device("cpu"), cache_items([rec], tiny), encode=online_latent, progress=False,
                       root=tmp_path / "latents")
    assert not [p for p in (tmp_path / "latents").rglob("*") if p.is_file()]


# ------------------------------------------------------------------ 7. the ledger refuses what the trainer refuses
def test_ledger_and_dryrun_refuse_frozen_bf16_with_the_stock_ema():
    from cosmos_framework_ext.levers.frozen_bf16 import check_with_ema
    from patches.core.errors import UserError

    with pytest.raises(UserError) as e:
        check_with_ema(True, True, False)
    want = f"error: {e.value}"
    line = _one_error(_run([sys.executable, "-m", "patches.ledger", "--toml", str(HEAD_TOML)], COSMOS_FROZEN_BF16="1"))
    assert line == want
    line = _one_error(_run(["bash", str(REPO / "launchers" / "sft_edge_24gb.sh")], DRYRUN="1",
                           TOML_FILE=str(HEAD_TOML), COSMOS_FROZEN_BF16="1"))
    assert line == want


def test_frozen_bf16_no_effect_message_says_the_real_reason():
    from cosmos_framework_ext.recipe.train import CosmosSFT

    def why(device: str, precision: str) -> str:
        fake = SimpleNamespace(device=torch.device(device), cfg=SimpleNamespace(model=SimpleNamespace(precision=precision)))
        return CosmosSFT._why_not_mixed(fake)

    assert "no bf16 compute on the CPU" in why("cpu", "bfloat16") and "fsdp_master_dtype" not in why("cpu", "bfloat16")
    assert "precision" in why("cuda", "float32")
    assert 'fsdp_master_dtype = "float32"' in why("cuda", "bfloat16")


# ------------------------------------------------------------------ 8. patches check with a root that is not a checkout
@pytest.mark.parametrize("var", ["COSMOS_FRAMEWORK_ROOT", "MILES_DIFFUSION_ROOT"])
def test_check_refuses_a_root_that_is_not_a_checkout(tmp_path, var):
    _one_error(_run([sys.executable, "-m", "patches", "check"], **{var: str(tmp_path)}), var, "not a")
    r = _run([sys.executable, "-m", "patches", "status"], **{var: str(tmp_path)})
    trainer = "embedded H3 trainer" if var == "MILES_DIFFUSION_ROOT" else "embedded reference trainer"
    _one_error(r, var, "not a", "point it at the folder that holds", f"or unset it to run the {trainer}")
    assert r.stdout == ""  # refused before any report is printed
    assert _tree(tmp_path) == set()


def test_the_launcher_gives_the_same_advice_for_a_folder_that_is_not_a_cosmos_checkout(tmp_path):
    advice = "point it at the folder that holds cosmos_framework/, or unset it to run the embedded reference trainer"
    _one_error(_run(["bash", str(REPO / "launchers" / "sft_edge_24gb.sh")], COSMOS_FRAMEWORK_ROOT=str(tmp_path)), advice)
    _one_error(_run([sys.executable, "-m", "patches", "status"], COSMOS_FRAMEWORK_ROOT=str(tmp_path)), advice)
    assert _tree(tmp_path) == set()


@pytest.mark.parametrize("setting", ["folder-is-a-file", "check-not-a-boolean", "decode-not-a-boolean"])
def test_check_refuses_a_bad_latent_cache_setting_before_upstream_starts(tmp_path, setting):
    """The launcher's upstream branch runs ``patches check`` first: a latent cache folder that is a file, or a check
    or decode switch that is not a boolean, is one line there (not a traceback inside upstream's model init)."""
    (tmp_path / "f").write_text("")
    switch = "ONECARD_LATENT_CACHE_CHECK" if setting == "check-not-a-boolean" else "ONECARD_LATENT_CACHE_DECODE"
    extra = ({"ONECARD_LATENT_CACHE": str(tmp_path / "f")} if setting == "folder-is-a-file" else
             {"ONECARD_LATENT_CACHE": str(tmp_path / "c"), switch: "maybe"})
    _one_error(run_main("patches.__main__", ["check"], _env(COSMOS_LATENT_CACHE="1", **extra), REPO),
               "ONECARD_LATENT_CACHE")
    assert _tree(tmp_path) == {"f"}


def test_check_applies_the_miles_table_of_a_checkout():
    r = run_main("patches.__main__", ["check"], _env(MILES_DIFFUSION_ROOT=str(FAKE), MILES_ONECARD_FSDP="1"), REPO,
                 isolate=("miles",))
    assert r.returncode == 0 and "apply_fsdp2" in r.stdout, r.stderr


@pytest.mark.parametrize("value", ["banana", "0", "-1", "inf"])
def test_sampler_interval_is_checked_before_anything_runs(tmp_path, value):
    """``ONECARD_SAMPLE_S`` (the memory sampler's interval): one error at validation, not a traceback in training."""
    out = tmp_path / "out"
    _one_error(_run([sys.executable, "-m", "cosmos_framework_ext.recipe.train", "--sft-toml",
                     str(REPO / "toml" / "vision_sft_edge_24gb.toml"), "--validate-only"],
                    ONECARD_SAMPLE_S=value, OUTPUT_ROOT=str(out)), "ONECARD_SAMPLE_S")
    assert not out.exists() or not any(out.rglob("*.pt"))


@pytest.mark.parametrize("edit, needle", [
    (("compile_blocks = true", 'compile_blocks = false\ncompile_wrapper = "cpp"'), "[onecard].compile_wrapper = \"cpp\""),
    (('distributed_parallelism = "fsdp"', 'distributed_parallelism = "ddp"'),
     "[trainer].distributed_parallelism = 'ddp'"),
    (('precision                    = "bfloat16"', 'precision                    = "float16"'), "[model].precision = 'float16'"),
], ids=["cpp-wrapper-uncompiled", "ddp", "float16"])
def test_ledger_and_dryrun_refuse_what_the_trainer_refuses(tmp_path, edit, needle):
    text = (REPO / "toml" / "vision_sft_edge_24gb.toml").read_text()
    assert edit[0] in text
    toml = tmp_path / "recipe.toml"
    toml.write_text(text.replace(edit[0], edit[1]))
    trainer = _one_error(_run([sys.executable, "-m", "cosmos_framework_ext.recipe.train", "--sft-toml", str(toml),
                               "--validate-only"], OUTPUT_ROOT=str(tmp_path / "out")), needle)
    assert _one_error(_run([sys.executable, "-m", "patches.ledger", "--toml", str(toml)]), needle) == trainer
    assert _one_error(_run(["bash", str(REPO / "launchers" / "sft_edge_24gb.sh")], DRYRUN="1", TOML_FILE=str(toml)),
                      needle) == trainer
