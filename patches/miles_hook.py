"""Apply the miles-diffusion patch table in every process that imports upstream's FSDP application.

Upstream trains in Ray actor processes (``train_diffusion.py`` -> ``miles/ray/train_actor.py``), which
the launcher does not start itself, so ``python -m patches.run`` cannot reach them. The launcher puts
``patches/miles_site`` on ``PYTHONPATH``; its ``sitecustomize`` calls :func:`install_hook` when ``MILES_DIFFUSION_ROOT``
and ``MILES_ONECARD_FSDP`` are set. :func:`install_hook` adds a ``sys.meta_path`` finder that, right after
``miles.backends.fsdp_utils.model_loader`` has been executed (it imports ``checkpoint`` itself), applies
:func:`patches.miles_table.patch_set` with the flags of the environment -- so nothing upstream is imported early
and a process that never builds a model (the Ray head, the rollout side) is not touched. A mismatch raises
:class:`patches.patches.core.errors.UpstreamMismatch` from that import, naming the target.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TRIGGER = "miles.backends.fsdp_utils.model_loader"
"""The module whose import applies the table."""

applied: list[str] = []
"""Targets patched in this process (for ``patches status`` and tests)."""


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TRIGGER:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            sys.modules[fullname] = module
            apply_now()

        spec.loader = _Loader(loader, exec_and_patch)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, exec_module):
        self._inner, self._exec = inner, exec_module

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._exec(module)


def apply_now() -> list[str]:
    """Read the miles flags and apply the table now (targets must be importable); returns the patched targets."""
    from .core.flags import read_miles
    from .miles_table import patch_set

    done = patch_set().apply(read_miles())
    applied[:] = done
    print(f"onecard: miles-diffusion patched: {', '.join(done) or 'nothing'}", file=sys.stderr, flush=True)
    return done


def install_hook() -> None:
    """Add the finder once (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
