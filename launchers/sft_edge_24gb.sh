#!/usr/bin/env bash
# Cosmos3-Edge vision SFT on ONE 24 GB GPU (the 8xH100 recipe vision_sft_edge, same effective batch).
#
#   COSMOS_EMA_CPU_SUBSET=1 COSMOS_VAE_CPU_OFFLOAD=1 bash launchers/sft_edge_24gb.sh [trainer args]
#
# Recipe:  default  toml/vision_sft_edge_24gb.toml          (cap 12288, grad_accum_iter 61, EMA on)
#          MEMTEST=1 toml/vision_sft_edge_24gb_memtest.toml (grad_accum_iter 2, EMA off: memory smoke)
#          EMAVAL=1  toml/vision_sft_edge_24gb_emaval.toml  (cap 6144, grad_accum_iter 2, EMA on)
# DRYRUN=1 prints the memory ledger (meta device, nothing allocated) against BUDGET_GIB (default 22.06)
# and exits: 0 fits, 1 does not fit.
# Reads, like upstream's launchers: NPROC_PER_NODE (default 1), MASTER_PORT (unset: a free port on a
# one-node run, 50012 with NNODES > 1; set: refused when taken on node 0), NNODES (1), NODE_RANK (0),
# MASTER_ADDR (127.0.0.1), DATASET_PATH,
# BASE_CHECKPOINT_PATH, WAN_VAE_PATH, OUTPUT_ROOT.
# Without COSMOS_FRAMEWORK_ROOT the embedded reference trainer runs (tiny preset on a machine without a
# GPU, the full edge preset on a GPU). Trailing arguments go to the trainer (e.g. --max-iter 3).
# With COSMOS_FRAMEWORK_ROOT (a cosmos-framework checkout at ed8287f or 5eee9ed) upstream's trainer runs,
# patched in every rank; TAIL_OVERRIDES and trailing arguments are passed as Hydra overrides.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"

as_bool() {  # as_bool NAME VALUE -> prints 1 or 0, or fails with one clear line
  # Surrounding spaces are ignored, as patches/core/flags.py reads every COSMOS_* flag (" 1" is 1 there too).
  local v="${2,,}"
  v="${v#"${v%%[![:space:]]*}"}"; v="${v%"${v##*[![:space:]]}"}"
  case "$v" in
    1|true|yes) echo 1 ;;
    0|false|no|"") echo 0 ;;
    *) echo "error: $1='$2' is not a boolean: set it to one of 1/0/true/false/yes/no, or unset it" >&2; return 2 ;;
  esac
}
memtest="$(as_bool MEMTEST "${MEMTEST:-}")" || exit 2
emaval="$(as_bool EMAVAL "${EMAVAL:-}")" || exit 2
dryrun="$(as_bool DRYRUN "${DRYRUN:-}")" || exit 2
if [[ "$memtest" == 1 && "$emaval" == 1 ]]; then
  echo "error: MEMTEST=1 and EMAVAL=1 select different recipes: set only one" >&2
  exit 2
fi
toml="$here/toml/vision_sft_edge_24gb.toml"
[[ "$memtest" == 1 ]] && toml="$here/toml/vision_sft_edge_24gb_memtest.toml"
[[ "$emaval" == 1 ]] && toml="$here/toml/vision_sft_edge_24gb_emaval.toml"
TOML_FILE="${TOML_FILE:-$toml}"

# Upstream's trainer is what runs with COSMOS_FRAMEWORK_ROOT (torchrun -m patches.run cosmos_framework.scripts.train):
# a folder without that file is refused here, in one line, before anything is written.
if [[ -n "${COSMOS_FRAMEWORK_ROOT:-}" && ! -f "${COSMOS_FRAMEWORK_ROOT}/cosmos_framework/scripts/train.py" ]]; then
  echo "error: COSMOS_FRAMEWORK_ROOT=${COSMOS_FRAMEWORK_ROOT} is not a cosmos-framework checkout (no cosmos_framework/scripts/train.py in it): point it at the folder that holds cosmos_framework/, or unset it to run the embedded reference trainer" >&2
  exit 2
fi

