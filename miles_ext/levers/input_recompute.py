"""Checkpointed block inputs recomputed instead of kept, for the H3 transformer blocks (exact).

**What holds the card under full offload.** Gradient checkpointing keeps each transformer block's input until that
block's backward: ``tokens x hidden`` bf16 values per block, 0.28 GiB at the recipe's 27,580 tokens and 13.8 GiB for
the 50 blocks, over half of the 24.2 GiB a full-offload step peaks at (``docs/h3.md``). Parking them in host memory
would need about 89 GB of host, over the 75 GB the run may use.

**The lever.** For a chosen set of blocks ``b`` (:func:`select_dropped`: never block 0, never two in a row), ``b``'s
checkpoint keeps no input. It keeps a *recipe* instead: the block before it (``a``), ``a``'s own arguments (``a``'s
input is kept by ``a``'s checkpoint anyway) and nothing else. When ``b``'s backward starts, the recipe runs ``a``'s
forward once more, in the conditions of ``a``'s first forward (grad mode on, the same argument tensors, nothing saved
for backward), and hands its output to ``b``'s recompute, which then runs unchanged. The same kernels on the same
bytes give the same bits, so every gradient is bitwise the plain checkpoint's; the cost is one more forward of ``a``
per dropped input (a quarter of a block's checkpointed forward-and-backward work).

It is torch's own non-reentrant checkpoint in both cases (``torch.utils.checkpoint.checkpoint(block.__call__, *args,
use_reentrant=False)``, what diffusers calls): for a dropped input, a ``saved_tensors_hooks`` pair around that call
replaces the checkpoint's saved copy of the block input (its ``_NoopSaveInputs`` node, the only thing that holds it
after the forward) with the recipe, and the unpack runs the recipe.

**FSDP2.** ``a``'s forward inside ``b``'s backward gathers ``a``'s weights (a host-to-device copy under CPU offload);
FSDP2 does not reshard a unit whose forward runs inside a backward (``FSDPParamGroup.post_forward`` checks
``is_bw()``), so ``a``'s own backward, which comes next, finds them gathered: no extra copy, one more block's weights
on the card while ``b``'s backward runs (the memory model counts it, :func:`full_offload_terms`).

Installed with :func:`enable` (diffusers' ``enable_gradient_checkpointing(gradient_checkpointing_func=...)``); the
token refiner's blocks and any other checkpointed module go through the plain checkpoint. Proof:
``tests/equivalence/test_h3_input_recompute.py`` (gradients and weights bitwise the plain checkpoint's under full
offload and all-resident, the dropped inputs freed after the forward, the extra forwards counted; planted: a recipe
that runs the wrong block, and a pack hook that keeps the input).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from patches.core.errors import UserError
from patches.core.units import GiB

__all__ = ["InputRecompute", "enable", "select_dropped", "full_offload_terms", "plan_dropped", "DroppedPlan",
           "parse_setting", "resolve_count", "FULL_OFFLOAD_MARGIN_GIB", "FRAGMENTATION_GIB"]

FULL_OFFLOAD_MARGIN_GIB = 0.6
"""What a full-offload step holds besides the gathered blocks, the block inputs and one block's backward working set
(GiB): embeddings, the loss, gathered adapters, staging. Calibrated on the full-offload H200 rows of 2026-11-30 to
12-04 (576 to 27,580 tokens, with and without the side-stream prefetch, with 18 inputs recomputed), which the model
then over-predicts by 0.01-0.51 GiB (``tests/equivalence/test_h3_input_recompute.py``)."""

FRAGMENTATION_GIB = 1.0
"""Room left between the peak allocated and a card cap (the allocator's reserved-but-free blocks), GiB: ``auto``
plans the peak allocated to ``budget - FRAGMENTATION_GIB``."""


def select_dropped(num_blocks: int, k: int) -> list[int]:
    """The ``k`` blocks (indices into the transformer blocks) whose inputs are recomputed: spread evenly over the odd
    indices ``1, 3, 5, ...`` (so never block 0 and never two in a row), ``odd[round((j + 0.5) * n_odd / k - 0.5)]``.

    Raises:
        ValueError: ``k`` is negative or above ``num_blocks // 2``.
    """
    odd = list(range(1, num_blocks, 2))
    if not 0 <= k <= len(odd):
        raise ValueError(f"{k} recomputed block inputs out of {num_blocks} blocks: use 0 to {len(odd)} (every second "
                         "block at most, never the first)")
    return sorted({odd[min(len(odd) - 1, max(0, round((j + 0.5) * len(odd) / k - 0.5)))] for j in range(k)})


class _InputRecipe:
    """How to recompute a dropped block input: block ``a`` and the arguments of its first call."""

    __slots__ = ("block", "args", "owner")

    def __init__(self, block: nn.Module, args: tuple, owner: "InputRecompute"):
        self.block, self.args, self.owner = block, args, owner

    def run(self) -> torch.Tensor:
        """``a``'s output again: grad mode on as in its first (checkpointed) forward, every saved tensor discarded
        (nothing ever runs backward through this graph), the output detached."""
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_discard, _never_unpacked):
            out = self.block(*self.args)
        self.owner.recomputed += 1
        return out.detach()


def _discard(t: torch.Tensor) -> None:
    return None


def _never_unpacked(x: Any) -> torch.Tensor:  # pragma: no cover - a graph nobody backpropagates through
    raise RuntimeError("onecard: a recomputed block input's graph was backpropagated through")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is the block input ``b``, or a handle of all of it: torch 2.13 hands a custom Function's saved input to
    the pack hook as the very tensor (the CPU proof); the alias test, which the H200 run (torch 2.11) used, keeps the
    lever working should a version hand over another handle. A miss keeps the input (memory, never values)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype and a.device == b.device)


class InputRecompute:
    """diffusers' gradient-checkpointing function with the inputs of ``dropped`` blocks recomputed (module docstring).

    Args:
        blocks: the transformer blocks in forward order (``model.transformer_blocks``).
        dropped: indices into ``blocks`` whose inputs are recomputed (:func:`select_dropped`); none may be 0 or follow
            another dropped one.

    Counters (per instance, for reports and proofs): ``dropped_calls`` checkpoints that kept a recipe instead of the
    input, ``recomputed`` recipes run.

    Raises:
        ValueError: a bad ``dropped`` set.
    """

    def __init__(self, blocks: Sequence[nn.Module], dropped: Iterable[int]):
        self.blocks = list(blocks)
        self.dropped = frozenset(int(i) for i in dropped)
        bad = sorted(i for i in self.dropped if not 0 < i < len(self.blocks) or i - 1 in self.dropped)
        if bad:
            raise ValueError(f"blocks {bad} cannot have their inputs recomputed: not block 0, not past the last "
                             f"({len(self.blocks) - 1}), never right after another recomputed one")
        self._index = {id(b): i for i, b in enumerate(self.blocks)}
        self._last: tuple[int, nn.Module, tuple, weakref.ref] | None = None
        self.dropped_calls = 0
        self.recomputed = 0

    def __call__(self, block: nn.Module, *args: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        i = self._index.get(id(block))
        last, self._last = self._last, None
        recipe = None
        if (i is not None and i in self.dropped and last is not None and last[0] == i - 1 and args
                and torch.is_tensor(args[0]) and last[3]() is args[0]):
            recipe = _InputRecipe(last[1], last[2], self)
        del last
        if recipe is None:
            out = checkpoint(block.__call__, *args, use_reentrant=False)
        else:
            target = args[0]

            def pack(t: torch.Tensor) -> Any:
                return recipe if _same(t, target) else t

            def unpack(x: Any) -> torch.Tensor:
                return x.run() if isinstance(x, _InputRecipe) else x

            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                out = checkpoint(block.__call__, *args, use_reentrant=False)
            del target
            self.dropped_calls += 1
        if i is not None and i + 1 in self.dropped and torch.is_tensor(out):
            self._last = (i, block, args, weakref.ref(out))  # the next block's recipe, if it is called with ``out``
        return out

    def reset(self) -> None:
        """Forget the last block's call (after a forward, so nothing outlives it)."""
        self._last = None


def _base_bytes(block: nn.Module) -> int:
    """Bytes of ``block``'s base parameters in their stored dtypes (LoRA adapters left out; meta or sharded alike)."""
    return sum(p.numel() * p.element_size() for n, p in block.named_parameters()
               if ".lora_A." not in f".{n}" and ".lora_B." not in f".{n}")


def _transformer(model: nn.Module) -> nn.Module:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "transformer_blocks") or not hasattr(base, "enable_gradient_checkpointing"):
        raise ValueError(f"{type(base).__name__} has no transformer_blocks to recompute inputs of (an H3 transformer "
                         "is needed)")
    return base


