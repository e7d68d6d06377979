"""Typed config dataclasses: strict loading from a TOML-like mapping, field docs, command-line flags.

A recipe's config is a tree of ``@dataclasses.dataclass`` classes, one per TOML table, each field with a
type, a default and a docstring (a string literal right after the field, as in torchtitan's job config).
This module gives them three things:

- :func:`from_mapping` builds the tree from a parsed TOML dict, refusing an unknown table or key and a
  value of the wrong type with one :class:`ConfigError` naming it and what is accepted;
- :func:`field_docs` reads the field docstrings (for ``--help`` and error messages);
- :func:`add_arguments` / :func:`from_namespace` turn a flat dataclass into ``argparse`` flags and back
  (``lora_rank`` <-> ``--lora-rank``), so a command line and its config are one definition.

Numbers are checked for what they mean, not only for their type, in both directions (TOML and flags): every float
must be finite and every integer must fit a signed 64-bit integer (what torch and the OS take), unless a field's
:func:`meaning` says otherwise; a field's ``metadata["meaning"]`` (:class:`Meaning`) adds its range (``lr > 0``,
``0 <= beta < 1``, ``0 <= cfg_dropout <= 1``...). A value outside is one :class:`ConfigError` naming the key or flag,
the value, the range and the fix.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import math
import textwrap
import types
import typing
from typing import Any, Mapping, TypeVar

from .errors import UserError

T = TypeVar("T")


class ConfigError(UserError):
    """A config is unreadable, has an unknown table or key, or a value of the wrong type or meaning."""


@dataclasses.dataclass(frozen=True)
class Meaning:
    """What a numeric field (or each element of a numeric list) may be.

    ``gt``/``ge``/``lt``/``le``: exclusive / inclusive bounds (``None``: none). ``finite``: a float must be finite
    (no NaN, no infinity). ``bits``: an integer must satisfy ``-2**(bits-1) <= v < 2**(bits-1)``. ``allowed``: values
    accepted outside the bounds (``-1`` for "all ranks"). ``why``: what the field is, for the message.
    """

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    finite: bool = True
    bits: int = 64
    allowed: tuple[Any, ...] = ()
    why: str = ""

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is refused (``None`` when it is accepted)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None  # types are _check's
        if value in self.allowed:
            return None
        if isinstance(value, float) and self.finite and not math.isfinite(value):
            return "must be a finite number"
        if isinstance(value, int) and not -(1 << (self.bits - 1)) <= value < (1 << (self.bits - 1)):
            return f"does not fit a {self.bits}-bit signed integer"
        bounds = [(self.gt, ">", lambda v, b: v > b), (self.ge, ">=", lambda v, b: v >= b),
                  (self.lt, "<", lambda v, b: v < b), (self.le, "<=", lambda v, b: v <= b)]
        if any(b is not None and not ok(value, b) for b, _, ok in bounds):  # `not` also refuses NaN
            want = " and ".join(f"{op} {b:g}" for b, op, _ in bounds if b is not None)
            extra = f" (or {', '.join(map(str, self.allowed))})" if self.allowed else ""
            return f"must be {want}{extra}"
        return None


def meaning(**kw: Any) -> dict[str, Meaning]:
    """``dataclasses.field(metadata=meaning(gt=0, why="the learning rate"))``: the field's :class:`Meaning`."""
    return {"meaning": Meaning(**kw)}


DEFAULT_MEANING = Meaning()
"""A float must be finite, an integer must fit 64 bits: what every numeric field means at least."""


def check_meaning(value: Any, m: Meaning, where: str) -> None:
    """Check ``value`` (a number or a list of numbers) against ``m``.

    Raises:
        ConfigError: one line: ``<where> = <value> <problem>[ (<why>)]``.
    """
    for v in (value if isinstance(value, (list, tuple)) else [value]):
        why = m.problem(v)
        if why is not None:
            shown = repr(value) if not isinstance(value, (list, tuple)) else f"{list(value)!r}: element {v!r}"
            raise ConfigError(f"{where} = {shown} {why}" + (f" ({m.why})" if m.why else "") + ": fix the value")

@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """``{field name: docstring}`` of a dataclass whose fields carry a string literal after them."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_union(origin: Any) -> bool:
    """Whether a type's origin is a union (``Optional[X]``, ``X | None``)."""
    return origin is typing.Union or origin is types.UnionType


