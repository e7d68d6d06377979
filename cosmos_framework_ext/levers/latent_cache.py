"""Lever 4 (``COSMOS_LATENT_CACHE=1``): encode every clip window once, then train from the stored latents.

The VAE is frozen and its encode is deterministic (posterior mean, no sampling), so the latent of a
(clip, window, size) is the same at every epoch. A **pre-pass** encodes every ``(clip, window, target
size)`` the embedded loader can yield (every window of every JSONL row, at the row's resolution bucket: the
recipe's ``cache_items``) exactly as the online path does -- the same :func:`online_latent` call the trainer
makes without the lever (the recipe passes it in as ``encode``: ``decode_window`` -> float32 ``[3, T, H, W]`` in
[-1, 1] -> batch of one, cast to the VAE's dtype and device -> the recipe's ``encode_latents`` (posterior mean,
``(mu - latents_mean) * (1 / latents_std)``)) -- and stores each normalised latent in the VAE's dtype
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

**Storage** is the shared store :class:`patches.core.data.latents.LatentStore` (the H3 recipe's clip cache uses
it too): ``<root>/<digest[:2]>/<digest>.safetensors``, here one tensor ``"latent"`` ``[1, z_dim, (T - 1) // 4 + 1,
H / 16, W / 16]``, written atomically. ``<root>`` is :func:`patches.core.flags.latent_cache_dir`
(``$ONECARD_LATENT_CACHE``, default ``$ONECARD_DATA_CACHE/latents``).

Run alone: ``python -m cosmos_framework_ext.recipe.prepass --toml RECIPE`` (it builds the VAE exactly as the
trainer does, so the trainer's own pre-pass then finds every entry).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from patches.core.data.latents import (CorruptEntry, EntryKey, LatentCacheError, LatentStore, file_sha256, make_key,
                                       module_fingerprint)
from patches.core.data.latents import check_folder
from patches.core.flags import LATENT_CACHE_DIR, latent_cache_dir
from patches.core.runtime import group_moves_host_tensors

Encode = Callable[[nn.Module, torch.Tensor, "torch.device | str", torch.dtype], torch.Tensor]
"""The recipe's online encode of one decoded window: ``(vae, video [3, T, H, W] fp32, device, dtype) -> latent``."""

__all__ = ["FORMAT", "PIPELINE", "CacheItem", "CorruptEntry", "EntryKey", "LatentCache", "LatentCacheError",
           "PrepassReport", "run_prepass", "vae_fingerprint"]

log = logging.getLogger("onecard.latent_cache")

FORMAT = "onecard-latent-v1"
"""Version of the entry format; part of every key (a new format misses every old entry)."""
PIPELINE = "decode_window(PyAV decode, swscale AREA cover + centre crop, uint8/127.5-1 fp32) v1"
"""Version of the pixel pipeline in front of the encode; part of the VAE fingerprint."""
TENSOR = "latent"
"""Name of the one tensor in an entry file."""


def vae_fingerprint(vae: nn.Module, dtype: torch.dtype, device: torch.device | str) -> dict[str, str]:
    """What, besides the clip, decides a latent: :func:`patches.core.data.latents.module_fingerprint` of the VAE
    (weights, config with ``latents_mean``/``latents_std``, class, dtype, device, torch version) plus the PyAV version
    and the pixel pipeline's version :data:`PIPELINE`."""
    try:
        import av

        av_version = av.__version__
    except ImportError:  # pragma: no cover - av is a dependency
        av_version = "none"
    return module_fingerprint(vae, dtype, device, av=av_version, pipeline=PIPELINE)


