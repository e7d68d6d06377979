"""Packing equivalence: the planner's prediction is exactly what the training loader yields.

The planner (:func:`plan`, max-window full-caption counts) and :class:`PackingLoader` (with
``window_policy="max"``, ``cfg_dropout=0``, no shuffle) must give the same micro-batches and drops.
Both call :func:`pack_indices`, so the fit rule itself is pinned separately: against hand-computed
packings of upstream's rules (strict ``<``, look-ahead 10, set-aside order) and against an
independent re-implementation. Planted-bug cases show each comparison does detect a divergence.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from cosmos_framework_ext.levers import packing
from patches.core.data.rows import JSONL_RELPATH, load_records
from cosmos_framework_ext.recipe.data import CaptionTokenizer, SampleSource
from cosmos_framework_ext.levers.packing import (
    DEFAULT_LOOKAHEAD,
    PackingLoader,
    pack_indices,
    plan,
    rank_partition,
)
from cosmos_framework_ext.recipe.plan import main
from cosmos_framework_ext.recipe.presets import get_preset

TINY = get_preset("tiny")


# ------------------------------------------------------------------ fixtures and helpers


def _max_source(dataset: Path, tokenizer: CaptionTokenizer) -> SampleSource:
    """A source whose every access is the planner's worst case (largest window, full caption)."""
    return SampleSource(load_records(dataset), tokenizer, TINY, cfg_dropout=0.0, window_policy="max")


@pytest.fixture(scope="session")
def sample_source(sample_dataset: Path, tokenizer: CaptionTokenizer) -> SampleSource:
    return _max_source(sample_dataset, tokenizer)


OVERSIZED_ROW = 3


@pytest.fixture(scope="session")
def synthetic_source(
    sample_dataset: Path, tokenizer: CaptionTokenizer, tmp_path_factory: pytest.TempPathFactory
) -> SampleSource:
    """12 rows on a copy of carphone; row 3 has a ~400-token caption that no 150-token batch holds."""
    root = tmp_path_factory.mktemp("synthetic")
    (root / "train" / "media").mkdir(parents=True)
    media = sample_dataset / "train" / "media"
    shutil.copyfile(media / "carphone_pristine.mp4", root / "train" / "media" / "clip.mp4")
    words = [3, 30, 12, 400, 25, 7, 40, 18, 33, 5, 60, 21]
    rows = [
        {"video": "media/clip.mp4", "caption": " ".join(["cyclist"] * k), "fps": 29.97, "width": 176,
         "height": 144, "windows": [[k % 50, 17], [0, 9]]}
        for k in words
    ]
    (root / JSONL_RELPATH).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return _max_source(root, tokenizer)


SYNTHETIC_CAP = 150


def _first_epoch(loader: PackingLoader) -> tuple[list[list[int]], list[tuple[int, int]], list[int]]:
    """(batches of indices, dropped (index, tokens), batch token sums) of the loader's epoch 0."""
    batches: list[list[int]] = []
    sums: list[int] = []
    dropped: list[tuple[int, int]] = []
    for micro_batch in loader:
        if loader.epoch != 0:
            break
        dropped = [(i, n) for e, i, n in loader.dropped_samples if e == 0]
        batches.append([s.record_index for s in micro_batch])
        sums.append(sum(s.num_tokens for s in micro_batch))
    return batches, dropped, sums


def prediction_matches_loader(source: SampleSource, cap: int, world_size: int = 1, **loader_kwargs) -> bool:
    """Whether :func:`plan`'s predicted micro-batches and drops for every rank equal what
    :class:`PackingLoader` yields in its first epoch (identity order)."""
    report = plan(source, cap, ref_cap=cap, ref_grad_accum=1, ref_world_size=world_size, world_size=world_size)
    loader_dropped: list[tuple[int, int]] = []
    for rank in range(world_size):
        loader = PackingLoader(source, cap, rank=rank, world_size=world_size, shuffle=False, **loader_kwargs)
        batches, dropped, sums = _first_epoch(loader)
        if batches != report.ours.batches[rank] or sums != report.ours.tokens[rank]:
            return False
        loader_dropped += dropped
    return loader_dropped == report.ours.dropped


