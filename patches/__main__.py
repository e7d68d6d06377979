"""``python -m patches status``: which lever flags are on, and what they act on in this process.

Exit status 2 with one ``error:`` line when a flag holds a non-boolean value.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import flags


def status() -> int:
    try:
        values = flags.read_all()
    except flags.FlagError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rank = os.environ.get("RANK", "0")
    print(f"rank {rank}: onecard lever flags")
    for f in flags.ALL_FLAGS:
        print(f"  {f.name}={'1' if values[f.name] else '0'}  {f.help}")
    root = os.environ.get("COSMOS_FRAMEWORK_ROOT", "")
    target = f"upstream checkout {root} (not driven by this version)" if root else "embedded reference trainer"
    print(f"target: {target}")
    try:
        import torch

        from .host_arena import pinned_bytes_total

        cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        print(f"torch {torch.__version__}; GPU: {cuda}; pinned by onecard in this process: {pinned_bytes_total()} B")
    except ImportError:
        print("torch: not installed")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m patches")
    ap.add_argument("command", choices=["status"], help="status: report flags and targets")
    ap.parse_args(argv)
    return status()


if __name__ == "__main__":
    sys.exit(main())
