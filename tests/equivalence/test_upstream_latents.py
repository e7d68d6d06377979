"""Lever 4's upstream patch (``cosmos_framework_ext/upstream/latents.py``) without an upstream checkout.

A stand-in model speaks the interface the patch wraps (upstream's ``_encode_vision_x0_tokens(raw_state_vision,
num_vision_items_per_sample, vision_condition_indexes)`` returning one float32 latent per item; the VAE at
``tokenizer_vision_gen.model.model`` with its ``scale`` and ``dtype``); its encode is a fixed 3-D convolution, an
independent reference computed again for every comparison. The real upstream code path (upstream's dataset,
collate, packing and ``get_data_and_condition``) is ``tests/upstream/test_cosmos_latents.py``.

Proofs: served latents ``torch.equal`` (float32) to the online encode, with the encode made to raise; only missing
items are encoded; calls off the training path (conditioning indexes, several vision items per sample) go to the
original encode; keys from the dataset's workers equal keys made in the trainer; the pre-pass encodes each window
once and restores the RNG. Planted bugs (same file): a key without the pixels (a stale hit), bf16 storage of a float32
latent that bf16 cannot hold, the VAE fingerprint without the ``scale`` tensors.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cosmos_framework_ext.upstream import latents as L
from cosmos_framework_ext.upstream.latents import UpstreamLatentCache, patched_encode_vision_x0_tokens, serving


class Vae(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = torch.nn.Conv3d(3, 4, kernel_size=(1, 4, 4), stride=(1, 4, 4))


def encode_ref(vae: Vae, x: torch.Tensor, bf16: bool) -> torch.Tensor:
    """The reference encode: the conv in bf16 (upstream's VAE dtype) or fp32, returned as float32."""
    if bf16:
        return torch.nn.functional.conv3d(x.bfloat16(), vae.conv.weight.bfloat16(), vae.conv.bias.bfloat16(),
                                          stride=(1, 4, 4)).float()
    return vae.conv(x).float()


class Model:
    """What the patch reads of upstream's OmniMoTModel: the tokenizer chain, ``config``, the encode it wraps."""

    def __init__(self, bf16: bool = True):
        self.bf16 = bf16
        wan = SimpleNamespace(model=Vae(), scale=(torch.zeros(4), torch.ones(4)),
                              dtype=torch.bfloat16 if bf16 else torch.float32)
        self.tokenizer_vision_gen = SimpleNamespace(model=wan, encode_chunk_frames={"256": 68})
        self.config = SimpleNamespace(tokenizer="stand-in")
        self.calls = 0

    def _encode_vision_x0_tokens(self, raw_state_vision, num_vision_items_per_sample, vision_condition_indexes,
                                 *multiview):
        self.calls += len(raw_state_vision)
        return [encode_ref(self.tokenizer_vision_gen.model.model, x, self.bf16).contiguous()
                for x in raw_state_vision]


class Raising(Model):
    def _encode_vision_x0_tokens(self, *args):
        raise AssertionError("encoded online")


def patched(model: Model, root) -> Model:
    model._onecard_latents = UpstreamLatentCache(root, model, torch.device("cpu"))
    model.encode_items = patched_encode_vision_x0_tokens(type(model)._encode_vision_x0_tokens).__get__(model)
    return model


def clip(seed: int, t: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, t, 16, 16), dtype=torch.uint8, generator=g)


def batch(clips: list[torch.Tensor], starts: list[int], keys: bool = True) -> dict:
    """A packed upstream batch of one clip per sample (the layout upstream's packing loader hands the model)."""
    b = {"video": [[c] for c in clips], "__url__": [f"/data/c{i}.mp4" for i in range(len(clips))],
         "frame_start": [torch.tensor([s]) for s in starts], "frame_end": [torch.tensor([s + 4]) for s in starts],
         "num_multiplier": [torch.tensor([1]) for _ in clips],
         "image_size": [torch.tensor([16.0, 16.0, 16.0, 16.0]) for _ in clips]}
    if keys:
        b[L.SAMPLE_KEY] = [L.sample_key({k: b[k][i][0] if isinstance(b[k][i], list) else b[k][i] for k in L._IDENTITY},
                                        c) for i, c in enumerate(clips)]
    return b


