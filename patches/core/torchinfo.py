"""What the installed torch was built for, read without importing it (``import torch`` costs about 2 s of CPU).

Commands that run before a trainer (the H3 launcher's flag helper) only need to know whether a GPU is possible at
all: a torch wheel built without CUDA, ROCm (HIP) or XPU has ``torch.cuda.is_available() == False`` everywhere, so
asking torch is needed only when the build has a GPU backend.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

__all__ = ["gpu_backends_built", "cuda_available"]


def gpu_backends_built() -> set[str] | None:
    """The GPU backends the installed torch was built with (``{"cuda"}``, ``{"hip"}``, ``set()`` for a CPU wheel),
    read from ``torch/version.py``'s literal assignments; ``None`` when that cannot be read (no torch, an unusual
    layout), in which case only importing torch can tell."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    values: dict[str, object] = {}
    for node in tree.body:
        target = (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else
                  node.target if isinstance(node, ast.AnnAssign) else None)
        if isinstance(target, ast.Name) and getattr(node, "value", None) is not None:
            try:
                values[target.id] = ast.literal_eval(node.value)
            except ValueError:
                return None
    if not {"cuda", "hip"} <= values.keys():
        return None
    return {k for k in ("cuda", "hip", "xpu") if values.get(k)}


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing torch when the build has no CUDA or HIP backend."""
    built = gpu_backends_built()
    if built is not None and not built & {"cuda", "hip"}:
        return False
    import torch

    return bool(torch.cuda.is_available())
