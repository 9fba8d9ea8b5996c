#!/usr/bin/env bash
# Session 25's device call: on the H200 the issue-10 aims first (hybrid Mixtral 16L batch 16, then batch 1);
# on another GPU the checks that do not need the H200 (nf4 select diagnosis, new CUDA tests, the plan's trace
# replay on the offloaded Qwen3 case, profiles of that case's batch-1 step and of the NF4 Mixtral's prefill).
# Writes under $OUT. Each step gets at most its own limit and what is left of BUDGET seconds (skipped under 30).
#
#   bash benchmarks/device_s25.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-560}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu; $(lscpu | grep -m1 'Model name')"
if [[ $gpu == *H200* ]]; then
    (cd benchmarks && PYTHONPATH=.. step 290 python bench_offload.py --cases hybrid16-b16 --commit "$commit" \
        --out "$OUT/offload-s25-h200-b16.json" 2>&1 | grep -v '^{' | tail -12)
    echo "b16 done at $(( $(date +%s) - t0 )) s"
    (cd benchmarks && PYTHONPATH=.. step 210 python bench_offload.py --cases hybrid16-decode-quick --commit "$commit" \
        --out "$OUT/offload-s25-h200-b1.json" 2>&1 | grep -v '^{' | tail -12)
    echo "b1 done at $(( $(date +%s) - t0 )) s"
    PYTHONPATH=. step 50 python benchmarks/diag_nf4_select.py 2>&1 | tail -6
else
    PYTHONPATH=. step 60 python benchmarks/diag_nf4_select.py 2>&1 | tail -6
    t=$(left 230)
    if [ "$t" -gt 60 ]; then
        bash benchmarks/gpu_tests.sh "$OUT/tests.txt" $(( t / 2 )) decode_trace $(( t / 2 )) test_fused_moe_decode.py
        grep -E "PASS|FAIL|passed|failed|^E " "$OUT/tests.txt" | head -24
    fi
    echo "tests done at $(( $(date +%s) - t0 )) s"
    PYTHONPATH=benchmarks:. step 200 python benchmarks/bench_plan.py --gpu local --cases moe-offload \
        --case-timeout 190 --time-budget 195 --out "$OUT/plan-check-s25.json" 2>&1 | grep -v '^{' | tail -24
    echo "plan done at $(( $(date +%s) - t0 )) s"
    PYTHONPATH=benchmarks:. step 120 python benchmarks/profile_offload.py --experts gpu --warm 64 --profile 2>&1 \
        | tail -48 | tee "$OUT/profile-offload-s25.txt"
    PYTHONPATH=benchmarks:. step 120 python benchmarks/profile_offload.py --experts gpu --shape mixtral --layers 8 \
        --budget-gib 5 --expert-quant nf4 --tokens 4 --prefill-tokens 512 --profile 2>&1 \
        | grep -A20 "prefill of" | tee "$OUT/profile-prefill-nf4-s25.txt"
fi
echo "all done at $(( $(date +%s) - t0 )) s"
