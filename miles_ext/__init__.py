"""onecard's port of the miles-diffusion MiniMax-H3 LoRA SFT recipe to one GPU.

Modules: ``presets`` (full / tiny H3), ``h3_inputs`` (packed forward inputs), ``lora`` (PEFT adapters),
``fsdp_policy`` (FSDP2 wrapping, master dtype, grad clipping), ``sft`` (the SFT micro-batch: seeding, noising,
loss_sum), ``recipe`` (N-GPU -> 1-GPU argument translation, pair schedule, stable hash), ``text_encoder``
(MiniLM captions), ``train`` (the embedded trainer: ``H3SFTConfig`` flags, ``H3SFTRecipe`` in the
``patches.core.trainer`` skeleton) and ``export_lora`` (checkpoint -> PEFT / diffusers adapter). From
``patches`` they import ``patches.core`` only.
"""
