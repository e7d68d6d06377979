"""The MiniMax-H3 LoRA SFT recipe: presets, inputs, latents, the step, schedule, data, trainer, export."""
