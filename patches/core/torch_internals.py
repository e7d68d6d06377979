"""The torch internals the FSDP2 levers touch, in one guarded table, checked once.

The exact pinned arena (``miles_ext.levers.pinned``), the side-stream host-to-device prefetch
(``miles_ext.levers.h2d_prefetch``, which rebinds two ``FSDPParamGroup`` methods per unit), lockstep micro-batches
(``miles_ext.levers.lockstep``, which toggles each unit's reshard-after-forward and rebinds the root's
``post_forward``), the low-RAM init
(``miles_ext.levers.fast_init``), the FSDP2 policy (``miles_ext.levers.fsdp_policy``) and the compact frozen storage
of an already-wrapped model (``cosmos_framework_ext.levers.frozen_bf16.WrappedFrozenBF16``, upstream's order) read and
rebind private attributes of FSDP2 (``torch.distributed.fsdp._fully_shard``), the most volatile code onecard relies
on. Every such attribute is listed in :data:`INTERNALS` with what it must be: a method with one of the expected
parameter lists, or an attribute the class assigns to ``self`` (read from the class's source) or defines.
:func:`require` checks the whole table once per process before any lever touches FSDP2 and raises
:class:`~patches.core.errors.UpstreamMismatch` naming the first entry that does not match, the torch version found and
the versions this table was checked against -- one line, before any work, instead of an ``AttributeError`` in the
middle of a step. ``python -m patches status`` prints the table's state."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import textwrap

from patches.core.errors import UpstreamMismatch

__all__ = ["SUPPORTED", "Internal", "INTERNALS", "check", "fsdp_param_groups", "require", "status"]

SUPPORTED = "torch 2.11 and 2.13"
"""The torch releases whose FSDP2 internals this table was checked against."""

_FS = "torch.distributed.fsdp._fully_shard"


@dataclasses.dataclass(frozen=True)
class Internal:
    """One torch internal a lever relies on."""

    name: str
    """Short name, e.g. ``fsdp2.group.unshard``."""
    target: str
    """``"module:Class.attr"`` (a method), or ``"module:Class"`` with :attr:`fields`."""
    used_by: str
    """The lever(s) that need it, for the message."""
    params: tuple[tuple[str, ...], ...] = ()
    """Accepted parameter-name lists of a method (``self`` included)."""
    fields: tuple[tuple[str, ...], ...] = ()
    """Attributes instances must carry: each inner tuple is satisfied by any one of its names (a release that renamed
    an attribute, e.g. ``_fsdp_param_group`` / ``_fsdp_param_groups``)."""


INTERNALS: tuple[Internal, ...] = (
    Internal("fsdp2.module.get_fsdp_state", "torch.distributed.fsdp:FSDPModule._get_fsdp_state",
             "pinned arena, H2D prefetch, FSDP2 policy, compact frozen (wrapped)", params=(("self",),)),
    Internal("fsdp2.state.fields", f"{_FS}._fsdp_state:FSDPState", "pinned arena, FSDP2 policy",
             fields=(("_fsdp_param_group", "_fsdp_param_groups"), ("_modules",))),
    Internal("fsdp2.group.unshard", f"{_FS}._fsdp_param_group:FSDPParamGroup.unshard", "H2D prefetch",
             params=(("self", "async_op"),)),
    Internal("fsdp2.group.wait_for_unshard", f"{_FS}._fsdp_param_group:FSDPParamGroup.wait_for_unshard",
             "H2D prefetch", params=(("self",),)),
    Internal("fsdp2.group.fields", f"{_FS}._fsdp_param_group:FSDPParamGroup",
             "H2D prefetch, pinned arena, compact frozen (wrapped)",
             fields=(("fsdp_params",), ("device",), ("_all_gather_result",), ("mp_policy",))),
    Internal("fsdp2.group.post_forward", f"{_FS}._fsdp_param_group:FSDPParamGroup.post_forward", "lockstep",
             params=(("self", "module", "input", "output"),)),
    Internal("fsdp2.group.lockstep_fields", f"{_FS}._fsdp_param_group:FSDPParamGroup", "lockstep",
             fields=(("post_forward_mesh_info",), ("_training_state",), ("is_unsharded",), ("fsdp_params",))),
    Internal("fsdp2.training_state.forward", f"{_FS}._fsdp_common:TrainingState", "lockstep",
             fields=(("FORWARD",),)),
    Internal("fsdp2.param.lockstep_fields", f"{_FS}._fsdp_param:FSDPParam", "lockstep",
             fields=(("unsharded_param",), ("reduce_dtype",), ("orig_dtype",), ("sharded_size",),
                     ("offload_to_cpu",), ("sharded_param",))),
    Internal("fsdp2.param.setattr_on_modules", f"{_FS}._fsdp_param:FSDPParam._setattr_on_modules",
             "pinned arena, low-RAM init", params=(("self", "param"),)),
    Internal("fsdp2.param.reset_sharded_param", f"{_FS}._fsdp_param:FSDPParam.reset_sharded_param",
             "compact frozen (wrapped)", params=(("self",),)),
    Internal("fsdp2.param.init_dtype_attrs", f"{_FS}._fsdp_param:FSDPParam.init_dtype_attrs",
             "compact frozen (wrapped)", params=(("self", "mp_policy"),)),
    Internal("fsdp2.param.to_sharded_dtensor", f"{_FS}._fsdp_param:FSDPParam.to_sharded_dtensor",
             "pinned arena", params=(("self", "tensor"),)),
    Internal("fsdp2.param.fields", f"{_FS}._fsdp_param:FSDPParam",
             "pinned arena, H2D prefetch, low-RAM init, compact frozen (wrapped)",
             fields=(("_sharded_param_data",), ("_param_fqn",), ("_orig_size",), ("sharded_param",),
                     ("offload_to_cpu",), ("pin_memory",), ("fsdp_placement",), ("padded_sharded_param_size",),
                     ("orig_dtype",), ("param_dtype",))),
)
"""Every FSDP2 internal the FSDP2 levers touch."""


def _owner(target: str) -> tuple[object, str]:
    module_name, _, path = target.partition(":")
    obj: object = importlib.import_module(module_name)
    *parents, attr = path.split(".")
    for part in parents:
        obj = getattr(obj, part)
    return obj, attr


def _assigned_fields(cls: type) -> set[str]:
    """Attributes the class's own source assigns to ``self`` (``self.x = ...``, ``self.x: T = ...``, tuples)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return set()
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}


