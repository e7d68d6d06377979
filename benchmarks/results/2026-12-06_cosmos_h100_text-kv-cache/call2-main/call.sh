#!/usr/bin/env bash
# Call 30 (branch text-kv-cache, main + the text K/V cache): the two rows only.
set -u; START=$(date +%s)
rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.carry/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
ulimit -l unlimited
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
R="all levers + optimizer-state streaming + selective AC + fewer checkpointed layers + text stream detached + lookup tables on the host + variable-length attention"
echo "rows start $(date -u +%H:%M:%S)" >> $OUT/gpu.txt
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 390 python3 benchmarks/edge_24gb.py --budget-gib 22.06 --steps 6 --warmup 3 --grad-accum 8 --only "$R,$R + text K/V cache" --out /tmp/s-rows > /tmp/rows.log 2>&1
echo "rows rc=$? $(( $(date +%s) - START )) s" | tee -a $OUT/gpu.txt
grep -E "loss=|onecard: text K/V" /tmp/rows.log | cut -c1-300 > $OUT/rows_losses.txt
grep "^{\"config\"" /tmp/rows.log > $OUT/rows.jsonl; cp /tmp/s-rows/*.md /tmp/s-rows/*.json $OUT/ 2>/dev/null; tail -40 /tmp/rows.log > $OUT/rows_tail.txt
grep -o 'loss=[0-9.]*' /tmp/rows.log | uniq > $OUT/losses.txt
grep "^| all" /tmp/s-rows/*.md | cut -c1-400


echo "total $(( $(date +%s) - START )) s" >> $OUT/gpu.txt
