"""``miles_ext.train --fsdp-resident-blocks auto|N --gpu-budget-gib G`` (partial residency, issue 14 item 3) on the
CPU, tiny preset: the flags reach ``apply_fsdp2(resident=..., adapters_on_device=True)``, ``auto`` prints its count
and terms, the LoRA trained equals the all-resident and the fully offloaded run's bitwise (on the CPU every mode's
AdamW runs on the CPU: the placement is the same), and each bad value is one ``error:`` line.

Runs in this process (``miles_ext.train.main``) on a 2-row copy of the sample dataset, one optimizer step of two
micro-batches each, so the file stays well under 30 s; the launcher path is covered by ``tests/test_h3_train.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from miles_ext.train import main
from patches.core.runtime import to_local

STEP = ["--preset", "tiny", "--rollout-batch-size", "2", "--num-steps-per-rollout", "1", "--from-gpus", "1",
        "--fsdp-master-dtype", "bf16"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 2-row DATASET_PATH cut from the sample dataset, and a latent cache shared by the runs of this file."""
    from cosmos_framework_ext import data as cdata
    from cosmos_framework_ext.presets import get_preset

    src = cdata.prepare_sample_dataset(cdata.default_sample_dataset_root(get_preset("edge")), get_preset("edge"))
    root = tmp_path_factory.mktemp("ds")
    rows = (src / cdata.JSONL_RELPATH).read_text().splitlines()[:2]
    (root / cdata.JSONL_RELPATH).parent.mkdir(parents=True)
    (root / cdata.JSONL_RELPATH).write_text("\n".join(rows) + "\n")
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
    assert "--fsdp-resident-blocks auto: 4 of 4 blocks resident;" in outs["auto"]
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
    assert s["resident"]["loss_per_step"] == s["partial1"]["loss_per_step"] == s["offload"]["loss_per_step"]


