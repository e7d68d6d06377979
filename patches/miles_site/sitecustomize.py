"""On ``PYTHONPATH`` (set by ``launchers/sft_h3_t2va_1gpu.sh`` with ``MILES_DIFFUSION_ROOT``): arm the miles-diffusion
patch table in every Python process, Ray actors included (:mod:`patches.miles_hook`)."""

import os

if os.environ.get("MILES_DIFFUSION_ROOT") and os.environ.get("MILES_ONECARD_FSDP", "").strip().lower() in ("1", "true", "yes"):
    from patches.miles_hook import install_hook

    install_hook()
