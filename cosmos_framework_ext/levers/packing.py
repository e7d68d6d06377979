"""Upstream sequence packing (``PackingDataLoader``) and the zero-drop packing planner.

:func:`pack_indices` is the one implementation of the fit rule; :class:`PackingLoader` (training) and
:func:`plan` (prediction) both call it, so they cannot disagree by construction.

Upstream semantics reproduced:

* samples are packed greedily, in order, into a micro-batch of at most ``cap`` tokens; the fit rule
  is strict: a sample of ``n`` tokens fits only if ``packed + n < cap``;
* look-ahead: a sample that does not fit is set aside and the following ones are tried; the
  micro-batch closes when ``lookahead`` (10) samples are set aside or the stream ends; set-aside
  samples go back to the front of the queue, in their original order, for the next micro-batch;
* a sample that does not fit an *empty* micro-batch is dropped (one error line, counted);
* before packing, the epoch order is partitioned over ranks: rank ``r`` of ``w`` takes positions
  ``r, r + w, r + 2w, ...``.

The planner's command line is the recipe's (``python -m cosmos_framework_ext.recipe.plan``). The lever needs of its
samples only their token counts: a *source* is anything with ``__len__``, ``token_count(i, epoch)``,
``max_token_count(i)`` and ``sample(i, epoch)`` (the recipe's ``SampleSource``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from typing import Protocol

from patches.core.errors import UserError


class PackingError(UserError):
    """No sample fits the packing cap: the run would train nothing (the message names the cap to use)."""


def check_some_sample_fits(source: "Source", cap: int, where: str = "the packing cap") -> None:
    """At least one access of one sample can fit an empty micro-batch at ``cap`` (``source.min_token_count``: the
    smallest window with its caption dropped), so that training is not a loop that drops everything.

    Raises:
        PackingError: no access of any sample fits (names the cap to use).
    """
    smallest = min((source.min_token_count(i) for i in range(len(source))), default=0)
    if smallest and not fits(0, smallest, cap):
        raise PackingError(f"{where} {cap} is below every sample (the smallest possible has {smallest} tokens; the "
                           f"fit rule is tokens < cap): raise it above {smallest}")


class Source(Protocol):
    """What the packing needs of a dataset: per-access token counts and the samples themselves."""

    def __len__(self) -> int: ...

    def token_count(self, i: int, epoch: int) -> int: ...

    def max_token_count(self, i: int) -> int: ...

    def min_token_count(self, i: int) -> int: ...

    def sample(self, i: int, epoch: int) -> Any: ...

__all__ = [
    "DEFAULT_LOOKAHEAD",
    "PackResult",
    "PackStats",
    "PlanReport",
    "PackingLoader",
    "fits",
    "pack_indices",
    "rank_partition",
    "plan",
    "Source",
    "PackingError",
    "check_some_sample_fits",
]

logger = logging.getLogger("onecard.packing")

DEFAULT_LOOKAHEAD = 10
"""Upstream ``PackingDataLoader`` look-ahead: samples set aside before a micro-batch is closed."""

"""Where the CLI builds/uses the sample dataset when ``--dataset`` is not given."""


def fits(packed_tokens: int, num_tokens: int, cap: int) -> bool:
    """Upstream's strict fit rule: ``packed_tokens + num_tokens < cap``."""
    return packed_tokens + num_tokens < cap


@dataclasses.dataclass
class PackResult:
    """Micro-batches of one rank's sample stream.

    Attributes:
        batches: sample indices of each micro-batch, in packing order.
        tokens: total tokens of each micro-batch (same length as ``batches``).
        dropped: ``(index, tokens)`` of each sample that did not fit an empty micro-batch, in order.
    """

    batches: list[list[int]] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    dropped: list[tuple[int, int]] = dataclasses.field(default_factory=list)


