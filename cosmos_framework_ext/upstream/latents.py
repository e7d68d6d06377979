"""Lever 4 in upstream's trainer (``COSMOS_LATENT_CACHE=1``): upstream's own encode, done once per clip window.

Upstream's trainer decodes a clip in its SFT dataset (ffmpeg, resize, centre crop, ``4n+1`` frames, uint8
``[3, T, H, W]``), then re-encodes it with its Wan2.2 VAE on every micro-batch
(``get_data_and_condition`` -> ``_encode_vision_x0_tokens`` -> ``_encode_vision_item``). The VAE is frozen
and the encode deterministic (posterior mean), so the latent of a given clip window is the same every epoch.
This patch stores the output of upstream's own ``_encode_vision_x0_tokens`` per vision item and serves it
back, ``torch.equal`` (dtype float32, shape, values) to the online encode:

- **Key.** Each sample gets :data:`SAMPLE_KEY` in upstream's dataset (``SFTDataset.process_one_sample``, in the
  loader's worker processes): the SHA-256 of its identity (``__url__``, ``frame_start``, ``frame_end``,
  ``num_multiplier``, ``image_size``, the clip's shape) and of the uint8 pixels the encode will see (the source's
  bytes as upstream's pipeline decodes them). The model side adds the VAE fingerprint
  (:meth:`UpstreamLatentCache.fingerprint`: every weight's bytes, the 48-channel ``scale`` tensors, the VAE's dtype and
  autocast setting, the tokenizer config, the source of upstream's model and tokenizer modules, the GPU's name,
  torch's version) and the item's shape and dtype after upstream's normalisation. Any change gives another name: a
  miss, never a stale hit. A batch whose samples carry no key (a loader whose workers were not patched) is keyed in
  the trainer process from the same fields.
- **Serve.** ``_encode_vision_x0_tokens`` returns the stored latents for the training path (one vision item per
  sample, no conditioning-prefix inference optimisation, no multiview); an item that misses is encoded by upstream's
  own code with the VAE moved to the GPU for that call, and stored. With every item a hit the VAE never leaves the
  host (it is parked there as :mod:`~cosmos_framework_ext.upstream.patches` lever 2 parks it; this flag turns that
  parking on too). ``ONECARD_LATENT_CACHE_CHECK=1`` also encodes every hit online and stops with one error line if
  the two differ (a check run, at the online encode's speed).
- **Cached clips are not decoded** (:class:`DecodeFree`, off with ``ONECARD_LATENT_CACHE_DECODE=1`` and in the
  check run): the trainer process exports the VAE fingerprint (:data:`PLAN_ENV`) when upstream sets up the VAE,
  before the loader's workers start. A worker runs ``process_one_sample`` first with the decoder yielding zero frames
  and ffprobe's stored answer; a window found in the index (its :func:`source_key`: the source's bytes, scale,
  identity, decoder) keeps those zeros and the indexed sample key; otherwise the RNG states are put back and upstream
  decodes as stock. Readers of the pixels get them decoded again (:func:`decode_cached`: upstream's sample-drawing
  callback, and a cached sample whose latent file has gone).
- **Pre-pass** (``ImaginaireTrainer.train``, before upstream's loop): every ``(row, window)`` of the SFT dataset the
  loader wraps is run once through upstream's own ``process_one_sample``, ``custom_collate_fn``, the packing loader's
  split and merge, and ``get_data_and_condition`` -- the online path, so its misses fill the cache. The Python,
  NumPy and torch RNG states are restored afterwards, so training draws what it draws without the patch. At several
  ranks each takes every world_size-th window, then all wait. Windows chosen at random inside a window
  (``frame_selection_mode="random"`` with a fixed frame count) cannot be listed ahead; they fill on first use.

Entries are :class:`patches.core.data.latents.LatentStore` files under ``$ONECARD_LATENT_CACHE`` (default
``$ONECARD_DATA_CACHE/latents``), one tensor ``"latent"`` per item, stored in bfloat16 when that holds the float32
value exactly (upstream's bf16 VAE output cast to float32 always does) and in float32 otherwise. A corrupt entry is
re-encoded, with a warning.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import hashlib
import inspect
import json
import logging
import os
import pickle
import random
import shutil
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from patches.core.data.latents import (CorruptEntry, LatentCacheError, LatentStore, file_sha256, make_key,
                                       module_fingerprint, tensor_bytes)
from patches.core.flags import LATENT_CACHE_CHECK, LATENT_CACHE_DECODE

log = logging.getLogger("onecard.upstream")

SAMPLE_KEY = "onecard_latent_key"
"""The sample field (a hex string) that carries a sample's identity-and-pixels digest through upstream's loader."""

FORMAT = "cosmos-upstream-latent-v1"
"""Entry format; part of every key."""

_IDENTITY = ("__url__", "frame_start", "frame_end", "num_multiplier", "image_size")


# ------------------------------------------------------------------------------------------- sample keys
def _flat(value: Any) -> Any:
    """A sample field as JSON: strings as they are, numbers and tensors as a flat list of Python numbers."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    return torch.as_tensor(value).detach().reshape(-1).tolist()


