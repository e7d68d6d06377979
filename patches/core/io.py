"""Atomic file writes: readers never see half a file, and a failed write leaves nothing behind.

Every writer here writes to a temporary name in the destination's folder (``.<name>.tmp-<random>``),
flushes and fsyncs it, then ``os.replace``-s it onto the destination; on any exception the temporary
file is removed and the destination is untouched.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
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


def own_storage(obj: Any) -> Any:
    """``obj`` (tensors inside dicts, lists and tuples) with every tensor that views a larger storage replaced by a
    tensor whose storage holds just its elements; other tensors and values are returned as they are.

    ``torch.save`` writes a tensor's whole storage. A tensor that views part of a larger buffer -- an offloaded
    FSDP2 shard in the exact pinned arena (:mod:`miles_ext.levers.pinned`), whose ``full_tensor()`` at one rank is such a
    view -- would carry the whole buffer into the file (the whole 66 GB arena for one 33 B H3 checkpoint).

    A contiguous CPU view is re-wrapped without a copy (``torch.from_numpy`` over the same bytes, so the new
    storage starts at the view and is exactly as long; 2-byte dtypes numpy lacks, such as bfloat16, travel as
    int16): a checkpoint of the 1.38 GB of fp32 LoRA tensors under full offload then adds no host memory. Any
    other view (non-contiguous, CUDA, a dtype numpy cannot hold) is cloned.
    """
    import torch

    def own(tensor: Any) -> Any:
        t = tensor.detach()
        if t.layout != torch.strided or t.is_nested:  # sparse / nested: no one storage; torch.save writes their parts
            return tensor
        if not (t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
            return tensor
        return alias_bytes(t)

    return map_tensors(obj, own)


def map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` (tensors inside dicts, lists and tuples, rebuilt) with ``fn`` applied to every tensor; other values as
    they are."""
    import torch

    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


_NUMPY_STAND_IN = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def alias_bytes(t: Any) -> Any:
    """A tensor equal to ``t`` with a storage object of its own holding exactly ``t``'s elements: the same bytes (no
    copy) where ``t`` is a contiguous CPU tensor, else a copy. ``torch.save`` writes it as an entry of its own, so a
    file that holds the same values under two keys loads them into two tensors that do not share memory."""
    import torch

    if t.device.type != "cpu" or not t.is_contiguous() or t.is_quantized:
        return t.clone()
    stand_in = _NUMPY_STAND_IN.get(str(t.dtype).removeprefix("torch."))
    try:
        viewed = t.view(getattr(torch, stand_in)) if stand_in else t
        alias = torch.from_numpy(viewed.numpy())
    except (TypeError, RuntimeError):  # a dtype numpy cannot hold (complex32, uint16 on old numpy, ...)
        return t.clone()
    return alias.view(t.dtype) if stand_in else alias


_SAVE = threading.local()


def _cpu_tag(storage: Any) -> str | None:
    """``torch.serialization`` location tagger, active only inside :func:`atomic_torch_save`: every storage is tagged
    ``"cpu"`` (torch.save copies a GPU storage to the host one at a time as it writes it)."""
    if getattr(_SAVE, "active", False) and getattr(storage, "device", None) is not None:
        return "cpu"
    return None


def _no_restore(storage: Any, location: str) -> None:
    return None  # loading is left to torch's own deserializers


@functools.cache
def _register_cpu_tag() -> None:
    """Register :func:`_cpu_tag` with ``torch.serialization`` (once per process)."""
    import torch

    torch.serialization.register_package(0, _cpu_tag, _no_restore)


