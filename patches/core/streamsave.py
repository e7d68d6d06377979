"""A ``torch.save`` file written one tensor at a time, with tensors that exist only while they are written.

``torch.save`` pickles the whole object before it writes a byte of tensor data, so every tensor in it must exist
at once. A checkpoint entry that is a conversion of live state (the EMA's fp32 copy of a bf16 GPU weight, 7.25 GiB
for Cosmos3-Edge's frozen weights) would then sit whole in host memory for the length of the save. A
:class:`Deferred` entry is made only when its bytes are written, and dropped right after.

The file is torch's own format, byte for byte the layout ``torch.save`` writes, loadable by ``torch.load`` (also
with ``mmap=True`` and ``weights_only=True``) and a valid zip archive (its CRC-32s are right). It is written in two
passes with torch's documented tools:

1. ``torch.serialization.skip_data`` writes the file with every record's space reserved but not filled, each
   :class:`Deferred` standing in as an untouched (so never resident) host tensor of its shape and dtype;
2. ``torch.load(map_location="meta")`` of that file gives each tensor's storage its offset in the file
   (``_checkpoint_offset``), where its bytes are then written, one storage at a time, and the CRC-32 of each record
   is set in its data descriptor and in the central directory.

A storage that is not already whole in host memory -- one on the GPU, or a :class:`Deferred` that can make itself in
pieces (``piece``) -- is copied or made and written :data:`CHUNK_BYTES` at a time, so the save adds at most about
two pieces to the host's memory whatever the largest tensor (Cosmos3-Edge's ``embed_tokens``, whose fp32 EMA entry is
1 GiB). A :class:`Deferred` without ``piece`` is made whole.
"""

from __future__ import annotations

import copy
import math
import os
import struct
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

CHUNK_BYTES = 64 * 2**20
"""The most bytes of one storage :func:`save` brings into host memory at a time, where the storage is not already
there whole (a GPU tensor's copy, a :class:`Deferred`'s piece)."""


class Deferred:
    """A tensor that :func:`patches.core.io.atomic_torch_save` makes only when it writes it.

    Args:
        shape: the tensor's shape.
        dtype: its ``torch.dtype``.
        make: returns the tensor (any device; contiguous or not), called once, while the file is written; it must
            have ``shape`` and ``dtype`` (else :func:`save` raises ``ValueError``).
        piece: optional; ``piece(start, stop)`` returns the elements ``[start, stop)`` of the tensor ``make`` would
            return, flattened in row-major order: a 1-D tensor of ``stop - start`` elements of ``dtype``, on any
            device. Given, :func:`save` makes the tensor piece by piece (at most :data:`CHUNK_BYTES` a piece) and
            never calls ``make``.
    """

    __slots__ = ("shape", "dtype", "make", "piece")

    def __init__(self, shape: Any, dtype: Any, make: Callable[[], Any],
                 piece: Callable[[int, int], Any] | None = None) -> None:
        self.shape = tuple(shape)
        self.dtype = dtype
        self.make = make
        self.piece = piece

    def __repr__(self) -> str:
        return f"Deferred(shape={self.shape}, dtype={self.dtype})"


