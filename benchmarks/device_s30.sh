#!/usr/bin/env bash
# Session 28's device call: the copy-path round orders (`CachedExperts.one_large_a_round`, `free_hits_first`).
# The CUDA rounds test for every order (bits equal to the resident run), then 512-token fresh NF4 prefills of the
# 8-layer Mixtral under 5 GiB alternating each | misses | all, the timeline of `each` (session 28's `all` timeline:
# copies 50.8 ms and kernels 33.4 ms of 107, never at once), and a 2k prefill of the 16-layer bf16 Mixtral under
# 16 GiB (copies 352 MB an expert: the orders should tie there) each against all.
#
#   [PART=big] bash benchmarks/device_s30.sh COMMIT [BUDGET]     PART=big: only the 2k prefills (16L bf16, 32L NF4)
set -u
commit=${1:-unknown}
budget=${2:-560}
part=rest
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
h200_aims
if [[ ${PART:-} != big ]]; then
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" "$(left 90)" "cached_experts_fused_rounds or packed_experts_resident_and_offloaded"
grep -E "passed|failed|^E " "$OUT/tests.txt" | grep -v "^\[.*passed" | head -12
nf4=(--experts gpu --shape mixtral --layers 8 --budget-gib 5 --expert-quant nf4 --tokens 4 --prefill-tokens 512)
for r in each misses all each misses all; do
    PYTHONPATH=benchmarks:. step 45 python benchmarks/profile_offload.py "${nf4[@]}" --rounds $r > "$OUT/nf4-$r.txt" 2>&1
    echo "[$r] $(grep -E '^\{"prefill"' "$OUT/nf4-$r.txt" | cut -c1-150)"
done
PYTHONPATH=benchmarks:. step 60 python benchmarks/profile_offload.py "${nf4[@]}" --rounds each --profile \
    > "$OUT/prefill-timeline-each.txt" 2>&1; grep "prefill timeline" "$OUT/prefill-timeline-each.txt" | cut -c1-300
fi
bf16=(--experts gpu --shape mixtral --layers 16 --budget-gib 16 --tokens 2 --warm 2 --prefill-tokens 2048)
for r in each all; do
    PYTHONPATH=benchmarks:. step 120 python benchmarks/profile_offload.py "${bf16[@]}" --rounds $r > "$OUT/bf16-$r.txt" 2>&1
    echo "[bf16 $r] $(grep -E '^\{"prefill"' "$OUT/bf16-$r.txt" | cut -c1-180)"
done
nf4_32=(--experts gpu --shape mixtral --layers 32 --budget-gib 16 --expert-quant nf4 --tokens 2 --warm 2 --prefill-tokens 2048)
for r in each all; do
    PYTHONPATH=benchmarks:. step 120 python benchmarks/profile_offload.py "${nf4_32[@]}" --rounds $r > "$OUT/nf4-32-$r.txt" 2>&1
    echo "[nf4 32L $r] $(grep -E '^\{"prefill"' "$OUT/nf4-32-$r.txt" | cut -c1-180)"
done
echo "done at $(( $(date +%s) - t0 )) s"
