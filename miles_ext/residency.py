"""Partial residency for the 1-GPU H3 run (issue 14, item 3): N transformer blocks stay on the GPU, the others
are CPU-offloaded FSDP2 units streamed in with prefetch.

``--fsdp-resident-blocks auto|N`` with ``--fsdp-cpu-offload``; ``--gpu-budget-gib`` (default: the card's total
memory) is what ``auto`` fills. :func:`miles_ext.fsdp_policy.apply_fsdp2` does the sharding (``resident=``): the
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
differently (issue 14: loss 2.66513 vs 2.66530 at step 2), while the gradients stay bit-exact across all three.

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

The two activation terms are checked against the all-resident H200 runs of ``benchmarks/h3_1gpu.py`` (full
preset, LoRA r64, bf16; ``tests/equivalence/test_h3_residency.py`` reads the committed results): the GPU peak
rises 892.4 KB per packed row from 576 to 24,290 rows (least squares; a straight line within 0.013 GiB), and
the model says 892.4 KB; everything but the reserve is modelled 0.42 GiB under the measured peak at every size. The first
version of this model kept the block inputs in fp32 "to be safe" and the working set without its gradients:
9.6 GiB over at 24,290 rows, where it refused a 40 GB budget that fits.

``auto`` = the largest N whose total is within the budget (0 .. num_layers), printed with the terms.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from torch import nn

from patches.core.errors import UserError
from patches.core.flags import is_whole_number
from patches.core.runtime import GiB

__all__ = ["ResidencyPlan", "parse_resident_blocks", "select_resident", "wire_prefetch", "plan_resident_blocks",
           "block_bytes"]


def parse_resident_blocks(value: str | int | None) -> str | int | None:
    """``--fsdp-resident-blocks``: ``None``/``""`` (off), ``"auto"``, or a whole number >= 0.

    Raises:
        UserError: anything else (names the flag and the accepted values).
    """
    if value is None or value == "":
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if is_whole_number(text):
        return int(text)
    raise UserError(f"--fsdp-resident-blocks {value!r}: use auto or a whole number of blocks (0 = stream all)")


def select_resident(num_blocks: int, n: int) -> list[int]:
    """Indices of the ``n`` resident blocks out of ``num_blocks``: the ``num_blocks - n`` streamed blocks are
    spread evenly (streamed block k sits at ``round((k + 0.5) * num_blocks / streamed - 0.5)``)."""
    if not 0 <= n <= num_blocks:
        raise ValueError(f"{n} resident blocks out of {num_blocks}")
    streamed = num_blocks - n
    out = {min(num_blocks - 1, max(0, round((k + 0.5) * num_blocks / streamed - 0.5))) for k in range(streamed)}
    return [i for i in range(num_blocks) if i not in out]


def wire_prefetch(blocks: Sequence[nn.Module], streamed: Sequence[int], depth: int = 1) -> None:
    """Explicit FSDP2 prefetch of the streamed blocks: in forward each block gathers the next ``depth`` streamed
    blocks after it; in backward, the previous ``depth`` before it. ``depth`` 0 leaves FSDP2's implicit order."""
    if depth <= 0 or not streamed:
        return
    streamed = sorted(streamed)
    for i, block in enumerate(blocks):
        ahead = [blocks[j] for j in streamed if j > i][:depth]
        behind = [blocks[j] for j in reversed(streamed) if j < i][:depth]
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
        return (f"--fsdp-resident-blocks auto: {self.resident_blocks} of {self.num_blocks} blocks resident; "
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
