"""One latent cache for both recipes: encoder outputs on disk, keyed by everything that decides them.

An entry is one safetensors file of named tensors. Its name is the SHA-256 of its **key** -- a JSON object of every
part that can change the stored tensors (the source file's bytes as :func:`file_sha256`, the window, the size, the
encoder's fingerprint from :func:`module_fingerprint`, the entry format, whatever else the caller adds): a change in
any part gives another name, so a changed source is a miss, never a stale hit. The file also stores its key and the
SHA-256 of its tensors' bytes in its metadata; :meth:`LatentStore.load` compares both, so a file that was replaced,
truncated or damaged is :class:`CorruptEntry`, not data.

Layout: ``<root>/<digest[:2]>/<digest>.safetensors``. Writes go to a temporary name in the same folder and are renamed
into place (:func:`patches.core.io.atomic_write`): two processes filling the cache at once each leave whole files (the
same bytes; the last rename wins), and a killed one leaves at most a ``.*.tmp-*`` file, never half an entry.

What the entries hold and when they are filled is the recipe's: the Cosmos latent-cache lever
(``cosmos_framework_ext.levers.latent_cache``) keys Wan2.2 latents by (clip, window, size, VAE); the H3 recipe
(``miles_ext.recipe.data``) keys a clip's video latent, silent audio latent and caption embedding together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from patches.core.errors import UserError
from patches.core.io import atomic_write

__all__ = ["CorruptEntry", "EntryKey", "LatentCacheError", "LatentStore", "check_folder", "file_sha256",
           "make_key", "module_fingerprint", "tensor_bytes"]


class LatentCacheError(UserError):
    """The latent cache cannot serve or store an entry (missing or corrupt entry, unwritable folder)."""


class CorruptEntry(ValueError):
    """An entry file exists but does not hold what its name promises (the message says why)."""


# ---------------------------------------------------------------------------------------------- keys
_FILE_SHA: dict[tuple[str, int, int, int], str] = {}
_FILE_SHA_LOCK = threading.Lock()


def file_sha256(path: str | Path) -> str:
    """SHA-256 (hex) of the file's bytes, memoised per process by ``(path, size, mtime_ns, inode)``.

    The memo only saves re-reading an unchanged file within one process; the digest itself is of the bytes, so
    a file replaced by another of the same size and mtime gets its own digest in the next process.

    Raises:
        OSError: the file cannot be read.
    """
    st = os.stat(path)
    memo = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    with _FILE_SHA_LOCK:
        if memo in _FILE_SHA:
            return _FILE_SHA[memo]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    digest = h.hexdigest()
    with _FILE_SHA_LOCK:
        _FILE_SHA[memo] = digest
    return digest


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` (contiguous, on the host), any dtype."""
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _jsonable(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


def module_fingerprint(module: nn.Module, dtype: torch.dtype, device: torch.device | str,
                       **extra: str) -> dict[str, str]:
    """What, besides its input, decides an encoder's output: its weights and config, the dtype and device.

    Returns a JSON-able dict: ``weights`` (SHA-256 over every state_dict entry's name, dtype, shape and bytes, in
    name order), ``config`` (the module's ``config`` as sorted JSON; keys starting with ``_`` are bookkeeping --
    diffusers' ``_use_default_values`` is a set whose order changes per process -- and left out), ``class``,
    ``dtype``, ``device`` (kind, and the GPU's name on CUDA), ``torch`` (version), plus ``extra`` (e.g. the pixel
    pipeline's version). Hashing reads every weight once (about 1 s per GiB).
    """
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(tensor_bytes(t))
    config = getattr(module, "config", {})
    dev = torch.device(device)
    where = dev.type
    if dev.type == "cuda":
        where += f":{torch.cuda.get_device_name(dev)}"
    return {
        "class": type(module).__name__,
        "weights": h.hexdigest(),
        "config": json.dumps(_jsonable({k: v for k, v in dict(config).items() if not str(k).startswith("_")}),
                             sort_keys=True),
        "dtype": str(dtype).replace("torch.", ""),
        "device": where,
        "torch": torch.__version__.split("+")[0],
        **extra,
    }


@dataclasses.dataclass(frozen=True)
class EntryKey:
    """An entry's identity: its parts as JSON and their SHA-256 (the file name)."""

    parts: str
    """Sorted JSON of the key parts (stored in the entry's metadata and compared on every load)."""
    digest: str
    """SHA-256 hex of :attr:`parts`."""


def make_key(parts: Mapping[str, Any]) -> EntryKey:
    """The :class:`EntryKey` of ``parts`` (JSON-able values; key order does not matter)."""
    text = json.dumps(_jsonable(dict(parts)), sort_keys=True)
    return EntryKey(text, hashlib.sha256(text.encode()).hexdigest())


def _checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(tensor_bytes(tensors[name]))
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- the store
class LatentStore:
    """Entries of named tensors on disk under ``root``, one safetensors file per :class:`EntryKey`.

    Args:
        root: the cache folder (created on the first write).
        fix: what the user should set to use another folder, for messages (e.g. ``"set ONECARD_LATENT_CACHE to
            another folder"``).
    """

    def __init__(self, root: str | Path, fix: str = "use another cache folder") -> None:
        self.root = Path(root)
        self.fix = fix

    def path(self, key: EntryKey) -> Path:
        """``<root>/<digest[:2]>/<digest>.safetensors``."""
        return self.entry_path(key.digest)

    def entry_path(self, digest: str) -> Path:
        """The file of the entry whose key has SHA-256 ``digest`` (hex), as :meth:`path` names it."""
        return self.root / digest[:2] / f"{digest}.safetensors"

    def load(self, key: EntryKey) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The entry's tensors (CPU) and metadata, verified against ``key`` and the stored checksum.

        Raises:
            FileNotFoundError: no entry.
            CorruptEntry: the file does not parse, or its stored key or checksum differs.
        """
        from safetensors import safe_open

        path = self.path(key)
        if not path.is_file():
            raise FileNotFoundError(str(path))
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # noqa: BLE001 - any reader error means the file is not a whole entry
            raise CorruptEntry(f"{path}: does not parse as safetensors ({' '.join(str(e).split())[:120]})") from None
        if meta.get("key") != key.parts:
            raise CorruptEntry(f"{path}: its stored key differs from the one its name stands for")
        if _checksum(tensors) != meta.get("sha256"):
            raise CorruptEntry(f"{path}: checksum mismatch (the file was changed or damaged)")
        return tensors, meta

    def store(self, key: EntryKey, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str] | None = None) -> Path:
        """Write ``tensors`` as ``key``'s entry, atomically; returns the path.

        Raises:
            LatentCacheError: the entry cannot be written (disk full, a read-only shard folder, a directory where the
                entry file belongs, a file where its shard folder belongs): one line naming the cache folder, the
                path and the fix; the temporary file is removed.
        """
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        host = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        seen: set[int] = set()
        for name, t in host.items():  # safetensors refuses tensors that share memory: give each its own
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                host[name] = t.clone()
            seen.add(host[name].untyped_storage().data_ptr())
        full = {**dict(meta or {}), "key": key.parts, "sha256": _checksum(host)}
        path = self.path(key)
        new_shard = not os.path.lexists(path.parent)
        try:
            return atomic_write(path, lambda p: save_file(host, str(p), metadata=full))
        except (OSError, SafetensorError) as e:
            if new_shard:  # leave the folder as it was: no empty shard folder from a failed write
                with contextlib.suppress(OSError):
                    path.parent.rmdir()
            raise LatentCacheError(f"latent cache folder {self.root} cannot be written: {write_problem(e, path)}; "
                                   f"or {self.fix}") from None

    def ensure(self, what: str) -> None:
        """Create :attr:`root` if needed and check it is writable.

        Raises:
            LatentCacheError: it cannot be created or is not writable (names ``what`` to set instead).
        """
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LatentCacheError(f"latent cache folder {self.root} cannot be created ({e}): set {what} to a "
                                   "writable folder") from None
        if not os.access(self.root, os.W_OK):
            raise LatentCacheError(f"latent cache folder {self.root} is not writable: set {what} to a writable folder")


def check_folder(root: str | Path, what: str) -> Path:
    """That the cache folder ``root`` is (or can be created as) a writable folder; creates nothing (preflight).

    Raises:
        UserError: ``root`` is a regular file (:class:`LatentCacheError`, "is a file, not a folder"), lies under a
            file, or its nearest existing folder is not writable (:func:`patches.core.preflight.check_writable`);
            the message names ``what`` (the variable or flag to change).
    """
    from patches.core.preflight import check_writable

    root = Path(root)
    if root.exists() and not root.is_dir():
        raise LatentCacheError(f"latent cache folder {root} is a file, not a folder: set {what} to a folder (or "
                               "remove the file)")
    return check_writable(root, what)


def write_problem(e: BaseException, path: Path) -> str:
    """What stopped writing the entry ``path`` (an ``OSError`` or a safetensors error) and its fix, in one phrase."""
    why = " ".join(str(e).split())[:160] or type(e).__name__
    if isinstance(e, IsADirectoryError) or path.is_dir():
        return f"{path} is a directory where an entry file belongs: remove it"
    if isinstance(e, (FileExistsError, NotADirectoryError)) or (path.parent.exists() and not path.parent.is_dir()):
        return f"{path.parent} is a file where a shard folder belongs: remove it"
    if getattr(e, "errno", None) in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{path.parent} is read-only ({why}): make it writable"
    if getattr(e, "errno", None) == errno.ENOSPC or "StorageFull" in why or "No space" in why:
        return f"the disk is full writing {path.name} ({why}): free space"
    return f"writing {path} failed ({type(e).__name__}: {why}): free disk space or fix the folder's permissions"
