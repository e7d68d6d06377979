"""Data and config fidelity: a caption longer than ``max_caption_tokens`` is cut *before* its
duration/fps/resolution suffix, never through it, and the trainer counts such captions; a ``WAN_VAE_PATH``
whose config has other ``latents_mean``/``latents_std`` than the preset trains with its own, and one whose
architecture differs is refused before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cosmos_framework_ext.recipe import data as datamod
from patches.core.data import rows
from cosmos_framework_ext.recipe import train
from cosmos_framework_ext.recipe.presets import build_vae, get_preset
from cosmos_framework_ext.recipe.vae import encode_latents

REPO = Path(__file__).resolve().parents[1]
TINY = get_preset("tiny")


@pytest.fixture(scope="module")
def records(sample_dataset):
    return rows.load_records(sample_dataset)


def test_long_caption_keeps_its_suffix_and_is_counted(records, tokenizer):
    src = datamod.SampleSource(records, tokenizer, TINY, max_caption_tokens=24, cfg_dropout=0.0)
    for i in (0, 20, 60):
        rec = records[i]
        for w in range(len(rec.windows)):
            _, ids = src._text(i, w, False)
            suffix = tokenizer.encode(datamod.caption_suffix(rec, rec.windows[w], src.size(i)), 99)
            caption = tokenizer.encode(rec.caption, 10_000)
            assert len(ids) == 24 and ids[-len(suffix):] == suffix  # the conditioning text survives whole
            assert ids[: 24 - len(suffix)] == caption[: 24 - len(suffix)]  # the caption's start, cut
        sample = src.sample(i, 0)  # what the loader hands the trainer: the same ids, counted as such
        assert sample.text_ids == src._text(i, src.choice(i, 0)[0], False)[1] and sample.und_tokens == 25
    assert src.truncated_captions() == len(records)  # every sample caption is longer than 24 tokens


def test_captions_that_fit_tokenise_exactly_as_before(records, tokenizer):
    """Caption ids + suffix ids are the ids of the whole text: nothing changes for a caption that fits."""
    src = datamod.SampleSource(records, tokenizer, TINY)  # 2048: every sample caption fits
    for i, rec in enumerate(records):
        for w in range(len(rec.windows)):
            for dropped in (False, True):
                text, ids = src._text(i, w, dropped)
                assert ids == tokenizer.encode(text, 2048)
    assert src.truncated_captions() == 0


def test_planted_bug_cutting_the_joined_text_loses_the_suffix(records, tokenizer):
    """Planted: the old rule (cut caption + suffix as one text) drops the suffix the test above requires."""
    rec = records[0]
    size = datamod.target_size(rec.width, rec.height, TINY)
    old = tokenizer.encode(datamod.caption_with_suffix(rec, rec.windows[0], size), 24)
    suffix = tokenizer.encode(datamod.caption_suffix(rec, rec.windows[0], size), 99)
    assert old[-len(suffix):] != suffix


# ------------------------------------------------------------------------------------------------ the VAE
def _saved_vae(tmp_path: Path, **config_changes) -> Path:
    """The tiny preset's VAE saved as a diffusers directory, its config edited by ``config_changes``."""
    torch.manual_seed(3)
    folder = tmp_path / "wan_vae"
    build_vae(TINY).save_pretrained(folder)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(config_changes)
    cfg_path.write_text(json.dumps(cfg))
    return folder


def test_vae_directory_trains_with_its_own_latent_statistics(tmp_path):
    mean = [0.25 * ((i % 5) - 2) for i in range(48)]
    std = [0.5 + 0.125 * (i % 4) for i in range(48)]
    folder = _saved_vae(tmp_path, latents_mean=mean, latents_std=std)
    assert train._check_vae_dir(str(folder), TINY)["latents_mean"] == mean

    vae = build_vae(TINY)  # what the trainer builds, then loads the directory into
    note = train._load_vae_weights(vae, str(folder))
    assert "differ from the preset's" in note
    assert list(vae.config.latents_mean) == mean and list(vae.config.latents_std) == std

    from diffusers import AutoencoderKLWan

    ref = AutoencoderKLWan.from_pretrained(folder).eval()
    video = torch.rand(1, 3, 5, 32, 64) * 2 - 1
    with torch.no_grad():
        mu = ref.encode(video).latent_dist.mean
        want = (mu - torch.tensor(mean).view(1, 48, 1, 1, 1)) * (1 / torch.tensor(std).view(1, 48, 1, 1, 1))
        got = encode_latents(vae, video)
        preset_stats = encode_latents(build_vae(TINY).requires_grad_(False), video)
    assert torch.equal(got, want)
    assert not torch.allclose(got, (mu - torch.tensor(TINY.vae["latents_mean"]).view(1, 48, 1, 1, 1))
                              / torch.tensor(TINY.vae["latents_std"]).view(1, 48, 1, 1, 1))
    assert preset_stats.shape == got.shape


@pytest.mark.parametrize("changes, needle", [
    ({"base_dim": 16}, "base_dim 16 (preset 'tiny': 8)"),
    ({"latents_std": [1.0] * 7}, "latents_std must list 48 numbers"),
    ({"_class_name": "AutoencoderKL"}, "holds a AutoencoderKL, not an AutoencoderKLWan"),
], ids=["architecture", "stats-length", "class"])
def test_a_vae_that_does_not_fit_the_preset_is_one_error(tmp_path, monkeypatch, capsys, sample_dataset, changes,
                                                         needle):
    folder = _saved_vae(tmp_path, **changes)
    monkeypatch.setenv("WAN_VAE_PATH", str(folder))
    monkeypatch.setenv("DATASET_PATH", str(sample_dataset))
    monkeypatch.setenv("OUTPUT_ROOT", str(tmp_path / "out"))
    rc = train.main(["--sft-toml", str(REPO / "toml" / "vision_sft_edge_24gb.toml"), "--validate-only"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert rc == 2 and len(err) == 1 and needle in err[0] and f"WAN_VAE_PATH={folder}" in err[0], err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- both, through the trainer
def test_trainer_counts_truncated_captions_and_uses_the_vae_config(tmp_path, monkeypatch, capsys, sample_dataset):
    import re

    mean = [0.0] * 48
    folder = _saved_vae(tmp_path, latents_mean=mean, latents_std=[2.0] * 48)
    text = (REPO / "toml" / "vision_sft_edge_24gb.toml").read_text()
    for key, value in {"max_caption_tokens": "30", "cpu_grad_accum_iter": "1", "cpu_max_sequence_length": "300"}.items():
        text, n = re.subn(rf"^{key}(\s*)=.*$", rf"{key}\g<1>= {value}", text, flags=re.M)
        assert n == 1
    toml = tmp_path / "recipe.toml"
    toml.write_text(text)
    for k, v in dict(WAN_VAE_PATH=str(folder), DATASET_PATH=str(sample_dataset), OUTPUT_ROOT=str(tmp_path / "out"),
                     COSMOS_EMA_CPU_SUBSET="1", COSMOS_VAE_CPU_OFFLOAD="1").items():
        monkeypatch.setenv(k, v)
    rc = train.main(["--sft-toml", str(toml), "--max-iter", "1", "--no-save"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    n = len(rows.load_records(sample_dataset))
    assert f"onecard: {n} of {n} captions are longer than max_caption_tokens 30" in out.out
    assert f"latents_mean/latents_std from {folder} (its latents_mean and latents_std differ" in out.out
    s = json.loads((tmp_path / "out" / "cosmos3" / "sft" / "vision_sft_edge_24gb" / "summary.json").read_text())
    assert s["captions_truncated"] == n