@dataclasses.dataclass(frozen=True)
class CacheItem:
    """One (clip, window, size) the loader can yield."""

    video_path: Path
    """Absolute path of the video file."""
    window: tuple[int, int]
    """``(start_frame, num_frames)``."""
    size: tuple[int, int]
    """Target ``(W, H)`` in pixels."""


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
    """Normalised VAE latents on disk, one entry of the shared store per (clip, window, size, VAE fingerprint).

    Args:
        root: the cache folder (created on the first write).
        fingerprint: :func:`vae_fingerprint` of the VAE that encodes (or encoded) the entries.
        vae: the VAE, needed only to encode (pre-pass); ``None`` for a read-only cache (training).
        device: where ``vae`` encodes.
        dtype: the VAE's parameter dtype; also the dtype every entry must hold.
        encode: the recipe's online encode (:data:`Encode`), needed with ``vae``.

    Raises:
        ValueError: ``dtype`` does not match ``fingerprint["dtype"]``.
    """

    def __init__(self, root: str | Path, fingerprint: dict[str, str], *, vae: nn.Module | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 encode: Encode | None = None) -> None:
        if fingerprint.get("dtype") != str(dtype).replace("torch.", ""):
            raise ValueError(f"fingerprint dtype {fingerprint.get('dtype')} does not match the encode dtype {dtype}")
        self.entries = LatentStore(root, f"set {LATENT_CACHE_DIR} to another folder")
        self.root = self.entries.root
        self.fingerprint = dict(fingerprint)
        self.vae_digest = hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()
        self.vae = vae
        self.encode_fn = encode
        self.device = torch.device(device)
        self.dtype = dtype
        config = json.loads(self.fingerprint.get("config") or "{}")
        self._tf = int(config.get("scale_factor_temporal", 4))
        self._sf = int(config.get("scale_factor_spatial", 16))
        self._z = config.get("z_dim")

    @classmethod
    def for_vae(cls, vae: nn.Module, device: torch.device | str, root: str | Path | None = None, *,
                encode: Encode) -> "LatentCache":
        """A cache that encodes with ``vae`` on ``device`` in the VAE's parameter dtype through ``encode``; ``root``
        defaults to :func:`patches.core.flags.latent_cache_dir`."""
        dtype = next(vae.parameters()).dtype
        return cls(root if root is not None else latent_cache_dir(), vae_fingerprint(vae, dtype, device),
                   vae=vae, device=device, dtype=dtype, encode=encode)

    def read_only(self) -> "LatentCache":
        """The same cache without the VAE (what training holds: it cannot encode)."""
        return LatentCache(self.root, self.fingerprint, device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------ naming
    def key(self, item: CacheItem) -> EntryKey:
        """The entry key of ``item``: file bytes, window, size, VAE fingerprint, format."""
        return make_key({
            "format": FORMAT,
            "video_sha256": file_sha256(item.video_path),
            "window": [int(item.window[0]), int(item.window[1])],
            "size": [int(item.size[0]), int(item.size[1])],
            "vae": self.vae_digest,
        })

    def path(self, key: EntryKey) -> Path:
        """``<root>/<digest[:2]>/<digest>.safetensors``."""
        return self.entries.path(key)

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
        key = key or self.key(item)
        tensors, _ = self.entries.load(key)
        path = self.path(key)
        if set(tensors) != {TENSOR}:
            raise CorruptEntry(f"{path}: holds {sorted(tensors)}, expected one tensor {TENSOR!r}")
        latent = tensors[TENSOR]
        if latent.dtype != self.dtype:
            raise CorruptEntry(f"{path}: holds {latent.dtype}, the encode yields {self.dtype}")
        want = self._expected_shape(item)
        if latent.dim() != 5 or any(w not in (-1, s) for w, s in zip(want, latent.shape)):
            raise CorruptEntry(f"{path}: shape {tuple(latent.shape)}, expected {want}")
        return latent

    def store(self, item: CacheItem, latent: torch.Tensor, key: EntryKey | None = None) -> Path:
        """Write ``latent`` (as the online encode returned it) as ``item``'s entry, atomically; returns the path.

        Raises:
            LatentCacheError: the entry cannot be written (:meth:`patches.core.data.latents.LatentStore.store`).
        """
        meta = {"format": FORMAT, "vae": json.dumps(self.fingerprint, sort_keys=True)}
        return self.entries.store(key or self.key(item), {TENSOR: latent}, meta)

    def encode(self, item: CacheItem) -> torch.Tensor:
        """Decode ``item``'s window and encode it exactly as the trainer's online path does (CPU copy).

        Raises:
            RuntimeError: this cache has no VAE (read-only).
            DatasetError: the window does not decode.
        """
        from patches.core.data.video import DEFAULT_CLIP_CACHE, decode_window

        if self.vae is None or self.encode_fn is None:
            raise RuntimeError("this LatentCache has no VAE: it can only read entries")
        video = decode_window(item.video_path, item.window[0], item.window[1], item.size, DEFAULT_CLIP_CACHE)
        with torch.no_grad():
            return self.encode_fn(self.vae, video, self.device, self.dtype).to("cpu")

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
                f"{what}: run `python -m cosmos_framework_ext.recipe.prepass --toml <recipe>` (or restart the run: its "
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
            if self.vae is None or self.encode_fn is None:
                raise RuntimeError(f"{len(mine)} latent cache entries must be encoded, but this cache has no VAE")
            from patches.core.data.prefetch import prefetched
            from patches.core.data.video import DEFAULT_CLIP_CACHE, decode_window

            def decode(pair):
                it, k = pair
                return it, k, decode_window(it.video_path, it.window[0], it.window[1], it.size, DEFAULT_CLIP_CACHE)

            bar = tqdm(total=len(mine), desc="latent cache pre-pass", unit="clip", disable=not progress,
                       file=sys.stderr, dynamic_ncols=True)
            te = time.perf_counter()
            with bar, torch.no_grad():
                for it, k, video in prefetched(mine, workers=workers, depth=2 * workers, load=decode):
                    self.store(it, self.encode_fn(self.vae, video, self.device, self.dtype).to("cpu"), k)
                    bar.update(1)
            enc_s = time.perf_counter() - te
        nbytes = sum(p.stat().st_size for p in {self.path(k) for k in keys} if p.is_file())
        return PrepassReport(entries=len(items), hits=hits, misses=len(mine) - corrupt_mine, corrupt=corrupt_mine,
                             bytes_on_disk=nbytes, seconds=time.perf_counter() - t0, encode_seconds=enc_s,
                             root=str(self.root))


def run_prepass(vae: nn.Module, device: torch.device, items: Iterable[CacheItem], *, encode: Encode, rank: int = 0,
                world_size: int = 1, progress: bool = True, root: str | Path | None = None,
                ) -> tuple[LatentCache, PrepassReport]:
    """The trainer's pre-pass: fingerprint ``vae`` (on the host), move it to ``device``, fill the cache for every
    item, move it back to the host. Returns the read-only cache training uses and the report.

    The VAE is on ``device`` only inside this call. Every rank encodes its share of the misses, then (with
    ``torch.distributed`` initialised) waits for the others.

    Raises:
        LatentCacheError: the cache folder cannot be written (names it and the fix).
        DatasetError: a window does not decode.
    """
    items = list(items)
    cache = LatentCache.for_vae(vae, device, root, encode=encode)
    check_folder(cache.root, LATENT_CACHE_DIR)
    cache.entries.ensure(LATENT_CACHE_DIR)
    home = next(vae.parameters()).device
    vae.to(device)
    try:
        report = cache.prepass(items, rank=rank, world_size=world_size, progress=progress)
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
        nbytes = sum(p.stat().st_size for p in {cache.path(cache.key(it)) for it in items} if p.is_file())
        report = dataclasses.replace(report, hits=hits, misses=misses, corrupt=corrupt, bytes_on_disk=nbytes)
    return cache.read_only(), report
