"""The one trainer skeleton every recipe runs in: build -> levers -> resume -> loop -> summary.

A recipe supplies its pieces as a :class:`Recipe` subclass (as torchtitan's ``ModelSpec`` or
diffusion-pipe's per-model class do); :func:`run` calls them in a fixed order, each step a short named
function here:

0. :func:`preflight` -- ``recipe.preflight()``: every input the user controls is checked (what
   ``--validate-only`` runs), then the settings of the newest checkpoint, if any, are compared with this
   run's (:mod:`patches.core.settings`). Nothing is built or written before both pass.
   The run folder is then locked (:func:`~patches.core.lock.hold_run_lock`): a second run into it stops
   with one error naming the process that holds it.
1. :func:`build` -- ``recipe.build(stack)``: data, model, optimizer: the stock recipe.
2. ``recipe.attach_levers(stack)``: the levers the flags ask for (each an object attached to what it
   acts on; the loop never branches on a flag).
3. :func:`resume` -- the newest readable checkpoint of :attr:`Recipe.checkpoints`, if any, goes to
   ``recipe.load_state_dict``; otherwise ``recipe.warm_start()``. Temporary files a killed save left and a
   damaged newest checkpoint (skipped for the one before it) are each reported in one line.
4. :func:`loop` -- ``recipe.train_step(step)`` for every step left, a progress bar, per-step metrics in TensorBoard
   event files (:class:`patches.core.metrics.MetricsLog`, fed by ``recipe.log_metrics``), and a checkpoint
   (``recipe.state_dict()`` on every rank, written by rank 0, with ``recipe.training_settings()``) wherever
   ``recipe.save_due(done)`` says; the free space for those checkpoints is checked in step 0.
5. :func:`finish` -- ``recipe.summary(...)``, written atomically as ``<run dir>/summary.json``.

Anything a recipe registers on ``stack`` (a background sampler, a worker thread) is closed whether the
run ends or raises. Bad input is a :class:`~patches.core.errors.UserError`, raised before anything is
written.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from . import settings as settingsmod
from .checkpoint import CheckpointManager
from .errors import UserError
from .io import atomic_write_json
from .lock import hold_run_lock

RECIPE_KEY = "onecard_recipe"
"""Checkpoint key naming the recipe that wrote it (:attr:`Recipe.recipe_name`)."""


@dataclasses.dataclass
class StepResult:
    """What one optimizer step reports to the loop."""

    loss: float
    """The step's training loss (the recipe's definition, summed over its micro-batches)."""
    samples: int = 0
    """Samples (pairs, clips) the step trained on."""
    seconds: float = 0.0
    """Wall time of the step, s (filled by :func:`loop` when the recipe leaves it 0)."""
    postfix: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra values for the progress bar (``{"peak_gib": "12.3"}``)."""


