"""Pinned host memory at its exact size.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds each
block up to a power of two (five 1.2 GiB tensors lock 10 GiB). A
:class:`HostArena` instead allocates one ordinary host buffer of exactly the bytes asked and page-locks it
with ``cudaHostRegister``, then hands out views carved from it. Without CUDA the buffer is ordinary memory
and :attr:`HostArena.pinned_bytes` is 0.

Process-wide accounting: :func:`pinned_bytes_total` sums the bytes every live arena has locked.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .runtime import GiB

_ALIGN = 64  # bytes; every view starts on a 64-byte boundary
_live: "weakref.WeakSet[HostArena]" = weakref.WeakSet()
_lock = threading.Lock()


def _cuda_usable() -> bool:
    return torch.cuda.is_available()


class HostArena:
    """One flat host buffer, page-locked at its exact size when CUDA is present, carved into tensors.

    Args:
        specs: ``(shape, dtype)`` of each tensor to carve, in order.
        pin: page-lock the buffer (ignored without CUDA).
        name: label for reports.

    Attributes:
        tensors: the carved tensors, one per spec, each a view into the arena.
        nbytes: bytes of the buffer (sum of the specs, each aligned to 64 bytes).
        pinned_bytes: bytes page-locked (``nbytes`` when pinned, else 0).

    Raises:
        RuntimeError: ``cudaHostRegister`` failed (for example, the locked-memory limit was hit).
    """

    def __init__(self, specs: list[tuple[tuple[int, ...], torch.dtype]], pin: bool = True, name: str = "arena"):
        self.name = name
        offsets = []
        total = 0
        for shape, dtype in specs:
            total = (total + _ALIGN - 1) // _ALIGN * _ALIGN
            offsets.append(total)
            numel = 1
            for s in shape:
                numel *= int(s)
            total += numel * torch.empty((), dtype=dtype).element_size()
        self.nbytes = total
        self._buf = torch.empty(max(total, 1), dtype=torch.uint8)
        self.pinned_bytes = 0
        if pin and _cuda_usable() and total > 0:
            rc = torch.cuda.cudart().cudaHostRegister(self._buf.data_ptr(), total, 0)
            if int(rc) != 0:
                raise RuntimeError(
                    f"cudaHostRegister of {total / GiB:.2f} GiB for {name} failed (error {int(rc)}): "
                    "raise the locked-memory limit (ulimit -l) or free host memory"
                )
            self.pinned_bytes = total
        self.tensors: list[torch.Tensor] = []
        for (shape, dtype), off in zip(specs, offsets):
            numel = 1
            for s in shape:
                numel *= int(s)
            nb = numel * torch.empty((), dtype=dtype).element_size()
            self.tensors.append(self._buf[off : off + nb].view(dtype).view(shape))
        self._finalizer = weakref.finalize(self, HostArena._unregister, self._buf, self.pinned_bytes)
        with _lock:
            _live.add(self)

    @staticmethod
    def _unregister(buf: torch.Tensor, pinned: int) -> None:
        if pinned:
            try:
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
            except Exception:  # interpreter shutdown: the process is exiting anyway
                pass

    def release(self) -> None:
        """Unlock and drop the buffer now; the carved tensors must not be used afterwards."""
        self._finalizer()
        self.pinned_bytes = 0
        self.tensors = []
        self._buf = torch.empty(0, dtype=torch.uint8)


def pinned_bytes_total() -> int:
    """Bytes page-locked by all live :class:`HostArena` objects of this process."""
    with _lock:
        return sum(a.pinned_bytes for a in list(_live))