def normalised(clips):
    return [c.float().div(127.5).sub(1.0).unsqueeze(0) for c in clips]  # upstream's normalisation, [1,3,T,H,W]


def encode_batch(model: Model, b: dict) -> list[torch.Tensor]:
    with serving(model, b):
        return model.encode_items(normalised([v[0] for v in b["video"]]), None, None)


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype == torch.float32 and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-vae", "fp32-vae"])
def test_served_latents_equal_the_online_encode(tmp_path, bf16):
    m = patched(Model(bf16), tmp_path)
    clips = [clip(0), clip(1), clip(2)]
    b = batch(clips, [0, 4, 0])
    ref = [encode_ref(m.tokenizer_vision_gen.model.model, x, bf16) for x in normalised(clips)]
    assert same(encode_batch(m, b), ref) and m.calls == 3
    assert same(encode_batch(patched(Raising(bf16), tmp_path), b), ref)  # served: the online encode would raise
    stored = {f.stat().st_size for f in tmp_path.rglob("*.safetensors")}
    assert len(list(tmp_path.rglob("*.safetensors"))) == 3 and m._onecard_latents.stats["stored"] == 3
    assert (max(stored) < 4 * 2 * 5 * 16 * 4) if bf16 else (min(stored) > 4 * 5 * 16 * 4)  # bf16 only when exact


def test_only_missing_items_are_encoded_and_stored(tmp_path):
    m = patched(Model(), tmp_path)
    encode_batch(m, batch([clip(0)], [0]))
    m.calls = 0
    out = encode_batch(m, batch([clip(0), clip(5)], [0, 0]))
    assert m.calls == 1 and m._onecard_latents.stats["misses"] == 2 and len(out) == 2
    assert same(out, [encode_ref(m.tokenizer_vision_gen.model.model, x, True) for x in normalised([clip(0), clip(5)])])


def test_calls_off_the_training_path_go_to_the_original(tmp_path):
    m = patched(Model(), tmp_path)
    b = batch([clip(0)], [0])
    with serving(m, b):
        m.encode_items(normalised([clip(0)]), None, [[0]])  # inference's conditioning prefix
        m.encode_items(normalised([clip(0)]), [1], None)  # several vision items per sample
        m.encode_items(normalised([clip(0)]), None, None, [2], [3])  # multiview metadata
    m.encode_items(normalised([clip(0)]), None, None)  # no batch keys known (outside get_data_and_condition)
    assert m.calls == 4 and not list(tmp_path.rglob("*.safetensors"))


def test_trainer_side_keys_equal_the_workers_and_odd_batches_are_not_keyed():
    b = batch([clip(0), clip(1)], [0, 4])
    assert L.batch_keys(b) == b[L.SAMPLE_KEY]
    assert L.batch_keys({**b, L.SAMPLE_KEY: ["w0", "w1"]}) == ["w0", "w1"]  # the workers' keys: no hashing here
    assert L.batch_keys({**b, L.SAMPLE_KEY: ["w0"]}) == b[L.SAMPLE_KEY]  # not one per sample: keyed here
    del b[L.SAMPLE_KEY]
    assert L.batch_keys(b) == batch([clip(0), clip(1)], [0, 4])[L.SAMPLE_KEY]
    assert L.batch_keys({**b, "video": [[clip(0), clip(1)]]}) is None  # two vision items in one sample
    assert L.batch_keys({**b, "video": [[clip(0).float()]]}) is None  # already normalised
    assert L.batch_keys({k: v for k, v in b.items() if k != "frame_end"}) is None
    keyed = L.patched_process_one_sample(lambda self, meta: {"video": clip(0), "__url__": "/data/c0.mp4",
                                                             "frame_start": 0, "frame_end": 4, "num_multiplier": 1,
                                                             "image_size": torch.tensor([16.0] * 4)})(None, {})
    assert keyed[L.SAMPLE_KEY] == batch([clip(0)], [0])[L.SAMPLE_KEY][0]