def enable(model: nn.Module, k: int) -> InputRecompute | None:
    """Gradient checkpointing on ``model`` (an H3 transformer, its PEFT wrapper or its FSDP2 root) with ``k`` block
    inputs recomputed (:func:`select_dropped`); ``k == 0`` leaves diffusers' plain checkpoint and returns ``None``.
    The instance is ``model._onecard_input_recompute``; a forward hook on the root forgets the last block's call.

    Raises:
        ValueError: ``model`` is no H3 transformer, or ``k`` is out of range.
    """
    base = _transformer(model)
    blocks = list(base.transformer_blocks)
    dropped = select_dropped(len(blocks), k)
    if not dropped:
        return None
    fn = InputRecompute(blocks, dropped)
    base.enable_gradient_checkpointing(gradient_checkpointing_func=fn)
    base.register_forward_hook(lambda module, args, output: fn.reset())
    model._onecard_input_recompute = fn
    return fn


# ------------------------------------------------------------------------------------------------ memory model
def full_offload_terms(tokens: int, *, num_blocks: int, hidden: int, ffn_dim: int, block_bytes: int, dropped: int = 0,
                       act_bytes: int = 2, prefetch: bool = False) -> dict[str, int]:
    """The GPU bytes of a full-offload H3 step (every unit streamed, adapters and AdamW on the host), term by term.

    - ``streamed block``: the running block's gathered weights (``block_bytes``, the largest block);
    - ``second gathered block``: ``block_bytes`` when ``dropped > 0`` (the block before a recomputed input, gathered
      while the next block runs its backward) or ``prefetch`` (the side-stream prefetch's staged copy of the next
      block, :mod:`miles_ext.levers.h2d_prefetch`); both at once are still one block: the recipe's forward consumes
      the staged copy;
    - ``block inputs``: ``(num_blocks - dropped) * tokens * hidden * act_bytes`` (``num_blocks``: every FSDP block,
      as :func:`miles_ext.levers.residency.plan_resident_blocks` counts them);
    - ``backward working set``: ``tokens * (12 * hidden + 3 * ffn_dim) * 2 * 1.5`` (the residency model's term);
    - ``margin``: :data:`FULL_OFFLOAD_MARGIN_GIB`.
    """
    return {
        "streamed block": int(block_bytes),
        "second gathered block": int(block_bytes) if dropped or prefetch else 0,
        "block inputs": (num_blocks - dropped) * tokens * hidden * act_bytes,
        "backward working set": int(tokens * (12 * hidden + 3 * ffn_dim) * 2 * 1.5),
        "margin": int(FULL_OFFLOAD_MARGIN_GIB * GiB),
    }


