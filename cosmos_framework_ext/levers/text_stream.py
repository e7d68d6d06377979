"""The frozen text stream without a backward pass (``[onecard] detach_text_stream = true``).

``Cosmos3OmniTransformer`` runs two token streams through its decoder layers: the understanding (text) stream and
the generation (vision) stream. The vision SFT recipe trains the generation pathway only (``keys_to_select``:
``moe_gen``, ``time_embedder``, ``vae2llm``, ``llm2vae``, ``k_norm_und_for_gen``); every weight the text stream
passes through is frozen, and so is the text-token embedding it starts from. The text stream still enters the layers
requiring gradients: diffusers' forward writes the text embeddings and the trainable ``proj_in`` output into one
buffer (``hidden_states[vision_sequence_indexes] = ...``) and slices the text stream out of it
(``und_seq = hidden_states[:und_len]``), so autograd marks the slice as needing a gradient. The backward pass then
runs the text stream's whole backward (the input gradients of its six linear layers and its causal attention, per
layer) and the activation checkpoint recomputes its forward, for gradients that end in rows of the buffer no
parameter reads: the text rows of ``hidden_states`` come from ``embed_tokens`` (frozen) alone.

This lever hands the decoder stack the text stream detached (``_run_decoder_stack`` is wrapped on the model
instance). Nothing trainable lies upstream of it, so every parameter's gradient is the same: the gradients that
reach a trainable parameter never pass through the cut (the text stream's keys reach ``k_norm_und_for_gen`` and the
vision stream's attention as values, and their gradients are computed there as before). What changes is the work:
no backward through the text stream (its six input-gradient matmuls per layer), and, in a checkpointed layer
compiled with the checkpoint inside it (``mode = "selective"`` or fewer checkpointed layers under ``[model.compile]``),
the partitioner no longer recomputes text-stream values only that backward read. An eager checkpoint (or diffusers'
whole-layer one) recomputes the layer's forward as before.

Exact under two conditions:

* ``embed_tokens`` is frozen (else its gradient arrives through the text stream): :func:`check_text_stream` refuses
  the key otherwise, and the wrapper re-checks at each call;
* the text prefix ``hidden_states[:und_len]`` holds text tokens only: true by construction of the packed layout of
  :func:`cosmos_framework_ext.recipe.attention.build_packed_inputs` (text of every sample, then vision), the only
  layout the embedded trainer builds; not checked at run time.

Trainable weights inside the text stream (a ``keys_to_select`` that names ``to_q``, ``mlp`` ...) stay exact: the cut
is at the stack's entry, so a trainable text-stream weight makes the stream after it require gradients again.

Proof: ``tests/equivalence/test_text_stream.py`` (the loss and every trainable gradient ``torch.equal`` with and
without, CPU, fp32, packed micro-batches, dense and block-sparse attention, eager, compiled with ``aot_eager`` and
with inductor, every checkpointing mode; the text stream's backward counted to zero; anchored to diffusers' own
forward).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["check_text_stream", "detach_text_stream", "detached_if_frozen", "is_detached"]

_MARK = "_onecard_text_stream_detached"


def check_text_stream(on: bool, trainable: list[str]) -> None:
    """Refuse ``detach_text_stream`` where it would drop a gradient.

    Args:
        on: ``[onecard] detach_text_stream``.
        trainable: the trainable parameter names (``keys_to_select``'s match).

    Raises:
        ValueError: ``embed_tokens`` trains (its gradient comes through the text stream); the message names the fix.
    """
    if not on:
        return
    trains = [n for n in trainable if n.split(".")[0] == "embed_tokens"]
    if trains:
        raise ValueError(f"[onecard] detach_text_stream cuts the text stream's backward, but {trains[0]} trains "
                         "([optimizer] keys_to_select matches it) and its gradient comes through that stream: drop it "
                         "from keys_to_select or set detach_text_stream = false")


def detached_if_frozen(stream: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
    """``stream.detach()`` (the same values, no autograd history) while ``embed_weight`` (the text-token embedding's
    weight) is frozen; ``stream`` itself while it trains (the stock path: its gradient comes through the stream)."""
    return stream if embed_weight.requires_grad else stream.detach()


def detach_text_stream(model: torch.nn.Module) -> None:
    """Wrap ``model._run_decoder_stack`` (diffusers' ``Cosmos3OmniTransformer``) so that the text stream enters the
    decoder layers detached while ``model.embed_tokens`` is frozen; idempotent.

    The wrapped call is ``_run_decoder_stack(und_seq.detach(), gen_seq, rotary_emb)``: ``und_seq`` [und_len, hidden]
    in the compute dtype, the values unchanged. With ``embed_tokens.weight.requires_grad`` true at call time the
    stream is passed as it comes (the stock path), so a later unfreeze cannot lose a gradient.

    Raises:
        TypeError: ``model`` has no ``_run_decoder_stack`` or no ``embed_tokens`` (not a Cosmos3 transformer).
    """
    if getattr(model, _MARK, False):
        return
    if not callable(getattr(model, "_run_decoder_stack", None)) or not hasattr(model, "embed_tokens"):
        raise TypeError(f"{type(model).__name__} has no _run_decoder_stack/embed_tokens: detach_text_stream wraps "
                        "diffusers' Cosmos3OmniTransformer")
    inner = model._run_decoder_stack

    @functools.wraps(inner)
    def run(und_seq: torch.Tensor, gen_seq: torch.Tensor, rotary_emb: Any) -> Any:
        # looked up at each call: FSDP2 replaces the Parameter objects when it shards the model
        return inner(detached_if_frozen(und_seq, model.embed_tokens.weight), gen_seq, rotary_emb)

    model._run_decoder_stack = run
    setattr(model, _MARK, True)


def is_detached(model: torch.nn.Module) -> bool:
    """Whether :func:`detach_text_stream` wrapped ``model``."""
    return bool(getattr(model, _MARK, False))