class Recipe(abc.ABC):
    """Per-recipe pieces of the skeleton. Subclasses set the attributes in ``preflight`` (or earlier).

    Attributes:
        run_dir: the run's output folder (``summary.json``, ``checkpoints/``).
        checkpoints: the run's :class:`CheckpointManager` (writing on rank 0 only).
        max_steps: the step count to train up to (the checkpoint unit: iterations, rollouts...).
        main_rank: whether this process prints and writes.
    """

    run_dir: Path
    checkpoints: CheckpointManager
    max_steps: int
    main_rank: bool = True
    unit: str = "step"
    """What one step of :meth:`train_step` is called in messages (``iteration``, ``rollout``)."""
    more_hint: str = "raise the step count to train further"
    """How to train further, shown when the run is already done."""
    adjustable_settings: frozenset[str] = frozenset()
    """Names in :meth:`training_settings` that may change between a run and its resume (applied, and said)."""

    def preflight(self) -> None:
        """Check every input the user controls, writing nothing (what ``--validate-only`` runs).

        Raises:
            UserError: one line naming the bad input and the fix.
        """

    def training_settings(self) -> dict[str, Any]:
        """The settings that decide what this run trains (stored in each checkpoint, compared on resume).

        A flat ``{name: JSON-like value}``, names spelled as the user sets them. Default: none.
        """
        return {}

    @abc.abstractmethod
    def build(self, stack: contextlib.ExitStack) -> None:
        """Build data, model and optimizer as the stock recipe does (the inputs passed :meth:`preflight`)."""

    def attach_levers(self, stack: contextlib.ExitStack) -> None:
        """Attach the levers the environment flags ask for (none by default)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's contents (called on every rank: gathering may be collective)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> int:
        """Restore a checkpoint; returns the number of steps it holds."""

    def warm_start(self) -> None:
        """Without a checkpoint: load the base weights the config names, if any."""

    @abc.abstractmethod
    def train_step(self, step: int) -> StepResult:
        """Train step ``step`` (0-based) and report it."""

    def save_due(self, done: int) -> bool:
        """Whether to write a checkpoint after ``done`` steps (default: at the end only)."""
        return done == self.max_steps

    def save_scope(self) -> contextlib.AbstractContextManager:
        """Context around one whole save (the state and the file), e.g. a memory phase (default: nothing)."""
        return contextlib.nullcontext()

    def saves_between(self, start: int, end: int) -> int:
        """How many checkpoints steps ``start + 1 .. end`` write (:meth:`save_due` counted; a recipe with a regular
        schedule overrides this with arithmetic, so that a huge step count costs nothing to check)."""
        return sum(1 for done in range(start + 1, end + 1) if self.save_due(done))

    @abc.abstractmethod
    def summary(self, start: int, results: list[StepResult], checkpoint: Path | None) -> dict[str, Any]:
        """The run's summary (JSON-serialisable)."""

    recipe_name: str = "recipe"
    """The recipe's name in its checkpoints (``cosmos3-edge``, ``minimax-h3``): a file of another recipe is refused."""
    checkpoint_keys: tuple[str, ...] = ()
    """The keys every checkpoint of this recipe holds (besides the skeleton's own)."""
    checkpoint_types: dict[str, type] = {}
    """The type each of those keys' values must have (``int`` also means >= 0 and not a bool)."""

    def warm_start_source(self) -> str:
        """What :meth:`warm_start` would load, as the user named it (``"BASE_CHECKPOINT_PATH=..."``; empty: none)."""
        return ""

    def checkpoint_bytes(self) -> int:
        """Bytes of one checkpoint file on disk, estimated after :meth:`preflight` (0: unknown, no space check)."""
        return 0

    def checkpoint_problem(self, state: Any) -> str | None:
        """Why ``state`` is not a checkpoint of this recipe (``None`` when it is): not a dict, another recipe's
        (its ``onecard_recipe`` tag), without one of :attr:`checkpoint_keys`, or one of another type than
        :attr:`checkpoint_types` says."""
        if not isinstance(state, dict):
            return f"it holds a {type(state).__name__}, not a checkpoint dict"
        tag = state.get(RECIPE_KEY)
        if tag is not None and tag != self.recipe_name:
            return f"it is a {tag} checkpoint, this run is {self.recipe_name}"
        missing = [k for k in self.checkpoint_keys if k not in state]
        if missing:
            return f"it lacks {missing}"
        for key, kind in self.checkpoint_types.items():
            value = state.get(key)
            if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0)):
                return f"its {key!r} is {type(value).__name__} {str(value)[:40]!r}, not a{' whole number >= 0' if kind is int else ' ' + kind.__name__}"
        return None

    metrics: Any = None
    """The run's :class:`patches.core.metrics.MetricsLog` while it trains (set by :func:`loop`)."""

    def log_metrics(self, step: int, **scalars: float | None) -> None:
        """Write this optimizer step's scalars (``loss``, ``lr``, ``grad_norm``, ``step_s``, ``samples_per_s``; the
        GPU peaks and host RSS are added here) to TensorBoard (and wandb); rank 0 only, nothing before the loop."""
        if self.metrics is None:
            return
        from .runtime import GiB, host_rss

        device = getattr(self, "device", None)
        if getattr(device, "type", "cpu") == "cuda":
            import torch

            scalars.setdefault("gpu_allocated_gib", torch.cuda.max_memory_allocated(device) / GiB)
            scalars.setdefault("gpu_reserved_gib", torch.cuda.max_memory_reserved(device) / GiB)
        scalars.setdefault("host_rss_gib", host_rss() / GiB)
        self.metrics.log(step, scalars)

    def on_resume(self, path: Path, step: int) -> None:
        """Say where the run resumes from (rank 0)."""
        if self.main_rank:
            print(f"onecard: resumed from {path} at {self.unit} {step}", flush=True)


