"""Per-step training metrics where trainers' users read them: TensorBoard event files, and wandb when asked.

:class:`MetricsLog` writes one scalar per name and optimizer step into ``<run dir>/tensorboard/`` with
``torch.utils.tensorboard.SummaryWriter`` (TensorBoard reads the folder: ``tensorboard --logdir <run dir>``). With
``WANDB_PROJECT`` set and the ``wandb`` package importable, the same scalars also go to a wandb run of that project
(``WANDB_MODE`` etc. are wandb's own; nothing else is sent). Both recipes log the same names under ``train/``:

``loss``, ``lr``, ``grad_norm``, ``step_s`` (seconds of the optimizer step), ``samples_per_s``,
``gpu_allocated_gib`` / ``gpu_reserved_gib`` (peak during the step, GiB), ``host_rss_gib`` (after the step, GiB).

The writer queues events for a background thread (``SummaryWriter``'s own), so a step pays well under a millisecond
(``benchmarks/metrics_cost.py``); only rank 0 writes. A run resumed from a checkpoint appends to the same folder, at
the steps it trains. The writer opens at the first logged step with ``purge_step`` set to it, so the steps of a run
that was killed after its last checkpoint, and are now trained again, are shown once (TensorBoard hides the
earlier events at or after that step).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping

__all__ = ["MetricsLog", "NAMES"]

NAMES = ("loss", "lr", "grad_norm", "step_s", "samples_per_s", "gpu_allocated_gib", "gpu_reserved_gib", "host_rss_gib")
"""The scalars both recipes log, under ``train/<name>``."""


class MetricsLog:
    """Scalars per optimizer step into TensorBoard event files (and wandb with ``WANDB_PROJECT``).

    Args:
        run_dir: the run's folder; events go to ``run_dir/tensorboard``.
        enabled: ``False`` on ranks other than 0 (nothing is written or imported).
        config: the run's settings, recorded once (TensorBoard text, wandb config).
    """

    def __init__(self, run_dir: str | Path, *, enabled: bool = True, config: Mapping[str, Any] | None = None):
        self.dir = Path(run_dir) / "tensorboard"
        self.enabled = enabled
        self.config = dict(config or {})
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter  # imported here: a failing import fails before training

        self._writer_cls = SummaryWriter
        project = os.environ.get("WANDB_PROJECT", "").strip()
        if project:
            try:
                import wandb
            except ImportError:
                print("onecard: WANDB_PROJECT is set but wandb is not installed: metrics go to TensorBoard only",
                      flush=True)
            else:
                self._wandb = wandb.init(project=project, dir=str(self.dir.parent), config=self.config,
                                         resume="allow")

    def _open(self, first_step: int) -> None:
        """The event writer, opened at the first logged step: events a killed run wrote at ``first_step`` or later
        are purged from TensorBoard's view (``SummaryWriter(purge_step=...)``)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._tb = self._writer_cls(log_dir=str(self.dir), flush_secs=30, purge_step=first_step)
        if self.config:
            self._tb.add_text("settings", "\n".join(f"    {k}: {v}" for k, v in sorted(self.config.items())), first_step)

    def log(self, step: int, scalars: Mapping[str, float | None]) -> None:
        """Write ``scalars`` (``None`` and non-numbers skipped; NaN/inf written, TensorBoard shows them) at
        optimizer step ``step``."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in scalars.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is None:
            self._open(step)
        for name, value in clean.items():
            self._tb.add_scalar(f"train/{name}", value, step)
        if self._wandb is not None:
            self._wandb.log({f"train/{k}": v for k, v in clean.items() if math.isfinite(v)}, step=step)

    def close(self) -> None:
        """Flush and close (the skeleton calls it when the run ends or raises)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
