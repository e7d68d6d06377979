"""Exact below the reference: upstream HEAD's fp32-master recipe and the older bf16 base, all levers.

    python benchmarks/edge_exact.py [--grad-accum 8] [--steps 4] [--out benchmarks/results]   # on a GPU
    python benchmarks/edge_exact.py --smoke                                                     # CPU, tiny preset
    python benchmarks/edge_exact.py --only head-reference,head-levers ...   # a subset (keys: KEYS below)

The ``edge`` preset at cap 12288, EMA on (``benchmarks/edge_24gb.toml``, with ``[model.parallelism]``
``fsdp_master_dtype`` set per configuration and ``grad_accum_iter`` from ``--grad-accum``), one configuration
after another in this process. Every row trains as the 24 GB recipe's fast path does: latents from the cache
(lever 4, ``COSMOS_LATENT_CACHE=1``; its cold pre-pass runs before the first row's training, in no step time)
and block-sparse attention (``[onecard] attention = "flex"``), so the VAE is never on the GPU in training:

1. ``HEAD dtypes, reference``: fp32 master, bf16 compute (FSDP2 ``MixedPrecisionPolicy``, reduce bf16), EMA
   and VAE levers, the card uncapped (it needs ~32 GiB): the step time to compare with;
2. ``HEAD dtypes, all levers``: the same with ``COSMOS_OPTIM_STATE_OFFLOAD=1 COSMOS_FROZEN_BF16=1``, card capped
   at ``--head-cap-gib`` (22.06: a 24 GB card). Target: peak allocated <= 20 GiB;
3. ``seed dtypes, reference``: bf16 master (upstream ed8287f), EMA and VAE levers, uncapped;
4. ``seed dtypes, all levers``: with ``COSMOS_OPTIM_STATE_OFFLOAD=1`` too (``COSMOS_FROZEN_BF16`` has nothing to
   do at a bf16 master), capped at ``--seed-cap-gib`` (15: a 16 GB card). Target: <= 14 GiB.

Each row: status, peak allocated / reserved GiB, the ledger's prediction, median s per optimizer step and per
micro-batch after the warm-up step, the step-time ratio to its reference (target: within 5 % at the recipe's
grad_accum_iter 61; the levers add a fixed cost per optimizer step -- the state's PCIe round trip, hidden partly
by the overlap -- so the ratio shrinks as grad_accum_iter grows), host RSS and pinned GiB, and the optimizer
lever's bytes moved. Writes ``<date>_cosmos_<gpu>_edge-exact.json`` and ``.md`` into ``--out`` (atomically, both or
neither). Bad arguments are one ``error:`` line, exit status 2, before the GPU check and any run.

``--smoke``: the same four configurations on the CPU with the tiny preset (the TOML's ``cpu_*`` values), no cap:
it checks the code path, not memory or time. Random weights: the losses mean nothing.
"""

from __future__ import annotations

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

from benchmarks.checks import (at_least, at_most_card, folder_arg, free_targets, pick, positive, result_stem,  # noqa: E402
                               writable_dir, write_together)
from cosmos_framework_ext.recipe import train  # noqa: E402
from patches.core.errors import ArgumentParser, UserError, cli  # noqa: E402
from patches.core.runtime import GiB  # noqa: E402

EMA, VAE, OPT, FRZ = "COSMOS_EMA_CPU_SUBSET", "COSMOS_VAE_CPU_OFFLOAD", "COSMOS_OPTIM_STATE_OFFLOAD", "COSMOS_FROZEN_BF16"
CACHE = "COSMOS_LATENT_CACHE"
BASE = {EMA: "1", VAE: "1", CACHE: "1", OPT: "0", FRZ: "0"}
ALL = {EMA: "1", VAE: "1", CACHE: "1", OPT: "1", FRZ: "1"}
# (name, master dtype, flags, cap key (None: uncapped), reference row for the step-time ratio, target GiB)
CONFIGS = [
    ("HEAD dtypes, reference", "float32", BASE, None, None, None),
    ("HEAD dtypes, all levers", "float32", ALL, "head", "HEAD dtypes, reference", 20.0),
    ("seed dtypes, reference", "bfloat16", BASE, None, None, None),
    ("seed dtypes, all levers", "bfloat16", ALL, "seed", "seed dtypes, reference", 14.0),
]
KEYS = {"head-reference": CONFIGS[0][0], "head-levers": CONFIGS[1][0], "seed-reference": CONFIGS[2][0],
        "seed-levers": CONFIGS[3][0]}
