"""What every lever and both recipes share; imports no recipe package and nothing else of ``patches``.

- :mod:`.flags`       -- the lever environment flags (``COSMOS_EMA_CPU_SUBSET``, ...), strict parsing; the one
                         parser of an H3 residency setting.
- :mod:`.errors`      -- :class:`~.errors.UserError` (bad input: one ``error:`` line, exit 2), ``cli``, and
                         :class:`~.errors.UpstreamMismatch`.
- :mod:`.io`          -- atomic writes (temp name + rename), own-storage checkpoint tensors, file-page release.
- :mod:`.runtime`     -- GiB, host RSS, rank/world, DTensor shards (local, sliced, global), median, ports, stable hash.
- :mod:`.device`      -- the one device picker (``ONECARD_GPU_MEMORY_GIB`` caps the card) and the GPU budget.
- :mod:`.config`      -- typed config dataclasses: strict TOML loading, field docs, argparse flags.
- :mod:`.checkpoint`  -- :class:`~.checkpoint.CheckpointManager`: one naming scheme, atomic, resumable, retention;
                         full (unsharded) state gathered at any world size and sliced back on load.
- :mod:`.settings`    -- the settings a checkpoint was trained with, compared when a run resumes.
- :mod:`.preflight`   -- input checks shared by the launchers' validate steps (output folder, port).
- :mod:`.lock`        -- one run per output folder.
- :mod:`.trainer`     -- the trainer skeleton (preflight -> lock -> build -> levers -> resume -> loop -> summary).
- :mod:`.summary`     -- the one ``summary.json`` schema.
- :mod:`.host_arena`  -- exact-size pinned host memory.
- :mod:`.ledger`      -- the memory ledger's table (components, totals, fit verdict).
- :mod:`.sampler`     -- the GPU/host memory timeline sampler.
- :mod:`.threads`     -- the intra-op CPU threads of one background thread (a per-thread cap) and the pools that use it.
- :mod:`.torch_internals` -- the guarded table of torch-private FSDP2 internals the H3 levers touch.
- :mod:`.data`        -- dataset rows, video decode and clip cache, the sample dataset, the one latent cache, prefetch.
"""