def problem(entry: Internal) -> str | None:
    """Why ``entry`` does not hold in this torch (``None`` when it does)."""
    try:
        owner, attr = _owner(entry.target)
        obj = getattr(owner, attr)
    except (ImportError, AttributeError) as e:
        return f"{entry.target} is missing ({type(e).__name__}: {e})"
    if entry.params:
        try:
            found = tuple(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            found = ()
        if found not in entry.params:
            return f"{entry.target} has parameters {found}, expected {' or '.join(map(str, entry.params))}"
    if entry.fields:
        have = _assigned_fields(obj) if isinstance(obj, type) else set()
        missing = [alts for alts in entry.fields
                   if not any(a in have or hasattr(obj, a) for a in alts)]
        if missing:
            names = ", ".join(" or ".join(alts) for alts in missing)
            return f"{entry.target} no longer has {names}"
    return None


def check(table: tuple[Internal, ...] = INTERNALS) -> list[tuple[Internal, str | None]]:
    """``(entry, problem or None)`` for every entry of ``table`` (imports what it names, changes nothing)."""
    return [(e, problem(e)) for e in table]


@functools.lru_cache(maxsize=None)
def _require_cached(table: tuple[Internal, ...]) -> None:
    import torch

    for entry, why in check(table):
        if why is not None:
            raise UpstreamMismatch(
                f"torch {torch.__version__}: {why} ({entry.name}, used by {entry.used_by}): onecard's FSDP2 levers "
                f"support {SUPPORTED}; install one of those, or turn that lever off")


def require(table: tuple[Internal, ...] | None = None) -> None:
    """Check ``table`` once per process; a mismatch raises :class:`~patches.core.errors.UpstreamMismatch`.

    Raises:
        UpstreamMismatch: the first entry that does not hold, with the torch version and :data:`SUPPORTED`.
    """
    _require_cached(INTERNALS if table is None else table)


def fsdp_param_groups(model) -> list:
    """Every ``FSDPParamGroup`` of ``model``'s FSDP2 units, in module order, each once (torch 2.11's
    ``_fsdp_param_group`` and 2.13's ``_fsdp_param_groups``: private attributes, checked by :func:`require`)."""
    from torch.distributed.fsdp import FSDPModule

    out: list = []
    seen: set[int] = set()
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        if id(state) in seen:
            continue
        seen.add(id(state))
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        out.extend(groups)
    return out


def status() -> list[tuple[str, str, str]]:
    """``(name, target, "ok" or the problem)`` for every entry (for ``python -m patches status``)."""
    return [(e.name, e.target, why or "ok") for e, why in check()]