Packing = tuple[list[list[int]], list[tuple[int, int]]]
"""(batches of indices, dropped (index, tokens))."""


def _reference_pack(counts: Sequence[int], cap: int, lookahead: int = 10) -> Packing:
    """Independent re-statement of upstream's PackingDataLoader over indices ``0..len(counts)-1``."""
    pending = list(range(len(counts)))
    batches: list[list[int]] = []
    dropped: list[tuple[int, int]] = []
    while pending:
        batch, total, skipped, pos = [], 0, [], 0
        while pos < len(pending) and len(skipped) < max(lookahead, 1):
            i = pending[pos]
            pos += 1
            if total + counts[i] < cap:
                batch.append(i)
                total += counts[i]
            elif batch:
                skipped.append(i)
            else:
                dropped.append((i, counts[i]))
        pending = skipped + pending[pos:]
        if batch:
            batches.append(batch)
    return batches, dropped


def pack_matches_reference(counts: Sequence[int], cap: int, lookahead: int = 10) -> bool:
    """Whether :func:`pack_indices` agrees with :func:`_reference_pack` on ``counts``."""
    res = pack_indices(range(len(counts)), counts.__getitem__, cap, lookahead)
    return (res.batches, res.dropped) == _reference_pack(counts, cap, lookahead)


def _pack(counts: Sequence[int], cap: int, lookahead: int = DEFAULT_LOOKAHEAD) -> Packing:
    res = pack_indices(range(len(counts)), counts.__getitem__, cap, lookahead)
    assert res.tokens == [sum(counts[i] for i in b) for b in res.batches]
    return res.batches, res.dropped


# ------------------------------------------------------------------ fit rule, by hand


def test_strict_fit_rule() -> None:
    assert _pack([10], 10) == ([], [(0, 10)])  # exactly cap tokens never fits
    assert _pack([9], 10) == ([[0]], [])  # cap - 1 fits
    assert _pack([4, 6], 10) == ([[0], [1]], [])  # 4 + 6 == cap: the second goes to a new batch
    assert _pack([4, 5], 10) == ([[0, 1]], [])
    assert _pack([0, 0, 9], 10) == ([[0, 1, 2]], [])


def test_lookahead_order() -> None:
    # cap 10: batch 1 takes 0 (6) and 3 (3), setting 1, 2, 4, 5 aside; they come back in that order.
    assert _pack([6, 5, 5, 3, 4, 2], 10) == ([[0, 3], [1, 4], [2, 5]], [])
    # Without look-ahead the batch closes at the first sample that does not fit.
    assert _pack([6, 5, 5, 3, 4, 2], 10, lookahead=0) == ([[0], [1], [2, 3], [4, 5]], [])


def test_lookahead_limit_is_ten() -> None:
    nine = [9] + [5] * 9 + [0]  # 9 set aside: the last sample is still tried and fits batch 1
    assert _pack(nine, 10)[0][0] == [0, 10]
    ten = [9] + [5] * 10 + [0]  # 10 set aside: batch 1 closes before reaching it
    assert _pack(ten, 10)[0][0] == [0]
    assert _pack(ten, 10, lookahead=11)[0][0] == [0, 11]


def test_oversized_dropped_only_from_empty_batch() -> None:
    # 12 > cap is set aside while batch 1 is open, then dropped when it heads an empty batch.
    assert _pack([3, 12, 4], 10) == ([[0, 2]], [(1, 12)])
    assert _pack([12, 3], 10) == ([[1]], [(0, 12)])


def test_rank_partition() -> None:
    assert rank_partition(list(range(10)), 1, 4) == [1, 5, 9]
    with pytest.raises(ValueError):
        rank_partition([1, 2], 2, 2)


