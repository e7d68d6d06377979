"""Environment flags that switch the levers on.

Every flag is off unless set. A boolean :class:`Flag` must read 1/0/true/false/yes/no (any case); a
:class:`ChoiceFlag` must be unset, empty, or one of its accepted words (any case). Anything else raises
:class:`FlagError` naming the variable and the accepted values.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from .errors import UserError, shown  # noqa: F401 - shown: read from here too

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

OPTIM_STATE_OFFLOAD = Flag(
    "COSMOS_OPTIM_STATE_OFFLOAD",
    "AdamW exp_avg/exp_avg_sq in one exact-size pinned host arena, streamed to the GPU group by group for "
    "the optimizer's own step (same kernel, same values)",
)
FROZEN_BF16 = Flag(
    "COSMOS_FROZEN_BF16",
    "frozen fp32 parameters computed in bf16 are held on the GPU as their bf16 cast; fp32 values stay on "
    "the host for checkpoints and the EMA (saved tensors unchanged)",
)

ATTN_BACKEND = ChoiceFlag(
    "COSMOS_ATTN_BACKEND",
    "torch: upstream's attention() runs on PyTorch's own kernels (varlen_attn on CUDA bf16/fp16, "
    "scaled_dot_product_attention otherwise) instead of flash/cuDNN/NATTEN; unset: upstream's choice",
    ("torch",),
)

LATENT_CACHE = Flag(
    "COSMOS_LATENT_CACHE",
    "lever 4: a pre-pass encodes every (clip, window, size) once into a safetensors latent cache "
    "($ONECARD_LATENT_CACHE); training reads latents from it and never puts the VAE on the GPU",
)

DETACH_TEXT_STREAM = Flag(
    "COSMOS_DETACH_TEXT_STREAM",
    "the frozen text (causal) stream enters the decoder layers detached while the text model's embed_tokens is "
    "frozen: no backward pass over it, the same gradients",
)

ALL_FLAGS: tuple[Flag | ChoiceFlag, ...] = (EMA_CPU_SUBSET, VAE_CPU_OFFLOAD, ATTN_BACKEND, LATENT_CACHE,
                                        OPTIM_STATE_OFFLOAD, FROZEN_BF16, DETACH_TEXT_STREAM)

LATENT_CACHE_DIR = "ONECARD_LATENT_CACHE"
"""Environment variable naming the latent cache folder (lever 4)."""

LATENT_CACHE_CHECK = Flag(
    "ONECARD_LATENT_CACHE_CHECK",
    "lever 4 in upstream's trainer: also encode every served latent online and stop with one error line if the "
    "two differ (a check run: the VAE is on the GPU for every micro-batch)",
)

LATENT_CACHE_DECODE = Flag(
    "ONECARD_LATENT_CACHE_DECODE",
    "lever 4 in upstream's trainer: decode every clip even when its latent is cached (by default a cached clip is "
    "not decoded and its batch carries zero pixels of the decoded shape, re-decoded for upstream's sample-drawing "
    "callback); for callbacks of your own that read the batch's pixels",
)


def latent_cache_dir(environ: dict[str, str] | None = None) -> Path:
    """The latent cache folder: ``$ONECARD_LATENT_CACHE``, else ``$ONECARD_DATA_CACHE/latents``, else
    ``~/.cache/onecard/latents`` (the data cache's default, as for the sample dataset)."""
    env = environ if environ is not None else os.environ
    if env.get(LATENT_CACHE_DIR):
        return Path(env[LATENT_CACHE_DIR]).expanduser()
    return Path(env.get("ONECARD_DATA_CACHE") or Path.home() / ".cache" / "onecard").expanduser() / "latents"


def read_all(environ: dict[str, str] | None = None) -> dict[str, bool | Choice]:
    """All flags' values by name (a :class:`Choice` for a :class:`ChoiceFlag`, truthy when on); raises
    :class:`FlagError` on the first bad one."""
    return {f.name: f.value(environ) for f in ALL_FLAGS}


def is_whole_number(text: str) -> bool:
    """``text`` is ASCII digits only (``"07"`` yes; ``""``, ``"-3"``, ``"3.0"``, ``"\u00b3"`` no).

    ``str.isdigit`` alone is True for other scripts' digits (``"\u00b3"``, ``"\u0663"``) that ``int()`` rejects or reads
    differently, so every whole-number parser of onecard uses this instead.
    """
    return text.isascii() and text.isdigit()


MAX_COUNT_DIGITS = 9
"""Digits a count setting may have (leading zeros aside): ``int()`` of a 5,000-digit string raises a ``ValueError``
instead of the one ``error:`` line, and no block count is that large."""


def read_count(text: str) -> int | None:
    """``text`` as a whole number >= 0 (ASCII digits, at most :data:`MAX_COUNT_DIGITS` significant), else ``None``:
    the count reader of every auto/number/none setting (:func:`parse_resident_blocks`,
    ``miles_ext.levers.input_recompute.parse_setting``)."""
    return int(text) if is_whole_number(text) and len(text.lstrip("0")) <= MAX_COUNT_DIGITS else None


MAX_GPU_GIB = 1024.0
"""The largest GPU budget in GiB any planner takes for one card (no card holds a TiB; an H200 has 141 GB): a larger
one is a typo, and ``gib * 2**30`` of an absurd one overflows."""
MAX_RANKS_PER_NODE = 1024
"""The most ranks (``NPROC_PER_NODE``) one node may start, as the trainer's launch check says."""
MAX_NODES = 1024
"""The most nodes (``NNODES``) a launch may span."""
MAX_WORLD_SIZE = MAX_RANKS_PER_NODE * MAX_NODES
"""The largest world size (``--world-size``, ``NPROC_PER_NODE`` x ``NNODES``) the planners take."""


def _whole_number_problem(text: str, at_least: int, at_most: int, what: str) -> str | None:
    if is_whole_number(text) and at_least <= int(text) <= at_most:
        return None
    return (f"{text!r} is not a whole number from {at_least} to {at_most}{f' ({what})' if what else ''}: give plain "
            "digits in that range")


def whole_number(text: str, source: str, at_least: int, at_most: int, what: str = "") -> int:
    """``text`` as a whole number in ``[at_least, at_most]``: plain ASCII digits only (:func:`is_whole_number`; no
    sign, spaces, ``_`` or exponent).

    Raises:
        FlagError: anything else, one line naming ``source`` (a ``--flag`` or a variable), the value and the range.
    """
    problem = _whole_number_problem(text, at_least, at_most, what)
    if problem:
        raise FlagError(f"{source}={problem}" if not source.startswith("-") else f"{source} {problem}")
    return int(text)


def whole_number_arg(at_least: int, at_most: int, what: str = ""):
    """An ``argparse`` ``type=``: :func:`whole_number` in ``[at_least, at_most]``; a refusal is argparse's one line
    (with :class:`patches.core.errors.ArgumentParser`: ``error: PROG: argument --flag: '0' is not ...``)."""
    import argparse

    def parse(text: str) -> int:
        problem = _whole_number_problem(text, at_least, at_most, what)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return int(text)

    parse.__name__ = "whole number"
    return parse


def setting(source: str, value: object) -> str:
    """How a setting reads in a message: ``--flag 3`` for a command-line flag, ``NAME=3`` for a variable."""
    return f"{source} {value}" if source.startswith("-") else f"{source}={value}"


def parse_resident_blocks(value: "str | int | None", source: str) -> "str | int | None":
    """The one parser of an H3 residency setting (the launcher's ``RESIDENT_BLOCKS``, the trainer's
    ``--fsdp-resident-blocks``, upstream's ``MILES_RESIDENT_BLOCKS``): ``None`` (unset, empty or ``none``: every block
    streams under CPU offload, no partial residency), ``"auto"`` (the memory model picks the count), or a whole
    number of blocks >= 0 kept on the GPU. Any case.

    Raises:
        FlagError: anything else, one line naming ``source`` and the accepted values.
    """
    given = setting(source, repr(value))
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise FlagError(f"{given}: use auto, a whole number of blocks >= 0, or none")
        return value
    text = str(value).strip().lower()
    if text in ("", "none"):
        return None
    if text == "auto":
        return "auto"
    count = read_count(text)
    if count is not None:
        return count
    raise FlagError(f"{setting(source, shown(value))}: use auto, a whole number of blocks (0 streams every block), or "
                    "none (plain CPU offload)")


@dataclasses.dataclass(frozen=True)
class CountFlag:
    """An environment flag holding a residency setting (:func:`parse_resident_blocks`): off, ``auto`` or a count."""

    name: str
    """Environment variable name."""
    help: str
    """What ``auto`` and a number do."""

    def value(self, environ: dict[str, str] | None = None) -> Choice:
        """``Choice("auto")``, ``Choice("<n>")`` or ``Choice("")`` (off); raises :class:`FlagError` on other text."""
        raw = (environ if environ is not None else os.environ).get(self.name, "")
        parsed = parse_resident_blocks(raw, self.name)
        return Choice("" if parsed is None else str(parsed))


MILES_ONECARD_FSDP = Flag(
    "MILES_ONECARD_FSDP",
    "miles-diffusion on one GPU: onecard's FSDP2 application (offloaded shards in one exact-size pinned arena) "
    "and a one-rank state load that never moves the whole model to the GPU",
)
MILES_RESIDENT_BLOCKS = CountFlag(
    "MILES_RESIDENT_BLOCKS",
    "partial residency under --fsdp-cpu-offload (needs MILES_ONECARD_FSDP=1): auto (from the memory model and "
    "$MILES_GPU_BUDGET_GIB, default the card) or N blocks kept on the GPU, the others streamed with prefetch",
)
MILES_GPU_BUDGET_GIB = "MILES_GPU_BUDGET_GIB"
"""Environment variable: the GPU budget in GiB that ``MILES_RESIDENT_BLOCKS=auto`` fills (default: the card)."""


def env_number(name: str, above: float, fix: str, environ: dict[str, str] | None = None,
               at_least: bool = False, at_most: float = math.inf) -> float | None:
    """``$name`` as a finite float ``> above`` (``>= above`` with ``at_least``) and ``<= at_most``, or ``None`` when
    unset or empty.

    Raises:
        FlagError: not a number, ``nan``/``inf``, or out of range: one line naming the variable, its value and
            ``fix`` (what to set instead).
    """
    raw = (environ if environ is not None else os.environ).get(name, "")
    if not raw.strip():
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and (value >= above if at_least else value > above) and value <= at_most):
        raise FlagError(f"{name}={raw!r}: {fix}")
    return value


