"""Compiled blocks: ``torch.compile`` per decoder layer, where the recipe says ``[model.compile] enabled = true``.

Regional compilation (diffusers' ``ModelMixin.compile_repeated_blocks``: every ``Cosmos3VLTextMoTDecoderLayer``
is compiled in place with ``nn.Module.compile``), as upstream compiles its blocks. The layers share one code
object and PyTorch inlines ``nn.Module``\\ s, so the layers share one compiled graph: the compile cost is one
layer's, not 28.

A packed micro-batch has a new length almost every time (the text and vision token counts of the samples that
happened to fit). Lengths are **marked dynamic**, not bucketed (bucketing would pad the sequence and change
the attention): with ``compile_dynamic = true`` (the recipes' value) the first compile already treats every
size as symbolic (``dynamic=True``); with ``compile_dynamic = false`` PyTorch's automatic dynamic shapes
(``dynamic=None``) compile once static and, on the first length change, once more with the changed sizes
symbolic. Either way a new length does not recompile again (``tests/equivalence/test_compile_blocks.py``
counts the compiles). The segment masks / block masks reach the compiled layer through the shared attention
processor, as tensors, so they are graph inputs as well, not constants.

The embedded trainer compiles on a GPU only: on the CPU (tests, smoke runs) the step runs eagerly, and the
proof compiles with the ``eager``/``aot_eager`` backends, which trace exactly what ``inductor`` would be given.
"""

from __future__ import annotations

import torch

__all__ = ["compile_blocks"]


def compile_blocks(model: torch.nn.Module, dynamic: bool = True, backend: str = "inductor") -> int:
    """Compile each repeated block of ``model`` in place; returns how many were wrapped.

    Args:
        model: a diffusers model with ``_repeated_blocks`` (``Cosmos3OmniTransformer``), before FSDP2 wraps it
            and after activation checkpointing is enabled (the checkpoint wrapper calls the compiled layer).
        dynamic: ``[model.compile].compile_dynamic``: True marks every size dynamic from the first compile;
            False lets PyTorch's automatic dynamic shapes do it at the first size change.
        backend: ``torch.compile`` backend (``inductor`` on the GPU; tests use ``eager``).

    Raises:
        ValueError: ``model`` has no repeated blocks to compile (diffusers' message).
    """
    model.compile_repeated_blocks(dynamic=True if dynamic else None, backend=backend)
    names = set(getattr(model, "_repeated_blocks", ()))
    return sum(1 for m in model.modules() if type(m).__name__ in names)


