"""The frozen text stream's keys and values from a per-caption cache (``[onecard] text_kv_cache = true``).

``Cosmos3OmniTransformer`` runs two token streams through each decoder layer. The vision (generation) stream reads
the text (understanding) stream in one place only: its attention's keys and values, ``k_und`` (``norm_k(to_k(x))``,
before the trainable ``k_norm_und_for_gen`` and the rotary embedding) and ``v_und`` (``to_v(x)``), ``x`` being the
layer's ``input_layernorm`` of the text stream. A text token attends causally to its own sample's text only, and each
sample's text positions start at 0 (:func:`cosmos_framework_ext.recipe.attention.build_packed_inputs`), so with every
text-stream weight frozen these keys and values are a function of the sample's token ids alone: the same at every
access of the same caption.

This lever computes them once per distinct token-id list (a **pre-pass**, :meth:`TextKVCache.fill`: the model's own
forward over packed micro-batches of captions, each with a one-token stand-in latent, the values read by forward
hooks on ``norm_k`` and ``to_v``), keeps them in host memory (compute dtype, ``[layers, 2, tokens, kv_heads *
head_dim]``) and, per micro-batch, gathers its samples' rows into one pinned tensor (:meth:`TextKVCache.gather`; on a
loader thread with the latent cache, where the trainer builds every host input there, else on the main thread) that
reaches the GPU on a stream of its own (:meth:`TextKVCache.upload`), overlapping the previous micro-batch's work.
The decoder stack then runs the vision stream alone (:func:`use_text_kv_cache`): each layer gets an empty text
stream and its cached keys and values through the rotary tuple, ``(cos_und, sin_und, cos_gen, sin_gen, k_und,
v_und)``; the packed processor applies
``k_norm_und_for_gen`` and the rotary embedding to them as before and runs the vision attention over ``[text |
vision]`` keys as before. The layers' signatures are unchanged, so the compile and checkpoint wrappers are too.

What it saves: per layer, the text stream's forward (its six matmuls, its causal attention, its norms) and, with
the checkpoint, its recompute. What it costs: the pre-pass (once per run), the host cache (``bytes``; 112 KiB per
text token for the edge preset, 28 layers x 2 x 1024 bf16 values) and one host-to-device copy per micro-batch of
its text tokens' rows.

Not bitwise: the cached values come from another packing of the captions than the training micro-batch's (other
matmul row counts, other attention calls), so they differ from the ones the layer would compute by the compute
dtype's rounding. The proof (``tests/equivalence/test_text_kv_cache.py``: CPU, fp32) states the tolerance: the
cached keys and values equal the training forward's own within 1e-6 of their largest value, the loss and every
trainable gradient within 1e-5, for dense, block-sparse and variable-length attention, eager and compiled, each
checkpointing mode; it is anchored to diffusers' own forward. Planted: rows gathered in another sample order, each
layer handed the previous layer's keys and values, cached keys that skip ``k_norm_und_for_gen``. Only this fp32
bound is proven; in bf16 on a GPU the losses of a benchmark run agree to the 4th decimal (no bound stated). The
presets' ``norm_k`` is an identity (``qk_norm_for_text = false``); the proof also trains a tiny model whose ``norm_k``
is an RMSNorm, which tells the hook point after it from ``to_k``.

Exact only while the text stream is frozen: :func:`check_text_kv_cache` refuses a ``keys_to_select`` that trains a
text-stream weight (any layer part not in ``VISION_STREAM_PARTS``), the final text ``norm`` or ``embed_tokens`` (their gradients come through the text stream, which
no longer runs), and the wrapper re-checks at each call. The text stream's output (``norm(und_seq)``) is not
computed: the stack returns the text rows as they entered, which the vision loss does not read
(``vision_mse_loss_indexes`` index vision rows only).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from patches.core.units import gib_or_mib

__all__ = ["VISION_STREAM_PARTS", "TextKVCache", "check_text_kv_cache", "text_stream_params", "use_text_kv_cache"]

log = logging.getLogger("onecard.text_kv_cache")

VISION_STREAM_PARTS = ("input_layernorm_moe_gen", "post_attention_layernorm_moe_gen", "mlp_moe_gen",
                       "self_attn.add_q_proj", "self_attn.add_k_proj", "self_attn.add_v_proj", "self_attn.to_add_out",
                       "self_attn.norm_added_q", "self_attn.norm_added_k", "self_attn.k_norm_und_for_gen")
"""The parts of a decoder layer (``layers.<i>.<part>``) the vision stream runs with the cache on; every other part
of a layer is the text stream's (an allowlist: a part a later diffusers adds counts as text until listed here).
``self_attn.k_norm_und_for_gen`` is one: the vision stream applies it to the cached keys."""

_MARK = "_onecard_text_kv_cache"
_PREPASS_BATCH_TOKENS = 4096
"""Text tokens per pre-pass forward (several captions packed, each with its own causal mask)."""


def text_stream_params(names: Iterable[str]) -> list[str]:
    """The names among ``names`` that the text stream reads: ``embed_tokens.*``, ``norm.*`` (the text stream's final
    norm) and ``layers.<i>.<part>.*`` for a part not in :data:`VISION_STREAM_PARTS`."""
    out = []
    for n in names:
        head = n.split(".")
        if head[0] in ("embed_tokens", "norm"):
            out.append(n)
        elif head[0] == "layers" and len(head) > 2:
            rest = ".".join(head[2:])
            if not any(rest.startswith(p + ".") for p in VISION_STREAM_PARTS):
                out.append(n)
    return out


def check_text_kv_cache(on: bool, trainable: list[str]) -> None:
    """Refuse ``text_kv_cache`` where it would drop a gradient.

    Args:
        on: ``[onecard] text_kv_cache``.
        trainable: the trainable parameter names (``keys_to_select``'s match).

    Raises:
        ValueError: a trainable parameter lies in the text stream; the message names it and the fix.
    """
    if not on:
        return
    trains = text_stream_params(trainable)
    if trains:
        raise ValueError(f"[onecard] text_kv_cache reads the text stream's keys and values from a cache computed once, "
                         f"but {trains[0]} trains ([optimizer] keys_to_select matches it) and the text stream then "
                         "changes at every step: drop it from keys_to_select or set text_kv_cache = false")


class TextKVCache:
    """Per distinct token-id list: every decoder layer's ``k_und`` and ``v_und`` in host memory.

    Args:
        layers: decoder layers of the model.
        kv_dim: ``num_key_value_heads * head_dim``.
        dtype: the compute dtype the layers produce them in (the cache stores that dtype).
        pin: put each gathered micro-batch in pinned memory (a GPU run).

    Attributes:
        current: the K/V of the micro-batch being trained, ``[layers, 2, und_len, kv_dim]`` on the model's device
            (set by the trainer before the forward, ``None`` after the backward); ``None``: the stock text stream.
    """

    def __init__(self, layers: int, kv_dim: int, dtype: torch.dtype, pin: bool = False):
        self.layers, self.kv_dim, self.dtype, self.pin = layers, kv_dim, dtype, pin
        self.rows: dict[tuple[int, ...], tuple[int, int]] = {}
        """token ids -> (first row, row count) in :attr:`store`."""
        self.store = torch.empty(layers, 2, 0, kv_dim, dtype=dtype)
        self.current: torch.Tensor | None = None
        self.seconds = 0.0
        """Seconds the pre-pass took (every :meth:`fill`)."""
        self.micro_batches = 0
        """Forwards whose decoder stack ran from the cache (:func:`use_text_kv_cache`)."""
        self._stream: Any = None
        """The CUDA stream :meth:`upload` copies on (made at its first GPU call)."""
        self._copied: tuple[torch.device, Any] | None = None
        """The device and CUDA event after the last :meth:`upload`'s copy, until :meth:`ready` has the compute stream
        wait."""
        self.prepass_peak_bytes: int | None = None
        """The GPU's allocated peak during the last pre-pass that computed something, bytes (:meth:`fill` on a GPU
        model; ``None`` on the CPU)."""

    @property
    def bytes(self) -> int:
        """Host bytes of the cache."""
        return self.store.numel() * self.store.element_size()

    def __contains__(self, ids: Sequence[int]) -> bool:
        return tuple(ids) in self.rows

    def line(self) -> str:
        """One line for the log: captions, tokens, GiB on the host, pre-pass seconds (and its GPU peak, where
        measured)."""
        peak = f", GPU peak {gib_or_mib(self.prepass_peak_bytes)}" if self.prepass_peak_bytes is not None else ""
        return (f"text K/V cache: {len(self.rows)} captions, {self.store.shape[2]} tokens, "
                f"{gib_or_mib(self.bytes)} on the host, "
                f"pre-pass {self.seconds:.1f} s{peak}")

    def fill(self, model: torch.nn.Module, proc: Any, texts: Iterable[Sequence[int]],
             forward_inputs: Callable[[list[list[int]]], tuple[dict[str, Any], Any]],
             progress: bool = False) -> int:
        """Compute the keys and values of every text in ``texts`` not cached yet (the pre-pass); returns how many.

        The model's own forward runs (no grad, eager: ``torch.compiler.set_stance("force_eager")``) over packed
        micro-batches of up to :data:`_PREPASS_BATCH_TOKENS` text tokens, built by ``forward_inputs`` (a list of
        token-id lists -> forward kwargs and the processor's segments: the trainer binds
        :func:`cosmos_framework_ext.recipe.attention.prepass_inputs` to the run's settings);
        forward hooks on each layer's ``self_attn.norm_k`` and ``self_attn.to_v`` read the text rows. On a GPU model
        its allocated peak is :attr:`prepass_peak_bytes` (the device's peak statistics are reset first).

        Raises:
            RuntimeError: :attr:`current` is set (the pre-pass must see the stock text stream).
        """
        if self.current is not None:
            raise RuntimeError("TextKVCache.fill with a micro-batch's K/V installed: the pre-pass needs the text stream")
        todo, seen = [], set(self.rows)
        for ids in texts:
            key = tuple(int(t) for t in ids)
            if key not in seen:
                seen.add(key)
                todo.append(key)
        if not todo:
            return 0
        t0 = time.perf_counter()
        batches, batch, n = [], [], 0
        for key in todo:
            if batch and n + len(key) > _PREPASS_BATCH_TOKENS:
                batches.append(batch)
                batch, n = [], 0
            batch.append(key)
            n += len(key)
        batches.append(batch)
        layers = list(model.layers)
        got: list[list[torch.Tensor]] = [[None, None] for _ in layers]  # type: ignore[list-item]

        def keep(i: int, j: int) -> Callable:
            def hook(_module, _inputs, out):
                got[i][j] = out.detach().reshape(out.shape[0], -1)
            return hook

        handles = [m.register_forward_hook(keep(i, j)) for i, layer in enumerate(layers)
                   for j, m in enumerate((layer.self_attn.norm_k, layer.self_attn.to_v))]
        start = self.store.shape[2]
        store = torch.empty(self.layers, 2, start + sum(len(k) for k in todo), self.kv_dim, dtype=self.dtype)
        store[:, :, :start] = self.store  # the rows it had; then each batch's rows written in place (no second copy)
        rows: dict[tuple[int, ...], tuple[int, int]] = {}
        device = next(model.parameters()).device
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        bar = _progress(len(todo), progress)
        try:
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                for batch in batches:
                    kwargs, segments = forward_inputs([list(k) for k in batch])
                    und_len = kwargs["und_len"]
                    old, proc.segments = proc.segments, segments
                    try:
                        model(**kwargs)
                    finally:
                        proc.segments = old
                    kv = torch.stack([torch.stack([k[:und_len], v[:und_len]]) for k, v in got])  # [L, 2, und, kv]
                    store[:, :, start:start + und_len] = kv.to("cpu", self.dtype)
                    for key in batch:
                        rows[key] = (start, len(key))
                        start += len(key)
                    bar(len(batch))
        finally:
            for h in handles:
                h.remove()
            bar(0, close=True)
        self.store = store  # both at once: an error above leaves the cache as it was
        self.rows.update(rows)
        if cuda:
            self.prepass_peak_bytes = torch.cuda.max_memory_allocated(device)
        self.seconds += time.perf_counter() - t0
        return len(todo)

    def gather(self, texts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The rows of ``texts`` (one micro-batch's, in order) as one ``[layers, 2, sum(len), kv_dim]`` host tensor
        (pinned when :attr:`pin`); touches no GPU tensor, so a loader thread may call it.

        Raises:
            RuntimeError: a text the pre-pass did not see.
        """
        index = []
        for ids in texts:
            key = tuple(int(t) for t in ids)
            if key not in self.rows:
                raise RuntimeError(f"text K/V cache: a text of {len(key)} tokens was not in the pre-pass (the pre-pass "
                               "must see every text the loader can yield)")
            first, n = self.rows[key]
            index.append(torch.arange(first, first + n))
        idx = torch.cat(index) if index else torch.empty(0, dtype=torch.long)
        out = torch.empty(self.layers, 2, idx.numel(), self.kv_dim, dtype=self.dtype, pin_memory=self.pin)
        torch.index_select(self.store, 2, idx, out=out)
        return out

    def upload(self, kv: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        """``kv`` (a :meth:`gather` result) on ``device``, to be installed as :attr:`current`; the reader calls
        :meth:`ready` before its first use.

        On a GPU the copy runs on the cache's own stream, which waits for nothing: it overlaps the compute stream's
        queued work (the previous micro-batch's backward while the host runs ahead, and the forward's work before the
        decoder stack) instead of queuing behind it on the compute stream (about 225 MB, estimated, for a near-cap
        micro-batch of the sample dataset). The device tensor comes from the copy stream's pool, so no block a queued
        compute kernel still reads is written; it is marked as used by the compute stream (``record_stream``), so once
        freed its block is reused only after the compute stream's work queued before the free has run. The host
        tensor is pinned (:meth:`gather` on a GPU run) or pinned here. Elsewhere ``kv.to(device)``.
        """
        device = torch.device(device)
        if device.type != "cuda":
            return kv.to(device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        compute = torch.cuda.current_stream(device)
        with torch.cuda.stream(self._stream):
            out = torch.empty(kv.shape, dtype=kv.dtype, device=device)
            out.copy_(kv if kv.is_pinned() else kv.pin_memory(), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        self._copied = (device, copied)
        out.record_stream(compute)
        return out

    def ready(self) -> None:
        """Have the current (compute) stream wait for the last :meth:`upload`'s copy, once; nothing elsewhere or when
        there is none pending. :func:`use_text_kv_cache` calls it before the decoder layers read :attr:`current`."""
        if self._copied is not None:
            device, copied = self._copied
            torch.cuda.current_stream(device).wait_event(copied)
            self._copied = None


def _progress(total: int, on: bool) -> Callable[..., None]:
    """A tqdm bar over ``total`` captions (``on``), else a no-op; ``bar(n)`` advances, ``bar(0, close=True)`` ends."""
    if not on:
        return lambda n, close=False: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="text K/V cache pre-pass", unit="caption", dynamic_ncols=True)

    def step(n: int, close: bool = False) -> None:
        bar.update(n)
        if close:
            bar.close()

    return step


def use_text_kv_cache(model: torch.nn.Module, cache: TextKVCache) -> None:
    """Wrap ``model._run_decoder_stack`` so that, while ``cache.current`` holds a micro-batch's K/V, the decoder
    layers run the vision stream alone; idempotent.

    Each layer ``i`` is called as before (through diffusers' gradient-checkpointing function when it is on), with an
    empty text stream ``und_seq[:0]`` and ``rotary_emb + (k_i, v_i)``, ``k_i`` ``[und_len, kv_heads, head_dim]`` and
    ``v_i`` the same, views of ``cache.current[i]``. The packed processor recognises the six-tuple
    (:class:`~cosmos_framework_ext.recipe.attention.PackedAttnProcessor`). Returns ``(und_seq, norm_moe_gen(gen))``:
    the text rows as they entered (not read by the vision loss). With ``cache.current`` ``None`` the stock stack runs.

    Raises:
        TypeError: ``model`` is not a Cosmos3 transformer (no ``_run_decoder_stack``/``layers``).
        RuntimeError: at a call, a text-stream parameter requires a gradient (:func:`check_text_kv_cache`'s rule),
            or ``cache.current`` does not match the text stream's length or the layer count.
    """
    if getattr(model, _MARK, False):
        return
    if not callable(getattr(model, "_run_decoder_stack", None)) or not hasattr(model, "layers"):
        raise TypeError(f"{type(model).__name__} has no _run_decoder_stack/layers: text_kv_cache wraps diffusers' "
                        "Cosmos3OmniTransformer")
    inner = model._run_decoder_stack

    @functools.wraps(inner)
    def run(und_seq: torch.Tensor, gen_seq: torch.Tensor, rotary_emb: Any) -> Any:
        kv = cache.current
        if kv is None:
            return inner(und_seq, gen_seq, rotary_emb)
        trains = text_stream_params(n for n, p in model.named_parameters() if p.requires_grad)
        if trains:
            raise RuntimeError(f"text_kv_cache: {trains[0]} requires a gradient, but its text stream is read from the "
                               "cache: freeze it or turn the cache off")
        layers = model.layers
        if kv.shape[0] != len(layers) or kv.shape[1] != 2 or kv.shape[2] != und_seq.shape[0]:
            raise RuntimeError(f"text_kv_cache: K/V of shape {tuple(kv.shape)} for {len(layers)} layers and "
                               f"{und_seq.shape[0]} text tokens")
        empty = und_seq[:0]
        cache.ready()  # the copy of these keys and values has ended before the first layer reads them
        cache.micro_batches += 1
        checkpointed = torch.is_grad_enabled() and model.gradient_checkpointing
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            k = kv[i, 0].view(-1, attn.num_key_value_heads, attn.head_dim)
            v = kv[i, 1].view(-1, attn.num_key_value_heads, attn.head_dim)
            rot = (*rotary_emb[:4], k, v)
            if checkpointed:
                _, gen_seq = model._gradient_checkpointing_func(layer.__call__, empty, gen_seq, rot)
            else:
                _, gen_seq = layer(empty, gen_seq, rot)
        return und_seq, model.norm_moe_gen(gen_seq)

    model._run_decoder_stack = run
    setattr(model, _MARK, True)
