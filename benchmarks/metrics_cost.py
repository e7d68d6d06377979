"""What the per-step metrics cost a training step: ``Recipe.log_metrics`` with TensorBoard on, against the same call
with metrics off, in one process.

``python benchmarks/metrics_cost.py [--steps 2000] [--out benchmarks/results]``

Both recipes log through :meth:`patches.core.trainer.Recipe.log_metrics` once per optimizer step: the scalars the
step already holds (loss, lr, grad norm, step time, samples/s), plus the GPU peaks and the host RSS read there, into
``<run>/tensorboard`` through ``SummaryWriter`` (its background thread writes the event file). This times that call
alone, ``--steps`` times, with a real ``SummaryWriter`` into a temporary folder, and the same call with metrics off
(the recipe's cost without TensorBoard), and reports per-step microseconds (median, p99, max), the final
flush-and-close, and the event file's bytes per step. The call is host-side only: on a GPU it adds two allocator
queries (``max_memory_allocated``/``max_memory_reserved``), no synchronisation. The step times it is compared with
are the newest measured ones (Cosmos 3.29 s per optimizer step at grad_accum_iter 8, H3 19 s per micro-batch).

Writes ``<date>_core_<device>_metrics-cost.{json,md}`` under ``--out``; bad arguments are one ``error:`` line, exit 2,
before anything runs.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.checks import at_least, folder_arg, free_targets, result_stem, write_together, writable_dir  # noqa: E402
from patches.core.errors import ArgumentParser, cli  # noqa: E402
from patches.core.trainer import Recipe  # noqa: E402

STEP_S = {"Cosmos3-Edge (s per optimizer step, 2026-12-01)": 3.29, "MiniMax-H3 33 B (s per micro-batch, 2026-11-30)": 19.0}


class _Run:
    """The part of a recipe ``log_metrics`` reads: ``metrics`` and ``device``."""

    log_metrics = Recipe.log_metrics

    def __init__(self, metrics, device):
        self.metrics, self.device = metrics, device


def _time(run: _Run, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``run.log_metrics`` with a fixed set of scalars."""
    out = []
    for step in range(1, steps + 1):
        t = time.perf_counter()
        run.log_metrics(step, loss=1.0 / step, lr=1e-4, grad_norm=2.5, step_s=3.29, samples_per_s=81.0)
        out.append(time.perf_counter() - t)
    return out


def _stats(seconds: list[float]) -> dict:
    us = sorted(s * 1e6 for s in seconds)
    return {"median_us": statistics.median(us), "p99_us": us[int(0.99 * (len(us) - 1))], "max_us": us[-1],
            "mean_us": statistics.fmean(us)}


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps to log (default 2000)")
    ap.add_argument("--out", type=folder_arg, default="benchmarks/results", help="folder for the result files")
    args = ap.parse_args(argv)
    at_least("--steps", args.steps, 1)
    out = writable_dir("--out", args.out)

    import torch

    from patches.core.metrics import MetricsLog

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    stem = result_stem("core", "metrics-cost", name)
    free_targets("--out", out, [stem + ".json", stem + ".md"])
    print(f"metrics cost: {args.steps} steps with metrics off, then on ({name})", flush=True)

    off = _stats(_time(_Run(None, device), args.steps))
    with tempfile.TemporaryDirectory() as tmp:
        log = MetricsLog(tmp, config={"recipe": "benchmark"})
        on_s = _time(_Run(log, device), args.steps)
        t = time.perf_counter()
        log.close()
        close_s = time.perf_counter() - t
        event_bytes = sum(p.stat().st_size for p in (Path(tmp) / "tensorboard").glob("*"))
    on = _stats(on_s)
    extra_us = on["median_us"] - off["median_us"]
    rows = {"date": stem[:10], "device": name, "torch": torch.__version__, "steps": args.steps,
            "metrics_off": off, "metrics_on": on, "extra_median_us_per_step": extra_us, "close_s": close_s,
            "event_bytes_per_step": event_bytes / args.steps,
            "share_of_step": {k: extra_us * 1e-6 / v for k, v in STEP_S.items()}}
    md = [f"{rows['date']}, {name}, torch {torch.__version__}; `benchmarks/metrics_cost.py --steps {args.steps}`: "
          "`Recipe.log_metrics` (5 scalars from the step + GPU peaks + host RSS) into TensorBoard event files, "
          "against metrics off, in one process.", "",
          "| metrics | median µs/step | p99 µs/step | max µs/step |", "|---|---|---|---|",
          f"| off | {off['median_us']:.1f} | {off['p99_us']:.1f} | {off['max_us']:.1f} |",
          f"| on (TensorBoard) | {on['median_us']:.1f} | {on['p99_us']:.1f} | {on['max_us']:.1f} |", "",
          f"Extra per step (median): {extra_us:.1f} µs; final flush and close {close_s * 1e3:.1f} ms; "
          f"event file {event_bytes / args.steps:.0f} bytes per step."]
    md += [f"Share of a step: {k}: {v * 100:.4f} %" for k, v in rows["share_of_step"].items()]
    write_together({out / (stem + ".json"): json.dumps(rows, indent=2) + "\n", out / (stem + ".md"): "\n".join(md) + "\n"})
    print("\n".join(md))
    print(f"wrote {out / (stem + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(cli(main))
