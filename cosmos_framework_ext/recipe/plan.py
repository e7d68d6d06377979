"""``python -m cosmos_framework_ext.recipe.plan``: the packing planner for a dataset (lever 3).

Simulates the one-GPU loader at ``--cap`` and the multi-GPU reference loader over the whole dataset (each sample's
largest window with its full caption), reports drops, mean samples per micro-batch and per optimizer step for both,
and the grad accumulation that gives the reference's samples per optimizer step.

Exit status 0; 1 on a dataset error or when a sample would be dropped at ``--cap``; 2 on bad arguments (a number out
of range, a ``--json`` path that cannot be written, or a ``--cap`` / ``--ref-cap`` that drops every sample, so there is
nothing to plan), with one ``error:`` line and nothing written::

    python -m cosmos_framework_ext.recipe.plan --cap 12288 --ref-cap 45056 --ref-grad-accum 2 --ref-world-size 8 \\
        [--dataset PATH] [--world-size 1] [--max-caption-tokens 2048] [--preset edge] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cosmos_framework_ext.levers.packing import plan
from cosmos_framework_ext.recipe.data import CaptionTokenizer, SampleSource
from cosmos_framework_ext.recipe.presets import PRESETS, get_preset
from patches.core.errors import ArgumentParser
from patches.core.data.rows import DatasetError, load_records
from patches.core.data.sample_dataset import default_sample_dataset_root, prepare_sample_dataset
from patches.core.flags import MAX_WORLD_SIZE, whole_number_arg
from patches.core.io import atomic_write_text

__all__ = ["main"]

MAX_TOKENS = (1 << 31) - 1
"""The largest token cap (and caption truncation) the planner takes: packed sequence offsets are int32 in the attention
kernels (``cu_seqlens``), so a larger cap cannot be a micro-batch."""
MAX_GRAD_ACCUM = 1 << 20
"""The largest gradient accumulation the planner takes (the recipes use 2 to 61)."""

_cap = whole_number_arg(1, MAX_TOKENS, "tokens")
_ranks = whole_number_arg(1, MAX_WORLD_SIZE, "ranks")
_accum = whole_number_arg(1, MAX_GRAD_ACCUM, "micro-batches per optimizer step")
_caption = whole_number_arg(0, MAX_TOKENS, "tokens")


def _json_problem(path: Path) -> str | None:
    """Why ``--json PATH`` cannot be written (checked before any work), or ``None``."""
    if path.is_dir():
        return f"--json {path} is a folder: give the path of the file to write"
    existing = next(p for p in path.parents if p.exists() or p == Path(p.anchor))
    if not existing.is_dir():
        return f"--json {path} cannot be written: {existing} is a file, not a folder: give a path in a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--json {path} cannot be written: {existing} is not writable: give a path in a folder you can write"
    return None


def _packs_nothing(report, source: SampleSource, which: str, cap: int) -> str | None:
    """The one line for a cap at which every sample is dropped (no micro-batch at all, so nothing to plan), or
    ``None``."""
    stats = report.ours if which == "--cap" else report.ref
    if stats.micro_batches:
        return None
    smallest = min(source.max_token_count(i) for i in range(len(source)))
    return (f"{which} {cap} drops every sample (the smallest has {smallest} tokens, the largest "
            f"{report.max_sample_tokens}; the fit rule is strict): nothing is packed, so there is no plan; use "
            f"{which} {report.min_zero_drop_cap} or more")


def _planner_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m cosmos_framework_ext.recipe.plan",
        description="Predict upstream sequence packing for our token cap vs the multi-GPU reference, "
        "and the grad accumulation giving the same samples per optimizer step.",
    )
    p.add_argument("--dataset", type=Path, default=None,
                   help="DATASET_PATH (holds train/video_dataset_file.jsonl); default: build/use the sample "
                   "dataset in $ONECARD_DATA_CACHE (default ~/.cache/onecard)")
    p.add_argument("--cap", type=_cap, required=True, help=f"our micro-batch token cap (1 to {MAX_TOKENS})")
    p.add_argument("--ref-cap", type=_cap, required=True, help="reference micro-batch token cap")
    p.add_argument("--ref-grad-accum", type=_accum, required=True,
                   help=f"reference grad accumulation steps (1 to {MAX_GRAD_ACCUM})")
    p.add_argument("--ref-world-size", type=_ranks, required=True,
                   help=f"reference data-parallel ranks (1 to {MAX_WORLD_SIZE})")
    p.add_argument("--world-size", type=_ranks, default=1, help="our data-parallel ranks (default 1)")
    p.add_argument("--max-caption-tokens", type=_caption, default=2048,
                   help="caption truncation (default 2048)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="edge", help="model preset (resolution buckets)")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON here (atomically)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (argparse exits 2 itself on bad arguments)."""
    parser = _planner_parser()
    args = parser.parse_args(argv)
    problem = _json_problem(args.json) if args.json is not None else None
    if problem:  # before the dataset is read (or the sample dataset built)
        parser.exit(2, f"error: {problem}\n")
    preset = get_preset(args.preset)
    try:
        dataset = args.dataset
        if dataset is None:
            dataset = prepare_sample_dataset(default_sample_dataset_root(preset), preset)
        records = load_records(dataset, max_frames=preset.max_frames)
        source = SampleSource(records, CaptionTokenizer(), preset, max_caption_tokens=args.max_caption_tokens,
                              cfg_dropout=0.0, window_policy="max")
        report = plan(source, args.cap, args.ref_cap, args.ref_grad_accum, args.ref_world_size, args.world_size)
    except DatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for which, cap in (("--cap", args.cap), ("--ref-cap", args.ref_cap)):
        problem = _packs_nothing(report, source, which, cap)
        if problem:  # nothing printed or written: the report would be all zeros and a made-up grad accum
            print(f"error: {problem}", file=sys.stderr)
            return 2
    if args.json is not None:
        try:
            atomic_write_text(args.json, report.to_json())
        except OSError as e:
            print(f"error: --json {args.json} cannot be written ({e.strerror or e}): give a path in a folder you can "
                  "write", file=sys.stderr)
            return 2
    print(f"dataset: {dataset} (preset {preset.name})")
    print(report.format_table())
    if report.ours.dropped:
        index, tokens = report.ours.dropped[0]
        rec = records[index]
        more = f" (and {len(report.ours.dropped) - 1} more)" if len(report.ours.dropped) > 1 else ""
        print(
            f"error: sample {index} ({rec.video}, JSONL line {rec.line}) has {tokens} tokens and would be "
            f"dropped at --cap {args.cap}{more}; the fit rule is strict, use --cap "
            f"{report.min_zero_drop_cap} or more",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
