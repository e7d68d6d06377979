"""A micro-batch's host inputs built on a loader thread train exactly what the main thread's train.

With the latent cache (lever 4) the embedded trainer builds each packed micro-batch's host inputs -- the seeded
sigmas and noise (pinned on a GPU), the mRoPE positions, timesteps and segment indices
(:func:`~cosmos_framework_ext.recipe.attention.host_layout`) -- on the loader threads that read the latents, one
or two micro-batches ahead, so the main thread only launches work (:meth:`CosmosSFT._host_inputs`). Each is built
for the (iteration, micro-batch) of its place in the run; the main thread uses it only for that key and rebuilds
any other.

- **Exact, CPU:** the tiny recipe (4 optimizer steps, EMA, checkpoint) with the inputs built ahead equals the
  anchor, the same run with every micro-batch's inputs built on the main thread (``prepare_ahead = False``, the
  path before this change): every step's loss and every checkpoint tensor ``torch.equal``. Every micro-batch
  took its inputs from a thread.
- **Resume:** 2 steps, then a second process resumes to 4: the checkpoint equals the straight run's, and the
  resumed process also built every micro-batch's inputs ahead (its keys start at the checkpoint's place).

- **Each micro-batch's own inputs** (an anchor outside the trainer's path): the sigmas and the noise the
  micro-batch trains on are the seeded draws of its (iteration, micro-batch), in its samples' order; the model's
  input is ``(1 - s) x0 + s eps`` and the target ``eps - x0`` of each sample, computed here by hand; and the layout
  it uses equals one built afresh from those sigmas, its text ids, latent shapes and fps.

Planted: keys counted from 0 in the resumed process (not from the micro-batches consumed) leaves every
micro-batch to the main thread; a thread that draws the next micro-batch's noise under this one's key
breaks the equality.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cosmos_framework_ext.recipe import attention, train
from tests.test_train import env, run_main, small_toml  # noqa: F401 - env: the fixture (dataset, output root)


def _job(out: Path) -> Path:
    return out / "cosmos3" / "sft" / "vision_sft_edge_24gb"


def _toml(env_dir: Path) -> Path:
    """The small recipe at 2 micro-batches per step (so a key is (iteration, micro-batch), not the step alone), of
    several samples each (so a sample's own sigma and noise are told from another's)."""
    return small_toml(env_dir, **{"cpu_grad_accum_iter     = 1": "cpu_grad_accum_iter     = 2",
                                  "cpu_max_sequence_length = 300": "cpu_max_sequence_length = 600"})


def _run(env_dir: Path, monkeypatch, capsys, name: str, *extra: str) -> dict:
    monkeypatch.setenv("OUTPUT_ROOT", str(env_dir / name))
    monkeypatch.setenv("COSMOS_LATENT_CACHE", "1")
    monkeypatch.setenv("ONECARD_LATENT_CACHE", str(env_dir / "latents"))
    rc, _, err = run_main(["--sft-toml", str(_toml(env_dir)), *extra], capsys)
    assert rc == 0, err
    return json.loads((_job(env_dir / name) / "summary.json").read_text())


def _same_checkpoints(a: dict, b: dict) -> bool:
    x = torch.load(a["checkpoint"], map_location="cpu", weights_only=False)
    y = torch.load(b["checkpoint"], map_location="cpu", weights_only=False)
    return x["model"].keys() == y["model"].keys() and all(torch.equal(x["model"][k], y["model"][k]) for k in x["model"])


def _reference(env_dir, monkeypatch, capsys) -> dict:
    """The anchor: every micro-batch's host inputs built on the main thread."""
    with monkeypatch.context() as m:
        m.setattr(train.CosmosSFT, "prepare_ahead", False)
        ref = _run(env_dir, monkeypatch, capsys, "main-thread")
    assert ref["host_inputs_built"] == {"loader_threads": 0, "main_thread": 8}  # 4 steps x 2 micro-batches
    return ref


def test_inputs_built_ahead_train_the_same(env, monkeypatch, capsys):
    ref = _reference(env, monkeypatch, capsys)
    ahead = _run(env, monkeypatch, capsys, "ahead")
    assert ahead["host_inputs_built"] == {"loader_threads": 8, "main_thread": 0}
    assert min(ahead["samples_per_optimizer_step"]) >= 2 * 3  # several samples per micro-batch
    assert ahead["losses"] == ref["losses"] and _same_checkpoints(ahead, ref)


def test_a_resumed_run_builds_ahead_from_its_place(env, monkeypatch, capsys):
    straight = _run(env, monkeypatch, capsys, "straight")
    _run(env, monkeypatch, capsys, "resumed", "--max-iter", "2")
    resumed = _run(env, monkeypatch, capsys, "resumed")
    assert resumed["resumed_from"] == 2 and resumed["host_inputs_built"] == {"loader_threads": 4, "main_thread": 0}
    assert _same_checkpoints(straight, resumed)


