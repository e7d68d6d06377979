"""Lever 4 as an upstream patch (``COSMOS_LATENT_CACHE=1``), against the real cosmos-framework code on the CPU.

Upstream's own ``SFTDataset.process_one_sample`` decodes real mp4 clips (through the ``ffmpeg``/``ffprobe``
stand-ins of ``benchmarks/upstream/fftools.py``; only caption tokenisation is stubbed), upstream's
``custom_collate_fn`` and packing-loader split/merge build the batch, and upstream's own
``get_data_and_condition`` / ``_encode_vision_x0_tokens`` / ``_encode_vision_item`` / ``encode`` run unbound on a
stand-in model whose tokenizer is upstream's ``Wan2pt2VAEInterface`` over a small ``WanVAE_`` (upstream's own CPU
test pattern). The model's methods are upstream's; the stand-in only carries the attributes they read.

Proofs: the latents the patched trainer is handed are ``torch.equal`` (float32, shape, values) to upstream's online
encode, with the VAE made to raise after the pre-pass (it is never used, never moved); the pre-pass leaves the RNG
states as they were; every key part misses when changed, including a clip replaced by another of the same size and
mtime. Planted bugs (same file): a key without the pixels (a stale hit), latents always stored in bf16, a pre-pass
that does not restore the RNG.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from patches.cosmos_table import patch_set

HERE = Path(__file__).resolve().parents[2] / "benchmarks" / "upstream"
ON = {"COSMOS_LATENT_CACHE": True}


def _prepare_assets():
    sys.path.insert(0, str(HERE))
    try:
        import prepare_assets
    finally:
        sys.path.remove(str(HERE))
    return prepare_assets


WINDOWS = [{"start_frame": 0, "end_frame": 8, "temporal_interval": 1, "caption": "a"},
           {"start_frame": 4, "end_frame": 12, "temporal_interval": 1, "caption": "b"}]


@pytest.fixture(autouse=True)
def no_plan(monkeypatch):
    """The decode-free plan the patched set_up_tokenizers exports is undone after each test."""
    monkeypatch.setenv("ONECARD_LATENT_CACHE_PLAN", "")


@pytest.fixture
def clips(tmp_path, monkeypatch):
    """Two small mp4 clips (two windows each) and the ffmpeg/ffprobe stand-ins first on PATH."""
    pa = _prepare_assets()
    monkeypatch.setenv("PATH", f"{pa.write_bin(tmp_path)}{os.pathsep}{os.environ['PATH']}")
    rows = []
    for i, (w, h) in enumerate([(96, 72), (80, 80)]):
        path = tmp_path / f"clip{i}.mp4"
        pa._write_clip(path, w, h, 13, 24, seed=i)
        rows.append({"uuid": f"clip{i}", "vision_path": str(path), "width": w, "height": h,
                     "aspect_ratio": "4,3" if w != h else "1,1", "t2w_windows": [dict(x) for x in WINDOWS]})
    return rows


@pytest.fixture
def dataset(clips, monkeypatch):
    """Upstream's own SFTDataset over the clips (caption tokenisation stubbed)."""
    from cosmos_framework.data.generator.local_datasets import sft_dataset as sd

    monkeypatch.setattr(sd, "lazy_instantiate", lambda cfg: SimpleNamespace(tokenizer=object()))
    monkeypatch.setattr(sd, "add_special_tokens", lambda tok: (tok, None))
    monkeypatch.setattr(sd, "tokenize_caption", lambda caption, tok, **kw: [7, 8, 9])
    ds = sd.SFTDataset(metadata=clips, num_video_frames=-1, resolution="256", s3_credentials={}, cfg_dropout_rate=0.0)
    ds.s3_client = None  # local paths: upstream's download_from_s3 reads the file
    return ds


