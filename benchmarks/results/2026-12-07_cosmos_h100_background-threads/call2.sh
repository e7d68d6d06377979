#!/usr/bin/env bash
# Background threads capped or not, with and without the text K/V cache: four rows in one process.
set -u; START=$(date +%s); SCRATCH=${SCRATCH:-/tmp}; LIMIT=${LIMIT:-585}  # run with LIMIT=585
rm -rf $SCRATCH/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SCRATCH/site .whl/*.whl || exit 1
export PYTHONPATH=$SCRATCH/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
ulimit -l unlimited
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt; nproc >> $OUT/gpu.txt
python3 -c "
import torch, concurrent.futures as cf
from patches.core.threads import cap_this_thread, background_threads, _setters
print(torch.__config__.parallel_info().splitlines()[:4], len(_setters()), 'auto each', background_threads('auto', 3))
ex = cf.ThreadPoolExecutor(1, initializer=cap_this_thread, initargs=(4,))
print('capped worker', ex.submit(torch.get_num_threads).result(), 'main', torch.get_num_threads())" 2>&1 | tee -a $OUT/gpu.txt
R="all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached + lookup tables on the host + variable-length attention"
echo "rows start $(date -u +%FT%H:%M:%S)" >> $OUT/gpu.txt
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $(( LIMIT - 25 - ($(date +%s) - START) )) python3 benchmarks/edge_24gb.py --budget-gib 22.06 --steps 6 --warmup 3 --grad-accum 8 --only "$R + text K/V cache + background threads capped,$R + text K/V cache,$R + background threads capped,$R" --out $SCRATCH/s-rows > $SCRATCH/rows.log 2>&1
echo "rows rc=$? $(( $(date +%s) - START )) s" | tee -a $OUT/gpu.txt
grep -E "loss=|onecard: text K/V" $SCRATCH/rows.log | cut -c1-300 > $OUT/rows_losses.txt
grep "^{\"config\"" $SCRATCH/rows.log > $OUT/rows.jsonl; cp -r $SCRATCH/s-rows $OUT/ 2>/dev/null; tail -40 $SCRATCH/rows.log > $OUT/rows_tail.txt
python3 -c "
import json,statistics as st
for l in open('$OUT/rows.jsonl'):
    r=json.loads(l); m=r.get('micro_batch_s') or []; print(r['config'][-45:], r.get('s_per_micro_batch'), r.get('mfu'), 'mean', round(st.mean(m),4) if m else None, 'ema', r.get('ema_critical_path_s'), r.get('background_threads'))" 2>&1 | tail -4
echo "total $(( $(date +%s) - START )) s" >> $OUT/gpu.txt
