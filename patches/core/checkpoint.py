"""One checkpoint manager for every recipe: atomic files, one naming scheme, resume from the newest good one.

Layout, under ``<run dir>/checkpoints/``::

    iter_000000012.pt          one file per saved step (9 digits; the step is the recipe's checkpoint
                               unit: an optimizer iteration for Cosmos, a rollout for MiniMax-H3)
    latest_checkpoint.txt      the newest file's name (what upstream cosmos-framework writes too)

A file is written under a temporary name and renamed (:func:`patches.core.io.atomic_torch_save`), so a
killed save never leaves a half file under a real name; the temporaries it may leave are removed by
:meth:`CheckpointManager.clean_stale`. :meth:`CheckpointManager.load_latest` tries the newest file first
and, if it cannot be read, says so and falls back to the next older one.

**Retention.** With ``keep = N > 0`` a save deletes the oldest checkpoints beyond the newest ``N``, only after the new
file is complete (renamed into place, the marker pointing at it), so the newest good checkpoint is never deleted and
a save killed at any moment leaves every file that was there before. ``keep = 0`` keeps every checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable

from .io import TMP_MARK, atomic_torch_save, atomic_write_text, map_tensors

MARKER = "latest_checkpoint.txt"
"""File naming the newest checkpoint."""
DIGITS = 9
"""Zero-padded width of the step number in a checkpoint's name."""
_NAME = re.compile(r"^iter_(\d+)\.pt$")


class CheckpointManager:
    """Save and find a run's checkpoints.

    Args:
        run_dir: the run's output folder; checkpoints go to ``run_dir/checkpoints``.
        write: whether this process writes (``False`` on ranks other than 0: they compute the state,
            which may need collectives, but rank 0 alone writes it).
        load_kw: default ``torch.load`` keywords of :meth:`load_latest` (e.g. ``{"mmap": True}``: tensors backed
            by the file's pages instead of a copy in memory).
        keep: checkpoints kept after each save, the new one included (0: all).

    Raises:
        ValueError: ``keep`` is negative.
    """

    def __init__(self, run_dir: str | Path, write: bool = True, load_kw: dict[str, Any] | None = None, keep: int = 0):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep must be a whole number >= 0 (0 keeps every checkpoint), got {keep!r}")
        self.dir = Path(run_dir) / "checkpoints"
        self.write = write
        self.load_kw = dict(load_kw or {})
        self.keep = keep
        self.damaged: list[Path] = []
        """The files the last :meth:`load_latest` skipped as damaged, newest first."""

    def path(self, step: int) -> Path:
        """``checkpoints/iter_<step, 9 digits>.pt``."""
        return self.dir / f"iter_{step:0{DIGITS}d}.pt"

    def save(self, step: int, state: dict[str, Any]) -> Path | None:
        """Write ``state`` as step ``step`` atomically, point the marker at it, then apply the retention
        (:meth:`prune`); ``None`` if not writing."""
        if not self.write:
            return None
        path = atomic_torch_save(state, self.path(step))
        atomic_write_text(self.dir / MARKER, path.name + "\n")
        self.prune(path)
        return path

    def prune(self, newest: Path) -> list[Path]:
        """Delete the oldest checkpoints so that :attr:`keep` remain, ``newest`` (the one just written) always among
        them; returns what was deleted. Nothing is deleted with ``keep = 0`` or on a rank that does not write."""
        if not self.write or self.keep <= 0:
            return []
        others = [p for _, p in self.all() if p != newest]
        doomed = others[: max(0, len(others) - (self.keep - 1))]
        for p in doomed:
            p.unlink(missing_ok=True)
        return doomed

    def all(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every checkpoint file, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _NAME.match(p.name))]
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest checkpoint file, or ``None`` when the run has none."""
        found = self.all()
        return found[-1][1] if found else None

    def load_latest(self, on_damaged: Callable[[str], None] | None = None,
                    validate: Callable[[Any], str | None] | None = None,
                    **load_kw: Any) -> tuple[Path, dict[str, Any]] | None:
        """Load the newest readable checkpoint of this run: ``(path, state)``, or ``None`` when there is none.

        A file that cannot be read (truncated, not a torch file), or that reads but is not a checkpoint of this run
        (``validate(state)`` returns why: an empty dict, another recipe's file), is reported and skipped for the next
        older one: the one-line report goes to ``on_damaged`` (default: a ``UserWarning``). ``load_kw`` go to
        ``torch.load`` (default ``map_location="cpu"``, ``weights_only=False``: the file is this run's own).
        """
        import torch

        load_kw = {"map_location": "cpu", "weights_only": False, **self.load_kw, **load_kw}
        found = self.all()
        self.damaged = []
        for i, (_, path) in reversed(list(enumerate(found))):
            try:
                state = torch.load(path, **load_kw)
            except Exception as e:  # noqa: BLE001 - any reader error means "damaged"
                why = " ".join(f"{type(e).__name__}: {e}".split())[:160]
            else:
                # outside the ``try``: a fault in the check itself is a bug to see, not a damaged file to skip
                problem = validate(state) if validate is not None else None
                if problem is None:
                    return path, state
                why = " ".join(f"ValueError: not a checkpoint of this run: {problem}".split())[:160]
            self.damaged.append(path)
            then = f"resuming from {found[i - 1][1].name} if it reads" if i else "no older one: starting anew"
            msg = f"checkpoint {path} is damaged ({why}); {then}"
            if on_damaged is None:
                warnings.warn(msg.replace(f"; {then}", "; trying the next older one"), stacklevel=2)
            else:
                on_damaged(msg)
        return None

    def set_aside_damaged(self) -> list[Path]:
        """Rename each file the last :meth:`load_latest` skipped to ``<name>.damaged`` (kept for a look, no longer a
        checkpoint: not the newest, not counted by retention, so ``keep`` never deletes a good checkpoint while a
        damaged one stays). Returns the new paths; nothing happens without ``write``."""
        moved = []
        for p in self.damaged if self.write else []:
            target = p.with_name(p.name + ".damaged")
            with contextlib.suppress(FileNotFoundError):  # another rank set it aside first
                os.replace(p, target)
                moved.append(target)
        self.damaged = []
        return moved

    def clean_stale(self) -> list[Path]:
        """Remove temporary files a killed save left in the checkpoint folder; returns what was removed."""
        if not self.write or not self.dir.is_dir():
            return []
        stale = [p for p in self.dir.iterdir() if p.name.startswith(".") and TMP_MARK in p.name]
        for p in stale:
            p.unlink(missing_ok=True)
        return stale


# ------------------------------------------------------------------------- full state at any world size
def gather_full_state(model: Any, optimizer: Any = None, *,
                      optimizer_on_every_rank: bool = False) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Full (unsharded) CPU copies of ``model.state_dict()`` (on every rank) and of ``optimizer``'s state.

    A collective at world size > 1 (call it on every rank): FSDP2 (DTensor) entries are gathered one tensor
    at a time with their global shapes, uneven shards included. The optimizer state is keyed by parameter name
    (torch's ``get_optimizer_state_dict`` with ``full_state_dict`` and ``cpu_offload``), so a checkpoint
    written at one world size loads at another; it is complete on global rank 0, the writer
    (:meth:`CheckpointManager.save`), and empty on the other ranks, which never hold a whole copy (with
    ``optimizer_on_every_rank``: complete everywhere, e.g. for a mesh that does not hold global rank 0).
    :func:`load_full_state` reads it back.
    """
    net = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().to("cpu", copy=True)
           for k, v in model.state_dict().items()}
    if optimizer is None:
        return net, None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=not optimizer_on_every_rank)
    return net, _to_cpu(get_optimizer_state_dict(model, optimizer, options=options))


