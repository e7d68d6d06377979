"""TCP ports for a rendezvous, without importing torch (launchers call this before any rank starts).

``python -m patches.core.ports free`` prints a port that was free a moment ago;
``python -m patches.core.ports check NAME PORT`` exits 0 when ``PORT`` is free, else prints one ``error:`` line
naming ``NAME`` (the variable or flag it came from) and exits 2.
"""

from __future__ import annotations

import socket
import sys

from .errors import UserError, cli
from .flags import is_whole_number


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it back, close).

    For a one-node rendezvous and for tests run in parallel: never hard-code a port.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something is already bound to ``host:port`` (a bind attempt fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_port_free(port: int, name: str, host: str = "127.0.0.1") -> int:
    """That nothing is bound to ``host:port`` (the rendezvous would fail only after the ranks start).

    Raises:
        UserError: the port is outside 1..65535 or already in use; the message names ``name``.
    """
    if not 0 < port < 65536:
        raise UserError(f"{name}={port} is not a TCP port: use one in 1..65535, or leave {name} unset for a free one")
    if port_in_use(port, host):
        raise UserError(f"{name}={port} is in use on {host} (another run's rendezvous?): pass a free port, or "
                        f"leave {name} unset to pick one")
    return port


def _ports_cli(argv: list[str]) -> int:
    if argv == ["free"]:
        print(free_port())
        return 0
    if len(argv) == 3 and argv[0] == "check":
        name, value = argv[1], argv[2]

        def check() -> None:
            if not is_whole_number(value):
                raise UserError(f"{name}={value} is not a whole number")
            check_port_free(int(value), name)

        return cli(check)
    print("usage: python -m patches.core.ports free | check NAME PORT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_ports_cli(sys.argv[1:]))