def pack_indices(
    order: Sequence[int], token_count: Callable[[int], int], cap: int, lookahead: int = DEFAULT_LOOKAHEAD
) -> PackResult:
    """Pack ``order`` into micro-batches of fewer than ``cap`` tokens with upstream's look-ahead.

    Args:
        order: sample indices in stream order.
        token_count: tokens of sample ``i`` (called once per index).
        cap: micro-batch token capacity; a micro-batch holds at most ``cap - 1`` tokens (strict rule).
        lookahead: the micro-batch is closed once this many non-fitting samples are set aside
            (``0`` or ``1``: at the first sample that does not fit, i.e. no look-ahead).

    Returns:
        The :class:`PackResult`; every index of ``order`` is in exactly one batch or in ``dropped``.

    Raises:
        ValueError: ``cap < 1``, ``lookahead < 0``, or ``token_count`` returns a negative number.
    """
    if cap < 1:
        raise ValueError(f"cap must be >= 1 token, got {cap}")
    if lookahead < 0:
        raise ValueError(f"lookahead must be >= 0, got {lookahead}")
    counts: dict[int, int] = {}
    for i in order:
        if i not in counts:
            n = int(token_count(i))
            if n < 0:
                raise ValueError(f"token_count({i}) returned {n} < 0")
            counts[i] = n
    result = PackResult()
    queue: deque[int] = deque(order)
    while queue:
        batch: list[int] = []
        packed = 0
        set_aside: list[int] = []
        while queue:
            i = queue.popleft()
            n = counts[i]
            if fits(packed, n, cap):
                batch.append(i)
                packed += n
            elif not batch:
                result.dropped.append((i, n))
            else:
                set_aside.append(i)
                if len(set_aside) >= lookahead:
                    break
        # Set-aside samples go back to the front of the queue, in their original order.
        queue.extendleft(reversed(set_aside))
        if batch:
            result.batches.append(batch)
            result.tokens.append(packed)
    return result


def rank_partition(order: Sequence[int], rank: int, world_size: int) -> list[int]:
    """Positions ``rank, rank + world_size, ...`` of ``order`` (upstream's distributed sampler split).

    Raises:
        ValueError: ``world_size < 1`` or ``rank`` not in ``[0, world_size)``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return list(order[rank::world_size])


class PackingLoader:
    """Infinite iterator of packed micro-batches (the samples ``source.sample`` returns) for one rank.

    Per epoch: the record indices are permuted (seeded by ``(seed, epoch)``) when ``shuffle``, the
    order is partitioned over ranks, and the rank's part is packed by :func:`pack_indices` with
    ``source.token_count(i, epoch)``. Every dropped sample logs one error line on the
    ``onecard.packing`` logger, increments :attr:`dropped_count` and is listed in
    :attr:`dropped_samples` (before the epoch's first micro-batch is yielded). After an epoch's micro-batches,
    :attr:`epoch` increments and the next epoch starts (samples are not carried across epochs).

    Args:
        source: per-access sample choice and token counts.
        cap: micro-batch token capacity (strict fit rule).
        rank: this rank, ``0 <= rank < world_size``.
        world_size: number of data-parallel ranks.
        shuffle: permute the records each epoch; identity order otherwise.
        seed: non-negative seed of the epoch permutation.
        lookahead: see :func:`pack_indices`.
        start_epoch: first epoch (to resume).
        decode_video: decode each sample's video window before yielding it (otherwise lazy, see
            :attr:`SftSample.video`, decoded on first access).

    Raises:
        ValueError: bad ``cap``/``rank``/``world_size``/``seed``/``lookahead``/``start_epoch``; while
            iterating, an epoch in which every sample of this rank is dropped.
        DatasetError: while iterating with ``decode_video``, a video cannot be decoded.
    """

    def __init__(
        self,
        source: Source,
        cap: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        lookahead: int = DEFAULT_LOOKAHEAD,
        start_epoch: int = 0,
        decode_video: bool = False,
    ) -> None:
        if cap < 1:
            raise ValueError(f"cap must be >= 1 token, got {cap}")
        rank_partition([], rank, world_size)  # validates rank and world_size
        if seed < 0 or lookahead < 0 or start_epoch < 0:
            raise ValueError(
                f"seed, lookahead and start_epoch must be >= 0, got {seed}, {lookahead}, {start_epoch}"
            )
        self.source = source
        self.cap = cap
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.lookahead = lookahead
        self.epoch = start_epoch
        self.decode_video = decode_video
        self.dropped_count = 0
        """Samples dropped so far (all epochs)."""
        self.dropped_samples: list[tuple[int, int, int]] = []
        """``(epoch, index, tokens)`` of every dropped sample so far."""

    def epoch_order(self, epoch: int) -> list[int]:
        """All record indices in the order of ``epoch`` (before the rank partition)."""
        n = len(self.source)
        if not self.shuffle:
            return list(range(n))
        return [int(i) for i in np.random.default_rng([self.seed, epoch]).permutation(n)]

    def pack_epoch(self, epoch: int) -> PackResult:
        """This rank's packing of ``epoch`` (pure: no logging, no counters)."""
        order = rank_partition(self.epoch_order(epoch), self.rank, self.world_size)
        return pack_indices(order, lambda i: self.source.token_count(i, epoch), self.cap, self.lookahead)

    def _log_drop(self, index: int, tokens: int, epoch: int) -> None:
        rec = self.source.records[index]
        logger.error(
            "dropped sample %d (%s, JSONL line %d, epoch %d): %d tokens do not fit the packing cap of %d "
            "(fit rule: tokens < cap); raise the cap above %d or shorten its caption/windows",
            index, rec.video, rec.line, epoch, tokens, self.cap, tokens,
        )

    def __iter__(self) -> Iterator[list[Any]]:
        while True:
            epoch = self.epoch
            result = self.pack_epoch(epoch)
            for index, tokens in result.dropped:
                self._log_drop(index, tokens, epoch)
                self.dropped_samples.append((epoch, index, tokens))
            self.dropped_count += len(result.dropped)
            if not result.batches and result.dropped:
                raise PackingError(
                    f"every sample of rank {self.rank} was dropped in epoch {epoch} (cap {self.cap}); "
                    f"raise the cap above {max(t for _, t in result.dropped)}"
                )
            for batch in result.batches:
                samples = [self.source.sample(i, epoch) for i in batch]
                if self.decode_video:
                    for s in samples:
                        s.load_video()
                yield samples
            self.epoch = epoch + 1
            if not result.batches:  # this rank holds no samples at all
                return