count() {  # count NAME VALUE MIN MAX WHAT -> prints VALUE as a decimal number, or fails with one clear line
  # Plain ASCII digits only (no sign, spaces or exponent; "08" is 8, not octal), as patches.core.flags.whole_number.
  local n="$2"
  case "$n" in ""|*[!0123456789]*) n="" ;; esac
  if [[ -n "$n" ]]; then
    n="${n#"${n%%[!0]*}"}"; n="${n:-0}"  # leading zeros off: no octal, and the length below is the magnitude
    if (( ${#n} <= 9 && n >= $3 && n <= $4 )); then echo "$n"; return 0; fi
  fi
  local shown="$2"
  [[ -n "$2" && "$2" != *[[:space:]]* ]] || shown="'$2'"  # quoted only where spaces would hide in the line
  echo "error: $1=$shown is not a whole number from $3 to $4 ($5): give plain digits in that range" >&2
  return 2
}
nproc="$(count NPROC_PER_NODE "${NPROC_PER_NODE:-1}" 1 1024 "ranks on this node")" || exit 2
nnodes="$(count NNODES "${NNODES:-1}" 1 1024 "nodes")" || exit 2
node_rank="$(count NODE_RANK "${NODE_RANK:-0}" 0 "$(( nnodes - 1 ))" "this node's rank, below NNODES=$nnodes")" || exit 2
if [[ -n "${MASTER_PORT:-}" ]]; then
  MASTER_PORT="$(count MASTER_PORT "$MASTER_PORT" 1 65535 "a TCP port; unset it for a free one")" || exit 2
fi
if [[ "$dryrun" == 1 ]]; then
  exec "$PYTHON" -m patches.ledger --toml "$TOML_FILE" --world-size "$(( nproc * nnodes ))"
fi

if [[ -z "${MASTER_PORT:-}" ]]; then
  # One node: any free port, so that runs side by side (parallel tests) do not collide. Several nodes must
  # agree on the port: keep upstream's fixed default there.
  if [[ "$nnodes" == 1 ]]; then
    MASTER_PORT="$(cd "$here" && "$PYTHON" -m patches.core.ports free)"
  else
    MASTER_PORT=50012
  fi
elif [[ "$node_rank" == 0 ]]; then
  # A port given explicitly must be free where the rendezvous listens (node 0): one line now, not a torchrun
  # traceback after the ranks start.
  (cd "$here" && "$PYTHON" -m patches.core.ports check MASTER_PORT "$MASTER_PORT") || exit 2
fi

export DATASET_PATH="${DATASET_PATH:-}" BASE_CHECKPOINT_PATH="${BASE_CHECKPOINT_PATH:-}" WAN_VAE_PATH="${WAN_VAE_PATH:-}"
export OUTPUT_ROOT="${OUTPUT_ROOT:-outputs/train}"
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"  # less allocator slack

if [[ -n "${COSMOS_FRAMEWORK_ROOT:-}" ]]; then
  # The user's upstream checkout: its own trainer, every rank started through patches.run so that the
  # lever patches are applied before upstream code runs. The [onecard] table is dropped from the TOML
  # (upstream's schema forbids unknown keys); TAIL_OVERRIDES and trailing arguments become Hydra overrides.
  export PYTHONPATH="${COSMOS_FRAMEWORK_ROOT}:${here}${PYTHONPATH:+:$PYTHONPATH}"
  "$PYTHON" -m patches check >/dev/null || exit 2  # flags + targets, one error line; writes nothing
  # The TOML copy is made in a private staging folder first (a bad recipe is one error line and nothing in
  # OUTPUT_ROOT), then put beside the run under a name that holds its content's hash: the same recipe always
  # gives the same file (a rerun replaces it, nothing piles up), and `exec torchrun` below keeps every signal
  # (TERM from a scheduler or `timeout`, Ctrl-C) going straight to torchrun, as it always has.
  staging="$(mktemp -d)"
  trap 'rm -rf "$staging"' EXIT
  name=".onecard-$(basename "$TOML_FILE" .toml)"
  "$PYTHON" -m cosmos_framework_ext.recipe.config upstream-toml "$TOML_FILE" "$staging/$name.toml" || exit 2
  if ! mkdir -p "$OUTPUT_ROOT" 2>/dev/null || [[ ! -w "$OUTPUT_ROOT" ]]; then
    echo "error: OUTPUT_ROOT=$OUTPUT_ROOT cannot be created or written: point it at a folder you can write" >&2
    exit 2
  fi
  OUTPUT_ROOT="$(cd "$OUTPUT_ROOT" && pwd)"  # absolute: upstream's trainer runs in COSMOS_FRAMEWORK_ROOT
  export IMAGINAIRE_OUTPUT_ROOT="${IMAGINAIRE_OUTPUT_ROOT:-$OUTPUT_ROOT}"
  digest="$("$PYTHON" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest()[:12])' \
    "$staging/$name.toml")" || exit 2
  upstream_toml="$OUTPUT_ROOT/$name-$digest.toml"
  # copied next to its final name, then renamed (one file system): a run starting beside this one reads it whole
  cp "$staging/$name.toml" "$upstream_toml.$$" && mv -f "$upstream_toml.$$" "$upstream_toml" || exit 2
  rm -rf "$staging"
  trap - EXIT
  read -r -a overrides <<< "${TAIL_OVERRIDES:-}"
  trainer_flags=()
  for a in "$@"; do  # --flags (e.g. --dryrun) go to upstream's train.py, the rest are Hydra overrides
    if [[ "$a" == --* ]]; then trainer_flags+=("$a"); else overrides+=("$a"); fi
  done
  cd "$COSMOS_FRAMEWORK_ROOT"
  exec "$PYTHON" -m torch.distributed.run \
    --nproc_per_node="$nproc" --nnodes="$nnodes" --node_rank="$node_rank" \
    --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="$MASTER_PORT" \
    -m patches.run cosmos_framework.scripts.train --sft-toml="$upstream_toml" \
    ${trainer_flags[@]+"${trainer_flags[@]}"} ${overrides[@]+-- "${overrides[@]}"}
fi

train=(-m cosmos_framework_ext.recipe.train --sft-toml="$TOML_FILE" "$@")
# Check every input once in this process first (prints the memory ledger): the TOML, flags and paths,
# OUTPUT_ROOT writable, BASE_CHECKPOINT_PATH's header, WAN_VAE_PATH's config, every dataset row and video, and
# a resume's settings against the checkpoint's. Bad input then ends with the trainer's one error line and exit
# status 2, with nothing written, before torchrun wraps anything in its report.
echo "onecard: checking every input before the run starts (TOML, flags, paths, dataset rows and videos, output" \
     "folder; a first run also prepares the sample dataset) ..."
"$PYTHON" "${train[@]}" --validate-only >/dev/null || exit $?
echo "onecard: inputs OK; starting the trainer"
if [[ "$nproc" == 1 && "$nnodes" == 1 ]]; then
  # One process: no torchrun around it, so an error found only now (say, another run took the output
  # folder's lock after the check above) is still one error line and exit status 2, with no torchrun report.
  exec "$PYTHON" "${train[@]}" --videos-checked
fi
exec "$PYTHON" -m torch.distributed.run \
  --nproc_per_node="$nproc" --nnodes="$nnodes" --node_rank="$node_rank" \
  --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="$MASTER_PORT" \
  "${train[@]}" --videos-checked
