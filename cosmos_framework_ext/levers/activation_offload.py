"""Offloaded layers: the activations of the first decoder layers wait in pinned host memory, not recomputed.

With ``[onecard] offload_layers = k`` the first ``k`` of the checkpointed decoder layers are not checkpointed: each
keeps every activation its backward needs, as an uncheckpointed layer does, but in pinned host memory. During the
forward pass each saved tensor of such a layer is copied to the host on a side stream (device to host) and its GPU
memory is released once the copy is done; in the backward pass the layer's tensors are copied back (host to device,
another side stream) before the backward reaches it. The GPU runs each of these layers once instead of twice (no
recompute), for the same GPU memory at the forward's peak as a checkpointed layer once its copies are done; the price is the PCIe traffic (0.57 GB
each way per edge-preset layer for a near-cap micro-batch, measured; about 10 ms at 55 GB/s) and the pinned host
memory (the trainer reserves the ledger's bound, 0.71 GiB a layer at cap 12288).

Why the first layers: their copies to the host overlap the forward of every later layer, and their copies back the
backward of every checkpointed layer after them (the backward runs last to first). The copies back start when the
backward reaches the last checkpointed layer (:attr:`ActivationOffload.trigger`), once the uncheckpointed layers'
activations have been freed, so the tensors coming back take the GPU memory those released.

Exact by construction, given the stream order of :class:`ActivationOffload`: the same ops run on the same inputs as in
an uncheckpointed layer, and the backward reads
bitwise copies of the values the forward saved (the same shape, strides and dtype). Only where they waited changes.
``tests/equivalence/test_activation_offload.py`` proves the loss and every gradient ``torch.equal`` to the same
layers left on the GPU, anchored to every layer checkpointed (CPU, fp32, packed micro-batches, eager and compiled with
``aot_eager``), and on a GPU (compiled with inductor, the copies on their streams) within the compiled layers' own
run-to-run difference.

How it hooks in: PyTorch's ``torch.autograd.graph.saved_tensors_hooks`` around the call of each offloaded layer.
The call is made outside the compiled region (the decoder stack's loop receives a thin caller for each offloaded
layer), so ``torch.compile`` sees no hook: plain Python hooks are not inlined, and the compiled layer's saved
tensors pass through them at run time. A tensor stays on the GPU (the hook returns it as it is) when it is a
parameter or buffer of the model, smaller than :data:`MIN_BYTES`, or not contiguous.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from patches.core.host_arena import HostArena

__all__ = ["ALIGN", "CHUNK_BYTES", "MIN_BYTES", "ROUND_BYTES", "ActivationOffload", "offload_activations"]

MIN_BYTES = 1 << 20
"""Saved tensors smaller than this (bytes) stay on the GPU: a copy each way costs more launch time than they hold."""
CHUNK_BYTES = 256 << 20
"""Smallest pinned host chunk (bytes) a layer's copies are carved from; chunks are kept and reused."""
ALIGN = 64
"""Byte alignment of every tensor carved from a chunk."""
ROUND_BYTES = 16 << 20
"""A consolidated chunk's size is rounded up to this many bytes."""
_MARK = "_onecard_activation_offload"


class _OffloadedTensor:
    """One saved tensor while it lives on the host (the value the pack hook returns to autograd)."""

    __slots__ = ("layer", "step", "host", "shape", "dtype", "device", "back")

    def __init__(self, layer: int, step: int, host: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
                 device: torch.device):
        self.layer, self.step, self.host, self.shape, self.dtype, self.device = layer, step, host, shape, dtype, device
        self.back: torch.Tensor | None = None  # the tensor on its device again, once copied back