def local_state(model: Any, optimizer: Any = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """At world size 1, what :func:`gather_full_state` gives there, as the live tensors rather than host copies.

    ``model.state_dict()`` (DTensors as their local tensor: the whole tensor at one rank) and ``optimizer``'s state
    keyed by parameter name (torch's ``get_optimizer_state_dict``, not gathered), each tensor where it lives, GPU or
    host. Saved through :func:`patches.core.io.atomic_torch_save`, the file is the same (every tensor written as a CPU
    tensor) while the host holds at most one tensor's copy at a time. Read-only use: the tensors are the training
    state itself.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from .runtime import to_local

    net = {k: to_local(v).detach() for k, v in model.state_dict().items()}
    if optimizer is None:
        return net, None
    options = StateDictOptions(full_state_dict=False)
    return net, map_tensors(get_optimizer_state_dict(model, optimizer, options=options),
                            lambda t: to_local(t).detach())


def load_full_state(model: Any, net: dict[str, Any], optimizer: Any = None, optim: dict[str, Any] | None = None) -> None:
    """Load full tensors (what :func:`gather_full_state` gives) into a model that may be FSDP2-sharded.

    Each rank slices its own shard out of the full tensor (:func:`patches.core.runtime.shard_of`); no
    collective runs. (torch's ``set_*_state_dict(full_state_dict=True)`` scatters only on the ranks whose
    shard shape differs from the full one, so a ``(1,)`` parameter on 2 ranks hangs one rank in a scatter.)

    Raises:
        KeyError: ``net`` lacks a key of ``model.state_dict()``.
        ValueError: a tensor's shape differs from the model's.
    """
    import torch

    from .runtime import as_dtensor, shard_of, to_local

    target = model.state_dict()
    missing = [k for k in target if k not in net]
    if missing:
        raise KeyError(f"the checkpoint lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for k, t in target.items():
            full = net[k]
            if tuple(full.shape) != tuple(t.shape):
                raise ValueError(f"checkpoint tensor {k} has shape {tuple(full.shape)}, the model's {tuple(t.shape)}")
            to_local(t).copy_(shard_of(full, getattr(t, "device_mesh", None), getattr(t, "placements", None)))
    if optimizer is None or optim is None:
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    params = dict(model.named_parameters())
    state: dict[str, Any] = {}
    for name, per_param in optim.get("state", {}).items():
        p = params.get(name)
        mesh = getattr(p, "device_mesh", None)
        state[name] = {}
        for k, v in per_param.items():
            if torch.is_tensor(v):  # a copy: the optimizer updates its state (even ``step``) in place
                sharded = mesh is not None and tuple(v.shape) == tuple(p.shape)
                v = shard_of(v, mesh, p.placements).clone() if sharded else v.clone()
                if sharded:
                    v = as_dtensor(v, mesh, p.placements, p.shape, p.stride())
            state[name][k] = v
    # torch rewrites the dict it is given: pass copies, so ``optim`` can be loaded again (another model)
    groups = copy.deepcopy(optim.get("param_groups", []))
    set_optimizer_state_dict(model, optimizer, optim_state_dict={"state": state, "param_groups": groups},
                             options=StateDictOptions(full_state_dict=False))


def _to_cpu(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))