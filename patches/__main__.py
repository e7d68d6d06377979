"""``python -m patches status``: which lever flags are on, and what they act on in this process.

Both upstreams are reported: cosmos-framework's flags and, with ``COSMOS_FRAMEWORK_ROOT``, its patch targets;
miles-diffusion's flags and, with ``MILES_DIFFUSION_ROOT``, its patch targets; then the torch internals the H3 FSDP2
levers touch (:mod:`patches.core.torch_internals`; a mismatch there is reported, and refused when a lever needs it). Exit status 2 with an ``error:``
line when a flag holds a value it does not accept, a root is not a checkout, or a patch target does not match
the supported upstream commits.
"""

from __future__ import annotations

import os
import sys

from .core import flags
from .core.errors import ArgumentParser
from .run import ROOTS, roots_problem


def status() -> int:
    """Print the flags and, with ``COSMOS_FRAMEWORK_ROOT``, each patch target's state.

    Returns 0, or 2 when a flag holds a bad value, the root is not a checkout, or any target mismatches.
    """
    try:
        values = {**flags.read_all(), **flags.read_miles()}
    except flags.FlagError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    problem = roots_problem()
    if problem:  # bad input: one line before any report
        print(f"error: {problem}", file=sys.stderr)
        return 2
    print(f"rank {os.environ.get('RANK', '0')}: onecard lever flags")
    for f in flags.ALL_FLAGS:
        print(f"  {f.name}={_shown(f, values[f.name])}  {f.help}")
    print(f"  {flags.LATENT_CACHE_DIR}={flags.latent_cache_dir()}  latent cache folder "
          f"({'used' if values[flags.LATENT_CACHE.name] else 'unused'}: {flags.LATENT_CACHE.name}="
          f"{_shown(flags.LATENT_CACHE, values[flags.LATENT_CACHE.name])})")
    code = _upstream_status(values, "COSMOS_FRAMEWORK_ROOT", os.environ.get("COSMOS_FRAMEWORK_ROOT", ""))
    print("onecard flags for miles-diffusion (H3)")
    for f in flags.MILES_FLAGS:
        print(f"  {f.name}={_shown(f, values[f.name])}  {f.help}")
    budget = flags.miles_gpu_budget_gib()
    print(f"  {flags.MILES_GPU_BUDGET_GIB}={'(unset: the card)' if budget is None else f'{budget:g}'}  GPU budget in "
          f"GiB that {flags.MILES_RESIDENT_BLOCKS.name}=auto fills")
    code = max(code, _upstream_status(values, "MILES_DIFFUSION_ROOT", os.environ.get("MILES_DIFFUSION_ROOT", "")))
    try:
        import torch

        from .core.host_arena import pinned_bytes_total

        cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        print(f"torch {torch.__version__}; GPU: {cuda}; pinned by onecard in this process: {pinned_bytes_total()} B")
    except ImportError:
        print("torch: not installed")
        return code
    from .core import torch_internals

    print(f"torch internals the FSDP2 levers touch ({torch_internals.SUPPORTED} supported)")
    for name, target, state in torch_internals.status():
        print(f"  {name:<32} {target}: {state if state == 'ok' else 'MISMATCH: ' + state}")
    return code


def _shown(flag: flags.Flag | flags.ChoiceFlag | flags.CountFlag, value: bool | str) -> str:
    """How ``status`` prints a flag's value: 1/0 for a boolean, the word or number (or ``(unset)``) for a choice or
    count flag."""
    if isinstance(flag, flags.ChoiceFlag):
        return str(value) if value else f"(unset; accepts {'/'.join(flag.choices)})"
    if isinstance(flag, flags.CountFlag):
        return str(value) if value else "(unset; accepts auto or a whole number)"
    return "1" if value else "0"


