"""Lever 4 (``COSMOS_LATENT_CACHE=1``): the cached latents are the online encode's, bit for bit.

The proof, on the CPU with the ``tiny`` preset (Wan2.2 layout) and real clips of the sample dataset:

- every latent the pre-pass stores, read back by a read-only cache (what training holds), is ``torch.equal``
  (same dtype, same shape, same values) to an independent online encode: ``decode_window`` -> batch of one ->
  ``encode_latents`` in the VAE's dtype -- for windows of one clip that start at different frames with the
  same length (same shape), so a key that forgets the window cannot hide;
- a trainer run fed from the cache (the VAE never encodes during training) ends with the same weights, EMA,
  optimizer state and losses, ``torch.equal``, as one fed online;
- every key part misses when it changes (file bytes, window, size, VAE weights, ``latents_mean``/``latents_std``,
  encode dtype); a corrupt entry is re-encoded with a warning; training refuses a missing entry;
- planted bugs fail the check: a key that ignores the window, a cache that stores bf16 while the online path
  yields fp32 (also as mutants in ``tests/mutation/mutants.toml``).

A CUDA variant (bf16 VAE on the GPU, as the trainer runs it there) is skipped without a GPU.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path

import pytest
import torch

from cosmos_framework_ext.levers import latent_cache as lc
from cosmos_framework_ext.recipe import train
from patches.core.data.rows import SampleRecord, load_records
from patches.core.data.video import decode_window
from cosmos_framework_ext.recipe import prepass
from cosmos_framework_ext.recipe.data import cache_items, target_size
from cosmos_framework_ext.recipe.presets import build_vae, get_preset
from cosmos_framework_ext.recipe.vae import encode_latents, online_latent

TINY = get_preset("tiny")


def _vae(device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_vae(TINY, device=device, dtype=dtype)


def _records(sample_dataset: Path, video: Path | None = None) -> list[SampleRecord]:
    """Two rows of one clip: windows of equal length at different starts, plus a longer one."""
    rec = load_records(sample_dataset)[0]
    path = video or rec.video_path
    return [
        SampleRecord(0, 1, rec.video, path, "a", rec.fps, rec.width, rec.height, ((0, 5), (4, 5))),
        SampleRecord(1, 2, rec.video, path, "b", rec.fps, rec.width, rec.height, ((2, 9), (4, 5))),
    ]


def online(vae: torch.nn.Module, item: lc.CacheItem, device: str = "cpu") -> torch.Tensor:
    """The trainer's online encode, written out independently of the cache module."""
    dtype = next(vae.parameters()).dtype
    video = decode_window(item.video_path, item.window[0], item.window[1], item.size)
    with torch.no_grad():
        return encode_latents(vae, video.unsqueeze(0).to(device, dtype)).to("cpu")


def mismatches(vae: torch.nn.Module, items: list[lc.CacheItem], root: Path, device: str = "cpu") -> list[str]:
    """The check: pre-pass into ``root``, then every item read back read-only against the online encode."""
    cache = lc.LatentCache.for_vae(vae, device, root, encode=online_latent)
    cache.prepass(items, progress=False)
    reader = cache.read_only()
    bad = []
    for it in items:
        ref = online(vae, it, device)
        try:
            got = reader.get(it)
        except lc.LatentCacheError as e:
            bad.append(f"{it.window}: {e}")
            continue
        if got.dtype != ref.dtype or got.shape != ref.shape or not torch.equal(got, ref):
            bad.append(f"{it.window}: {got.dtype} {tuple(got.shape)} vs online {ref.dtype} {tuple(ref.shape)}")
    return bad


@pytest.fixture()
def items(sample_dataset: Path) -> list[lc.CacheItem]:
    out = cache_items(_records(sample_dataset), TINY)
    assert len(out) == 3  # (0, 5), (4, 5), (2, 9): the repeated (4, 5) is one item
    return out


# ------------------------------------------------------------------------------------------ the proof
def test_cached_latents_equal_online_encode(items, tmp_path):
    vae = _vae()
    assert mismatches(vae, items, tmp_path / "c") == []
    again = lc.LatentCache.for_vae(vae, "cpu", tmp_path / "c", encode=online_latent).prepass(items, progress=False)
    assert (again.hits, again.misses, again.corrupt) == (3, 0, 0)
    assert again.bytes_on_disk == sum(p.stat().st_size for p in (tmp_path / "c").rglob("*.safetensors")) > 0
    assert not list((tmp_path / "c").rglob(".*.tmp-*"))


def test_items_cover_every_window_at_the_row_size(sample_dataset):
    records = load_records(sample_dataset)
    got = cache_items(records, TINY)
    want = {(r.video_path, w, target_size(r.width, r.height, TINY)) for r in records for w in r.windows}
    assert {(i.video_path, i.window, i.size) for i in got} == want and len(got) == len(want)


