#!/usr/bin/env bash
# Session 28's third device call: staging slots shared by the cached layers (`CachedExperts.staging_slots`,
# `StagingSlots`) on the copy-path prefill. The CUDA rounds test (bits equal to the resident run, experts staged), then alternating staging 2 | 0:
# 2k prefills of the 32-layer NF4 Mixtral under 16 GiB (0.68 of the copy floor without), 512-token prefills of the
# 8-layer NF4 Mixtral under 5 GiB, the 2k prefill of the 16-layer bf16 Mixtral under 16 GiB; the 8L timeline with.
#
#   bash benchmarks/device_s32.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-560}
part=rest
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
h200_aims
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" "$(left 90)" "cached_experts_fused_rounds or packed_experts_resident_and_offloaded"
grep -E "passed|failed|^E |assert" "$OUT/tests.txt" | grep -v "^\[.*passed" | head -12
nf4_32=(--experts gpu --shape mixtral --layers 32 --budget-gib 16 --expert-quant nf4 --tokens 2 --warm 2 --prefill-tokens 2048)
for l in 2 0 2 0; do
    PYTHONPATH=benchmarks:. step 60 python benchmarks/profile_offload.py "${nf4_32[@]}" --staging $l > "$OUT/nf4-32-staging$l.txt" 2>&1
    echo "[nf4 32L staging $l] $(grep -E '^\{"prefill"' "$OUT/nf4-32-staging$l.txt" | cut -c1-300)"; grep -hE '^\{"experts"' "$OUT/nf4-32-staging$l.txt" | cut -c1-130
done
nf4=(--experts gpu --shape mixtral --layers 8 --budget-gib 5 --expert-quant nf4 --tokens 4 --prefill-tokens 512)
for l in 2 0; do
    PYTHONPATH=benchmarks:. step 45 python benchmarks/profile_offload.py "${nf4[@]}" --staging $l > "$OUT/nf4-8-staging$l.txt" 2>&1
    echo "[nf4 8L staging $l] $(grep -E '^\{"prefill"' "$OUT/nf4-8-staging$l.txt" | cut -c1-300)"; grep -hE '^\{"experts"' "$OUT/nf4-8-staging$l.txt" | cut -c1-130
done
bf16=(--experts gpu --shape mixtral --layers 16 --budget-gib 16 --tokens 2 --warm 2 --prefill-tokens 2048)
for l in 2 0; do
    PYTHONPATH=benchmarks:. step 60 python benchmarks/profile_offload.py "${bf16[@]}" --staging $l > "$OUT/bf16-staging$l.txt" 2>&1
    echo "[bf16 16L staging $l] $(grep -E '^\{"prefill"' "$OUT/bf16-staging$l.txt" | cut -c1-300)"; grep -hE '^\{"experts"' "$OUT/bf16-staging$l.txt" | cut -c1-130
done
PYTHONPATH=benchmarks:. step 60 python benchmarks/profile_offload.py "${nf4[@]}" --staging 2 --profile \
    > "$OUT/prefill-timeline-staging.txt" 2>&1; grep "prefill timeline" "$OUT/prefill-timeline-staging.txt" | cut -c1-300
echo "done at $(( $(date +%s) - t0 )) s"
