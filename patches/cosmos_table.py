"""The patch table for NVIDIA cosmos-framework (targets at upstream commits ed8287f and 5eee9ed).

Implementations live in :mod:`cosmos_framework_ext.upstream`, named here by import string and imported only
when a flag asks for them; this table says WHERE (target and its expected signature) and WHEN (the flag). Patch points: ``shared/upstream/cosmos_framework.md`` §1-§2.
"""

from __future__ import annotations

from .core.flags import EMA_CPU_SUBSET, VAE_CPU_OFFLOAD
from .guard import Patch, PatchSet

SUPPORTED = "cosmos-framework ed8287f (2026-07-21) and 5eee9ed (2026-08-21)"
_MODEL = "cosmos_framework.model.generator.omni_mot_model:OmniMoTModel"
_DCP = "cosmos_framework.checkpoint.dcp:ModelWrapper"
_IMPL = "cosmos_framework_ext.upstream"

PATCHES = [
    Patch("ema.set_up_model", EMA_CPU_SUBSET, f"{_MODEL}.set_up_model", (("self",),), f"{_IMPL}:patched_set_up_model"),
    Patch("ema.checkpoint_save", EMA_CPU_SUBSET, f"{_DCP}.state_dict", (("self",),), f"{_IMPL}:patched_wrapper_state_dict"),
    Patch("ema.checkpoint_load", EMA_CPU_SUBSET, f"{_DCP}.load_state_dict", (("self", "state_dict"),),
          f"{_IMPL}:patched_wrapper_load_state_dict"),
    Patch("vae.set_up_tokenizers", VAE_CPU_OFFLOAD, f"{_MODEL}.set_up_tokenizers", (("self",),),
          f"{_IMPL}:patched_set_up_tokenizers"),
    Patch("vae.get_data_and_condition", VAE_CPU_OFFLOAD, f"{_MODEL}.get_data_and_condition",
          (("self", "data_batch", "iteration", "vision_condition_indexes"),
           ("self", "data_batch", "iteration", "vision_condition_indexes", "retain_raw_state_vision")),
          f"{_IMPL}:with_vae_on_device"),
    Patch("vae.encode", VAE_CPU_OFFLOAD, f"{_MODEL}.encode", (("self", "state"),), f"{_IMPL}:with_vae_on_device"),
    Patch("vae.decode", VAE_CPU_OFFLOAD, f"{_MODEL}.decode", (("self", "latent"),), f"{_IMPL}:with_vae_on_device"),
]


def patch_set() -> PatchSet:
    """A fresh :class:`PatchSet` over :data:`PATCHES`."""
    return PatchSet("cosmos-framework", SUPPORTED, PATCHES)
