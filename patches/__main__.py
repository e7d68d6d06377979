"""``python -m patches status``: which lever flags are on, and what they act on in this process.

Exit status 2 with an ``error:`` line when a flag holds a value it does not accept, ``COSMOS_FRAMEWORK_ROOT``
is not a checkout, or a patch target does not match the supported upstream commits.
"""

from __future__ import annotations

import argparse
import os
import sys

from .core import flags


def status() -> int:
    """Print the flags and, with ``COSMOS_FRAMEWORK_ROOT``, each patch target's state.

    Returns 0, or 2 when a flag holds a bad value, the root is not a checkout, or any target mismatches.
    """
    try:
        values = flags.read_all()
    except flags.FlagError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"rank {os.environ.get('RANK', '0')}: onecard lever flags")
    for f in flags.ALL_FLAGS:
        print(f"  {f.name}={_shown(f, values[f.name])}  {f.help}")
    code = _upstream_status(values, os.environ.get("COSMOS_FRAMEWORK_ROOT", ""))
    try:
        import torch

        from .core.host_arena import pinned_bytes_total

        cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        print(f"torch {torch.__version__}; GPU: {cuda}; pinned by onecard in this process: {pinned_bytes_total()} B")
    except ImportError:
        print("torch: not installed")
    return code


def _shown(flag: flags.Flag | flags.ChoiceFlag, value: bool | str) -> str:
    """How ``status`` prints a flag's value: 1/0 for a boolean, the word (or ``(unset)``) for a choice."""
    if isinstance(flag, flags.ChoiceFlag):
        return str(value) if value else f"(unset; accepts {'/'.join(flag.choices)})"
    return "1" if value else "0"


def _upstream_status(values: dict[str, bool | str], root: str) -> int:
    """Print what the patch table would do to the checkout at ``root``; 2 if anything does not match."""
    if not root:
        print("target: embedded reference trainer (levers built in; no upstream patched)")
        return 0
    if not os.path.isdir(os.path.join(root, "cosmos_framework")):
        print(f"error: COSMOS_FRAMEWORK_ROOT={root} is not a cosmos-framework checkout (no cosmos_framework/ in "
              "it): point it at your checkout, or unset it for the embedded trainer", file=sys.stderr)
        return 2
    sys.path.insert(0, root)
    from .cosmos_table import patch_set
    from .guard import UpstreamMismatch

    ps = patch_set()
    print(f"target: upstream checkout {root} ({ps.supported} supported)")
    mismatches = 0
    for p in ps.patches:
        try:
            p.check(ps.supported)
            off = f"{p.flag.name} unset" if isinstance(p.flag, flags.ChoiceFlag) else f"{p.flag.name}=0"
            state = "ok, would be patched" if values[p.flag.name] else f"ok, left alone ({off})"
        except UpstreamMismatch as e:
            state = f"MISMATCH: {e}"
            mismatches += 1
        print(f"  {p.name:<28} {p.target}: {state}")
    print("  (each rank prints what it patched when the launcher starts it through python -m patches.run)")
    if mismatches:
        print(f"error: {mismatches} patch target(s) do not match this checkout: check out a supported commit "
              f"({ps.supported})", file=sys.stderr)
        return 2
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
