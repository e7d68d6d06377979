"""onecard for NVIDIA cosmos-framework's Cosmos3-Edge vision SFT: its levers, its recipe, and what the patch table names.

- :mod:`.levers`   -- one module per lever (``ema``, ``vae_offload``, ``packing``, ``latent_cache``, ``optim_offload``,
  ``frozen_bf16``, ``attention_blocksparse``, ``compile_blocks``), each with its proof in
  ``tests/equivalence/test_<lever>.py``; a lever imports ``patches.core`` and other levers only.
- :mod:`.recipe`   -- the recipe: TOML schema (``config``), presets, samples (``data``), loss, VAE encode, packed
  attention, the memory ledger, the embedded reference trainer (``train``) and its command lines (``plan``,
  ``prepass``).
- :mod:`.upstream` -- the implementations ``patches/cosmos_table.py`` names by import string for a real checkout.
"""
