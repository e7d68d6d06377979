"""The block-sparse attention's kernel settings at the recipe's micro-batch size, on one GPU.

    python benchmarks/flex_kernels.py [--tokens 12288] [--iters 10] [--only default,tma,...] [--out DIR]

The compiled ``flex_attention`` of :mod:`cosmos_framework_ext.levers.attention_blocksparse` (inductor's Triton
template) runs with the settings inductor picks for the card unless ``kernel_options`` names others: tile sizes
(``fwd_BLOCK_M``/``fwd_BLOCK_N`` forward; ``BLOCK_M1``/``BLOCK_N1`` for the key/value gradients and
``BLOCK_M2``/``BLOCK_N2`` for the query gradient), warps and pipeline stages, and Hopper's tensor-memory loads
(``USE_TMA``). Each configuration (:data:`CONFIGS`) is compiled on its own and runs the edge preset's two attention
calls of one packed micro-batch (a seeded layout of samples with 60-160 text tokens and 1-24 latent frames of
8 x 10 tokens, filling ``--tokens``; 16 query heads, 8 key/value heads, head_dim 128, bf16, the lever's 128-token
tiles): the text call (causal, text over text) and the vision call (vision over text and vision).

**Reported per configuration:** the median over ``--iters`` (after one warm-up repetition of each) of the training
forward alone and of forward + backward (ms, CUDA events around both calls: the kernels, the two key/value
concatenations of the vision call, and any host time the GPU waits for), and the largest difference of the output and of each input gradient from the
``default`` configuration's, relative to the largest magnitude of the default's (0 means bitwise equal: a change
of tile sizes changes the order of the floating-point sums, so a configuration that differs is a change of kernel
and needs its own A/B before it becomes a lever). A configuration inductor cannot build (a tile that does not
fit the card's shared memory) is reported with its error; the ``default`` configuration failing stops the run (every
difference is taken from it). Writes ``<date>_cosmos_<gpu>_flex-kernels.{json,md}`` into ``--out`` after each
configuration (both files at once, ``"complete": false`` until the last), so a run stopped by a time limit keeps
the configurations it finished. Bad arguments are one ``error:`` line, exit status 2, before any GPU work.

Random inputs: the values mean nothing.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.checks import at_least, pick, result_stem, writable_dir, write_together  # noqa: E402
from patches.core.errors import ArgumentParser, UserError, cli  # noqa: E402

CONFIGS: dict[str, dict] = {
    "default": {},
    "tma": {"USE_TMA": True},
    "bwd 64/128/128/64 w8 s2": {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64,
                                "bwd_num_warps": 8, "bwd_num_stages": 2},
    "bwd 64/128/128/64 w4 s3": {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64,
                                "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd 64/64/64/64 w4 s3": {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64,
                              "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd 32/128/128/32 w4 s3": {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32,
                                "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd 128/128/128/128 w8 s2": {"BLOCK_M1": 128, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 128,
                                  "bwd_num_warps": 8, "bwd_num_stages": 2},
    "fwd 128/128 w8 s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "fwd 128/64 w4 s3": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "fwd 64/128 w4 s3": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "tma + bwd 64/128/128/64 w8 s2": {"USE_TMA": True, "BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128,
                                      "BLOCK_N2": 64, "bwd_num_warps": 8, "bwd_num_stages": 2},
}
"""Name -> extra ``kernel_options`` (on top of the lever's own); ``default`` is the lever's path."""


TEXT_TOKENS = (60, 160)
"""The layout's text tokens per sample, fewest and most."""
FRAME_TOKENS, MAX_FRAMES = 80, 24
"""The layout's vision tokens per latent frame (8 x 10 patches) and the most frames of a sample."""
MIN_TOKENS = TEXT_TOKENS[1] + FRAME_TOKENS * MAX_FRAMES
"""Tokens of the layout's largest sample: the smallest ``--tokens``."""


def layout(tokens: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Per-sample (text tokens, vision tokens) of one packed micro-batch filling at most ``tokens``."""
    import random

    rng = random.Random(seed)
    text, vision = [], []
    while True:
        t, v = rng.randint(*TEXT_TOKENS), FRAME_TOKENS * rng.randint(1, MAX_FRAMES)
        if sum(text) + sum(vision) + t + v > tokens:
            break
        text.append(t)
        vision.append(v)
    return text, vision


def parse_args(argv: list[str] | None):
    """The checked arguments; every check before any GPU work (:mod:`benchmarks.checks`).

    Raises:
        UserError: ``--tokens``/``--iters`` out of range, ``--only`` naming an unknown or no configuration,
            ``--out`` empty or not a writable folder.
    """
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--tokens", type=int, default=12288, help="packed micro-batch size in tokens (default 12288)")
    ap.add_argument("--iters", type=int, default=10, help="timed repetitions per configuration (default 10)")
    ap.add_argument("--only", default=None, help=f"comma-separated configurations (default all: {', '.join(CONFIGS)})")
    ap.add_argument("--out", default=None, help="folder for the JSON and Markdown results (default: print only)")
    args = ap.parse_args(argv)
    at_least("--tokens", args.tokens, MIN_TOKENS, "the largest sample of the layout must fit (the recipe's cap is 12288)")
    if args.tokens > 1 << 20:
        raise UserError(f"--tokens {args.tokens}: more than 1048576 tokens in one micro-batch; use at most that")
    at_least("--iters", args.iters, 1, "timed repetitions")
    if args.iters > 1000:
        raise UserError(f"--iters {args.iters}: more than 1000 timed repetitions per configuration; use 1 to 1000")
    names = pick("--only", args.only, CONFIGS) if args.only is not None else list(CONFIGS)
    args.names = ["default", *[n for n in names if n != "default"]]  # the reference of every difference, first
    if args.out is not None and not args.out.strip():
        raise UserError("--out is empty: give the folder the results go to, or leave --out out to print them only")
    args.out = writable_dir("--out", args.out) if args.out is not None else None
    return args


def run(args) -> tuple[list[dict], dict]:
    """Every configuration of ``args.names`` on GPU 0, ``default`` first; returns (rows, micro-batch shape) and writes
    the results after each configuration when ``args.out`` is set.

    Raises:
        RuntimeError: the ``default`` configuration failed (nothing to compare the others with).
    """
    import torch

    from cosmos_framework_ext.levers import attention_blocksparse as ab

    text, vision = layout(args.tokens)
    dev = torch.device("cuda")
    und = torch.cat([torch.full((t,), i) for i, t in enumerate(text)]).to(dev)
    gen = torch.cat([torch.full((v,), i) for i, v in enumerate(vision)]).to(dev)
    seg = ab.BlockSparseSegments(und, gen, n_segments=len(text))
    U, G, H, HKV, D = und.numel(), gen.numel(), 16, 8, 128
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda n, h: torch.randn(1, h, n, D, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
    qu, ku, vu = mk(U, H), mk(U, HKV), mk(U, HKV)
    qg, kg, vg = mk(G, H), mk(G, HKV), mk(G, HKV)
    dout_u, dout_g = mk(U, H), mk(G, H)
    shape = {"samples": len(text), "text_tokens": U, "vision_tokens": G}
    print(f"micro-batch: {len(text)} samples, {U} text + {G} vision tokens", flush=True)
    rows, ref = [], None
    for name in args.names:
        t0 = time.time()
        torch._dynamo.reset()
        opts = dict(ab.KERNEL_OPTIONS, **CONFIGS[name])

        fn = torch.compile(functools.partial(ab._flex, kernel_options=opts), dynamic=False)  # the lever's call
        leaves = [t.detach().clone().requires_grad_(True) for t in (qu, ku, vu, qg, kg, vg)]

        def both(backward: bool):
            a, b, c, d, e, f = leaves
            kv_k, kv_v = torch.cat([b, e], 2), torch.cat([c, f], 2)
            ou = fn(a, b, c, seg.und_mask)
            og = fn(d, kv_k, kv_v, seg.gen_mask)
            if backward:
                torch.autograd.backward([ou, og], [dout_u, dout_g])
            return ou, og

        try:
            for leaf in leaves:
                leaf.grad = None
            outs = both(True)
            vals = [o.detach().float() for o in outs] + [leaf.grad.float() for leaf in leaves]
            times = {}
            for key, bw in (("fwd_ms", False), ("fwd_bwd_ms", True)):
                ms = []
                for i in range(args.iters + 1):  # the first repetition warms up, untimed
                    for leaf in leaves:
                        leaf.grad = None
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    outs = both(bw)  # the training forward (with grad: the kernels training runs)
                    e.record()
                    torch.cuda.synchronize()
                    if i:
                        ms.append(s.elapsed_time(e))
                    del outs
                times[key] = sorted(ms)[len(ms) // 2]
            if ref is None:
                ref = vals
            diffs = [float((v - r).abs().max() / r.abs().max().clamp_min(1e-30)) for v, r in zip(vals, ref)]
            row = {"config": name, "kernel_options": CONFIGS[name], **times,
                   "max_rel_diff": dict(zip(["out_text", "out_vision", "dq_text", "dk_text", "dv_text", "dq_vision",
                                             "dk_vision", "dv_vision"], diffs)),
                   "bitwise_default": all(d == 0 for d in diffs), "wall_s": round(time.time() - t0, 1)}
        except Exception as e:  # a tile inductor cannot build on this card: reported, the others still run
            if ref is None:
                raise RuntimeError(f"the default configuration failed, so nothing can be compared with it: {e}") from e
            row = {"config": name, "kernel_options": CONFIGS[name], "error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out is not None:
            write(args, rows, shape, complete=len(rows) == len(args.names))
    return rows, shape


def write(args, rows: list[dict], shape: dict, complete: bool = True, gpu: str | None = None) -> None:
    """``<date>_cosmos_<gpu>_flex-kernels.{json,md}`` into ``args.out``, both or neither (``complete``: every
    configuration asked for has run; ``gpu``: the card's name, GPU 0's when ``None``)."""
    import torch

    gpu = gpu or torch.cuda.get_device_name()
    stem = result_stem("cosmos", "flex-kernels", gpu)
    doc = {"date": stem[:10], "gpu": gpu, "torch": torch.__version__, "iters": args.iters, **shape,
           "complete": complete, "rows": rows}
    md = [f"# Flex attention kernel settings, {doc['date']}, {gpu}, torch {doc['torch']}", "",
          f"One packed micro-batch: {shape['samples']} samples, {shape['text_tokens']} text + "
          f"{shape['vision_tokens']} vision tokens; median of {args.iters}; random inputs"
          f"{'' if complete else '; incomplete: the run stopped before its last configuration'}.", "",
          "| configuration | forward ms | forward + backward ms | largest relative difference from default |",
          "|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['config']} | – | – | {r['error'][:120]} |")
        else:
            md.append(f"| {r['config']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
                      f"{max(r['max_rel_diff'].values()):.2e} |")
    args.out.mkdir(parents=True, exist_ok=True)
    write_together({args.out / f"{stem}.json": json.dumps(doc, indent=1) + "\n",
                    args.out / f"{stem}.md": "\n".join(md) + "\n"})
    if complete:
        print("\n".join(md))


def main(argv: list[str] | None = None) -> int:
    """The command line; bad input is one ``error:`` line and exit status 2 (:func:`patches.core.errors.cli`)."""
    return cli(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise UserError("no CUDA GPU: this benchmark times the GPU kernels; run it on a GPU machine")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
