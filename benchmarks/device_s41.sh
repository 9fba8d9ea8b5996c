#!/usr/bin/env bash
# Session 32's short call (ten starts failed; little budget left): the most telling parts of device_s38.sh and
# device_s39.sh. The CUDA tests of `decode_experts`' 4-bit kernel; `decode_experts` alone by tile (TB/s); where the
# hybrid batch-1 decode step of the 8-layer NF4 Mixtral under 5 GiB goes (`profile_offload.py --profile`); the plan
# checks of the NF4 Mixtral offloaded and resident (session 32's `estimate.DEQUANT_GBS`: the prefill replayed +25%).
#   bash benchmarks/device_s41.sh COMMIT [BUDGET]; PART=short (~350 s of budget): the tests and the sweep alone
set -u
commit=${1:-unknown}
budget=${2:-420}
part=rest  # no issue-10 aims in this call, whatever the GPU
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
h200_aims
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" 90 "test_fused_moe_formats.py::decoded_experts or packed_experts_equal"
grep -E "passed|failed|^E |assert" "$OUT/tests.txt" | grep -v "^\[.*passed" | head -12
PYTHONPATH=. step 60 python benchmarks/bench_decode_experts.py 2>&1 | tail -7
echo "decode done at $(( $(date +%s) - t0 )) s"
[ "${PART:-}" = short ] && exit 0
(cd benchmarks && PYTHONPATH=.. step 150 python profile_offload.py --shape mixtral --layers 8 --budget-gib 5 \
    --expert-quant nf4 --experts auto gpu --tokens 16 --profile > "$OUT/profile-hybrid-b1.txt" 2>&1)
grep -v '^{' "$OUT/profile-hybrid-b1.txt" | grep -vE "^\s*$|Warning|warn" | cut -c1-160 | head -70
echo "profile done at $(( $(date +%s) - t0 )) s"
PYTHONPATH=benchmarks:. step 120 python benchmarks/bench_plan.py --gpu local --cases moe-offload-nf4 moe-nf4 \
    --case-timeout 60 --time-budget "$(left 115)" --out "$OUT/plan-check-s41.json" 2>&1 \
    | grep -v '^{' | grep -E "^  [a-z_]|^moe" | grep -E "%|^moe" | tail -30
echo "done at $(( $(date +%s) - t0 )) s"