def test_pack_matches_independent_reference() -> None:
    rng = random.Random(0)
    for _ in range(300):
        cap = rng.randint(5, 60)
        counts = [rng.choice([rng.randint(0, cap // 2), rng.randint(0, cap + 5), cap, cap - 1])
                  for _ in range(rng.randint(0, 40))]
        for lookahead in (0, 1, 3, 10):
            assert pack_matches_reference(counts, cap, lookahead), (counts, cap, lookahead)


def test_plan_numbers() -> None:
    report = plan([4] * 8, cap=10, ref_cap=100, ref_grad_accum=2, ref_world_size=2)
    assert report.ours.mean_samples_per_micro_batch == 2.0  # 4 + 4 < 10, + 4 is not
    assert report.ref.mean_samples_per_micro_batch == 4.0  # 4 samples per rank, one batch each
    assert report.ref_samples_per_step == 2 * 2 * 4.0
    assert report.grad_accum == 8 and report.samples_per_step == 16.0
    assert report.max_sample_tokens == 4 and report.min_zero_drop_cap == 5
    assert plan([4] * 8, cap=100, ref_cap=10, ref_grad_accum=1, ref_world_size=1).grad_accum == 1  # never < 1


# ------------------------------------------------------------------ planner == loader


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("cap", [90, 150, 300, 2000])
def test_planner_equals_loader_sample_dataset(sample_source: SampleSource, cap: int, world_size: int) -> None:
    assert prediction_matches_loader(sample_source, cap, world_size)


def test_sample_dataset_drops_predicted(sample_source: SampleSource, caplog: pytest.LogCaptureFixture) -> None:
    report = plan(sample_source, 90, ref_cap=90, ref_grad_accum=1, ref_world_size=1)
    assert report.ours.dropped and all(n >= 90 for _, n in report.ours.dropped)
    loader = PackingLoader(sample_source, 90, shuffle=False)
    with caplog.at_level(logging.ERROR, logger="onecard.packing"):
        _first_epoch(loader)
    assert len([r for r in caplog.records if "epoch 0" in r.getMessage()]) == len(report.ours.dropped)


def test_planner_equals_loader_synthetic_oversized(
    synthetic_source: SampleSource, caplog: pytest.LogCaptureFixture
) -> None:
    assert synthetic_source.max_token_count(OVERSIZED_ROW) >= SYNTHETIC_CAP
    others = [i for i in range(len(synthetic_source)) if i != OVERSIZED_ROW]
    assert all(synthetic_source.max_token_count(i) < SYNTHETIC_CAP for i in others)
    report = plan(synthetic_source, SYNTHETIC_CAP, ref_cap=SYNTHETIC_CAP, ref_grad_accum=1, ref_world_size=1)
    tokens = synthetic_source.max_token_count(OVERSIZED_ROW)
    assert report.ours.dropped == [(OVERSIZED_ROW, tokens)]

    loader = PackingLoader(synthetic_source, SYNTHETIC_CAP, shuffle=False)
    with caplog.at_level(logging.ERROR, logger="onecard.packing"):
        batches, dropped, sums = _first_epoch(loader)
    assert batches == report.ours.batches[0] and dropped == report.ours.dropped
    assert all(s < SYNTHETIC_CAP for s in sums)
    errors = [r for r in caplog.records if r.name == "onecard.packing" and r.levelno == logging.ERROR]
    epoch0 = [r for r in errors if "epoch 0" in r.getMessage()]
    assert len(epoch0) == 1
    message = epoch0[0].getMessage()
    assert f"dropped sample {OVERSIZED_ROW} " in message and f"{tokens} tokens" in message
    assert loader.dropped_count >= 1  # epoch 1 (already started by _first_epoch) drops it again
    assert prediction_matches_loader(synthetic_source, SYNTHETIC_CAP, world_size=2)


def test_loader_shuffles_and_continues(sample_source: SampleSource) -> None:
    loader = PackingLoader(sample_source, 300, seed=1)
    it = iter(loader)
    seen: dict[int, list[int]] = {}
    while loader.epoch < 2:
        batch = next(it)
        seen.setdefault(loader.epoch, []).extend(s.record_index for s in batch)
    assert sorted(seen[0]) == list(range(len(sample_source))) and seen[0] != seen[1]
    assert PackingLoader(sample_source, 300, seed=1).epoch_order(0) == loader.epoch_order(0)


def test_random_windows_never_exceed_prediction(sample_dataset: Path, tokenizer: CaptionTokenizer) -> None:
    """Training accesses (random window, 10% dropout) never exceed the planner's worst case."""
    src = SampleSource(load_records(sample_dataset), tokenizer, TINY, seed=7)
    worst = plan(_max_source(sample_dataset, tokenizer), 300, 300, 1, 1)
    assert not worst.ours.dropped
    loader = PackingLoader(src, 300, seed=7)
    it = iter(loader)
    while loader.epoch < 3:
        assert all(s.num_tokens < 300 for s in next(it))
    assert loader.dropped_count == 0


# ------------------------------------------------------------------ planted bugs


def test_planted_bug_lookahead_disabled_in_loader(sample_source: SampleSource) -> None:
    assert prediction_matches_loader(sample_source, 150)
    assert prediction_matches_loader(sample_source, 150, lookahead=0) is False


def test_planted_bug_non_strict_fit_in_loader(
    synthetic_source: SampleSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A sample of exactly (cap - packed) tokens is what separates "<" from "<=": pick that cap.
    counts = [synthetic_source.max_token_count(i) for i in range(len(synthetic_source))]
    cap = counts[0] + counts[1]
    assert prediction_matches_loader(synthetic_source, cap)
    original = PackingLoader.pack_epoch

    def pack_epoch_le(self: PackingLoader, epoch: int):
        with monkeypatch.context() as m:
            m.setattr(packing, "fits", lambda packed, n, c: packed + n <= c)
            return original(self, epoch)

    monkeypatch.setattr(PackingLoader, "pack_epoch", pack_epoch_le)
    assert prediction_matches_loader(synthetic_source, cap) is False


def test_planted_bug_non_strict_fit_in_shared_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    # A bug in the shared fit rule moves planner and loader together (so they still agree); the
    # hand-computed and independent-reference checks above are what catch it.
    monkeypatch.setattr(packing, "fits", lambda packed, n, c: packed + n <= c)
    assert pack_matches_reference([4, 6, 10, 3], 10) is False
    assert _pack([10], 10) != ([], [(0, 10)])


# ------------------------------------------------------------------ CLI


def _cli(argv: list[str]) -> int:
    return main(["--ref-cap", "1000", "--ref-grad-accum", "2", "--ref-world-size", "8", "--preset", "tiny", *argv])


def test_cli_ok_and_json(sample_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sub" / "plan.json"
    assert _cli(["--dataset", str(sample_dataset), "--cap", "300", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ours"]["dropped"] == [] and data["num_samples"] == len(load_records(sample_dataset))
    assert data["grad_accum"] >= 1
    assert "samples / optimizer step" in capsys.readouterr().out
    assert [p.name for p in out.parent.iterdir()] == ["plan.json"]  # no temp file left


def test_cli_drop_exits_1(sample_dataset: Path, capsys: pytest.CaptureFixture) -> None:
    assert _cli(["--dataset", str(sample_dataset), "--cap", "60"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "would be dropped at --cap 60" in err[0] and "use --cap" in err[0]


def test_cli_dataset_error_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert _cli(["--dataset", str(tmp_path / "missing"), "--cap", "300"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]


def test_cli_bad_args_exit_2() -> None:
    with pytest.raises(SystemExit) as exc:
        _cli(["--cap", "-5"])
    assert exc.value.code == 2


def test_cli_default_sample_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONECARD_DATA_CACHE", str(tmp_path / "cache"))
    assert _cli(["--cap", "300"]) == 0
    assert (tmp_path / "cache" / "sample_dataset_tiny" / JSONL_RELPATH).is_file()

