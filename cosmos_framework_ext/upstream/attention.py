"""``COSMOS_ATTN_BACKEND=torch``: upstream's attention frontend on PyTorch's own kernels.

cosmos-framework's ``attention()`` (``cosmos_framework.model.attention.frontend``) validates its arguments,
asks ``choose_backend`` for a backend name and calls ``BACKEND_MAP[name]`` with one fixed set of keyword
arguments. Its backends are flash2/flash3 (flash-attn builds), cuDNN (>= 9.20 at 5eee9ed, >= 9.22 at
ed8287f) and NATTEN; where none of them is installed, every call stops with "Could not find a compatible
Attention backend". Every module of the model reaches attention through that frontend, under several
import names (``mot/attention.py``, ``unified_mot.py``, the tokenizer, the HF adapter), so the patch sits
behind the frontend, not at those names: :func:`patched_choose_backend` replaces the frontend's
``choose_backend`` and registers :func:`torch_attention` as the backend ``"torch"`` in ``BACKEND_MAP``
(removed again when the patch is reverted). Upstream's own argument checks, ``seqlens_*`` handling and
default scale stay in force; only the kernel changes.

What the Cosmos3-Edge vision SFT recipe (``joint_attn_implementation="two_way"``) sends, per layer, from
``two_way_attention``: 16 query heads, 8 KV heads, head dim 128, bf16, batch 1 with packed samples:

- the text (understanding) tokens: causal, ``causal_type=DontCare`` (query and key offsets are the same
  tensor), ``cumulative_seqlen_Q == cumulative_seqlen_KV``;
- the vision (generation) queries against all of their sample's tokens: not causal, query offsets
  (vision tokens per sample) differ from key offsets (all tokens per sample);
- in inference with one sample, the same two calls without offsets (the dense API).

Kernels, chosen per call from static facts (no device sync on the main path):

- ``varlen``: :func:`torch.nn.attention.varlen.varlen_attn` (torch >= 2.10) on CUDA for bf16/fp16 with
  equal Q/K/V head dims <= 256 and a multiple of 8. Causal uses ``window_size=(-1, 0)``: bottom-right,
  which is what ``DontCare``/``BottomRight`` mean; ``TopLeft`` uses it only when the query and key offsets
  are equal (one comparison on the device), where the two alignments coincide. Grouped KV heads go to the
  kernel as they are. Rows outside the offsets (trailing padding) are zero in the output, and the
  gradients of such rows are zero too: they are masked on the way in, so whatever the kernel leaves in
  the rows it does not visit cannot reach a weight gradient.
- ``sdpa``: one :func:`torch.nn.functional.scaled_dot_product_attention` per packed sequence, KV heads
  repeated to the query heads (``repeat_interleave``: query head ``h`` reads KV head ``h // (H/H_kv)``, as
  flash does). Used on the CPU, for fp32, and where ``varlen`` does not apply.
- ``math``: per sequence, explicit scores in fp32, ``logsumexp`` and softmax. Used when the caller asks
  for the log-sum-exp while gradients are wanted (``varlen_attn``'s backward ignores a gradient arriving
  through its LSE, so that case must not use it) and for ``deterministic=True``. It holds a sequence's
  full score matrix, so it is meant for short sequences (the recipe never takes it).

The log-sum-exp, when asked for, is returned as upstream's backends return it: float32, shape
``[batch, seqlen_q, heads]``, natural log of the sum of ``exp(scale * q.k)``; ``-inf`` for a row that sees
no key (its output row is zero).

Arguments the torch backend does not take (``backend_kwargs``) are refused with one ``ValueError`` naming
the argument. An explicit ``backend=`` other than ``"torch"`` is left to upstream's own choice.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F

log = logging.getLogger("onecard.upstream_attention")

NAME = "torch"
"""The backend name registered in the frontend's ``BACKEND_MAP``."""
FRONTEND = "cosmos_framework.model.attention.frontend"
BACKEND_PARAMS = ("query", "key", "value", "is_causal", "causal_type", "scale", "cumulative_seqlen_Q",
                  "cumulative_seqlen_KV", "max_seqlen_Q", "max_seqlen_KV", "return_lse", "backend_kwargs",
                  "deterministic")
