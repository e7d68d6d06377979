"""Load the next items on worker threads while the current one is used (data work off the critical path)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from patches.core.threads import thread_pool

T = TypeVar("T")

__all__ = ["prefetched"]


def prefetched(items: Iterable[T], load: Callable[[T], Any], workers: int = 2, depth: int = 2,
               threads: int | None = None) -> Iterator[Any]:
    """Yield ``load(item)`` for each of ``items``, in order, while the next ``depth`` are loaded on ``workers``
    threads, each running its PyTorch CPU operators on at most ``threads`` intra-op threads (``None``: PyTorch's
    default, one per core; :func:`patches.core.threads.thread_pool`).

    PyAV and safetensors release the GIL while decoding or reading, so the load of the next item overlaps the use of
    this one. An error raised by ``load`` surfaces when its item is reached.
    """
    with thread_pool(workers, "onecard-load", threads) as pool:
        queue: collections.deque = collections.deque()
        it = iter(items)
        while True:
            while len(queue) < depth:
                try:
                    queue.append(pool.submit(load, next(it)))
                except StopIteration:
                    break
            if not queue:
                return
            yield queue.popleft().result()
