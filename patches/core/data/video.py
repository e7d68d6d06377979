"""Video decoding shared by both recipes: a window of frames, scaled to cover a size and centre-cropped.

PyAV decodes; swscale's area filter scales each frame so that it covers the target size with its aspect kept;
the centre crop starts at the floor of the margin. :class:`ClipCache` keeps whole decoded clips in memory so that
rows cut from one clip decode it once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from patches.core.data.rows import DatasetError, Size, probe_video

__all__ = ["ClipCache", "DEFAULT_CLIP_CACHE", "decode_window"]



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