def _model():
    """Upstream's OmniMoTModel methods on a stand-in: upstream's Wan2pt2VAEInterface over a small WanVAE_ (fp32)."""
    from cosmos_framework.model.generator.omni_mot_model import OmniMoTModel
    from cosmos_framework.model.generator.tokenizers import wan2pt2_vae_4x16x16 as wv

    m = object.__new__(OmniMoTModel)
    torch.nn.Module.__init__(m)
    torch.manual_seed(0)
    wan = object.__new__(wv.WanVAE)
    wan.model = wv.WanVAE_(dim=8, dec_dim=8, z_dim=48, num_res_blocks=1).eval().requires_grad_(False)
    wan.dtype, wan.device = torch.float32, "cpu"
    wan.is_amp, wan.context = False, contextlib.nullcontext()  # ed8287f's WanVAE reads these
    wan.scale = (torch.randn(48), torch.rand(48) + 0.5)
    tok = object.__new__(wv.Wan2pt2VAEInterface)
    tok.model, tok._causal, tok._decoder_override = wan, True, None
    tok._spatial_compression_factor, tok._temporal_compression_factor = 16, 4
    tok.encode_chunk_frames = {"256": 68, "480": 24, "720": 8}
    m.tokenizer_vision_gen, m.tokenizer_sound_gen, m.tokenizer_lidar = tok, None, None
    m.input_image_key, m.input_video_key, m.log_enc_time_every_n = "images", "video", 1000
    m.config = SimpleNamespace(diffusion_expert_config=SimpleNamespace(vision_temporal_position_mode="latent_index"),
                               tokenizer="wan2pt2 stand-in")
    m.tensor_kwargs_fp32 = dict(device="cpu", dtype=torch.float32)
    m.tensor_kwargs = dict(device="cpu", dtype=torch.bfloat16)
    return m


def _samples(ds, rows):
    from cosmos_framework_ext.upstream.latents import windows

    return [ds.process_one_sample(meta) for meta in windows(SimpleNamespace(metadata=rows))]


def _x0(model, sample) -> list[torch.Tensor]:
    from cosmos_framework_ext.upstream.latents import pack_one

    with torch.no_grad():
        return model.get_data_and_condition(pack_one(sample), iteration=1).x0_tokens_vision


def _with_cache(tmp_path, monkeypatch):
    """The patched set_up_tokenizers run over the stand-in: VAE parked, cache created (as in upstream's __init__)."""
    from cosmos_framework_ext.upstream.patches import patched_set_up_tokenizers

    monkeypatch.setenv("COSMOS_LATENT_CACHE", "1")
    monkeypatch.setenv("ONECARD_LATENT_CACHE", str(tmp_path / "latents"))
    m = _model()
    patched_set_up_tokenizers(lambda self: None)(m)
    assert m._onecard_vae.parked and m._onecard_latents.store.root == tmp_path / "latents"
    return m


def _cached_run(tmp_path, monkeypatch, dataset, clips):
    """Stock online latents, then the patched path: pre-pass, then each window again with the VAE made to raise."""
    from cosmos_framework_ext.upstream.latents import run_prepass

    stock_model = _model()
    online = [_x0(stock_model, s) for s in _samples(dataset, clips)]
    ps = patch_set()
    ps.apply(ON)
    try:
        m = _with_cache(tmp_path, monkeypatch)
        loader = SimpleNamespace(dataloader_list=[SimpleNamespace(dataset=dataset)])  # the packing loader's shape
        rng = (random.getstate(), torch.get_rng_state())
        done = run_prepass(m, loader)
        rng_kept = random.getstate() == rng[0] and torch.equal(torch.get_rng_state(), rng[1])
        moves = m._onecard_vae.stats["unpark_count"]

        def no_vae(*a, **k):
            raise AssertionError("the VAE encoded a window the pre-pass had cached")

        monkeypatch.setattr(m.tokenizer_vision_gen.model.model, "encode", no_vae)
        served = [_x0(m, s) for s in _samples(dataset, clips)]
        return SimpleNamespace(online=online, served=served, done=done, rng_kept=rng_kept, model=m,
                               moves_after_prepass=m._onecard_vae.stats["unpark_count"] - moves)
    finally:
        ps.revert()


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def test_cached_latents_equal_upstreams_online_encode_and_the_vae_never_moves(tmp_path, monkeypatch, dataset, clips):
    r = _cached_run(tmp_path, monkeypatch, dataset, clips)
    assert r.done["stored"] == 4 and r.done["skipped"] == 0  # 2 clips x 2 windows, all from upstream's dataset
    assert all(_same(a, b) for a, b in zip(r.online, r.served)) and len(r.served) == 4
    assert r.online[0][0].dtype == torch.float32 and not torch.equal(r.online[0][0], r.online[1][0])
    assert r.model._onecard_latents.stats["hits"] == 4 and r.moves_after_prepass == 0
    assert r.rng_kept  # the pre-pass drew upstream's window/caption randomness; training's RNG is as before


