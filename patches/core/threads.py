"""The CPU threads of background work: a cap on one thread's intra-op threads, and the count a trainer gives each.

A trainer's background threads (the loader threads that build the next micro-batches' host inputs, the EMA's host
lerp) run PyTorch CPU operators, and each such operator splits its work over the calling thread's own OpenMP team:
by default one thread per core, for every calling thread. Two loader threads and the EMA worker can so keep three
teams of all the cores busy at once, while the thread that launches the GPU's kernels (and autograd's device thread)
wait for a core: a host-paced forward then stalls the GPU. :func:`cap_this_thread` caps the team of the thread that
calls it only; the main thread, and threads that never call it, keep PyTorch's default.

The values do not change: the operators these threads run (copies, ``cat``, ``index_select``, pinning, the
elementwise lerp) compute each element the same way whatever the team's size.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["MAX_CAP", "background_threads", "cap_holds", "cap_this_thread", "cores", "thread_pool"]

MAX_CAP = 2**31 - 1
"""The largest cap: ``omp_set_num_threads`` takes a C ``int``."""
_RUNTIMES = ("libgomp", "libiomp5", "libomp")
"""OpenMP runtimes ATen may be linked against (GNU, Intel, LLVM); each exports ``omp_set_num_threads``."""


def cores() -> int:
    """CPU cores this process may run on (its affinity where the OS reports one), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def _count(n: object) -> bool:
    """Whether ``n`` is an ``int`` (not a ``bool``) of at least 1."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _check_cap(n: object) -> None:
    """Refuse a cap that is not an ``int`` from 1 to :data:`MAX_CAP` (``ValueError``)."""
    if not _count(n) or n > MAX_CAP:
        raise ValueError(f"an intra-op thread cap is an integer from 1 to {MAX_CAP}, not {n!r}")


def background_threads(setting: int | str, busy_threads: int, gpu: bool = True) -> int | None:
    """Intra-op threads for each of ``busy_threads`` background threads under ``setting``.

    Args:
        setting: ``"all"`` (no cap: PyTorch's default, one per core, for each), ``"auto"`` (on a GPU run, the cores
            less two, for the main thread and autograd's device thread, shared among the busy threads, at least 1;
            on a CPU run no cap), or a count each from 1 to the cores (:func:`cores`: more would not cap the team
            but grow it past the cores).
        busy_threads: background threads that may run CPU operators at once (an ``int`` >= 1).
        gpu: whether the run computes on a GPU. Without one the main thread's own operators are the work, and a
            cap leaves the OpenMP team of the main thread spinning on cores the capped threads no longer claim
            (measured: a CPU smoke 10 times slower per micro-batch on a loaded 2-core machine).

    Returns:
        The cap for each, or ``None`` for no cap.

    Raises:
        ValueError: a setting that is none of these (the message names the cores), or a bad ``busy_threads``.
    """
    if not _count(busy_threads):
        raise ValueError(f"busy_threads must be an integer of at least 1, not {busy_threads!r}")
    if setting == "all":
        return None
    if setting == "auto":
        return max(1, (cores() - 2) // busy_threads) if gpu else None
    if not _count(setting) or setting > cores():
        raise ValueError(f"background_threads = {setting!r} is not \"all\", \"auto\" or a count from 1 to {cores()} "
                         f"(the cores this process may run on; a larger team than the cores crowds them more, not less): "
                         f"set \"auto\", or a count of at most {cores()}")
    return setting


@functools.cache
def _setters() -> tuple[Callable[[int], None], ...]:
    """``omp_set_num_threads`` of each OpenMP runtime mapped into this process, torch's own first; none where ATen's
    parallel backend is not OpenMP or ``/proc/self/maps`` cannot be read."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return ()
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ()
    paths = {line.split(maxsplit=5)[5].strip() for line in maps.splitlines() if len(line.split(maxsplit=5)) == 6}
    libs = sorted((p for p in paths if Path(p).name.startswith(_RUNTIMES)),
                  key=lambda p: not p.startswith(str(Path(torch.__file__).parent)))
    out = []
    for path in libs:
        try:
            fn = ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], None
        out.append(fn)
    return tuple(out)


def cap_this_thread(n: int | None) -> bool:
    """Cap the intra-op threads of the PyTorch CPU operators the calling thread runs at ``n``; other threads, and
    the default of threads that start later, keep theirs. For a worker pool's ``initializer``.

    It sets the OpenMP runtime's per-thread count (``omp_set_num_threads``, a per-thread setting) after making ATen
    initialise this thread's own (which it does once per thread, at its first parallel operator, from the
    process-wide ``torch.set_num_threads`` value: done later, that would undo the cap). ``torch.set_num_threads``
    itself would also change that process-wide value for every thread started afterwards.

    Args:
        n: the cap (an ``int`` from 1 to :data:`MAX_CAP`), or ``None``: leave the thread as it is.

    Returns:
        Whether the thread's operators now use at most ``n`` threads (``torch.get_num_threads()`` reads ``n`` in it);
        ``False`` where ATen's backend is not OpenMP or its runtime was not found: the thread keeps its count.

    Raises:
        ValueError: ``n`` is not an ``int`` from 1 to :data:`MAX_CAP` (a ``bool`` is not a count).
    """
    if n is None:
        return False
    _check_cap(n)
    torch.get_num_threads()  # ATen's once-per-thread initialisation, now, before the cap
    for setter in _setters():
        setter(n)
        if torch.get_num_threads() == n:
            return True
    return False


def thread_pool(workers: int, name: str, threads: int | None = None) -> concurrent.futures.ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` of ``workers`` threads named ``name-*``, each capped at ``threads`` intra-op threads
    (:func:`cap_this_thread`); ``threads=None``: exactly the pool without a cap (no initializer).

    Raises:
        ValueError: ``threads`` is not ``None`` or an ``int`` from 1 to :data:`MAX_CAP` (checked here, not in the
            first thread the pool starts).
    """
    if threads is None:
        return concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
    _check_cap(threads)
    return concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name,
                                                 initializer=cap_this_thread, initargs=(threads,))


def cap_holds(n: int) -> bool:
    """Whether :func:`cap_this_thread` ``(n)`` takes in a new thread (a short-lived one, started and joined here):
    ``False`` where ATen's backend is not OpenMP or its runtime was not found."""
    with thread_pool(1, "onecard-cap-probe") as pool:
        return pool.submit(cap_this_thread, n).result()
