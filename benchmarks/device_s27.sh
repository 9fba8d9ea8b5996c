#!/usr/bin/env bash
# Session 26's waiting call, run in session 27 (kept as it ran: `dueling-wX` was removed after it). On the H200 only the issue-10 aims (hybrid Mixtral 16L batch 16,
# then batch 1: `device_s26.sh ... aims`); call again (`PART=rest`) for the rest. On any other GPU, most valuable
# first: the CUDA tests written after session 26's last call (slot-bank rounds at Qwen3 shapes, fp8 and NF4); the
# NF4 host expert in one call on the box's 14 threads (CPU only, ~1 min); the fp8 offload cases again (tiles above
# one token now split K 4 ways, a table point one copy); the fp8 and bf16 batch-1 steps per slot policy (promotions
# were 3.3 ms of the fp8 one; `dueling-wX` weighs them in the duel); the NF4 plan check (it now records the engine's
# calibration). Writes under $OUT. Each step gets at most its own limit and what is left of BUDGET seconds (skipped
# under 30, said on the call's output).
#
#   bash benchmarks/device_s27.sh COMMIT [BUDGET] [PART]     PART: auto (default) | rest
set -u
commit=${1:-unknown}
budget=${2:-560}
part=${3:-auto}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
h200_aims
t=$(left 130)
if [ "$t" -gt 60 ]; then
    bash benchmarks/gpu_tests.sh "$OUT/tests.txt" $(( t / 2 )) slot_bank_round $(( t / 2 )) test_fused_moe_decode.py
    grep -E "passed|failed|^E " "$OUT/tests.txt" | head -12
else
    echo "skipped (no time left): the CUDA tests"
fi
PYTHONPATH=. step 70 python benchmarks/bench_host_rowblocks.py --formats nf4 --experts 3 --tokens 1 4 --reps 5 \
    --threads 14 > "$OUT/host-rowblocks-nf4.txt" 2>&1; grep native "$OUT/host-rowblocks-nf4.txt"
(cd benchmarks && PYTHONPATH=.. step 170 python bench_offload.py --cases qwen3-30b-fp8,qwen3-30b --commit "$commit" \
    --out "$OUT/offload-s27-fp8.json" 2>&1 | grep -E "tok/s" | cut -c1-200 | tail -16)
echo "offload done at $(( $(date +%s) - t0 )) s"
# slot policies on the batch-1 step: the duel with promotions weighed 2-3 in-place reads (`dueling-wX`) against
# the plain duel and frequency alone, fp8 then bf16 (a policy to keep must not lose on either)
PYTHONPATH=benchmarks:. step 120 python benchmarks/profile_offload.py --experts gpu --expert-quant fp8-g128 --warm 64 \
    --variants dueling:now dueling-w2:now dueling-w3:now frequent:now 2>&1 | grep -E '^\{"experts"' | cut -c1-260 \
    | tee "$OUT/profile-fp8-variants.txt"
PYTHONPATH=benchmarks:. step 90 python benchmarks/profile_offload.py --experts gpu --warm 64 \
    --variants dueling:now dueling-w2:now frequent:now 2>&1 | grep -E '^\{"experts"' | cut -c1-260 \
    | tee "$OUT/profile-bf16-variants.txt"
echo "variants done at $(( $(date +%s) - t0 )) s"
PYTHONPATH=benchmarks:. step 200 python benchmarks/bench_plan.py --gpu local --cases moe-offload-nf4 \
    --case-timeout 190 --time-budget 195 --out "$OUT/plan-check-s27.json" 2>&1 | grep -v '^{' | tail -20
echo "all done at $(( $(date +%s) - t0 )) s"
