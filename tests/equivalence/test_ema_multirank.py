"""Lever 1 at world sizes 1, 2 and 3 with uneven shards: the EMA, its checkpoints and DCP are exact.

A toy network whose trainable parameters have a dim 0 the world size does not divide -- ``(7, 5)`` and
``(7,)`` (4 + 3 rows on 2 ranks, 3 + 3 + 1 on 3), ``(1,)`` (one rank holds it, the others an empty shard) --
plus a frozen ``(5, 2)`` and an even ``(6, 3)``, sharded by FSDP2 (CPU offload policy, gloo) per block and at
the root. Its loss is linear in the parameters with dyadic coefficients, so every rank count computes the
same gradients bit for bit (the mean over identical dyadic values is exact) and any difference is the EMA's.

One launch of 5 ranks (forkserver) forms two groups: ranks 0-1 (world size 2) and ranks 2-4 (world size 3).
Each group trains 6 steps with the two EMA placements and upstream's ``HostEmaWorker``, and at step 3 writes

- a full-state checkpoint (``EMA.full_state_dict`` gathered on every rank, net and optimizer full), and
- a DCP checkpoint through upstream's ``ModelWrapper.state_dict`` patch (``net.*`` + ``net_ema.*``),

then resumes each into a fresh, differently initialised model and finishes the 6 steps. The test compares
every rank's gathered state with a plain one-rank run (world size 1, no FSDP): global shapes, bit-exact.
NCCL on two GPUs is not covered here (no GPU on the CI machine).
"""

from __future__ import annotations

import multiprocessing
import os
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from cosmos_framework_ext.levers.ema import EMA, power_ema_beta, power_ema_gamma
from patches.core.runtime import free_port

GAMMA = power_ema_gamma(0.1)
STEPS, HALF = 6, 3
GROUPS = ([0, 1], [2, 3, 4])  # world size 2 and world size 3, in one launch of 5 ranks
SHAPES = {"a.weight": (7, 5), "a.bias": (7,), "b.w": (1,), "b.f": (6, 3), "b.frozen": (5, 2)}
TRAINABLE = ["a.weight", "a.bias", "b.w", "b.f"]


class _A(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(7, 5))
        self.bias = nn.Parameter(torch.randn(7))

    def forward(self, c: dict[str, torch.Tensor]) -> torch.Tensor:
        return (self.weight * c["a.weight"]).sum() + (self.bias * c["a.bias"]).sum()


class _B(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(1))
        self.f = nn.Parameter(torch.randn(6, 3))
        self.frozen = nn.Parameter(torch.randn(5, 2), requires_grad=False)
        self.register_buffer("steps_seen", torch.zeros(2))

    def forward(self, c: dict[str, torch.Tensor]) -> torch.Tensor:
        return (self.w * c["b.w"]).sum() + (self.f * c["b.f"]).sum() + self.frozen.sum() * 0.0


class Toy(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a = _A()
        self.b = _B()

    def forward(self, c: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.a(c) + self.b(c)


def coefficients(step: int) -> dict[str, torch.Tensor]:
    """Dyadic loss coefficients of ``step`` (multiples of 1/8 in [-2, 2]): exact gradients at any world size."""
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randint(-16, 17, SHAPES[n], generator=g).float() / 8 for n in TRAINABLE}


def make(seed: int, mesh=None) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Toy(seed)
    if mesh is not None:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        fully_shard(model.b, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.95),
                            eps=1e-6)
    return model, opt


