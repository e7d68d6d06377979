"""The H3 (MiniMax LoRA SFT) command lines checked by meaning: the trainer's flags, the translator's upstream flags,
the exporter's checkpoint, and a run in which every step was skipped.

Each refusal is one ``error:`` line, exit status 2, nothing written; each kind has a planted check next to it (the
check switched off lets the bad value through, or the good neighbouring value passes), so the test can fail.
CPU only, in-process, no dataset encoding and no model build except where a check needs the preset's layers.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from miles_ext.recipe import export_lora, meanings, translate
from miles_ext.recipe import train as h3


def _one_error(capsys, rc: int, *needles: str) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), (rc, err)
    assert all(n in err[0] for n in needles), err[0]
    return err[0]


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# ------------------------------------------------------------------ 1. the trainer's flags
@pytest.fixture
def no_dataset(monkeypatch):
    """``--validate-only`` without the sample dataset's build (the dataset is not what these tests check)."""
    def fake(self):
        self.dataset_sha = "0" * 16

    monkeypatch.setattr(h3.H3SFTRecipe, "_check_dataset", fake)


@pytest.mark.parametrize("args,needle", [
    (["--lr", "5"], "--lr = 5.0 must be > 0 and <= 1"),
    (["--lr", "1.5"], "--lr = 1.5 must be > 0 and <= 1"),
    (["--lora-alpha", "1e30"], "--lora-alpha = 1e+30 must be > 0 and <= 1e+06"),
    (["--lora-alpha", "nan"], "--lora-alpha = nan must be a finite number"),
    (["--lora-alpha", "1e6"], "--lora-alpha 1e+06 / --lora-rank 64 x --lr 0.0001 = 1.56"),
    (["--lr", "1"], "--lora-alpha 128 / --lora-rank 64 x --lr 1 = 2"),
    (["--lora-rank", "100000000"], "--lora-rank = 100000000 must be >= 1 and <= 65536"),
    (["--rollout-batch-size", str(2 ** 32), "--num-steps-per-rollout", "1"], "more than 1048576"),
    (["--rollout-batch-size", str(2 ** 20), "--n-samples-per-prompt", "2", "--num-steps-per-rollout", "1"],
     "= 2097152 samples a rollout is more than 1048576"),
], ids=["lr-5", "lr-1.5", "alpha-1e30", "alpha-nan", "adapter-step-alpha", "adapter-step-lr", "rank-1e8",
        "rollout-2**32", "rollout-samples-2**21"])
def test_trainer_refuses_numbers_of_a_wrong_meaning(tmp_path, capsys, args, needle):
    out = tmp_path / "run"
    _one_error(capsys, h3.main([*args, "--validate-only", "--output-dir", str(out)]), needle)
    assert not out.exists()


def test_trainer_planted_good_neighbours_pass(tmp_path, capsys, monkeypatch, no_dataset):
    """lr 1 and alpha/rank x lr = 1 exactly are accepted; with the adapter-step rule off, alpha 1e6 gets through."""
    monkeypatch.setattr(h3.H3SFTRecipe, "_check_lora_targets", lambda self: None)
    out = tmp_path / "run"
    for args in (["--lr", "0.5"], ["--lr", "1", "--lora-alpha", "64"], ["--lora-alpha", "6.4e5"],
                 ["--rollout-batch-size", "64", "--num-steps-per-rollout", "8"]):
        assert h3.main([*args, "--validate-only", "--output-dir", str(out)]) == 0, capsys.readouterr().err
    monkeypatch.setattr(meanings, "adapter_step_problem", lambda *a, **k: None)
    assert h3.main(["--lora-alpha", "1e6", "--validate-only", "--output-dir", str(out)]) == 0
    assert "inputs OK" in capsys.readouterr().out and not out.exists()


def test_trainer_refuses_a_rank_above_the_narrowest_targeted_layer(tmp_path, capsys, no_dataset):
    """The tiny preset's narrowest H3 target is 64 wide: rank 65 adds memory, no capacity (planted: 64 passes)."""
    out = tmp_path / "run"
    _one_error(capsys, h3.main(["--preset", "tiny", "--lora-rank", "65", "--validate-only", "--output-dir", str(out)]),
               "--lora-rank 65 is above the width 64 of", "tiny preset")
    assert not out.exists()
    assert h3.main(["--preset", "tiny", "--lora-rank", "64", "--validate-only", "--output-dir", str(out)]) == 0
    assert not out.exists()


