"""Lever 4 (``COSMOS_LATENT_CACHE=1``): encode every clip window once, then train from the stored latents.

The VAE is frozen and its encode is deterministic (posterior mean, no sampling), so the latent of a
(clip, window, size) is the same at every epoch. A **pre-pass** encodes every ``(clip, window, target
size)`` the embedded loader can yield (every window of every JSONL row, at the row's resolution bucket:
:func:`items_for`) exactly as the online path does -- the same :func:`online_latent` call the trainer
makes without the lever: ``decode_window`` -> float32 ``[3, T, H, W]`` in [-1, 1] -> batch of one, cast to
the VAE's dtype and device -> :func:`~cosmos_framework_ext.vae_offload.encode_latents` (posterior mean,
``(mu - latents_mean) * (1 / latents_std)``) -- and stores each normalised latent in the VAE's dtype
(bf16 on a GPU, fp32 on the CPU) as one safetensors file. Training then reads the latents from disk on the
prefetch threads and never puts the VAE on the GPU (the trainer frees it after the pre-pass; the ledger
counts 0 GPU bytes for it).

**Key.** An entry is named by the SHA-256 of everything that can change the latent (:meth:`LatentCache.key`):
the video file's bytes (SHA-256 of the file, memoised per process by path, size, mtime and inode), the
window ``(start_frame, num_frames)``, the target size ``(W, H)``, and the VAE fingerprint
(:func:`vae_fingerprint`: SHA-256 of every weight's bytes, name, dtype and shape; the VAE config including
``latents_mean``/``latents_std``; the encode dtype; the device kind and name; the torch and PyAV versions;
and the pixel pipeline's version :data:`PIPELINE`). A change in any of them gives another name: a miss,
never a stale hit. Each file also carries its full key (JSON) and the SHA-256 of the latent's bytes in
its safetensors metadata; a file whose metadata, dtype, shape or checksum does not match, or that does not
parse, is **corrupt**: the pre-pass re-encodes it with a warning, and training refuses it (one
:class:`LatentCacheError` naming the fix).

**Layout.** ``<root>/<digest[:2]>/<digest>.safetensors``, one tensor ``"latent"`` ``[1, z_dim, (T - 1)
// 4 + 1, H / 16, W / 16]``. ``<root>`` is :func:`patches.core.flags.latent_cache_dir`
(``$ONECARD_LATENT_CACHE``, default ``$ONECARD_DATA_CACHE/latents``). Writes go to a temporary name in
the same folder and are renamed into place (:func:`patches.core.io.atomic_write`), so two runs filling the
cache at once each leave whole files (the same bytes; the last rename wins) and a killed run leaves at most
a ``.*.tmp-*`` file, never a half entry.

Run alone (exit 0; 2 with one ``error:`` line on bad input)::

    python -m cosmos_framework_ext.latent_cache --toml toml/vision_sft_edge_24gb.toml

It builds the VAE exactly as the trainer does (same preset, seed and ``WAN_VAE_PATH``), so the trainer's
own pre-pass then finds every entry (all hits).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from patches.core.errors import UserError
from patches.core.flags import LATENT_CACHE_DIR, latent_cache_dir
from patches.core.io import atomic_write
from patches.core.runtime import group_moves_host_tensors

from .vae_offload import encode_latents

__all__ = [
    "FORMAT",
    "PIPELINE",
    "CacheItem",
    "CorruptEntry",
    "EntryKey",
    "LatentCache",
    "LatentCacheError",
    "PrepassReport",
    "check_folder",
    "file_sha256",
    "items_for",
    "main",
    "online_latent",
    "vae_fingerprint",
]

log = logging.getLogger("onecard.latent_cache")

FORMAT = "onecard-latent-v1"
"""Version of the entry format; part of every key (a new format misses every old entry)."""
PIPELINE = "decode_window(PyAV decode, swscale AREA cover + centre crop, uint8/127.5-1 fp32) v1"
"""Version of the pixel pipeline in front of the encode; part of the VAE fingerprint."""
TENSOR = "latent"
"""Name of the one tensor in an entry file."""


class LatentCacheError(UserError):
    """The latent cache cannot serve a sample (missing or corrupt entry, unwritable folder)."""


class CorruptEntry(ValueError):
    """An entry file exists but does not hold the latent its name promises (message says why)."""


# ---------------------------------------------------------------------------------------------- encode
def online_latent(vae: nn.Module, video: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """The trainer's online encode of one decoded window (the cache stores exactly this).

    Args:
        vae: the frozen ``AutoencoderKLWan`` (with or without a ``VAEOffload`` attached).
        video: float32 ``[3, T, H, W]`` in [-1, 1] (``SftSample.video``).
        device: where the VAE encodes.
        dtype: the VAE's parameter dtype (the clip is cast to it).

    Returns:
        ``[1, z_dim, (T - 1) // 4 + 1, H / 16, W / 16]`` in ``dtype`` on ``device`` (the trainer casts it to
        fp32 after).
    """
    return encode_latents(vae, video.unsqueeze(0).to(device, dtype))


# ---------------------------------------------------------------------------------------------- keys
_FILE_SHA: dict[tuple[str, int, int, int], str] = {}
_FILE_SHA_LOCK = threading.Lock()


def file_sha256(path: str | Path) -> str:
    """SHA-256 (hex) of the file's bytes, memoised per process by ``(path, size, mtime_ns, inode)``.

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


