"""One setting, one door: the H3 residency setting is parsed and resolved by one function whichever door it comes
through; one device picker (``ONECARD_GPU_MEMORY_GIB``) serves both recipes; one latent cache, keyed by the source's
bytes, serves both recipes (a replaced clip of the same size and mtime is a miss)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from patches.core.errors import UserError


# ------------------------------------------------------------------ residency: every door calls the one resolver
@pytest.fixture()
def tiny_lora_model():
    from tests.equivalence.h3_tiny_run import make_lora_model

    return make_lora_model(seed=0)


def test_the_three_doors_parse_alike(capsys):
    from miles_ext.levers.residency import launcher_args
    from patches.core.flags import MILES_RESIDENT_BLOCKS, FlagError, parse_resident_blocks

    for raw, want in (("auto", "auto"), ("3", 3), ("none", None), ("", None), (" AUTO ", "auto")):
        assert parse_resident_blocks(raw, "--fsdp-resident-blocks") == want
        shown = MILES_RESIDENT_BLOCKS.value({"MILES_RESIDENT_BLOCKS": raw})
        assert (str(shown) or None) == (str(want) if want is not None else None)
    for bad in ("x", "-1", "1.5"):
        messages = []
        for call in (lambda: parse_resident_blocks(bad, "--fsdp-resident-blocks"),
                     lambda: MILES_RESIDENT_BLOCKS.value({"MILES_RESIDENT_BLOCKS": bad}),
                     lambda: launcher_args(bad, [], cuda=True)):
            with pytest.raises(FlagError) as e:
                call()
            messages.append(str(e.value).split(": ", 1)[1])
        assert len(set(messages)) == 1, messages  # the same rule, whatever door
    assert launcher_args(None, [], cuda=True) == ["--fsdp-cpu-offload", "--fsdp-resident-blocks", "auto"]
    assert launcher_args("none", [], cuda=True) == ["--fsdp-cpu-offload"]
    capsys.readouterr()
    assert launcher_args("4", [], cuda=False) == []
    assert "RESIDENT_BLOCKS=4 applies on a GPU only" in capsys.readouterr().err  # said, not silently dropped
    assert launcher_args("auto", [], cuda=False) == [] and capsys.readouterr().err == ""  # the default says nothing
    assert launcher_args(None, ["--fsdp-resident-blocks", "2"], cuda=True) == ["--fsdp-cpu-offload"]
    with pytest.raises(UserError, match="both given: keep one"):
        launcher_args("3", ["--fsdp-resident-blocks=2"], cuda=True)


def test_trainer_and_upstream_patch_resolve_through_the_same_function(tiny_lora_model, monkeypatch):
    from miles_ext.levers import residency
    from miles_ext.recipe.train import H3SFTConfig, H3SFTRecipe
    from miles_ext.upstream.patches import resident_indices

    calls = []
    real = residency.resolve_residency

    def spy(model, value, **kw):
        calls.append((value, kw["source"], kw["budget_bytes"]))
        return real(model, value, **kw)

    monkeypatch.setattr(residency, "resolve_residency", spy)
    no_split = ["MiniMaxH3TransformerBlock", "MiniMaxH3TokenRefinerBlock", "MiniMaxH3AdaLayerNormOut"]
    assert resident_indices(tiny_lora_model, no_split, "2") is not None
    recipe = H3SFTRecipe(H3SFTConfig(fsdp_cpu_offload=True, fsdp_resident_blocks="2"))
    recipe.resident_value, recipe.max_tokens, recipe.device = 2, 100, torch.device("cpu")
    monkeypatch.setenv("ONECARD_GPU_MEMORY_GIB", "12")
    indices = recipe._plan_residency(tiny_lora_model)
    assert [c[:2] for c in calls] == [("2", "MILES_RESIDENT_BLOCKS"), (2, "--fsdp-resident-blocks")]
    assert calls[1][2] == 12 * 2**30  # the trainer's auto budget is the capped card
    assert indices == resident_indices(tiny_lora_model, no_split, "2")


def test_a_count_above_the_blocks_is_refused_by_the_door_it_came_from(tiny_lora_model):
    from miles_ext.levers.residency import resolve_residency

    for source, shown in (("--fsdp-resident-blocks", "--fsdp-resident-blocks 99"),
                          ("MILES_RESIDENT_BLOCKS", "MILES_RESIDENT_BLOCKS=99")):
        with pytest.raises(UserError, match=f"^{shown} but this model has 4 FSDP blocks"):
            resolve_residency(tiny_lora_model, 99, source=source, budget_bytes=None, tokens=10)
    with pytest.raises(UserError, match="auto fills the GPU's memory and no GPU was found"):
        resolve_residency(tiny_lora_model, "auto", source="--fsdp-resident-blocks", budget_bytes=None, tokens=10)


# ------------------------------------------------------------------ one device picker
@pytest.mark.parametrize("raw", ["abc", "0", "-3", "nan", "inf", "1e999"])
def test_gpu_memory_cap_refuses_what_is_not_a_size(monkeypatch, raw):
    from patches.core.device import gpu_memory_cap_gib

    with pytest.raises(UserError, match="ONECARD_GPU_MEMORY_GIB=.* must be a number of GiB in"):
        gpu_memory_cap_gib(environ={"ONECARD_GPU_MEMORY_GIB": raw})


def test_gpu_memory_cap_within_the_card_and_the_budget_it_gives(monkeypatch):
    from patches.core.device import gpu_budget_bytes, gpu_memory_cap_gib, pick_device

    assert gpu_memory_cap_gib(environ={}) is None and gpu_memory_cap_gib(environ={"ONECARD_GPU_MEMORY_GIB": " "}) is None
    assert gpu_memory_cap_gib(24 * 2**30, {"ONECARD_GPU_MEMORY_GIB": "22.06"}) == 22.06
    with pytest.raises(UserError, match=r"in \(0, 24.00\]"):
        gpu_memory_cap_gib(24 * 2**30, {"ONECARD_GPU_MEMORY_GIB": "30"})
    if not torch.cuda.is_available():
        assert pick_device(0).type == "cpu"
        monkeypatch.setenv("ONECARD_GPU_MEMORY_GIB", "11")
        assert gpu_budget_bytes(torch.device("cpu")) == 11 * 2**30
        monkeypatch.delenv("ONECARD_GPU_MEMORY_GIB")
        assert gpu_budget_bytes(torch.device("cpu")) == 0


def test_both_trainers_pick_their_device_through_the_one_picker(monkeypatch):
    """The H3 trainer honours ONECARD_GPU_MEMORY_GIB as the Cosmos trainer does: a bad value is the same one line."""
    from miles_ext.recipe.train import H3SFTConfig, H3SFTRecipe

    monkeypatch.setenv("ONECARD_GPU_MEMORY_GIB", "-1")
    recipe = H3SFTRecipe(H3SFTConfig())
    recipe.gbs, recipe.micro_per_step = 8, 8
    with pytest.raises(UserError, match="ONECARD_GPU_MEMORY_GIB='-1' must be a number of GiB"):
        recipe._pick_device()


# ------------------------------------------------------------------ one latent cache, keyed by content
def test_h3_pairs_miss_when_a_clip_is_replaced_with_the_same_size_and_mtime(tmp_path, sample_dataset, monkeypatch):
    """The H3 pair cache keys on the clip's bytes: a replaced clip of the same size and modification time is a miss,
    never the old clip's latents (the old key, file size + mtime, served them)."""
    import shutil

    from miles_ext.recipe import data as h3data
    from miles_ext.recipe.presets import get_preset
    from patches.core.data import latents

    root = tmp_path / "ds"
    shutil.copytree(sample_dataset, root)
    jsonl = root / "train" / "video_dataset_file.jsonl"
    jsonl.write_text(jsonl.read_text().splitlines()[0] + "\n")  # one clip
    encoded = []

    class Fake(h3data.PairEncoder):
        def encode(self, rec, start, n, size):
            encoded.append(latents.file_sha256(rec.video_path))
            t = torch.full((2, 8), float(len(encoded)))
            return {"text": t, "video": t.reshape(1, 2, 2, 4), "audio": t[:1], "encoder": "fake"}

    monkeypatch.setattr(h3data, "PairEncoder", Fake)
    args = (get_preset("tiny"), torch.device("cpu"), root, tmp_path / "cache", 9, (16, 16), True)
    first, info1 = h3data.encode_pairs(*args, progress=False)
    again, info2 = h3data.encode_pairs(*args, progress=False)
    assert (info1["cache_misses"], info2["cache_hits"]) == (1, 1) and torch.equal(first[0].text, again[0].text)
    video = Path(h3data.rows.load_records(root)[0].video_path)
    st = video.stat()
    data = bytearray(video.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, other bytes (one bit inside the coded frames)
    video.write_bytes(bytes(data))
    os.utime(video, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the same modification time
    latents._FILE_SHA.clear()  # a new process: no memo
    third, info3 = h3data.encode_pairs(*args, progress=False)
    assert video.stat().st_size == st.st_size and video.stat().st_mtime_ns == st.st_mtime_ns
    assert info3["cache_misses"] == 1 and not torch.equal(third[0].text, first[0].text)
    assert encoded[0] != encoded[1]
