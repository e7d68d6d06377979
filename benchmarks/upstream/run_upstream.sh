#!/usr/bin/env bash
# Run upstream cosmos-framework's SFT trainer, patched by onecard, on a GPU machine without network.
#
#   COSMOS_FRAMEWORK_ROOT=CHECKOUT bash benchmarks/upstream/run_upstream.sh ASSETS_DIR WHEELS_DIR [ARGS...]
#
# CHECKOUT  an upstream checkout (ed8287f or 5eee9ed; stage_upstream.sh makes a small copy).
# ASSETS_DIR  where the stand-in assets live; written by prepare_assets.py on first use (the clips and the
#           random-init VAE are kept across runs). Not carried: the VAE alone is 1.3 GiB.
# WHEELS_DIR  the wheelhouse of make_wheelhouse.sh (cp312 for the GPU machine).
# ARGS      passed to launchers/sft_edge_24gb.sh after the processor overrides: Hydra overrides such as
#           trainer.max_iter=3 or model.config.parallelism.fsdp_master_dtype=bfloat16 (needed to fit 24 GB
#           at 5eee9ed), or upstream trainer flags such as --dryrun (no VAE is made for a dry run).
#
# What it does: installs the wheels into ASSETS_DIR/pylib (pip --no-index --no-deps --target, redone
# only when the wheel set changes) and puts that first on PYTHONPATH so they shadow the machine's
# newer transformers & co.; writes/refreshes the assets; sources ASSETS_DIR/env.sh; runs the launcher,
# teeing everything to LOG. Every torchrun worker starts through memcap.py (torchrun's PYTHON_EXEC):
# the launcher's upstream path does not cap the card itself, so ONECARD_GPU_MEMORY_GIB is applied there
# with torch.cuda.set_per_process_memory_fraction, and each rank prints its peak memory at exit.
#
# Environment (read as set; nothing else is changed):
#   MEMTEST=1 / EMAVAL=1               recipe choice, as the launcher reads it
#   COSMOS_EMA_CPU_SUBSET, COSMOS_VAE_CPU_OFFLOAD, COSMOS_OPTIM_STATE_OFFLOAD, COSMOS_FROZEN_BF16, COSMOS_DETACH_TEXT_STREAM,
#   COSMOS_LATENT_CACHE (folder ONECARD_LATENT_CACHE; ONECARD_LATENT_CACHE_CHECK=1 compares every hit)   the levers
#   COSMOS_ATTN_BACKEND                default torch (upstream finds no attention backend on a GPU
#                                      without flash-attn / new cuDNN); set it empty for upstream's choice
#   ONECARD_GPU_MEMORY_GIB             cap per rank in GiB, e.g. 22.06 (a 24 GB card); unset: no cap
#   OUTPUT_ROOT                        default outputs/upstream (made absolute: the launcher cd's away)
#   LOG                                default $OUTPUT_ROOT/<recipe>-<date>.log
#   PYTHON                             default python3 (the machine's torch environment)
#   ASSET_ARGS                         options for prepare_assets.py, e.g. "--tokenizer wordpiece --captions sample"
#                                      (the embedded trainer's tokenizer and captions: both trainers get the same text)
#   FFMPEG                             a real ffmpeg executable to decode with instead of the Python stand-in
#                                      (e.g. the static build inside the imageio-ffmpeg wheel); ffprobe stays the stand-in
#   TAIL_OVERRIDES, NPROC_PER_NODE, MASTER_PORT, ...   as the launcher reads them
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
export PYTHON="${PYTHON:-python3}"

