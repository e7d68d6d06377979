"""Environment flags that switch the levers on.

Every flag is off unless set; a set flag must read 1/0/true/false/yes/no (any case), anything else
raises :class:`FlagError` naming the variable and the accepted values.
"""

from __future__ import annotations

import dataclasses
import os

from .errors import UserError

_TRUE = {"1", "true", "yes"}
_FALSE = {"0", "false", "no", ""}


class FlagError(UserError):
    """An environment flag holds a value that is not a boolean."""


@dataclasses.dataclass(frozen=True)
class Flag:
    """One boolean environment flag."""

    name: str
    """Environment variable name."""
    help: str
    """What turning it on does."""

    def value(self, environ: dict[str, str] | None = None) -> bool:
        """The flag's value in ``environ`` (default ``os.environ``); raises :class:`FlagError` on bad text."""
        raw = (environ if environ is not None else os.environ).get(self.name, "")
        text = raw.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise FlagError(
            f"{self.name}={raw!r} is not a boolean: set it to one of 1/0/true/false/yes/no, or unset it"
        )


EMA_CPU_SUBSET = Flag(
    "COSMOS_EMA_CPU_SUBSET",
    "fp32 EMA of the trainable subset only, in pinned host memory, updated off the training thread",
)
VAE_CPU_OFFLOAD = Flag(
    "COSMOS_VAE_CPU_OFFLOAD",
    "frozen Wan2.2 VAE parked in pinned host memory, on the GPU only for a micro-batch's encodes",
)

ALL_FLAGS: tuple[Flag, ...] = (EMA_CPU_SUBSET, VAE_CPU_OFFLOAD)


def read_all(environ: dict[str, str] | None = None) -> dict[str, bool]:
    """All flags' values by name; raises :class:`FlagError` on the first bad one."""
    return {f.name: f.value(environ) for f in ALL_FLAGS}