def atomic_torch_save(obj: Any, path: str | Path) -> Path:
    """``torch.save(obj, path)`` atomically, each tensor saved with only its own elements (:func:`own_storage`).

    A tensor on the GPU is written as a CPU tensor: the file is what saving its ``.cpu()`` copy writes and loads on a
    machine without a GPU, but torch.save copies it to the host only when it writes it, one storage at a time, so the
    save never holds a second copy of the whole state in host memory. An entry that is a
    :class:`patches.core.streamsave.Deferred` is made only when it is written (:func:`patches.core.streamsave.save`):
    the file is what saving the made tensor writes; in such a file every storage that is not already whole in host
    memory is copied or made :data:`patches.core.streamsave.CHUNK_BYTES` at a time.
    """
    import torch

    from .streamsave import holds_deferred, save

    _register_cpu_tag()
    # entries made only as they are written, GPU storages copied a piece at a time (patches.core.streamsave)
    streamed = holds_deferred(obj)

    def write(p: Path) -> None:
        _SAVE.active = True
        try:
            (save if streamed else torch.save)(own_storage(obj), p)
        finally:
            _SAVE.active = False

    return atomic_write(path, write)


def _file_backed_spans() -> list[tuple[int, int]]:
    """``(start, end)`` of this process's private file-backed mappings (``/proc/self/maps`` entries with an inode
    and a path); empty where there is no ``/proc``."""
    spans = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[4] != "0" and parts[5].startswith("/") and parts[1][3] == "p":
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    spans.append((lo, hi))
    except OSError:
        return []
    return spans


def _unwritten_runs(lo: int, hi: int, page: int) -> list[tuple[int, int]]:
    """``(start, end)`` runs of the pages in ``[lo, hi)`` (page-aligned addresses) that hold no data of their own:
    each is a page-cache page of its file, or not in memory at all (``/proc/self/pagemap``: "file-page" bit 61 set,
    or neither "present" bit 63 nor "swapped" bit 62). A page of a private file mapping that was written holds the
    process's own copy (copy-on-write, anonymous): dropping it would revert the written data to the file's, so such
    pages end a run. Empty where pagemap cannot be read (nothing is then dropped)."""
    import numpy as np

    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(lo // page * 8)
            raw = f.read((hi - lo) // page * 8)
    except OSError:
        return []
    entry = np.frombuffer(raw, dtype=np.uint64)
    if entry.size != (hi - lo) // page:
        return []
    own = ((entry >> np.uint64(61)) & np.uint64(1)) == 0
    own &= ((entry >> np.uint64(62)) & np.uint64(3)) != 0  # present or swapped, and not a file page
    edges = np.flatnonzero(np.diff(np.concatenate(([True], own, [True])).astype(np.int8)))
    return [(lo + int(a) * page, lo + int(b) * page) for a, b in zip(edges[::2], edges[1::2])]


def release_file_pages(tensors: Any) -> int:
    """Drop the resident pages of host tensors that are done being read and that view a file mapping
    (``torch.load(..., mmap=True)``); returns the bytes released.

    Each such page counts in the process's RSS (and VmHWM) for as long as the mapping lives, which is as long as
    any tensor of that file does: resuming the 33 B H3 run kept the 1.29 GiB of read LoRA pages resident beside
    the arena they were copied into. ``madvise(MADV_DONTNEED)`` on a private file mapping drops the pages (a later
    read would fetch them from the file again). Only whole pages inside a tensor's own bytes and inside a private
    file-backed mapping are dropped: anonymous memory, which ``MADV_DONTNEED`` would zero, is never touched, and
    neither is a page of the mapping that was written after the load (its private copy-on-write copy would be
    dropped and the written values read back from the file: :func:`_unwritten_runs`). Linux only; elsewhere, or
    without ``/proc/self/pagemap``, nothing is released.
    """
    import ctypes
    import sys

    import torch

    if not sys.platform.startswith("linux"):
        return 0
    spans = _file_backed_spans()
    if not spans:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    released = 0
    for t in (tensors.values() if isinstance(tensors, dict) else tensors):
        if not torch.is_tensor(t) or t.device.type != "cpu" or not t.is_contiguous():
            continue
        lo = -(-t.data_ptr() // page) * page
        hi = (t.data_ptr() + t.numel() * t.element_size()) // page * page
        if hi > lo and any(a <= lo and hi <= b for a, b in spans):
            for a, b in _unwritten_runs(lo, hi, page):
                if libc.madvise(a, b - a, 4) == 0:  # 4 = MADV_DONTNEED
                    released += b - a
    return released