def preflight(recipe: Recipe) -> None:
    """Step 0: the recipe's input checks, then its settings against the newest readable checkpoint's.

    The checkpoint is memory-mapped (only its small pickle is read) and read silently: :func:`resume`
    reports a damaged one.

    Raises:
        UserError: bad input; :class:`~patches.core.settings.SettingsChanged` when a resume would train
            something else than the run it continues.
    """
    recipe.preflight()
    if recipe.checkpoints.write and recipe.checkpoints.dir.exists():
        import tempfile

        try:
            os.close((probe := tempfile.mkstemp(prefix=".onecard-write-test-", dir=recipe.checkpoints.dir))[0])
            os.unlink(probe[1])
        except OSError as e:
            raise UserError(f"the checkpoint folder {recipe.checkpoints.dir} is not writable ({e.strerror}): make it "
                            "writable, or use another output folder") from None
    found = recipe.checkpoints.load_latest(on_damaged=lambda _msg: None, validate=recipe.checkpoint_problem, mmap=True)
    start = 0
    if found is not None:
        path, state = found
        settingsmod.compare(state.get(settingsmod.KEY), recipe.training_settings(),
                            adjustable=recipe.adjustable_settings, checkpoint=str(path))
        start = next((step for step, p in recipe.checkpoints.all() if p == path), 0)
    check_checkpoint_space(recipe, start)


def checkpoint_space_needed(size: int, existing: int, saves: int, keep: int) -> int:
    """Bytes the checkpoint folder must still take for ``saves`` more saves of ``size`` bytes each, with ``existing``
    checkpoints there and retention ``keep`` (0: all): the most files at once beyond the existing ones, a new file
    being complete before the oldest beyond ``keep`` is deleted (:meth:`CheckpointManager.prune`)."""
    if saves <= 0 or size <= 0:
        return 0
    if keep <= 0:
        return saves * size
    peak = max(existing, min(existing + saves - 1, keep)) + 1  # files at once while the last new one is written
    return max(0, peak - existing) * size


def check_checkpoint_space(recipe: Recipe, start: int) -> None:
    """The output folder can take this run's checkpoints (:func:`checkpoint_space_needed`), before anything trains.

    Raises:
        UserError: the free space of the checkpoint folder's file system is below the need (names both, and the fix).
    """
    import shutil

    size = int(recipe.checkpoint_bytes() or 0)
    if not size or not recipe.checkpoints.write:
        return
    saves = recipe.saves_between(start, recipe.max_steps)
    need = checkpoint_space_needed(size, len(recipe.checkpoints.all()), saves, recipe.checkpoints.keep)
    if not need:
        return
    where = recipe.checkpoints.dir
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need:
        gb = 1e9
        raise UserError(f"the checkpoint folder {recipe.checkpoints.dir} has {free / gb:.1f} GB free, and this run's "
                        f"checkpoints need {need / gb:.1f} GB ({saves} save(s) of {size / gb:.2f} GB, keeping "
                        f"{recipe.checkpoints.keep or 'every'}): free space, keep fewer checkpoints, or point the "
                        "output elsewhere")