# --------------------------------------------------------------------------------------------------
# Planner
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PackStats:
    """Packing of one epoch over all ranks of one configuration.

    Attributes:
        cap: token capacity per micro-batch.
        world_size: ranks the epoch is partitioned over.
        batches: per rank, the micro-batches' sample indices.
        tokens: per rank, the micro-batches' token totals.
        dropped: ``(index, tokens)`` of dropped samples, all ranks, rank order.
        micro_batches: number of micro-batches over all ranks.
        samples_packed: samples in micro-batches over all ranks.
        mean_samples_per_micro_batch: ``samples_packed / micro_batches`` (0.0 if none).
        mean_fill: mean of micro-batch tokens / cap.
    """

    cap: int
    world_size: int
    batches: list[list[list[int]]]
    tokens: list[list[int]]
    dropped: list[tuple[int, int]]
    micro_batches: int
    samples_packed: int
    mean_samples_per_micro_batch: float
    mean_fill: float

    @classmethod
    def simulate(cls, counts: Sequence[int], cap: int, world_size: int, lookahead: int) -> PackStats:
        """Pack the identity order of ``counts`` partitioned over ``world_size`` ranks."""
        batches, tokens, dropped = [], [], []
        order = list(range(len(counts)))
        for rank in range(world_size):
            res = pack_indices(rank_partition(order, rank, world_size), counts.__getitem__, cap, lookahead)
            batches.append(res.batches)
            tokens.append(res.tokens)
            dropped.extend(res.dropped)
        flat = [t for per_rank in tokens for t in per_rank]
        micro = len(flat)
        packed = sum(len(b) for per_rank in batches for b in per_rank)
        return cls(
            cap=cap, world_size=world_size, batches=batches, tokens=tokens, dropped=dropped,
            micro_batches=micro, samples_packed=packed,
            mean_samples_per_micro_batch=packed / micro if micro else 0.0,
            mean_fill=sum(flat) / (micro * cap) if micro else 0.0,
        )

    def to_dict(self, include_batches: bool = False) -> dict[str, Any]:
        """JSON-ready dict; batch lists only with ``include_batches``."""
        d = dataclasses.asdict(self)
        d["dropped"] = [list(x) for x in self.dropped]
        if not include_batches:
            del d["batches"], d["tokens"]
        return d


