#!/usr/bin/env bash
# MiniMax-H3 text-to-audio-video LoRA SFT on ONE GPU, training what the 8-GPU miles-diffusion recipe trains.
#
#   bash launchers/sft_h3_t2va_1gpu.sh [trainer args, e.g. --num-rollout 2 --deterministic-mode]
#
# Without MILES_DIFFUSION_ROOT the embedded reference trainer runs (python -m miles_ext.train): the tiny
# preset on a machine without a GPU, the full 33 B preset on a GPU. Recipe defaults: rollout batch 32, 1
# sample per prompt, 4 optimizer steps per rollout (global batch 8), micro-batch 1, LoRA rank 64 / alpha
# 128, the 8-GPU schedule replayed by grad accumulation (FROM_GPUS, default 8), --fsdp-cpu-offload and
# --fsdp-master-dtype bf16 on a GPU.
# Reads: FROM_GPUS (8), OUTPUT_ROOT (outputs), DATASET_PATH (default: the sample dataset), MASTER_PORT (the
# one-rank process group's port; default: a free one, or pass --master-port).
# Writes $OUTPUT_ROOT/h3_t2va_sft/: summary.json, checkpoints/iter_<rollout, 9 digits>.pt after every rollout and
# checkpoints/latest_checkpoint.txt naming the newest. Run it again with a larger --num-rollout to resume; with
# the same --num-rollout it says there is nothing to do.
set -euo pipefail
PYTHON="${PYTHON:-python}"
if [[ -n "${MILES_DIFFUSION_ROOT:-}" ]]; then
  echo "error: MILES_DIFFUSION_ROOT is set, but driving an upstream miles-diffusion checkout is not supported by" \
       "this version; unset it to run the embedded reference trainer" >&2
  exit 2
fi
from="${FROM_GPUS:-8}"
if [[ ! "$from" =~ ^[0-9]+$ ]]; then
  echo "error: FROM_GPUS=$from is not a whole number" >&2
  exit 2
fi
offload=()
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" && offload=(--fsdp-cpu-offload)
export PYTHONUNBUFFERED=1
exec "$PYTHON" -m miles_ext.train --from-gpus "$from" --fsdp-master-dtype bf16 "${offload[@]}" \
  --output-dir "${OUTPUT_ROOT:-outputs}/h3_t2va_sft" ${DATASET_PATH:+--data-dir "$DATASET_PATH"} "$@"
