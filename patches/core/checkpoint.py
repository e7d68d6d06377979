"""One checkpoint manager for every recipe: atomic files, one naming scheme, resume from the newest good one.

Layout, under ``<run dir>/checkpoints/``::

    iter_000000012.pt          one file per saved step (9 digits; the step is the recipe's checkpoint
                               unit: an optimizer iteration for Cosmos, a rollout for MiniMax-H3)
    latest_checkpoint.txt      the newest file's name (what upstream cosmos-framework writes too)

A file is written under a temporary name and renamed (:func:`patches.core.io.atomic_torch_save`), so a
killed save never leaves a half file under a real name; the temporaries it may leave are removed by
:meth:`CheckpointManager.clean_stale`. :meth:`CheckpointManager.load_latest` tries the newest file first
and, if it cannot be read, says so and falls back to the next older one.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

from .io import TMP_MARK, atomic_torch_save, atomic_write_text

MARKER = "latest_checkpoint.txt"
"""File naming the newest checkpoint."""
DIGITS = 9
"""Zero-padded width of the step number in a checkpoint's name."""
_NAME = re.compile(r"^iter_(\d+)\.pt$")


class CheckpointManager:
    """Save and find a run's checkpoints.

    Args:
        run_dir: the run's output folder; checkpoints go to ``run_dir/checkpoints``.
        write: whether this process writes (``False`` on ranks other than 0: they compute the state,
            which may need collectives, but rank 0 alone writes it).
    """

    def __init__(self, run_dir: str | Path, write: bool = True):
        self.dir = Path(run_dir) / "checkpoints"
        self.write = write

    def path(self, step: int) -> Path:
        """``checkpoints/iter_<step, 9 digits>.pt``."""
        return self.dir / f"iter_{step:0{DIGITS}d}.pt"

    def save(self, step: int, state: dict[str, Any]) -> Path | None:
        """Write ``state`` as step ``step`` atomically, then point the marker at it; ``None`` if not writing."""
        if not self.write:
            return None
        path = atomic_torch_save(state, self.path(step))
        atomic_write_text(self.dir / MARKER, path.name + "\n")
        return path

    def all(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every checkpoint file, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _NAME.match(p.name))]
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest checkpoint file, or ``None`` when the run has none."""
        found = self.all()
        return found[-1][1] if found else None

    def load_latest(self, **load_kw: Any) -> tuple[Path, dict[str, Any]] | None:
        """Load the newest readable checkpoint: ``(path, state)``, or ``None`` when there is none.

        A file that cannot be read (truncated, not a torch file) is reported with a warning and skipped
        for the next older one. ``load_kw`` go to ``torch.load`` (default ``map_location="cpu"``,
        ``weights_only=False``: the file is this run's own).
        """
        import torch

        load_kw = {"map_location": "cpu", "weights_only": False, **load_kw}
        for _, path in reversed(self.all()):
            try:
                return path, torch.load(path, **load_kw)
            except Exception as e:  # noqa: BLE001 - any reader error means "damaged"
                warnings.warn(f"checkpoint {path} is damaged ({type(e).__name__}: {str(e)[:120]}); "
                              "trying the next older one", stacklevel=2)
        return None

    def clean_stale(self) -> list[Path]:
        """Remove temporary files a killed save left in the checkpoint folder; returns what was removed."""
        if not self.write or not self.dir.is_dir():
            return []
        stale = [p for p in self.dir.iterdir() if p.name.startswith(".") and TMP_MARK in p.name]
        for p in stale:
            p.unlink(missing_ok=True)
        return stale