def holds_deferred(obj: Any) -> bool:
    """Whether ``obj`` (dicts, lists and tuples) holds a :class:`Deferred` anywhere."""
    if isinstance(obj, Deferred):
        return True
    if isinstance(obj, dict):
        return any(holds_deferred(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_deferred(v) for v in obj)
    return False


def _skeleton(obj: Any) -> Any:
    """``obj`` with each :class:`Deferred` replaced by an uninitialised host tensor of its shape and dtype: memory
    that is allocated but never written, so none of it becomes resident."""
    import torch

    if isinstance(obj, Deferred):
        return torch.empty(obj.shape, dtype=obj.dtype)
    if isinstance(obj, dict):  # a copy keeps the type (OrderedDict, ...): the file holds what torch.save would write
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _skeleton(v)
        return out
    if isinstance(obj, list):
        return type(obj)(_skeleton(v) for v in obj)
    if isinstance(obj, tuple):
        items = [_skeleton(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _pairs(src: Any, meta: Any) -> Iterator[tuple[Any, Any]]:
    """``(source leaf, loaded meta tensor)`` for every tensor or :class:`Deferred` of ``src``, walking ``src`` and
    its meta-loaded copy ``meta`` together (dicts by key, lists and tuples by position)."""
    import torch

    if isinstance(src, Deferred) or torch.is_tensor(src):
        yield src, meta
    elif isinstance(src, dict):
        for k, v in src.items():
            yield from _pairs(v, meta[k])
    elif isinstance(src, (list, tuple)):
        for v, m in zip(src, meta):
            yield from _pairs(v, m)


def _host_bytes(t: Any) -> Any:
    """The bytes of the contiguous tensor ``t``'s own elements as a host ``uint8`` numpy array (copied to the host if
    ``t`` lives elsewhere; a host tensor's bytes are not copied)."""
    import torch

    if t.device.type != "cpu":
        t = t.cpu()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else torch.empty(0, dtype=torch.uint8).numpy()


def _storage_pieces(leaf: Any, chunk: int) -> Iterator[Any]:
    """The bytes of the storage ``torch.save`` writes for ``leaf``, in order, as host ``uint8`` numpy arrays: a host
    storage whole (no copy); a storage elsewhere copied ``chunk`` bytes at a time; a :class:`Deferred` made piece by
    piece of at most ``chunk`` bytes where it has ``piece``, else made whole, checked and made contiguous."""
    import torch

    if isinstance(leaf, Deferred) and leaf.piece is not None:
        size = torch.empty((), dtype=leaf.dtype).element_size()
        n = math.prod(leaf.shape)
        step = max(1, chunk // size)
        for start in range(0, n, step):
            stop = min(n, start + step)
            t = leaf.piece(start, stop)
            if tuple(t.shape) != (stop - start,) or t.dtype != leaf.dtype:
                raise ValueError(f"a deferred checkpoint tensor's piece [{start}, {stop}) was made as "
                                 f"{tuple(t.shape)} {t.dtype}, declared ({stop - start},) {leaf.dtype}")
            data = _host_bytes(t.detach().contiguous())
            del t
            yield data
            del data  # before the next piece is made: one piece alive at a time
        return
    if isinstance(leaf, Deferred):
        t = leaf.make()
        if tuple(t.shape) != leaf.shape or t.dtype != leaf.dtype:
            raise ValueError(f"a deferred checkpoint tensor was made as {tuple(t.shape)} {t.dtype}, "
                             f"declared {leaf.shape} {leaf.dtype}")
        t = t.detach().contiguous()
        storage = t.untyped_storage()
        if t.storage_offset() or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
            storage = t.untyped_storage()
    else:
        storage = leaf.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    if storage.device.type == "cpu":
        yield whole.numpy()
        return
    for start in range(0, storage.nbytes(), chunk):
        data = _host_bytes(whole[start:start + chunk])
        yield data
        del data  # before the next piece is copied


def _records(path: Path) -> dict[int, tuple[str, int, int]]:
    """``{offset of the record's data: (record name, offset of the CRC-32 in its data descriptor, offset of the CRC-32
    in its central directory entry)}`` for every ``data/<key>`` record (a storage) of the torch file at ``path``
    that holds bytes (torch writes each with a data descriptor, its signature included or not; an empty record has
    none, and its CRC-32, 0, is already right)."""
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        start = z.start_dir
    out: dict[int, tuple[str, int, int]] = {}
    with open(path, "rb") as f:
        f.seek(start)
        central = f.read()
        pos = 0
        for info in infos:
            if struct.unpack_from("<I", central, pos)[0] != 0x02014B50:
                raise RuntimeError(f"{path}: no central directory entry for {info.filename}")
            n, e, c = struct.unpack_from("<HHH", central, pos + 28)
            f.seek(info.header_offset + 26)
            ln, le = struct.unpack("<HH", f.read(4))
            data = info.header_offset + 30 + ln + le
            f.seek(data + info.file_size)
            has_sig = struct.unpack("<I", f.read(4))[0] == 0x08074B50
            if info.filename.split("/", 1)[-1].startswith("data/") and info.file_size:  # empty: no descriptor, CRC 0
                out[data] = (info.filename, data + info.file_size + (4 if has_sig else 0), start + pos + 16)
            pos += 46 + n + e + c
    return out


def save(obj: Any, path: str | Path, chunk: int | None = None) -> None:
    """Write ``obj`` to ``path`` as ``torch.save(obj, path)`` would with each :class:`Deferred` made into its tensor,
    bringing into host memory at most ``chunk`` bytes (default :data:`CHUNK_BYTES`) of a storage that is not already
    there (a GPU storage's copy, a :class:`Deferred`'s piece) or one :class:`Deferred` made whole, at a time.

    ``obj`` holds its tensors in dicts, lists and tuples. Two tensors that share a storage are written once and load
    sharing it, as with ``torch.save``.

    Raises:
        ValueError: a :class:`Deferred` made a tensor (or a piece) of another shape or dtype than it declared;
            ``chunk`` < 1.
        RuntimeError: this torch's ``torch.load(map_location="meta")`` gives no storage offsets, or the file holds
            a record this writer did not fill (a tensor inside an object that is not a dict, list or tuple).
    """
    import torch

    chunk = CHUNK_BYTES if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 byte, not {chunk}")
    path = Path(path)
    with torch.serialization.skip_data(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(_skeleton(obj), path)
    meta = torch.load(path, map_location="meta", weights_only=False)
    records = _records(path)
    crcs: dict[int, int] = {}
    fd = os.open(path, os.O_RDWR)
    try:
        for leaf, m in _pairs(obj, meta):
            offset = m.untyped_storage()._checkpoint_offset
            if offset is None or (offset not in records and m.untyped_storage().nbytes()):
                raise RuntimeError(f"torch {torch.__version__} gives no storage offsets at a meta load: this "
                                   "checkpoint cannot be streamed")
            if offset in crcs:  # a storage shared with a tensor already written
                continue
            crc, at = 0, offset
            for data in _storage_pieces(leaf, chunk):
                view = memoryview(data)
                done = 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], at + done)
                crc = zlib.crc32(view, crc)
                at += len(view)
                del data, view
            crcs[offset] = crc
        unfilled = sorted(name for pos, (name, _, _) in records.items() if pos not in crcs)
        if unfilled:
            raise RuntimeError(f"{len(unfilled)} record(s) of {path.name} were not filled (e.g. {unfilled[0]}): a "
                               "tensor sits inside an object other than a dict, list or tuple")
        for offset, crc in crcs.items():
            if offset in records:
                for at in records[offset][1:]:
                    os.pwrite(fd, struct.pack("<I", crc), at)
        os.fsync(fd)
    finally:
        os.close(fd)