@pytest.mark.parametrize("extra, needle", [
    (["--fsdp-cpu-offload", "--fsdp-resident-blocks", "-1"], "use auto or a whole number"),
    (["--fsdp-cpu-offload", "--fsdp-resident-blocks", "half"], "use auto or a whole number"),
    (["--fsdp-cpu-offload", "--fsdp-resident-blocks", "5"], "has 4 FSDP blocks (1 MiniMaxH3TokenRefinerBlock, 2 MiniMaxH3TransformerBlock"),
    (["--fsdp-resident-blocks", "1"], "add --fsdp-cpu-offload"),
    (["--fsdp-cpu-offload", "--fsdp-resident-blocks", "auto"], "no GPU was found: pass --gpu-budget-gib"),
    (["--fsdp-cpu-offload", "--fsdp-resident-blocks", "auto", "--gpu-budget-gib", "0"], "must be a finite number > 0"),
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



def test_one_rank_checkpoint_state_is_taken_without_a_gather(tmp_path, monkeypatch):
    """At world size 1 the checkpoint's LoRA and AdamW state are the shards themselves: equal to the gathered
    full state, sharing the optimizer's memory, with no gather called. On the H200 the gather sent every
    CPU-offloaded moment to the GPU and back, a host copy that lifted the 33 B save to 76.9 GB (target 75).
    Planted: the full-state path (``_gather_state_dict``) is what fails here."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as dsd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from miles_ext.train import host_full_state

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        for unit in (*model, model):
            fully_shard(unit, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        lora = dict(model.named_parameters())
        gathered = dsd.get_optimizer_state_dict(model, opt, options=dsd.StateDictOptions(full_state_dict=True,
                                                                                           cpu_offload=True))

        def no_gather(*args, **kwargs):
            raise AssertionError("gathered at world size 1")

        monkeypatch.setattr(dsd, "_gather_state_dict", no_gather)
        monkeypatch.setattr(DTensor, "full_tensor", no_gather)
        full, optimizer = host_full_state(model, opt, lora)
        assert optimizer["param_groups"] == gathered["param_groups"]
        assert optimizer["state"].keys() == gathered["state"].keys()
        for k, v in gathered["state"].items():
            for n, t in v.items():
                got = optimizer["state"][k][n]
                assert type(got) is torch.Tensor and torch.equal(got, t), (k, n)
        shards = {to.to_local().data_ptr() for st in opt.state.values() for to in (st["exp_avg"], st["exp_avg_sq"])}
        assert {t.data_ptr() for v in optimizer["state"].values() for n, t in v.items() if n != "step"} <= shards
        assert all(type(t) is torch.Tensor and torch.equal(t, p.to_local()) for (k, t), p in
                   zip(full.items(), lora.values()))
    finally:
        dist.destroy_process_group()


def file_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) >= 6 and head[5] == str(path)
        elif inside and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_one_rank_resume_holds_each_moment_once(tmp_path, monkeypatch):
    """At world size 1 a resume copies each saved AdamW moment (``torch.load(mmap=True)``) into the optimizer's
    state and drops the file's pages once copied, and the LoRA pages once copied into the parameters: the host
    holds the state once, as from scratch, and training continues bitwise as if never stopped. On the H200 the
    full-state load path sent each host moment to the GPU and copied it back (33 B resume: 80.9 GB against
    74.2 GB from scratch). Planted: that path (``set_optimizer_state_dict``) fails here, and so do file pages
    left resident."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as dsd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from miles_ext.train import host_full_state, load_host_state
    from patches.core.io import atomic_torch_save, release_file_pages

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def build():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))
            for unit in (*model, model):
                fully_shard(unit, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
            return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

        def step(model, opt, seed):
            torch.manual_seed(seed)
            model(torch.randn(2, 512)).sum().backward()
            opt.step()
            opt.zero_grad()

        ref, ref_opt = build()
        step(ref, ref_opt, 1)
        lora, optimizer = host_full_state(ref, ref_opt, dict(ref.named_parameters()))
        atomic_torch_save({"lora": lora, "optimizer": optimizer}, tmp_path / "ck.pt")
        step(ref, ref_opt, 2)

        model, opt = build()
        ck = torch.load(tmp_path / "ck.pt", mmap=True, weights_only=False)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.to_local().copy_(ck["lora"][n])
                release_file_pages([ck["lora"][n]])

        def full_path(*args, **kwargs):
            raise AssertionError("full-state load path at world size 1")

        monkeypatch.setattr(dsd, "set_optimizer_state_dict", full_path)
        monkeypatch.setattr("miles_ext.train.RELEASE_EVERY_BYTES", 5 << 19)  # chunks inside the loop and a last one
        load_host_state(model, opt, dict(model.named_parameters()), ck["optimizer"])
        moments = sum(t.numel() * 4 for st in opt.state.values() for k, t in st.items() if k != "step")
        assert moments > 3 << 20 and file_rss(tmp_path / "ck.pt") < 64 << 10  # edges of pages only
        step(model, opt, 2)
        for (n, a), b in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(a.to_local(), b.to_local()), n
        for a, b in zip(ref_opt.state.values(), opt.state.values()):
            assert all(torch.equal(to_local(a[k]), to_local(b[k])) for k in ("step", "exp_avg", "exp_avg_sq"))
    finally:
        dist.destroy_process_group()


def test_one_rank_resume_takes_the_full_path_for_other_groups_or_shapes(tmp_path, monkeypatch):
    """The in-place load (``load_host_state`` at world size 1) is taken only for a checkpoint of the same groups
    and the parameters' shapes; otherwise torch's full-state path decides. Two saved groups over the one group of
    this optimizer loaded as the saved two (``ValueError: loaded state dict has a different number of parameter
    groups``), and a ``(1, n)`` moment saved for an ``(m, n)`` parameter was broadcast by ``copy_`` without a word.
    A section without one tensor's state is refused there (in place it would start that tensor's moments afresh).
    Planted: both checks dropped (the ValueError, and the fast path taken for the bad shape)."""
    import copy

    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as dsd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from miles_ext.train import host_full_state, load_host_state

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def build(groups):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
            for unit in (*model, model):
                fully_shard(unit, mesh=mesh)
            ps = list(model.parameters())
            opt = torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "lr": 5e-3}] if groups == 2 else ps,
                                    lr=1e-2)
            return model, opt

        ref, ref_opt = build(2)
        ref(torch.randn(2, 8)).sum().backward()
        ref_opt.step()
        _, two_groups = host_full_state(ref, ref_opt, dict(ref.named_parameters()))
        two_groups = copy.deepcopy(two_groups)
        full_path = []
        real = dsd.set_optimizer_state_dict
        monkeypatch.setattr(dsd, "set_optimizer_state_dict", lambda *a, **k: full_path.append(1) or real(*a, **k))

        model, opt = build(1)
        load_host_state(model, opt, dict(model.named_parameters()), copy.deepcopy(two_groups))
        assert full_path and len(opt.param_groups) == 1
        for a, b in zip(ref_opt.state.values(), opt.state.values()):
            assert all(torch.equal(to_local(a[k]), to_local(b[k])) for k in ("step", "exp_avg", "exp_avg_sq"))

        model, opt = build(2)
        full_path.clear()
        load_host_state(model, opt, dict(model.named_parameters()), copy.deepcopy(two_groups))
        assert not full_path  # the matching checkpoint: in place
        bad = copy.deepcopy(two_groups)
        bad["state"]["0.weight"]["exp_avg"] = bad["state"]["0.weight"]["exp_avg"][:1]  # (1, 8) for (8, 8)
        model, opt = build(2)
        try:
            load_host_state(model, opt, dict(model.named_parameters()), bad)
        except RuntimeError:
            pass  # torch's path may refuse it at once
        assert full_path
        missing = copy.deepcopy(two_groups)
        del missing["state"]["1.bias"]  # fresh moments for one tensor would be silent: torch's path refuses
        model, opt = build(2)
        full_path.clear()
        with pytest.raises(Exception, match="1.bias"):
            load_host_state(model, opt, dict(model.named_parameters()), missing)
        assert full_path
    finally:
        dist.destroy_process_group()
