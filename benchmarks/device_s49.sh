#!/usr/bin/env bash
# Sessions 40-41's pending call (docs/benchmarks.md, pending item 0): async scheduling, on by default for offloaded
# CUDA engines since 672f198, first its CUDA tests (the offloaded roads against the synchronous loop, the graphed
# share tuner applying shares with a step in flight, offloaded = resident). Then on an H200 the issue-10 aims as
# served (`device_s26.sh ... aims`); on any other GPU the A/B again with the corrected window (8c125bb), NF4 then
# bf16, then the 16-layer bf16 batch-1 case as served (now async).
#   bash benchmarks/device_s49.sh COMMIT [BUDGET]   (~570 s; with ~200 s, the tests alone)
set -u
commit=${1:-unknown}
budget=${2:-570}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, machine
machine
bash benchmarks/gpu_tests.sh "$OUT/tests-s49.txt" "$(left 170)" \
    "offloaded_async_equals_sync or hybrid_share_tuner or offloaded_on_cuda_equals_resident or graph_decode_equals_eager"
grep -E "passed|FAILED|^E |async vs sync" "$OUT/tests-s49.txt" | cut -c1-260 | head -24
echo "tests done at $(( $(date +%s) - t0 )) s"
if [[ $gpu == *H200* ]]; then
    bash benchmarks/device_s26.sh "$commit" "$(left 560)" aims
    echo "all done at $(( $(date +%s) - t0 )) s"
    exit 0
fi
for q in "nf4 5 150" "none 8 170"; do
    set -- $q
    (cd benchmarks && PYTHONPATH=.. step "$3" python ab_async_offload.py --layers 8 --expert-quant "$1" --budget-gib "$2" \
        --experts gpu auto --batches 1 16 --rounds 3 --commit "$commit" --out "$OUT/ab-async-$1-s49.json" 2>&1 \
        | grep -E "mean|Error|error" | tail -10)
    echo "A/B $1 done at $(( $(date +%s) - t0 )) s"
done
(cd benchmarks && PYTHONPATH=.. step 210 python bench_offload.py --cases hybrid16-decode-quick --commit "$commit" \
    --out "$OUT/offload-hybrid16-b1-s49.json" 2>&1 | grep -v '^{' | tail -12)
echo "all done at $(( $(date +%s) - t0 )) s"
