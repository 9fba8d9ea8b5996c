#!/usr/bin/env bash
# Session 26's third device call: fp8 experts on the decode kernel's fp8 tiles at <= 32 tokens. The offload cases
# (bf16 baseline in the same call), then the CUDA tests that cover fp8 banks. Writes under $OUT.
#
#   bash benchmarks/device_s26c.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-500}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step
echo "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); commit $commit"
(cd benchmarks && PYTHONPATH=.. step 280 python bench_offload.py --cases qwen3-30b-fp8,qwen3-30b,hybrid-qwen3-30b-fp8 \
    --commit "$commit" --out "$OUT/offload-s26-fp8-decode.json" 2>&1 | grep -E "tok/s|hybrid|calibrated" | cut -c1-400 | tail -24)
echo "offload done at $(( $(date +%s) - t0 )) s"
t=$(left 200)
if [ "$t" -gt 60 ]; then
    bash benchmarks/gpu_tests.sh "$OUT/tests.txt" $(( t * 2 / 5 )) test_fused_moe_decode.py $(( t * 3 / 5 )) "fp8 or packed_experts"
    grep -E "PASS|FAIL|passed|failed|^E " "$OUT/tests.txt" | head -30
fi
echo "all done at $(( $(date +%s) - t0 )) s"