@dataclasses.dataclass
class PlanReport:
    """Prediction of our packing vs the reference (upstream multi-GPU) packing, one epoch.

    Token counts are the zero-drop worst case: each sample's largest window with its full caption.

    Attributes:
        num_samples: records in the dataset.
        max_sample_tokens: largest sample token count; ``max_sample_index`` is its record.
        ours: our packing (``cap``, ``world_size``).
        ref: reference packing (``ref_cap``, ``ref_world_size``).
        ref_grad_accum: reference gradient-accumulation steps.
        ref_samples_per_step: ``ref_world_size * ref_grad_accum * ref.mean_samples_per_micro_batch``.
        grad_accum: our gradient accumulation matching it,
            ``max(1, round_half_up(ref_samples_per_step / (world_size * ours.mean)))``.
        samples_per_step: ``world_size * grad_accum * ours.mean_samples_per_micro_batch``.
        min_zero_drop_cap: smallest cap that drops nothing (``max_sample_tokens + 1``).
    """

    num_samples: int
    max_sample_tokens: int
    max_sample_index: int
    ours: PackStats
    ref: PackStats
    ref_grad_accum: int
    ref_samples_per_step: float
    grad_accum: int
    samples_per_step: float
    min_zero_drop_cap: int

    def to_json(self, include_batches: bool = False) -> str:
        """The report as indented JSON (micro-batch index lists only with ``include_batches``)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["ours"] = self.ours.to_dict(include_batches)
        d["ref"] = self.ref.to_dict(include_batches)
        return json.dumps(d, indent=2, allow_nan=False) + "\n"  # valid JSON or an error, never NaN/Infinity

    def format_table(self) -> str:
        """Human-readable comparison table (multi-line, no trailing newline)."""
        rows = [
            ("", "ours", "reference"),
            ("cap (tokens, strict <)", f"{self.ours.cap}", f"{self.ref.cap}"),
            ("world size", f"{self.ours.world_size}", f"{self.ref.world_size}"),
            ("micro-batches / epoch", f"{self.ours.micro_batches}", f"{self.ref.micro_batches}"),
            ("mean samples / micro-batch", f"{self.ours.mean_samples_per_micro_batch:.3f}",
             f"{self.ref.mean_samples_per_micro_batch:.3f}"),
            ("mean cap fill", f"{self.ours.mean_fill:.1%}", f"{self.ref.mean_fill:.1%}"),
            ("dropped samples", f"{len(self.ours.dropped)}", f"{len(self.ref.dropped)}"),
            ("grad accum", f"{self.grad_accum}", f"{self.ref_grad_accum}"),
            ("samples / optimizer step", f"{self.samples_per_step:.2f}", f"{self.ref_samples_per_step:.2f}"),
        ]
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        w2 = max(len(r[2]) for r in rows)
        lines = [f"{a:<{w0}}  {b:>{w1}}  {c:>{w2}}" for a, b, c in rows]
        lines.append(
            f"{self.num_samples} samples; largest: sample {self.max_sample_index} with "
            f"{self.max_sample_tokens} tokens (zero-drop cap >= {self.min_zero_drop_cap})"
        )
        return "\n".join(lines)


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def plan(
    source: Source | Sequence[int],
    cap: int,
    ref_cap: int,
    ref_grad_accum: int,
    ref_world_size: int,
    world_size: int = 1,
    lookahead: int = DEFAULT_LOOKAHEAD,
) -> PlanReport:
    """Simulate our and the reference packing over one epoch and match samples per optimizer step.

    Both use identity order, the rank partition of their world size, and each sample's
    ``source.max_token_count`` (largest window, full caption), so a zero drop count here
    means no access can ever be dropped at ``cap``.

    Args:
        source: the dataset's source (the recipe's ``SampleSource``), or the per-sample token counts directly.
        cap: our micro-batch token cap.
        ref_cap: the reference token cap.
        ref_grad_accum: reference gradient-accumulation steps (>= 1).
        ref_world_size: reference data-parallel ranks (>= 1).
        world_size: our data-parallel ranks (>= 1).
        lookahead: packing look-ahead (upstream 10).

    Raises:
        ValueError: an empty dataset or a non-positive argument.
    """
    for name, value in (("cap", cap), ("ref_cap", ref_cap), ("ref_grad_accum", ref_grad_accum),
                        ("ref_world_size", ref_world_size), ("world_size", world_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if hasattr(source, "max_token_count"):
        counts = [source.max_token_count(i) for i in range(len(source))]
    else:
        counts = [int(c) for c in source]
    if not counts:
        raise ValueError("the dataset holds no samples")
    ours = PackStats.simulate(counts, cap, world_size, lookahead)
    ref = PackStats.simulate(counts, ref_cap, ref_world_size, lookahead)
    ref_sps = ref_world_size * ref_grad_accum * ref.mean_samples_per_micro_batch
    per_micro = world_size * ours.mean_samples_per_micro_batch
    grad_accum = max(1, _round_half_up(ref_sps / per_micro)) if per_micro > 0 else 1
    max_tokens = max(counts)
    return PlanReport(
        num_samples=len(counts), max_sample_tokens=max_tokens, max_sample_index=counts.index(max_tokens),
        ours=ours, ref=ref, ref_grad_accum=ref_grad_accum, ref_samples_per_step=ref_sps,
        grad_accum=grad_accum, samples_per_step=world_size * grad_accum * ours.mean_samples_per_micro_batch,
        min_zero_drop_cap=max_tokens + 1,
    )
