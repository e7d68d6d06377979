"""Guarded monkeypatches: replace an upstream function only after checking it is the one we expect.

A :class:`Patch` names its target as ``"package.module:Class.attr"``, the parameter names the target
must have, and its implementation as an import string (``"cosmos_framework_ext.upstream.patches:factory"``),
resolved only when the patch is applied: ``patches`` imports no recipe package at module level. :meth:`PatchSet.apply` imports each target, compares its signature, and only then installs
the replacement; a missing target or a changed signature raises :class:`UpstreamMismatch` naming the
target, what was found, and the upstream commits this version supports -- before anything is patched
(all targets are checked first). :meth:`PatchSet.revert` puts every original back (tests use it).
Patches whose flag is off are not applied: an unset flag leaves the upstream untouched.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable

from .core.errors import UpstreamMismatch
from .core.flags import ChoiceFlag, Flag

MARK = "_onecard_patch"
"""Attribute set on every installed replacement: the patch's name."""


def resolve(spec: str) -> Any:
    """The object an import string ``"package.module:attr.path"`` names (imported now).

    Raises:
        ImportError: the module does not import.
        AttributeError: the module has no such attribute.
    """
    module_name, _, path = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


@dataclasses.dataclass(frozen=True)
class Patch:
    """One guarded replacement."""

    name: str
    """Short name, e.g. ``ema.set_up_model``."""
    flag: Flag | ChoiceFlag
    """The environment flag that turns it on (a choice flag: any accepted value)."""
    target: str
    """``"module.path:Owner.attr"`` (or ``"module.path:function"``)."""
    params: tuple[tuple[str, ...], ...]
    """Accepted parameter-name lists of the target, in order (``self`` included for methods): one per
    supported upstream signature."""
    impl: str
    """Import string ``"module:function"`` of the factory that builds the replacement from the original."""
    also: tuple[Flag | ChoiceFlag, ...] = ()
    """Further flags whose levers need the same replacement (one target is patched once, whichever asks)."""

    @property
    def flags(self) -> tuple[Flag | ChoiceFlag, ...]:
        """Every flag that turns this patch on: :attr:`flag` first, then :attr:`also`."""
        return (self.flag, *self.also)

    def wanted(self, values: dict[str, Any]) -> bool:
        """Whether any of :attr:`flags` is on in ``values`` (env-variable name -> value)."""
        return any(values.get(f.name) for f in self.flags)

    def factory(self) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """The implementation's factory, imported now."""
        return resolve(self.impl)

    def resolve(self, supported: str = "") -> tuple[Any, str, Callable[..., Any]]:
        """(owner object, attribute name, current value); raises :class:`UpstreamMismatch` if absent.

        A method target must be defined by the class the table names itself (in its ``__dict__``), not
        merely inherited: an upstream that stops defining it would otherwise pass the check and the patch
        would wrap a base class's stub (torch's ``Stateful.load_state_dict``, say).
        """
        module_name, _, path = self.target.partition(":")
        where = f" ({supported} supported)" if supported else ""
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError as e:
            raise UpstreamMismatch(f"{self.name}: cannot import {module_name} ({e}){where}") from None
        except Exception as e:  # a broken checkout (SyntaxError, an error raised at import): named, not a traceback
            raise UpstreamMismatch(f"{self.name}: importing {module_name} failed ({type(e).__name__}: {e}){where}"
                                   ) from None
        *parents, attr = path.split(".")
        for part in parents:
            if not hasattr(owner, part):
                raise UpstreamMismatch(f"{self.name}: {module_name} has no {path}{where}")
            owner = getattr(owner, part)
        if not hasattr(owner, attr):
            raise UpstreamMismatch(f"{self.name}: {self.target} does not exist{where}")
        if isinstance(owner, type) and attr not in vars(owner):
            base = next((c.__qualname__ for c in owner.__mro__ if attr in vars(c)), "a base class")
            raise UpstreamMismatch(
                f"{self.name}: {self.target} is no longer defined by {owner.__qualname__} itself (only inherited "
                f"from {base}): this upstream is not one onecard supports{where}")
        return owner, attr, getattr(owner, attr)

    def check(self, supported: str) -> tuple[Any, str, Callable[..., Any]]:
        """Resolve and compare the signature; raises :class:`UpstreamMismatch` naming the target."""
        owner, attr, current = self.resolve(supported)
        original = getattr(current, "__wrapped__", current) if getattr(current, MARK, None) else current
        try:
            found = tuple(inspect.signature(original).parameters)
        except (TypeError, ValueError):
            found = ()
        if found not in self.params:
            expected = " or ".join(str(p) for p in self.params)
            raise UpstreamMismatch(
                f"{self.target} has parameters {found}, expected {expected}: this upstream is not one "
                f"onecard supports ({supported}); check out a supported commit or unset "
                f"{' and '.join(f.name for f in self.flags)}"
            )
        return owner, attr, current


class PatchSet:
    """A table of :class:`Patch` for one upstream, applied and reverted together.

    Args:
        upstream: label for messages (``cosmos-framework``).
        supported: the upstream commits this table was checked against, for error messages.
        patches: the table.
    """

    def __init__(self, upstream: str, supported: str, patches: list[Patch]):
        self.upstream = upstream
        self.supported = supported
        self.patches = patches
        self._applied: list[tuple[Patch, Any, str, Any]] = []

    def wanted(self, flags: dict[str, bool]) -> list[Patch]:
        """The patches whose flag is on in ``flags`` (env-variable name -> value)."""
        return [p for p in self.patches if p.wanted(flags)]

    def apply(self, flags: dict[str, bool]) -> list[str]:
        """Check every wanted target, then install every replacement; returns the patched targets.

        Raises:
            UpstreamMismatch: a target is missing or changed (nothing is patched then).
        """
        todo = self.wanted(flags)
        # All checks (targets and implementations) before any change.
        targets = [p.check(self.supported) for p in todo]
        checked = [(p, p.factory(), *t) for p, t in zip(todo, targets)]
        for p, factory, owner, attr, current in checked:
            if getattr(current, MARK, None) == p.name:
                continue  # already applied (a second apply in the same process)
            new = factory(current)
            setattr(new, MARK, p.name)
            new.__wrapped__ = current
            setattr(owner, attr, new)
            self._applied.append((p, owner, attr, current))
        return [p.target for p, *_ in checked]

    def revert(self) -> None:
        """Put back every original this set installed, newest first.

        A replacement that also changed something beside its target (a registry entry, say) carries an
        ``onecard_undo`` callable; it is called after the original is back.
        """
        while self._applied:
            _, owner, attr, original = self._applied.pop()
            undo = getattr(getattr(owner, attr), "onecard_undo", None)
            setattr(owner, attr, original)
            if callable(undo):
                undo()

    def status(self) -> list[tuple[str, str, bool]]:
        """``(name, target, patched now)`` for every patch in the table."""
        out = []
        for p in self.patches:
            try:
                _, _, current = p.resolve(self.supported)
                out.append((p.name, p.target, getattr(current, MARK, None) == p.name))
            except UpstreamMismatch:
                out.append((p.name, p.target, False))
        return out