class _Chunks:
    """A layer's pinned host chunks and the cursor the current forward pass carves from.

    A pass that needs more than the chunks hold gets a new chunk (at least :data:`CHUNK_BYTES`); at the next
    :meth:`rewind` chunks that a pass spread over are replaced by one chunk of the most bytes a pass has carved
    (rounded up to :data:`ROUND_BYTES`), so the host holds about one pass's bytes, not the chunks' leftovers."""

    def __init__(self, name: str):
        self.name = name
        self.arenas: list[HostArena] = []
        self.at = (0, 0)  # (chunk, byte offset)
        self.used = 0  # bytes carved by the current pass (alignment included)
        self.peak = 0  # the most bytes a pass carved
        self.pin = False

    def reserve(self, nbytes: int, pin: bool) -> None:
        """Hold one chunk of ``nbytes`` now (before training), so that passes up to that size page-lock nothing."""
        if nbytes > 0 and not self.arenas:
            self.pin = pin
            self.arenas.append(HostArena([((nbytes,), torch.uint8)], pin=pin, name=f"{self.name} chunk"))

    def rewind(self) -> None:
        """Start the next pass at the first byte (one chunk of the peak when the last pass spread over several)."""
        self.peak = max(self.peak, self.used)
        if len(self.arenas) > 1:
            size = -(-self.peak // ROUND_BYTES) * ROUND_BYTES
            for a in self.arenas:
                a.release()
            self.arenas = [HostArena([((size,), torch.uint8)], pin=self.pin, name=f"{self.name} chunk")]
        self.at, self.used = (0, 0), 0

    def carve(self, nbytes: int, pin: bool) -> torch.Tensor:
        """``nbytes`` uint8 from the chunks (a new chunk of at least :data:`CHUNK_BYTES` when none has room); the view
        is valid until the next :meth:`rewind` (which may replace the chunks)."""
        self.pin = pin
        i, off = self.at
        while i < len(self.arenas):
            start = (off + ALIGN - 1) // ALIGN * ALIGN
            if start + nbytes <= self.arenas[i].nbytes:
                self.at = (i, start + nbytes)
                self.used += start - off + nbytes
                return self.arenas[i].tensors[0][start:start + nbytes]
            i, off = i + 1, 0
        size = max(nbytes, CHUNK_BYTES)
        self.arenas.append(HostArena([((size,), torch.uint8)], pin=pin, name=f"{self.name} chunk {len(self.arenas)}"))
        self.at = (len(self.arenas) - 1, nbytes)
        self.used += nbytes
        return self.arenas[-1].tensors[0][:nbytes]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arenas)


