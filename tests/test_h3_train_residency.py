"""``miles_ext.recipe.train --fsdp-resident-blocks auto|N --gpu-budget-gib G`` (partial residency) on the
CPU, tiny preset: the flags reach ``apply_fsdp2(resident=..., adapters_on_device=True)``, ``auto`` prints its count
and terms, the LoRA trained equals the all-resident and the fully offloaded run's bitwise (on the CPU every mode's
AdamW runs on the CPU: the placement is the same), and each bad value is one ``error:`` line.

Runs in this process (``miles_ext.recipe.train.main``) on a 2-row copy of the sample dataset, one optimizer step of two
micro-batches each, so the file stays well under 30 s; the launcher path is covered by ``tests/test_h3_train.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from miles_ext.recipe.train import main

STEP = ["--preset", "tiny", "--rollout-batch-size", "2", "--num-steps-per-rollout", "1", "--from-gpus", "1",
        "--fsdp-master-dtype", "bf16"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 2-row DATASET_PATH cut from the sample dataset, and a latent cache shared by the runs of this file."""
    from patches.core.data import sample_dataset
    from patches.core.data.rows import JSONL_RELPATH

    spec = sample_dataset.FULL_SIZE
    src = sample_dataset.prepare_sample_dataset(tmp_path_factory.mktemp("sd") / "sample_dataset", spec)
    root = tmp_path_factory.mktemp("ds")
    rows = (src / JSONL_RELPATH).read_text().splitlines()[:2]
    (root / JSONL_RELPATH).parent.mkdir(parents=True)
    (root / JSONL_RELPATH).write_text("\n".join(rows) + "\n")
    for row in rows:
        rel = json.loads(row)["video"]
        (root / "train" / rel).parent.mkdir(parents=True, exist_ok=True)
        if not (root / "train" / rel).exists():
            shutil.copy(src / "train" / rel, root / "train" / rel)
    return root, tmp_path_factory.mktemp("cache")


def train(small, out: Path, *extra: str, capsys=None) -> tuple[int, str, str]:
    root, cache = small
    os.environ.pop("MASTER_PORT", None)  # the previous run set it (its rendezvous): pick a free port again
    rc = main([*STEP, "--data-dir", str(root), "--cache-dir", str(cache), "--output-dir", str(out), *extra])
    captured = capsys.readouterr() if capsys is not None else None
    return rc, captured.out if captured else "", captured.err if captured else ""


def lora_of(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoints" / "iter_000000001.pt", weights_only=False)["lora"]


def test_partial_residency_trains_the_all_resident_lora_bitwise(small, tmp_path, capsys):
    modes = {
        "resident": [],
        "offload": ["--fsdp-cpu-offload"],
        "partial1": ["--fsdp-cpu-offload", "--fsdp-resident-blocks", "1"],
        "partial0": ["--fsdp-cpu-offload", "--fsdp-resident-blocks", "0"],
        "auto": ["--fsdp-cpu-offload", "--fsdp-resident-blocks", "auto", "--gpu-budget-gib", "64"],
    }
    outs = {}
    for name, extra in modes.items():
        rc, out, err = train(small, tmp_path / name, *extra, capsys=capsys)
        assert rc == 0, err[-3000:]
        outs[name] = out
    # auto: the count and its terms, printed; the tiny model fits a 64 GiB budget whole
    assert "residency auto: 4 of 4 blocks resident;" in outs["auto"]
    assert all(t in outs["auto"] for t in ("root", "adapters+grads+adamw", "activations", "reserve", "tokens"))
    assert "with 1 blocks resident" in outs["partial1"] and "with 0 blocks resident" in outs["partial0"]
    s = {n: json.loads((tmp_path / n / "summary.json").read_text()) for n in modes}
    assert [s[n]["fsdp_resident_blocks"] for n in modes] == [None, None, 1, 0, 4]
    assert s["auto"]["residency_plan_bytes"]["resident_blocks"] > 0 and s["partial1"]["residency_plan_bytes"] is None
    assert {x["optimizer_device"] for x in s.values()} == {"cpu"}  # same placement on the CPU
    # a checkpoint holds its tensors, not the storage they view: under offload the adapters live in the pinned
    # arena, and torch.save writes a view's whole storage (the 33 B save wrote 68.4 GB of arena on the H200)
    for n in modes:
        ckpt = tmp_path / n / "checkpoints" / "iter_000000001.pt"
        blob = torch.load(ckpt, weights_only=False)
        held = sum(t.numel() * t.element_size() for t in blob["lora"].values())
        held += sum(t.numel() * t.element_size() for st in blob["optimizer"]["state"].values()
                    for t in st.values() if torch.is_tensor(t))
        assert ckpt.stat().st_size < held + (64 << 10), (n, ckpt.stat().st_size, held)
    # partial residency streams what it does not keep: the arena holds the streamed blocks' shards only
    req = {n: s[n]["pinned_fsdp_requested_vs_locked"]["requested"] for n in ("partial1", "partial0", "offload")}
    assert 0 < req["partial1"] < req["partial0"] < req["offload"]  # a resident block and the adapters stay off it
    ref = lora_of(tmp_path / "resident")
    for name in modes:
        got = lora_of(tmp_path / name)
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), name
    assert s["resident"]["losses"] == s["partial1"]["losses"] == s["offload"]["losses"]


@pytest.mark.parametrize("extra, needle", [
    (["--fsdp-cpu-offload", "--fsdp-resident-blocks", "-1"], "use auto, a whole number"),
    (["--fsdp-cpu-offload", "--fsdp-resident-blocks", "half"], "use auto, a whole number"),
    (["--fsdp-cpu-offload", "--fsdp-resident-blocks", "5"], "has 4 FSDP blocks (1 MiniMaxH3TokenRefinerBlock, 2 MiniMaxH3TransformerBlock"),
    (["--fsdp-resident-blocks", "1"], "add --fsdp-cpu-offload"),
    (["--fsdp-cpu-offload", "--fsdp-resident-blocks", "auto"], "no GPU was found: pass --gpu-budget-gib"),
    (["--fsdp-cpu-offload", "--fsdp-resident-blocks", "auto", "--gpu-budget-gib", "0"], "--gpu-budget-gib = 0.0 must be > 0"),
    (["--fsdp-cpu-offload", "--gpu-budget-gib", "40"], "add --fsdp-resident-blocks auto"),
    (["--fsdp-cpu-offload", "--fsdp-resident-blocks", "auto", "--gpu-budget-gib", "1"],
     "is below what streaming every block needs"),
], ids=["negative", "not-a-number", "more-than-blocks", "without-offload", "auto-without-gpu", "budget-zero",
        "budget-without-auto", "budget-too-small"])
def test_bad_residency_flags_are_one_error_line(small, tmp_path, capsys, extra, needle):
    rc, _, err = train(small, tmp_path / "out", *extra, capsys=capsys)
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and needle in lines[0], err[-2000:]
    assert not (tmp_path / "out" / "checkpoints").exists()
