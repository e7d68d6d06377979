#!/usr/bin/env bash
# R against R + text K/V cache in one process; then the text K/V cache's CUDA tests and its 7 CUDA-only mutants.
set -u; START=$(date +%s); SCRATCH=${SCRATCH:-/tmp}; LIMIT=${LIMIT:-590}  # run with LIMIT=585
rm -rf $SCRATCH/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SCRATCH/site .whl/*.whl || exit 1
python3 -c "import pytest" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SCRATCH/site .whl/pt/*.whl
export PYTHONPATH=$SCRATCH/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
ulimit -l unlimited
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, diffusers, huggingface_hub; print(torch.__version__, diffusers.__version__, huggingface_hub.__version__)" | tee -a $OUT/gpu.txt
R="all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached + lookup tables on the host + variable-length attention"
echo "rows start $(date -u +%FT%H:%M:%S)" >> $OUT/gpu.txt
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout ${ROWS_S:-340} python3 benchmarks/edge_24gb.py --budget-gib 22.06 --steps 6 --warmup 3 --grad-accum 8 --only "$R,$R + text K/V cache" --out $SCRATCH/s-rows > $SCRATCH/rows.log 2>&1
echo "rows rc=$? $(( $(date +%s) - START )) s" | tee -a $OUT/gpu.txt
grep -E "loss=|onecard: text K/V" $SCRATCH/rows.log | cut -c1-300 > $OUT/rows_losses.txt
grep "^{\"config\"" $SCRATCH/rows.log > $OUT/rows.jsonl; cp -r $SCRATCH/s-rows $OUT/ 2>/dev/null; tail -40 $SCRATCH/rows.log > $OUT/rows_tail.txt
python3 -c "
import json
for l in open('$OUT/rows.jsonl'):
    r=json.loads(l); print(r['config'][-30:], r.get('s_per_micro_batch'), r.get('mfu'), r.get('pinned_allocator_measured'))" 2>&1 | tail -3
left=$(( LIMIT - 150 - ($(date +%s) - START) )); [ $left -gt 30 ] && { timeout $(( left < 80 ? left : 80 )) python3 -m pytest -q -s -p no:cacheprovider tests/equivalence/test_text_kv_cache.py -k cuda -W ignore 2>&1 | grep -v "^There are modules" | tail -25 > $OUT/textkv_cuda_tests.txt; echo "textkv tests rc=${PIPESTATUS[0]} $(( $(date +%s) - START )) s" | tee -a $OUT/gpu.txt; tail -3 $OUT/textkv_cuda_tests.txt; }
left=$(( LIMIT - ($(date +%s) - START) )); [ $left -gt 30 ] && { timeout $left python3 tests/mutation/run.py --cuda --no-baseline --jobs 1 --timeout 50 --only textkv-upload-on-the-compute-stream textkv-upload-without-record-stream ind6-prepass-peak-current-not-max ind6-upload-allocated-from-compute-pool textkv-upload-without-waiting textkv-stack-reads-before-the-copy-ends ind6-prepass-peak-not-reset > $OUT/cuda_mutants.txt 2>&1; echo "mutants rc=$? $(( $(date +%s) - START )) s" | tee -a $OUT/gpu.txt; tail -9 $OUT/cuda_mutants.txt; }
echo "total $(( $(date +%s) - START )) s" >> $OUT/gpu.txt
