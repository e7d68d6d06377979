"""The one error type for input a user can fix, and the CLI wrapper that turns it into one line.

Every recipe's bad-input exception (a TOML key, a dataset row, a flag value, a checkpoint that does not
match) derives from :class:`UserError`, so a command line catches one type, prints ``error: <message>`` on
stderr and exits 2 -- never a traceback for something the user can fix.
"""

from __future__ import annotations

import sys
from typing import Callable


class UserError(ValueError):
    """Bad input the user can fix: the message names the problem and the fix, in one line."""


class UpstreamMismatch(RuntimeError):
    """Code onecard patches or relies on (an upstream trainer's function, a torch internal) is missing or has another
    signature than the versions onecard supports; the message names the target, what was found and what is
    supported."""


EXIT_USER_ERROR = 2
"""Exit status of every onecard command on a :class:`UserError`."""


def cli(main: Callable[[], int | None]) -> int:
    """Run ``main()``; a :class:`UserError` prints one ``error:`` line and returns :data:`EXIT_USER_ERROR`.

    Returns ``main``'s own status (``None`` counts as 0). Any other exception propagates (a bug, not bad
    input).
    """
    try:
        return int(main() or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