@pytest.fixture()
def train_env(tmp_path, monkeypatch, sample_dataset):
    monkeypatch.setenv("DATASET_PATH", str(sample_dataset))
    monkeypatch.setenv("ONECARD_LATENT_CACHE", str(tmp_path / "latents"))
    for var in ("BASE_CHECKPOINT_PATH", "WAN_VAE_PATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "COSMOS_EMA_CPU_SUBSET",
                "COSMOS_VAE_CPU_OFFLOAD"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def _train(env: Path, monkeypatch, name: str, cache: bool) -> tuple[dict, dict]:
    from tests.test_train import small_toml

    monkeypatch.setenv("OUTPUT_ROOT", str(env / name))
    monkeypatch.setenv("COSMOS_LATENT_CACHE", "1" if cache else "0")
    toml = small_toml(env, **{"cpu_max_iter            = 4": "cpu_max_iter            = 2"})
    assert train.main(["--sft-toml", str(toml)]) == 0
    summary = json.loads(next((env / name).rglob("summary.json")).read_text())
    return summary, torch.load(summary["checkpoint"], map_location="cpu", weights_only=False)


def test_training_step_from_cache_equals_online(train_env, monkeypatch, capsys):
    ref_summary, ref = _train(train_env, monkeypatch, "online", cache=False)

    def never(*a, **k):
        raise AssertionError("training encoded a clip although the latent cache is on")

    monkeypatch.setattr(train, "online_latent", never)  # the trainer's online encode; the pre-pass has its own
    summary, got = _train(train_env, monkeypatch, "cached", cache=True)
    out = capsys.readouterr().out
    assert "latents from the cache (lever 4)" in out and "misses" in out
    assert summary["latent_cache"]["misses"] == summary["latent_cache"]["entries"] > 0
    assert summary["vae_offload"] is None and summary["last_loss"] == ref_summary["last_loss"]
    assert summary["samples_per_optimizer_step"] == ref_summary["samples_per_optimizer_step"]
    assert got["model"].keys() == ref["model"].keys()
    assert all(torch.equal(got["model"][k], ref["model"][k]) for k in ref["model"])
    flat = lambda sd: {(i, k): v for i, s in sd["state"].items() for k, v in s.items()}  # noqa: E731
    a, b = flat(got["optimizer"]), flat(ref["optimizer"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ledger_counts_no_gpu_bytes_for_the_vae_with_the_cache():
    from cosmos_framework_ext.recipe import config as cfgmod
    from cosmos_framework_ext.recipe.ledger import cosmos_ledger

    cfg = cfgmod.load(Path(__file__).resolve().parents[2] / "toml" / "vision_sft_edge_24gb.toml")
    stock = cosmos_ledger(cfg, "tiny", {})
    cached = cosmos_ledger(cfg, "tiny", {"COSMOS_LATENT_CACHE": True})
    vae = [i for i in cached.items if "VAE" in i.name]
    assert len(vae) == 1 and vae[0].gpu_bytes == 0 and vae[0].host_bytes == 0 and "lever 4" in vae[0].name
    stock_vae = [i for i in stock.items if "VAE" in i.name][0]
    assert stock.gpu_allocated - cached.gpu_allocated == stock_vae.gpu_bytes > 0


# ------------------------------------------------------------------------------------------ keys
def test_every_key_part_misses_when_it_changes(items, sample_dataset, tmp_path):
    vae = _vae()
    base = lc.LatentCache.for_vae(vae, "cpu", tmp_path, encode=online_latent)
    it = items[0]
    k0 = base.key(it).digest
    assert base.key(lc.CacheItem(it.video_path, (1, 5), it.size)).digest != k0  # window start
    assert base.key(lc.CacheItem(it.video_path, (0, 9), it.size)).digest != k0  # window length
    other = (64, 48) if it.size != (64, 48) else (64, 32)
    assert base.key(lc.CacheItem(it.video_path, it.window, other)).digest != k0  # target size
    copy = tmp_path / "copy.mp4"
    shutil.copyfile(it.video_path, copy)
    assert base.key(lc.CacheItem(copy, it.window, it.size)).digest == k0  # same bytes elsewhere: same entry
    with open(copy, "ab") as f:
        f.write(b"\0")
    assert base.key(lc.CacheItem(copy, it.window, it.size)).digest != k0  # other bytes
    with torch.no_grad():
        next(vae.parameters()).view(-1)[0] += 1e-3
    assert lc.LatentCache.for_vae(vae, "cpu", tmp_path, encode=online_latent).key(it).digest != k0  # weights
    vae = _vae()
    assert lc.LatentCache.for_vae(vae, "cpu", tmp_path, encode=online_latent).key(it).digest == k0  # rebuilt alike: a hit
    vae.register_to_config(latents_std=[s * 2 for s in vae.config.latents_std])
    assert lc.LatentCache.for_vae(vae, "cpu", tmp_path, encode=online_latent).key(it).digest != k0  # latents_std
    vae = _vae()
    vae.register_to_config(latents_mean=[m + 1 for m in vae.config.latents_mean])
    assert lc.LatentCache.for_vae(vae, "cpu", tmp_path, encode=online_latent).key(it).digest != k0  # latents_mean
    assert lc.LatentCache.for_vae(_vae(dtype=torch.bfloat16), "cpu", tmp_path, encode=online_latent).key(it).digest != k0  # dtype


def test_a_changed_latents_std_is_a_miss_not_a_stale_hit(items, tmp_path):
    vae = _vae()
    lc.LatentCache.for_vae(vae, "cpu", tmp_path, encode=online_latent).prepass(items, progress=False)
    vae.register_to_config(latents_std=[s * 2 for s in vae.config.latents_std])
    report = lc.LatentCache.for_vae(vae, "cpu", tmp_path, encode=online_latent).prepass(items, progress=False)
    assert (report.hits, report.misses) == (0, 3)
    assert mismatches(vae, items, tmp_path) == []


# ------------------------------------------------------------------------------------------ robustness
def test_corrupt_entries_are_reencoded_with_a_warning(items, tmp_path, caplog):
    vae = _vae()
    cache = lc.LatentCache.for_vae(vae, "cpu", tmp_path, encode=online_latent)
    cache.prepass(items, progress=False)
    truncated, flipped = cache.path(cache.key(items[0])), cache.path(cache.key(items[1]))
    truncated.write_bytes(truncated.read_bytes()[:40])
    data = bytearray(flipped.read_bytes())
    data[-3] ^= 0xFF  # a bit flip in the tensor payload: only the checksum sees it
    flipped.write_bytes(bytes(data))
    reader = cache.read_only()
    for it in items[:2]:
        with pytest.raises(lc.LatentCacheError, match="corrupt"):
            reader.get(it)
    with caplog.at_level(logging.WARNING, logger="onecard.latent_cache"):
        report = cache.prepass(items, progress=False)
    assert (report.hits, report.misses, report.corrupt) == (1, 0, 2)
    warned = [r.getMessage() for r in caplog.records if "re-encoding" in r.getMessage()]
    assert len(warned) == 2 and any("checksum" in w for w in warned) and any("parse" in w for w in warned)
    assert all(torch.equal(reader.get(it), online(vae, it)) for it in items)


def test_entries_of_another_shape_are_refused(tmp_path):
    """The module docstring's entry shape: ``[1, z_dim, (T - 1) // 4 + 1, H / 16, W / 16]``. For a window of 9 frames
    at ``(W, H) = (64, 32)`` and ``z_dim`` 4 that is ``(1, 4, 3, 2, 4)`` (written out by hand); an entry of that
    shape loads back, one that differs in any single size (same rank) or in rank (a prefix of the right shape, or
    one trailing dimension more) is :class:`CorruptEntry` naming the shape, and ``get`` refuses it. No VAE: a
    read-only cache on a stand-in fingerprint, the clip a few bytes (the key only hashes them)."""
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"not decoded here")
    cache = lc.LatentCache(tmp_path / "c", {"dtype": "float32", "config": json.dumps({"z_dim": 4})})
    item = lc.CacheItem(clip, (0, 9), (64, 32))
    good = (1, 4, 3, 2, 4)
    cache.store(item, torch.arange(96.0).reshape(good))
    assert torch.equal(cache.load(item), torch.arange(96.0).reshape(good))
    wrong = [(2, 4, 3, 2, 4), (1, 5, 3, 2, 4), (1, 4, 2, 2, 4), (1, 4, 3, 3, 4), (1, 4, 3, 2, 5),  # one size off
             (1, 4, 3, 2), (1, 4, 3, 2, 4, 1)]  # rank 4 (a prefix of the right shape), rank 6
    for shape in wrong:
        cache.store(item, torch.zeros(shape))
        with pytest.raises(lc.CorruptEntry, match="shape"):
            cache.load(item)
        with pytest.raises(lc.LatentCacheError, match="corrupt"):
            cache.get(item)


def test_training_refuses_a_missing_entry(items, tmp_path):
    reader = lc.LatentCache.for_vae(_vae(), "cpu", tmp_path, encode=online_latent).read_only()
    with pytest.raises(lc.LatentCacheError, match="missing.*python -m cosmos_framework_ext.recipe.prepass"):
        reader.get(items[0])
    with pytest.raises(RuntimeError, match="no VAE"):
        reader.prepass(items, progress=False)


def test_two_writers_at_once_leave_whole_entries(items, tmp_path):
    """Two runs filling one folder at once (threads here, each with its own VAE as each run has: the Wan VAE's
    causal-conv feature cache lives on the module, so one module must not encode on two threads)."""
    vae, other = _vae(), _vae()
    errors: list[BaseException] = []

    def fill(v):
        try:
            lc.LatentCache.for_vae(v, "cpu", tmp_path, encode=online_latent).prepass(items, progress=False)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=fill, args=(v,)) for v in (vae, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert not list(tmp_path.rglob(".*.tmp-*")) and len(list(tmp_path.rglob("*.safetensors"))) == 3
    assert mismatches(vae, items, tmp_path) == []


def test_rank_shares_cover_every_item_whatever_the_others_wrote(items, tmp_path):
    """Ranks check the cache at different moments: rank 1 may look after rank 0 has written its share. The shares
    are fixed by item position, so together they still cover every item (a share taken from 'what is missing
    now' skipped items here, and training then stopped on a missing entry at 2 ranks)."""
    vae = _vae()
    reports = [lc.LatentCache.for_vae(vae, "cpu", tmp_path, encode=online_latent).prepass(items, rank=r, world_size=2, progress=False)
               for r in (0, 1)]  # rank 0 all done before rank 1 looks: the worst order
    reader = lc.LatentCache.for_vae(vae, "cpu", tmp_path, encode=online_latent).read_only()
    for it in items:
        reader.load(it, reader.key(it))  # raises if an entry is missing
    distinct = len({lc.LatentCache.for_vae(vae, "cpu", tmp_path, encode=online_latent).key(it).digest for it in items})
    assert sum(r.misses for r in reports) + sum(r.hits for r in reports) == len(items)
    assert len(list(tmp_path.rglob("*.safetensors"))) == distinct


def test_cli_fills_the_cache_the_trainer_then_hits(train_env, monkeypatch, capsys):
    from tests.test_train import small_toml

    monkeypatch.setenv("COSMOS_LATENT_CACHE", "1")
    toml = str(small_toml(train_env))
    assert prepass.main(["--toml", toml, "--no-progress"]) == 0
    first = capsys.readouterr().out.strip().splitlines()[-1]
    assert " 0 hits" in first and "MiB on disk" in first
    assert prepass.main(["--toml", toml, "--no-progress"]) == 0
    assert " 0 misses" in capsys.readouterr().out.strip().splitlines()[-1]
    monkeypatch.setenv("ONECARD_LATENT_CACHE", str(Path(toml)))  # a file, not a folder
    assert prepass.main(["--toml", toml, "--no-progress"]) == 2
    assert "error: latent cache folder" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ planted bugs
def test_planted_key_without_the_window_fails_the_check(items, tmp_path, monkeypatch):
    real = lc.LatentCache.key

    def key_without_window(self, item):
        return real(self, lc.CacheItem(item.video_path, (0, item.window[1]), item.size))

    monkeypatch.setattr(lc.LatentCache, "key", key_without_window)
    assert mismatches(_vae(), items, tmp_path)  # (0, 5) and (4, 5) share one entry


def test_planted_bf16_store_fails_the_check(items, tmp_path, monkeypatch):
    real = lc.LatentCache.store

    def store_bf16(self, item, latent, key=None):
        return real(self, item, latent.to(torch.bfloat16), key)

    monkeypatch.setattr(lc.LatentCache, "store", store_bf16)
    monkeypatch.setattr(lc.LatentCache, "load", _load_without_dtype_check(lc.LatentCache.load))
    assert mismatches(_vae(), items, tmp_path)  # the online path yields fp32 on the CPU


def _load_without_dtype_check(real):
    """``load`` that accepts any dtype: the bf16 entry must still fail the comparison, not only the reader."""

    def load(self, item, key=None):
        want, self.dtype = self.dtype, torch.bfloat16
        try:
            return real(self, item, key)
        finally:
            self.dtype = want

    return load


# ------------------------------------------------------------------------------------------ CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the bf16 VAE on the GPU, as the trainer runs it")
def test_cuda_cached_latents_equal_online_encode(items, tmp_path):
    vae = _vae("cuda", torch.bfloat16)
    assert mismatches(vae, items, tmp_path, "cuda") == []
    got = lc.LatentCache.for_vae(vae, "cuda", tmp_path, encode=online_latent).read_only().get(items[0])
    assert got.dtype == torch.bfloat16 and "cuda" in lc.vae_fingerprint(vae, torch.bfloat16, "cuda")["device"]
