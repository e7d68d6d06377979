"""``python -m patches.run MODULE [ARGS...]``: apply the lever patches, then run MODULE as ``__main__``.

This is how the launcher drives an upstream trainer: ``torchrun ... -m patches.run
cosmos_framework.scripts.train --sft-toml=...`` starts every rank through this wrapper, so the patches are
in place before any upstream code runs, whatever ``sitecustomize.py`` the upstream puts on ``PYTHONPATH``.
Each rank prints one line saying which flags are on and which targets it patched.

Exit status 2 with one ``error:`` line when a flag is not a boolean or a target does not match the
supported upstream commits.
"""

from __future__ import annotations

import os
import runpy
import sys

from .core import flags
from .core.errors import UpstreamMismatch


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
    if not os.path.isdir(os.path.join(root, "cosmos_framework")):
        raise UpstreamMismatch(f"COSMOS_FRAMEWORK_ROOT={root} is not a cosmos-framework checkout (no cosmos_framework/ in it): "
                               "point it at the folder that holds cosmos_framework/")
    if root not in sys.path:
        sys.path.insert(0, root)
    from .cosmos_table import patch_set

    return patch_set().apply(values)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: python -m patches.run MODULE [ARGS...]", file=sys.stderr)
        return 2
    try:
        patched = apply_from_env()
    except (flags.FlagError, UpstreamMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    on = " ".join(f"{k}={v if isinstance(v, str) else int(v)}" for k, v in flags.read_all().items())
    print(f"onecard[rank {os.environ.get('RANK', '0')}]: {on}; patched: {', '.join(patched) or 'nothing'}",
          file=sys.stderr, flush=True)
    module, *rest = argv
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