def test_each_micro_batch_gets_its_own_draw_and_layout(env, monkeypatch, capsys):
    real_micro, real_build = train.CosmosSFT._micro_batch, attention.build_packed_inputs
    now, checked = {}, []

    def micro_batch(self, iteration, micro):
        now.update(seed=self.cfg.onecard.seed, key=(iteration, micro))
        return real_micro(self, iteration, micro)

    from tokenizers import Tokenizer

    from cosmos_framework_ext.recipe.data import CaptionTokenizer

    vocab = Tokenizer.from_file(str(CaptionTokenizer.default_tokenizer_file()))  # the markers' ids, read apart
    markers = [vocab.token_to_id(t) for t in ("[SEP]", "[unused0]", "[unused1]")]

    def build(model_config, text_ids, latents, sigmas, fps, device, **kw):
        assert all(ids[-3:] == markers for ids in text_ids)  # caption, then eos and the vision start/end markers
        shapes = [x.shape for x in latents]
        assert torch.equal(sigmas, train._sample_noise(now["seed"], *now["key"], shapes)[0])
        # the model's input, by hand: x_t = (1 - s) x0 + s eps per sample, then the model's dtype
        x0, eps = now["x0"].split(now["sizes"]), now["noise"].split(now["sizes"])
        for x, a, e, s in zip(latents, x0, eps, sigmas.tolist()):
            assert torch.equal(x.reshape(-1), ((1.0 - s) * a + s * e).to(x.dtype))
        fresh, given = attention.host_layout(model_config, text_ids, shapes, sigmas, fps), kw["layout"]
        assert given.shapes == fresh.shapes
        assert all(torch.equal(getattr(given, f), getattr(fresh, f))
                   for f in ("input_ids", "position_ids", "timesteps", "und_segments", "gen_segments"))
        checked.append(now["key"])
        return real_build(model_config, text_ids, latents, sigmas, fps, device, **kw)

    real_noising = train.packed_flow_matching_inputs

    def noising(x0, noise, sigmas, sizes):  # the noise each sample gets: its own seeded draw, in order
        draws = train._sample_noise(now["seed"], *now["key"], [torch.Size([n]) for n in sizes])[1]  # fills by size
        assert torch.equal(noise.cpu(), torch.cat(draws)) and x0.numel() == sum(sizes)
        now.update(x0=x0, noise=noise, sizes=sizes)
        return real_noising(x0, noise, sigmas, sizes)

    real_loss = train.micro_batch_loss

    def loss(preds, targets, scale, ga):  # the velocity targets, by hand: v = eps - x0 per sample
        assert torch.equal(torch.cat([t.reshape(-1) for t in targets]), now["noise"] - now["x0"])
        return real_loss(preds, targets, scale, ga)

    monkeypatch.setattr(train.CosmosSFT, "_micro_batch", micro_batch)
    monkeypatch.setattr(train, "packed_flow_matching_inputs", noising)
    monkeypatch.setattr(train, "micro_batch_loss", loss)
    monkeypatch.setattr(attention, "build_packed_inputs", build)
    s = _run(env, monkeypatch, capsys, "checked")
    assert s["host_inputs_built"] == {"loader_threads": 8, "main_thread": 0}
    assert checked == [(i, m) for i in range(4) for m in range(2)]


def test_planted_keys_counted_from_zero_after_a_resume_are_caught(env, monkeypatch, capsys):
    real = train.prefetched

    def from_zero(items, load, **kw):  # the bug: this process's position, not the run's
        return real(((i, batch) for i, (_, batch) in enumerate(items)), load, **kw)

    _run(env, monkeypatch, capsys, "resumed", "--max-iter", "2")
    monkeypatch.setattr(train, "prefetched", from_zero)
    resumed = _run(env, monkeypatch, capsys, "resumed")
    assert resumed["host_inputs_built"] != {"loader_threads": 4, "main_thread": 0}  # what the test above asserts


def test_planted_a_draw_for_the_next_micro_batch_breaks_the_equality(env, monkeypatch, capsys):
    ref = _reference(env, monkeypatch, capsys)
    real = train.CosmosSFT._host_inputs

    def next_draw(self, iteration, micro, batch, shapes):  # the bug: labelled (iteration, micro), drawn for micro + 1
        got = real(self, iteration, micro + 1, batch, shapes)
        got.key = (iteration, micro)
        return got

    monkeypatch.setattr(train.CosmosSFT, "_host_inputs", next_draw)
    planted = _run(env, monkeypatch, capsys, "planted")
    assert planted["losses"] != ref["losses"] or not _same_checkpoints(planted, ref)


@pytest.mark.parametrize("prepare_ahead", [True, False])
def test_without_the_latent_cache_the_main_thread_builds_them(env, monkeypatch, capsys, prepare_ahead):
    monkeypatch.setattr(train.CosmosSFT, "prepare_ahead", prepare_ahead)
    rc, _, err = run_main(["--sft-toml", str(_toml(env))], capsys)
    assert rc == 0, err
    s = json.loads((_job(env / "out") / "summary.json").read_text())
    assert s["host_inputs_built"] == {"loader_threads": 0, "main_thread": 8}