def test_n_samples_per_prompt_fills_every_slot_of_the_schedule(tmp_path, monkeypatch):
    """``--n-samples-per-prompt 3`` with a rollout larger than the dataset: the pairs were repeated to the rollout's
    prompts only, so the schedule indexed past them (IndexError after validate-only had said OK)."""
    from types import SimpleNamespace

    from miles_ext.recipe.presets import get_preset
    from miles_ext.recipe.schedule import pair_schedule

    pair = SimpleNamespace(text=torch.zeros(2, 4), audio=torch.zeros(1, 2, 3), video=torch.zeros(1, 24, 1, 2, 2))
    monkeypatch.setattr(h3, "encode_pairs", lambda *a, **k: ([pair] * 5, {"rows": 5, "dataset": "x", "cache_hits": 5,
                                                                       "cache_misses": 0, "encode_s": 0.0}))
    cfg = h3.H3SFTConfig(rollout_batch_size=8, n_samples_per_prompt=3, num_steps_per_rollout=3, from_gpus=8,
                         output_dir=str(tmp_path / "run"))
    recipe = h3.H3SFTRecipe(cfg)
    recipe._check_batch()
    recipe.preset, recipe.device = get_preset("tiny"), torch.device("cpu")
    recipe._load_data()
    recipe.data_gen, recipe.orders_drawn = torch.Generator().manual_seed(0), 0
    pairs = recipe._rollout_pairs(0)
    used = {i for step in pair_schedule(recipe.gbs, 8, 3, 1) for slot in step for i in slot.pairs}
    assert max(used) < len(pairs) == 24  # every slot the schedule trains has its pair
    assert max(used) >= cfg.rollout_batch_size  # planted: the old fill (to rollout_batch_size pairs) falls short


# ------------------------------------------------------------------ 2. every step skipped
def _skipping_recipe(tmp_path, taken_steps: set[int]) -> h3.H3SFTRecipe:
    """An H3 recipe whose optimizer steps go through the real guard with a finite loss and an inf gradient norm
    (skipped) except ``taken_steps``; the rest of the run (model, data) is not built."""
    from miles_ext.levers.finite_step import NonFiniteGuard

    recipe = h3.H3SFTRecipe(h3.H3SFTConfig(rollout_batch_size=16, num_steps_per_rollout=2, num_rollout=2,
                                           output_dir=str(tmp_path / "run")))
    recipe._check_batch()
    recipe.device = torch.device("cpu")
    recipe.guard = NonFiniteGuard(max_consecutive=0, say=lambda line: None)
    recipe._rollout_pairs = lambda step: list(range(recipe.gbs * 2))
    seen = []

    def optimizer_step(rollout, s, steps, slots, rollout_pairs):  # as _optimizer_step: the loss recorded is finite
        norm = torch.tensor(1.0 if len(seen) in taken_steps else math.inf)
        seen.append(recipe.guard.take_step([2.5], norm))
        recipe.losses.append(2.5)
        return 2.5

    recipe._optimizer_step = optimizer_step
    recipe.summary = lambda *a: {"summarised": True}
    return recipe


def _finish(recipe) -> int:
    from patches.core.errors import cli
    from patches.core.trainer import finish

    return cli(lambda: finish(recipe, 0, [recipe.train_step(0), recipe.train_step(1)], None) and 0)


def test_a_run_whose_every_step_was_skipped_is_refused(tmp_path, capsys):
    recipe = _skipping_recipe(tmp_path, taken_steps=set())
    _one_error(capsys, _finish(recipe), "every one of this run's 2 rollout(s) had a non-finite loss", "nothing was "
               "learned")
    assert recipe.guard.skipped_steps == 4 and all(math.isfinite(x) for x in recipe.losses)  # finite, yet skipped
    assert not (tmp_path / "run").exists()  # no summary.json


def test_planted_one_step_taken_is_a_run_that_learned(tmp_path, capsys):
    recipe = _skipping_recipe(tmp_path, taken_steps={3})
    assert _finish(recipe) == 0 and recipe.guard.skipped_steps == 3
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------ 3. the translator
BASE = ["--from-gpus", "8", "--rollout-batch-size", "32", "--num-steps-per-rollout", "4", "--use-lora"]


