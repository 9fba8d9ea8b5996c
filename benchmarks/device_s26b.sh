#!/usr/bin/env bash
# Session 26's second device call: why FP8 experts decode slower than bf16 at batch 1 in place (the first call:
# Qwen3-30B-A3B under 8 GiB, 25.5 against 37.8 tok/s; the engine's calibration read fp8 in place at 11.7 GB/s).
# The mixed-layer kernel benchmark under CUDA graphs per format, then a profile of the fp8 batch-1 step, then the
# bf16 decode-trace test (its expectation fixed). Writes under $OUT.
#
#   bash benchmarks/device_s26b.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-560}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step
echo "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); commit $commit"
PYTHONPATH=benchmarks:. step 200 python benchmarks/bench_mapped.py --mixed --budget-s 170 \
    --out "$OUT/mapped-mixed-graphed-s26.json" 2>&1 | grep -E "^qwen3|^mixtral|rror|failed" | tail -40
echo "mixed done at $(( $(date +%s) - t0 )) s"
PYTHONPATH=benchmarks:. step 150 python benchmarks/profile_offload.py --experts gpu --expert-quant fp8-g128 --warm 64 \
    --profile 2>&1 | tail -44 | tee "$OUT/profile-offload-fp8-s26.txt" | head -30
echo "profile done at $(( $(date +%s) - t0 )) s"
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" "$(left 80)" decode_trace
grep -E "passed|failed|^E " "$OUT/tests.txt" | head -8
echo "all done at $(( $(date +%s) - t0 )) s"