@dataclasses.dataclass(frozen=True)
class DroppedPlan:
    """What :func:`plan_dropped` chose: ``dropped`` inputs recomputed, the predicted peak's terms, the budget."""

    dropped: int
    terms: dict
    budget_bytes: int

    @property
    def total_bytes(self) -> int:
        return int(sum(self.terms.values()))

    def line(self) -> str:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.terms.items())
        return (f"input recompute auto: {self.dropped} block inputs recomputed; predicted peak "
                f"{self.total_bytes / GiB:.2f} GiB allocated for a {self.budget_bytes / GiB:.2f} GiB budget less "
                f"{FRAGMENTATION_GIB:g} GiB ({parts} GiB)")


def plan_dropped(tokens: int, *, budget_bytes: int, num_blocks: int, num_transformer_blocks: int, hidden: int,
                 ffn_dim: int, block_bytes: int, act_bytes: int = 2, prefetch: bool = False) -> DroppedPlan:
    """The fewest recomputed block inputs (0 .. ``num_transformer_blocks // 2``) whose full-offload peak
    (:func:`full_offload_terms`) is within ``budget_bytes - FRAGMENTATION_GIB``.

    Raises:
        UserError: even every second input recomputed does not fit (names the budget, the tokens and the need).
    """
    target = budget_bytes - FRAGMENTATION_GIB * GiB
    most = num_transformer_blocks // 2
    for k in range(most + 1):
        terms = full_offload_terms(tokens, num_blocks=num_blocks, hidden=hidden, ffn_dim=ffn_dim,
                                   block_bytes=block_bytes, dropped=k, act_bytes=act_bytes, prefetch=prefetch)
        if sum(terms.values()) <= target:
            return DroppedPlan(k, terms, int(budget_bytes))
    need = math.ceil((sum(terms.values()) / GiB + FRAGMENTATION_GIB) * 100) / 100  # rounded up: never "x of x"
    raise UserError(f"a {budget_bytes / GiB:.2f} GiB GPU budget does not hold {tokens} token{'s' * (tokens != 1)} under "
                    f"full offload even with {most} block inputs recomputed ({need:.2f} GiB needed, "
                    f"{FRAGMENTATION_GIB:g} of it allocator room): raise the budget (--gpu-budget-gib, "
                    "ONECARD_GPU_MEMORY_GIB), use shorter clips or a larger card")


