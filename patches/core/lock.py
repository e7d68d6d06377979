"""One run per output folder: a lock file that names its holder, and that a dead holder does not keep.

:func:`hold_run_lock` creates ``<run dir>/.onecard.lock`` exclusively (``O_CREAT | O_EXCL``) holding
``{"pid": ..., "host": ...}``. A second run into the same folder stops with one :class:`RunLocked` error
naming the lock file and the process holding it. A lock left by a process that no longer exists on this
host (killed, crashed) is stale: it is taken over, and the run says so. So is a lock file that is empty or
unreadable and older than :data:`EMPTY_GRACE_S` (its holder died between creating and writing it; a live holder
writes it right after creating it).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from .errors import UserError

LOCK_NAME = ".onecard.lock"
"""File name of the lock inside a run folder."""

EMPTY_GRACE_S = 10.0
"""Age in seconds after which an empty or unreadable lock file is stale (its writer had that long to write it)."""


class RunLocked(UserError):
    """Another live process is training into the same output folder."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process; a pid beyond the C range names none either
        return False
    except PermissionError:
        return True
    return True


def _try_create(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
    return True


@contextlib.contextmanager
def hold_run_lock(run_dir: str | Path, enabled: bool = True) -> Iterator[Path | None]:
    """Hold the run folder's lock for the ``with`` block (a no-op when ``enabled`` is false, e.g. rank > 0).

    Folders it creates for the lock are removed again on exit when they are empty (nothing was written).

    Raises:
        RunLocked: a live process on this host (or any process on another host) holds the lock.
    """
    if not enabled:
        yield None
        return
    path = Path(run_dir) / LOCK_NAME
    created = [p for p in (path.parent, *path.parent.parents) if not p.exists()]  # innermost first
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield from _hold(path)
    finally:
        for folder in created:  # a run that wrote nothing (refused, failed early) leaves no empty folders
            try:
                folder.rmdir()
            except OSError:
                break


def _holder(path: Path) -> tuple[str, str]:
    """Who holds the lock file ``path``: ``("free", "")`` (no file), ``("stale", why)`` (a dead process on this host,
    or empty/unreadable for :data:`EMPTY_GRACE_S` or more: may be taken over), ``("held", message)`` (a live holder,
    any holder on another host, or a file created moments ago and not written yet)."""
    if path.is_dir() and not path.is_symlink():
        return "held", (f"the lock {path} is a folder, not a lock file: remove it (rmdir) if no run is using "
                        f"{path.parent}")
    try:
        holder = json.loads(path.read_text() or "null")
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return "free", ""
    except (OSError, ValueError):
        try:
            holder, age = None, time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return "free", ""
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int):
        if age >= EMPTY_GRACE_S:
            return "stale", f"empty or unreadable for {age:.0f} s: its holder died while creating it"
        return "held", (f"{path.parent} is being locked by another run right now (lock {path} was created "
                        f"{age:.1f} s ago and is not written yet): wait a few seconds and try again")
    pid, host = holder["pid"], str(holder.get("host", "?"))
    if host == socket.gethostname() and pid > 0 and not _alive(pid):
        return "stale", f"process {pid} no longer exists"
    return "held", (f"{path.parent} is in use by process {pid} on {host} (lock {path}): wait for that run "
                    f"to end, or use another output folder; if no such process exists, delete {path}")


def check_unlocked(run_dir: str | Path) -> None:
    """Refuse early, without taking it, a run folder whose lock a live run holds (a stale lock passes: the run will
    take it over). Called by the recipes' input checks, so a second run stops before its expensive checks.

    Raises:
        RunLocked: as :func:`hold_run_lock` would.
    """
    state, message = _holder(Path(run_dir) / LOCK_NAME)
    if state == "held":
        raise RunLocked(message)


def _hold(path: Path) -> Iterator[Path]:
    for _ in range(2):
        if _try_create(path):
            break
        state, message = _holder(path)
        if state == "free":
            continue  # its holder just let it go
        if state == "stale":
            print(f"onecard: removing stale lock {path} ({message})", flush=True)
            path.unlink(missing_ok=True)
            continue
        raise RunLocked(message)
    else:
        raise RunLocked(f"cannot take the lock {path}: delete it if no run is using {path.parent}")
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
