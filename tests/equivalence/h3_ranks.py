"""Spawned gloo ranks for the H3 proofs (``test_h3_*.py``): a CPU mesh and a forkserver launcher.

Ranks are real processes in a gloo group, started from a forkserver that imports torch/diffusers/PEFT once
(``spawn`` re-imports them per rank, ~9 s of CPU each, too slow for 15 ranks on 2 cores; ``fork`` of the test
process hangs). The forkserver is a fresh single-threaded interpreter, so forking it is safe. Every launch
rendezvouses on a free port (:func:`patches.core.runtime.free_port`), so proofs can run in parallel.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from typing import Any, Callable, Iterator

import torch

from tests.equivalence.h3_tiny_run import PRELOAD
from patches.core.runtime import free_port

__all__ = ["gloo_rank", "cpu_mesh", "launch", "launch_cuda", "cuda_results"]


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int) -> Iterator[None]:
    """This spawned process as ``rank`` of a gloo process group on ``127.0.0.1:port``, torn down on exit."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, args: tuple, group: bool) -> None:
    torch.set_num_threads(1)
    if not group:  # torchrun's environment only: ``fn`` (a trainer's main) makes and ends the group itself
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        fn(rank, world, *args)
        return
    with gloo_rank(rank, world, port):
        fn(rank, world, *args)


def cpu_mesh():
    """The gloo world as a CPU device mesh: these proofs compute on the CPU even on a machine with a GPU."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (torch.distributed.get_world_size(),))


def launch(fn: Callable[..., Any], world: int, *args: Any, group: bool = True) -> None:
    """``fn(rank, world, *args)`` in ``world`` processes joined by gloo (forkserver; see module docstring).
    ``fn`` must be a module-level function (its module is preloaded in the forkserver); results go through
    files. ``group=False``: each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT``) instead of a group, for a trainer that makes its own."""
    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(PRELOAD + [__name__, fn.__module__])
    # CPU proofs: hide any GPU from the forkserver (started here, with this environment) and so from every rank.
    # A forked rank must not touch CUDA, and on a GPU machine torch would (the default mesh, Adam's graph-capture
    # check), failing with "CUDA error: initialization error".
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        mp.start_processes(_entry, args=(fn, world, free_port(), args, group), nprocs=world, join=True,
                           start_method="forkserver")
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _cuda_entry(worker: Callable[..., Any], port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    try:
        worker(0, 1, out_dir)
    finally:
        torch.distributed.destroy_process_group()


def launch_cuda(worker: Callable[..., Any], out_dir: str) -> None:
    """``worker(0, 1, out_dir)`` in one spawned process, a one-rank ``cpu:gloo,cuda:nccl`` group on a free port
    (the CUDA proofs; ``worker`` is a module-level function). ``AssertionError`` when the process fails."""
    import torch.multiprocessing as mp

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    p = mp.get_context("spawn").Process(target=_cuda_entry, args=(worker, free_port(), out_dir))
    p.start()
    p.join()
    assert p.exitcode == 0, f"the CUDA worker exited with {p.exitcode}"


def cuda_results(tmp_path_factory, worker: Callable[..., Any], name: str) -> Any:
    """Run ``worker(0, 1, out_dir)`` through :func:`launch_cuda` in a fresh ``name`` folder and load what it saved
    there as ``cuda.pt`` (the CUDA proofs' module fixtures)."""
    out = tmp_path_factory.mktemp(name)
    launch_cuda(worker, str(out))
    return torch.load(out / "cuda.pt")