@pytest.mark.parametrize("args,needle", [
    (["--actor-num-gpus-per-node", "-8", "--actor-num-nodes", "-1"], "--actor-num-gpus-per-node = -8 must be >= 1"),
    (["--actor-num-gpus-per-node", "8", "--actor-num-nodes", "0"], "--actor-num-nodes = 0 must be >= 1"),
    (["--lora-rank", "-3"], "--lora-rank = -3 must be >= 1"),
    (["--lora-alpha", "nan"], "--lora-alpha = nan must be a finite number"),
    (["--lora-alpha", "0"], "--lora-alpha = 0.0 must be > 0"),
    (["--seed", "-5"], "--seed = -5 must be >= 0"),
    (["--lr", "nan"], "--lr = nan must be a finite number"),
    (["--lr=5"], "--lr = 5.0 must be > 0 and <= 1"),
    (["--clip-grad", "-1"], "--clip-grad = -1.0 must be > 0"),
    (["--lora-rank", "64", "--lora-alpha", "1e6", "--lr", "1e-4"], "--lora-alpha 1e+06 / --lora-rank 64 x --lr"),
    (["--micro-batch-size", "0"], "--micro-batch-size = 0 must be >= 1"),
    (["--global-batch-size", "-8"], "--global-batch-size = -8 must be >= 1"),
    (["--n-samples-per-prompt", str(2 ** 70)], "does not fit a 64-bit signed integer"),
    (["--n-samples-per-prompt", "٣"], "--n-samples-per-prompt: '٣' is not a number in ASCII digits"),
    (["--n-samples-per-prompt", str(2 ** 21)], "samples a rollout is more than 1048576"),
    (["--seed", "9" * 5000], "--seed: 9999999999999999999999999999999999999999... does not fit a 64-bit"),
    (["--seed", " 7 "], "--seed: ' 7 ' has spaces or underscores"),
    (["--lora-alpha", "\u0661\u0662\u0668"], "--lora-alpha: '١٢٨' is not a number in ASCII digits"),
    (["--lr", "1_0e-5"], "--lr: '1_0e-5' has spaces or underscores"),
    (["--clip-grad", " 1.0"], "--clip-grad: ' 1.0' has spaces or underscores"),
    (["--data-path", "/d/\udcff"], "is not valid UTF-8"),
], ids=["gpus-negative-product", "nodes-0", "rank-negative", "alpha-nan", "alpha-0", "seed-negative", "lr-nan",
        "lr-5", "clip-negative", "adapter-step", "mbs-0", "gbs-negative", "n-70-bit", "n-arabic-digit",
        "rollout-2**21", "seed-5000-digits", "seed-spaces", "alpha-arabic-digits", "lr-underscore", "clip-space",
        "not-utf8"])
def test_translator_refuses_what_the_trainer_refuses(tmp_path, capsys, args, needle):
    out = tmp_path / "line.txt"
    _one_error(capsys, translate.main([*BASE, *args, "--out", str(out)]), needle)
    assert not out.exists() and capsys.readouterr().out == ""


@pytest.mark.parametrize("argv,needle", [
    (["--from-gpus", "٨", "--rollout-batch-size", "32", "--use-lora"], "--from-gpus: '٨' is not a number in ASCII digits"),
    (["--from-gpus", str(2 ** 70), "--to-gpus", str(2 ** 70), "--rollout-batch-size", "8", "--use-lora"],
     "--from-gpus: 1180591620717411303424 does not fit a 64-bit signed integer"),
    (["--from-gpus", "8", "--rollout-batch-size", "8", "--use-lora", "--actor-num-nodes", "3"],
     "--actor-num-nodes 3 does not divide --from-gpus 8"),
], ids=["from-gpus-arabic", "from-gpus-70-bit", "nodes-not-dividing"])
def test_translator_refuses_bad_gpu_counts(tmp_path, capsys, argv, needle):
    out = tmp_path / "line.txt"
    _one_error(capsys, translate.main([*argv, "--out", str(out)]), needle)
    assert not out.exists()


def test_translator_planted(tmp_path, capsys, monkeypatch):
    """The good neighbours pass (and ``--lr=1e-4`` stays one token); with the number checks off, the bad ones get
    through to the translated line."""
    out = tmp_path / "line.txt"
    good = [*BASE, "--lora-rank", "64", "--lora-alpha", "128", "--lr=1e-4", "--clip-grad", "1.0", "--seed", "0",
            "--actor-num-gpus-per-node", "8", "--actor-num-nodes", "1"]
    assert translate.main([*good, "--out", str(out)]) == 0
    line = out.read_text()
    assert " --lr=1e-4 " in line and "--clip-grad 1.0" in line and capsys.readouterr().err == ""
    monkeypatch.setattr(translate, "_check_numbers", lambda values: None)
    assert translate.main([*BASE, "--lr=5", "--lora-alpha", "nan"]) == 0
    assert "--lr=5" in capsys.readouterr().out


