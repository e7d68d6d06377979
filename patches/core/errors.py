"""The one error type for input a user can fix, and the CLI wrapper that turns it into one line.

Every recipe's bad-input exception (a TOML key, a dataset row, a flag value, a checkpoint that does not
match) derives from :class:`UserError`, so a command line catches one type, prints ``error: <message>`` on
stderr and exits 2 -- never a traceback for something the user can fix. :class:`ArgumentParser` does the same for
argparse's own refusals (an unknown flag, a value of the wrong type), and :func:`cli` turns Ctrl-C into one line.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, NoReturn


class UserError(ValueError):
    """Bad input the user can fix: the message names the problem and the fix, in one line."""


class UpstreamMismatch(RuntimeError):
    """Code onecard patches or relies on (an upstream trainer's function, a torch internal) is missing or has another
    signature than the versions onecard supports; the message names the target, what was found and what is
    supported."""


EXIT_USER_ERROR = 2
"""Exit status of every onecard command on a :class:`UserError`."""

EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, the shell's convention)."""


INT64_MAX = 2**63 - 1


def shown(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters plus ``...`` (a bad value quoted in a one-line message)."""
    text = str(value)
    return repr(text[:limit] + "..." if len(text) > limit else value)


def ascii_number(kind: type) -> Callable[[str], Any]:
    """An argparse ``type=`` that reads ``kind`` (``int`` or ``float``) from ASCII text only: ``int()`` and
    ``float()`` also take other scripts' digits (``"٥"`` is 5), which no shell user means; an ``int`` must fit a
    64-bit signed integer (what every count and seed here becomes in torch); spaces around it and underscores in it
    (which ``int()`` reads: ``"1_0"`` is 10) are refused too. Refusals are argparse's one line."""

    def parse(text: str) -> Any:
        quoted = shown(text)  # a bad value quoted, not pasted whole
        if not text.isascii():
            raise argparse.ArgumentTypeError(f"{quoted} is not a number in ASCII digits: type it with 0-9")
        if text != text.strip() or "_" in text:  # int() and float() take " 3", "3\n" and "1_0" (10)
            raise argparse.ArgumentTypeError(f"{quoted} has spaces or underscores: type the number alone, e.g. "
                                             f"{text.strip().replace('_', '')[:40] or '3'}")
        if kind is int and len(text.lstrip("+-").lstrip("0")) > len(str(INT64_MAX)):  # int() of 4,300+ digits raises
            raise argparse.ArgumentTypeError(f"{quoted[1:-1]} does not fit a 64-bit signed integer "
                                             f"(at most {INT64_MAX})")
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {quoted}") from None
        if kind is int and not -INT64_MAX - 1 <= value <= INT64_MAX:  # the range of config.Meaning(bits=64)
            raise argparse.ArgumentTypeError(f"{text} does not fit a 64-bit signed integer (at most {INT64_MAX})")
        return value

    parse.__name__ = kind.__name__
    return parse


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose refusals are one ``error:`` line, exit status 2.

    argparse prints its usage block and then ``prog: error: ...``; this prints ``error: <prog>: <message>; see <prog>
    --help`` only. A value that starts with ``-`` (``--lr -1e-4``) reads to argparse as a flag; the line then says to
    write it with ``=`` (``--lr=-1e-4``).
    """

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        """As argparse's, with ``type=int`` / ``type=float`` read from ASCII text only (Python's ``int("٥")`` is 5)
        and an ``int`` bounded to a 64-bit signed integer (:func:`ascii_number`)."""
        if kwargs.get("type") in (int, float):
            kwargs["type"] = ascii_number(kwargs["type"])
        return super().add_argument(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        hint = ""
        if "expected one argument" in message:
            hint = " (a value that starts with '-' goes with '=', e.g. --lr=-1e-4)"
        self.exit(EXIT_USER_ERROR, f"error: {self.prog}: {message}{hint}; see {self.prog} --help\n")


def cli(main: Callable[[], int | None], interrupted: str = "") -> int:
    """Run ``main()``; a :class:`UserError` prints one ``error:`` line and returns :data:`EXIT_USER_ERROR`.

    Ctrl-C (``KeyboardInterrupt``) prints one ``interrupted:`` line, followed by ``interrupted`` (what the user can
    do next, e.g. how to resume) when given, and returns :data:`EXIT_INTERRUPTED`; the ``with`` blocks inside
    ``main`` have closed by then (the run lock released, temporaries removed). Returns ``main``'s own status
    (``None`` counts as 0). Any other exception propagates (a bug, not bad input).
    """
    try:
        return int(main() or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"\ninterrupted: stopped by Ctrl-C{'; ' + interrupted if interrupted else ''}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
