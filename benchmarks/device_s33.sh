#!/usr/bin/env bash
# Session 28's fourth device call: copy-road staging in slots of the first cached layer (`StagingSlots`, held only
# during a large step). The CUDA rounds test (bits equal to the resident run, experts staged), then staging 2 | 0
# on the 2k prefill of the 32-layer NF4 Mixtral under 16 GiB, and batch-1 decode of the 8-layer NF4 Mixtral under
# 5 GiB, 32 tokens after 16 (slots taken from the caches for good had cost it 10.7 against 9.3 ms a step).
#
#   bash benchmarks/device_s33.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-300}
part=rest
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
h200_aims
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" "$(left 80)" "cached_experts_fused_rounds and not all"
grep -E "passed|failed|^E |assert" "$OUT/tests.txt" | grep -v "^\[.*passed" | head -12
nf4_32=(--experts gpu --shape mixtral --layers 32 --budget-gib 16 --expert-quant nf4 --tokens 2 --warm 2 --prefill-tokens 2048)
for l in 2 0; do
    PYTHONPATH=benchmarks:. step 50 python benchmarks/profile_offload.py "${nf4_32[@]}" --staging $l > "$OUT/nf4-32-staging$l.txt" 2>&1
    echo "[nf4 32L staging $l] $(grep -E '^\{"prefill"' "$OUT/nf4-32-staging$l.txt" | cut -c1-300)"
done
for l in 2 0; do
    PYTHONPATH=benchmarks:. step 45 python benchmarks/profile_offload.py --experts gpu --shape mixtral --layers 8 --budget-gib 5 \
        --expert-quant nf4 --tokens 32 --warm 16 --staging $l 2>&1 | grep -E '^\{"experts"' | cut -c1-200 | sed "s/^/[8L decode staging $l] /"
done
echo "done at $(( $(date +%s) - t0 )) s"
