"""Compiled blocks (``[model.compile] enabled = true``): a new micro-batch length does not recompile.

:func:`cosmos_framework_ext.levers.compile_blocks.compile_blocks` compiles each decoder layer with its sizes dynamic.
The proof runs packed micro-batches of five different lengths (tiny preset, fp32, CPU, activation checkpointing
on as in the trainer) through the compiled layers, forward and backward, with the dense and the block-sparse
attention, and counts the graphs Dynamo compiles (``torch._dynamo.utils.counters``): the first micro-batch
compiles two graphs (the first layer's inputs are views of the joint buffer, the other layers' not; measured
[2, 0, 0, 0, 0]); a second warm-up micro-batch is allowed (a size that happens to equal a static one, e.g.
head_dim, is specialised once), and three with ``compile_dynamic = false`` (automatic dynamic shapes: measured
[1, 2, 2, 0, 0]); later lengths must compile nothing, and the losses and gradients equal the eager model's. Backend ``eager``: recompiles are decided by Dynamo's guards
before any backend runs, so the count is inductor's too (``aot_eager`` gives the same counts, 2.5x slower).

Planted: layers compiled static (``dynamic=False``) recompile at every new length, and the check fails.
"""

from __future__ import annotations

import pytest
import torch

from cosmos_framework_ext.levers.compile_blocks import compile_blocks
from tests.equivalence import tiny_recipe as R

SAMPLES = (3, 4, 5, 6, 7)
"""Samples per micro-batch: five different packed lengths (text 18-56 tokens, vision 40-336)."""


def _step(model, impl: str, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return R.packed_step(model, R.micro_batch(n, 0, n_samples=n), impl)


def compiles_per_micro_batch(impl: str, compile_fn, check_eager: bool = True, device: str = "cpu",
                             rtol: float = 1e-5) -> list[int]:
    """Graphs compiled during each micro-batch of :data:`SAMPLES` by a model whose layers ``compile_fn(model)``
    compiled; with ``check_eager`` each loss and gradient is also compared with the uncompiled model's."""
    torch._dynamo.reset()
    model, _ = R.make_model(device=device)
    model.enable_gradient_checkpointing()
    eager, _ = R.make_model(device=device)
    eager.enable_gradient_checkpointing()
    compile_fn(model)
    counts = []
    for n in SAMPLES:
        before = compile_count()
        loss, grads = _step(model, impl, n)
        counts.append(compile_count() - before)
        if check_eager:
            loss_e, grads_e = _step(eager, impl, n)
            torch.testing.assert_close(loss, loss_e, rtol=rtol / 10, atol=0)
            for g, ge in zip(grads, grads_e):
                torch.testing.assert_close(g, ge, rtol=rtol, atol=rtol / 100)
    return counts


def lengths_do_not_recompile(counts: list[int], warmup: int = 2) -> bool:
    """The check: after the first ``warmup`` micro-batches a new length compiles nothing, and at most two graphs
    were compiled per warm-up micro-batch."""
    return sum(counts[warmup:]) == 0 and sum(counts) <= 2 * warmup


@pytest.mark.parametrize("impl, backend", [("dense", "eager"), ("flex", "eager")])
def test_new_lengths_do_not_recompile(impl, backend):
    counts = compiles_per_micro_batch(impl, lambda m: compile_blocks(m, dynamic=True, backend=backend))
    assert counts[0] > 0 and lengths_do_not_recompile(counts), counts


def test_automatic_dynamic_when_compile_dynamic_is_false():
    """Automatic dynamic shapes mark a size dynamic when it first changes: one more warm-up micro-batch (measured
    [1, 2, 2, 0, 0]), then nothing."""
    counts = compiles_per_micro_batch("flex", lambda m: compile_blocks(m, dynamic=False, backend="eager"),
                                      check_eager=False)
    assert lengths_do_not_recompile(counts, warmup=3), counts


def test_every_decoder_layer_is_compiled():
    model, _ = R.make_model()
    assert compile_blocks(model, backend="eager") == len(model.layers)
    assert all(layer._compiled_call_impl is not None for layer in model.layers)


def test_planted_static_compile_recompiles_every_length_and_is_detected():
    counts = compiles_per_micro_batch(
        "dense", lambda m: m.compile_repeated_blocks(dynamic=False, backend="eager"), check_eager=False)
    assert all(c > 0 for c in counts[:4]) and not lengths_do_not_recompile(counts), counts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("impl", ["dense", "flex"])
def test_cuda_inductor_blocks_equal_eager_and_do_not_recompile(impl):
    """What the trainer does on the GPU: inductor, dynamic sizes, fp32 tiny preset; losses and gradients within
    1e-4 relative of the eager model (inductor fuses and reorders reductions), no recompile after warm-up.

    flex: inductor's flex lowering guards on "fewer than 128 query tokens" (its decoding-kernel test). Here the
    vision queries of the first micro-batches (3-4 samples, 40-odd tokens) are fewer than 128 and later ones more,
    so the crossing recompiles once: one more warm-up micro-batch (measured [2, 0, 2, 0, 0] on the H200). The
    recipe's micro-batches hold 8-12 k vision tokens and over 1000 text tokens: they never cross it."""
    counts = compiles_per_micro_batch(impl, lambda m: compile_blocks(m, dynamic=True), device="cuda", rtol=1e-4)
    assert lengths_do_not_recompile(counts, warmup=3 if impl == "flex" else 2), counts


def compile_count() -> int:
    """Graphs Dynamo has compiled in this process so far (``torch._dynamo.utils.counters['stats']['unique_graphs']``);
    the difference across micro-batches is the number of (re)compiles they caused."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])