def _type_name(tp: Any) -> str:
    """How a message names what ``tp`` accepts: ``int``, ``one of ['all', 'auto']``, ``int or one of [...]``."""
    origin = typing.get_origin(tp)
    if _is_union(origin):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is typing.Literal:
        return f"one of {list(typing.get_args(tp))}"
    if tp is bool:
        return "true or false"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _toml(value: Any) -> str:
    """``value`` as TOML writes it (``true``, ``"text"``, ``[1, 2]``), for messages; anything else as Python's repr."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (int, float)):
        return repr(value)
    return str(value)


def _check(value: Any, tp: Any, where: str) -> Any:
    """``value`` converted to ``tp`` (int -> float only), or :class:`ConfigError` naming ``where``."""
    origin = typing.get_origin(tp)
    if _is_union(origin):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _check(value, a, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where} = {_toml(value)} has the wrong type: expected {_type_name(tp)}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} = {_toml(value)} has the wrong type: expected a list")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where} = {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }.get(tp, lambda v: True)(value)
    if not ok:
        raise ConfigError(f"{where} = {_toml(value)} has the wrong type: expected {_type_name(tp)}")
    return float(value) if tp is float else value


def from_mapping(cls: type[T], data: Mapping[str, Any], where: str = "config", table: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; nested dataclass fields take sub-tables.

    Missing keys keep their defaults. ``where`` (the file) and ``table`` (the dotted table path) only
    label messages.

    Raises:
        ConfigError: an unknown key or table, or a value of the wrong type.
    """
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    label = f"[{table}]" if table else "the top level"
    unknown = sorted(set(data) - set(fields))
    if unknown:
        subs = [n for n in fields if _is_dataclass_type(hints[n])]
        kind = "table(s)" if all(isinstance(data[k], Mapping) for k in unknown) else "key(s)"
        known = ", ".join(f"[{_join(table, s)}]" for s in subs) if kind == "table(s)" else ", ".join(sorted(fields))
        raise ConfigError(f"{where}: unknown {kind} {unknown} in {label}; known: {known}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        tp = hints[name]
        path = _join(table, name)
        if _is_dataclass_type(tp):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}: {path} must be a table [{path}], not {value!r}")
            kwargs[name] = from_mapping(tp, value, where, path)
        else:
            if isinstance(value, Mapping):
                raise ConfigError(f"{where}: [{path}] is not a table; {name} is a key of {label}")
            key = f"{where}: [{table}].{name}" if table else f"{where}: {name}"
            kwargs[name] = _check(value, tp, key)
            check_meaning(kwargs[name], fields[name].metadata.get("meaning", DEFAULT_MEANING), key)
    return cls(**kwargs)


def _join(table: str, name: str) -> str:
    return f"{table}.{name}" if table else name


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--kebab-name`` flag per field of the flat dataclass ``cls``, typed and documented from it.

    ``bool`` fields become ``store_true`` flags; ``list[X] | None`` fields take ``nargs="*"``; a field's
    ``metadata["choices"]`` limits its values.
    """
    docs = field_docs(cls)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_ = docs.get(f.name, "")
        if tp is bool:
            parser.add_argument(flag, action="store_true", default=default, help=help_)
            continue
        base = tp
        if _is_union(typing.get_origin(tp)):
            base = next(a for a in typing.get_args(tp) if a is not type(None))
        kw: dict[str, Any] = {"default": default, "help": help_ + (f" (default {default})" if default not in (None, "") else "")}
        if typing.get_origin(base) in (list, tuple):
            kw.update(nargs="*", type=typing.get_args(base)[0])
        else:
            kw["type"] = base
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        parser.add_argument(flag, **kw)


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    """Build the flat dataclass ``cls`` from an ``argparse`` namespace made by :func:`add_arguments`, every numeric
    value checked for its meaning (:func:`check_meaning`).

    Raises:
        ConfigError: a value outside its field's :class:`Meaning` (names the flag).
    """
    for f in dataclasses.fields(cls):
        value = getattr(ns, f.name)
        if value is not None:
            check_meaning(value, f.metadata.get("meaning", DEFAULT_MEANING), "--" + f.name.replace("_", "-"))
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
