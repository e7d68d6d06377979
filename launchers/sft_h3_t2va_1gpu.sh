#!/usr/bin/env bash
# MiniMax-H3 text-to-audio-video LoRA SFT on ONE GPU, training what the 8-GPU miles-diffusion recipe trains.
#
#   bash launchers/sft_h3_t2va_1gpu.sh [trainer args, e.g. --num-rollout 2 --deterministic-mode]
#
# With MILES_DIFFUSION_ROOT (a miles-diffusion checkout) upstream's train_diffusion.py runs with the trailing
# arguments, its FSDP application patched when MILES_ONECARD_FSDP=1 (see patches/miles_table.py).
# Without MILES_DIFFUSION_ROOT the embedded reference trainer runs (python -m miles_ext.recipe.train): the tiny
# preset on a machine without a GPU, the full 33 B preset on a GPU. Recipe defaults: rollout batch 32, 1
# sample per prompt, 4 optimizer steps per rollout (global batch 8), micro-batch 1, LoRA rank 64 / alpha
# 128, the 8-GPU schedule replayed by grad accumulation (FROM_GPUS, default 8), --fsdp-cpu-offload with
# --fsdp-resident-blocks auto (as many blocks stay on the card as it holds, the rest streamed from the host with
# side-stream prefetch; RESIDENT_BLOCKS=N or none to change it) and --fsdp-master-dtype bf16 on a GPU.
# Reads: FROM_GPUS (8), RESIDENT_BLOCKS (auto; on a GPU), OUTPUT_ROOT (outputs), DATASET_PATH (default: the sample dataset), MASTER_PORT (the
# one-rank process group's port; default: a free one, or pass --master-port), PYTORCH_CUDA_ALLOC_CONF (default
# expandable_segments:True: less allocator slack under a capped card), BASE_CHECKPOINT_PATH (a diffusers
# MiniMaxH3Transformer3DModel safetensors checkpoint streamed into the base; default: random weights).
# Writes $OUTPUT_ROOT/h3_t2va_sft/: summary.json, checkpoints/iter_<rollout, 9 digits>.pt after every rollout and
# checkpoints/latest_checkpoint.txt naming the newest. Run it again with a larger --num-rollout to resume; with
# the same --num-rollout it says there is nothing to do.
set -euo pipefail
PYTHON="${PYTHON:-python}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${MILES_DIFFUSION_ROOT:-}" ]]; then
  # An upstream miles-diffusion checkout: its own train_diffusion.py with the trailing arguments (upstream's flags;
  # start Ray yourself, as upstream's MILES_SCRIPT_EXTERNAL_RAY=1 path expects). patches/miles_site on PYTHONPATH
  # arms the miles patch table in every process, Ray actors included (patches/miles_hook.py), when
  # MILES_ONECARD_FSDP=1 (and MILES_RESIDENT_BLOCKS, MILES_GPU_BUDGET_GIB) are set.
  for v in RESIDENT_BLOCKS FROM_GPUS; do
    if [[ -n "${!v:-}" ]]; then
      echo "error: $v applies to the embedded trainer, not to an upstream checkout (MILES_DIFFUSION_ROOT is set):" \
           "use MILES_RESIDENT_BLOCKS / upstream's own flags, or unset $v" >&2
      exit 2
    fi
  done
  if [[ ! -d "$MILES_DIFFUSION_ROOT/miles/backends/fsdp_utils" || ! -f "$MILES_DIFFUSION_ROOT/train_diffusion.py" ]]; then
    echo "error: MILES_DIFFUSION_ROOT=$MILES_DIFFUSION_ROOT is not a miles-diffusion checkout (no" \
         "miles/backends/fsdp_utils/ or train_diffusion.py in it): point it at one, or unset it for the embedded trainer" >&2
    exit 2
  fi
  (cd "$here" && "$PYTHON" -c "import sys
from patches.core.flags import FlagError, read_miles
try:
    read_miles()
except FlagError as e:
    sys.exit(f'error: {e}')") || exit 2
  export PYTHONPATH="$here/patches/miles_site:$here:$MILES_DIFFUSION_ROOT${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
  cd "$MILES_DIFFUSION_ROOT"
  exec "$PYTHON" train_diffusion.py "$@"
fi
# FROM_GPUS: plain ASCII digits from 1 to 1024 (no sign, spaces or exponent; "08" is 8), as the Cosmos launcher's counts.
from="${FROM_GPUS:-8}"
case "$from" in ""|*[!0123456789]*) from_ok="" ;; *) from_ok="${from#"${from%%[!0]*}"}" ;; esac
if [[ -z "$from_ok" ]] || (( ${#from_ok} > 9 || from_ok > 1024 )); then
  shown="$from"; [[ -n "$from" && "$from" != *[[:space:]]* ]] || shown="'$from'"
  echo "error: FROM_GPUS=$shown is not a whole number from 1 to 1024 (the GPUs of the schedule replayed):" \
       "give plain digits in that range" >&2
  exit 2
fi
from="$from_ok"
# RESIDENT_BLOCKS (auto | N | none) becomes trainer flags through the one residency resolver (miles_ext.levers.residency):
# on a GPU --fsdp-cpu-offload and --fsdp-resident-blocks; refused in one line when bad or given twice.
offload_out="$(cd "$here" && "$PYTHON" -m miles_ext.levers.residency launcher-args "$@")" || exit 2
offload=()
[[ -n "$offload_out" ]] && mapfile -t offload <<< "$offload_out"
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"  # less allocator slack
exec "$PYTHON" -m miles_ext.recipe.train --from-gpus "$from" --fsdp-master-dtype bf16 ${offload[@]+"${offload[@]}"} \
  --output-dir "${OUTPUT_ROOT:-outputs}/h3_t2va_sft" ${DATASET_PATH:+--data-dir "$DATASET_PATH"} \
  ${BASE_CHECKPOINT_PATH:+--base-checkpoint-path "$BASE_CHECKPOINT_PATH"} "$@"
