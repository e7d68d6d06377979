"""What every lever and both recipes share; imports no recipe package and nothing else of ``patches``.

- :mod:`.flags`       -- the lever environment flags (``COSMOS_EMA_CPU_SUBSET``, ...), strict parsing.
- :mod:`.errors`      -- :class:`~.errors.UserError` (bad input: one ``error:`` line, exit 2) and ``cli``.
- :mod:`.io`          -- atomic writes (temp name + rename).
- :mod:`.runtime`     -- GiB, host RSS, rank/world, DTensor shards (local, sliced, global), median, ports.
- :mod:`.config`      -- typed config dataclasses: strict TOML loading, field docs, argparse flags.
- :mod:`.checkpoint`  -- :class:`~.checkpoint.CheckpointManager`: one naming scheme, atomic, resumable;
                         full (unsharded) state gathered at any world size and sliced back on load.
- :mod:`.settings`    -- the settings a checkpoint was trained with, compared when a run resumes.
- :mod:`.preflight`   -- input checks shared by the launchers' validate steps (output folder, port).
- :mod:`.lock`        -- one run per output folder.
- :mod:`.trainer`     -- the trainer skeleton (preflight -> lock -> build -> levers -> resume -> loop -> summary).
- :mod:`.host_arena`  -- exact-size pinned host memory.
- :mod:`.ledger`      -- the memory ledger's table (components, totals, fit verdict).
- :mod:`.sampler`     -- the GPU/host memory timeline sampler.
"""