def sample_key(fields: dict[str, Any], video: torch.Tensor) -> str:
    """The SHA-256 (hex) of a sample's identity ``fields`` (:data:`_IDENTITY`) and its uint8 ``video`` ``[3, T, H, W]``.

    The same for the dataset's sample and for the same sample after upstream's collate and packing (where each field
    is a one-element tensor or list and the clip may live on the GPU).

    Raises:
        KeyError: a field is missing.
    """
    video = video.detach()
    while video.ndim > 4 and video.shape[0] == 1:
        video = video[0]
    ident = {k: _flat(fields[k]) for k in _IDENTITY}
    ident["shape"] = list(video.shape)
    ident["dtype"] = str(video.dtype)
    h = hashlib.sha256(json.dumps(ident, sort_keys=True).encode())
    h.update(hashlib.sha256(tensor_bytes(video)).digest())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------- decode-free hits
class _Probe:
    """What one ``process_one_sample`` call's decode saw: the source's SHA-256 and the scale (set by the decoder)."""

    def __init__(self, speculate: bool, store: LatentStore | None = None):
        self.speculate = speculate
        """Yield zero frames instead of decoding (the pixels are not needed: the clip's latent is cached)."""
        self.store = store
        """Where ffprobe's answers are kept (decode-free runs only)."""
        self.source: str | None = None
        self.scale_hw: tuple[int, int] | None = None


_PROBE: contextvars.ContextVar[_Probe | None] = contextvars.ContextVar("onecard_decode_probe", default=None)
_DECODER: dict[str, str] = {}


