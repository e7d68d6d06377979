"""Small datasets cut from the sample datasets, for runs that check wiring rather than data."""

from __future__ import annotations

from pathlib import Path


def first_rows(dataset: Path, root: Path, n: int) -> Path:
    """A dataset at ``root`` with ``dataset``'s first ``n`` rows and the same clips (the media folder linked)."""
    (root / "train").mkdir(parents=True)
    (root / "train" / "media").symlink_to(dataset / "train" / "media", target_is_directory=True)
    rows = (dataset / "train" / "video_dataset_file.jsonl").read_text().splitlines(keepends=True)
    (root / "train" / "video_dataset_file.jsonl").write_text("".join(rows[:n]))
    return root