"""The keyword arguments the frontend passes to every ``BACKEND_MAP`` entry (both supported commits)."""

_CAUSAL_KINDS = ("TopLeft", "BottomRight", "DontCare")
_VARLEN_DTYPES = (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------- kernels
def _load_varlen() -> tuple[Callable[..., Any], Any, bool] | None:
    """``(varlen_attn, AuxRequest, takes enable_gqa)``, or None where this torch has no varlen_attn."""
    try:
        from torch.nn.attention.varlen import AuxRequest, varlen_attn
    except ImportError:
        return None
    return varlen_attn, AuxRequest, "enable_gqa" in inspect.signature(varlen_attn).parameters


VARLEN = _load_varlen()
"""torch's varlen_attn (torch >= 2.10), looked up once at import (not inside traced code)."""


def _causal_kind(is_causal: bool, causal_type: Any) -> str | None:
    """``None`` (not causal), ``"TopLeft"``, ``"BottomRight"`` or ``"DontCare"`` (upstream's ``CausalType``
    names; matched by name so that this module needs no upstream import)."""
    if not is_causal:
        return None
    name = getattr(causal_type, "name", None)
    if name not in _CAUSAL_KINDS:
        raise ValueError(f"causal_type={causal_type!r}: with is_causal=True the torch attention backend needs "
                         f"an upstream CausalType ({', '.join(_CAUSAL_KINDS)})")
    return name


def _offset(kind: str | None, q_len: int, k_len: int) -> int | None:
    """Query row ``i`` of a sequence sees key ``j`` iff ``j <= i + offset`` (None: every key).

    ``TopLeft`` aligns the mask's diagonal at the first rows (offset 0); ``BottomRight`` at the last rows
    (offset ``k_len - q_len``). ``DontCare`` is only valid for equal lengths, where both agree; it is taken
    as bottom-right, as flash (and so the ``varlen`` kernel) does.
    """
    if kind is None:
        return None
    return 0 if kind == "TopLeft" else k_len - q_len


def _sdpa_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int | None, scale: float) -> torch.Tensor:
    """One sequence: q [L,H,D], k/v [S,H,D*] (KV heads already repeated) -> [L,H,Dv]."""
    q_len, k_len = q.shape[0], k.shape[0]
    if q_len == 0 or k_len == 0:
        return q.new_zeros((q_len, q.shape[1], v.shape[-1]))
    if offset is not None and offset < 0:
        # The first -offset rows see no key (zero); the rest are top-left causal against all keys.
        blind = min(-offset, q_len)
        head = q.new_zeros((blind, q.shape[1], v.shape[-1]))
        return torch.cat([head, _sdpa_one(q[blind:], k, v, 0, scale)]) if blind < q_len else head
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1,H,L,D]
    if offset is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale)
    elif offset == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)  # SDPA's causal is top-left
    else:
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(offset)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.squeeze(0).transpose(0, 1)


