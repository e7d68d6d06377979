"""Checks a launcher runs before any rank starts: each failure is one :class:`~patches.core.errors.UserError`
line naming the input and the fix, and none of them leaves anything behind.

Both recipes' ``preflight`` steps (what ``--validate-only`` runs) use these for the inputs they share: the
output folder, a rendezvous port, whole-number settings. The dataset and checkpoint checks live with the
recipe that knows the format.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from .errors import UserError
from .ports import check_port_free  # noqa: F401 - one place for every pre-flight check


_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EBADF)
"""``stat`` errors that mean "nothing there" (what ``Path.exists`` of Python 3.11 reads as False)."""


def _exists(path: Path, follow: bool = True) -> bool:
    """Whether ``path`` (its link target when ``follow``) exists; any other ``stat`` error is raised (``Path.exists``
    swallows every ``OSError`` on newer Pythons, a name too long among them)."""
    try:
        os.stat(path) if follow else os.lstat(path)
    except OSError as e:
        if e.errno in _ABSENT:
            return False
        raise
    return True


def check_writable(folder: str | Path, name: str) -> Path:
    """That ``folder`` (created later if missing) can be written, without creating it.

    The nearest existing folder on its path must be a folder (not a regular file), and a temporary file
    created there must be creatable; it is removed at once. Returns ``folder`` as a :class:`Path`.

    Raises:
        UserError: ``folder`` is a regular file or lies under one, a link on its path is dangling, the path cannot
            be looked at (a name too long, a folder on it that cannot be searched), or the nearest existing folder is
            not writable.
    """
    folder = Path(folder)
    try:
        existing = next(p for p in (folder, *folder.parents) if _exists(p) or p == Path(p.anchor))
        dangling = next((p for p in (folder, *folder.parents) if _exists(p, follow=False) and not _exists(p)), None)
    except OSError as e:  # a name too long for the file system, a folder on the path that cannot be searched
        raise UserError(f"{name}={str(folder)[:120]!r} cannot be used ({e.strerror}); point {name} at another "
                        "folder") from None
    if dangling is not None:
        raise UserError(f"{name}={folder} cannot be created: {dangling} is a broken symbolic link; point {name} at "
                        "another folder")
    if existing == folder and not folder.is_dir():
        raise UserError(f"{name}={folder} is a file, not a folder; point {name} at a folder")
    if not existing.is_dir():
        raise UserError(f"{name}={folder} cannot be created: {existing} is a file, not a folder; "
                        f"point {name} at a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".onecard-write-test-", dir=existing)
    except OSError as e:
        raise UserError(f"{name}={folder} is not writable ({existing}: {e.strerror}); point {name} at a "
                        "folder you can write") from None
    os.close(fd)
    os.unlink(tmp)
    return folder


def check_at_least(value: int | float, minimum: int | float, name: str, hint: str = "") -> None:
    """``value >= minimum``, or one error naming ``name``, its value and ``hint`` (how to fix it).

    Raises:
        UserError: ``value < minimum``, or ``value`` is NaN.
    """
    if not value >= minimum:  # `not >=` also refuses NaN
        raise UserError(f"{name} = {value} must be >= {minimum}{'; ' + hint if hint else ''}")