def test_a_batch_without_worker_keys_is_keyed_the_same_in_the_trainer(dataset, clips):
    from cosmos_framework_ext.upstream.latents import SAMPLE_KEY, batch_keys, pack_one

    ps = patch_set()
    ps.apply(ON)
    try:
        sample = _samples(dataset, clips)[0]
    finally:
        ps.revert()
    packed = pack_one(sample)
    assert packed[SAMPLE_KEY] == [sample[SAMPLE_KEY]]
    del packed[SAMPLE_KEY]
    assert batch_keys(packed) == [sample[SAMPLE_KEY]]


def test_every_key_part_misses_when_changed(tmp_path, monkeypatch, dataset, clips):
    """The window, the size, one pixel of the clip, the item's shape, the VAE's weights, its scale, its dtype."""
    from cosmos_framework_ext.upstream.latents import UpstreamLatentCache, sample_key

    s0, s1 = _samples(dataset, clips)[:2]
    fields = {k: s0[k] for k in ("__url__", "frame_start", "frame_end", "num_multiplier", "image_size")}
    base = sample_key(fields, s0["video"])
    assert sample_key(fields, s0["video"].clone()) == base
    assert sample_key({**fields, "frame_start": 4}, s0["video"]) != base
    assert sample_key({**fields, "image_size": s0["image_size"] * 2}, s0["video"]) != base
    assert sample_key(fields, s1["video"]) != base
    changed = s0["video"].clone()
    changed.view(-1)[-1] ^= 1
    assert sample_key(fields, changed) != base

    item = torch.zeros(1, 3, 9, 256, 320)
    m = _model()
    key = UpstreamLatentCache(tmp_path / "c", m, torch.device("cpu")).key(base, item).digest
    assert UpstreamLatentCache(tmp_path / "c", m, torch.device("cpu")).key(base, item[..., :160]).digest != key
    vae = m.tokenizer_vision_gen.model
    with torch.no_grad():
        next(vae.model.parameters()).view(-1)[0] += 1
    assert UpstreamLatentCache(tmp_path / "c", m, torch.device("cpu")).key(base, item).digest != key
    m2 = _model()
    m2.tokenizer_vision_gen.model.scale = (m2.tokenizer_vision_gen.model.scale[0] + 1,
                                           m2.tokenizer_vision_gen.model.scale[1])
    assert UpstreamLatentCache(tmp_path / "c", m2, torch.device("cpu")).key(base, item).digest != key
    m3 = _model()
    m3.tokenizer_vision_gen.model.dtype = torch.bfloat16
    assert UpstreamLatentCache(tmp_path / "c", m3, torch.device("cpu")).key(base, item).digest != key


def test_a_corrupt_entry_is_encoded_again(tmp_path, monkeypatch, dataset, clips):
    from cosmos_framework_ext.upstream.latents import run_prepass

    ps = patch_set()
    ps.apply(ON)
    try:
        m = _with_cache(tmp_path, monkeypatch)
        loader = SimpleNamespace(dataset=dataset)
        assert run_prepass(m, loader)["stored"] == 4
        for f in (tmp_path / "latents").rglob("*.safetensors"):
            f.write_bytes(f.read_bytes()[:-8] + bytes(8))
        again = run_prepass(m, loader)
        assert again["corrupt"] == 4 and again["stored"] == 4 and again["hits"] == 0
        assert run_prepass(m, loader)["hits"] == 4
    finally:
        ps.revert()


def test_the_table_names_the_dataset_model_and_trainer_targets():
    ps = patch_set()
    names = {p.name for p in ps.wanted(ON)}
    assert {"latent.sample_key", "latent.encode", "latent.prepass", "vae.set_up_tokenizers",
            "vae.get_data_and_condition", "vae.encode", "vae.decode"} <= names
    assert not {"ema.set_up_model", "optim.state_offload"} & names
    ps.apply(ON)
    ps.revert()


