"""SFT data: dataset validation errors, tokenizer, token formula, video decoding, sample dataset."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from patches.core.data.rows import JSONL_RELPATH, DatasetError, load_records
from patches.core.data.sample_dataset import MARKER_NAME, prepare_sample_dataset
from cosmos_framework_ext.recipe.data import CaptionTokenizer, SampleSource, caption_with_suffix, target_size, tokens_per_sample
from patches.core.data.video import decode_window
from cosmos_framework_ext.recipe.presets import get_preset

TINY = get_preset("tiny")
EDGE = get_preset("edge")


def _write_dataset(root: Path, rows: list[dict] | list[str], media_from: Path) -> Path:
    """A dataset at ``root`` whose media/clip.mp4 is a copy of ``media_from``; rows as dicts or raw lines."""
    train = root / "train"
    (train / "media").mkdir(parents=True)
    shutil.copyfile(media_from, train / "media" / "clip.mp4")
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    (root / JSONL_RELPATH).write_text("\n".join(lines) + "\n")
    return root


def _row(**over) -> dict:
    row = {"video": "media/clip.mp4", "caption": "a car interior", "fps": 29.97, "width": 176, "height": 144,
           "windows": [[0, 17], [8, 9]]}
    row.update(over)
    return row


@pytest.fixture(scope="session")
def clip(sample_dataset: Path) -> Path:
    return sample_dataset / "train" / "media" / "carphone_pristine.mp4"


# ------------------------------------------------------------------ sample dataset


def test_sample_dataset_layout(sample_dataset: Path) -> None:
    records = load_records(sample_dataset, max_frames=TINY.max_frames)
    assert 40 <= len(records) <= 120
    videos = {"media/bigbuckbunny.mp4", "media/bikes.mp4", "media/carphone_pristine.mp4"}
    assert {r.video for r in records} == videos
    assert len({r.caption for r in records}) == 19  # one specific caption per segment
    for r in records:
        lengths = {n for _, n in r.windows}
        assert len(lengths) >= 2
        assert all((n - 1) % 4 == 0 and n <= TINY.max_frames for n in lengths)
    bikes = next(r for r in records if r.video == "media/bikes.mp4")
    assert (bikes.width, bikes.height, bikes.fps) == (640, 272, 25.0)


def test_sample_dataset_idempotent(sample_dataset: Path) -> None:
    marker = sample_dataset / MARKER_NAME
    before = (marker.stat().st_mtime_ns, (sample_dataset / JSONL_RELPATH).read_bytes())
    assert prepare_sample_dataset(sample_dataset, TINY) == sample_dataset
    assert (marker.stat().st_mtime_ns, (sample_dataset / JSONL_RELPATH).read_bytes()) == before
    assert not [p for p in sample_dataset.parent.iterdir() if ".tmp-" in p.name]  # no temp dir left


def test_sample_dataset_other_preset_refused(sample_dataset: Path) -> None:
    with pytest.raises(DatasetError, match="delete"):
        prepare_sample_dataset(sample_dataset, EDGE)


def test_sample_dataset_refuses_foreign_folder(tmp_path: Path) -> None:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "something").write_text("x")
    with pytest.raises(DatasetError, match="not a complete sample dataset"):
        prepare_sample_dataset(tmp_path / "ds", TINY)


# ------------------------------------------------------------------ load_records errors


def test_missing_dataset_dir(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"does not exist.*train/video_dataset_file.jsonl"):
        load_records(tmp_path / "nope")


def test_missing_jsonl(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="video_dataset_file.jsonl is missing"):
        load_records(tmp_path)


def test_bad_json_names_line(tmp_path: Path, clip: Path) -> None:
    _write_dataset(tmp_path, [_row(), "", '{"video": "media/clip.mp4", oops'], clip)
    with pytest.raises(DatasetError, match=r"video_dataset_file.jsonl:3: invalid JSON"):
        load_records(tmp_path)


def test_missing_key(tmp_path: Path, clip: Path) -> None:
    row = _row()
    del row["windows"]
    _write_dataset(tmp_path, [row], clip)
    with pytest.raises(DatasetError, match=r":1: missing key\(s\) \['windows'\]"):
        load_records(tmp_path)


def test_missing_media(tmp_path: Path, clip: Path) -> None:
    _write_dataset(tmp_path, [_row(), _row(video="media/gone.mp4")], clip)
    with pytest.raises(DatasetError, match=r":2: media file .*gone.mp4 does not exist"):
        load_records(tmp_path)


@pytest.mark.parametrize("window, match", [
    ([0, 16], "4n\\+1"),
    ([0, 0], "4n\\+1"),
    ([-1, 5], "out of range"),
    ([110, 17], "out of range"),  # the clip has 120 frames
    ([0, "9"], "two integers"),
])
def test_bad_window(tmp_path: Path, clip: Path, window: list, match: str) -> None:
    _write_dataset(tmp_path, [_row(windows=[[0, 9], window])], clip)
    with pytest.raises(DatasetError, match=match):
        load_records(tmp_path)


def test_window_longer_than_preset(tmp_path: Path, clip: Path) -> None:
    _write_dataset(tmp_path, [_row(windows=[[0, 21]])], clip)
    assert load_records(tmp_path)[0].windows == ((0, 21),)
    with pytest.raises(DatasetError, match="max_frames 17"):
        load_records(tmp_path, max_frames=TINY.max_frames)


def test_corrupt_video(tmp_path: Path, clip: Path) -> None:
    bad = tmp_path / "garbage.mp4"
    bad.write_bytes(b"\x00\x01 definitely not an mp4 " * 200)
    with pytest.raises(DatasetError, match="garbage.mp4.*corrupt"):
        decode_window(bad, 0, 5, (64, 48))
    _write_dataset(tmp_path / "ds", [_row(video="../../garbage.mp4")], clip)
    with pytest.raises(DatasetError, match="garbage.mp4"):
        load_records(tmp_path / "ds")


def test_too_short_video(clip: Path) -> None:
    with pytest.raises(DatasetError, match="too short"):
        decode_window(clip, 115, 9, (64, 48))


# ------------------------------------------------------------------ tokens


def test_tokenizer_offline(tokenizer: CaptionTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = CaptionTokenizer()
    assert tok.vocab_size == 30522
    assert len({tok.eos_id, tok.vision_start_id, tok.vision_end_id}) == 3
    ids = tok.encode("A cyclist waits at the traffic light.", max_tokens=2048)
    assert 0 < len(ids) < 20 and tok.eos_id not in ids and 0 not in ids  # no specials, no padding
    long_text = "word " * 500  # longer than the tokenizer file's own 128-token truncation
    assert len(tok.encode(long_text, 2048)) == 500
    assert tok.encode(long_text, 7) == tok.encode(long_text, 2048)[:7]


def test_tokens_per_sample_worked_example() -> None:
    # 320x192, 33 frames: ceil(192/32)=6 rows x ceil(320/32)=10 cols x (1 + 32//4)=9 latent frames + 2.
    assert tokens_per_sample(40, 33, (320, 192)) == (41, 10 * 6 * 9 + 2)
    assert tokens_per_sample(0, 1, (64, 48)) == (1, 2 * 2 * 1 + 2)
    assert tokens_per_sample(3, 93, (320, 256)) == (4, 10 * 8 * 24 + 2)
    assert tokens_per_sample(0, 5, (65, 33)) == (1, 3 * 2 * 2 + 2)  # ceil on partial patches
    with pytest.raises(ValueError):
        tokens_per_sample(3, 32, (320, 192))


def test_target_size() -> None:
    assert target_size(640, 272, EDGE) == (320, 192)
    assert target_size(1280, 720, EDGE) == (320, 192)
    assert target_size(176, 144, EDGE) == (320, 256)
    assert target_size(640, 480, TINY) == (64, 48)
    assert target_size(1920, 1080, TINY) == (64, 32)


def test_caption_with_suffix(sample_dataset: Path) -> None:
    rec = load_records(sample_dataset)[0]
    text = caption_with_suffix(rec, (0, 33), (320, 192))
    assert text == rec.caption + " Duration: 1.32 s, 25 fps, 320x192."
    carphone = next(r for r in load_records(sample_dataset) if "carphone" in r.video)
    assert caption_with_suffix(carphone, (0, 17), (64, 48)).endswith(" Duration: 0.57 s, 29.97 fps, 64x48.")


def test_sample_source_agrees_and_is_deterministic(sample_dataset: Path, tokenizer: CaptionTokenizer) -> None:
    records = load_records(sample_dataset)
    src = SampleSource(records, tokenizer, TINY, seed=3)
    again = SampleSource(records, tokenizer, TINY, seed=3)
    drops, windows = 0, set()
    for epoch in range(12):
        for i in range(len(records)):
            s = src.sample(i, epoch)
            assert s.num_tokens == src.token_count(i, epoch) == again.token_count(i, epoch)
            assert s.num_tokens == s.und_tokens + s.gen_tokens and s.und_tokens == len(s.text_ids) + 1
            assert s.num_tokens <= src.max_token_count(i)
            drops += s.caption_dropped
            windows.add((i, s.window))
            if s.caption_dropped:
                assert s.text.startswith("Duration:")
    total = 12 * len(records)
    assert 0.03 * total < drops < 0.2 * total  # cfg_dropout 0.1
    assert len(windows) > len(records)  # both windows get picked
    maxed = SampleSource(records, tokenizer, TINY, cfg_dropout=0.0, window_policy="max")
    assert all(maxed.token_count(i, 5) == maxed.max_token_count(i) for i in range(len(records)))


def test_caption_truncation(sample_dataset: Path, tokenizer: CaptionTokenizer) -> None:
    records = load_records(sample_dataset)
    src = SampleSource(records, tokenizer, TINY, max_caption_tokens=5, cfg_dropout=0.0)
    s = src.sample(0, 0)
    assert len(s.text_ids) == 5 and s.und_tokens == 6


# ------------------------------------------------------------------ decoding


def test_decode_window_shape_dtype_range(sample_dataset: Path, tokenizer: CaptionTokenizer) -> None:
    records = load_records(sample_dataset)
    bunny = next(r for r in records if "bigbuckbunny" in r.video)
    video = decode_window(bunny.video_path, 3, 9, (64, 32))
    assert video.shape == (3, 9, 32, 64) and video.dtype == torch.float32
    assert video.min() >= -1.0 and video.max() <= 1.0 and video.std() > 0.05
    assert not torch.equal(video[:, 0], video[:, -1])  # distinct frames
    # The same frame decoded on its own matches (window start is honoured).
    single = decode_window(bunny.video_path, 11, 1, (64, 32))
    assert torch.equal(single[:, 0], video[:, 8])
    sample = SampleSource(records, tokenizer, TINY).sample(bunny.index, 0)
    assert sample.video_tensor is None  # lazy
    assert sample.video.shape == (3, sample.window[1], 32, 64)
    assert sample.video_tensor is not None and sample.load_video() is sample.video_tensor


def test_clip_cache_returns_the_same_frames_as_a_direct_decode(sample_dataset):
    from patches.core.data.video import ClipCache, decode_window
    from patches.core.data.rows import load_records

    rec = load_records(sample_dataset)[0]
    cache = ClipCache()
    start, n = rec.windows[0]
    direct = decode_window(rec.video_path, start, n, (64, 32))
    cached = decode_window(rec.video_path, start, n, (64, 32), cache)
    again = decode_window(rec.video_path, start, n, (64, 32), cache)
    assert torch.equal(direct, cached) and torch.equal(cached, again)
    assert len(cache._clips) == 1
    tiny = ClipCache(max_clip_bytes=1)  # too small to hold the clip: falls back to a window decode
    assert torch.equal(decode_window(rec.video_path, start, n, (64, 32), tiny), direct)
    assert not tiny._clips