def _upstream_status(values: dict[str, bool | str], var: str, root: str) -> int:
    """Print what the patch table for upstream ``var`` (a key of :data:`ROOTS`) would do to the checkout at
    ``root`` (checked to be one by :func:`status` first); 0 when ``root`` is unset (the embedded trainer), 2 if
    anything mismatches."""
    _, _, table, embedded = ROOTS[var]
    if not root:
        print(f"target: {embedded} (levers built in; no upstream patched)")
        return 0
    import importlib

    return _table_status(values, root, importlib.import_module(table, __package__).patch_set())


def _table_status(values: dict[str, bool | str], root: str, ps) -> int:
    """Check every target of the patch set ``ps`` in the checkout at ``root`` and print one line each."""
    from .core.errors import UpstreamMismatch

    sys.path.insert(0, root)
    print(f"target: upstream checkout {root} ({ps.supported} supported)")
    mismatches = 0
    for p in ps.patches:
        try:
            p.check(ps.supported)
            off = ", ".join(f"{f.name} unset" if isinstance(f, flags.ChoiceFlag) else f"{f.name}=0" for f in p.flags)
            state = "ok, would be patched" if p.wanted(values) else f"ok, left alone ({off})"
        except UpstreamMismatch as e:
            state = f"MISMATCH: {e}"
            mismatches += 1
        print(f"  {p.name:<28} {p.target}: {state}")
    how = ("the sitecustomize hook in patches/miles_site, in every Ray process" if ps.upstream == "miles-diffusion"
           else "python -m patches.run")
    print(f"  (each rank prints what it patched when the launcher starts it through {how})")
    if mismatches:
        print(f"error: {mismatches} patch target(s) do not match this checkout: check out a supported commit "
              f"({ps.supported})", file=sys.stderr)
        return 2
    return 0


def check() -> int:
    """Apply the patches in this (throwaway) process: 0 and the patched targets, or 2 and one error line.

    Checked first, as ``status`` does: every cosmos and miles flag (``MILES_GPU_BUDGET_GIB`` too), and each root
    that is set (``COSMOS_FRAMEWORK_ROOT``, ``MILES_DIFFUSION_ROOT``) must be a checkout, whether or not a flag is on.
    With ``MILES_DIFFUSION_ROOT`` and ``MILES_ONECARD_FSDP=1`` the miles table is applied here too. With
    ``COSMOS_LATENT_CACHE=1`` the cache folder must be a writable folder (or creatable; nothing is created) and
    ``ONECARD_LATENT_CACHE_CHECK`` and ``ONECARD_LATENT_CACHE_DECODE`` booleans.
    """
    from .core.errors import UpstreamMismatch, UserError
    from .run import apply_from_env

    try:
        if flags.LATENT_CACHE.value():
            from .core.data.latents import check_folder  # imports torch: only when the cache is on

            flags.LATENT_CACHE_CHECK.value()
            flags.LATENT_CACHE_DECODE.value()
            check_folder(flags.latent_cache_dir(), flags.LATENT_CACHE_DIR)
        miles = flags.read_miles()
        problem = roots_problem()
        if problem:
            raise UpstreamMismatch(problem)
        patched = apply_from_env()
        miles_root = os.environ.get("MILES_DIFFUSION_ROOT", "")
        if miles_root and any(miles.values()):
            from .miles_table import patch_set

            if miles_root not in sys.path:
                sys.path.insert(0, miles_root)
            patched += patch_set().apply(miles)
    except (flags.FlagError, UpstreamMismatch, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    why = ("no lever flag set" if not any(flags.read_all().values()) and not any(miles.values()) else
           "no upstream root set: the embedded trainers have the levers built in")
    print("patched: " + (", ".join(patched) or f"nothing ({why})"))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m patches")
    ap.add_argument("command", choices=["status", "check"],
                    help="status: report flags and targets; check: apply the patches here and report (exit 2 on a mismatch)")
    args = ap.parse_args(argv)
    return status() if args.command == "status" else check()


if __name__ == "__main__":
    sys.exit(main())