def miles_gpu_budget_gib(environ: dict[str, str] | None = None) -> float | None:
    """``$MILES_GPU_BUDGET_GIB`` in GiB, or ``None`` when unset or empty.

    Raises:
        FlagError: not a finite number > 0 and <= :data:`MAX_GPU_GIB` (``abc``, ``0``, ``-3``, ``nan``, ``inf``,
            ``1e300``), naming the variable.
    """
    return env_number(MILES_GPU_BUDGET_GIB, 0.0, f"is not a GPU budget: set a number of GiB > 0 and <= {MAX_GPU_GIB:g} "
                      "(e.g. 80), or unset it for the card's total memory", environ, at_most=MAX_GPU_GIB)


def sample_interval_s(environ: dict[str, str] | None = None) -> float:
    """``$ONECARD_SAMPLE_S``: the memory sampler's interval in seconds (default 0.5, at least 0.01).

    Raises:
        FlagError: not a finite number >= 0.01 (a smaller one floods the timeline), naming the variable.
    """
    value = env_number("ONECARD_SAMPLE_S", 0.01, "must be the memory sampler's interval in seconds, at least "
                       "0.01 (default 0.5): fix it or unset it", environ, at_least=True)
    return 0.5 if value is None else value


MILES_FLAGS: tuple[Flag | CountFlag, ...] = (MILES_ONECARD_FSDP, MILES_RESIDENT_BLOCKS)
"""The flags of the miles-diffusion patch table (``patches.miles_table``)."""


