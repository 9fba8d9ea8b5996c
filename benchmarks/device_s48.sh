#!/usr/bin/env bash
# Session 38's second device call: the shared slot pool's CUDA tests after the review (the one-slot pool, tables
# never on the pool, mapped decode with large experts as they are) and the no-slot test's flip row; then the pool
# against the host on the 16-layer bf16 Mixtral under 8 GiB (`bench_offload.py --cases pool16`); then the plan checked
# on the 8-layer one under 4 GiB (`bench_plan.py --cases moe-pool-bf16`).
#   bash benchmarks/device_s48.sh COMMIT [BUDGET]   (~560 s)
set -u
commit=${1:-unknown}
budget=${2:-480}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu; $(lscpu | grep -m1 'Model name'); commit $commit"
bash benchmarks/gpu_tests.sh "$OUT/tests-s48.txt" "$(left 150)" "shared_pool or without_room_for_slots or dropped_offloaded"
grep -E "passed|FAILED|^E |max \|logit" "$OUT/tests-s48.txt" | cut -c1-260 | head -24
echo "tests done at $(( $(date +%s) - t0 )) s"
(cd benchmarks && PYTHONPATH=.. step 280 python bench_offload.py --cases pool16 --commit "$commit" \
    --out "$OUT/offload-pool16-s48.json" 2>&1 | grep -E "^pool|Error|error" | cut -c1-330 | tail -16)
echo "pool16 done at $(( $(date +%s) - t0 )) s"
PYTHONPATH=benchmarks:. step 130 python benchmarks/bench_plan.py --gpu local --cases moe-pool-bf16 \
    --case-timeout 125 --time-budget "$(left 125)" --out "$OUT/plan-check-pool-s48.json" 2>&1 \
    | grep -v '^{' | grep -E "^  [a-z_]|^moe" | grep -E "%|^moe" | cut -c1-220 | tail -20
echo "all done at $(( $(date +%s) - t0 )) s"