def _tool(name: str) -> dict[str, str]:
    exe = shutil.which(name) or ""
    try:
        out = subprocess.run([exe or name, "-version"], capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
        text = (out.stdout or out.stderr).strip()
        version = text.splitlines()[0] if text else f"rc {out.returncode}"
    except (OSError, subprocess.SubprocessError) as e:
        version = type(e).__name__
    return {name: file_sha256(exe) if exe else "none", f"{name} -version": version}


def decoder_fingerprint() -> dict[str, str]:
    """What besides the source and the window decides upstream's decoded pixels (computed once per process):
    the source of upstream's ``helper`` and ``sft_dataset`` modules, and the ``ffmpeg`` and ``ffprobe`` on ``PATH``
    (each file's SHA-256 and what it prints for ``-version``: the binary a wrapper script runs)."""
    if not _DECODER:
        from cosmos_framework.data.generator.local_datasets import helper, sft_dataset

        _DECODER.update(helper=file_sha256(inspect.getfile(helper)), dataset=file_sha256(inspect.getfile(sft_dataset)),
                        **_tool("ffmpeg"), **_tool("ffprobe"))
    return _DECODER


def _source(probe: _Probe, path: str) -> str:
    if probe.source is None:
        probe.source = file_sha256(path)
    return probe.source


def patched_get_video_metadata(original: Callable[..., Any]) -> Callable[..., Any]:
    """upstream's ``helper.get_video_metadata`` (ffprobe) as ``sft_dataset`` calls it: in a decode-free run, inside
    :func:`patched_process_one_sample`, its answer is kept per source (the file's SHA-256 and
    :func:`decoder_fingerprint`) and served again instead of running ffprobe; elsewhere the original."""

    def get_video_metadata(video_path):
        probe = _PROBE.get()
        if probe is None or probe.store is None:
            return original(video_path)
        key = make_key({"format": FORMAT + "-probe", "source": _source(probe, video_path),
                        "decoder": decoder_fingerprint()})
        try:
            tensors, _ = probe.store.load(key)
            return json.loads(bytes(tensors["probe"].tolist()).decode())
        except (FileNotFoundError, CorruptEntry, KeyError, ValueError):
            pass
        out = original(video_path)
        probe.store.store(key, {"probe": torch.tensor(list(json.dumps(out, sort_keys=True).encode()),
                                                      dtype=torch.uint8)})
        return out

    return get_video_metadata


def patched_ffmpeg_decode_video(original: Callable[..., Any]) -> Callable[..., Any]:
    """upstream's ``helper.ffmpeg_decode_video`` as ``sft_dataset`` calls it: outside :func:`patched_process_one_sample`
    the original; inside, it records the source file's SHA-256 and the scale, and on the speculative pass (the clip's
    latent may be cached) yields zero frames of the decoded shape instead of running ffmpeg."""

    def ffmpeg_decode_video(video_path, scale_hw=None, num_threads=1):
        probe = _PROBE.get()
        if probe is None:
            return original(video_path, scale_hw=scale_hw, num_threads=num_threads)
        _source(probe, video_path)
        probe.scale_hw = tuple(int(x) for x in scale_hw) if scale_hw is not None else None
        if probe.speculate and probe.scale_hw is not None:
            return _zero_frames(probe.scale_hw)
        return original(video_path, scale_hw=scale_hw, num_threads=num_threads)

    return ffmpeg_decode_video


def _zero_frames(scale_hw: tuple[int, int]) -> Iterator[Any]:
    import numpy as np

    frame = np.zeros((*scale_hw, 3), dtype=np.uint8)
    frame.setflags(write=False)
    for _ in range(1 << 20):  # upstream's loop stops at the window's last frame
        yield frame


def source_key(sample: dict[str, Any], probe: _Probe) -> str:
    """SHA-256 (hex) of what decides a decoded sample's pixels without reading them: the source's bytes, the scale,
    the identity fields, the clip's shape and dtype, and :func:`decoder_fingerprint`."""
    video = sample["video"]
    ident = {k: _flat(sample[k]) for k in _IDENTITY}
    return make_key({"format": FORMAT + "-source", "source": probe.source, "scale_hw": list(probe.scale_hw or ()),
                     "identity": ident, "shape": list(video.shape), "dtype": str(video.dtype),
                     "decoder": decoder_fingerprint()}).digest


class DecodeFree:
    """Decode-free hits, handed to upstream's dataset in the loader's workers through :data:`PLAN_ENV`.

    A window whose latent the cache holds under the active VAE fingerprint is not decoded: the index entry
    ``(source key, VAE fingerprint) -> (sample key, latent entry)``, written by the trainer process once the latent is
    stored or served, gives the sample its :data:`SAMPLE_KEY` without the pixels. Its ``video`` holds zeros of the
    decoded shape; :data:`REPLAY` lets the trainer process decode it again where pixels are read
    (:func:`decode_cached`).

    Args:
        root: the cache folder.
        vae: :meth:`UpstreamLatentCache.fingerprint`.
    """

    def __init__(self, root: str | Path, vae: dict[str, str]):
        self.root = str(root)
        self.vae = dict(vae)
        self.store = LatentStore(root, fix="set ONECARD_LATENT_CACHE to another folder")
        self._recorded: set[str] = set()  # sources this process has indexed (one file check each, not per micro-batch)

    def index_key(self, source: str):
        return make_key({"format": FORMAT + "-index", "source": source, "vae": self.vae})

    def lookup(self, source: str) -> tuple[str, str] | None:
        """``(sample key, latent entry digest)`` of a cached window whose latent file is present, else ``None``."""
        store = self.store
        try:
            tensors, _ = store.load(self.index_key(source))
            sample, latent = (bytes(tensors[n].tolist()).hex() for n in ("sample", "latent"))
        except (FileNotFoundError, CorruptEntry, KeyError, ValueError):
            return None
        return (sample, latent) if store.entry_path(latent).is_file() else None

    def recorded(self, source: str) -> bool:
        """Whether this process has already indexed ``source``."""
        return source in self._recorded

    def record(self, source: str, sample: str, latent: str) -> None:
        """Write the index entry (once: an existing entry is kept)."""
        key = self.index_key(source)
        if not self.store.path(key).is_file():
            self.store.store(key, {n: torch.tensor(list(bytes.fromhex(v)), dtype=torch.uint8)
                              for n, v in (("sample", sample), ("latent", latent))})
        self._recorded.add(source)


PLAN_ENV = "ONECARD_LATENT_CACHE_PLAN"
"""Internal: the :class:`DecodeFree` plan as JSON (cache folder, VAE fingerprint), set by the trainer process when the
VAE is set up, before upstream starts (and pre-warms) the loader's workers, which inherit it."""
_PLANS: dict[str, DecodeFree] = {}


def start_decode_free(cache: "UpstreamLatentCache") -> DecodeFree | None:
    """Turn decode-free hits on for ``cache`` and for every loader worker started after this call (:data:`PLAN_ENV`);
    off (``None``) for a check run or with ``ONECARD_LATENT_CACHE_DECODE=1``."""
    if cache.check or LATENT_CACHE_DECODE.value():
        os.environ.pop(PLAN_ENV, None)
        cache.decode_free = None
        return None
    cache.decode_free = DecodeFree(cache.store.root, cache.fingerprint())
    os.environ[PLAN_ENV] = json.dumps({"root": cache.decode_free.root, "vae": cache.decode_free.vae}, sort_keys=True)
    return cache.decode_free


def current_plan() -> DecodeFree | None:
    """The plan of :data:`PLAN_ENV` in this process (parsed once), or ``None``."""
    raw = os.environ.get(PLAN_ENV, "")
    if not raw:
        return None
    if raw not in _PLANS:
        d = json.loads(raw)
        _PLANS[raw] = DecodeFree(d["root"], d["vae"])
    return _PLANS[raw]


SOURCE_KEY = "onecard_source_key"
"""The sample field (hex): :func:`source_key` of a decoded sample, ``""`` where the decode was not probed."""
PIXELS = "onecard_pixels"
"""The sample field: ``"decoded"`` (upstream decoded the clip) or ``"cached"`` (not decoded: ``video`` holds zeros)."""
LATENT_FILE = "onecard_latent_file"
"""The sample field: the cached latent's entry digest for a ``"cached"`` sample, else ``""``."""
REPLAY = "onecard_replay"
"""The sample field: for a ``"cached"`` sample, what decodes it again (base64 pickle of its metadata row and the
Python and NumPy RNG states before the call), else ``""``."""


def _rng_states() -> tuple[Any, Any]:
    import numpy as np

    return random.getstate(), np.random.get_state()


def _set_rng(states: tuple[Any, Any]) -> None:
    import numpy as np

    random.setstate(states[0])
    np.random.set_state(states[1])


def _call(original: Callable[..., Any], self: Any, metadata: dict, speculate: bool,
          plan: DecodeFree | None = None) -> tuple[Any, _Probe]:
    probe = _Probe(speculate, plan.store if plan is not None else None)
    token = _PROBE.set(probe)
    try:
        return original(self, metadata), probe
    finally:
        _PROBE.reset(token)


def _is_clip(sample: Any) -> bool:
    return isinstance(sample, dict) and isinstance(sample.get("video"), torch.Tensor)


def patched_process_one_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    """``SFTDataset.process_one_sample`` that adds :data:`SAMPLE_KEY` (and the decode-free fields) to every sample.

    With a decode-free plan (:func:`current_plan`), it first runs upstream's code with the
    decoder yielding zeros; if the resulting window is in the index, that sample is returned (``"cached"``);
    otherwise the RNG states are put back and upstream's code runs again with the real decode, so the sample and
    every later draw are what stock gives.
    """
    def process_one_sample(self, metadata):
        plan = current_plan()
        if plan is not None:
            before = _rng_states()
            sample, probe = _call(original, self, metadata, speculate=True, plan=plan)
            if _is_clip(sample) and probe.source is not None and probe.scale_hw is not None:
                skey = source_key(sample, probe)
                hit = plan.lookup(skey)
                if hit is not None:
                    sample.update({SAMPLE_KEY: hit[0], SOURCE_KEY: skey, PIXELS: "cached", LATENT_FILE: hit[1],
                                   REPLAY: base64.b64encode(pickle.dumps((metadata, before))).decode()})
                    return sample
            _set_rng(before)
        sample, probe = _call(original, self, metadata, speculate=False, plan=plan)
        if _is_clip(sample):
            sample[SAMPLE_KEY] = sample_key(sample, sample["video"])
            sample.update({SOURCE_KEY: source_key(sample, probe) if probe.source is not None else "",
                           PIXELS: "decoded", LATENT_FILE: "", REPLAY: ""})
        return sample

    process_one_sample.__wrapped__ = original  # what decode_cached calls again
    return process_one_sample


def _field(data_batch: dict[str, Any], name: str, n: int) -> list[str] | None:
    v = data_batch.get(name)
    return v if isinstance(v, list) and len(v) == n and all(isinstance(x, str) for x in v) else None


def cached_samples(data_batch: dict[str, Any]) -> list[int]:
    """Indexes of the batch's samples whose ``video`` holds zeros (``"cached"``)."""
    videos = data_batch.get("video")
    flags = _field(data_batch, PIXELS, len(videos)) if isinstance(videos, list) else None
    return [i for i, f in enumerate(flags or []) if f == "cached"]


def decode_cached(data_batch: dict[str, Any], which: list[int] | None = None) -> int:
    """Decode the ``"cached"`` samples of ``data_batch`` again (upstream's own ``process_one_sample`` with the RNG
    states they were drawn with) and write their pixels into the batch in place; returns how many.

    Raises:
        LatentCacheError: upstream's dataset is not known in this process, or a clip decodes to other pixels than
            the ones its latent was keyed by (the source changed during the run).
    """
    which = cached_samples(data_batch) if which is None else which
    if not which:
        return 0
    dataset = _DATASET.get("sft")
    original = getattr(getattr(type(dataset), "process_one_sample", None), "__wrapped__", None)
    if dataset is None or original is None:
        raise LatentCacheError("latent cache: a batch holds clips that were not decoded, and upstream's dataset is "
                               "not known in this process to decode them; set ONECARD_LATENT_CACHE_DECODE=1")
    keys, replay = data_batch[SAMPLE_KEY], data_batch[REPLAY]
    for i in which:
        metadata, states = pickle.loads(base64.b64decode(replay[i]))
        now = _rng_states()
        try:
            _set_rng(states)
            sample, _ = _call(original, dataset, metadata, speculate=False)
        finally:
            _set_rng(now)
        if not _is_clip(sample) or sample_key(sample, sample["video"]) != keys[i]:
            raise LatentCacheError(f"latent cache: the clip of sample {keys[i][:16]} ({_flat(data_batch['__url__'][i])}) "
                                   "no longer decodes to the pixels its latent was stored for; remove the cache folder "
                                   "or set ONECARD_LATENT_CACHE_DECODE=1 and rerun")
        slot = data_batch["video"][i]
        target = slot[0] if isinstance(slot, (list, tuple)) else slot
        target.copy_(sample["video"].reshape(target.shape))
        data_batch[PIXELS][i] = "decoded"
    return len(which)


_DATASET: dict[str, Any] = {}


def patched_draw_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    """``EveryNDrawSample.every_n_impl`` (upstream's callback that shows the batch's pixels) with the batch's
    not-decoded clips decoded first (:func:`decode_cached`)."""

    def every_n_impl(self, trainer, model, data_batch, output_batch, loss, iteration):
        decode_cached(data_batch)
        return original(self, trainer, model, data_batch, output_batch, loss, iteration)

    return every_n_impl


def batch_keys(data_batch: dict[str, Any]) -> list[str] | None:
    """One key per sample of a packed upstream batch, or ``None`` where the batch is not one clip per sample.

    Uses the keys the dataset attached; a batch without them is keyed here from its fields and pixels.
    """
    videos = data_batch.get("video")
    if not isinstance(videos, list) or not videos:
        return None
    items = []
    for v in videos:
        if isinstance(v, (list, tuple)):
            if len(v) != 1:
                return None
            v = v[0]
        if not isinstance(v, torch.Tensor) or v.dtype != torch.uint8:
            return None
        items.append(v)
    keys = _field(data_batch, SAMPLE_KEY, len(items))
    if keys is not None:
        return keys
    try:
        return [sample_key({k: data_batch[k][i] for k in _IDENTITY}, items[i]) for i in range(len(items))]
    except (KeyError, IndexError, TypeError, ValueError):
        return None


# ------------------------------------------------------------------------------------------- the cache
def _source_digest(*objects: Any) -> str:
    """SHA-256 over the source files that define ``objects`` (a class without one counts by its name)."""
    h = hashlib.sha256()
    for obj in objects:
        try:
            h.update(file_sha256(inspect.getfile(obj)).encode())
        except (TypeError, OSError):
            h.update(getattr(obj, "__qualname__", type(obj).__qualname__).encode())
    return h.hexdigest()


class UpstreamLatentCache:
    """Upstream latents on disk, keyed by sample key + VAE fingerprint + item shape.

    Args:
        root: the cache folder.
        model: upstream's ``OmniMoTModel`` (its ``tokenizer_vision_gen.model`` is the ``WanVAE``).
        device: where the encode runs (and served latents go).
    """

    def __init__(self, root: str | Path, model: Any, device: torch.device):
        self.store = LatentStore(root, fix="set ONECARD_LATENT_CACHE to another folder")
        self.model = model
        self.device = torch.device(device)
        self._fingerprint: dict[str, str] | None = None
        self.stats = {"hits": 0, "misses": 0, "stored": 0, "corrupt": 0, "checked": 0}
        self.batches = 0
        self.check = bool(LATENT_CACHE_CHECK.value())
        """``ONECARD_LATENT_CACHE_CHECK``: compare every hit with upstream's online encode (:meth:`verify`)."""
        self.decode_free: DecodeFree | None = None
        """Set by :func:`start_decode_free` (when upstream sets up the VAE) unless ``ONECARD_LATENT_CACHE_DECODE`` or
        the check run asks every clip decoded."""

    def fingerprint(self) -> dict[str, str]:
        """What besides its input decides upstream's encode (computed once; reads every VAE weight)."""
        if self._fingerprint is None:
            tok = self.model.tokenizer_vision_gen
            wan = tok.model
            scale = hashlib.sha256()
            for t in wan.scale:
                scale.update(tensor_bytes(torch.as_tensor(t)))
            config = getattr(getattr(self.model, "config", None), "tokenizer", None)
            self._fingerprint = module_fingerprint(
                wan.model, getattr(wan, "dtype", torch.bfloat16), self.device, scale=scale.hexdigest(),
                tokenizer=repr(config), amp=repr(getattr(wan, "is_amp", None)),
                chunk_frames=repr(getattr(tok, "encode_chunk_frames", None)),
                code=_source_digest(type(self.model), type(tok), type(wan.model)))
        return self._fingerprint

    def key(self, sample: str, item: torch.Tensor):
        return make_key({"format": FORMAT, "sample": sample, "vae": self.fingerprint(),
                         "item": [list(item.shape), str(item.dtype)]})

    def load(self, sample: str, item: torch.Tensor) -> torch.Tensor | None:
        """The stored latent of ``item`` (float32 on :attr:`device`), or ``None`` on a miss."""
        key = self.key(sample, item)
        try:
            tensors, _ = self.store.load(key)
        except FileNotFoundError:
            return None
        except CorruptEntry as e:
            self.stats["corrupt"] += 1
            log.warning("onecard: latent cache: %s; encoding it again", e)
            return None
        return tensors["latent"].to(self.device).float()

    def verify(self, samples: list[str], served: list[torch.Tensor], online: list[torch.Tensor]) -> None:
        """That each served latent is ``torch.equal`` (and of the same dtype) to upstream's online encode.

        Raises:
            LatentCacheError: one differs (names the sample key and the fix).
        """
        for sample, a, b in zip(samples, served, online):
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                diff = ((a.float() - b.float()).abs().max().item() if a.shape == b.shape else float("nan"))
                raise LatentCacheError(
                    f"latent cache: the stored latent of sample {sample[:16]} differs from upstream's online encode "
                    f"({a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}, max |difference| {diff:.3g}); an "
                    "encode is reproducible across processes only with trainer.cudnn.benchmark=False and "
                    f"trainer.cudnn.deterministic=True; otherwise remove {self.store.root} and report it")
            self.stats["checked"] += 1

    def save(self, sample: str, item: torch.Tensor, latent: torch.Tensor) -> None:
        """Store ``latent`` (upstream's float32 output) for ``item``, as bf16 where that is exact."""
        host = latent.detach().to("cpu").contiguous()
        small = host.to(torch.bfloat16)
        self.store.store(self.key(sample, item), {"latent": small if torch.equal(small.float(), host) else host})
        self.stats["stored"] += 1


def with_vae(model: Any) -> contextlib.AbstractContextManager:
    """The parked VAE of ``model`` (lever 2's ``_onecard_vae``) on the GPU for the block; nothing if it has none."""
    off = getattr(model, "_onecard_vae", None)
    return off.on_device() if off is not None else contextlib.nullcontext()


def patched_encode_vision_x0_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_encode_vision_x0_tokens`` that serves stored latents on the training path and encodes only misses."""

    def _encode_vision_x0_tokens(self, raw_state_vision, num_vision_items_per_sample, vision_condition_indexes,
                                 *more, **kw):
        cache: UpstreamLatentCache | None = getattr(self, "_onecard_latents", None)
        keys = getattr(self, "_onecard_batch_keys", None)
        plain = (cache is not None and keys is not None and num_vision_items_per_sample is None
                 and vision_condition_indexes is None and all(m is None for m in (*more, *kw.values()))
                 and isinstance(raw_state_vision, list) and len(keys) == len(raw_state_vision))
        if not plain:
            with with_vae(self):
                return original(self, raw_state_vision, num_vision_items_per_sample, vision_condition_indexes,
                                *more, **kw)
        out = [cache.load(k, item) for k, item in zip(keys, raw_state_vision)]
        missing = [i for i, t in enumerate(out) if t is None]
        pixels = getattr(self, "_onecard_batch_pixels", None) or ["decoded"] * len(keys)
        blind = [i for i in missing if pixels[i] == "cached"]
        if blind:
            raise LatentCacheError(f"latent cache: the latent of not-decoded sample {keys[blind[0]][:16]} could not be "
                                   f"read from {cache.store.root} (see the warning above); remove that folder, or set "
                                   "ONECARD_LATENT_CACHE_DECODE=1, and rerun")
        cache.stats["hits"] += len(out) - len(missing)
        cache.stats["misses"] += len(missing)
        if cache.check and len(missing) < len(out):
            hits = [i for i in range(len(out)) if out[i] is not None]
            with with_vae(self):
                online = original(self, [raw_state_vision[i] for i in hits], None, None)
            cache.verify([keys[i] for i in hits], [out[i] for i in hits], online)
        if missing:
            with with_vae(self):
                fresh = original(self, [raw_state_vision[i] for i in missing], None, None)
            for i, latent in zip(missing, fresh):
                cache.save(keys[i], raw_state_vision[i], latent)
                out[i] = latent
        sources = getattr(self, "_onecard_batch_sources", None)
        if cache.decode_free is not None and sources is not None:
            for i, item in enumerate(raw_state_vision):
                if sources[i] and pixels[i] == "decoded" and not cache.decode_free.recorded(sources[i]):
                    cache.decode_free.record(sources[i], keys[i], cache.key(keys[i], item).digest)
        cache.batches += 1
        if cache.batches in (1, 10) or cache.batches % 100 == 0:
            log.info("onecard: latent cache: %d batches served, %s", cache.batches,
                     ", ".join(f"{k} {v}" for k, v in cache.stats.items()))
        return out

    return _encode_vision_x0_tokens


def serving(self, data_batch: dict[str, Any]) -> contextlib.AbstractContextManager:
    """Within it, ``self``'s ``_encode_vision_x0_tokens`` knows ``data_batch``'s sample keys (used by lever 2's
    ``get_data_and_condition`` patch when this lever is on). A not-decoded (``"cached"``) sample whose latent file is
    no longer in the cache is decoded first (:func:`decode_cached`), so it is encoded from its real pixels."""

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        keys = batch_keys(data_batch)
        cached = cached_samples(data_batch) if keys is not None else []
        cache: UpstreamLatentCache | None = getattr(self, "_onecard_latents", None)
        if cached and cache is not None:
            gone = [i for i in cached if not cache.store.entry_path(data_batch[LATENT_FILE][i]).is_file()]
            if gone:
                log.warning("onecard: latent cache: %d not-decoded clips lost their latent file; decoding them",
                            len(gone))
                decode_cached(data_batch, gone)
        n = len(keys) if keys is not None else 0
        self._onecard_batch_keys = keys
        self._onecard_batch_sources = _field(data_batch, SOURCE_KEY, n) if keys is not None else None
        self._onecard_batch_pixels = _field(data_batch, PIXELS, n) if keys is not None else None
        try:
            yield
        finally:
            self._onecard_batch_keys = self._onecard_batch_sources = self._onecard_batch_pixels = None

    return scope()


# ------------------------------------------------------------------------------------------- the pre-pass
def find_sft_dataset(loader: Any, depth: int = 6) -> Any | None:
    """The object inside ``loader`` (upstream's packing loader and what it wraps) that has ``process_one_sample``
    and a ``metadata`` list, or ``None``."""
    seen: set[int] = set()
    todo: deque[tuple[Any, int]] = deque([(loader, 0)])
    while todo:
        obj, d = todo.popleft()
        if id(obj) in seen or d > depth:
            continue
        seen.add(id(obj))
        if (callable(getattr(type(obj), "process_one_sample", None))
                and isinstance(getattr(obj, "metadata", None), list)):
            return obj
        if isinstance(obj, (list, tuple)):
            todo.extend((x, d + 1) for x in obj)
        elif isinstance(obj, dict):
            todo.extend((x, d + 1) for x in obj.values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, torch.nn.Module, type)):
            todo.extend((x, d + 1) for x in vars(obj).values())
    return None


def windows(dataset: Any) -> list[dict]:
    """One metadata row per ``(row, window)``: each row's ``t2w_windows`` reduced to that one window."""
    out = []
    for meta in dataset.metadata:
        for win in meta.get("t2w_windows", []):
            out.append({**meta, "t2w_windows": [win]})
    return out


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's (CPU and CUDA) RNG states on exit."""
    host = _rng_states()
    states = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        _set_rng(host)
        torch.set_rng_state(states[0])
        if states[1] is not None:
            torch.cuda.set_rng_state_all(states[1])


def pack_one(sample: dict) -> dict:
    """One sample as upstream's packing loader hands it to the model: ``custom_collate_fn`` then the packing loader's
    own split (``_get_next_sample``) and merge (``_update_output_batch``)."""
    from cosmos_framework.data.generator import joint_dataloader as jd

    packer = object.__new__(jd.PackingDataLoader)
    packer.buffers = [deque()]
    packer.dataloaders = [iter([jd.custom_collate_fn([sample])])]
    packed: dict = {}
    packer._update_output_batch(packed, packer._get_next_sample(0))
    return packed


def _batch_to_device(batch: dict, device: torch.device) -> dict:
    try:
        from cosmos_framework.utils import misc

        return misc.to(batch, device=device)
    except (ImportError, AttributeError):
        return batch


def run_prepass(model: Any, loader: Any, out: Any = None,
                pack: Callable[[dict], dict] = pack_one) -> dict[str, int] | None:
    """Encode every window of the loader's SFT dataset through upstream's own online path (misses fill the cache).

    ``pack`` builds the model's batch from one sample (upstream's collate and packing: :func:`pack_one`).
    Prints progress (windows done, seconds, ETA) to ``out`` (default stderr) every 20 windows and at the end.
    Returns the counters of this pass (``stored``, ``hits``, ``misses``, ``corrupt``, ``checked``, ``skipped``:
    windows the dataset returned nothing for), or ``None`` where ``model`` has no cache or the loader no SFT dataset.
    """
    out = out or sys.stderr
    cache: UpstreamLatentCache | None = getattr(model, "_onecard_latents", None)
    dataset = find_sft_dataset(loader)
    if cache is None or dataset is None:
        if cache is not None:
            log.warning("onecard: latent cache: no SFT dataset found in the training loader; latents are stored "
                        "on first encode")
        return None
    rank, world = 0, 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rows = windows(dataset)[rank::world]
    params = inspect.signature(model.get_data_and_condition).parameters
    kwargs = {k: v for k, v in (("iteration", 0), ("retain_raw_state_vision", False)) if k in params}
    if cache.decode_free is None:
        start_decode_free(cache)
    _DATASET["sft"] = dataset  # what decode_cached decodes with, in this process
    before = dict(cache.stats)
    t0 = time.perf_counter()
    with rng_preserved(), torch.no_grad():
        if not hasattr(dataset, "s3_client"):  # upstream's __iter__ sets it, in the loader's workers
            from cosmos_framework.data.generator.local_datasets import sft_dataset as sd

            dataset.s3_client = sd.boto3.client("s3", **dataset.s3_credentials, config=sd.client_config)
        skipped = 0
        for n, meta in enumerate(rows, 1):
            sample = dataset.process_one_sample(meta)
            if sample is None:
                skipped += 1
            else:
                model.get_data_and_condition(_batch_to_device(pack(sample), cache.device), **kwargs)
            if n == len(rows) or n % 20 == 0:
                dt = time.perf_counter() - t0
                print(f"onecard: latent pre-pass {n}/{len(rows)} windows, {dt:.1f} s, "
                      f"ETA {dt / n * (len(rows) - n):.0f} s", file=out, flush=True)
    if world > 1:
        torch.distributed.barrier()
    done = {k: cache.stats[k] - before[k] for k in cache.stats}
    done["skipped"] = skipped
    log.info("onecard: latent pre-pass: %d windows, %d encoded and stored, %d already cached, %d skipped by the "
             "dataset, %.1f s", len(rows), done["stored"], done["hits"], skipped, time.perf_counter() - t0)
    return done


def patched_trainer_train(original: Callable[..., Any]) -> Callable[..., Any]:
    """``ImaginaireTrainer.train`` that runs :func:`run_prepass` before upstream's loop."""

    def train(self, model, dataloader_train, dataloader_val):
        run_prepass(model, dataloader_train)
        return original(self, model, dataloader_train, dataloader_val)

    return train