"""``--only``'s names for the configurations (their row names hold commas, the list separator)."""


def write_toml(dst: Path, master: str, grad_accum: int, steps: int) -> Path:
    """``benchmarks/edge_24gb.toml`` with ``fsdp_master_dtype = master``, ``grad_accum_iter`` and ``max_iter`` set."""
    text = (HERE / "edge_24gb.toml").read_text()
    text = text.replace("data_parallel_replicate_degree  = 1\n",
                        f'data_parallel_replicate_degree  = 1\nfsdp_master_dtype = "{master}"\n'
                        'fsdp_reduce_dtype = "bfloat16"\n', 1)
    text = text.replace("grad_accum_iter         = 2\n", f"grad_accum_iter         = {grad_accum}\n", 1)
    text = text.replace("max_iter                = 7\n", f"max_iter                = {steps}\n", 1)
    text = text.replace("[onecard]\n", '[onecard]\nattention = "flex"\n', 1)  # the 24 GB recipe's fast path
    dst.write_text(text)
    return dst


def run_one(name: str, master: str, flags: dict, cap_gib: float | None, args, tmp: Path) -> dict:
    out = tmp / name.replace(" ", "_").replace(",", "")
    os.environ.update(flags, OUTPUT_ROOT=str(out))
    cuda = torch.cuda.is_available() and not args.smoke
    if cap_gib is not None and cuda:
        os.environ["ONECARD_GPU_MEMORY_GIB"] = str(cap_gib)
    else:
        os.environ.pop("ONECARD_GPU_MEMORY_GIB", None)
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    toml = write_toml(tmp / f"{master}.toml", master, args.grad_accum, args.steps)
    row: dict = {"config": name, "master_dtype": master, "capped_gib": cap_gib if cuda else None,
                 "flags": {k: v for k, v in flags.items() if v == "1"}}
    t0 = time.perf_counter()
    try:
        s = train.run(train.parse_args(["--sft-toml", str(toml), "--no-save"]))
    except torch.OutOfMemoryError as e:
        row.update(status="out of memory", peak_gpu_gib=torch.cuda.max_memory_allocated() / GiB,
                   peak_gpu_reserved_gib=torch.cuda.max_memory_reserved() / GiB, error=str(e).split("\n")[0][:300])
    else:
        row.update(status="ok", steps=s["steps"], grad_accum_iter=s["grad_accum_iter"],
                   peak_gpu_gib=s["peak_gpu_allocated_gib"], peak_gpu_reserved_gib=s["peak_gpu_reserved_gib"],
                   predicted_gpu_gib=s["ledger"]["predicted_gpu_allocated_gib"],
                   s_per_step=s["s_per_step_median"], s_per_micro_batch=s["s_per_micro_batch_median"],
                   peak_host_rss_gib=s["peak_host_rss_gib"], pinned_gib=s["pinned_bytes"] / GiB,
                   optim_offload=s.get("optim_offload"), frozen_bf16=s.get("frozen_bf16"), last_loss=s["last_loss"])
    row["wall_s"] = time.perf_counter() - t0
    return row


