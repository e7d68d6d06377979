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

``[onecard] compile_wrapper = "cpp"`` compiles the layers with inductor's C++ wrapper (``options={"cpp_wrapper":
True}``): the generated code that allocates the outputs and launches the kernels is C++, not Python. The kernels
and their order are the same, so the results are the same: bitwise on the CPU, and on the GPU within the compiled
layers' own run-to-run difference (a stated fp32 tolerance; proof: ``tests/equivalence/test_compile_wrapper.py``);
what changes is the host time per kernel launch, which bounds a forward whose kernels the host launches more slowly
than the GPU runs them.

The embedded trainer compiles on a GPU only: on the CPU (tests, smoke runs) the step runs eagerly, and the
proof compiles with the ``eager``/``aot_eager`` backends, which trace exactly what ``inductor`` would be given.
"""

from __future__ import annotations

import torch

__all__ = ["WRAPPERS", "compile_blocks"]

WRAPPERS = ("python", "cpp")
"""Values of ``[onecard] compile_wrapper``: inductor's Python wrapper (its default) or its C++ wrapper."""


def compile_blocks(model: torch.nn.Module, dynamic: bool = True, backend: str = "inductor",
                   wrapper: str = "python") -> int:
    """Compile each repeated block of ``model`` in place; returns how many were wrapped.

    Args:
        model: a diffusers model with ``_repeated_blocks`` (``Cosmos3OmniTransformer``), before FSDP2 wraps it
            and after activation checkpointing is enabled (the checkpoint wrapper calls the compiled layer).
        dynamic: ``[model.compile].compile_dynamic``: True marks every size dynamic from the first compile;
            False lets PyTorch's automatic dynamic shapes do it at the first size change.
        backend: ``torch.compile`` backend (``inductor`` on the GPU; tests use ``eager``).
        wrapper: ``"python"`` or ``"cpp"`` (:data:`WRAPPERS`): inductor's wrapper code; ``"cpp"`` needs
            ``backend="inductor"`` (the other backends generate no wrapper).

    Raises:
        ValueError: ``model`` has no repeated blocks to compile (diffusers' message); ``wrapper`` not one of
            :data:`WRAPPERS`, or ``"cpp"`` with a backend other than inductor.
    """
    if wrapper not in WRAPPERS:
        raise ValueError(f"compile wrapper {wrapper!r} is not one of {list(WRAPPERS)}")
    if wrapper == "cpp" and backend != "inductor":
        raise ValueError(f"the C++ wrapper is inductor's: backend {backend!r} generates no wrapper")
    options = {"options": {"cpp_wrapper": True}} if wrapper == "cpp" else {}
    model.compile_repeated_blocks(dynamic=True if dynamic else None, backend=backend, **options)
    names = set(getattr(model, "_repeated_blocks", ()))
    return sum(1 for m in model.modules() if type(m).__name__ in names)


