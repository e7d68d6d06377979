#!/usr/bin/env bash
# The committed tree's capped cached row alone (the cap's probe, the pools' helper): does it run, and hold, on a GPU?
set -u; START=$(date +%s); SCRATCH=${SCRATCH:-/tmp}; LIMIT=${LIMIT:-280}  # run with LIMIT=280
rm -rf $SCRATCH/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SCRATCH/site .whl/*.whl || exit 1
export PYTHONPATH=$SCRATCH/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
ulimit -l unlimited
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt; git log --oneline -1 | tee -a $OUT/gpu.txt
R="all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached + lookup tables on the host + variable-length attention"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $(( LIMIT - 10 - ($(date +%s) - START) )) python3 benchmarks/edge_24gb.py --budget-gib 22.06 --steps 5 --warmup 3 --grad-accum 8 --only "$R + text K/V cache + background threads capped" --out $SCRATCH/s-rows > $SCRATCH/rows.log 2>&1
echo "rows rc=$? $(( $(date +%s) - START )) s" | tee -a $OUT/gpu.txt
grep "^{\"config\"" $SCRATCH/rows.log > $OUT/rows.jsonl; cp -r $SCRATCH/s-rows $OUT/ 2>/dev/null; tail -20 $SCRATCH/rows.log | cut -c1-1500 > $OUT/rows_tail.txt; grep -a "not applied\|error" $SCRATCH/rows.log | head -3
python3 -c "
import json,statistics as st
for l in open('$OUT/rows.jsonl'):
    r=json.loads(l); m=r.get('micro_batch_s') or []; print(r['config'][-45:], r.get('s_per_micro_batch'), r.get('mfu'), 'mean', round(st.mean(m),4) if m else None, 'bt', r.get('background_threads'), 'losses', r.get('losses'))" 2>&1 | tail -2
