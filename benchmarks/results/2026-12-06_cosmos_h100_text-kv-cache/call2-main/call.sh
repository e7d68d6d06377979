#!/usr/bin/env bash
# $SCRATCH: a scratch folder on the GPU machine (set it before running; the run used the machine's temporary folder).
# Call 30 (branch text-kv-cache, main + the text K/V cache): the two rows only.
set -u; START=$(date +%s)
rm -rf $SCRATCH/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SCRATCH/site .whl/*.whl || exit 1
export PYTHONPATH=$SCRATCH/site:$PWD/.carry/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
ulimit -l unlimited
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
R="all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached + lookup tables on the host + variable-length attention"
echo "rows start $(date -u +%H:%M:%S)" >> $OUT/gpu.txt
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 390 python3 benchmarks/edge_24gb.py --budget-gib 22.06 --steps 6 --warmup 3 --grad-accum 8 --only "$R,$R + text K/V cache" --out $SCRATCH/s-rows > $SCRATCH/rows.log 2>&1
echo "rows rc=$? $(( $(date +%s) - START )) s" | tee -a $OUT/gpu.txt
grep -E "loss=|onecard: text K/V" $SCRATCH/rows.log | cut -c1-300 > $OUT/rows_losses.txt
grep "^{\"config\"" $SCRATCH/rows.log > $OUT/rows.jsonl; cp $SCRATCH/s-rows/*.md $SCRATCH/s-rows/*.json $OUT/ 2>/dev/null; tail -40 $SCRATCH/rows.log > $OUT/rows_tail.txt
grep -o 'loss=[0-9.]*' $SCRATCH/rows.log | uniq > $OUT/losses.txt
grep "^| all" $SCRATCH/s-rows/*.md | cut -c1-400


echo "total $(( $(date +%s) - START )) s" >> $OUT/gpu.txt
