#!/usr/bin/env bash
# Session 38's device call: (1) the CUDA tests of the shared slot pool (`expert_cache.SlotPool`: layers with no expert
# on the device copy through one pool of slots) and of the no-slot paths it changed; (2) the pool against the host on a
# bf16 8-layer Mixtral under 4 GiB (`bench_offload.py --cases pool8`: 2k prefill, batch 1 and 16); (3) on an H200
# with time left, the issue-10 aims (hybrid Mixtral 16L batch 16, then batch 1).
#   bash benchmarks/device_s47.sh COMMIT [BUDGET]   (~560 s)
set -u
commit=${1:-unknown}
budget=${2:-560}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu; $(lscpu | grep -m1 'Model name'); commit $commit"
bash benchmarks/gpu_tests.sh "$OUT/tests-s47.txt" "$(left 170)" "shared_pool or no_device_slots or without_room_for_slots"
grep -E "PASS|FAIL|passed|failed|^E |max \|logit" "$OUT/tests-s47.txt" | cut -c1-300 | head -24
echo "tests done at $(( $(date +%s) - t0 )) s"
(cd benchmarks && PYTHONPATH=.. step 260 python bench_offload.py --cases pool8 --commit "$commit" \
    --out "$OUT/offload-pool-s47.json" 2>&1 | grep -E "^pool|Error|error" | cut -c1-400 | tail -16)
echo "pool done at $(( $(date +%s) - t0 )) s"
if [[ $gpu == *H200* ]] && [ "$(left 400)" -ge 300 ]; then
    bash benchmarks/device_s26.sh "$commit" "$(left 540)" aims 2>&1 | tail -20
fi
echo "all done at $(( $(date +%s) - t0 )) s"
