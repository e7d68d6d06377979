"""The patch table for NVIDIA cosmos-framework (targets at upstream commits ed8287f and 5eee9ed).

Implementations live in :mod:`cosmos_framework_ext.upstream.patches` (levers) and
:mod:`cosmos_framework_ext.upstream.attention` (``COSMOS_ATTN_BACKEND=torch``), named here by import string and
imported only when a flag asks for them; this table says WHERE (target and its expected signature) and WHEN
(the flag).

The attention patch replaces the frontend's ``choose_backend`` (not ``attention`` itself): ``attention()`` looks
``choose_backend`` and ``BACKEND_MAP`` up in its own module at every call, so every importer of ``attention``
(``mot/attention.py``, ``unified_mot.py``, the tokenizer, the HF adapter), whenever it was imported, reaches
the torch backend.
"""

from __future__ import annotations

from .core.flags import (ATTN_BACKEND, DETACH_TEXT_STREAM, EMA_CPU_SUBSET, FROZEN_BF16, LATENT_CACHE, OPTIM_STATE_OFFLOAD,
                         VAE_CPU_OFFLOAD)
from .guard import Patch, PatchSet

SUPPORTED = "cosmos-framework ed8287f (2026-07-21) and 5eee9ed (2026-08-21)"
_MODEL = "cosmos_framework.model.generator.omni_mot_model:OmniMoTModel"
_DCP = "cosmos_framework.checkpoint.dcp:ModelWrapper"
_IMPL = "cosmos_framework_ext.upstream.patches"
_LATENTS = "cosmos_framework_ext.upstream.latents"
_SFT = "cosmos_framework.data.generator.local_datasets.sft_dataset:SFTDataset"
_ATTN = "cosmos_framework.model.attention.frontend"
_OPTIM = "cosmos_framework.utils.generator.optimizer"  # _optimizer_cls: the one place both commits build AdamW
_CHOOSE_BACKEND = ("query_shape", "key_shape", "value_shape", "dtype", "device", "requires_grad", "is_causal",
                   "causal_type", "is_varlen", "deterministic", "backend", "raise_error")  # ed8287f and 5eee9ed

PATCHES = [
    Patch("ema.set_up_model", EMA_CPU_SUBSET, f"{_MODEL}.set_up_model", (("self",),), f"{_IMPL}:patched_set_up_model"),
    Patch("ema.checkpoint_save", EMA_CPU_SUBSET, f"{_DCP}.state_dict", (("self",),), f"{_IMPL}:patched_wrapper_state_dict"),
    Patch("ema.checkpoint_load", EMA_CPU_SUBSET, f"{_DCP}.load_state_dict", (("self", "state_dict"),),
          f"{_IMPL}:patched_wrapper_load_state_dict"),
    Patch("checkpoint.broadcast", EMA_CPU_SUBSET, "cosmos_framework.checkpoint.dcp:_broadcast_tensor_leaf",
          (("value",),), f"{_IMPL}:patched_broadcast_tensor_leaf", also=(FROZEN_BF16,)),
    # lever 2 parks the VAE on the host; lever 4 needs it parked too (it moves only for a cache miss)
    Patch("vae.set_up_tokenizers", VAE_CPU_OFFLOAD, f"{_MODEL}.set_up_tokenizers", (("self",),),
          f"{_IMPL}:patched_set_up_tokenizers", also=(LATENT_CACHE,)),
    Patch("vae.get_data_and_condition", VAE_CPU_OFFLOAD, f"{_MODEL}.get_data_and_condition",
          (("self", "data_batch", "iteration", "vision_condition_indexes"),
           ("self", "data_batch", "iteration", "vision_condition_indexes", "retain_raw_state_vision")),
          f"{_IMPL}:patched_get_data_and_condition", also=(LATENT_CACHE,)),
    Patch("vae.encode", VAE_CPU_OFFLOAD, f"{_MODEL}.encode", (("self", "state"),), f"{_IMPL}:with_vae_on_device",
          also=(LATENT_CACHE,)),
    Patch("vae.decode", VAE_CPU_OFFLOAD, f"{_MODEL}.decode", (("self", "latent"),), f"{_IMPL}:with_vae_on_device",
          also=(LATENT_CACHE,)),
    Patch("latent.sample_key", LATENT_CACHE, f"{_SFT}.process_one_sample", (("self", "metadata"),),
          f"{_LATENTS}:patched_process_one_sample"),
    Patch("latent.encode", LATENT_CACHE, f"{_MODEL}._encode_vision_x0_tokens",
          (("self", "raw_state_vision", "num_vision_items_per_sample", "vision_condition_indexes"),
           ("self", "raw_state_vision", "num_vision_items_per_sample", "vision_condition_indexes",
            "num_views_per_vision_item", "frames_per_vision_item")),
          f"{_LATENTS}:patched_encode_vision_x0_tokens"),
    Patch("latent.decode_free", LATENT_CACHE,
          "cosmos_framework.data.generator.local_datasets.sft_dataset:ffmpeg_decode_video",
          (("video_path", "scale_hw", "num_threads"),), f"{_LATENTS}:patched_ffmpeg_decode_video"),
    Patch("latent.probe", LATENT_CACHE,
          "cosmos_framework.data.generator.local_datasets.sft_dataset:get_video_metadata",
          (("video_path",),), f"{_LATENTS}:patched_get_video_metadata"),
    Patch("latent.draw_sample", LATENT_CACHE,
          "cosmos_framework.callbacks.every_n_draw_sample:EveryNDrawSample.every_n_impl",
          (("self", "trainer", "model", "data_batch", "output_batch", "loss", "iteration"),),
          f"{_LATENTS}:patched_draw_sample"),
    Patch("latent.prepass", LATENT_CACHE, "cosmos_framework.trainer:ImaginaireTrainer.train",
          (("self", "model", "dataloader_train", "dataloader_val"),), f"{_LATENTS}:patched_trainer_train"),
    Patch("optim.state_offload", OPTIM_STATE_OFFLOAD, f"{_OPTIM}:_optimizer_cls",
          (("params", "optimizer_type", "optimizer_kwargs"),), f"{_IMPL}:patched_optimizer_cls"),
    Patch("frozen.init_optimizer", FROZEN_BF16, f"{_MODEL}.init_optimizer_scheduler",
          (("self", "optimizer_config", "scheduler_config"),), f"{_IMPL}:patched_init_optimizer_scheduler"),
    # 5eee9ed's shared decoder-stack forward (the three MoT text models' ``forward`` call it by its module name)
    Patch("text.impl_forward", DETACH_TEXT_STREAM, "cosmos_framework.model.generator.mot.unified_mot:_impl_forward",
          (("self", "pack", "attention_mask", "position_ids", "natten_metadata_list", "memory"),),
          f"{_IMPL}:patched_impl_forward"),
    Patch("attention.choose_backend", ATTN_BACKEND, f"{_ATTN}:choose_backend", (_CHOOSE_BACKEND,),
          "cosmos_framework_ext.upstream.attention:patched_choose_backend"),
]


def patch_set() -> PatchSet:
    """A fresh :class:`PatchSet` over :data:`PATCHES`."""
    return PatchSet("cosmos-framework", SUPPORTED, PATCHES)