def _tensor_bytes(t: torch.Tensor) -> bytes:
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


def vae_fingerprint(vae: nn.Module, dtype: torch.dtype, device: torch.device | str) -> dict[str, str]:
    """What, besides the clip, decides a latent: the VAE's weights and config, the encode dtype and device.

    Returns a JSON-able dict: ``weights`` (SHA-256 over every state_dict entry's name, dtype, shape and bytes,
    in name order), ``config`` (the VAE config as sorted JSON, ``latents_mean``/``latents_std`` included; keys
    starting with ``_`` are bookkeeping -- ``_use_default_values`` is a set whose order changes per process --
    and left out),
    ``class``, ``dtype``, ``device`` (kind, and the GPU's name on CUDA), ``torch`` and ``av`` versions,
    ``pipeline`` (:data:`PIPELINE`). Hashing reads every weight once (about 1 s per GiB).
    """
    h = hashlib.sha256()
    for name, t in sorted(vae.state_dict().items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(_tensor_bytes(t))
    config = getattr(vae, "config", {})
    dev = torch.device(device)
    where = dev.type
    if dev.type == "cuda":
        where += f":{torch.cuda.get_device_name(dev)}"
    try:
        import av

        av_version = av.__version__
    except ImportError:  # pragma: no cover - av is a dependency
        av_version = "none"
    return {
        "class": type(vae).__name__,
        "weights": h.hexdigest(),
        "config": json.dumps(_jsonable({k: v for k, v in dict(config).items() if not str(k).startswith("_")}),
                             sort_keys=True),
        "dtype": str(dtype).replace("torch.", ""),
        "device": where,
        "torch": torch.__version__.split("+")[0],
        "av": av_version,
        "pipeline": PIPELINE,
    }


@dataclasses.dataclass(frozen=True)
class CacheItem:
    """One (clip, window, size) the loader can yield."""

    video_path: Path
    """Absolute path of the video file."""
    window: tuple[int, int]
    """``(start_frame, num_frames)``."""
    size: tuple[int, int]
    """Target ``(W, H)`` in pixels."""


@dataclasses.dataclass(frozen=True)
class EntryKey:
    """A cache entry's identity: its parts as JSON and their SHA-256 (the file name)."""

    parts: str
    """Sorted JSON of the key parts (stored in the entry's metadata and compared on every load)."""
    digest: str
    """SHA-256 hex of :attr:`parts`."""


def items_for(records: Sequence[Any], preset: Any) -> list[CacheItem]:
    """Every (clip, window, size) the embedded loader can yield for ``records``: each window of each row at
    the row's resolution bucket (:func:`~cosmos_framework_ext.data.target_size`), duplicates removed, in row
    order."""
    from .data import target_size

    seen: dict[CacheItem, None] = {}
    for rec in records:
        size = tuple(target_size(rec.width, rec.height, preset))
        for w in rec.windows:
            seen.setdefault(CacheItem(Path(rec.video_path), (int(w[0]), int(w[1])), size), None)
    return list(seen)


# ---------------------------------------------------------------------------------------------- report
@dataclasses.dataclass
class PrepassReport:
    """What a pre-pass did: over this rank's share of the items from :meth:`LatentCache.prepass`, over every
    rank's after :func:`run_prepass` (summed once all ranks are done)."""

    entries: int
    """Distinct (clip, window, size) items."""
    hits: int
    """Items whose entry was there and verified."""
    misses: int
    """Items encoded because their entry was missing."""
    corrupt: int
    """Items whose entry was there but corrupt, re-encoded (each also warned about)."""
    bytes_on_disk: int
    """Bytes of this item set's entry files after the pre-pass."""
    seconds: float
    """Wall time of the pre-pass, s (verify + decode + encode + write)."""
    encode_seconds: float
    """Of that, time spent decoding and encoding misses, s."""
    root: str
    """The cache folder."""

    def line(self) -> str:
        """One human line: hits/misses, bytes on disk, time."""
        return (f"latent cache {self.root}: {self.entries} clip windows, {self.hits} hits, {self.misses} misses"
                f"{f', {self.corrupt} corrupt re-encoded' if self.corrupt else ''}; "
                f"{self.bytes_on_disk / 2**20:.1f} MiB on disk; pre-pass {self.seconds:.1f} s "
                f"(encoding {self.encode_seconds:.1f} s)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------- the cache
class LatentCache:
    """Normalised VAE latents on disk, one safetensors file per (clip, window, size, VAE fingerprint).

    Args:
        root: the cache folder (created on the first write).
        fingerprint: :func:`vae_fingerprint` of the VAE that encodes (or encoded) the entries.
        vae: the VAE, needed only to encode (pre-pass); ``None`` for a read-only cache (training).
        device: where ``vae`` encodes.
        dtype: the VAE's parameter dtype; also the dtype every entry must hold.

    Raises:
        ValueError: ``dtype`` does not match ``fingerprint["dtype"]``.
    """

    def __init__(self, root: str | Path, fingerprint: dict[str, str], *, vae: nn.Module | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if fingerprint.get("dtype") != str(dtype).replace("torch.", ""):
            raise ValueError(f"fingerprint dtype {fingerprint.get('dtype')} does not match the encode dtype {dtype}")
        self.root = Path(root)
        self.fingerprint = dict(fingerprint)
        self.vae_digest = hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()
        self.vae = vae
        self.device = torch.device(device)
        self.dtype = dtype
        config = json.loads(self.fingerprint.get("config") or "{}")
        self._tf = int(config.get("scale_factor_temporal", 4))
        self._sf = int(config.get("scale_factor_spatial", 16))
        self._z = config.get("z_dim")

    @classmethod
    def for_vae(cls, vae: nn.Module, device: torch.device | str, root: str | Path | None = None) -> "LatentCache":
        """A cache that encodes with ``vae`` on ``device`` in the VAE's parameter dtype; ``root`` defaults to
        :func:`patches.core.flags.latent_cache_dir`."""
        dtype = next(vae.parameters()).dtype
        return cls(root if root is not None else latent_cache_dir(), vae_fingerprint(vae, dtype, device),
                   vae=vae, device=device, dtype=dtype)

    def read_only(self) -> "LatentCache":
        """The same cache without the VAE (what training holds: it cannot encode)."""
        return LatentCache(self.root, self.fingerprint, device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------ naming
    def key(self, item: CacheItem) -> EntryKey:
        """The entry key of ``item``: file bytes, window, size, VAE fingerprint, format."""
        parts = {
            "format": FORMAT,
            "video_sha256": file_sha256(item.video_path),
            "window": [int(item.window[0]), int(item.window[1])],
            "size": [int(item.size[0]), int(item.size[1])],
            "vae": self.vae_digest,
        }
        text = json.dumps(parts, sort_keys=True)
        return EntryKey(text, hashlib.sha256(text.encode()).hexdigest())

    def path(self, key: EntryKey) -> Path:
        """``<root>/<digest[:2]>/<digest>.safetensors``."""
        return self.root / key.digest[:2] / f"{key.digest}.safetensors"

    def _expected_shape(self, item: CacheItem) -> tuple[int, ...]:
        (w, h), n = item.size, item.window[1]
        z = int(self._z) if self._z is not None else -1
        return (1, z, (n - 1) // self._tf + 1, h // self._sf, w // self._sf)

    # ------------------------------------------------------------ entries
    def load(self, item: CacheItem, key: EntryKey | None = None) -> torch.Tensor:
        """The stored latent of ``item`` (CPU, :attr:`dtype`, ``[1, z, T', H', W']``), verified.

        Raises:
            FileNotFoundError: no entry.
            CorruptEntry: the file does not parse, or its key, format, dtype, shape or checksum differs.
        """
        from safetensors import safe_open

        key = key or self.key(item)
        path = self.path(key)
        if not path.is_file():
            raise FileNotFoundError(str(path))
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                latent = f.get_tensor(TENSOR)
        except Exception as e:  # noqa: BLE001 - any reader error means the file is not a whole entry
            raise CorruptEntry(f"{path}: does not parse as safetensors ({' '.join(str(e).split())[:120]})") from None
        if meta.get("key") != key.parts:
            raise CorruptEntry(f"{path}: its stored key differs from the one its name stands for")
        if latent.dtype != self.dtype:
            raise CorruptEntry(f"{path}: holds {latent.dtype}, the encode yields {self.dtype}")
        want = self._expected_shape(item)
        if latent.dim() != 5 or any(w not in (-1, s) for w, s in zip(want, latent.shape)):
            raise CorruptEntry(f"{path}: shape {tuple(latent.shape)}, expected {want}")
        if hashlib.sha256(_tensor_bytes(latent)).hexdigest() != meta.get("sha256"):
            raise CorruptEntry(f"{path}: checksum mismatch (the file was changed or damaged)")
        return latent

    def store(self, item: CacheItem, latent: torch.Tensor, key: EntryKey | None = None) -> Path:
        """Write ``latent`` (as the online encode returned it) as ``item``'s entry, atomically; returns the path.

        Raises:
            LatentCacheError: the entry cannot be written (disk full, a read-only shard folder, a directory where
                the entry file belongs, a file where its shard folder belongs): one line naming the cache folder,
                the path and the fix; the temporary file is removed.
        """
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        key = key or self.key(item)
        tensor = latent.detach().to("cpu").contiguous()
        meta = {"key": key.parts, "sha256": hashlib.sha256(_tensor_bytes(tensor)).hexdigest(),
                "format": FORMAT, "vae": json.dumps(self.fingerprint, sort_keys=True)}
        path = self.path(key)
        new_shard = not os.path.lexists(path.parent)
        try:
            return atomic_write(path, lambda p: save_file({TENSOR: tensor}, str(p), metadata=meta))
        except (OSError, SafetensorError) as e:
            if new_shard:  # leave the folder as it was: no empty shard folder from a failed write
                with contextlib.suppress(OSError):
                    path.parent.rmdir()
            raise LatentCacheError(f"latent cache folder {self.root} cannot be written: {_write_problem(e, path)}; "
                                   f"or set {LATENT_CACHE_DIR} to another folder") from None

    def encode(self, item: CacheItem) -> torch.Tensor:
        """Decode ``item``'s window and encode it exactly as the trainer's online path does (CPU copy).

        Raises:
            RuntimeError: this cache has no VAE (read-only).
            DatasetError: the window does not decode.
        """
        from .data import DEFAULT_CLIP_CACHE, decode_window

        if self.vae is None:
            raise RuntimeError("this LatentCache has no VAE: it can only read entries")
        video = decode_window(item.video_path, item.window[0], item.window[1], item.size, DEFAULT_CLIP_CACHE)
        with torch.no_grad():
            return online_latent(self.vae, video, self.device, self.dtype).to("cpu")

    def get(self, item: CacheItem) -> torch.Tensor:
        """The latent for training: read and verified, never encoded.

        Raises:
            LatentCacheError: the entry is missing or corrupt (names the file and the fix).
        """
        try:
            return self.load(item)
        except (FileNotFoundError, CorruptEntry) as e:
            what = "missing" if isinstance(e, FileNotFoundError) else f"corrupt ({e})"
            raise LatentCacheError(
                f"latent cache entry for {item.video_path.name} window {list(item.window)} size {list(item.size)} is "
                f"{what}: run `python -m cosmos_framework_ext.latent_cache --toml <recipe>` (or restart the run: its "
                f"pre-pass re-encodes it), or unset COSMOS_LATENT_CACHE"
            ) from None

    # ------------------------------------------------------------ the pre-pass
    def prepass(self, items: Iterable[CacheItem], *, rank: int = 0, world_size: int = 1, progress: bool = True,
                workers: int = 2) -> PrepassReport:
        """Verify and, where missing or corrupt, encode this rank's share of the items (every ``world_size``-th
        item, starting at ``rank``: fixed by position, so the shares of ranks that check at the same time never
        depend on what another rank has written yet), decoding on ``workers`` threads ahead of the encode.

        Shows a tqdm bar (with ETA) on stderr when ``progress``; logs one warning per corrupt entry.

        Raises:
            RuntimeError: an entry must be encoded but this cache has no VAE.
            DatasetError: a window does not decode.
            LatentCacheError: an entry cannot be written (:meth:`store`).
        """
        from tqdm import tqdm

        t0 = time.perf_counter()
        items = list(items)
        keys = [self.key(it) for it in items]
        todo: list[tuple[CacheItem, EntryKey, bool]] = []  # (item, key, its entry was corrupt)
        hits = 0
        for i, (it, k) in enumerate(zip(items, keys)):
            if i % world_size != rank:
                continue
            try:
                self.load(it, k)
                hits += 1
                continue
            except FileNotFoundError:
                todo.append((it, k, False))
            except CorruptEntry as e:
                log.warning("latent cache: %s; re-encoding it", e)
                todo.append((it, k, True))
        mine = [(it, k) for it, k, _ in todo]
        corrupt_mine = sum(bad for _, _, bad in todo)
        enc_s = 0.0
        if mine:
            if self.vae is None:
                raise RuntimeError(f"{len(mine)} latent cache entries must be encoded, but this cache has no VAE")
            from .data import DEFAULT_CLIP_CACHE, decode_window
            from .train import prefetched

            def decode(pair):
                it, k = pair
                return it, k, decode_window(it.video_path, it.window[0], it.window[1], it.size, DEFAULT_CLIP_CACHE)

            bar = tqdm(total=len(mine), desc="latent cache pre-pass", unit="clip", disable=not progress,
                       file=sys.stderr, dynamic_ncols=True)
            te = time.perf_counter()
            with bar, torch.no_grad():
                for it, k, video in prefetched(mine, workers=workers, depth=2 * workers, load=decode):
                    self.store(it, online_latent(self.vae, video, self.device, self.dtype).to("cpu"), k)
                    bar.update(1)
            enc_s = time.perf_counter() - te
        nbytes = sum(p.stat().st_size for p in {self.path(k) for k in keys} if p.is_file())
        return PrepassReport(entries=len(items), hits=hits, misses=len(mine) - corrupt_mine, corrupt=corrupt_mine,
                             bytes_on_disk=nbytes, seconds=time.perf_counter() - t0, encode_seconds=enc_s,
                             root=str(self.root))


def check_folder(root: str | Path) -> Path:
    """That the cache folder ``root`` is (or can be created as) a writable folder; creates nothing (the trainer's
    preflight and the CLI call it before building anything).

    Raises:
        UserError: ``root`` is a regular file (:class:`LatentCacheError`, "is a file, not a folder"), lies under a
            file, or its nearest existing folder is not writable (:func:`patches.core.preflight.check_writable`).
    """
    from patches.core.preflight import check_writable

    root = Path(root)
    if root.exists() and not root.is_dir():
        raise LatentCacheError(f"latent cache folder {root} is a file, not a folder: set {LATENT_CACHE_DIR} to a "
                               "folder (or remove the file)")
    return check_writable(root, LATENT_CACHE_DIR)


def run_prepass(vae: nn.Module, device: torch.device, records: Sequence[Any], preset: Any, *, rank: int = 0,
                world_size: int = 1, progress: bool = True, root: str | Path | None = None,
                ) -> tuple[LatentCache, PrepassReport]:
    """The trainer's pre-pass: fingerprint ``vae`` (on the host), move it to ``device``, fill the cache for every
    item of ``records``, move it back to the host. Returns the read-only cache training uses and the report.

    The VAE is on ``device`` only inside this call. Every rank encodes its share of the misses, then (with
    ``torch.distributed`` initialised) waits for the others.

    Raises:
        LatentCacheError: the cache folder cannot be written (names it and the fix).
        DatasetError: a window does not decode.
    """
    cache = LatentCache.for_vae(vae, device, root)
    check_folder(cache.root)
    try:
        cache.root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LatentCacheError(f"latent cache folder {cache.root} cannot be created ({e}): set {LATENT_CACHE_DIR} "
                               "to a writable folder") from None
    if not os.access(cache.root, os.W_OK):
        raise LatentCacheError(f"latent cache folder {cache.root} is not writable: set {LATENT_CACHE_DIR} to a "
                               "writable folder")
    home = next(vae.parameters()).device
    vae.to(device)
    try:
        report = cache.prepass(items_for(records, preset), rank=rank, world_size=world_size, progress=progress)
    finally:
        vae.to(home)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every share written before anyone trains
        counts = torch.tensor([report.hits, report.misses, report.corrupt], dtype=torch.int64)
        if not group_moves_host_tensors():
            counts = counts.to(device)
        torch.distributed.all_reduce(counts)
        hits, misses, corrupt = (int(c) for c in counts.cpu())
        nbytes = sum(p.stat().st_size for p in {cache.path(cache.key(it)) for it in items_for(records, preset)}
                     if p.is_file())
        report = dataclasses.replace(report, hits=hits, misses=misses, corrupt=corrupt, bytes_on_disk=nbytes)
    return cache.read_only(), report


def _write_problem(e: BaseException, path: Path) -> str:
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


# ---------------------------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cosmos_framework_ext.latent_cache --toml RECIPE``: fill the cache for a recipe, then exit.

    Reads the recipe, the dataset (``DATASET_PATH`` or the sample dataset) and ``WAN_VAE_PATH`` exactly as the
    trainer does, builds the trainer's VAE (same preset and seed; the transformer is built too, because a
    random-init VAE takes its weights from the random stream after it), runs the pre-pass and prints one line
    with hits/misses, bytes on disk and time. Exit 0, or 2 with one ``error:`` line on bad input.
    """
    ap = argparse.ArgumentParser(prog="python -m cosmos_framework_ext.latent_cache",
                                 description="Fill the latent cache (lever 4) for a recipe TOML.")
    ap.add_argument("--toml", required=True, help="recipe TOML (as for the trainer's --sft-toml)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    def fill() -> None:
        from . import train

        check_folder(latent_cache_dir())  # before the model and VAE are built
        recipe = train.CosmosSFT(train.parse_args(["--sft-toml", args.toml, "--no-save"]))
        recipe.preflight()
        with contextlib.ExitStack() as stack:
            recipe.build(stack)
            recipe.model = recipe.opt = None  # only the VAE is needed from here on
            _, report = run_prepass(recipe.vae, recipe.device, recipe.records, recipe.preset, rank=recipe.rank,
                                    world_size=recipe.world, progress=not args.no_progress)
        if recipe.main_rank:
            print(report.line(), flush=True)

    from patches.core.errors import cli

    return cli(fill)


if __name__ == "__main__":
    sys.exit(main())
