#!/usr/bin/env bash
# The next device call (written in session 29, not yet run). On the H200 the issue-10 aims first (`h200_aims`). Then
# the CUDA tests of session 29's last change (an offload round's packed prefill caps rows on the model's expert
# count: the rounds tests, bits equal to the resident run; the peak test with NF4 experts and a one-token prompt;
# graphs bounded by `fused_moe.graph_token_limit`), then the plan checks: the NF4 Mixtral offloaded and resident
# (`moe-nf4`, new) and the Qwen3 bf16 offload (the kernel path's rounds now counted; each prediction's parts
# recorded for the batch-1 "@profile routing" row, +68% in session 29). PART=cases (a second call): the issue-8
# 32-layer NF4 cases never run (batch 64 with a 2k prefill, batch 1 under Zipf routing).
#   bash benchmarks/device_s35.sh COMMIT [BUDGET]; PART=cases bash benchmarks/device_s35.sh COMMIT
set -u
commit=${1:-unknown}
budget=${2:-560}
part=${PART:-auto}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
h200_aims
if [[ $part == cases ]]; then
    (cd benchmarks && PYTHONPATH=.. step 540 python bench_offload.py --cases mixtral-32L-nf4-b64,mixtral-32L-nf4-zipf \
        --commit "$commit" --out "$OUT/offload-s35-32L-nf4.json" 2>&1 | grep -v '^{' | tail -30)
    echo "cases done at $(( $(date +%s) - t0 )) s"
    exit 0
fi
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" "$(left 200)" \
    "cached_experts_fused_rounds or slot_bank or peak_stays_within_the_budget or piecewise or dequant or packed_prefill"
grep -E "passed|failed|^E |assert" "$OUT/tests.txt" | grep -v "^\[.*passed" | head -8
echo "tests done at $(( $(date +%s) - t0 )) s"
PYTHONPATH=benchmarks:. step 330 python benchmarks/bench_plan.py --gpu local --cases moe-offload-nf4 moe-nf4 moe-offload \
    --case-timeout 150 --time-budget "$(left 330)" --out "$OUT/plan-check-s35.json" 2>&1 | grep -v '^{' \
    | grep -E "^  [a-z_]|^moe|step " | tail -60
echo "done at $(( $(date +%s) - t0 )) s"
