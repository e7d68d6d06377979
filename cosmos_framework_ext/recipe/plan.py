"""``python -m cosmos_framework_ext.recipe.plan``: the packing planner for a dataset (lever 3).

Simulates the one-GPU loader at ``--cap`` and the multi-GPU reference loader over the whole dataset (each sample's
largest window with its full caption), reports drops, mean samples per micro-batch and per optimizer step for both,
and the grad accumulation that gives the reference's samples per optimizer step.

Exit status 0; 1 on a dataset error or when a sample would be dropped at ``--cap``; 2 on bad arguments::

    python -m cosmos_framework_ext.recipe.plan --cap 12288 --ref-cap 45056 --ref-grad-accum 2 --ref-world-size 8 \\
        [--dataset PATH] [--world-size 1] [--max-caption-tokens 2048] [--preset edge] [--json OUT]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from cosmos_framework_ext.levers.packing import plan
from cosmos_framework_ext.recipe.data import CaptionTokenizer, SampleSource
from cosmos_framework_ext.recipe.presets import PRESETS, get_preset
from patches.core.errors import ArgumentParser
from patches.core.data.rows import DatasetError, load_records
from patches.core.data.sample_dataset import default_sample_dataset_root, prepare_sample_dataset
from patches.core.io import atomic_write_text

__all__ = ["main"]




def _int_at_least(minimum: int):
    """An argparse type: a whole number >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _planner_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m cosmos_framework_ext.recipe.plan",
        description="Predict upstream sequence packing for our token cap vs the multi-GPU reference, "
        "and the grad accumulation giving the same samples per optimizer step.",
    )
    p.add_argument("--dataset", type=Path, default=None,
                   help="DATASET_PATH (holds train/video_dataset_file.jsonl); default: build/use the sample "
                   "dataset in $ONECARD_DATA_CACHE (default ~/.cache/onecard)")
    p.add_argument("--cap", type=_positive_int, required=True, help="our micro-batch token cap")
    p.add_argument("--ref-cap", type=_positive_int, required=True, help="reference micro-batch token cap")
    p.add_argument("--ref-grad-accum", type=_positive_int, required=True, help="reference grad accumulation steps")
    p.add_argument("--ref-world-size", type=_positive_int, required=True, help="reference data-parallel ranks")
    p.add_argument("--world-size", type=_positive_int, default=1, help="our data-parallel ranks (default 1)")
    p.add_argument("--max-caption-tokens", type=_non_negative_int, default=2048,
                   help="caption truncation (default 2048)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="edge", help="model preset (resolution buckets)")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON here (atomically)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (argparse exits 2 itself on bad arguments)."""
    args = _planner_parser().parse_args(argv)
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
    print(f"dataset: {dataset} (preset {preset.name})")
    print(report.format_table())
    if args.json is not None:
        atomic_write_text(args.json, report.to_json())
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
