"""``miles_ext.levers.host_checkpoint``: the H3 checkpoint's state at world size 1 without a host copy, A/B against
torch's full-state paths on a 1-rank gloo FSDP2 model with CPU offload (no port: a ``FileStore``). Each test
names the bug it plants."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from patches.core.runtime import to_local


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

    from miles_ext.levers.host_checkpoint import host_full_state

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

    from miles_ext.levers.host_checkpoint import host_full_state, load_host_state
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
        monkeypatch.setattr("miles_ext.levers.host_checkpoint.RELEASE_EVERY_BYTES", 5 << 19)  # chunks inside the loop and a last one
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

    from miles_ext.levers.host_checkpoint import host_full_state, load_host_state

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