def _math_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int | None,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, explicit fp32 softmax: (out [L,H,Dv] in q's dtype, lse [L,H] fp32).

    Masked scores are set to the lowest finite float and their probabilities multiplied by zero, so a row
    that sees no key gives output 0, LSE -inf, and finite gradients.
    """
    scores = torch.einsum("lhd,shd->hls", q.float(), k.float()) * scale  # [H,L,S]
    if offset is None:
        lse = torch.logsumexp(scores, dim=-1)  # [H,L]
        probs = torch.exp(scores - lse[..., None])
    else:
        rows = torch.arange(q.shape[0], device=q.device)[:, None]
        seen = torch.arange(k.shape[0], device=q.device)[None, :] <= rows + offset  # [L,S]
        scores = scores.masked_fill(~seen, torch.finfo(torch.float32).min)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[..., None]) * seen
        lse = torch.where(seen.any(-1), lse, torch.full((), float("-inf"), device=q.device))
    out = torch.einsum("hls,shd->lhd", probs, v.float())
    return out.to(q.dtype), lse.transpose(0, 1)


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """``(q_start, q_end, k_start, k_end)`` per packed sequence (reads the offsets on the host)."""
    q, k = cu_q.tolist(), cu_k.tolist()
    return [(q[i], q[i + 1], k[i], k[i + 1]) for i in range(len(q) - 1)]


def _per_sequence(query, key, value, kind, scale, cu_q, cu_k, with_lse: bool):
    """The ``sdpa`` (``with_lse=False``) or ``math`` kernel over packed or dense sequences.

    Returns (out [B,S_q,H,Dv], lse [B,S_q,H] or None). Rows outside the offsets are zero (lse -inf).
    """
    batch, total_q, heads, _ = query.shape
    rep = heads // key.shape[2]
    if cu_q is None:  # dense: each batch element is one sequence
        seqs = [(b, 0, total_q, 0, key.shape[1]) for b in range(batch)]
    else:
        seqs = [(0, *s) for s in _segments(cu_q, cu_k)]
    outs: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    lses: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    ends = [0] * batch
    for b, qs, qe, ks, ke in seqs:
        q = query[b, qs:qe]
        k = key[b, ks:ke].repeat_interleave(rep, dim=1) if rep > 1 else key[b, ks:ke]
        v = value[b, ks:ke].repeat_interleave(rep, dim=1) if rep > 1 else value[b, ks:ke]
        if qs > ends[b]:  # a gap before this sequence
            outs[b].append(query.new_zeros((qs - ends[b], heads, value.shape[-1])))
            lses[b].append(query.new_full((qs - ends[b], heads), float("-inf"), dtype=torch.float32))
        off = _offset(kind, qe - qs, ke - ks)
        if with_lse:
            o, lse = _math_one(q, k, v, off, scale)
            lses[b].append(lse)
        else:
            o = _sdpa_one(q, k, v, off, scale)
        outs[b].append(o)
        ends[b] = qe
    for b in range(batch):
        if ends[b] < total_q:  # trailing padding
            outs[b].append(query.new_zeros((total_q - ends[b], heads, value.shape[-1])))
            lses[b].append(query.new_full((total_q - ends[b], heads), float("-inf"), dtype=torch.float32))
    out = torch.stack([torch.cat(o) for o in outs])
    lse = torch.stack([torch.cat(x) for x in lses]) if with_lse else None
    return out, lse


def _varlen_eligible(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    d = query.shape[-1]
    return (VARLEN is not None and query.is_cuda and query.dtype in _VARLEN_DTYPES
            and key.shape[-1] == d == value.shape[-1] and d <= 256 and d % 8 == 0)


def _run_varlen(query, key, value, kind, scale, cu_q, cu_k, max_q, max_k, return_lse):
    """The ``varlen`` kernel: (out [B,S_q,H,Dv], lse [B,S_q,H] or None)."""
    varlen_attn, aux_request, takes_gqa = VARLEN
    batch, total_q, heads, _ = query.shape
    total_k = key.shape[1]
    if cu_q is None:  # dense: B sequences of equal length, flattened
        cu_q = torch.arange(0, (batch + 1) * total_q, total_q, dtype=torch.int32, device=query.device)
        cu_k = torch.arange(0, (batch + 1) * total_k, total_k, dtype=torch.int32, device=query.device)
        max_q, max_k = total_q, total_k
        rows_q = rows_k = None
    else:
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        rows_q = torch.arange(total_q, device=query.device) < cu_q[-1]
        rows_k = torch.arange(total_k, device=query.device) < cu_k[-1]

    def flat(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        t = t.reshape(-1, *t.shape[2:])
        if rows is not None and t.requires_grad:  # the gradient of a row the kernel skips is zero
            t = torch.where(rows[:, None, None], t, torch.zeros((), dtype=t.dtype, device=t.device))
        return t.contiguous()

    kwargs: dict[str, Any] = {"scale": scale, "window_size": (-1, 0) if kind is not None else (-1, -1)}
    if takes_gqa and key.shape[2] != heads:
        kwargs["enable_gqa"] = True
    if return_lse:
        kwargs["return_aux"] = aux_request(lse=True)
    res = varlen_attn(flat(query, rows_q), flat(key, rows_k), flat(value, rows_k), cu_q, cu_k, max_q, max_k, **kwargs)
    out, lse = res if return_lse else (res, None)
    if rows_q is not None:
        out = torch.where(rows_q[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    out = out.reshape(batch, total_q, heads, value.shape[-1])
    if lse is not None:
        if tuple(lse.shape) == (heads, batch * total_q):  # flash's layout, [H, total_q]
            lse = lse.transpose(0, 1)
        lse = lse.float()
        if rows_q is not None:
            lse = torch.where(rows_q[:, None], lse, torch.full((), float("-inf"), device=lse.device))
        lse = lse.reshape(batch, total_q, heads)
    return out, lse


def kernel_for(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool = False,
               causal_type: Any = None, cumulative_seqlen_Q: torch.Tensor | None = None,
               cumulative_seqlen_KV: torch.Tensor | None = None, return_lse: bool = False,
               deterministic: bool = False) -> str:
    """Which kernel :func:`torch_attention` runs for these arguments: ``varlen``, ``sdpa`` or ``math``."""
    kind = _causal_kind(is_causal, causal_type)
    wants_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if deterministic or (return_lse and wants_grad):
        return "math"
    if not _varlen_eligible(query, key, value):
        return "sdpa"
    if kind == "TopLeft":
        if cumulative_seqlen_Q is None:
            return "varlen" if query.shape[1] == key.shape[1] else "sdpa"
        same = cumulative_seqlen_Q is cumulative_seqlen_KV or torch.equal(cumulative_seqlen_Q, cumulative_seqlen_KV)
        return "varlen" if same else "sdpa"
    return "varlen"


# ---------------------------------------------------------------------------------------------- backend
def torch_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool = False,
    causal_type: Any = None,
    scale: float | None = None,
    cumulative_seqlen_Q: torch.Tensor | None = None,
    cumulative_seqlen_KV: torch.Tensor | None = None,
    max_seqlen_Q: int | None = None,
    max_seqlen_KV: int | None = None,
    return_lse: bool = False,
    backend_kwargs: dict | None = None,
    deterministic: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention on PyTorch kernels, with upstream's backend calling convention.

    Args:
        query: ``[B, S_q, H, D]`` (heads-last); ``B == 1`` with offsets (sequence-packed).
        key, value: ``[B, S_kv, H_kv, D]`` / ``[B, S_kv, H_kv, D_v]``; ``H`` a multiple of ``H_kv``.
        is_causal, causal_type: causal masking and its alignment (an upstream ``CausalType``).
        scale: dot-product scale (default ``D ** -0.5``).
        cumulative_seqlen_Q, cumulative_seqlen_KV: ``[N+1]`` offsets of the packed sequences, or None.
        max_seqlen_Q, max_seqlen_KV: the longest sequences (ints).
        return_lse: also return the log-sum-exp, ``[B, S_q, H]`` float32.
        backend_kwargs: must be empty (the torch backend has no extra options).
        deterministic: use the ``math`` kernel (no atomics in its backward).

    Returns:
        ``[B, S_q, H, D_v]`` in the query's dtype, and the LSE when ``return_lse``.

    Raises:
        ValueError: an argument this backend does not take, or inconsistent shapes, named.
    """
    if backend_kwargs:
        raise ValueError(f"backend_kwargs={backend_kwargs!r}: the torch attention backend (COSMOS_ATTN_BACKEND=torch) "
                         "takes no backend-specific options; leave backend_kwargs unset")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"query/key/value must be 4-D [batch, seqlen, heads, head_dim], got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    heads, kv_heads = query.shape[2], key.shape[2]
    if value.shape[2] != kv_heads or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"key/value heads ({kv_heads}, {value.shape[2]}) must be equal and divide the query heads "
                         f"({heads})")
    kind = _causal_kind(is_causal, causal_type)
    varlen = cumulative_seqlen_Q is not None
    if varlen != (cumulative_seqlen_KV is not None):
        raise ValueError("cumulative_seqlen_Q and cumulative_seqlen_KV must be given together")
    if varlen and query.shape[0] != 1:
        raise ValueError(f"packed (varlen) attention takes batch 1, got query batch {query.shape[0]}")
    scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
    if varlen and max_seqlen_Q == 0 and max_seqlen_KV == 0:  # upstream's empty-batch case: nothing to attend
        out = query.new_zeros((*query.shape[:3], value.shape[-1]))
        lse = torch.full(query.shape[:3], float("-inf"), device=query.device)
        return (out, lse) if return_lse else out

    kernel = kernel_for(query, key, value, is_causal=is_causal, causal_type=causal_type,
                        cumulative_seqlen_Q=cumulative_seqlen_Q, cumulative_seqlen_KV=cumulative_seqlen_KV,
                        return_lse=return_lse, deterministic=deterministic)
    if kernel == "varlen":
        out, lse = _run_varlen(query, key, value, kind, scale, cumulative_seqlen_Q, cumulative_seqlen_KV,
                               max_seqlen_Q, max_seqlen_KV, return_lse)
    else:
        out, lse = _per_sequence(query, key, value, kind, scale, cumulative_seqlen_Q, cumulative_seqlen_KV,
                                 with_lse=kernel == "math" or return_lse)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------- the patch
