#!/usr/bin/env bash
# Session 26's device call. On the H200 the issue-10 aims first (hybrid Mixtral 16L batch 16, then batch 1). On any
# GPU then: the CUDA tests written after the last run (bf16 decode trace, the NF4 select test), the NF4 Mixtral's
# prefill profile and plan check (copy rounds without count read-backs), then the FP8 offload cases.
# Writes under $OUT. Each step gets at most its own limit and what is left of BUDGET seconds (skipped under 30).
#
#   bash benchmarks/device_s26.sh COMMIT [BUDGET] [PARTS]
# PARTS (default "aims checks fp8"): aims (H200 only; on any GPU with ANY_GPU=1), checks (tests, the mixed in-place layer, NF4 prefill), fp8.
set -u
commit=${1:-unknown}
budget=${2:-560}
parts=${3:-aims checks fp8}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu; $(lscpu | grep -m1 'Model name')"
if [[ ($gpu == *H200* || ${ANY_GPU:-} == 1) && $parts == *aims* ]]; then
    (cd benchmarks && PYTHONPATH=.. step 290 python bench_offload.py --cases hybrid16-b16 --commit "$commit" \
        --out "$OUT/offload-s26-h200-b16.json" 2>&1 | grep -v '^{' | tail -12)
    echo "b16 done at $(( $(date +%s) - t0 )) s"
    (cd benchmarks && PYTHONPATH=.. step 210 python bench_offload.py --cases hybrid16-decode-quick --commit "$commit" \
        --out "$OUT/offload-s26-h200-b1.json" 2>&1 | grep -v '^{' | tail -12)
    echo "b1 done at $(( $(date +%s) - t0 )) s"
fi
if [[ $parts == *checks* ]]; then
PYTHONPATH=benchmarks:. step 150 python benchmarks/bench_mapped.py --mixed --budget-s 100 \
    --out "$OUT/mapped-mixed-s26.json" 2>&1 | grep -E "^qwen3|^mixtral|Error|error" | tail -16
echo "mixed done at $(( $(date +%s) - t0 )) s"
t=$(left 200)
if [ "$t" -gt 60 ]; then
    bash benchmarks/gpu_tests.sh "$OUT/tests.txt" $(( t * 2 / 5 )) decode_trace $(( t * 3 / 5 )) test_fused_moe_decode.py
    grep -E "PASS|FAIL|passed|failed|^E " "$OUT/tests.txt" | head -24
fi
echo "tests done at $(( $(date +%s) - t0 )) s"
PYTHONPATH=benchmarks:. step 120 python benchmarks/profile_offload.py --experts gpu --shape mixtral --layers 8 \
    --budget-gib 5 --expert-quant nf4 --tokens 4 --prefill-tokens 512 --profile 2>&1 \
    | grep -A24 "prefill of" | tee "$OUT/profile-prefill-nf4-s26.txt"
echo "profile done at $(( $(date +%s) - t0 )) s"
PYTHONPATH=benchmarks:. step 200 python benchmarks/bench_plan.py --gpu local --cases moe-offload-nf4 \
    --case-timeout 190 --time-budget 195 --out "$OUT/plan-check-s26.json" 2>&1 | grep -v '^{' | tail -24
echo "plan done at $(( $(date +%s) - t0 )) s"
fi
[[ $parts == *fp8* ]] && \
(cd benchmarks && PYTHONPATH=.. step 300 python bench_offload.py --cases qwen3-30b,qwen3-30b-fp8,hybrid-qwen3-30b-fp8 \
    --commit "$commit" --out "$OUT/offload-s26-fp8.json" 2>&1 | grep -v '^{' | tail -16)
echo "all done at $(( $(date +%s) - t0 )) s"
