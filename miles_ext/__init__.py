"""onecard for radixark miles-diffusion's MiniMax-H3 LoRA SFT on one GPU: its levers, its recipe, and what the patch
table names.

- :mod:`.levers`   -- ``fsdp_policy`` (FSDP2, bf16 master, CPU offload), ``lora`` (fp32 adapters), ``pinned`` (exact
  pinned arena), ``residency`` (partial residency, the one resolver), ``h2d_prefetch``, ``fast_init`` (low-RAM init),
  ``finite_step`` (non-finite step skip), ``host_checkpoint``; each imports ``patches.core`` and other levers only.
- :mod:`.recipe`   -- presets, packed inputs, latents, text encoder, the SFT step, the 8->1 schedule and its
  translator, the clip/caption data, the embedded trainer (``train``) and the adapter export.
- :mod:`.upstream` -- the implementations ``patches/miles_table.py`` names by import string for a real checkout.
"""
