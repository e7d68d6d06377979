"""onecard's port of the miles-diffusion MiniMax-H3 LoRA SFT recipe to one GPU.

Modules: ``presets`` (full / tiny H3), ``h3_inputs`` (packed forward inputs), ``lora`` (PEFT adapters),
``fsdp_policy`` (FSDP2 wrapping, master dtype, grad clipping), ``sft`` (the SFT micro-batch: seeding, noising,
loss_sum) and ``recipe`` (N-GPU -> 1-GPU argument translation, pair schedule, stable hash).
"""