def parse_setting(value: "str | int | None", source: str) -> "str | int":
    """A recompute setting (``--recompute-block-inputs``): ``"auto"``, a whole number >= 0 of block inputs, or 0 for
    unset, empty or ``none``. Any case.

    Raises:
        UserError: anything else, one line naming ``source`` and the accepted values.
    """
    from patches.core.flags import read_count, shown

    if value is None:
        return 0
    text = str(value).strip().lower()
    if text in ("", "none"):
        return 0
    if text == "auto":
        return "auto"
    count = read_count(text)
    if count is not None:
        return count
    raise UserError(f"{source} {shown(value)}: use auto, a whole number of block inputs to recompute (0 keeps every "
                    "input; at most every second block), or none")


def resolve_count(model: nn.Module, value: "str | int | None", *, source: str, full_offload: bool,
            budget_bytes: int | None, tokens: int, act_bytes: int = 2, prefetch: bool = False,
            say=print) -> tuple[int, DroppedPlan | None]:
    """The number of block inputs to recompute for ``model`` (meta or real, stored dtypes) and, for ``auto``, the
    plan. ``auto`` plans full offload's peak (:func:`plan_dropped`; ``prefetch``: the side-stream prefetch is on) for
    ``budget_bytes`` and ``tokens`` and prints its line through ``say``.

    Raises:
        UserError: a bad value (:func:`parse_setting`); a count above half the transformer blocks; ``auto`` without
            full offload or without a budget; ``auto`` whose budget holds no plan (:func:`plan_dropped`).
    """
    from miles_ext.levers.residency import model_widths

    n = parse_setting(value, source)
    blocks = len(_transformer(model).transformer_blocks)
    if isinstance(n, int):
        if n > blocks // 2:
            raise UserError(f"{source} {n}: at most every second of the {blocks} transformer blocks can have its input "
                            f"recomputed: use 0 to {blocks // 2}, or auto")
        return n, None
    if not full_offload:
        raise UserError(f"{source} auto plans the GPU peak of full offload (every block streamed): add "
                        "--fsdp-cpu-offload without --fsdp-resident-blocks, or give a number")
    if not budget_bytes:
        raise UserError(f"{source} auto fills the GPU's memory and no GPU was found: give a number of block inputs")
    base = _transformer(model)
    wrap = set(getattr(base, "_no_split_modules", None) or ())
    # before or after fully_shard, which renames each unit's class FSDP<name>
    num_blocks = sum(1 for m in base.modules() if type(m).__name__.removeprefix("FSDP") in wrap)
    hidden, ffn = model_widths(model)
    plan = plan_dropped(tokens, budget_bytes=int(budget_bytes), num_blocks=num_blocks, num_transformer_blocks=blocks,
                        hidden=hidden, ffn_dim=ffn, block_bytes=max(_base_bytes(b) for b in base.transformer_blocks),
                        act_bytes=act_bytes, prefetch=prefetch)
    say(f"onecard: {plan.line()} at {tokens} tokens")
    return plan.dropped, plan
