#!/usr/bin/env bash
# Session 41's first call: the CUDA tests of async scheduling on offloaded engines (device_s49.sh's first step),
# then on an H200 the issue-10 aims as served (now async: device_s26.sh aims), on an H100 the rest of
# device_s49.sh (the corrected A/B, the 16-layer bf16 batch-1 case).
#   bash benchmarks/device_s50.sh COMMIT [BUDGET]   (~570 s)
set -u
commit=${1:-unknown}
budget=${2:-570}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, machine
machine
bash benchmarks/gpu_tests.sh "$OUT/tests-s50.txt" "$(left 170)" \
    "offloaded_async_equals_sync or hybrid_share_tuner or offloaded_on_cuda_equals_resident or graph_decode_equals_eager"
grep -E "passed|FAILED|^E |async vs sync" "$OUT/tests-s50.txt" | cut -c1-260 | head -24
echo "tests done at $(( $(date +%s) - t0 )) s"
if [[ $gpu == *H200* ]]; then
    bash benchmarks/device_s26.sh "$commit" "$(left 560)" aims
else
    bash benchmarks/device_s49.sh "$commit" "$(left 560)" skip-tests
fi
echo "all done at $(( $(date +%s) - t0 )) s"
