"""The memory ledger's table: predicted GPU and host bytes per component, totals and a fit verdict.

Each recipe fills a :class:`Ledger` with its own components (``cosmos_framework_ext.recipe.ledger``); the
command line is ``python -m patches.ledger``. The budget is the memory the CUDA caching allocator may
reserve (what ``torch.cuda.set_per_process_memory_fraction`` limits); the CUDA context lives outside it and
is listed separately.
"""

from __future__ import annotations

import dataclasses
import math

from .flags import MAX_GPU_GIB
from .runtime import GiB


@dataclasses.dataclass(frozen=True)
class Item:
    """One component of the ledger."""

    name: str
    """What it is (weights, gradients, ...)."""
    gpu_bytes: int
    """Bytes it holds on the GPU at the step's peak."""
    host_bytes: int = 0
    """Bytes it holds in host memory."""
    pinned: bool = False
    """Whether the host bytes are page-locked."""
    note: str = ""
    """How the figure is computed."""


@dataclasses.dataclass
class Ledger:
    """A list of :class:`Item` with the totals a fit check needs.

    Attributes:
        title: what run this is the ledger of.
        items: the components counted against the budget.
        outside: GPU bytes outside the allocator budget (the CUDA context), for information.
        slack: allocator slack as a fraction of the allocated peak (reserved = allocated x (1 + slack)).
    """

    title: str
    items: list[Item]
    outside: list[Item] = dataclasses.field(default_factory=list)
    slack: float = 0.10
    checkpoint_bytes: int = 0
    """Bytes of one checkpoint file of this run on disk (0: not estimated); the pre-flight checks the free space
    of the output folder against it."""

    @property
    def gpu_allocated(self) -> int:
        """Predicted peak of ``torch.cuda.max_memory_allocated`` (bytes)."""
        return sum(i.gpu_bytes for i in self.items)

    @property
    def gpu_reserved(self) -> int:
        """Predicted peak reserved bytes: allocated plus allocator slack."""
        return int(self.gpu_allocated * (1.0 + self.slack))

    @property
    def host_bytes(self) -> int:
        return sum(i.host_bytes for i in self.items)

    @property
    def pinned_bytes(self) -> int:
        return sum(i.host_bytes for i in self.items if i.pinned)

    def fits(self, budget_bytes: int) -> bool:
        """Whether the predicted reserved peak is within ``budget_bytes``."""
        return self.gpu_reserved <= budget_bytes

    def format(self, budget_bytes: int | None = None) -> str:
        """A fixed-width table in GiB."""
        w = max(len(i.name) for i in [*self.items, *self.outside]) + 2
        lines = [self.title, f"{'component':<{w}}{'GPU GiB':>9}{'host GiB':>10}  note"]
        for i in self.items:
            host = f"{i.host_bytes / GiB:>9.2f}{'p' if i.pinned else ' '}" if i.host_bytes else f"{'':>10}"
            lines.append(f"{i.name:<{w}}{i.gpu_bytes / GiB:>9.2f}{host}  {i.note}")
        lines.append(f"{'= allocated peak':<{w}}{self.gpu_allocated / GiB:>9.2f}{self.host_bytes / GiB:>10.2f}  "
                     f"(host: {self.pinned_bytes / GiB:.2f} GiB of it pinned, marked p)")
        lines.append(f"{'+ allocator slack':<{w}}{(self.gpu_reserved - self.gpu_allocated) / GiB:>9.2f}"
                     f"{'':>10}  {self.slack:.0%} of the allocated peak")
        lines.append(f"{'= reserved peak':<{w}}{self.gpu_reserved / GiB:>9.2f}")
        for i in self.outside:
            lines.append(f"{'(' + i.name + ')':<{w}}{i.gpu_bytes / GiB:>9.2f}{'':>10}  {i.note}")
        if budget_bytes is not None:
            verdict = "FITS" if self.fits(budget_bytes) else "DOES NOT FIT"
            lines.append(f"budget {budget_bytes / GiB:.2f} GiB: {verdict} "
                         f"(margin {(budget_bytes - self.gpu_reserved) / GiB:+.2f} GiB)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "title": self.title,
            "items": [dataclasses.asdict(i) for i in self.items],
            "outside": [dataclasses.asdict(i) for i in self.outside],
            "gpu_allocated_bytes": self.gpu_allocated,
            "gpu_reserved_bytes": self.gpu_reserved,
            "host_bytes": self.host_bytes,
            "pinned_bytes": self.pinned_bytes,
        }


MIN_BUDGET_GIB = 0.01
"""The smallest budget :func:`parse_budget` takes (10 MiB): below it the byte count rounds to nothing."""


def parse_budget(text: str, name: str = "--budget-gib") -> int:
    """``--budget-gib`` (or the variable ``name``) text -> bytes.

    Raises:
        ValueError: not a number, or not a finite number of GiB from :data:`MIN_BUDGET_GIB` to
            :data:`patches.core.flags.MAX_GPU_GIB` (``nan``, ``inf``, ``-1``, ``0``, ``1e300``: whose bytes would
            overflow), one line naming ``name`` and the fix.
    """
    try:
        gib = float(text)
    except ValueError:
        raise ValueError(f"{name} {text!r} is not a number: give the card's usable GiB, e.g. 22.06") from None
    if not (math.isfinite(gib) and gib > 0):
        raise ValueError(f"{name} {text!r} must be a positive number of GiB, e.g. 22.06")
    if not MIN_BUDGET_GIB <= gib <= MAX_GPU_GIB:
        raise ValueError(f"{name} {text!r} is not one card's memory: give its usable GiB, from {MIN_BUDGET_GIB:g} to "
                         f"{MAX_GPU_GIB:g} (e.g. 22.06)")
    return int(gib * GiB)