def read_miles(environ: dict[str, str] | None = None) -> dict[str, bool | Choice]:
    """The miles-diffusion flags' values by name; raises :class:`FlagError` on a bad one, when
    ``MILES_RESIDENT_BLOCKS`` is set without ``MILES_ONECARD_FSDP``, or when ``MILES_GPU_BUDGET_GIB`` is not a
    finite number > 0 or is set without ``MILES_RESIDENT_BLOCKS=auto`` (the only setting that reads it)."""
    values = {f.name: f.value(environ) for f in MILES_FLAGS}
    if values[MILES_RESIDENT_BLOCKS.name] and not values[MILES_ONECARD_FSDP.name]:
        raise FlagError(f"{MILES_RESIDENT_BLOCKS.name} needs {MILES_ONECARD_FSDP.name}=1 (partial residency is part "
                        "of onecard's FSDP application): set it, or unset the residency flag")
    budget = miles_gpu_budget_gib(environ)
    if budget is not None and values[MILES_RESIDENT_BLOCKS.name] != "auto":
        raise FlagError(f"{MILES_GPU_BUDGET_GIB}={budget:g} is the budget {MILES_RESIDENT_BLOCKS.name}=auto fills, "
                        f"and {MILES_RESIDENT_BLOCKS.name} is not auto: set {MILES_RESIDENT_BLOCKS.name}=auto, or unset "
                        f"{MILES_GPU_BUDGET_GIB}")
    return values