class ActivationOffload:
    """Keeps the saved tensors of the decoder layers ``layers`` in pinned host memory between forward and backward.

    Contract: one backward per forward pass, before the next forward pass (the trainer's micro-batch). Each
    :meth:`begin` starts a pass and reuses the host chunks; unpacking a tensor of an earlier pass (a graph kept with
    ``retain_graph`` or backwarded after a later forward) raises ``RuntimeError`` instead of reading reused bytes.

    Stream order on CUDA (every copy is asynchronous to the host):

    - a tensor's copy to the host runs on the device-to-host stream after everything queued on the current stream
      when it is saved (so after the kernel that wrote it), and after the previous pass's copies back from the same
      layer's chunk; its GPU memory returns to the allocator once that copy is done (``record_stream``);
    - a layer's copies back run on the host-to-device stream after its copies to the host and after everything queued
      on the current stream when they are started (so the destinations, allocated there from memory the backward
      freed, are no longer in use); the current stream waits for them before the first of the layer's tensors is read.

    :meth:`pack` runs on the thread that runs the forward, :meth:`unpack`, :meth:`fetch` and the trigger's hook on
    autograd's backward thread. A fetched tensor stays on the GPU until autograd frees its graph node.

    Args:
        model: the model whose parameters and buffers stay where they are (never copied; their storages are looked up
            at each :meth:`begin`).
        layers: indices of the offloaded decoder layers (forward order).
        trigger: index of the layer whose backward starts the copies back (every offloaded layer's, highest first);
            ``None`` or an offloaded layer's own backward: each layer's copies start when its backward first reads one.
        min_bytes: tensors below this many bytes stay on the GPU (:data:`MIN_BYTES`; the CPU tests use 0).
        reserve: host bytes to hold per offloaded layer from the start (pinned when CUDA is present; 0: grow on
            demand). A pass that needs more grows its layer's chunks (page-locking memory mid-pass, slow), and the
            next pass starts from one chunk of that size.

    Attributes:
        offloaded: the offloaded layer indices.
        moved: tensors and bytes copied to the host by the last forward pass (``(count, bytes)``).
    """

    def __init__(self, model: torch.nn.Module, layers: list[int], trigger: int | None = None,
                 min_bytes: int = MIN_BYTES, reserve: int = 0):
        self.model = model
        self.offloaded = sorted(set(layers))
        self.trigger = trigger
        self.min_bytes = min_bytes
        self.moved = (0, 0)
        self._chunks = {i: _Chunks(f"offloaded layer {i}") for i in self.offloaded}
        for c in self._chunks.values():
            c.reserve(reserve, pin=torch.cuda.is_available())
        self._saved: dict[int, list[_OffloadedTensor]] = {i: [] for i in self.offloaded}
        self._kept: set[int] = set()
        self._layer: int | None = None
        self._step = 0  # the forward pass (begin() counts them)
        self._first_pack: set[int] = set()  # layers whose copy stream has not yet waited for last pass's read back
        self._copied: dict[int, Any] = {}  # layer -> event after its last copy to the host (CUDA)
        self._ready: dict[int, Any] = {}  # layer -> event after its copies back, until the backward first waits
        self._read_done: dict[int, Any] = {}  # layer -> event after its last copies back (the chunk is free again)
        self._d2h = self._h2d = None

    # -- the pass ----------------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a forward pass: rewind every layer's chunks (a chunk replaced only once its copies are done), note
        where the parameters and buffers live."""
        self._step += 1
        self._kept = {t.untyped_storage().data_ptr() for t in self.model.parameters()}
        self._kept |= {t.untyped_storage().data_ptr() for t in self.model.buffers()}
        for i in self.offloaded:
            if len(self._chunks[i].arenas) > 1:  # rewind() replaces them: let their copies finish first
                for ev in (self._copied.get(i), self._read_done.get(i)):
                    if ev is not None:
                        ev.synchronize()
            self._chunks[i].rewind()
            self._saved[i] = []  # a pass whose backward never ran leaves its tensors to autograd's graph
        self._ready.clear()
        self.moved = (0, 0)

    @contextlib.contextmanager
    def layer(self, index: int) -> Iterator[None]:
        """Run one offloaded layer's forward: its saved tensors go through :meth:`pack` / :meth:`unpack`."""
        self._layer = index
        self._first_pack.add(index)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._layer = None

    @property
    def host_bytes(self) -> int:
        """Bytes of host chunks held (pinned when CUDA is present)."""
        return sum(c.nbytes for c in self._chunks.values())

    # -- the hooks ---------------------------------------------------------------------------------------------
    def _stays(self, t: torch.Tensor) -> bool:
        return (not isinstance(t, torch.Tensor) or t.layout != torch.strided or not t.is_contiguous()
                or t.numel() * t.element_size() < max(self.min_bytes, 1)
                or t.untyped_storage().data_ptr() in self._kept)

    def pack(self, t: torch.Tensor) -> Any:
        """Saved-tensor pack hook: ``t`` itself when it stays (see the module doc), else a :class:`_OffloadedTensor`
        whose copy is on its way to the host (stream order: the class doc)."""
        i = self._layer
        if i is None or self._stays(t):
            return t
        nbytes = t.numel() * t.element_size()
        cuda = t.is_cuda
        host = self._chunks[i].carve(nbytes, pin=cuda).view(t.dtype).view(t.shape)
        with torch.no_grad():
            if cuda:
                if self._d2h is None:
                    self._d2h, self._h2d = torch.cuda.Stream(t.device), torch.cuda.Stream(t.device)
                self._d2h.wait_stream(torch.cuda.current_stream(t.device))  # after the kernel that wrote t
                if i in self._first_pack:  # once per layer and pass: the chunk's last read back is done
                    self._first_pack.discard(i)
                    if i in self._read_done:
                        self._d2h.wait_event(self._read_done[i])
                with torch.cuda.stream(self._d2h):
                    host.copy_(t, non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record(self._d2h)
                self._copied[i] = copied
                t.record_stream(self._d2h)
            else:
                host.copy_(t)
        away = _OffloadedTensor(i, self._step, host, t.shape, t.dtype, t.device)
        self._saved.setdefault(i, []).append(away)
        n, b = self.moved
        self.moved = (n + 1, b + nbytes)
        return away

    def unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the tensor on its device again (its layer's copies back started if not yet, and
        the current stream made to wait for them).

        Raises:
            RuntimeError: ``packed`` belongs to an earlier forward pass (its host bytes were reused since).
        """
        if not isinstance(packed, _OffloadedTensor):
            return packed
        if packed.step != self._step:
            raise RuntimeError(f"an offloaded activation of forward pass {packed.step} was read in pass {self._step}: "
                               "offloaded layers allow one backward per forward pass, before the next forward "
                               "([onecard] offload_layers = 0 for retain_graph or several forwards per backward)")
        if packed.back is None:
            self.fetch(packed.layer)
        ev = self._ready.pop(packed.layer, None)
        if ev is not None:
            torch.cuda.current_stream(packed.device).wait_event(ev)
        return packed.back

    def fetch(self, index: int) -> None:
        """Copy layer ``index``'s saved tensors of this pass back to their device (no-op when already done; stream
        order: the class doc)."""
        todo = [a for a in self._saved.pop(index, ()) if a.back is None]  # from here on only autograd holds them
        if not todo:
            return
        with torch.no_grad():
            for a in todo:
                a.back = torch.empty(a.shape, dtype=a.dtype, device=a.device)
            if todo[0].device.type != "cuda":
                for a in todo:
                    a.back.copy_(a.host)
                return
            cur = torch.cuda.current_stream(todo[0].device)
            self._h2d.wait_stream(cur)  # the destinations' memory is free on the GPU
            self._h2d.wait_event(self._copied[index])  # the host bytes are written
            with torch.cuda.stream(self._h2d):
                for a in todo:
                    a.back.copy_(a.host, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._h2d)
            for a in todo:  # freed unread (a backward that stops early): reused only after the copy
                a.back.record_stream(self._h2d)
            self._ready[index] = ready
            self._read_done[index] = ready  # the next pass's copies to the host wait for this read

    def fetch_all(self) -> None:
        """Start the copies back of every offloaded layer, the last one first (the backward's order)."""
        for i in reversed(self.offloaded):
            self.fetch(i)


class _Caller:
    """What the decoder stack's loop calls instead of an offloaded layer: the layer inside the offload hooks."""

    def __init__(self, layer: torch.nn.Module, index: int, offload: ActivationOffload):
        self.layer, self.index, self.offload = layer, index, offload

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.layer(*args, **kwargs)
        with self.offload.layer(self.index):
            return self.layer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "layer":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.layer, name)


