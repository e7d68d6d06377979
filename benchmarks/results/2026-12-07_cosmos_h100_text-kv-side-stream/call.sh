#!/usr/bin/env bash
# $SCRATCH: a scratch folder on the GPU machine (the run used the machine's temporary folder).
# R against R + text K/V cache (side-stream copy), one process; then the CUDA tests of the text K/V cache and of the
# optimizer-state streaming.
set -u; START=$(date +%s); : "${SCRATCH:?set SCRATCH to a scratch folder}"
rm -rf $SCRATCH/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SCRATCH/site .whl/*.whl || exit 1
python3 -c "import pytest" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SCRATCH/site .whl/pt/*.whl
export PYTHONPATH=$SCRATCH/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
ulimit -l unlimited
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, diffusers, huggingface_hub; print(torch.__version__, diffusers.__version__, huggingface_hub.__version__)" | tee -a $OUT/gpu.txt
R="all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached + lookup tables on the host + variable-length attention"
echo "rows start $(date -u +%FT%H:%M:%S)" >> $OUT/gpu.txt
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 330 python3 benchmarks/edge_24gb.py --budget-gib 22.06 --steps 6 --warmup 3 --grad-accum 8 --only "$R,$R + text K/V cache" --out $SCRATCH/s-rows > $SCRATCH/rows.log 2>&1
echo "rows rc=$? $(( $(date +%s) - START )) s" | tee -a $OUT/gpu.txt
grep -E "loss=|onecard: text K/V" $SCRATCH/rows.log | cut -c1-300 > $OUT/rows_losses.txt
grep "^{\"config\"" $SCRATCH/rows.log > $OUT/rows.jsonl; cp $SCRATCH/s-rows/*.md $SCRATCH/s-rows/*.json $OUT/ 2>/dev/null; tail -40 $SCRATCH/rows.log > $OUT/rows_tail.txt
grep "^| all" $SCRATCH/s-rows/*.md | cut -c1-400
left=$(( 580 - ($(date +%s) - START) )); [ $left -gt 60 ] && { timeout $(( left < 100 ? left : 100 )) python3 -m pytest -q -s -p no:cacheprovider tests/equivalence/test_text_kv_cache.py -k cuda 2>&1 | grep -v "Warning\|warn\|^  \|^W1" | tail -25 > $OUT/textkv_cuda_tests.txt; echo "textkv tests rc=${PIPESTATUS[0]} $(( $(date +%s) - START )) s" | tee -a $OUT/gpu.txt; tail -3 $OUT/textkv_cuda_tests.txt; }
left=$(( 585 - ($(date +%s) - START) )); [ $left -gt 40 ] && { timeout $(( left < 100 ? left : 100 )) python3 -m pytest -q -s -p no:cacheprovider tests/equivalence/test_optim_offload.py -k cuda 2>&1 | grep -v "Warning\|warn\|^  \|^W1" | tail -25 > $OUT/optim_cuda_tests.txt; echo "optim tests rc=${PIPESTATUS[0]} $(( $(date +%s) - START )) s" | tee -a $OUT/gpu.txt; tail -3 $OUT/optim_cuda_tests.txt; }
left=$(( 590 - ($(date +%s) - START) )); [ $left -gt 60 ] && { timeout $left python3 tests/mutation/run.py --cuda --no-baseline --jobs 4 --timeout 200 --only textkv-upload-on-the-compute-stream textkv-upload-without-waiting textkv-upload-without-record-stream textkv-stack-reads-before-the-copy-ends ind6-prepass-peak-not-reset ind6-prepass-peak-current-not-max ind6-upload-allocated-from-compute-pool optim-buffers-on-the-copy-stream optim-copy-without-waiting optim-no-room-wait > $OUT/cuda_mutants.txt 2>&1; echo "mutants rc=$? $(( $(date +%s) - START )) s" | tee -a $OUT/gpu.txt; tail -12 $OUT/cuda_mutants.txt; }
echo "total $(( $(date +%s) - START )) s" >> $OUT/gpu.txt
