"""onecard patches: WHERE and WHEN the levers apply.

- :mod:`patches.flags`       -- env-flag parsing (``COSMOS_EMA_CPU_SUBSET``, ``COSMOS_VAE_CPU_OFFLOAD``, ...).
- :mod:`patches.host_arena`  -- exact-size pinned host memory shared by every lever.
- :mod:`patches.status`      -- ``python -m patches status``.
"""