def test_every_key_part_misses(tmp_path):
    m = Model()
    c = UpstreamLatentCache(tmp_path, m, torch.device("cpu"))
    item = torch.zeros(1, 3, 5, 16, 16)
    base = c.key("s", item).digest
    assert c.key("t", item).digest != base and c.key("s", item[..., :8]).digest != base
    assert c.key("s", item.double()).digest != base
    for change in (lambda w: w.model.conv.weight.data.view(-1)[0].add_(1),
                   lambda w: setattr(w, "scale", (w.scale[0] + 1, w.scale[1])),
                   lambda w: setattr(w, "dtype", torch.float32)):
        m2 = Model()
        change(m2.tokenizer_vision_gen.model)
        assert UpstreamLatentCache(tmp_path, m2, torch.device("cpu")).key("s", item).digest != base
    fields = {"__url__": "/a.mp4", "frame_start": 0, "frame_end": 4, "num_multiplier": 1, "image_size": [16.0] * 4}
    k = L.sample_key(fields, clip(0))
    for name, value in (("__url__", "/b.mp4"), ("frame_start", 1), ("frame_end", 5), ("num_multiplier", 2),
                        ("image_size", [16.0, 16.0, 8.0, 8.0])):
        assert L.sample_key({**fields, name: value}, clip(0)) != k
    pixel = clip(0)
    pixel.view(-1)[7] ^= 1
    assert L.sample_key(fields, pixel) != k and L.sample_key(fields, clip(0)[:, :4]) != k


def test_a_corrupt_entry_is_encoded_again(tmp_path):
    m = patched(Model(), tmp_path)
    b = batch([clip(0)], [0])
    encode_batch(m, b)
    (f,) = tmp_path.rglob("*.safetensors")
    f.write_bytes(f.read_bytes()[:-4] + b"\0\0\0\0")
    m.calls = 0
    assert same(encode_batch(m, b), [encode_ref(m.tokenizer_vision_gen.model.model, normalised([clip(0)])[0], True)])
    assert m.calls == 1 and m._onecard_latents.stats["corrupt"] == 1


class Dataset:
    """Upstream's SFTDataset as the pre-pass sees it: ``metadata`` rows with ``t2w_windows``, random draws."""

    def __init__(self):
        self.s3_client = None
        self.metadata = [{"uuid": "a", "t2w_windows": [{"start_frame": 0}, {"start_frame": 4}]},
                         {"uuid": "b", "t2w_windows": [{"start_frame": 0}]}]

    def process_one_sample(self, meta):
        random.random(), np.random.rand(), torch.rand(1)  # upstream draws a window, a caption, an fps noise
        (win,) = meta["t2w_windows"]
        return {"clip": clip(ord(meta["uuid"]) + win["start_frame"]), "start": win["start_frame"]}


class PrepassModel(Model):
    def get_data_and_condition(self, data_batch, iteration=1):
        with serving(self, data_batch):
            return self.encode_items(normalised([v[0] for v in data_batch["video"]]), None, None)


def run(tmp_path):
    m = patched(PrepassModel(), tmp_path)
    loader = SimpleNamespace(dataloader_list=[SimpleNamespace(dataset=Dataset())])
    state = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    done = L.run_prepass(m, loader, pack=lambda s: batch([s["clip"]], [s["start"]]))
    kept = (random.getstate() == state[0] and np.array_equal(np.random.get_state()[1], state[1])
            and torch.equal(torch.get_rng_state(), state[2]))
    return m, done, kept


