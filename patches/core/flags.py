"""Environment flags that switch the levers on.

Every flag is off unless set. A boolean :class:`Flag` must read 1/0/true/false/yes/no (any case); a
:class:`ChoiceFlag` must be unset, empty, or one of its accepted words (any case). Anything else raises
:class:`FlagError` naming the variable and the accepted values.
"""

from __future__ import annotations

import dataclasses
import os

from .errors import UserError

_TRUE = {"1", "true", "yes"}
_FALSE = {"0", "false", "no", ""}


class FlagError(UserError):
    """An environment flag holds a value it does not accept."""


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


class Choice(str):
    """A :class:`ChoiceFlag`'s value: the accepted word, or ``""`` when off.

    It is a ``str`` (so it prints and serialises as the word) whose truth is "on", and ``int()`` of it is
    1 or 0, so code that reads every flag as a boolean (``PatchSet.wanted``, ``patches.run``'s line) works.
    """

    __slots__ = ()

    def __int__(self) -> int:
        return 1 if self else 0


@dataclasses.dataclass(frozen=True)
class ChoiceFlag:
    """One environment flag that names one of a few choices; unset or empty means off."""

    name: str
    """Environment variable name."""
    help: str
    """What each choice does."""
    choices: tuple[str, ...]
    """The accepted words (lower case), each of which turns the flag on."""

    def value(self, environ: dict[str, str] | None = None) -> Choice:
        """The flag's value in ``environ`` (default ``os.environ``); raises :class:`FlagError` on bad text."""
        raw = (environ if environ is not None else os.environ).get(self.name, "")
        text = raw.strip().lower()
        if not text:
            return Choice("")
        if text in self.choices:
            return Choice(text)
        raise FlagError(
            f"{self.name}={raw!r} is not an accepted value: set it to {' or '.join(self.choices)}, "
            "or unset it (or set it empty) to leave it off"
        )


EMA_CPU_SUBSET = Flag(
    "COSMOS_EMA_CPU_SUBSET",
    "fp32 EMA of the trainable subset only, in pinned host memory, updated off the training thread",
)
VAE_CPU_OFFLOAD = Flag(
    "COSMOS_VAE_CPU_OFFLOAD",
    "frozen Wan2.2 VAE parked in pinned host memory, on the GPU only for a micro-batch's encodes",
)

ATTN_BACKEND = ChoiceFlag(
    "COSMOS_ATTN_BACKEND",
    "torch: upstream's attention() runs on PyTorch's own kernels (varlen_attn on CUDA bf16/fp16, "
    "scaled_dot_product_attention otherwise) instead of flash/cuDNN/NATTEN; unset: upstream's choice",
    ("torch",),
)

ALL_FLAGS: tuple[Flag | ChoiceFlag, ...] = (EMA_CPU_SUBSET, VAE_CPU_OFFLOAD, ATTN_BACKEND)


def read_all(environ: dict[str, str] | None = None) -> dict[str, bool | Choice]:
    """All flags' values by name (a :class:`Choice` for a :class:`ChoiceFlag`, truthy when on); raises
    :class:`FlagError` on the first bad one."""
    return {f.name: f.value(environ) for f in ALL_FLAGS}
