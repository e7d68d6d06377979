"""Dataset rows in upstream cosmos-framework's SFT layout, shared by both recipes.

Layout: ``DATASET_PATH/train/video_dataset_file.jsonl``, one JSON object a line, media paths relative to
``DATASET_PATH/train``::

    {"video": "media/bikes.mp4", "caption": "...", "fps": 25.0, "width": 640, "height": 272,
     "windows": [[0, 29], [13, 17]]}

``width``/``height`` are the source size in pixels, ``windows`` lists candidate ``[start_frame, num_frames]``
windows (``num_frames`` = 4n+1). Everything raising on bad input raises :class:`DatasetError`, whose message
names the file (and the line for JSONL) and how to fix it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from patches.core.errors import UserError

__all__ = ["DatasetError", "SampleRecord", "JSONL_RELPATH", "REQUIRED_KEYS", "Window", "Size", "load_records",
           "check_videos_decode", "probe_video"]

JSONL_RELPATH = Path("train") / "video_dataset_file.jsonl"
"""Where the sample list lives inside ``DATASET_PATH``."""

REQUIRED_KEYS: tuple[str, ...] = ("video", "caption", "fps", "width", "height", "windows")
"""Keys every JSONL row must have."""

Window = tuple[int, int]
"""``(start_frame, num_frames)``; frames are counted from 0 in decode order."""

Size = tuple[int, int]
"""``(width, height)`` in pixels."""


class DatasetError(UserError):
    """Bad dataset input: the message names the offending file (line for JSONL) and the fix."""



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
    try:
        caption.encode("utf-8")
    except UnicodeEncodeError as exc:  # valid JSON ("\\ud800") that is no text: a lone surrogate
        raise DatasetError(f"{where}: 'caption' is not encodable text (character {exc.start} is "
                           f"{caption[exc.start]!r}, a lone surrogate); fix the caption") from None
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0.1 <= fps <= 1000:
        raise DatasetError(f"{where}: 'fps' must be a frame rate between 0.1 and 1000 frames per second, got {fps!r}; "
                           "give the video's own frame rate")
    if not (_is_int(width) and _is_int(height) and 0 < width <= 65536 and 0 < height <= 65536):
        raise DatasetError(f"{where}: 'width' and 'height' must be whole numbers of pixels from 1 to 65536 (the source "
                           "video's size)")
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
    with jsonl.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(
                    f"{jsonl}:{line_no}: not UTF-8 text (byte {exc.start} of the line is {raw[exc.start]:#04x}); save "
                    f"the file as UTF-8 or fix line {line_no}"
                ) from None
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


