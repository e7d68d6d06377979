"""Partial residency for the 1-GPU H3 run: N transformer blocks stay on the GPU, the others are CPU-offloaded FSDP2
units streamed in with prefetch.

**One resolver.** The three doors to the setting -- the launcher's ``RESIDENT_BLOCKS``, the trainer's
``--fsdp-resident-blocks`` (with ``--gpu-budget-gib``) and upstream miles-diffusion's ``MILES_RESIDENT_BLOCKS`` (with
``MILES_GPU_BUDGET_GIB``) -- are parsed by one function (:func:`patches.core.flags.parse_resident_blocks`: ``auto``,
a whole number, or ``none``) and resolved by one function, :func:`resolve_residency` (a count checked against the model's
blocks, ``auto`` planned by :func:`plan_resident_blocks`); the launcher turns its variable into trainer flags through
:func:`launcher_args` (``python -m miles_ext.levers.residency launcher-args``). ``auto`` fills the GPU budget: the
given one, else ``ONECARD_GPU_MEMORY_GIB`` when set, else the card (:func:`patches.core.device.gpu_budget_bytes`). :func:`miles_ext.levers.fsdp_policy.apply_fsdp2` does the sharding (``resident=``): the
resident blocks and the root unit are sharded without an offload policy, the streamed ones with
``CPUOffloadPolicy``; the LoRA adapter units stay on the device (``adapters_on_device``), so the adapters, their
gradients and their AdamW state are where an all-resident run has them and the optimizer step runs the same
kernel on the same values.

Optimizer placement by mode (what ``summary.json`` reports as ``optimizer_device``):

==================  ==========================  ===============================
mode                base blocks                 adapters, grads, AdamW state
==================  ==========================  ===============================
all-resident        GPU                         GPU
partial (N blocks)  N on GPU, rest streamed     GPU
full offload        all streamed                host (CPU AdamW)
==================  ==========================  ===============================

So weights after N steps equal the all-resident run's in partial mode; under full offload the CPU AdamW rounds
differently, while the gradients stay bit-exact across all three.

Which blocks stay: :func:`select_resident` spreads the streamed blocks evenly through the stack, so each
streamed block's host-to-device copy can hide behind resident blocks' compute; :func:`wire_prefetch` has each
block gather the next ``depth`` streamed blocks ahead (``FSDPModule.set_modules_to_forward_prefetch``) and, in
backward, the previous ones (``set_modules_to_backward_prefetch``).

The memory model (:func:`plan_resident_blocks`), bytes on the GPU, every term stated:

- ``N * block_bytes``: resident blocks, stored dtype (bf16 for the full preset: 1.29 GB each);
- ``(1 + depth) * 2 * max_block_bytes`` when anything streams: gathered copies in flight (the H2D staging and
  the all-gathered parameters, for the running block and ``depth`` prefetched ones);
- ``root_bytes``: parameters outside the blocks (resident root unit);
- ``5 * adapter_bytes``: fp32 adapters + gradients + AdamW ``exp_avg`` and ``exp_avg_sq``, plus the one
  adapter-sized temporary of the foreach AdamW step (its denominator);
- activations: gradient checkpointing keeps each block's input (``num_layers * tokens * hidden * act_bytes``, the
  compute dtype: 2 for bf16) plus one block's recompute-and-backward working set, ``tokens * (12 * hidden +
  3 * ffn_dim) * 2 * 1.5``: the bf16 intermediates a block names (q, k, v, attention output, norms, SwiGLU
  ``fc1`` and its activation) and, the factor 1.5, the gradients of those that are alive with them in backward;
- ``reserve_gib`` (default 3 GiB): CUDA context, cuBLAS workspaces, allocator fragmentation.

The two activation terms are calibrated on the all-resident GPU runs of ``benchmarks/h3_1gpu.py`` (full preset, LoRA
r64, bf16): the per-row slope of the model equals the least-squares slope of the measured peaks, and everything but
the reserve is modelled under the measured peak (``tests/equivalence/test_h3_residency.py`` checks this against a
fixed fixture of those runs; ``docs/levers/residency.md`` has the figures).

``auto`` = the largest N whose total is within the budget (0 .. num_layers), printed with the terms.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

from patches.core.errors import UserError
from patches.core.flags import parse_resident_blocks, setting
from patches.core.units import GiB

if TYPE_CHECKING:  # annotations only: ``launcher-args`` runs before any trainer and imports no torch on a CPU build
    from torch import nn

__all__ = ["DEFAULT_PLAN_TOKENS", "Residency", "ResidencyPlan", "block_bytes", "launcher_args", "model_widths",
           "plan_resident_blocks", "resolve_residency", "select_resident", "wire_prefetch"]

DEFAULT_PLAN_TOKENS = 16384
"""Packed rows per micro-batch that ``auto`` plans activations for when the caller cannot know its clip sizes (upstream
miles-diffusion's FSDP application runs before any batch exists): 81 x 480 x 832 video is about 8.2 k rows plus text
and audio; this is twice that. The embedded trainer passes its longest pair's rows instead."""


def select_resident(num_blocks: int, n: int) -> list[int]:
    """Indices of the ``n`` resident blocks out of ``num_blocks``: the ``num_blocks - n`` streamed blocks are
    spread evenly (streamed block k sits at ``round((k + 0.5) * num_blocks / streamed - 0.5)``)."""
    if not 0 <= n <= num_blocks:
        raise ValueError(f"{n} resident blocks out of {num_blocks}")
    streamed = num_blocks - n
    out = {min(num_blocks - 1, max(0, round((k + 0.5) * num_blocks / streamed - 0.5))) for k in range(streamed)}
    return [i for i in range(num_blocks) if i not in out]


def wire_prefetch(blocks: Sequence[nn.Module], streamed: Sequence[int], depth: int = 1,
                  companions: "dict[int, Sequence[nn.Module]] | None" = None) -> None:
    """Explicit FSDP2 prefetch of the streamed blocks: in forward each block gathers the next ``depth`` streamed
    blocks after it; in backward, the previous ``depth`` before it. ``depth`` 0 leaves FSDP2's implicit order.

    ``companions[j]``: other FSDP2 units block ``j`` needs gathered when it runs (its offloaded LoRA adapter unit),
    prefetched just before block ``j`` itself. With one side stream for every copy
    (:mod:`miles_ext.levers.h2d_prefetch`) a unit gathered only when its block starts waits behind the copy of the
    block prefetched after it (measured: full offload slower with the prefetch than without)."""
    if depth <= 0 or not streamed:
        return
    streamed = sorted(streamed)
    extra = companions or {}

    def units(js: list[int]) -> list[nn.Module]:
        return [u for j in js for u in (*extra.get(j, ()), blocks[j])]

    for i, block in enumerate(blocks):
        ahead = units([j for j in streamed if j > i][:depth])
        behind = units([j for j in reversed(streamed) if j < i][:depth])
        if ahead:
            block.set_modules_to_forward_prefetch(ahead)  # type: ignore[operator]
        if behind:
            block.set_modules_to_backward_prefetch(behind)  # type: ignore[operator]


def block_bytes(model: nn.Module, no_split_modules: Sequence[str] | None = None) -> tuple[list[int], int, int]:
    """``(bytes of each _no_split_modules block's base parameters, root bytes, adapter bytes)`` in stored dtypes
    (works on the meta device). Adapter parameters (``lora_A`` / ``lora_B``) are counted apart. ``no_split_modules``
    overrides ``model._no_split_modules``."""
    wrap = set(no_split_modules if no_split_modules is not None else (getattr(model, "_no_split_modules", None) or ()))
    blocks = [m for m in model.modules() if type(m).__name__ in wrap]
    in_block: set[int] = set()
    sizes = []
    adapters = 0
    for b in blocks:
        total = 0
        for n, p in b.named_parameters():
            if id(p) in in_block:
                continue
            in_block.add(id(p))
            if ".lora_A." in f".{n}" or ".lora_B." in f".{n}":
                adapters += p.numel() * p.element_size()
            else:
                total += p.numel() * p.element_size()
        sizes.append(total)
    root = 0
    for n, p in model.named_parameters():
        if id(p) in in_block:
            continue
        if ".lora_A." in f".{n}" or ".lora_B." in f".{n}":
            adapters += p.numel() * p.element_size()
        else:
            root += p.numel() * p.element_size()
    return sizes, root, adapters


@dataclasses.dataclass(frozen=True)
class ResidencyPlan:
    """The memory model's answer for one budget; bytes unless named otherwise."""

    resident_blocks: int
    """N: blocks kept on the GPU."""
    num_blocks: int
    """Blocks in the model (``_no_split_modules`` instances)."""
    budget_bytes: int
    """The GPU budget the plan fills."""
    terms: dict
    """Each term of the model at the chosen N (see the module docstring)."""

    @property
    def total_bytes(self) -> int:
        """Sum of the terms."""
        return int(sum(self.terms.values()))

    def line(self) -> str:
        """One printable line: N, the budget and the terms in GiB."""
        parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in self.terms.items())
        return (f"residency auto: {self.resident_blocks} of {self.num_blocks} blocks resident; "
                f"{self.total_bytes / GiB:.1f} of {self.budget_bytes / GiB:.1f} GiB budget ({parts} GiB)")


