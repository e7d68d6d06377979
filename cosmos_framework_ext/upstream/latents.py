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

import contextlib
import hashlib
import inspect
import json
import logging
import random
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from patches.core.data.latents import (CorruptEntry, LatentCacheError, LatentStore, file_sha256, make_key,
                                       module_fingerprint, tensor_bytes)
from patches.core.flags import LATENT_CACHE_CHECK

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


def patched_process_one_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    """``SFTDataset.process_one_sample`` that adds :data:`SAMPLE_KEY` to every sample it returns."""

    def process_one_sample(self, metadata):
        sample = original(self, metadata)
        if isinstance(sample, dict) and isinstance(sample.get("video"), torch.Tensor):
            sample[SAMPLE_KEY] = sample_key(sample, sample["video"])
        return sample

    return process_one_sample


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
    keys = data_batch.get(SAMPLE_KEY)
    if isinstance(keys, list) and len(keys) == len(items) and all(isinstance(k, str) for k in keys):
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
        cache.batches += 1
        if cache.batches in (1, 10) or cache.batches % 100 == 0:
            log.info("onecard: latent cache: %d batches served, %s", cache.batches,
                     ", ".join(f"{k} {v}" for k, v in cache.stats.items()))
        return out

    return _encode_vision_x0_tokens


def serving(self, data_batch: dict[str, Any]) -> contextlib.AbstractContextManager:
    """Within it, ``self``'s ``_encode_vision_x0_tokens`` knows ``data_batch``'s sample keys (used by lever 2's
    ``get_data_and_condition`` patch when this lever is on)."""

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        self._onecard_batch_keys = batch_keys(data_batch)
        try:
            yield
        finally:
            self._onecard_batch_keys = None

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
    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


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


def _to_device(batch: dict, device: torch.device) -> dict:
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
                model.get_data_and_condition(_to_device(pack(sample), cache.device), **kwargs)
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
