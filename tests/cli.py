"""Run a ``python -m MODULE`` command line in the test's own process.

A command's ``__main__`` block is ``sys.exit(main())``; :func:`run_main` calls that ``main(argv)`` with the given
environment (replacing ``os.environ`` for the call) and working directory, captures what it prints, and turns
``SystemExit`` (argparse's exit) into the status. What is left out is only the interpreter's start and
``import torch`` (about 2.5 s of each command on a CPU machine), so the tests of refusals that need no separate
process run in milliseconds. ``isolate=("cosmos_framework",)`` is for commands that put a (stand-in) checkout on
``sys.path`` and import it (``patches status``/``check``): the modules of those top-level packages are set aside
for the call and the ones it imported dropped after it, and ``sys.path`` is restored, so each call imports its own
checkout and leaves nothing behind. Commands whose behaviour depends on a fresh process (patches applied at import,
``torchrun``) keep running as subprocesses.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable
from unittest import mock


def run_main(main: Callable[[list[str]], int] | str, argv: list[str], env: dict[str, str],
             cwd: Path | str, isolate: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``main(argv)`` (a callable, or a module name whose ``main`` it is) as ``python -m`` would run it.

    Returns:
        A ``CompletedProcess`` with the status (``main``'s return value or ``SystemExit``'s code), stdout, stderr.
    """
    if isinstance(main, str):
        main = importlib.import_module(main).main
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    path = list(sys.path)

    def ours(name: str) -> bool:
        return name.partition(".")[0] in isolate

    stashed = {n: sys.modules.pop(n) for n in [n for n in sys.modules if ours(n)]}
    with mock.patch.dict(os.environ, env, clear=True), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        os.chdir(cwd)
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            os.chdir(here)
            if isolate:
                sys.path[:] = path
                for name in [n for n in sys.modules if ours(n)]:
                    del sys.modules[name]
                sys.modules.update(stashed)
                importlib.invalidate_caches()
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())
