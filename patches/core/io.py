"""Atomic file writes: readers never see half a file, and a failed write leaves nothing behind.

Every writer here writes to a temporary name in the destination's folder (``.<name>.tmp-<random>``),
flushes and fsyncs it, then ``os.replace``-s it onto the destination; on any exception the temporary
file is removed and the destination is untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterator

TMP_MARK = ".tmp-"
"""Substring of every temporary name (``.<name>.tmp-<random>``), so stale ones can be found and removed."""


def _umask_mode() -> int:
    """``0o666`` less the process umask: the mode ``open()`` would give a new file (``mkstemp`` gives 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_MODE = _umask_mode()  # read once, at import: changing the umask is process-wide and not thread-safe


def give_new_modes(folder: str | Path) -> None:
    """Give ``folder`` (made by ``tempfile.mkdtemp``: mode 0700) and the files in it the modes that ``mkdir()``
    and ``open()`` give under the process umask, before the folder is renamed into place: a published
    directory is then readable as any other output of the run."""
    folder = Path(folder)
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, _MODE)
    os.chmod(folder, _MODE | ((_MODE & 0o444) >> 2))  # the read bits also give search (x) on a folder


@contextlib.contextmanager
def _temp_beside(path: Path) -> Iterator[Path]:
    """A fresh temporary path in ``path``'s folder; renamed onto ``path`` on a clean exit, else removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{TMP_MARK}", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, _MODE)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kw: Any) -> Iterator[IO]:
    """Open a temporary file next to ``path``; on a clean exit fsync it and rename it onto ``path``.

    Creates the parent folder. ``mode`` is ``"w"`` or ``"wb"`` (plus ``open``'s keyword arguments).
    """
    with _temp_beside(Path(path)) as tmp, open(tmp, mode, **kw) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """Call ``write(tmp_path)`` (a writer that takes a path, like ``torch.save``), then rename onto ``path``."""
    with _temp_beside(Path(path)) as tmp:
        write(tmp)
    return Path(path)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return Path(path)


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented, key-sorted JSON to ``path`` atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def atomic_torch_save(obj: Any, path: str | Path) -> Path:
    """``torch.save(obj, path)`` atomically."""
    import torch

    return atomic_write(path, lambda p: torch.save(obj, p))