def patched_choose_backend(original: Callable[..., Any]) -> Callable[..., Any]:
    """Factory for ``frontend.choose_backend``: picks ``"torch"`` and registers :func:`torch_attention`.

    The frontend's ``BACKEND_MAP`` gains ``"torch"`` while the patch is applied (``onecard_undo`` takes it
    out again on revert). A caller that names another backend explicitly gets upstream's own choice.

    Raises:
        patches.core.errors.UpstreamMismatch: the frontend has no ``BACKEND_MAP``, or its backends take other arguments.
    """
    from patches.core.errors import UpstreamMismatch

    frontend = importlib.import_module(FRONTEND)
    backend_map = getattr(frontend, "BACKEND_MAP", None)
    if not isinstance(backend_map, dict):
        raise UpstreamMismatch(f"{FRONTEND}.BACKEND_MAP is missing or not a dict: the attention patch cannot "
                               "register its backend; unset COSMOS_ATTN_BACKEND")
    for name, fn in backend_map.items():
        if name == NAME:
            continue
        found = tuple(inspect.signature(fn).parameters)
        if found != BACKEND_PARAMS:
            raise UpstreamMismatch(f"{FRONTEND}.BACKEND_MAP[{name!r}] takes {found}, expected {BACKEND_PARAMS}: "
                                   "the frontend calls its backends differently; unset COSMOS_ATTN_BACKEND")
    had = backend_map.get(NAME)
    backend_map[NAME] = torch_attention

    def choose_backend(query_shape, key_shape, value_shape, dtype, device, requires_grad, is_causal,
                       causal_type, is_varlen, deterministic=False, backend=None, raise_error=True):
        if backend is None or backend == NAME:
            return NAME
        return original(query_shape, key_shape, value_shape, dtype, device, requires_grad, is_causal,
                        causal_type, is_varlen, deterministic=deterministic, backend=backend,
                        raise_error=raise_error)

    def undo() -> None:
        if had is None:
            backend_map.pop(NAME, None)
        else:
            backend_map[NAME] = had

    choose_backend.onecard_undo = undo  # type: ignore[attr-defined]
    log.info("onecard: attention backend -> torch (%s)",
             "varlen_attn for CUDA bf16/fp16, SDPA otherwise" if VARLEN else "SDPA; this torch has no varlen_attn")
    return choose_backend
