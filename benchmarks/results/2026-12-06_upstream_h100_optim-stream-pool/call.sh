#!/usr/bin/env bash
# $SCRATCH: a scratch folder on the GPU machine (set it before running; the run used the machine's temporary folder).
# Call 31 (branch optim-stream-pool): the optimizer-state CUDA tests and their 3 CUDA-only mutants, one at a time
# (packages from upstream's wheelhouse); then upstream's trainer with COSMOS_OPTIM_STATE_OFFLOAD=1 (the memtest recipe,
# every patch, the detached text stream), stopped after 16 training_step calls.
set -u; START=$(date +%s)
rm -rf $SCRATCH/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SCRATCH/site .carry/upwhl/*.whl > $OUT/pip.txt 2>&1 || echo "pip rc=$?" >> $OUT/pip.txt
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
( export PYTHONPATH=$SCRATCH/site:$PWD/.carry/site:$PWD PYTHONUNBUFFERED=1
  timeout 100 python3 -m pytest -q -s -p no:cacheprovider tests/equivalence/test_optim_offload.py -k cuda 2>&1 | grep -v "Warning\|warn\|^  \|^W1" | tail -25 > $OUT/optim_cuda_tests.txt; echo "optim tests rc=${PIPESTATUS[0]} $(( $(date +%s) - START )) s" | tee -a $OUT/gpu.txt
  tail -3 $OUT/optim_cuda_tests.txt
  timeout 150 python3 tests/mutation/run.py --cuda --no-baseline --jobs 1 --only optim-buffers-on-the-copy-stream optim-copy-without-waiting optim-no-room-wait > $OUT/optim_cuda_mutants.txt 2>&1; echo "mutants rc=$? $(( $(date +%s) - START )) s" | tee -a $OUT/gpu.txt
  tail -5 $OUT/optim_cuda_mutants.txt )
export PYTHONPATH=$PWD/.carry/site PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
lim=$(( 590 - ($(date +%s) - START) )); t0=$(date +%s)
env ASSET_ARGS="--tokenizer wordpiece --captions standin" ONECARD_GPU_MEMORY_GIB=22.06 ONECARD_MEMCAP_STEPS=1 \
  ONECARD_MEMCAP_STOP_AFTER=16 ONECARD_MEMCAP_EVERY_S=15 MEMTEST=1 COSMOS_EMA_CPU_SUBSET=1 COSMOS_VAE_CPU_OFFLOAD=1 \
  COSMOS_OPTIM_STATE_OFFLOAD=1 COSMOS_FROZEN_BF16=1 COSMOS_LATENT_CACHE=1 ONECARD_LATENT_CACHE=$SCRATCH/latents \
  COSMOS_DETACH_TEXT_STREAM=1 LOG=$OUT/up.log OUTPUT_ROOT=$SCRATCH/out-up COSMOS_FRAMEWORK_ROOT=.carry/cf \
  timeout $lim bash benchmarks/upstream/run_upstream.sh $SCRATCH/assets .carry/upwhl trainer.max_iter=30 2>&1 | tail -40 > $OUT/up.out
echo "upstream rc=${PIPESTATUS[0]} $(( $(date +%s) - t0 )) s (limit $lim)" | tee -a $OUT/gpu.txt
PYTHONPATH=$PWD python3 benchmarks/upstream/steps.py $OUT/up.log --json $OUT/up-steps.json > $OUT/up-steps.txt 2>&1
tail -8 $OUT/up-steps.txt; grep -E "onecard memcap|patched:|Traceback|Error|error:" $OUT/up.log | cut -c1-400 | tail -8
echo "total $(( $(date +%s) - START )) s" >> $OUT/gpu.txt
