#!/usr/bin/env bash
# Session 25's device call: on the H200 the issue-10 aims first (hybrid Mixtral 16L batch 16, then batch 1);
# on another GPU the checks that do not need the H200 (nf4 select diagnosis, new CUDA tests, the plan's trace
# replay on the offloaded Qwen3 case, a profile of its batch-1 step). Writes under $OUT.
set -u
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
commit=${1:-unknown}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu; $(lscpu | grep -m1 'Model name')"
t0=$(date +%s)
if [[ $gpu == *H200* ]]; then
    (cd benchmarks && PYTHONPATH=.. timeout 290 python bench_offload.py --cases hybrid16-b16 --commit "$commit" \
        --out "$OUT/offload-s25-h200-b16.json" 2>&1 | grep -v '^{' | tail -12)
    echo "b16 done at $(( $(date +%s) - t0 )) s"
    (cd benchmarks && PYTHONPATH=.. timeout 210 python bench_offload.py --cases hybrid16-decode-quick --commit "$commit" \
        --out "$OUT/offload-s25-h200-b1.json" 2>&1 | grep -v '^{' | tail -12)
    echo "b1 done at $(( $(date +%s) - t0 )) s"
    PYTHONPATH=. timeout 50 python benchmarks/diag_nf4_select.py 2>&1 | tail -6
else
    PYTHONPATH=. timeout 60 python benchmarks/diag_nf4_select.py 2>&1 | tail -6
    bash benchmarks/gpu_tests.sh "$OUT/tests.txt" 110 decode_trace 110 test_fused_moe_decode.py
    grep -E "PASS|FAIL|passed|failed|^E " "$OUT/tests.txt" | head -24
    echo "tests done at $(( $(date +%s) - t0 )) s"
    PYTHONPATH=benchmarks:. timeout 200 python benchmarks/bench_plan.py --gpu local --cases moe-offload \
        --case-timeout 190 --time-budget 195 --out "$OUT/plan-check-s25.json" 2>&1 | grep -v '^{' | tail -24
    echo "plan done at $(( $(date +%s) - t0 )) s"
    left() { local t=$(( $1 - ($(date +%s) - t0) )); echo $(( t < 30 ? 30 : t )); }
    PYTHONPATH=benchmarks:. timeout "$(left 470)" python benchmarks/profile_offload.py --experts gpu \
        --warm 64 --profile 2>&1 | tail -48 | tee "$OUT/profile-offload-s25.txt" | tail -48
    PYTHONPATH=benchmarks:. timeout "$(left 570)" python benchmarks/profile_offload.py --experts gpu \
        --shape mixtral --layers 8 --budget-gib 5 --expert-quant nf4 --tokens 4 --prefill-tokens 512 --profile \
        2>&1 | grep -A20 "prefill of" | tee "$OUT/profile-prefill-nf4-s25.txt"
fi
echo "all done at $(( $(date +%s) - t0 )) s"
