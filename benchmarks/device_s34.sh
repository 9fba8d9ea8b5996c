#!/usr/bin/env bash
# Session 28's last device call (not run: the budget was spent; run it next, then the 32-layer 2k prefill,
# `device_s33.sh`'s middle step, alternating): the donor's staging with its experts copied back (`StagingSlots.release`): the
# rounds test, then the 8-layer NF4 512-token prefill and batch-1 decode (32 tokens after 16), staging 2 | 0
# alternating, until the budget ends.
#   bash benchmarks/device_s34.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-150}
part=rest
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
h200_aims
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" "$(left 45)" "cached_experts_fused_rounds and each"
grep -E "passed|failed|^E |assert" "$OUT/tests.txt" | grep -v "^\[.*passed" | head -6
for l in 2 0 2 0; do
    PYTHONPATH=benchmarks:. step 30 python benchmarks/profile_offload.py --experts gpu --shape mixtral --layers 8 --budget-gib 5 \
        --expert-quant nf4 --tokens 32 --warm 16 --prefill-tokens 512 --staging $l 2>&1 | grep -E '^\{"(experts|prefill)"' \
        | cut -c1-170 | sed "s/^/[8L staging $l] /"
done
echo "done at $(( $(date +%s) - t0 )) s"