def test_cached_windows_are_not_decoded_and_decode_again_to_upstreams_pixels(tmp_path, monkeypatch, dataset, clips):
    """After the pre-pass, upstream's dataset returns each window without running ffmpeg (the stand-in is made to
    fail): every field, the key and the RNG draws are stock's, the clip is zeros of the decoded shape, and
    decode_cached puts upstream's own decoded pixels back into the packed batch."""
    import shutil

    from cosmos_framework_ext.upstream import latents as L

    random.seed(3)
    stock = _samples(dataset, clips)
    stock_rng = random.getstate()
    ps = patch_set()
    ps.apply(ON)
    try:
        m = _with_cache(tmp_path, monkeypatch)
        assert L.run_prepass(m, SimpleNamespace(dataset=dataset))["stored"] == 4
        ffmpeg = Path(shutil.which("ffmpeg"))
        kept = ffmpeg.read_bytes()
        ffmpeg.write_text("#!/bin/sh\nexit 3\n")  # a decode now yields no frame (the sample would be None)
        random.seed(3)
        got = _samples(dataset, clips)
        assert random.getstate() == stock_rng and all(g is not None and g[L.PIXELS] == "cached" for g in got)
        ffmpeg.write_bytes(kept)
        for s, g in zip(stock, got):
            assert g[L.SAMPLE_KEY] == L.sample_key(s, s["video"]) and not g["video"].any()
            for k, v in s.items():
                same = torch.equal(v, g[k]) if isinstance(v, torch.Tensor) and k != "video" else (k == "video" or v == g[k])
                assert same, k
            packed = L.pack_one(g)
            clip = packed["video"][0][0] if isinstance(packed["video"][0], list) else packed["video"][0]
            assert L.decode_cached(packed) == 1 and torch.equal(clip.reshape(s["video"].shape), s["video"])
        random.seed(3)
        served = [_x0(m, g) for g in _samples(dataset, clips)]
        online = [_x0(_model(), s) for s in stock]
        assert all(_same(a, b) for a, b in zip(online, served))
    finally:
        ps.revert()


# ------------------------------------------------------------------------------------------- planted bugs
def _replaced_clip_is_encoded_anew(tmp_path, monkeypatch, dataset, clips) -> bool:
    """Fill the cache, replace clip 0 by another clip at the same path with the old mtime, and compare what the
    patched path serves with a stock encode of the new clip (the key reads the pixels, never a size or an mtime)."""
    pa = _prepare_assets()
    ps = patch_set()
    ps.apply(ON)
    try:
        m = _with_cache(tmp_path, monkeypatch)
        [_x0(m, s) for s in _samples(dataset, clips)]
        path = Path(clips[0]["vision_path"])
        st = path.stat()
        pa._write_clip(path, 96, 72, 13, 24, seed=9)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        served = [_x0(m, s) for s in _samples(dataset, clips)]
    finally:
        ps.revert()
    fresh = [_x0(_model(), s) for s in _samples(dataset, clips)]
    return all(_same(a, b) for a, b in zip(fresh, served))


def test_a_replaced_clip_is_encoded_anew(tmp_path, monkeypatch, dataset, clips):
    assert _replaced_clip_is_encoded_anew(tmp_path, monkeypatch, dataset, clips)


def test_planted_key_without_the_pixels_is_a_stale_hit(tmp_path, monkeypatch, dataset, clips):
    """Planted: the sample key leaves out the pixels; a clip replaced at the same path is served its old latent."""
    from cosmos_framework_ext.upstream import latents as L

    def no_pixels(fields, video):
        return L.hashlib.sha256(repr({k: L._flat(fields[k]) for k in L._IDENTITY}).encode()).hexdigest()

    monkeypatch.setattr(L, "sample_key", no_pixels)
    assert not _replaced_clip_is_encoded_anew(tmp_path, monkeypatch, dataset, clips)


def test_planted_bf16_storage_is_caught(tmp_path, monkeypatch, dataset, clips):
    """Planted: every latent stored in bf16 (exact only for a bf16 VAE): the served fp32-VAE latents differ."""
    from cosmos_framework_ext.upstream.latents import UpstreamLatentCache

    def always_bf16(self, sample, item, latent):
        self.store.store(self.key(sample, item), {"latent": latent.detach().to("cpu").to(torch.bfloat16)})
        self.stats["stored"] += 1

    monkeypatch.setattr(UpstreamLatentCache, "save", always_bf16)
    r = _cached_run(tmp_path, monkeypatch, dataset, clips)
    assert not all(_same(a, b) for a, b in zip(r.online, r.served))


def test_planted_prepass_that_keeps_upstreams_draws_is_caught(tmp_path, monkeypatch, dataset, clips):
    """Planted: the pre-pass does not restore the RNG (upstream's dataset draws a window and a caption per call)."""
    from cosmos_framework_ext.upstream import latents as L

    monkeypatch.setattr(L, "rng_preserved", contextlib.nullcontext)
    r = _cached_run(tmp_path, monkeypatch, dataset, clips)
    assert not r.rng_kept
