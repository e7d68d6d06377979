"""Small process facts every trainer and lever reports: units, host RSS, ranks, shards, medians, ports."""

from __future__ import annotations

import os
import socket
from typing import Sequence

import torch

GiB = float(2**30)
"""Bytes in one GiB (binary gigabyte, 2**30); every memory figure onecard prints is in GiB unless it says GB."""


def host_rss() -> int:
    """Resident set size of this process, bytes (``psutil``)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def rank_world() -> tuple[int, int, int]:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` from the environment ``torchrun`` sets (``(0, 1, 0)`` outside it)."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def to_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (``t.to_local()``), or ``t`` itself for a plain tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def median(xs: Sequence[float]) -> float | None:
    """The upper median of ``xs`` (an element of it, no interpolation), or ``None`` when empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[len(s) // 2]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it back, close).

    For a one-node rendezvous and for tests run in parallel: never hard-code a port.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something is already bound to ``host:port`` (a bind attempt fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False