def plan_resident_blocks(
    sizes: Sequence[int], root_bytes: int, adapter_bytes: int, *, budget_bytes: int, tokens: int, hidden: int,
    ffn_dim: int, depth: int = 1, reserve_gib: float = 3.0, act_bytes: int = 2,
) -> ResidencyPlan:
    """The largest N (blocks resident, the largest blocks first counted) that fits ``budget_bytes``.

    Args:
        sizes: bytes of each block (:func:`block_bytes`).
        root_bytes / adapter_bytes: from :func:`block_bytes`.
        budget_bytes: the GPU budget (``--gpu-budget-gib`` x 2**30).
        tokens: packed sequence rows of the largest micro-batch (video + audio + text).
        hidden / ffn_dim: the preset's widths.
        depth: prefetch depth.
        reserve_gib: fixed reserve in GiB.
        act_bytes: bytes per element of the activations (the compute dtype: 2 for bf16, 4 for fp32).

    Raises:
        UserError: even N = 0 does not fit the budget (names the budget and the need).
    """
    n_blocks = len(sizes)
    big = max(sizes) if sizes else 0
    fixed = {
        "root": root_bytes,
        "adapters+grads+adamw": 5 * adapter_bytes,
        "activations": n_blocks * tokens * hidden * act_bytes + int(tokens * (12 * hidden + 3 * ffn_dim) * 2 * 1.5),
        "reserve": int(reserve_gib * GiB),
    }
    order = sorted(sizes, reverse=True)
    best = None
    for n in range(n_blocks + 1):
        terms = dict(fixed)
        terms["resident_blocks"] = sum(order[:n])
        terms["streaming_buffers"] = (1 + depth) * 2 * big if n < n_blocks else 0
        if sum(terms.values()) <= budget_bytes:
            best = (n, terms)
    if best is None:
        need = sum(fixed.values()) + (1 + depth) * 2 * big
        raise UserError(f"--gpu-budget-gib {budget_bytes / GiB:.1f} is below what streaming every block needs "
                        f"({need / GiB:.1f} GiB at {tokens} tokens): raise the budget or use shorter clips")
    return ResidencyPlan(resident_blocks=best[0], num_blocks=n_blocks, budget_bytes=int(budget_bytes), terms=best[1])