def test_prepass_encodes_every_window_once_and_restores_the_rng(tmp_path, capsys):
    m, done, kept = run(tmp_path)
    assert done == {"hits": 0, "misses": 3, "stored": 3, "corrupt": 0, "checked": 0, "skipped": 0} and kept
    assert "latent pre-pass 3/3 windows" in capsys.readouterr().err
    m2, again, _ = run(tmp_path)
    assert again["hits"] == 3 and again["stored"] == 0 and m2.calls == 0
    assert L.run_prepass(Model(), SimpleNamespace()) is None  # no cache on the model: nothing to do
    assert L.find_sft_dataset(SimpleNamespace(inner=[{"ds": Dataset()}])) is not None
    assert L.find_sft_dataset(SimpleNamespace(inner=[1, "x"])) is None


# ------------------------------------------------------------------------------------------- planted bugs
def test_planted_key_without_pixels_is_a_stale_hit(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "sample_key", lambda fields, video: repr({k: L._flat(fields[k]) for k in L._IDENTITY}))
    m = patched(Model(), tmp_path)
    encode_batch(m, batch([clip(0)], [0]))
    replaced = batch([clip(9)], [0])  # another clip at the same path, same window
    ref = [encode_ref(m.tokenizer_vision_gen.model.model, x, True) for x in normalised([clip(9)])]
    assert not same(encode_batch(m, replaced), ref)


def test_planted_bf16_storage_of_an_fp32_latent_is_caught(tmp_path, monkeypatch):
    def always_bf16(self, sample, item, latent):
        self.store.store(self.key(sample, item), {"latent": latent.detach().to(torch.bfloat16)})

    monkeypatch.setattr(UpstreamLatentCache, "save", always_bf16)
    m = patched(Model(bf16=False), tmp_path)
    b = batch([clip(0)], [0])
    first = encode_batch(m, b)
    assert not same(encode_batch(m, b), first)


def test_planted_fingerprint_without_scale_is_caught(monkeypatch, tmp_path):
    real = L.module_fingerprint
    monkeypatch.setattr(L, "module_fingerprint", lambda *a, **kw: real(*a, **{k: v for k, v in kw.items()
                                                                                if k != "scale"}))
    m, m2 = Model(), Model()
    m2.tokenizer_vision_gen.model.scale = (torch.ones(4), torch.ones(4))
    item = torch.zeros(1, 3, 5, 16, 16)
    assert UpstreamLatentCache(tmp_path, m, "cpu").key("s", item) == UpstreamLatentCache(tmp_path, m2, "cpu").key("s", item)


def test_check_mode_compares_every_hit_and_stops_on_a_difference(tmp_path, monkeypatch):
    from patches.core.data.latents import LatentCacheError

    b = batch([clip(0), clip(1)], [0, 0])
    encode_batch(patched(Model(), tmp_path), b)
    monkeypatch.setenv("ONECARD_LATENT_CACHE_CHECK", "1")
    m = patched(Model(), tmp_path)
    encode_batch(m, b)
    assert m._onecard_latents.stats["checked"] == 2 and m.calls == 2
    real = UpstreamLatentCache.load
    monkeypatch.setattr(UpstreamLatentCache, "load", lambda self, s, item: real(self, s, item) + 2 ** -8)
    with pytest.raises(LatentCacheError, match="differs from upstream's online encode"):
        encode_batch(patched(Model(), tmp_path), b)