class _Trigger:
    """The layer whose backward starts every offloaded layer's copies back (a gradient hook on its outputs)."""

    def __init__(self, layer: torch.nn.Module, offload: ActivationOffload):
        self.layer, self.offload = layer, offload

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.layer(*args, **kwargs)
        if torch.is_grad_enabled():
            fired = []

            def hook(grad: torch.Tensor) -> None:
                if not fired:
                    fired.append(True)
                    self.offload.fetch_all()

            for o in out if isinstance(out, tuple) else (out,):
                if isinstance(o, torch.Tensor) and o.requires_grad:
                    o.register_hook(hook)
        return out

    def __getattr__(self, name: str) -> Any:
        if name == "layer":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.layer, name)


class _Layers(torch.nn.ModuleList):
    """``model.layers`` whose iteration, inside the decoder stack's call only, yields the offloading callers.

    Indexing, ``len``, ``state_dict``, ``named_modules`` and FSDP go through ``_modules`` and see the layers
    themselves. Another thread that iterates ``model.layers`` while the decoder stack runs would get the callers (not
    modules); nothing in this repository does."""

    _onecard_callers: dict[int, Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        callers = self._onecard_callers
        for i, m in enumerate(super().__iter__()):
            yield callers.get(i, m) if callers is not None else m


def offload_activations(model: torch.nn.Module, layers: int, trigger: int | None = None,
                        min_bytes: int = MIN_BYTES, reserve: int = 0) -> ActivationOffload:
    """Offload the saved tensors of ``model``'s first ``layers`` decoder layers to pinned host memory (diffusers'
    ``Cosmos3OmniTransformer``: ``model.layers``, iterated by ``model._run_decoder_stack``); returns the offloader.

    Call after activation checkpointing is applied (the offloaded layers must not be checkpointed) and before or
    after compiling the layers (the callers sit outside the compiled region). Only the decoder stack's own loop sees
    the callers: ``model.layers`` indexes, lists its modules and saves as before.

    Args:
        layers: how many decoder layers, from the first; 0 installs nothing and returns an offloader with none.
        trigger: the layer whose backward starts the copies back of every offloaded layer (default ``None``: each
            layer's copies start at its own backward, no lead; the trainer passes the last checkpointed layer). All of
            them land on the GPU then: the ledger prices those the freed uncheckpointed layers do not make room for.
        min_bytes, reserve: see :class:`ActivationOffload`.

    Raises:
        TypeError: ``model`` has no ``layers``/``_run_decoder_stack`` (not a Cosmos3 transformer).
        ValueError: ``layers`` or ``trigger`` outside the decoder layers, the model already offloads, an offloaded
            layer is checkpointed (its ``forward`` wrapped), or the decoder stack checkpoints every layer itself
            (diffusers' ``gradient_checkpointing``).
    """
    if not isinstance(getattr(model, "layers", None), torch.nn.ModuleList) or not callable(
            getattr(model, "_run_decoder_stack", None)):
        raise TypeError(f"{type(model).__name__} has no layers/_run_decoder_stack: offload_activations wraps "
                        "diffusers' Cosmos3OmniTransformer")
    n = len(model.layers)
    if not 0 <= layers <= n:
        raise ValueError(f"offloaded layers {layers} must be in [0, {n}] (the model's decoder layers)")
    if trigger is not None and not 0 <= trigger < n:
        raise ValueError(f"trigger layer {trigger} must be in [0, {n - 1}]")
    if getattr(model, _MARK, None) is not None:
        raise ValueError("the model's activations are already offloaded")
    wrapped = [i for i in range(layers) if "forward" in vars(model.layers[i])]
    if wrapped:
        raise ValueError(f"decoder layer {wrapped[0]} is checkpointed (its forward is wrapped): offload the layers "
                         "apply_selective_checkpointing(..., skip=n) leaves out")
    if layers and getattr(model, "gradient_checkpointing", False):
        raise ValueError("the decoder stack checkpoints every layer itself (diffusers' gradient_checkpointing): "
                         "offloaded layers must not be checkpointed")
    off = ActivationOffload(model, list(range(layers)), trigger, min_bytes, reserve)
    if not layers:
        return off
    callers: dict[int, Any] = {i: _Caller(model.layers[i], i, off) for i in range(layers)}
    if trigger is not None and trigger >= layers:
        callers[trigger] = _Trigger(model.layers[trigger], off)
    model.layers.__class__ = _Layers
    inner = model._run_decoder_stack

    @functools.wraps(inner)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            off.begin()
        model.layers._onecard_callers = callers
        try:
            return inner(*args, **kwargs)
        finally:
            model.layers._onecard_callers = None

    model._run_decoder_stack = run
    setattr(model, _MARK, off)
    return off
