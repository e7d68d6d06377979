"""``python -m patches.run MODULE [ARGS...]``: apply the lever patches, then run MODULE as ``__main__``.

This is how the launcher drives an upstream trainer: ``torchrun ... -m patches.run
cosmos_framework.scripts.train --sft-toml=...`` starts every rank through this wrapper, so the patches are
in place before any upstream code runs, whatever ``sitecustomize.py`` the upstream puts on ``PYTHONPATH``.
Each rank prints one line saying which flags are on and which targets it patched.

Exit status 2 with one ``error:`` line when a flag is not a boolean, a target does not match the supported upstream
commits, MODULE is missing (or is not a module name), or no MODULE is given -- before MODULE runs.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

from .core import flags
from .core.errors import UpstreamMismatch


ROOTS = {"COSMOS_FRAMEWORK_ROOT": ("cosmos-framework", ("cosmos_framework",), ".cosmos_table",
                                   "embedded reference trainer"),
         "MILES_DIFFUSION_ROOT": ("miles-diffusion", ("miles", "backends", "fsdp_utils"), ".miles_table",
                                  "embedded H3 trainer")}
"""Upstream root variable -> (upstream, the folder inside a checkout that proves it is one, its patch table
module, what runs without it)."""


def root_problem(var: str, root: str) -> str:
    """Why ``root`` (the value of ``var``, one of :data:`ROOTS`) is not a checkout, or ``""`` when it is one (or
    unset)."""
    if not root:
        return ""
    name, inside = ROOTS[var][:2]
    if not os.path.isdir(os.path.join(root, *inside)):
        return (f"{var}={root} is not a {name} checkout (no {'/'.join(inside)}/ in it): point it at the folder that "
                f"holds {inside[0]}/, or unset it to run the {ROOTS[var][3]}")
    return ""


def roots_problem() -> str:
    """The first root variable of :data:`ROOTS` set in the environment to a folder that is not a checkout, as
    :func:`root_problem` words it, or ``""`` (``python -m patches status`` and ``check`` refuse it before anything)."""
    return next((p for var in ROOTS if (p := root_problem(var, os.environ.get(var, "")))), "")


def apply_from_env() -> list[str]:
    """Read the flags, put ``COSMOS_FRAMEWORK_ROOT`` on ``sys.path``, apply the cosmos patch table.

    Nothing is patched without ``COSMOS_FRAMEWORK_ROOT`` (the embedded trainer needs no patches) or with
    every flag off. Returns the patched targets. Raises :class:`flags.FlagError` or
    :class:`UpstreamMismatch` (also for a root that is not a cosmos-framework checkout).
    """
    values = flags.read_all()
    root = os.environ.get("COSMOS_FRAMEWORK_ROOT", "")
    if not root or not any(values.values()):
        return []  # the embedded trainer has the levers built in; unset flags patch nothing
    problem = root_problem("COSMOS_FRAMEWORK_ROOT", root)
    if problem:
        raise UpstreamMismatch(problem)
    if root not in sys.path:
        sys.path.insert(0, root)
    from .cosmos_table import patch_set

    return patch_set().apply(values)


USAGE = "usage: python -m patches.run MODULE [ARGS...]"


def _show_lever_messages() -> None:
    """The levers' own lines (logger ``onecard``, INFO: what each patch did, e.g. how many GiB it moved) go to
    stderr. Upstream logs through loguru, so nothing else gives Python's ``logging`` a handler, and its last-resort
    handler shows warnings only. A handler already on ``onecard`` is left alone."""
    logger = logging.getLogger("onecard")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"%(message)s [rank {os.environ.get('RANK', '0')}]"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _module_problem(name: str) -> str | None:
    """Why ``python -m patches.run NAME`` cannot run ``NAME`` as ``__main__`` (checked after the patches are applied,
    so ``COSMOS_FRAMEWORK_ROOT`` is on ``sys.path``, and before anything of it runs), or ``None``.

    Only the module's presence is checked (``importlib.util.find_spec``, which imports its parent packages, as
    running it would): an ``ImportError`` raised while the module itself runs is its own and stays a traceback.
    """
    import importlib.util

    if not all(part.isidentifier() for part in name.split(".")):
        return (f"python -m patches.run: {name!r} is not a module name: give a dotted module name, e.g. "
                f"cosmos_framework.scripts.train ({USAGE})")
    fix = "check its spelling, or put the folder that holds it on PYTHONPATH (COSMOS_FRAMEWORK_ROOT for upstream)"
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:  # a package runs its __main__
            if importlib.util.find_spec(f"{name}.__main__") is None:
                return f"python -m patches.run: {name} is a package with no __main__ module: give a module to run"
    except ModuleNotFoundError as e:  # a parent package is missing (anything else it raises is its own)
        if not e.name or not (name == e.name or name.startswith(e.name + ".")):
            raise
        spec = None
    if spec is None:
        return f"python -m patches.run: no module named {name}: {fix}"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{(__doc__ or '').strip()}")
        return 0
    if not argv:
        print(f"error: python -m patches.run: give the MODULE to run ({USAGE})", file=sys.stderr)
        return 2
    if argv[0].startswith("-"):
        print(f"error: python -m patches.run: {argv[0]!r} is not a module: the first argument is the MODULE to run, "
              f"its own arguments follow it ({USAGE})", file=sys.stderr)
        return 2
    try:
        patched = apply_from_env()
    except (flags.FlagError, UpstreamMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    module, *rest = argv
    problem = _module_problem(module)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    on = " ".join(f"{k}={v if isinstance(v, str) else int(v)}" for k, v in flags.read_all().items())
    print(f"onecard[rank {os.environ.get('RANK', '0')}]: {on}; patched: {', '.join(patched) or 'nothing'}",
          file=sys.stderr, flush=True)
    _show_lever_messages()
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