def _disk_full(e: BaseException) -> bool:
    """Whether a failed write failed for space (``ENOSPC``, or torch's ``PytorchStreamWriter ... file write failed``)."""
    import errno

    text = str(e)
    return getattr(e, "errno", None) == errno.ENOSPC or "No space left" in text or "file write failed" in text


def build(recipe: Recipe, stack: contextlib.ExitStack) -> None:
    """Steps 1-2: the stock recipe, then its levers."""
    recipe.build(stack)
    recipe.attach_levers(stack)


def _report(recipe: Recipe, line: str, file=None) -> None:
    """One ``onecard:`` line from rank 0: on stderr by default (warnings a user should see, outside the
    progress bar), or on ``file``."""
    if recipe.main_rank:
        print(f"onecard: {line}", file=file or sys.stderr, flush=True)


def resume(recipe: Recipe) -> int:
    """Step 3: load the newest readable checkpoint (or warm-start); returns the first step to train.

    Says, one line each: the temporary files a killed save left (removed), a damaged checkpoint skipped for
    the one before it, and each adjustable setting the resume changes.
    """
    stale = recipe.checkpoints.clean_stale()
    if stale:
        _report(recipe, f"removed {len(stale)} temporary file(s) a killed save left in {recipe.checkpoints.dir} "
                     f"({', '.join(p.name for p in stale[:3])})")
    found = recipe.checkpoints.load_latest(on_damaged=lambda msg: _report(recipe, f"warning: {msg}"),
                                           validate=recipe.checkpoint_problem)
    if recipe.main_rank and recipe.checkpoints.damaged:
        moved = recipe.checkpoints.set_aside_damaged()
        if moved:
            _report(recipe, f"set aside {len(moved)} damaged checkpoint(s) as {', '.join(p.name for p in moved[:3])}: "
                            "no longer counted as checkpoints, so retention keeps the good ones")
    if found is None:
        if recipe.checkpoints.dir.exists() or (recipe.run_dir / "tensorboard").exists():
            _report(recipe, f"no checkpoint in {recipe.checkpoints.dir}: an earlier run here saved none, so this one "
                            f"starts at {recipe.unit} 0", file=sys.stdout)
        recipe.warm_start()
        return 0
    path, state = found
    if recipe.warm_start_source():
        _report(recipe, f"{recipe.warm_start_source()} is not used: the run resumes from its own checkpoint {path.name} "
                        "(a warm start applies to a new run folder only)", file=sys.stdout)
    notes = settingsmod.compare(state.get(settingsmod.KEY), recipe.training_settings(),
                                adjustable=recipe.adjustable_settings, checkpoint=str(path))
    for note in notes:
        _report(recipe, note, file=sys.stdout)
    start = recipe.load_state_dict(state)
    recipe.on_resume(path, start)
    return start


DIVERGED_RATIO = 1000.0
"""A loss this many times the run's first positive loss (or a non-finite loss) is reported as a diverging run."""


def divergence(losses: Sequence[float]) -> str | None:
    """Why the losses so far say the run diverges, or ``None``: the newest loss is non-finite, or above
    :data:`DIVERGED_RATIO` times the first finite positive loss of the run (random-init losses move by a few times at
    most; a learning rate far too high multiplies them by 1e6 and more within a few steps)."""
    if not losses:
        return None
    last = losses[-1]
    if not math.isfinite(last):
        return f"the loss is {last}"
    ref = next((x for x in losses if math.isfinite(x) and x > 0), None)
    if ref is not None and last > DIVERGED_RATIO * ref:
        return f"the loss rose from {ref:.4g} to {last:.4g}"
    return None