def train(model, opt, emas, start: int, stop: int) -> None:
    for step in range(start, stop):
        model(coefficients(step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for e in emas:
            e(power_ema_beta(step, GAMMA))


def full_net(model) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
            for k, v in model.state_dict().items()}


def one_rank_reference() -> dict[str, dict[str, torch.Tensor]]:
    """World size 1, no FSDP: the net and both EMAs after STEPS steps."""
    model, opt = make(0)
    dev = EMA(model, placement="device")
    cpu = EMA(model, placement="cpu_subset", trainable=TRAINABLE)
    train(model, opt, [dev.step, cpu.step], 0, STEPS)
    out = {"net": full_net(model), "device": dev.state_dict()["shadow"], "cpu_subset": cpu.state_dict()["shadow"]}
    cpu.close()
    return out


# ------------------------------------------------------------------------------------------ the ranks
def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh

    from patches.core.checkpoint import gather_full_state, load_full_state

    from cosmos_framework_ext.upstream import patches as upstream

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        groups = [dist.new_group(g) for g in GROUPS]  # every rank creates every group, in the same order
        members = next(g for g in GROUPS if rank in g)
        group = groups[GROUPS.index(members)]
        ws, local = len(members), members.index(rank)
        mesh = DeviceMesh.from_group(group, "cpu")
        tag = f"w{ws}r{local}"

        def wrapper(model, worker):
            """Upstream's ModelWrapper as the DCP patches see it: ``net.*`` keys, ``model.net_ema_worker``."""
            inner = types.SimpleNamespace(net=model, net_ema_worker=worker)
            return types.SimpleNamespace(model=inner)

        sd_fn = upstream.patched_wrapper_state_dict(
            lambda self: {f"net.{k}": v for k, v in self.model.net.state_dict().items()})
        load_fn = upstream.patched_wrapper_load_state_dict(
            lambda self, sd: self.model.net.load_state_dict({k[4:]: v for k, v in sd.items() if k.startswith("net.")}))

        # ---- uninterrupted, with a full-state and a DCP checkpoint at HALF
        model, opt = make(0, mesh)
        dev = EMA(model, placement="device")
        cpu = EMA(model, placement="cpu_subset", trainable=TRAINABLE)
        worker = upstream.HostEmaWorker()
        emas = [dev.step, cpu.step, lambda b: worker.update_average(model, upstream.EmaPlaceholder(), b)]
        train(model, opt, emas, 0, HALF)
        # the core's full-state gather (the Cosmos trainer's); the optimizer on every rank: the world-3 mesh
        # does not hold global rank 0, where the trainer's copy lives
        net, optim = gather_full_state(model, opt, optimizer_on_every_rank=True)
        assert not _differ(net, full_net(model))
        ckpt = {"net": net, "ema": cpu.full_state_dict(), "optimizer": optim}
        # planted bug, recorded: the old call, DTensor.from_local without the global shape and stride
        from torch.distributed.tensor import DTensor

        p = dict(model.named_parameters())["a.weight"]
        ckpt["old_from_local_shape"] = tuple(DTensor.from_local(p.to_local(), mesh, p.placements).shape)
        torch.save(ckpt, f"{out}/{tag}.half.pt")  # every rank: each must hold the global shapes
        dcp.save(sd_fn(wrapper(model, worker)), checkpoint_id=f"{out}/dcp_w{ws}", process_group=group)
        train(model, opt, emas, HALF, STEPS)
        torch.save({"net": full_net(model), "device": dev.full_state_dict()["shadow"],
                    "cpu_subset": cpu.full_state_dict()["shadow"], "worker": worker.ema.full_state_dict()["shadow"]},
                   f"{out}/{tag}.straight.pt")
        cpu.close()
        worker.ema.close()

        # ---- resumed from the full-state checkpoint (full tensors sliced locally, no collective)
        model, opt = make(1, mesh)  # another init: everything must come from the checkpoint
        load_full_state(model, ckpt["net"], opt, ckpt["optimizer"])  # sliced locally: no rank-dependent collective
        cpu = EMA(model, placement="cpu_subset", trainable=TRAINABLE)
        assert cpu.load_state_dict(ckpt["ema"]) == len(TRAINABLE) and cpu.num_updates == HALF
        train(model, opt, [cpu.step], HALF, STEPS)
        torch.save({"cpu_subset": cpu.full_state_dict()["shadow"]}, f"{out}/{tag}.resumed.pt")
        cpu.close()

        # ---- resumed from DCP through upstream's load patch
        model, opt = make(2, mesh)
        load_full_state(model, ckpt["net"], opt, ckpt["optimizer"])
        worker = upstream.HostEmaWorker()
        w = wrapper(model, worker)
        template = sd_fn(w)
        dcp.load(template, checkpoint_id=f"{out}/dcp_w{ws}", process_group=group)
        load_fn(w, template)
        worker.ema.num_updates = HALF  # DCP carries no counter: upstream counts iterations itself
        train(model, opt, [lambda b: worker.update_average(model, upstream.EmaPlaceholder(), b)], HALF, STEPS)
        torch.save({"worker": worker.ema.full_state_dict()["shadow"], "net": full_net(model)},
                   f"{out}/{tag}.dcp.pt")
        worker.ema.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _launch(out: Path) -> None:
    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.fsdp", "cosmos_framework_ext.upstream.patches",
                                            __name__])
    world = sum(len(g) for g in GROUPS)
    mp.start_processes(_rank, args=(world, free_port(), str(out)), nprocs=world, join=True,
                       start_method="forkserver")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ema_multirank")
    _launch(out)
    return out