def markdown(rows: list[dict], device: str, args) -> str:
    def f(v, fmt):
        return "–" if v is None else format(v, fmt)

    ran = next((r for r in rows if r.get("status") == "ok"), {})
    ga, steps = ran.get("grad_accum_iter", args.grad_accum), ran.get("steps", args.steps)
    what = ("CPU smoke: tiny preset with the TOML's [onecard] cpu_* values; the CPU computes in fp32 whatever the "
            "master dtype, so the dtype columns only say what was asked" if args.smoke else "edge preset, cap 12288")
    head = (f"{time.strftime('%Y-%m-%d')}, {device}, torch {torch.__version__}; {what}, "
            f"grad_accum_iter {ga}, EMA on (CPU subset), VAE parked; {steps} steps, first is warm-up.\n\n"
            "| config | master | cap GiB | status | peak alloc GiB | target | peak reserved GiB | ledger GiB | s/step | "
            "vs reference | s/micro-batch | host RSS GiB | pinned GiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = ""
    for r in rows:
        body += (f"| {r['config']} | {r['master_dtype']} | {f(r.get('capped_gib'), '.2f')} | {r['status']} | "
                 f"{f(r.get('peak_gpu_gib'), '.2f')} | {f(r.get('target_gib'), '.0f')} | "
                 f"{f(r.get('peak_gpu_reserved_gib'), '.2f')} | {f(r.get('predicted_gpu_gib'), '.2f')} | "
                 f"{f(r.get('s_per_step'), '.3f')} | {f(r.get('step_time_ratio'), '.3f')} | "
                 f"{f(r.get('s_per_micro_batch'), '.3f')} | {f(r.get('peak_host_rss_gib'), '.1f')} | "
                 f"{f(r.get('pinned_gib'), '.2f')} |\n")
    return head + body


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); bad input: one ``error:`` line, exit 2, nothing written."""
    return cli(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grad-accum", type=int, default=8, help="micro-batches per optimizer step (recipe: 61)")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per configuration (>= 2: 1 warm-up)")
    ap.add_argument("--head-cap-gib", type=float, default=22.06, help="card cap for HEAD dtypes, all levers")
    ap.add_argument("--seed-cap-gib", type=float, default=15.0, help="card cap for seed dtypes, all levers")
    ap.add_argument("--only", default=None, help=f"comma-separated configurations to run, of {', '.join(KEYS)} "
                    "(default: all four, in that order)")
    ap.add_argument("--out", type=folder_arg, default=HERE / "results")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset: the code path only (also without a GPU)")
    args = ap.parse_args(argv)
    # every check before the GPU check, the runs and any write under --out
    only = {KEYS[k] for k in pick("--only", args.only, KEYS)} if args.only is not None else set()
    at_least("--steps", args.steps, 2, "1 warm-up + 1 measured")
    at_least("--grad-accum", args.grad_accum, 1, "micro-batches per optimizer step")
    positive("--head-cap-gib", args.head_cap_gib, "GiB")
    positive("--seed-cap-gib", args.seed_cap_gib, "GiB")
    writable_dir("--out", args.out)
    stem = result_stem("cosmos", "edge-exact", "cpu" if args.smoke or not torch.cuda.is_available()
                       else torch.cuda.get_device_name(), smoke=args.smoke)
    free_targets("--out", args.out, [f"{stem}.json", f"{stem}.md"])
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the tiny preset on the CPU even on a GPU machine
    if not args.smoke and not torch.cuda.is_available():
        raise UserError("this benchmark needs a CUDA GPU; pass --smoke for the CPU code-path check")
    if not args.smoke:
        used = {c[3] for c in CONFIGS if not only or c[0] in only}
        if "head" in used:
            at_most_card("--head-cap-gib", args.head_cap_gib)
        if "seed" in used:
            at_most_card("--seed-cap-gib", args.seed_cap_gib)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    caps = {"head": args.head_cap_gib, "seed": args.seed_cap_gib}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ONECARD_LATENT_CACHE"] = str(Path(tmp) / "latents")  # pre-pass in the first row, hits after
        for name, master, flags, cap, ref, target in CONFIGS:
            if only and name not in only:
                continue
            row = run_one(name, master, flags, caps.get(cap) if cap else None, args, Path(tmp))
            row["target_gib"] = target
            base = next((r for r in rows if r["config"] == ref and r.get("s_per_step")), None)
            if base and row.get("s_per_step"):
                row["step_time_ratio"] = row["s_per_step"] / base["s_per_step"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            gc.collect()
            if torch.cuda.is_available() and not args.smoke:
                torch.cuda.empty_cache()
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    md = markdown(rows, device, args)
    write_together({args.out / f"{stem}.json": json.dumps({"device": device, "rows": rows}, indent=2) + "\n",
                    args.out / f"{stem}.md": md})
    print(md)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
