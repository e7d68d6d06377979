"""Argument checks and result writes shared by the benchmark scripts (``edge_24gb.py``, ``edge_exact.py``,
``h3_1gpu.py``).

Every check raises :class:`patches.core.errors.UserError` with one line naming the flag, the bad value and the
fix; the scripts run their ``main`` under :func:`patches.core.errors.cli`, so bad input prints one ``error:`` line
and exits 2. The scripts call these checks before any expensive work (imports of the model, a GPU check, a run),
and before anything is written under ``--out``.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Iterable, Mapping

from patches.core.errors import UserError
from patches.core.io import atomic_open
from patches.core.preflight import check_at_least, check_writable


H100_H200_DENSE_BF16_TFLOPS = 989.0
"""NVIDIA H100/H200 SXM datasheet, dense BF16 (1,979 with 2:4 sparsity): the MFU denominator of the benchmarks."""


def pick(flag: str, text: str, known: Iterable[str], *, allow_none: bool = False) -> list[str]:
    """The comma-separated names in ``text`` (stripped, empty entries dropped), each one of ``known``.

    Returns the names in the order given (duplicates dropped). With ``allow_none``, a ``text`` that names
    nothing returns ``[]``.

    Raises:
        UserError: a name not in ``known`` (lists the known ones), or -- unless ``allow_none`` -- ``text``
            names nothing (e.g. ``","``): selecting nothing would run nothing and write an empty result.
    """
    known = list(known)
    names = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    unknown = [x for x in names if x not in known]
    if unknown:
        raise UserError(f"{flag} {','.join(unknown)!r}: unknown name(s); use a comma list of: {', '.join(known)}")
    if not names and not allow_none:
        raise UserError(f"{flag} {text!r} selects nothing; name at least one of: {', '.join(known)}")
    return names


def at_least(flag: str, value: float | None, low: float, why: str = "") -> None:
    """``value >= low`` (``None`` passes: the flag's default applies); else :class:`UserError` saying ``why``
    (:func:`patches.core.preflight.check_at_least`, which also refuses NaN)."""
    if value is not None:
        check_at_least(value, low, flag, why)


def positive(flag: str, value: float | None, unit: str = "") -> None:
    """``0 < value < inf`` (``None`` passes: the flag's default applies); else :class:`UserError`."""
    if value is not None and not 0 < value < math.inf:  # also refuses NaN
        raise UserError(f"{flag} {value:g}: must be a finite positive number{' of ' + unit if unit else ''}")


def at_most_card(flag: str, gib: float | None) -> None:
    """A card cap ``gib`` (GiB) no larger than GPU 0's memory; ``None`` or no GPU passes.

    Raises:
        UserError: the cap exceeds the card (checked before the first configuration runs, not when the capped
            row starts).
    """
    import torch

    if gib is None or not torch.cuda.is_available():
        return
    total = torch.cuda.get_device_properties(0).total_memory / (1 << 30)
    if gib > total:
        raise UserError(f"{flag} {gib:g}: larger than this card's {total:.2f} GiB; give a cap of at most that")


def free_targets(flag: str, folder: str | os.PathLike, names: Iterable[str]) -> None:
    """Each ``folder/name`` that the script will write is absent or a plain file (not a folder or a link), so
    the write at the end cannot fail after the runs.

    Raises:
        UserError: names the path that is in the way.
    """
    for name in names:
        path = Path(folder) / name
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise UserError(f"{flag} {folder}: {path} is in the way (a folder or a link where the result file goes); "
                            "move it or choose another folder")


def folder_arg(text: str) -> Path:
    """An ``argparse`` ``type=`` for an output folder (``--out``): the name as a :class:`Path`, refused when it is
    empty or blank (``Path("")`` is the current folder, which no one means by an empty value)."""
    import argparse

    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty: give the folder the results go to")
    return Path(text)


def writable_dir(flag: str, path: str | os.PathLike) -> Path:
    """That ``path`` is a writable folder, or can be created as one; creates nothing. Returns ``Path(path)``
    (:func:`patches.core.preflight.check_writable`, the trainers' check of ``OUTPUT_ROOT``).

    Raises:
        UserError: ``path`` (or an ancestor) is a file or a broken link, or the folder that would hold it is not
            writable.
    """
    return check_writable(path, flag)


def write_together(files: Mapping[str | os.PathLike, str]) -> None:
    """Write every ``{path: text}`` (UTF-8) atomically and together: each to a temporary file beside it, then all
    renamed in place once every one is written and fsynced (:func:`patches.core.io.atomic_open`).

    A failure while writing any of them leaves none of them changed (the temporaries are removed); only a
    failing rename between two renames (a full or vanished disk) could leave a subset.
    """
    with contextlib.ExitStack() as stack:
        handles = [(stack.enter_context(atomic_open(p, "w", encoding="utf-8")), text) for p, text in files.items()]
        for f, text in handles:
            f.write(text)


def result_stem(recipe: str, what: str, device: str, smoke: bool = False) -> str:
    """The results' one naming scheme, ``<date>_<recipe>_<gpu>_<what>`` (``2026-11-30_cosmos_h200_edge24gb``): today's
    date (UTC), the recipe (``cosmos``, ``h3``, ``upstream``; ``core`` for what both share), the GPU as a short lower-case name from ``device``
    (``NVIDIA H200`` -> ``h200``; ``cpu``), and what was measured; a CPU smoke ends in ``-smoke``."""
    import datetime
    import re

    words = [w for w in re.split(r"[^a-z0-9]+", device.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    gpu = words[0] if words else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return f"{date}_{recipe}_{gpu}_{what}{'-smoke' if smoke else ''}"
