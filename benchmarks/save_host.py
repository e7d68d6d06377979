"""What one Cosmos checkpoint save adds to the host's memory: the edge preset's real tensors, saved as the embedded
trainer saves them at one rank, with each storage written in pieces (``CHUNK_BYTES``, 64 MiB) against whole.

``python benchmarks/save_host.py [--layers 4] [--device cpu|cuda] [--preset edge|tiny] [--out benchmarks/results]``

Each mode runs in a fresh child process, which builds the edge preset's transformer in bf16 (``--layers`` of its 28
decoder layers; the largest tensors, ``embed_tokens`` and ``lm_head``, 131072 x 2048 each, are whole, whatever
``--layers``), trains the recipe's subset (``keys_to_select`` of ``toml/vision_sft_edge_24gb.toml``) with AdamW
(state made by one step at zero gradients) and keeps the EMA of that subset in host fp32 (lever 1's placement). It
then builds the checkpoint with the trainer's own ``CosmosSFT.state_dict`` (``net`` from the live tensors, the EMA's
frozen entries as fp32 casts made as they are written) and writes it with the trainer's ``CheckpointManager.save``,
sampling the process's RSS every 0.5 ms from before the state is built until the file is closed:
``save_adds_host_mib`` is the peak over the RSS before the save. Modes:

- ``pieces``: the writer as the trainer runs it (a GPU storage copied, an EMA entry cast, 64 MiB at a time);
- ``whole``: the same writer with pieces larger than any tensor (``CHUNK_BYTES`` = 1 TiB): each GPU storage copied,
  each EMA entry cast whole, as before pieces.

With ``--device cuda`` the weights, gradients and AdamW state are on the GPU, as in a training run; on the CPU every
tensor is already in host memory and only the EMA's casts are made. Writes ``<date>_cosmos_<device>_save-host.{json,md}``
under ``--out``; bad arguments are one ``error:`` line, exit 2, before anything runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.checks import at_least, folder_arg, free_targets, result_stem, write_together, writable_dir  # noqa: E402
from patches.core.errors import ArgumentParser, UserError, cli  # noqa: E402

MODES = {"pieces": None, "whole": 2**40}
"""Mode -> ``CHUNK_BYTES`` for the child (``None``: the writer's own)."""

MiB = 2**20


def _model(preset_name: str, layers: int, device: Any = None, dtype: Any = None) -> tuple[Any, list[str]]:
    """The preset's transformer with ``layers`` decoder layers (random init; ``device="meta"`` allocates nothing) and
    the names of the parameters the 24 GB recipe trains (its ``keys_to_select``)."""
    import dataclasses

    from cosmos_framework_ext.recipe import config as cfgmod
    from cosmos_framework_ext.recipe.presets import build_transformer, get_preset, select_trainable

    preset = get_preset(preset_name)
    preset = dataclasses.replace(preset, transformer={**preset.transformer, "num_hidden_layers": layers})
    model = build_transformer(preset, device=device, dtype=dtype)
    keys = cfgmod.load(str(ROOT / "toml" / "vision_sft_edge_24gb.toml")).optimizer.keys_to_select
    return model, select_trainable([n for n, _ in model.named_parameters()], keys)


def child(preset_name: str, layers: int, device: str, chunk: int | None, path: str) -> dict:
    """Build the state in this process and save it once (the child's body); returns the measured figures."""
    import time

    import torch

    from cosmos_framework_ext.levers import ema as E
    from cosmos_framework_ext.recipe.train import CosmosSFT
    from patches.core import streamsave
    from patches.core.checkpoint import CheckpointManager
    from patches.core.runtime import host_rss
    from patches.core.sampler import MemorySampler

    if chunk is not None:
        streamsave.CHUNK_BYTES = chunk
    torch.manual_seed(0)
    model, trainable = _model(preset_name, layers, device, torch.bfloat16)
    chosen = set(trainable)
    for n, p in model.named_parameters():
        p.requires_grad_(n in chosen)
        if n in chosen:
            p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    opt.step()
    ema = E.EMA(model, placement="cpu_subset", trainable=trainable, pin=False)
    ema.synchronize()

    class Run:
        """The part of the trainer its ``state_dict`` reads."""

        state_dict = CosmosSFT.state_dict

    run = Run()
    run.model, run.opt, run.ema, run.world, run.trainable = model, opt, ema, 1, trainable
    run.sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    run.done, run.consumed = 1, 1
    if device == "cuda":
        torch.cuda.synchronize()
    base = host_rss()
    # the trainers' own sampler (a daemon thread, stopped on leaving the block whether the save worked or not), every
    # 0.5 ms, the save as its "checkpoint" phase
    with MemorySampler(device, interval_s=0.0005) as sampler, sampler.phase("checkpoint"):
        t0 = time.perf_counter()
        written = CheckpointManager(path).save(1, run.state_dict())
        seconds = time.perf_counter() - t0
    peak = sampler.peaks()["phases"]["checkpoint"]["host_rss_bytes"]
    return {"save_adds_host_mib": (peak - base) / MiB, "host_rss_before_gib": base / 2**30,
            "save_s": seconds, "file_gib": written.stat().st_size / 2**30,
            "largest_fp32_entry_mib": max(p.numel() for p in model.parameters()) * 4 / MiB,
            "params": sum(p.numel() for p in model.parameters()), "trainable_params": sum(
                p.numel() for p in model.parameters() if p.requires_grad), "chunk_bytes": streamsave.CHUNK_BYTES}


def _file_bytes(preset_name: str, layers: int) -> int:
    """About the bytes one save writes: ``net`` in bf16, ``net_ema`` in fp32, the trained subset's AdamW moments in
    bf16 (the model built on the meta device)."""
    model, trainable = _model(preset_name, layers, "meta")
    names = dict(model.named_parameters())
    trained = sum(names[n].numel() for n in trainable)
    return sum(p.numel() for p in names.values()) * (2 + 4) + trained * 2 * 2


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(description="What one Cosmos checkpoint save adds to the host's memory (pieces vs whole)",
                        allow_abbrev=False)
    ap.add_argument("--layers", type=int, help="decoder layers of the preset's (edge: 28; default 4, or all of a "
                    "smaller preset's)")
    ap.add_argument("--preset", choices=("edge", "tiny"), default="edge", help="model size (tiny: tests; default edge)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the weights live (default cpu)")
    ap.add_argument("--out", type=folder_arg, default=str(ROOT / "benchmarks" / "results"), help="results folder")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)  # one measurement, here
    args = ap.parse_args(argv)
    from cosmos_framework_ext.recipe.presets import get_preset

    most = get_preset(args.preset).transformer["num_hidden_layers"]
    if args.layers is None:
        args.layers = min(4, most)
    if args.child:  # the parent's own call: its arguments were checked there
        mode, path = args.child
        print(json.dumps(child(args.preset, args.layers, args.device, MODES[mode], path)))
        return 0
    if not args.out:
        raise UserError("--out is empty: give the folder the results go to (default benchmarks/results)")
    at_least("--layers", args.layers, 1)
    if args.layers > most:
        raise UserError(f"--layers {args.layers}: the {args.preset} preset has {most} decoder layers; use 1 to {most}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible; run with --device cpu or on a GPU machine")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = writable_dir("--out", args.out)
    stem = result_stem("cosmos", "save-host", device, smoke=args.preset == "tiny")
    free_targets("--out", out, [f"{stem}.json", f"{stem}.md"])
    need = _file_bytes(args.preset, args.layers)
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < 1.1 * need:
        raise UserError(f"the temporary folder {tempfile.gettempdir()} has {free / 2**30:.1f} GiB free and each save "
                        f"writes about {need / 2**30:.1f} GiB: set TMPDIR to a folder with room, or lower --layers")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            print(f"save-host: {mode} ({len(rows) + 1} of {len(MODES)}): building the {args.preset} preset with "
                  f"{args.layers} layers and saving once ...", flush=True)
            r = subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--device", args.device,
                                "--preset", args.preset, "--child", mode, str(Path(tmp) / mode)],
                               capture_output=True, text=True, cwd=ROOT)
            if r.returncode:
                last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
                raise UserError(f"the {mode} measurement failed in its own process: {last[:300]} (run it alone: "
                                f"python benchmarks/save_host.py --preset {args.preset} --layers {args.layers} "
                                f"--device {args.device} --child {mode} PATH)")
            row = {"mode": mode, **json.loads(r.stdout.strip().splitlines()[-1])}
            print(f"save-host: {mode}: the save added {row['save_adds_host_mib']:.0f} MiB in {row['save_s']:.1f} s",
                  flush=True)
            rows.append(row)
    _write(out, stem, device, torch.__version__, args.preset, args.layers, most, rows)
    return 0