if [[ $# -lt 2 ]]; then sed -n '4p' "${BASH_SOURCE[0]}" | sed 's/^# *//' >&2; exit 2; fi
assets="$1" wheels="$2"; shift 2
if [[ -z "${COSMOS_FRAMEWORK_ROOT:-}" || ! -d "${COSMOS_FRAMEWORK_ROOT}/cosmos_framework" ]]; then
  echo "error: set COSMOS_FRAMEWORK_ROOT to a cosmos-framework checkout (got '${COSMOS_FRAMEWORK_ROOT:-}')" >&2
  exit 2
fi
shopt -s nullglob
whl=("$wheels"/*.whl)
shopt -u nullglob
(( ${#whl[@]} )) || { echo "error: no wheels in '$wheels' (make them with make_wheelhouse.sh)" >&2; exit 2; }
COSMOS_FRAMEWORK_ROOT="$(cd "$COSMOS_FRAMEWORK_ROOT" && pwd)"
export COSMOS_FRAMEWORK_ROOT
# the asset options are checked before anything is installed or written
# shellcheck disable=SC2086  # ASSET_ARGS is a list of options
"$PYTHON" "$here/prepare_assets.py" "$assets" ${ASSET_ARGS:-} --check || exit 2

mkdir -p "$assets"
assets="$(cd "$assets" && pwd)"

dryrun=0
for a in "$@"; do [[ "$a" == --dryrun ]] && dryrun=1; done

# 1. the pinned packages, first on PYTHONPATH
pylib="$assets/pylib"
stamp="$(for w in "${whl[@]}"; do basename "$w"; done | sort | "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [[ "$(cat "$pylib/.onecard-wheels" 2>/dev/null || true)" != "$stamp" ]]; then
  rm -rf "$pylib"
  echo "installing ${#whl[@]} wheels into $pylib ..." >&2
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$pylib" "${whl[@]}"
  echo "$stamp" > "$pylib/.onecard-wheels"
fi
export PYTHONPATH="$pylib${PYTHONPATH:+:$PYTHONPATH}"

# 2. the stand-in assets (cheap when they exist), then the environment they define
# shellcheck disable=SC2086  # ASSET_ARGS is a list of options
"$PYTHON" "$here/prepare_assets.py" "$assets" ${ASSET_ARGS:-}
# shellcheck disable=SC1091
source "$assets/env.sh"
if [[ "$dryrun" == 0 && ! -f "$WAN_VAE_PATH" ]]; then
  "$PYTHON" "$here/prepare_assets.py" "$assets" --vae-only
fi

if [[ -n "${FFMPEG:-}" ]]; then
  [[ -x "$FFMPEG" ]] || { echo "error: FFMPEG=$FFMPEG is not an executable: point it at an ffmpeg binary, or unset it" >&2; exit 2; }
  mkdir -p "$assets/ffmpeg-bin"
  # upstream's helper.py passes "-vsync 0", an option ffmpeg 8 removed ("Unrecognized option 'vsync'": every
  # sample then decodes no frame and is skipped); "-fps_mode passthrough" is the same setting under its new name
  rm -f "$assets/ffmpeg-bin/ffmpeg"  # never write through an old link onto the binary itself
  cat > "$assets/ffmpeg-bin/ffmpeg" <<SH
#!/usr/bin/env bash
a=(); for x in "\$@"; do
  if [[ "\$x" == -vsync ]]; then a+=(-fps_mode); elif [[ "\${a[-1]:-}" == -fps_mode && "\$x" == 0 ]]; then a+=(passthrough); else a+=("\$x"); fi
done
exec "$(cd "$(dirname "$FFMPEG")" && pwd)/$(basename "$FFMPEG")" "\${a[@]}"
SH
  chmod +x "$assets/ffmpeg-bin/ffmpeg"
  export PATH="$assets/ffmpeg-bin:$PATH"
fi

# 3. attention backend, output folder, log, per-rank memory cap + peak report
export COSMOS_ATTN_BACKEND="${COSMOS_ATTN_BACKEND-torch}"
export OUTPUT_ROOT="${OUTPUT_ROOT:-outputs/upstream}"
mkdir -p "$OUTPUT_ROOT"
OUTPUT_ROOT="$(cd "$OUTPUT_ROOT" && pwd)"
recipe=vision_sft_edge_24gb
[[ "${MEMTEST:-}" =~ ^(1|true|yes)$ ]] && recipe+=_memtest
[[ "${EMAVAL:-}" =~ ^(1|true|yes)$ ]] && recipe+=_emaval
LOG="${LOG:-$OUTPUT_ROOT/$recipe-$(date +%Y%m%d-%H%M%S).log}"
mkdir -p "$(dirname "$LOG")"
exec_dir="$assets/exec"
mkdir -p "$exec_dir"
real_python="$("$PYTHON" -c 'import sys; print(sys.executable)')"
printf '#!/bin/sh\nexec "%s" "%s" "$@"\n' "$real_python" "$here/memcap.py" > "$exec_dir/python-memcap"
chmod +x "$exec_dir/python-memcap"
export PYTHON_EXEC="$exec_dir/python-memcap"

{
  echo "== onecard run_upstream: $(date -u +%FT%TZ) recipe=$recipe dryrun=$dryrun"
  echo "== upstream: $COSMOS_FRAMEWORK_ROOT (staged from: $(cat "$COSMOS_FRAMEWORK_ROOT/.onecard-staged-from" 2>/dev/null || echo n/a))"
  echo "== flags: COSMOS_EMA_CPU_SUBSET=${COSMOS_EMA_CPU_SUBSET:-} COSMOS_VAE_CPU_OFFLOAD=${COSMOS_VAE_CPU_OFFLOAD:-}" \
       "COSMOS_OPTIM_STATE_OFFLOAD=${COSMOS_OPTIM_STATE_OFFLOAD:-} COSMOS_FROZEN_BF16=${COSMOS_FROZEN_BF16:-}" \
       "COSMOS_DETACH_TEXT_STREAM=${COSMOS_DETACH_TEXT_STREAM:-}" \
       "COSMOS_LATENT_CACHE=${COSMOS_LATENT_CACHE:-} ONECARD_LATENT_CACHE=${ONECARD_LATENT_CACHE:-default}" \
       "ONECARD_LATENT_CACHE_CHECK=${ONECARD_LATENT_CACHE_CHECK:-}" \
       "COSMOS_ATTN_BACKEND=$COSMOS_ATTN_BACKEND ONECARD_GPU_MEMORY_GIB=${ONECARD_GPU_MEMORY_GIB:-unset}"
  echo "== ffmpeg: $(command -v ffmpeg) ($(ffmpeg -version 2>/dev/null | head -1 || echo 'the Python stand-in'))"
  echo "== args: ${ONECARD_PROCESSOR_OVERRIDES[*]} $*"
  "$PYTHON" - <<'PY' 2>&1 || true
import importlib.metadata as md, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print("== python", __import__("sys").version.split()[0], "torch", torch.__version__, "|", gpu, "|",
      " ".join(f"{p} {md.version(p)}" for p in ("transformers", "huggingface_hub", "tokenizers", "diffusers")))
PY
} 2>&1 | tee "$LOG"

cd "$repo"
set +e
bash "$repo/launchers/sft_edge_24gb.sh" "${ONECARD_PROCESSOR_OVERRIDES[@]}" "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
echo "== exit status $status; log: $LOG" | tee -a "$LOG" >&2
exit "$status"
