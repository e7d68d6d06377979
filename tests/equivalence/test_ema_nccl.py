"""Lever 1 over NCCL: 2 ranks on 2 GPUs, uneven shards, equal the one-GPU run bit for bit.

The CPU suite proves world sizes 1, 2 and 3 over gloo (``test_ema_multirank.py``); this is the same
claim over NCCL with CUDA tensors, FSDP2 without offload, and the lever's real CUDA path (side-stream
D2H copy gated on an event, host lerp on the worker thread). The toy network and its dyadic loss are
``test_ema_multirank``'s, so the gradients are exact at any world size and a difference is the EMA's.
Skipped without two GPUs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from cosmos_framework_ext.levers.ema import EMA, power_ema_beta
from patches.core.runtime import free_port

from .test_ema_multirank import GAMMA, SHAPES, STEPS, TRAINABLE, Toy, coefficients

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")


def _train(model, opt, emas, device) -> None:
    for step in range(STEPS):
        model({k: v.to(device) for k, v in coefficients(step).items()}).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for e in emas:
            e.step(power_ema_beta(step, GAMMA))


def _make(device, mesh=None):
    model = Toy(0).to(device)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.95), eps=1e-6)
    return model, opt


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        mesh = init_device_mesh("cuda", (world,))
        model, opt = _make(device, mesh)
        emas = [EMA(model, placement="device"), EMA(model, placement="cpu_subset", trainable=TRAINABLE)]
        emas[1].attach_optimizer(opt)
        _train(model, opt, emas, device)
        got = {e.placement: e.full_state_dict()["shadow"] for e in emas}
        got["net"] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in model.state_dict().items()}
        torch.save(got, f"{out}/rank{rank}.pt")
        if rank == 0:  # the one-GPU reference, no FSDP, no collectives
            ref_model, ref_opt = _make(device)
            ref = [EMA(ref_model, placement="device"), EMA(ref_model, placement="cpu_subset", trainable=TRAINABLE)]
            ref[1].attach_optimizer(ref_opt)
            _train(ref_model, ref_opt, ref, device)
            want = {e.placement: e.state_dict()["shadow"] for e in ref}
            want["net"] = {k: v.detach().cpu() for k, v in ref_model.state_dict().items()}
            torch.save(want, f"{out}/reference.pt")
            ref[1].close()
        emas[1].close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    import torch.multiprocessing as mp

    d = tmp_path_factory.mktemp("ema_nccl")
    mp.start_processes(_rank, args=(2, free_port(), str(d)), nprocs=2, join=True, start_method="spawn")
    return d


def test_two_gpus_over_nccl_equal_one_gpu_bit_exact_with_global_shapes(out):
    want = torch.load(out / "reference.pt", weights_only=False)
    for rank in (0, 1):
        got = torch.load(out / f"rank{rank}.pt", weights_only=False)
        for part in ("net", "device", "cpu_subset"):
            for k, v in want[part].items():
                g = got[part][k]
                assert g.shape == v.shape, (rank, part, k, g.shape, v.shape)
                assert torch.equal(g.cpu().float(), v.cpu().float()), (rank, part, k)
    assert tuple(want["cpu_subset"]["a.weight"].shape) == SHAPES["a.weight"]
