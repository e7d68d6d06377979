"""Small process facts every trainer and lever reports: units, host RSS, ranks, shards, medians, ports.

Sharded tensors: :func:`to_local` (this rank's shard), :func:`shard_of` (a full tensor sliced to this rank's
shard, no collective) and :func:`as_dtensor` (a shard as a DTensor with its global shape, for gathers and DCP).
"""

from __future__ import annotations

import hashlib
import os
from typing import Sequence

import torch

from .ports import free_port, port_in_use  # noqa: F401 - re-exported (their home is torch-free)
from .units import GiB  # noqa: F401 - re-exported (its home is torch-free)


def host_rss() -> int:
    """Resident set size of this process, bytes (``psutil``)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


CGROUP = "/sys/fs/cgroup"
"""Where a cgroup v2 memory limit is read (:func:`host_available`)."""


def host_available(cgroup: str = CGROUP) -> int:
    """Host memory a new allocation can take, bytes: ``psutil.virtual_memory().available`` (Linux's ``MemAvailable``),
    or less where this process's cgroup v2 limit leaves less (``memory.max - memory.current`` under ``cgroup``; a
    container's or a batch job's limit, which ``MemAvailable`` does not see)."""
    import psutil

    free = int(psutil.virtual_memory().available)
    try:
        with open(os.path.join(cgroup, "memory.max")) as fh:
            limit = fh.read().strip()
        with open(os.path.join(cgroup, "memory.current")) as fh:
            used = int(fh.read().strip())
    except (OSError, ValueError):
        return free
    if limit == "max" or not limit.isdigit():
        return free
    return max(0, min(free, int(limit) - used))


def agree_max(value: int, device: torch.device | str = "cpu") -> int:
    """The largest ``value`` over the ranks of the default process group (an all-reduce), or ``value`` itself without
    one or at one rank: ranks that must reach one verdict from numbers each reads for itself (its host's free memory,
    a non-finite loss it saw). ``device``: where the collective's tensor lives (the rank's GPU under NCCL)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def proc_status_kib(fields: tuple[str, ...] = ("VmLck", "VmPin", "VmRSS", "VmHWM")) -> dict[str, int]:
    """``fields`` of ``/proc/self/status`` in KiB (``VmHWM``: peak RSS; ``VmLck``/``VmPin``: locked pages) (0 for a field the kernel does not report, or off Linux)."""
    out = {f: 0 for f in fields}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in out:
                    out[key] = int(rest.split()[0])
    except OSError:
        pass
    return out


def rank_world() -> tuple[int, int, int]:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` from the environment ``torchrun`` sets (``(0, 1, 0)`` outside it)."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def group_moves_host_tensors(group=None) -> bool:
    """Whether ``group``'s backend (default: the world's) can run collectives on CPU tensors (gloo or MPI, alone or
    as ``cpu:gloo,cuda:nccl``); ``False`` for a CUDA-only group such as plain NCCL."""
    backend = str(torch.distributed.get_backend(group)).lower()
    return "gloo" in backend or "mpi" in backend


def to_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (``t.to_local()``), or ``t`` itself for a plain tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def median(xs: Sequence[float]) -> float | None:
    """The upper median of ``xs`` (an element of it, no interpolation), or ``None`` when empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[len(s) // 2]


def shard_of(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's shard of ``full`` as a DTensor on ``mesh`` with ``placements`` holds it, sliced locally.

    ``full`` is the whole (global) tensor on every rank; the slice is what ``to_local()`` of that DTensor
    gives, uneven splits included (dim 0 of 7 on 2 ranks: 4 and 3 rows; of 1: 1 and 0). No collective runs,
    so ranks may call it for different tensors. ``full`` itself when ``mesh`` is ``None`` (not sharded).
    """
    if mesh is None:
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tuple(full.shape), mesh, placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def as_dtensor(local: torch.Tensor, mesh, placements, shape, stride):
    """``local`` (this rank's shard) as a DTensor on ``mesh`` with ``placements`` and the *global* ``shape``/``stride``.

    ``DTensor.from_local`` without the global shape infers it from the local one, which is wrong for uneven
    shards (a dim 0 the world size does not divide, an empty shard): ranks then disagree on the size (gloo's
    "Received data size doesn't match expected size", DCP's "overlapping chunks"). Pass the parameter's
    ``p.shape`` and ``p.stride()``.
    """
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.to(mesh.device_type), mesh, placements, shape=torch.Size(shape),
                              stride=tuple(stride))


def host_dtensor_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor with ``like``'s spec (mesh, placements, global shape and stride) when ``like`` is a
    DTensor, else ``local`` itself. No data moves: ``local`` may live on the host while the mesh is CUDA (a
    CPU-offloaded FSDP2 parameter's optimizer state), where ``DTensor.from_local`` would copy it to the mesh's device.
    """
    if not hasattr(like, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


def stable_hash(*parts: object) -> int:
    """A process-independent 63-bit hash of ``parts`` (upstream ``utils/hash_utils.stable_hash``).

    blake2b with an 8-byte digest, read as an unsigned integer and masked to 63 bits so it is a valid
    ``torch.Generator.manual_seed`` / int64 value. Guessed detail (the upstream file was not readable): the
    parts are serialised as ``str(part)`` joined by ``"|"`` and encoded UTF-8, and the digest is read
    big-endian. Only self-consistency matters for the 1-GPU == N-GPU proofs.
    """
    data = "|".join(str(p) for p in parts).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") & ((1 << 63) - 1)