# ------------------------------------------------------------------ 4. the exporter
A_KEY = "transformer_blocks.0.attn.to_q.lora_A.default.weight"
B_KEY = "transformer_blocks.0.attn.to_q.lora_B.default.weight"


def _ckpt(path: Path, a=None, b=None, **meta) -> Path:
    g = torch.Generator().manual_seed(0)
    lora = {A_KEY: torch.randn(2, 8, generator=g) if a is None else a,
            B_KEY: torch.randn(8, 2, generator=g) if b is None else b}
    torch.save({"lora": {k: v for k, v in lora.items() if v is not False},
                "lora_meta": {"rank": 2, "alpha": 4.0, "target_modules": ["attn.to_q"], **meta}}, path)
    return path


BAD_CHECKPOINTS = {
    "rank-mismatch": (dict(a=torch.randn(3, 8)), "lora_A [3, 8] and lora_B [8, 2] are not of lora_meta's rank 2"),
    "meta-rank-mismatch": (dict(rank=4), "are not of lora_meta's rank 4"),
    "A-3d": (dict(a=torch.randn(2, 8, 1)), "has shape [2, 8, 1], not a 2-D LoRA matrix"),
    "B-1d": (dict(b=torch.randn(16)), "has shape [16], not a 2-D LoRA matrix"),
    "int-dtype": (dict(a=torch.ones(2, 8, dtype=torch.int64)), "has dtype torch.int64, not a floating-point one"),
    "complex": (dict(a=torch.ones(2, 8, dtype=torch.complex64)), "has dtype torch.complex64"),
    "nan": (dict(b=torch.full((8, 2), math.nan)), "holds NaN/inf values"),
    "fp64-beyond-fp32": (dict(a=torch.full((2, 8), 1e300, dtype=torch.float64)), "holds NaN/inf values"),
    "missing-B": (dict(b=False), "has only ['lora_A']"),
    "not-a-tensor": (dict(a=[[1.0]]), "is a list, not a dense tensor"),
    "alpha-nan": (dict(alpha=math.nan), "lora_meta['alpha'] = nan must be a finite number"),
    "alpha-negative": (dict(alpha=-4.0), "lora_meta['alpha'] = -4.0 must be > 0"),
    "alpha-text": (dict(alpha="x"), "lora_meta['alpha'] = 'x' is not a number"),
    "rank-0": (dict(rank=0), "lora_meta['rank'] = 0 must be >= 1"),
    "rank-text": (dict(rank="two"), "lora_meta['rank'] = 'two' is not a whole number"),
    "targets-a-string": (dict(target_modules="attn.to_q"), "is not a non-empty list of module names"),
}


@pytest.mark.parametrize("comfyui", [False, True], ids=["peft", "comfyui"])
@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_export_refuses_inconsistent_lora_tensors(tmp_path, capsys, case, comfyui):
    kw, needle = BAD_CHECKPOINTS[case]
    ckpt = _ckpt(tmp_path / "iter_000000001.pt", **kw)
    before = _tree(tmp_path)
    rc = export_lora.main([str(ckpt), str(tmp_path / "adapter"), *(["--comfyui"] if comfyui else [])])
    _one_error(capsys, rc, needle)
    assert _tree(tmp_path) == before  # nothing written, no temporary left


def test_export_planted(tmp_path, capsys, monkeypatch):
    """The good checkpoint (bf16 too) exports; with the checks off, a rank mismatch is written as a silently wrong
    adapter and a string of target modules becomes PEFT targets of one character each."""
    import json

    assert export_lora.main([str(_ckpt(tmp_path / "good.pt")), str(tmp_path / "good")]) == 0
    assert export_lora.main([str(_ckpt(tmp_path / "bf16.pt", a=torch.ones(2, 8, dtype=torch.bfloat16))),
                             str(tmp_path / "bf16")]) == 0
    monkeypatch.setattr(export_lora, "_check_tensors", lambda p, state, rank: state)
    monkeypatch.setattr(export_lora, "_check_meta", lambda p, meta: None)
    assert export_lora.main([str(_ckpt(tmp_path / "r.pt", a=torch.randn(3, 8))), str(tmp_path / "wrong")]) == 0
    assert export_lora.main([str(_ckpt(tmp_path / "t.pt", target_modules="attn.to_q")), str(tmp_path / "chars")]) == 0
    targets = json.loads((tmp_path / "chars" / "adapter_config.json").read_text())["target_modules"]
    assert "a" in targets and "attn.to_q" not in targets
    assert capsys.readouterr().err == ""
