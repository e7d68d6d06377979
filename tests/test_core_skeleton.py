"""The trainer skeleton's run outputs on a toy recipe: checkpoint retention, the summary schema, TensorBoard metrics,
and the helpers other tests drive it with (:class:`ToyRecipe`, :func:`run_toy`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from patches.core.checkpoint import CheckpointManager
from patches.core.errors import cli
from patches.core.trainer import Recipe, StepResult, run


class ToyRecipe(Recipe):
    """A recipe whose step ``i`` has loss ``i``; the checkpoint holds ``x`` (steps done) and a 1 KB tensor."""

    recipe_name = "toy"
    checkpoint_keys = ("x",)

    def __init__(self, run_dir: Path, max_steps: int, save_every: int = 1, keep: int = 0):
        self.run_dir, self.max_steps, self.save_every = Path(run_dir), max_steps, save_every
        self.checkpoints = CheckpointManager(self.run_dir, keep=keep)
        self.x = 0
        self.device = torch.device("cpu")

    def build(self, stack):
        pass

    def state_dict(self):
        return {"x": self.x, "w": torch.full((256,), float(self.x))}

    def load_state_dict(self, state):
        self.x = state["x"]
        return self.x

    def train_step(self, step):
        self.x = step + 1
        self.log_metrics(self.x, loss=float(step), lr=1e-3, grad_norm=0.5, step_s=0.01, samples_per_s=100.0)
        return StepResult(loss=float(step), samples=1, seconds=0.01)

    def save_due(self, done):
        return done % self.save_every == 0 or done == self.max_steps

    def summary(self, start, results, checkpoint):
        from patches.core.summary import run_summary

        return run_summary(recipe=self.recipe_name, preset="toy", device=self.device, world_size=1, unit="step",
                           steps=len(results), optimizer_steps_total=self.max_steps, resumed_from=start,
                           reached=self.max_steps, losses=[r.loss for r in results], s_per_step_median=0.01,
                           peak_host_rss_gib=0.0, pinned_bytes=0, checkpoint=checkpoint)


def run_toy(recipe: ToyRecipe) -> int:
    """Run ``recipe`` as a command line does: 0, or 2 with one ``error:`` line."""
    return cli(lambda: run(recipe) and 0)


@pytest.mark.parametrize("keep,left", [(0, [1, 2, 3, 4, 5]), (1, [5]), (2, [4, 5]), (3, [3, 4, 5])])
def test_retention_keeps_the_newest_n_and_never_the_one_being_written(tmp_path, keep, left):
    recipe = ToyRecipe(tmp_path, 5, keep=keep)
    deleted_while_writing: list[int] = []
    real_save = recipe.checkpoints.save

    def watching(step, state):  # the files there while the new one is written: nothing older is gone yet
        before = [s for s, _ in recipe.checkpoints.all()]
        path = real_save(step, state)
        deleted_while_writing.extend(s for s in before if s not in [t for t, _ in recipe.checkpoints.all()]
                                     and s >= step)
        return path

    recipe.checkpoints.save = watching
    assert run_toy(recipe) == 0
    assert [s for s, _ in recipe.checkpoints.all()] == left
    assert deleted_while_writing == []
    assert (tmp_path / "checkpoints" / "latest_checkpoint.txt").read_text() == "iter_000000005.pt\n"


def test_planted_retention_that_deletes_before_the_write_completes_is_caught(tmp_path):
    """Planted: pruning before the new file is written -- a failing write would then leave no checkpoint."""
    cm = CheckpointManager(tmp_path, keep=1)
    cm.save(1, {"x": 1})

    def failing(obj, path):
        raise OSError(28, "No space left on device")

    import patches.core.checkpoint as ck

    real = ck.atomic_torch_save
    ck.atomic_torch_save = failing
    try:
        cm.prune(cm.path(2))  # what a save that prunes first would do
        with pytest.raises(OSError):
            cm.save(2, {"x": 2})
    finally:
        ck.atomic_torch_save = real
    assert cm.all() == []  # the planted order lost the only checkpoint; the real save prunes only after the write
    cm.save(3, {"x": 3})
    ck.atomic_torch_save = failing
    try:
        with pytest.raises(OSError):
            cm.save(4, {"x": 4})
    finally:
        ck.atomic_torch_save = real
    assert [s for s, _ in cm.all()] == [3]


def test_summary_follows_the_schema_and_counts_a_resume(tmp_path):
    from patches.core.summary import COMMON, SCHEMA, missing_keys

    recipe = ToyRecipe(tmp_path, 3)
    assert run_toy(recipe) == 0
    again = ToyRecipe(tmp_path, 5)
    summary = run(again)
    assert missing_keys(summary) == [] and summary["schema"] == SCHEMA and set(COMMON) <= set(summary)
    assert (summary["steps"], summary["resumed_from"], summary["reached"]) == (2, 3, 5)
    assert summary["losses"] == [3.0, 4.0] and summary["last_loss"] == 4.0
    assert missing_keys({k: v for k, v in summary.items() if k != "reached"}) == ["reached"]  # planted: a key lost


def test_metrics_are_written_as_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from patches.core.metrics import NAMES

    assert run_toy(ToyRecipe(tmp_path, 4)) == 0
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {f"train/{n}" for n in NAMES if not n.startswith("gpu_")} <= tags
    loss = acc.Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(1, 0.0), (2, 1.0), (3, 2.0), (4, 3.0)]


def test_steps_trained_again_after_a_kill_are_shown_once(tmp_path):
    """A run killed after logging steps 1-2 but before any checkpoint: the next run trains from step 1 again, and
    TensorBoard shows steps 1, 2, 3 once each (the writer's ``purge_step``), with the new run's values. Planted: a
    writer opened without ``purge_step`` shows the killed run's steps twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from patches.core.metrics import MetricsLog

    def steps(folder):
        acc = EventAccumulator(str(folder))
        acc.Reload()
        return [(e.step, e.value) for e in acc.Scalars("train/loss")]

    killed = MetricsLog(tmp_path / "a")
    for step in (1, 2):
        killed.log(step, {"loss": 10.0 + step})
    killed.close()
    again = MetricsLog(tmp_path / "a")
    for step in (1, 2, 3):
        again.log(step, {"loss": float(step)})
    again.close()
    assert steps(tmp_path / "a" / "tensorboard") == [(1, 1.0), (2, 2.0), (3, 3.0)]

    for values in ({1: 11.0, 2: 12.0}, {1: 1.0, 2: 2.0, 3: 3.0}):  # planted: no purge_step
        w = SummaryWriter(log_dir=str(tmp_path / "b"))
        for step, v in values.items():
            w.add_scalar("train/loss", v, step)
        w.close()
    assert len(steps(tmp_path / "b")) == 5


class _Exploding(ToyRecipe):
    """Losses 2, 3, then 5e3 (above 1000 x the first): a run whose learning rate is far too high."""

    def train_step(self, step):
        r = super().train_step(step)
        r.loss = [2.0, 3.0, 5e3, 1e9][step]
        return r


def test_a_diverging_run_says_so_once(tmp_path, capsys):
    """The skeleton warns once, at the step the loss passes 1000 x the first positive loss, and the run goes on.
    The rule by hand: non-finite or above the ratio is divergence; a few-fold rise, a falling loss, a leading zero
    loss and no losses are not (planted: the same rule at a 1.5 x ratio would call the 2 -> 3 rise divergence)."""
    from patches.core import trainer

    assert run_toy(_Exploding(tmp_path, 4)) == 0
    err = capsys.readouterr().err
    assert err.count("the run is diverging") == 1 and "the loss rose from 2 to 5000 at step 3" in err
    assert trainer.divergence([14.9, 14.9, 3.5e11]) == "the loss rose from 14.9 to 3.5e+11"
    assert trainer.divergence([1.0, float("nan")]) == "the loss is nan"
    assert trainer.divergence([0.0, 2.0, 900.0]) is None and trainer.divergence([]) is None
    assert trainer.divergence([14.9, 3.0, 40.0]) is None
    real = trainer.DIVERGED_RATIO
    trainer.DIVERGED_RATIO = 1.5  # planted
    try:
        assert trainer.divergence([2.0, 3.1]) is not None
    finally:
        trainer.DIVERGED_RATIO = real


class _Scoped(ToyRecipe):
    """Records, for each checkpoint written, whether the state and the file were both made inside ``save_scope``."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.inside, self.seen = False, []
        real = self.checkpoints.save

        def save(step, state):
            self.seen.append(("file", self.inside))
            return real(step, state)

        self.checkpoints.save = save

    def save_scope(self):
        import contextlib

        @contextlib.contextmanager
        def scope():
            self.inside = True
            try:
                yield
            finally:
                self.inside = False

        return scope()

    def state_dict(self):
        self.seen.append(("state", self.inside))
        return super().state_dict()


def test_the_whole_save_runs_inside_the_recipes_save_scope(tmp_path):
    """The state and the file of every checkpoint inside ``save_scope`` (the Cosmos recipe's memory phase, so its host
    peak is the save's)."""
    recipe = _Scoped(tmp_path, 2)
    assert run_toy(recipe) == 0
    assert recipe.seen == [("state", True), ("file", True)] * 2