def loop(recipe: Recipe, start: int) -> tuple[list[StepResult], Path | None]:
    """Step 4: train ``start .. max_steps``; returns the step results and the last checkpoint written."""
    from tqdm import tqdm

    from .metrics import MetricsLog

    results: list[StepResult] = []
    last: Path | None = None
    warned = False
    recipe.metrics = MetricsLog(recipe.run_dir, enabled=recipe.main_rank, config=recipe.training_settings())
    bar = tqdm(total=recipe.max_steps, initial=start, disable=not recipe.main_rank, dynamic_ncols=True,
               file=sys.stdout, unit=recipe.unit)
    try:
        for step in range(start, recipe.max_steps):
            t0 = time.perf_counter()
            r = recipe.train_step(step)
            r.seconds = r.seconds or time.perf_counter() - t0
            results.append(r)
            bar.set_postfix(loss=f"{r.loss:.4f}", s_step=f"{r.seconds:.2f}", **r.postfix, refresh=False)
            bar.update(1)
            done = step + 1
            why = None if warned else divergence([x.loss for x in results])
            if why:
                warned = True
                _report(recipe, f"warning: {why} at {recipe.unit} {done}: the run is diverging (a learning rate far "
                                "too high?); it goes on as configured")
            if recipe.save_due(done):
                try:
                    with recipe.save_scope():
                        state = recipe.state_dict()  # every rank: gathering a sharded state is collective
                        state[settingsmod.KEY] = recipe.training_settings()
                        state[RECIPE_KEY] = recipe.recipe_name
                        saved = recipe.checkpoints.save(done, state)
                        del state
                except (OSError, RuntimeError) as e:
                    full = _disk_full(e)
                    if not full and not isinstance(e, OSError):
                        raise
                    kept = recipe.checkpoints.latest()
                    raise UserError(("the disk is full: " if full else "")
                                    + f"checkpoint {recipe.checkpoints.path(done)} could not be "
                                    f"written ({' '.join(str(e).split())[:120]}); "
                                    + (f"the previous checkpoint {kept} is intact" if kept else "no checkpoint was kept")
                                    + (": free space" if full else ": make the folder writable")
                                    + " and run the same command again to resume") from None
                last = saved or last
    finally:
        bar.close()
        recipe.metrics.close()
        recipe.metrics = None
    return results, last


def finish(recipe: Recipe, start: int, results: list[StepResult], checkpoint: Path | None) -> dict[str, Any]:
    """Step 5: the summary, written as ``summary.json`` on rank 0.

    Raises:
        UserError: every step of this run had a non-finite loss: nothing was learned, and a run that says it
            finished would hide it (no summary is written).
    """
    if results and not any(math.isfinite(r.loss) for r in results):
        raise UserError(f"every one of this run's {len(results)} {recipe.unit}(s) had a non-finite loss "
                        f"({results[-1].loss}): nothing was learned; lower the learning rate or the loss scale "
                        "and run again")
    summary = recipe.summary(start, results, checkpoint)
    if recipe.main_rank:
        path = atomic_write_json(recipe.run_dir / "summary.json", summary)
        print(f"onecard: summary {path}", flush=True)
    return summary


def nothing_to_do(recipe: Recipe, start: int) -> dict[str, Any]:
    """The run already holds ``max_steps``: say so, leave everything as it is, return the old summary."""
    if recipe.main_rank:
        print(f"onecard: nothing to do: the latest checkpoint is already at {recipe.unit} {start} >= "
              f"{recipe.max_steps}; {recipe.more_hint}", flush=True)
    old = recipe.run_dir / "summary.json"
    return json.loads(old.read_text()) if old.is_file() else {}


def run(recipe: Recipe) -> dict[str, Any]:
    """Check, lock, build, attach the levers, resume, train, summarise; returns the summary."""
    with contextlib.ExitStack() as stack:
        preflight(recipe)
        stack.enter_context(hold_run_lock(recipe.run_dir, enabled=recipe.main_rank))
        build(recipe, stack)
        start = resume(recipe)
        if start >= recipe.max_steps:
            return nothing_to_do(recipe, start)
        results, checkpoint = loop(recipe, start)
        return finish(recipe, start, results, checkpoint)
