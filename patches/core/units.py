"""Units (torch-free, so that commands that run before a trainer can print memory figures)."""

from __future__ import annotations

GiB = float(2**30)
"""Bytes in one GiB (binary gigabyte, 2**30); every memory figure onecard prints is in GiB unless it says GB."""
