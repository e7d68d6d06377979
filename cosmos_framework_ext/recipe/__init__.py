"""The Cosmos3-Edge recipe: config, presets, data, loss, VAE encode, attention, ledger, trainer and its CLIs."""
