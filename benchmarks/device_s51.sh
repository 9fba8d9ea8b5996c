#!/usr/bin/env bash
# Session 42's first call (s51: the scripts' own count) (docs/benchmarks.md, pending item 0): the CUDA tests of async scheduling on offloaded
# engines (device_s49.sh's), the native host-kernel tests (the box's Xeon has AVX512-BF16 and AMX; the dev box does
# not) with the new one-call-a-layer host experts (`host_native.experts_silu_bf16`), then that call against one call an
# expert on the Qwen3-30B-A3B shape (benchmarks/bench_host_batched.py), then the engine's Qwen3 hybrid case with it
# on and off (bench_offload.py hybrid-qwen3-30b, --one-call-an-expert).
#   bash benchmarks/device_s51.sh COMMIT [BUDGET] [PART]
# PART "first" (default, ~510 s): the tests, then bench_host_batched (bf16, NF4); "engine" (~560 s): the Qwen3 hybrid case batched,
# then one call an expert.
set -u
commit=${1:-unknown}
budget=${2:-570}
part=${3:-first}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, machine
machine
if [ "$part" = engine ]; then
    for flag in "" "--one-call-an-expert"; do
        (cd benchmarks && PYTHONPATH=.. step 275 python bench_offload.py --cases hybrid-qwen3-30b --commit "$commit" \
            $flag --out "$OUT/offload-hybrid-qwen3${flag:+-one-call}-s51.json" 2>&1 | grep -v '^{' | tail -8)
        echo "qwen3 hybrid ${flag:-batched} done at $(( $(date +%s) - t0 )) s"
    done
    exit 0
fi
bash benchmarks/gpu_tests.sh "$OUT/tests-s51.txt" 150 "test_host_native.py" 60 "test_hybrid.py::host_rows" \
    "$(left 150)" "offloaded_async_equals_sync or hybrid_share_tuner or offloaded_on_cuda_equals_resident or graph_decode_equals_eager"
grep -E "^[0-9]+ (passed|failed)|[0-9] (passed|failed|skipped)|FAILED|^E |async vs sync|Error|^=== " "$OUT/tests-s51.txt" \
    | grep -v "^PASSED\|^SKIPPED" | cut -c1-260 | tail -40
echo "tests done at $(( $(date +%s) - t0 )) s"
for fmt in bf16 nf4; do
    (cd benchmarks && PYTHONPATH=.. step 75 python bench_host_batched.py --format $fmt --threads 16 --commit "$commit" \
        --out "$OUT/host-batched-$fmt-s51.json" 2>&1 | grep -v '^{' | tail -6)
done
echo "host batched done at $(( $(date +%s) - t0 )) s"
echo "all done at $(( $(date +%s) - t0 )) s"