def _tags():
    return [f"w{len(g)}r{i}" for g in GROUPS for i in range(len(g))]


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ (shape or any bit); empty when ``a`` and ``b`` are identical."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


# ------------------------------------------------------------------------------------------- the proofs
def test_the_shapes_are_uneven_at_both_world_sizes():
    """The premise: dim 0 of 7 and of 1 does not split evenly over 2 or 3 ranks (one shard of (1,) is empty)."""
    for ws in (2, 3):
        chunks = [len(c) for c in torch.arange(7).chunk(ws)] + [0] * (ws - len(torch.arange(7).chunk(ws)))
        assert len(set(chunks)) > 1
        assert [len(c) for c in torch.arange(1).chunk(ws)] == [1]  # ranks 1.. get an empty shard


def test_full_state_on_every_rank_has_global_shapes_and_equals_one_rank(ranks):
    ref = one_rank_reference()
    for tag in _tags():
        got = torch.load(ranks / f"{tag}.straight.pt")
        assert not _differ(got["net"], ref["net"]), tag  # the dyadic loss trains identically at every world size
        assert all(tuple(got["net"][k].shape) == s for k, s in
                   {"a.weight": (7, 5), "a.bias": (7,), "b.w": (1,), "b.frozen": (5, 2)}.items())
        assert not _differ(got["cpu_subset"], ref["cpu_subset"]), tag
        assert not _differ(got["device"], ref["device"]), tag
        assert not _differ(got["worker"], ref["cpu_subset"]), tag  # upstream's HostEmaWorker: the same EMA
        half = torch.load(ranks / f"{tag}.half.pt")
        assert {k: tuple(v.shape) for k, v in half["ema"]["shadow"].items()} == \
            {k: tuple(v.shape) for k, v in ref["cpu_subset"].items()}, tag
    # and the EMA moved: a comparison that cannot fail would prove nothing
    assert not torch.equal(ref["cpu_subset"]["a.weight"], ref["net"]["a.weight"])


def test_full_state_checkpoint_load_then_continue_equals_uninterrupted(ranks):
    for tag in _tags():
        straight = torch.load(ranks / f"{tag}.straight.pt")
        resumed = torch.load(ranks / f"{tag}.resumed.pt")
        assert not _differ(resumed["cpu_subset"], straight["cpu_subset"]), tag


def test_dcp_entries_carry_global_shapes_and_resume_exactly(ranks):
    import torch.distributed.checkpoint as dcp

    for ws in (2, 3):
        meta = dcp.FileSystemReader(str(ranks / f"dcp_w{ws}")).read_metadata().state_dict_metadata
        for k, shape in SHAPES.items():
            assert tuple(meta[f"net_ema.{k}"].size) == shape, (ws, k)
            assert tuple(meta[f"net.{k}"].size) == shape, (ws, k)
            chunks = meta[f"net_ema.{k}"].chunks  # one per rank holding rows, none overlapping
            assert sum(c.sizes[0] for c in chunks) == shape[0], (ws, k, chunks)
    for tag in _tags():
        straight = torch.load(ranks / f"{tag}.straight.pt")
        got = torch.load(ranks / f"{tag}.dcp.pt")
        assert not _differ(got["worker"], straight["worker"]), tag
        assert not _differ(got["net"], straight["net"]), tag


def test_planted_bug_from_local_without_global_shape_disagrees_across_ranks(ranks):
    """Planted: the old ``DTensor.from_local(local, mesh, placements)`` infers the global size from the local
    shard, so the ranks of one mesh disagree on it -- what made gloo abort and DCP see overlapping chunks."""
    inferred = {tag: torch.load(ranks / f"{tag}.half.pt")["old_from_local_shape"] for tag in _tags()}
    assert [inferred[f"w2r{i}"] for i in range(2)] == [(8, 5), (6, 5)]
    assert [inferred[f"w3r{i}"] for i in range(3)] == [(9, 5), (9, 5), (3, 5)]
