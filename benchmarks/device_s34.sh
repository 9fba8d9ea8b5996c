#!/usr/bin/env bash
# The next device call (written in session 28, not yet run): copy-road staging in the first cached layer's slots with
# its experts copied back at the step's end (`StagingSlots.release`). The rounds test (its `each` cases, a mapped
# donor among them), then staging 2 | 0 alternating: the 8-layer NF4 Mixtral under 5 GiB (512-token prefill and
# batch-1 decode, 32 tokens after 16), then the 2k prefill of the 32-layer NF4 Mixtral under 16 GiB. Session 28's
# calls of the earlier staging forms (device_s31-s33) are in git history and in
# benchmarks/results/profile-offload-2026-12-06-s28-h100.json.
#   bash benchmarks/device_s34.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-400}
part=rest
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
h200_aims
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" "$(left 60)" "cached_experts_fused_rounds and each"
grep -E "passed|failed|^E |assert" "$OUT/tests.txt" | grep -v "^\[.*passed" | head -6
for l in 2 0 2 0; do
    PYTHONPATH=benchmarks:. step 30 python benchmarks/profile_offload.py --experts gpu --shape mixtral --layers 8 --budget-gib 5 \
        --expert-quant nf4 --tokens 32 --warm 16 --prefill-tokens 512 --staging $l 2>&1 | grep -E '^\{"(experts|prefill)"' \
        | cut -c1-170 | sed "s/^/[8L staging $l] /"
done
for l in 2 0 2 0; do
    PYTHONPATH=benchmarks:. step 50 python benchmarks/profile_offload.py --experts gpu --shape mixtral --layers 32 --budget-gib 16 \
        --expert-quant nf4 --tokens 2 --warm 2 --prefill-tokens 2048 --staging $l 2>&1 | grep -E '^\{"prefill"' \
        | cut -c1-300 | sed "s/^/[32L staging $l] /"
done
echo "done at $(( $(date +%s) - t0 )) s"
