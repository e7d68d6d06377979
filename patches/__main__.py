"""``python -m patches status``: which lever flags are on, and what they act on in this process.

Exit status 2 with one ``error:`` line when a flag holds a non-boolean value.
"""

from __future__ import annotations

import argparse
import os
import sys

from .core import flags


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
    if not root:
        print("target: embedded reference trainer (levers built in; no upstream patched)")
    elif not os.path.isdir(os.path.join(root, "cosmos_framework")):
        print(f"target: COSMOS_FRAMEWORK_ROOT={root} is not a cosmos-framework checkout (no cosmos_framework/ in it)")
    else:
        import sys as _sys

        _sys.path.insert(0, root)
        from .cosmos_table import patch_set
        from .guard import UpstreamMismatch

        ps = patch_set()
        print(f"target: upstream checkout {root} ({ps.supported} supported)")
        for p in ps.patches:
            try:
                p.check(ps.supported)
                state = "ok, would be patched" if values[p.flag.name] else f"ok, left alone ({p.flag.name}=0)"
            except UpstreamMismatch as e:
                state = f"MISMATCH: {e}"
            print(f"  {p.name:<28} {p.target}: {state}")
        print("  (each rank prints what it patched when the launcher starts it through python -m patches.run)")
    try:
        import torch

        from .core.host_arena import pinned_bytes_total

        cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        print(f"torch {torch.__version__}; GPU: {cuda}; pinned by onecard in this process: {pinned_bytes_total()} B")
    except ImportError:
        print("torch: not installed")
    return 0


def check() -> int:
    """Apply the patches in this (throwaway) process: 0 and the patched targets, or 2 and one error line."""
    from .guard import UpstreamMismatch
    from .run import apply_from_env

    try:
        patched = apply_from_env()
    except (flags.FlagError, UpstreamMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    why = "no lever flag set" if not any(flags.read_all().values()) else "no COSMOS_FRAMEWORK_ROOT: the embedded trainer has the levers built in"
    print("patched: " + (", ".join(patched) or f"nothing ({why})"))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m patches")
    ap.add_argument("command", choices=["status", "check"],
                    help="status: report flags and targets; check: apply the patches here and report (exit 2 on a mismatch)")
    args = ap.parse_args(argv)
    return status() if args.command == "status" else check()


if __name__ == "__main__":
    sys.exit(main())
