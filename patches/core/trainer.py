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
4. :func:`loop` -- ``recipe.train_step(step)`` for every step left, a progress bar, and a checkpoint
   (``recipe.state_dict()`` on every rank, written by rank 0, with ``recipe.training_settings()``) wherever
   ``recipe.save_due(done)`` says.
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
import sys
import time
from pathlib import Path
from typing import Any

from . import settings as settingsmod
from .checkpoint import CheckpointManager
from .io import atomic_write_json
from .lock import hold_run_lock


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

    @abc.abstractmethod
    def summary(self, start: int, results: list[StepResult], checkpoint: Path | None) -> dict[str, Any]:
        """The run's summary (JSON-serialisable)."""

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
    found = recipe.checkpoints.load_latest(on_damaged=lambda _msg: None, mmap=True)
    if found is not None:
        path, state = found
        settingsmod.compare(state.get(settingsmod.KEY), recipe.training_settings(),
                            adjustable=recipe.adjustable_settings, checkpoint=str(path))


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
    found = recipe.checkpoints.load_latest(on_damaged=lambda msg: _report(recipe, f"warning: {msg}"))
    if found is None:
        recipe.warm_start()
        return 0
    path, state = found
    notes = settingsmod.compare(state.get(settingsmod.KEY), recipe.training_settings(),
                                adjustable=recipe.adjustable_settings, checkpoint=str(path))
    for note in notes:
        _report(recipe, note, file=sys.stdout)
    start = recipe.load_state_dict(state)
    recipe.on_resume(path, start)
    return start


def loop(recipe: Recipe, start: int) -> tuple[list[StepResult], Path | None]:
    """Step 4: train ``start .. max_steps``; returns the step results and the last checkpoint written."""
    from tqdm import tqdm

    results: list[StepResult] = []
    last: Path | None = None
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
            if recipe.save_due(done):
                state = recipe.state_dict()  # every rank: gathering a sharded state is collective
                state[settingsmod.KEY] = recipe.training_settings()
                saved = recipe.checkpoints.save(done, state)
                last = saved or last
    finally:
        bar.close()
    return results, last


def finish(recipe: Recipe, start: int, results: list[StepResult], checkpoint: Path | None) -> dict[str, Any]:
    """Step 5: the summary, written as ``summary.json`` on rank 0."""
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