# ------------------------------------------------------------------------------------------- decode-free hits
def file_decode(path, scale_hw=None, num_threads=1):
    """The stand-in decoder: the file's bytes as ``[H, W, 3]`` uint8 frames (what ffmpeg would yield)."""
    data = np.frombuffer(open(path, "rb").read(), dtype=np.uint8)
    h, w = scale_hw
    n = h * w * 3
    for i in range(len(data) // n):
        yield data[i * n:(i + 1) * n].reshape(h, w, 3)


def file_probe(path):
    """The stand-in ffprobe: the frame count and a rate from the file's size."""
    n = len(open(path, "rb").read()) // (8 * 8 * 3)
    return {"total_frames": n, "fps": 24.0 / 1.001, "width": 8, "height": 8}


class UpDataset:
    """Upstream's ``process_one_sample`` in miniature: ffprobe, a random window, the decode through the module's
    decoder (read at call time, as upstream reads ``ffmpeg_decode_video``), frame selection, a random caption."""

    decoder = staticmethod(file_decode)
    probe = staticmethod(file_probe)
    decoded = probed = 0

    def __init__(self, rows):
        self.metadata, self.s3_client = rows, None

    def process_one_sample(self, meta):
        info = type(self).probe(meta["vision_path"])
        win = meta["t2w_windows"][random.randrange(len(meta["t2w_windows"]))]
        start = win["start_frame"]
        frames = []
        for idx, f in enumerate(type(self).decoder(meta["vision_path"], scale_hw=(8, 8), num_threads=2)):
            if idx < start:
                continue
            if idx > start + 4:
                break
            frames.append(f)
        video = torch.from_numpy(np.ascontiguousarray(np.stack(frames).transpose(3, 0, 1, 2)))
        return {"video": video, "__url__": meta["vision_path"], "frame_start": start, "frame_end": start + 4,
                "num_multiplier": 1, "image_size": torch.tensor([8.0, 8.0, 8.0, 8.0]),
                "ai_caption": "a" if np.random.rand() < 0.5 else "b", "fps": info["fps"],
                "n_orig_video_frames": info["total_frames"]}


def counting_decode(path, scale_hw=None, num_threads=1):
    UpDataset.decoded += 1
    return file_decode(path, scale_hw, num_threads)


def counting_probe(path):
    UpDataset.probed += 1
    return file_probe(path)


class Patched(UpDataset):
    decoder = staticmethod(L.patched_ffmpeg_decode_video(counting_decode))
    probe = staticmethod(L.patched_get_video_metadata(counting_probe))
    process_one_sample = L.patched_process_one_sample(UpDataset.process_one_sample)


def write_clips(root, seeds=(1, 2)):
    rows = []
    for i, seed in enumerate(seeds):
        path = root / f"c{i}.raw"
        path.write_bytes(np.random.default_rng(seed).integers(0, 256, 10 * 8 * 8 * 3, dtype=np.uint8).tobytes())
        rows.append({"uuid": f"c{i}", "vision_path": str(path),
                     "t2w_windows": [{"start_frame": 0}, {"start_frame": 3}]})
    return rows


def pack(sample: dict) -> dict:
    """One sample as the packing loader hands it over: each field a one-element list, the clip ``[[video]]``."""
    return {k: ([[v]] if k == "video" else [v]) for k, v in sample.items()}


@pytest.fixture(autouse=True)
def no_plan(monkeypatch):
    monkeypatch.setenv(L.PLAN_ENV, "")  # restored (unset) after each test, whatever the test's code sets


@pytest.fixture
def decode_free(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "_DECODER", {"stand-in": "file_decode"})
    monkeypatch.setattr(L, "_DATASET", {})
    rows = write_clips(tmp_path)
    m = patched(PrepassModel(), tmp_path / "latents")
    ds = Patched(rows)
    done = L.run_prepass(m, SimpleNamespace(dataset=ds), pack=pack)
    return SimpleNamespace(rows=rows, model=m, ds=ds, done=done)


def draw(ds, n=12, seed=0):
    random.seed(seed)
    np.random.seed(seed)
    out = [ds.process_one_sample(r) for r in (ds.metadata * n)[:n]]
    return out, (random.getstate(), np.random.get_state()[1].copy())


def test_decode_free_hits_are_stock_samples_without_the_decode(decode_free, tmp_path):
    """After the pre-pass, every window is served without decoding: each sample's fields, its key and every later
    RNG draw are stock's; the latents served equal the online encode of stock's pixels; decode_cached restores
    stock's pixels exactly."""
    f = decode_free
    # 4 latents, 4 index entries, 2 ffprobe answers (one per source)
    assert f.done["stored"] == 4 and len(list((tmp_path / "latents").rglob("*.safetensors"))) == 10
    stock, stock_rng = draw(UpDataset(f.rows))
    UpDataset.decoded = UpDataset.probed = 0
    got, rng = draw(f.ds)
    assert UpDataset.decoded == UpDataset.probed == 0 and {s[L.PIXELS] for s in got} == {"cached"}
    assert rng[0] == stock_rng[0] and np.array_equal(rng[1], stock_rng[1])
    for s, g in zip(stock, got):
        assert all(torch.equal(torch.as_tensor(g[k]), torch.as_tensor(v)) if k == "image_size" else g[k] == v
                   for k, v in s.items() if k != "video")
        assert g[L.SAMPLE_KEY] == L.sample_key(s, s["video"]) and not g["video"].any()
        assert g["video"].shape == s["video"].shape and g["video"].dtype == s["video"].dtype
    served = patched(Raising(), tmp_path / "latents")
    served._onecard_latents.decode_free = f.model._onecard_latents.decode_free
    vae = f.model.tokenizer_vision_gen.model.model
    for s, g in zip(stock, got):
        b = pack(g)
        assert same(encode_batch(served, b), [encode_ref(vae, x, True) for x in normalised([s["video"]])])
        assert L.decode_cached(b) == 1 and torch.equal(b["video"][0][0], s["video"]) and b[L.PIXELS] == ["decoded"]


def test_a_changed_source_is_decoded_and_a_lost_latent_is_decoded_again(decode_free, tmp_path):
    f = decode_free
    path = f.rows[0]["vision_path"]
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1  # same size, one byte: the index key reads the source's bytes
    open(path, "wb").write(bytes(data))
    stock, stock_rng = draw(UpDataset(f.rows), n=4)
    got, rng = draw(f.ds, n=4)
    assert [g[L.PIXELS] for g in got] == ["decoded", "cached", "decoded", "cached"]
    assert all(torch.equal(s["video"], g["video"]) for s, g in zip(stock[::2], got[::2]))
    assert rng[0] == stock_rng[0] and np.array_equal(rng[1], stock_rng[1])
    b = pack(got[1])
    f.model._onecard_latents.store.entry_path(b[L.LATENT_FILE][0]).unlink()
    vae = f.model.tokenizer_vision_gen.model.model
    assert same(encode_batch(f.model, b), [encode_ref(vae, x, True) for x in normalised([stock[1]["video"]])])
    assert b[L.PIXELS] == ["decoded"]


def test_the_sample_drawing_callback_sees_decoded_pixels(decode_free):
    f = decode_free
    seen = []
    cb = L.patched_draw_sample(lambda self, trainer, model, data_batch, *rest: seen.append(data_batch["video"][0][0]))
    stock, _ = draw(UpDataset(f.rows), n=2)
    got, _ = draw(f.ds, n=2)
    for s, g in zip(stock, got):
        cb(None, None, None, pack(g), None, None, 1)
        assert torch.equal(seen[-1], s["video"])


def test_the_decode_flag_and_the_check_run_decode_every_clip(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "_DECODER", {"stand-in": "file_decode"})
    rows = write_clips(tmp_path)
    for env in ("ONECARD_LATENT_CACHE_DECODE", "ONECARD_LATENT_CACHE_CHECK"):
        monkeypatch.setenv(env, "1")
        m = patched(PrepassModel(), tmp_path / "latents")
        ds = Patched(rows)
        L.run_prepass(m, SimpleNamespace(dataset=ds), pack=pack)
        assert m._onecard_latents.decode_free is None and {draw(ds, n=4)[0][i][L.PIXELS] for i in range(4)} == {"decoded"}
        monkeypatch.delenv(env)


def test_planted_speculative_pass_that_keeps_its_draws_is_caught(tmp_path, monkeypatch):
    """Planted: after a speculative pass that misses, the RNG is not put back: samples and later draws differ."""
    monkeypatch.setattr(L, "_DECODER", {"stand-in": "file_decode"})
    monkeypatch.setattr(L, "_set_rng", lambda states: None)
    rows = write_clips(tmp_path)
    ds = Patched(rows)
    monkeypatch.setenv(L.PLAN_ENV, '{"root": "%s", "vae": {}}' % (tmp_path / "empty"))  # every lookup misses
    stock, stock_rng = draw(UpDataset(rows))
    got, rng = draw(ds)
    assert rng[0] != stock_rng[0] or any(s["frame_start"] != g["frame_start"] for s, g in zip(stock, got))


def test_planted_source_key_without_the_bytes_serves_a_stale_clip(decode_free, monkeypatch):
    """Planted: the decoder records the source's path instead of its bytes; a changed clip is then served its old
    latent (no decode, so its pixels are never looked at)."""
    f = decode_free
    monkeypatch.setattr(L, "file_sha256", lambda p: "same")
    monkeypatch.setattr(L, "_DECODER", {"stand-in": "file_decode"})
    L.run_prepass(f.model, SimpleNamespace(dataset=f.ds), pack=pack)  # index entries under the planted key
    path = f.rows[0]["vision_path"]
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1
    open(path, "wb").write(bytes(data))
    got, _ = draw(f.ds, n=4)
    assert got[0][L.PIXELS] == "cached"  # what the real key prevents (test_a_changed_source_is_decoded_...)


def test_planted_callback_without_decode_shows_zeros(decode_free, monkeypatch):
    f = decode_free
    monkeypatch.setattr(L, "decode_cached", lambda data_batch, which=None: 0)
    seen = []
    cb = L.patched_draw_sample(lambda self, trainer, model, data_batch, *rest: seen.append(data_batch["video"][0][0]))
    stock, _ = draw(UpDataset(f.rows), n=1)
    got, _ = draw(f.ds, n=1)
    cb(None, None, None, pack(got[0]), None, None, 1)
    assert not torch.equal(seen[-1], stock[0]["video"])


def test_every_decode_free_key_part_misses(decode_free, tmp_path, monkeypatch):
    """Another decoder (ffmpeg/ffprobe binary or upstream's decode code), a longer source, a window whose latent file
    is gone: each such window is decoded (and probed) again, and gives stock's sample."""
    f = decode_free
    monkeypatch.setattr(L, "_DECODER", {"stand-in": "another ffmpeg"})
    assert {g[L.PIXELS] for g in draw(f.ds, n=4)[0]} == {"decoded"}
    monkeypatch.setattr(L, "_DECODER", {"stand-in": "file_decode"})
    path = f.rows[1]["vision_path"]
    open(path, "ab").write(bytes(2 * 8 * 8 * 3))  # two more frames: ffprobe's answer changes too
    stock, _ = draw(UpDataset(f.rows), n=4)
    got, _ = draw(f.ds, n=4)
    assert [g[L.PIXELS] for g in got] == ["cached", "decoded", "cached", "decoded"]
    assert all(s["n_orig_video_frames"] == g["n_orig_video_frames"] for s, g in zip(stock, got))
    for g in got[::2]:
        f.model._onecard_latents.store.entry_path(g[L.LATENT_FILE]).unlink(missing_ok=True)
    assert {g[L.PIXELS] for g in draw(f.ds, n=4)[0]} == {"decoded"}


def test_a_cached_sample_whose_source_changed_is_not_served_blind(decode_free, tmp_path):
    """Drawn without decoding, then its source changes: decoding it again for a pixel reader stops with one error;
    a cached sample whose stored latent cannot be read stops the encode (its pixels are zeros)."""
    from patches.core.data.latents import LatentCacheError

    f = decode_free
    got, _ = draw(f.ds, n=2)
    path = f.rows[0]["vision_path"]
    data = bytearray(open(path, "rb").read())
    data[4 * 8 * 8 * 3 + 5] ^= 1  # frame 4: in both windows
    open(path, "wb").write(bytes(data))
    with pytest.raises(LatentCacheError, match="no longer decodes to the pixels"):
        L.decode_cached(pack(got[0]))
    b = pack(got[1])
    lat = f.model._onecard_latents.store.entry_path(b[L.LATENT_FILE][0])
    lat.write_bytes(lat.read_bytes()[:-8] + bytes(8))
    with pytest.raises(LatentCacheError, match="not-decoded sample"):
        encode_batch(f.model, b)
