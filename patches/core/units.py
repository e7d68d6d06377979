"""Units (torch-free, so that commands that run before a trainer can print memory figures)."""

from __future__ import annotations

GiB = float(2**30)
"""Bytes in one GiB (binary gigabyte, 2**30); every memory figure onecard prints is in GiB unless it says GB."""


def gib_or_mib(n: float) -> str:
    """Bytes as GiB with two decimals, or as MiB with one below 1 GiB (so that a small figure does not print as
    0.00 GiB)."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.1f} MiB"
