"""The patch table for radixark/miles_diffusion's FSDP application (one GPU, ``MILES_DIFFUSION_ROOT``).

Targets, read at these commits of ``miles/backends/fsdp_utils/`` (the newest versions the public snapshots hold;
radixark/miles_diffusion's code):

- ``model_loader.py`` @ 2f59a1e6 and @ 371fd61f: ``apply_fsdp2(model, parallel_plan, mesh=None, cpu_offload=False,
  args=None)``. Upstream builds ``CPUOffloadPolicy()`` (``pin_memory=True``: every shard pinned through the
  caching host allocator, rounded to a power of two) and offloads every unit or none.
- ``checkpoint.py`` @ 3636bdd7: ``broadcast_full_state_to_fsdp(model, full_state, *, cpu_offload)``. Rank 0 moves
  the *whole* sharded model to the GPU, loads the full state, and moves it back with ``.to("cpu",
  non_blocking=True)`` (pinned, rounded again): at one rank that is the whole 66 GB bf16 model on the card.

``load_fsdp_models`` (``model_loader.py``) calls both through their module globals, so replacing the module
attributes reaches it. ``parallel.py`` @ 09ab3b27 (``create_fsdp_parallel_state``), ``offload.py`` @ 81b51864
(``offload_model`` for ``--offload-train``, not used with ``--fsdp-cpu-offload``; upstream forces it off there)
and ``model_backend.py`` @ 09ab3b27 / d431a238 (``load_component``) are read but not patched: see the notes on
low-RAM init in the README.

Implementations live in :mod:`miles_ext.upstream.patches`, named by import string and imported only when a flag asks.
"""

from __future__ import annotations

from .core.flags import MILES_ONECARD_FSDP
from .guard import Patch, PatchSet

SUPPORTED = ("miles-diffusion model_loader.py@2f59a1e6/@371fd61f and checkpoint.py@3636bdd7 "
             "(radixark/miles_diffusion, miles/backends/fsdp_utils)")
_FSDP = "miles.backends.fsdp_utils"
_IMPL = "miles_ext.upstream.patches"

PATCHES = [
    Patch("fsdp.apply_fsdp2", MILES_ONECARD_FSDP, f"{_FSDP}.model_loader:apply_fsdp2",
          (("model", "parallel_plan", "mesh", "cpu_offload", "args"),), f"{_IMPL}:patched_apply_fsdp2"),
    Patch("fsdp.broadcast_full_state", MILES_ONECARD_FSDP, f"{_FSDP}.checkpoint:broadcast_full_state_to_fsdp",
          (("model", "full_state", "cpu_offload"),), f"{_IMPL}:patched_broadcast_full_state"),
]


def patch_set() -> PatchSet:
    """A fresh :class:`PatchSet` over :data:`PATCHES`."""
    return PatchSet("miles-diffusion", SUPPORTED, PATCHES)