def model_widths(model: nn.Module) -> tuple[int, int]:
    """``(hidden, ffn_dim)`` of an H3 transformer (or its PEFT wrapper) from its config, for the activation terms."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(base, "config", None)
    hidden = int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "num_attention_heads", 1) * getattr(
        cfg, "attention_head_dim", 1))
    ffn = int(getattr(cfg, "ffn_dim", 0) or 4 * hidden)
    return hidden, ffn


@dataclasses.dataclass(frozen=True)
class Residency:
    """What :func:`resolve_residency` decided: the resident block indices (``None``: no partial residency), their count and,
    for ``auto``, the plan."""

    indices: list[int] | None
    count: int | None
    plan: ResidencyPlan | None


def resolve_residency(model: nn.Module, value: "str | int | None", *, source: str, budget_bytes: int | None, tokens: int,
            no_split_modules: Sequence[str] | None = None, act_bytes: int = 2, reserve_gib: float = 3.0,
            depth: int = 1, say=print) -> Residency:
    """The one resolver of a residency setting on a (meta-device or real) model: every door calls it.

    Args:
        model: the model in its stored dtypes (after the master dtype is set).
        value: the setting as given (parsed by :func:`patches.core.flags.parse_resident_blocks`).
        source: where it came from (``--fsdp-resident-blocks``, ``MILES_RESIDENT_BLOCKS``), for messages.
        budget_bytes: the GPU budget ``auto`` fills (``None``: not known; ``auto`` is then refused).
        tokens: packed rows of the largest micro-batch (the trainer's longest pair, or :data:`DEFAULT_PLAN_TOKENS`).
        no_split_modules: the block classes (default ``model._no_split_modules``).
        act_bytes, reserve_gib, depth: as :func:`plan_resident_blocks`.
        say: where ``auto``'s one line (the count and the model's terms) goes.

    Raises:
        UserError: a count above the model's blocks, ``auto`` without a budget, or a budget too small even to
            stream every block (each one line naming ``source``).
    """
    n = parse_resident_blocks(value, source)
    if n is None:
        return Residency(None, None, None)
    sizes, root, adapters = block_bytes(model, no_split_modules)
    plan = None
    if n == "auto":
        if not budget_bytes:
            raise UserError(f"{source} auto fills the GPU's memory and no GPU was found: give a GPU budget, or a "
                            "number of blocks")
        hidden, ffn = model_widths(model)
        plan = plan_resident_blocks(sizes, root, adapters, budget_bytes=int(budget_bytes), tokens=tokens,
                                    hidden=hidden, ffn_dim=ffn, depth=depth, reserve_gib=reserve_gib,
                                    act_bytes=act_bytes)
        say(f"onecard: {plan.line()} at {tokens} tokens")
        n = plan.resident_blocks
    if n > len(sizes):
        raise UserError(f"{setting(source, n)} but this model has {len(sizes)} FSDP blocks: use at most "
                        f"{len(sizes)}, or auto")
    return Residency(select_resident(len(sizes), int(n)), int(n), plan)


def launcher_args(environ_value: str | None, argv: Sequence[str], cuda: bool) -> list[str]:
    """The trainer flags ``launchers/sft_h3_t2va_1gpu.sh`` adds for its ``RESIDENT_BLOCKS`` variable.

    On a GPU: ``--fsdp-cpu-offload`` and, unless the setting is ``none`` or the trailing arguments already carry
    ``--fsdp-resident-blocks``, ``--fsdp-resident-blocks <RESIDENT_BLOCKS or auto>``. Without a GPU: nothing (every
    block is resident on the CPU; a ``RESIDENT_BLOCKS`` other than ``auto`` is said to be unused, on stderr).

    Raises:
        UserError: a bad ``RESIDENT_BLOCKS`` (:func:`patches.core.flags.parse_resident_blocks`), or both it and
            ``--fsdp-resident-blocks`` given.
    """
    given = any(a == "--fsdp-resident-blocks" or a.startswith("--fsdp-resident-blocks=") for a in argv)
    env = (environ_value or "").strip()
    if env and given:
        raise UserError(f"RESIDENT_BLOCKS={env} and --fsdp-resident-blocks both given: keep one")
    parsed = parse_resident_blocks(env or "auto", "RESIDENT_BLOCKS")
    if not cuda:
        if env and env != "auto":
            import sys

            print(f"onecard: RESIDENT_BLOCKS={env} applies on a GPU only; without one every block stays on the CPU "
                  "and the setting is not used", file=sys.stderr, flush=True)
        return []
    out = ["--fsdp-cpu-offload"]
    if parsed is not None and not given:
        out += ["--fsdp-resident-blocks", str(parsed)]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m miles_ext.levers.residency launcher-args [TRAILING ARGS...]``: one trainer flag a line (the
    launcher's), from ``$RESIDENT_BLOCKS`` and whether CUDA is available; exit 2 with one ``error:`` line on bad
    input."""
    import os
    import sys

    from patches.core.errors import cli
    from patches.core.torchinfo import cuda_available

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "launcher-args":
        print("usage: python -m miles_ext.levers.residency launcher-args [TRAILING ARGS...]", file=sys.stderr)
        return 2

    def run() -> int:
        for flag in launcher_args(os.environ.get("RESIDENT_BLOCKS"), args[1:], cuda_available()):
            print(flag)
        return 0

    return cli(run)


if __name__ == "__main__":
    raise SystemExit(main())
