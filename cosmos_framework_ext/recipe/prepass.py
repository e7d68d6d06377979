"""``python -m cosmos_framework_ext.recipe.prepass --toml RECIPE``: fill the latent cache (lever 4) for a recipe.

Reads the recipe, the dataset (``DATASET_PATH`` or the sample dataset) and ``WAN_VAE_PATH`` exactly as the trainer
does, builds the trainer's VAE (same preset, same seed, :func:`cosmos_framework_ext.recipe.train.build_recipe_vae`;
the transformer is not built), runs the pre-pass over every (clip, window, size) the loader can yield and prints one
line with hits/misses, bytes on disk and time. The trainer's own pre-pass then finds every entry.

Exit 0, or 2 with one ``error:`` line on bad input (before anything is encoded).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    from patches.core.errors import ArgumentParser, cli

    ap = ArgumentParser(prog="python -m cosmos_framework_ext.recipe.prepass",
                        description="Fill the latent cache (lever 4) for a recipe TOML.")
    ap.add_argument("--toml", required=True, help="recipe TOML (as for the trainer's --sft-toml)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    def fill() -> None:
        from cosmos_framework_ext.levers.latent_cache import run_prepass
        from patches.core.data.latents import check_folder
        from cosmos_framework_ext.recipe import data as datamod
        from cosmos_framework_ext.recipe import train
        from cosmos_framework_ext.recipe.vae import online_latent
        from patches.core.flags import LATENT_CACHE_DIR, latent_cache_dir

        check_folder(latent_cache_dir(), LATENT_CACHE_DIR)  # before anything is built
        recipe = train.CosmosSFT(train.parse_args(["--sft-toml", args.toml, "--no-save"]))
        recipe.preflight()
        vae, _, _ = train.build_recipe_vae(recipe.cfg, recipe.preset, recipe.device)
        _, report = run_prepass(vae, recipe.device, datamod.cache_items(recipe.records, recipe.preset),
                                encode=online_latent, rank=recipe.rank, world_size=recipe.world,
                                progress=not args.no_progress)
        if recipe.main_rank:
            print(report.line(), flush=True)

    return cli(fill)


if __name__ == "__main__":
    sys.exit(main())