def _write(out: Path, stem: str, device: str, torch_version: str, preset: str, layers: int, most: int,
           rows: list[dict]) -> None:
    """``<stem>.json`` (the rows as measured) and ``<stem>.md`` (their table) under ``out``, together; the table
    printed too."""
    import datetime

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "device": device,
            "torch": torch_version, "preset": preset, "layers": layers, "rows": rows}
    md = [f"{meta['date']}, {device}, torch {torch_version}; {preset} preset in bf16 with {layers} of its {most} decoder "
          f"layers ({rows[0]['params']:,} params, {rows[0]['trainable_params']:,} trained), EMA of the trained subset in "
          "host fp32, one save through `CosmosSFT.state_dict` and `CheckpointManager.save`; random weights.", "",
          "| mode | piece bytes | largest fp32 entry MiB | host RSS before GiB | the save adds MiB | save s | file GiB |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['mode']} | {r['chunk_bytes']:,} | {r['largest_fp32_entry_mib']:.0f} | "
                  f"{r['host_rss_before_gib']:.2f} | {r['save_adds_host_mib']:.0f} | {r['save_s']:.1f} | "
                  f"{r['file_gib']:.2f} |")
    out.mkdir(parents=True, exist_ok=True)
    write_together({out / f"{stem}.json": json.dumps(meta, indent=1) + "\n", out / f"{stem}.md": "\n".join(md) + "\n"})
    print("\n".join(md))
    print(f"save-host: wrote {out / stem}.json and .md")


if __name__ == "__main__":
    sys.exit(cli(main))
