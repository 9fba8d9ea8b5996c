#!/usr/bin/env bash
# The next device calls (written in session 27). On the H200 only the issue-10 aims (hybrid Mixtral 16L batch 16,
# then batch 1: `device_s26.sh ... aims`); then PART=rest, then PART=later. Elsewhere PART=rest (the default there)
# runs, most valuable first: the CUDA tests of sessions 26-27's code (the fp8 decode kernel by format, whose group
# timed out in session 27's call; the copy-path prefill queues without a stream sync; promotions landed on the copy
# stream and one large expert a round equal the resident bits; offloaded and Yuan runs after the embedding and
# LFBatch copies went through pinned memory); the NF4 copy-path prefill's device timeline now that its rounds no
# longer sync the stream (session 27: copies 50 ms and kernels 33 ms of a 118 ms profiled prefill, overlapping
# 0.04 ms; idle 35 ms); the Qwen3 batch-1 step with promotions landed on the copy stream against landed now (bf16,
# fp8). PART=later: the NF4 plan check (prefill was +59%), one large expert a round against the default. Writes
# under $OUT; each step gets at most its own limit and what is left of BUDGET seconds (skipped under 30, said on
# the call's output).
#
#   bash benchmarks/device_s29.sh COMMIT [BUDGET] [PART]     PART: auto (default) | rest | later
set -u
commit=${1:-unknown}
budget=${2:-560}
part=${3:-auto}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
h200_aims
nf4=(--experts gpu --shape mixtral --layers 8 --budget-gib 5 --expert-quant nf4 --tokens 4 --prefill-tokens 512)
if [[ $part == later ]]; then
    PYTHONPATH=benchmarks:. step 200 python benchmarks/bench_plan.py --gpu local --cases moe-offload-nf4 \
        --case-timeout 190 --time-budget 195 --out "$OUT/plan-check-s29.json" 2>&1 | grep -v '^{' | tail -16
    i=0
    for v in "" --one-large-a-round "" --one-large-a-round; do  # alternating
        i=$(( i + 1 ))
        PYTHONPATH=benchmarks:. step 50 python benchmarks/profile_offload.py "${nf4[@]}" $v > "$OUT/ab$i$v.txt" 2>&1
        echo "[$v] $(grep -E '^\{"prefill"' "$OUT/ab$i$v.txt" | cut -c1-150)"
    done
    echo "all done at $(( $(date +%s) - t0 )) s"
    exit 0
fi
t=$(left 170)
if [ "$t" -gt 100 ]; then  # fixed shares: the main group, Yuan, the fp8 decode test (65 s was too short for its file)
    bash benchmarks/gpu_tests.sh "$OUT/tests.txt" $(( t - 80 )) \
        "without_a_stream_sync or mapped_experts_equal_resident or cached_experts_fused_rounds or packed_experts_resident_and_offloaded or offloaded_on_cuda_equals_resident" \
        35 "yuan" 45 "test_fused_moe_decode.py::fp8_takes_the_decode_kernel"
    grep -E "passed|failed|^E " "$OUT/tests.txt" | grep -v "^\[.*passed" | head -12
else
    echo "skipped (no time left): the CUDA tests"
fi
PYTHONPATH=benchmarks:. step 80 python benchmarks/profile_offload.py "${nf4[@]}" --profile \
    > "$OUT/prefill-timeline.txt" 2>&1; grep "prefill timeline" "$OUT/prefill-timeline.txt" | cut -c1-420
# the Qwen3 bf16 batch-1 step with promotions landed on the copy stream against landed now (session 27: the copies
# and the kernels never ran at once), also with the copies started after their layer (`promote_after_layer`), then fp8
PYTHONPATH=benchmarks:. step 130 python benchmarks/profile_offload.py --experts gpu --warm 64 --prefill-tokens 512 \
    --variants dueling:now dueling:stream dueling:stream:layer dueling:now dueling:stream 2>&1 | grep -E '^\{"(experts|prefill)"' \
    | cut -c1-200
# (its first variant also timed a fresh 512-token copy-road prefill: 2051 tok/s in session 27, before `_repoint`)
PYTHONPATH=benchmarks:. step 100 python benchmarks/profile_offload.py --experts gpu --warm 64 --expert-quant fp8-g128 \
    --variants dueling:now dueling:stream 2>&1 | grep -E '^\{"experts"' | cut -c1-200
echo "done at $(( $(date +%s) - t0 )) s; call again with PART=later for the plan check and the round orders"
