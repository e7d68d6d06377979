"""The memory ledger: what a run will hold on the GPU and on the host, before it runs.

``python -m patches.ledger --toml toml/vision_sft_edge_24gb.toml --budget-gib 22.06`` builds the recipe's
model on the meta device (nothing is allocated), itemises every component's predicted GPU and host
bytes, totals them against the budget and says whether the run fits. For a run that does not fit it
names the lever (or the cap) that closes the gap. The launcher's ``DRYRUN=1`` prints the same, and
every real run prints it at start.

The budget is the memory the CUDA caching allocator may reserve (what
``torch.cuda.set_per_process_memory_fraction`` limits); the CUDA context lives outside it and is listed
separately.

Exit status: 0 fits, 1 does not fit, 2 bad input (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Iterable

GiB = float(2**30)


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


def parse_budget(text: str) -> int:
    """``--budget-gib`` text -> bytes; raises ``ValueError`` naming the fix for a non-positive or non-number."""
    try:
        gib = float(text)
    except ValueError:
        raise ValueError(f"--budget-gib {text!r} is not a number: give the card's usable GiB, e.g. 22.06") from None
    if not gib > 0 or gib != gib or gib == float("inf"):
        raise ValueError(f"--budget-gib {text!r} must be a positive number of GiB, e.g. 22.06")
    return int(gib * GiB)


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m patches.ledger", description=__doc__.split("\n\n")[0])
    ap.add_argument("--toml", required=True, help="recipe TOML")
    ap.add_argument("--budget-gib", default="22.06", help="usable GPU memory in GiB (default 22.06: a 24 GB A10G)")
    ap.add_argument("--preset", default="edge", help="model preset to size (default edge)")
    ap.add_argument("--world-size", type=int, default=1, help="ranks (NPROC_PER_NODE x NNODES); default 1")
    args = ap.parse_args(list(argv) if argv is not None else None)
    from cosmos_framework_ext import config as cfgmod
    from cosmos_framework_ext.ledger import cosmos_ledger, what_closes_the_gap

    from . import flags

    try:
        budget = parse_budget(args.budget_gib)
        cfg = cfgmod.load(args.toml)
        env_flags = flags.read_all()
        ledger = cosmos_ledger(cfg, args.preset, env_flags, world_size=args.world_size)
    except (ValueError, flags.FlagError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(ledger.format(budget))
    if ledger.fits(budget):
        return 0
    print(what_closes_the_gap(cfg, args.preset, env_flags, budget, world_size=args.world_size))
    return 1


if __name__ == "__main__":
    sys.exit(main())
