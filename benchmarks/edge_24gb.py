"""Stock vs levers for the Cosmos3-Edge 24 GB recipe, in ONE run on one GPU.

    python benchmarks/edge_24gb.py [--budget-gib 22.06] [--steps 7] [--out benchmarks/results]

The ``edge`` preset at cap 12288 (``benchmarks/edge_24gb.toml``: EMA on, grad_accum_iter 2; step 1 is
warm-up) runs under these configurations, one after another in this process:

1. stock on the uncapped card: EMA as a full fp32 clone on the GPU, VAE resident;
2. stock, card capped at ``--budget-gib`` with ``torch.cuda.set_per_process_memory_fraction``;
3. EMA lever only (``COSMOS_EMA_CPU_SUBSET=1``), capped;
4. VAE lever only (``COSMOS_VAE_CPU_OFFLOAD=1``), capped;
5. both levers, capped.

For each: peak allocated and reserved GiB, the ledger's predicted allocated peak and its error, median s
per micro-batch and per optimizer step (after warm-up), the EMA's time on the critical path per optimizer
step, VAE park + unpark time per micro-batch, host RSS peak and pinned bytes. A configuration that runs
out of memory is reported as such, with the peak it reached. Writes ``edge_24gb.json`` and
``edge_24gb.md`` into ``--out``.

Random weights: the timings and memory are those of the real architecture, the losses mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from cosmos_framework_ext import train  # noqa: E402
from patches.core.runtime import GiB  # noqa: E402

EMA, VAE = "COSMOS_EMA_CPU_SUBSET", "COSMOS_VAE_CPU_OFFLOAD"
CONFIGS = [
    ("stock, uncapped card", {EMA: "0", VAE: "0"}, False),
    ("stock", {EMA: "0", VAE: "0"}, True),
    ("EMA lever", {EMA: "1", VAE: "0"}, True),
    ("VAE lever", {EMA: "0", VAE: "1"}, True),
    ("both levers", {EMA: "1", VAE: "1"}, True),
]


def run_one(name: str, flags: dict[str, str], capped: bool, budget_gib: float, steps: int, out_root: str) -> dict:
    os.environ.update(flags, OUTPUT_ROOT=os.path.join(out_root, name.replace(" ", "_").replace(",", "")))
    if capped:
        os.environ["ONECARD_GPU_MEMORY_GIB"] = str(budget_gib)
    else:
        os.environ.pop("ONECARD_GPU_MEMORY_GIB", None)
        torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.reset_peak_memory_stats()
    args = train.parse_args(["--sft-toml", str(HERE / "edge_24gb.toml"), "--max-iter", str(steps), "--no-save"])
    t0 = time.perf_counter()
    row: dict = {"config": name, "capped_gib": budget_gib if capped else None}
    try:
        s = train.run(args)
    except torch.OutOfMemoryError as e:
        row.update(status="out of memory", peak_gpu_gib=torch.cuda.max_memory_allocated() / GiB,
                   peak_gpu_reserved_gib=torch.cuda.max_memory_reserved() / GiB, error=str(e).split("\n")[0][:300])
    else:
        vae = s["vae_offload"]
        row.update(
            status="ok",
            steps=s["steps"],
            peak_gpu_gib=s["peak_gpu_gib"],
            peak_gpu_reserved_gib=s["peak_gpu_reserved_gib"],
            predicted_gpu_gib=s["ledger"]["predicted_gpu_allocated_gib"],
            s_per_micro_batch=s["s_per_micro_batch_median"],
            s_per_step=s["s_per_step_median"],
            ema_critical_path_s=(s["ema"] or {}).get("critical_path_s_median"),
            vae_park_unpark_s_per_micro_batch=(
                (vae["park_seconds"] + vae["unpark_seconds"]) / max(vae["unpark_count"], 1) if vae else None),
            peak_host_rss_gib=s["peak_host_rss_gib"],
            pinned_gib=s["pinned_bytes"] / GiB,
            samples_per_step=s["samples_per_optimizer_step"],
        )
        row["ledger_error_pct"] = 100.0 * (row["predicted_gpu_gib"] - row["peak_gpu_gib"]) / row["peak_gpu_gib"]
    row["wall_s"] = time.perf_counter() - t0
    return row


def keep_timeline(name: str, out_root: str, dest: Path) -> None:
    """Copy the run's memory.csv / memory.png to ``dest/<config>.memory.{csv,png}``."""
    import shutil

    for f in Path(out_root, name.replace(" ", "_").replace(",", "")).rglob("memory.*"):
        shutil.copyfile(f, dest / f"{name.replace(' ', '_').replace(',', '')}.{f.name}")


def markdown(rows: list[dict], device: str, budget: float) -> str:
    def f(v, fmt):
        return "–" if v is None else format(v, fmt)

    head = (f"{time.strftime('%Y-%m-%d')}, {device}, torch {torch.__version__}; edge preset, cap 12288, "
            f"grad_accum_iter 2, EMA on; capped rows: card limited to {budget} GiB.\n\n"
            "| config | status | peak alloc GiB | peak reserved GiB | ledger GiB (err) | s/micro-batch | s/step | "
            "EMA critical path ms/step | VAE park+unpark ms/micro-batch | host RSS GiB | pinned GiB |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = ""
    for r in rows:
        pred = f"{r['predicted_gpu_gib']:.2f} ({r['ledger_error_pct']:+.1f} %)" if r.get("predicted_gpu_gib") else "–"
        ema = r.get("ema_critical_path_s")
        vae = r.get("vae_park_unpark_s_per_micro_batch")
        body += (f"| {r['config']} | {r['status']} | {f(r.get('peak_gpu_gib'), '.2f')} | "
                 f"{f(r.get('peak_gpu_reserved_gib'), '.2f')} | {pred} | {f(r.get('s_per_micro_batch'), '.3f')} | "
                 f"{f(r.get('s_per_step'), '.3f')} | {f(None if ema is None else ema * 1e3, '.1f')} | "
                 f"{f(None if vae is None else vae * 1e3, '.1f')} | {f(r.get('peak_host_rss_gib'), '.1f')} | "
                 f"{f(r.get('pinned_gib'), '.2f')} |\n")
    return head + body


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-gib", type=float, default=22.06)
    ap.add_argument("--steps", type=int, default=7, help="optimizer steps per configuration (>= 6: 1 warm-up + 5)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--only", default="", help="comma-separated config names to run (default: all)")
    ap.add_argument("--timelines", default="both levers",
                    help="comma-separated config names whose memory timeline (CSV + PNG) to keep in --out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.steps < 6:
        print("error: --steps must be >= 6 (1 warm-up + 5 measured)", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags, capped in CONFIGS:
            if only and name not in only:
                continue
            rows.append(run_one(name, flags, capped, args.budget_gib, args.steps, tmp))
            if args.timelines and name in args.timelines.split(","):
                args.out.mkdir(parents=True, exist_ok=True)
                keep_timeline(name, tmp, args.out)
            print(json.dumps(rows[-1]), flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "edge_24gb.json").write_text(json.dumps({"device": device, "rows": rows}, indent=2) + "\n")
    md = markdown(rows, device, args.budget_gib)
    (args.out / "edge_24gb.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
