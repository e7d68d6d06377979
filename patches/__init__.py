"""onecard patches: WHERE and WHEN the levers apply, and the core every lever shares.

- :mod:`patches.core`          -- shared by both recipes (flags, errors, atomic IO, checkpoints, config,
  trainer skeleton, host arena, ledger table, memory sampler); imports no recipe.
- :mod:`patches.guard`         -- guarded monkeypatches: verify a target, refuse a mismatch by name, revert.
- :mod:`patches.cosmos_table`  -- the cosmos-framework patch table (implementations named by import string).
- :mod:`patches.miles_table`   -- the miles-diffusion patch table; :mod:`patches.miles_hook` applies it in Ray actors.
- :mod:`patches.run`           -- ``python -m patches.run MODULE``: apply the table, then run an upstream module.
- :mod:`patches.ledger`        -- ``python -m patches.ledger``: will a recipe fit the card?
- ``python -m patches status|check`` -- which flags are on, what they patch.

Imports point one way: ``cosmos_framework_ext`` and ``miles_ext`` import ``patches.core`` only; nothing in
``patches`` imports them, at any level (the tables name them by import string; ``tests/test_architecture.py`` reads
every import and checks it).
"""
