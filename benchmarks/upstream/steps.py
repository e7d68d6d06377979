"""Summarise a ``run_upstream.sh`` log: each optimizer step's time, loss, model time and data-loader wait, and MFU.

    python benchmarks/upstream/steps.py LOG [--json OUT] [--peak-tflops 989]

Reads the lines upstream's ``iter_speed`` callback writes (``Iteration N: ... | Loss: L | Time: S s``) and the
lines ``memcap.py`` writes with ``ONECARD_MEMCAP_STEPS=1`` (``micro-batch K S s samples [[text, vision], ...]``, one per
``training_step``, timed between two CUDA synchronisations). For step N (N >= 2; step 1 includes compile and the
pre-pass) the micro-batches are the ``grad_accum_iter`` calls that end it; its **loader wait** is the step's time minus
the sum of their times (what the step spent outside ``training_step``: upstream's data loader, callbacks, logging).
A step whose micro-batches are all timed but whose ``Iteration`` line is missing (a run stopped by
``ONECARD_MEMCAP_STOP_AFTER`` ends before upstream logs its last step) is summarised without its wall time, loss,
loader wait and wall MFU. Where the edge preset cannot be built (no diffusers with Cosmos3, e.g. beside upstream's
own packages on the GPU machine) the times are summarised and MFU is left out, with a line that says why.
Model FLOPs per micro-batch are :func:`benchmarks.edge_24gb.model_flops` over its logged ``(text, vision)`` split
with the recipe's trainable keys (``toml/vision_sft_edge_24gb.toml``); MFU is against ``--peak-tflops``
(default: the H100/H200 dense-BF16 datasheet, 989 TFLOP/s). Prints one line per step from step 2.

Exit status 2 with one ``error:`` line when the log does not exist or holds no timed micro-batch.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

ITER = re.compile(r"Iteration (\d+):.*?Loss: ([-\d.eE+naninf]+).*?Time: ([\d.]+)s")
MICRO = re.compile(r"micro-batch (\d+) ([\d.]+) s samples (\[\[.*?\]\])")
PEAK = re.compile(r"peak allocated ([\d.]+) GiB, peak reserved ([\d.]+) GiB")
KEYS = ["moe_gen", "time_embedder", "vae2llm", "llm2vae", "k_norm_und_for_gen"]
"""``keys_to_select`` of ``toml/vision_sft_edge_24gb.toml`` (what the recipe trains)."""


def summarise(text: str, grad_accum_iter: int, peak_tflops: float, flops_of=None) -> dict:
    """The log's steps as a dict (``steps``: one entry per optimizer step from step 2, ``peak_gib``, ``micro_batch_s``).

    ``flops_of(samples) -> FLOPs`` (default: the edge preset's :func:`model_flops` with :data:`KEYS`).
    """
    mfu_note = None
    if flops_of is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        try:
            from benchmarks.edge_24gb import model_flops, pathway_params

            p = pathway_params("edge", KEYS)
        except ImportError as e:  # e.g. on the GPU machine, beside upstream's own older diffusers
            mfu_note = f"MFU not computed: the edge preset's FLOPs need README's install ({e})"
        else:
            def flops_of(samples):
                return model_flops(samples, p)

    micro = [(float(m.group(2)), json.loads(m.group(3))) for m in MICRO.finditer(text)]
    iters = {int(m.group(1)): (float(m.group(3)), float(m.group(2))) for m in ITER.finditer(text)}
    steps = []
    # every step from 2 whose micro-batches are all timed; its wall time only where upstream logged the step (a run
    # stopped by ONECARD_MEMCAP_STOP_AFTER ends before upstream's line for its last step)
    for n in range(2, len(micro) // grad_accum_iter + 1):
        mb = micro[(n - 1) * grad_accum_iter:n * grad_accum_iter]
        model_s = sum(s for s, _ in mb)
        flops = sum(flops_of([tuple(x) for x in samples]) for _, samples in mb) if flops_of else None
        wall, loss = iters.get(n, (None, None))
        steps.append({"step": n, "s": wall, "loss": loss, "model_s": round(model_s, 2),
                      "loader_wait_s": None if wall is None else round(wall - model_s, 2),
                      "s_per_micro_batch": None if wall is None else round(wall / len(mb), 4),
                      "model_mean_s": round(model_s / len(mb), 4),
                      # the plain micro-batches (the last one also runs the optimizer step), or the only one
                      "model_median_s": statistics.median(s for s, _ in (mb[:-1] or mb)),
                      "optimizer_micro_batch_s": mb[-1][0],
                      "tflop_per_micro_batch": None if flops is None else round(flops / len(mb) / 1e12, 1),
                      "mfu_model": None if flops is None else round(flops / model_s / (peak_tflops * 1e12), 4),
                      "mfu_wall": None if flops is None or wall is None else
                      round(flops / wall / (peak_tflops * 1e12), 4)})
    peak = PEAK.findall(text)
    return {"grad_accum_iter": grad_accum_iter, "peak_tflops": peak_tflops, "steps": steps, "mfu_note": mfu_note,
            "peak_gib": {"allocated": float(peak[-1][0]), "reserved": float(peak[-1][1])} if peak else None,
            "micro_batch_s": [s for s, _ in micro]}


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); bad input: one ``error:`` line, exit 2."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from patches.core.errors import cli

    return cli(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    from benchmarks.checks import at_least, positive
    from patches.core.errors import ArgumentParser, UserError

    ap = ArgumentParser(prog="steps.py", description=__doc__.split("\n")[0])
    ap.add_argument("log", type=Path, help="the log run_upstream.sh wrote (its LOG), from a run with ONECARD_MEMCAP_STEPS=1")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    ap.add_argument("--grad-accum-iter", type=int, default=61,
                    help="micro-batches per optimizer step, as the run's recipe sets it (default 61)")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="the card's dense bf16 peak in TFLOP/s, for MFU (default 989: H100/H200 datasheet)")
    a = ap.parse_args(argv)
    at_least("--grad-accum-iter", a.grad_accum_iter, 1, "micro-batches per optimizer step")
    positive("--peak-tflops", a.peak_tflops, "TFLOP/s")
    if not a.log.is_file():
        raise UserError(f"{a.log} is not a file: pass the log run_upstream.sh wrote (LOG=...)")
    s = summarise(a.log.read_text(errors="replace"), a.grad_accum_iter, a.peak_tflops)
    if not s["micro_batch_s"]:
        raise UserError(f"{a.log} holds no timed micro-batch: run the harness with ONECARD_MEMCAP_STEPS=1")
    if not s["steps"]:
        print(f"no step from step 2 has all its {a.grad_accum_iter} micro-batches timed ({len(s['micro_batch_s'])} "
              "timed): step 1 includes compile and the pre-pass, so nothing is summarised")
    for st in s["steps"]:
        wall = ("wall not logged (the run stopped before upstream's line for it)" if st["s"] is None else
                f"{st['s']:.2f} s (loss {st['loss']})")
        per = "" if st["s"] is None else (f", loader wait {st['loader_wait_s']:.2f} s, {st['s_per_micro_batch']:.3f} s "
                                          "per micro-batch")
        mfu = "" if st["mfu_model"] is None else (
            f", MFU {st['mfu_model']:.1%} (model)" + ("" if st["mfu_wall"] is None else f" / {st['mfu_wall']:.1%} (wall)"))
        print(f"step {st['step']}: {wall}, model {st['model_s']:.2f} s (mean {st['model_mean_s']:.3f} s){per}, model "
              f"median {st['model_median_s']:.3f} s{mfu}")
    if s["mfu_note"]:
        print(s["mfu_note"])
    if a.json:
        a.json.write_text(json.dumps(s, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
