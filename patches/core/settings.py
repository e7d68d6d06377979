"""What a run trains is fixed when it starts: the settings that decide it are kept in every checkpoint and a
resume that would train something else is refused.

A recipe lists those settings as a flat ``{name: value}`` dict (:meth:`patches.core.trainer.Recipe.
training_settings`), the names spelled as the user sets them (``[optimizer].lr``, ``--lora-alpha``), the values
JSON-like (numbers, strings, booleans, lists). The skeleton stores the dict in each checkpoint under
:data:`KEY` and, before a run resumes, :func:`compare` checks it against the current one:

- a setting in the recipe's *adjustable* set (how long to train, how often to save) may change: the new
  value is applied and the run says so in one line;
- any other difference stops the run with one :class:`SettingsChanged` error naming every changed setting
  with both values, before anything is built or written;
- a setting the checkpoint does not hold (written by an older version) is not compared.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .errors import UserError

KEY = "training_settings"
"""Where a checkpoint holds the settings it was trained with."""


class SettingsChanged(UserError):
    """The run would resume a checkpoint with settings that change what it trains."""


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def compare(saved: Mapping[str, Any] | None, current: Mapping[str, Any], *, adjustable: Iterable[str] = (),
            checkpoint: str = "the checkpoint") -> list[str]:
    """Compare a checkpoint's settings with this run's; returns one note per adjustable setting that changed.

    Args:
        saved: the checkpoint's settings (``None``: written before settings were stored; nothing is compared).
        current: this run's settings.
        adjustable: names whose change is legitimate (applied and reported).
        checkpoint: how to name the checkpoint in messages (its path).

    Raises:
        SettingsChanged: any other setting differs; the message names each with its checkpoint and its new value.
    """
    if not saved:
        return []
    adjustable = set(adjustable)
    changed = [(k, saved[k], v) for k, v in current.items() if k in saved and not _values_equal(saved[k], v)]
    refused = [c for c in changed if c[0] not in adjustable]
    if refused:
        diffs = "; ".join(f"{k} was {old!r}, now {new!r}" for k, old, new in refused)
        raise SettingsChanged(
            f"{checkpoint} was trained with other settings: {diffs}. A resumed run trains what it started: set "
            f"{'it' if len(refused) == 1 else 'them'} back, or train into another output folder"
        )
    return [f"{k} changed since {checkpoint}: {old!r} -> {new!r} (applied)" for k, old, new in changed]
