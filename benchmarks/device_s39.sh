#!/usr/bin/env bash
# Written in session 32. On the H200 with PART unset: the issue-10 aims alone (`h200_aims`), then call again with
# PART=rest. Otherwise, in order of worth: (1) where the hybrid batch-1 decode step of the 8-layer NF4 Mixtral under
# 5 GiB goes (`profile_offload.py --experts auto gpu --profile`: the plan's "@profile routing" row misses it by ~0.8 ms
# a layer, sessions 30-31); (2) the plan checks after session 31's audit of `ferry plan` (dense, MoE resident, NF4
# offloaded and resident); (3) `ferry plan DIR --gpu local --check` once as a user runs it, on a random Mixtral
# checkpoint written by transformers into /tmp.
#   bash benchmarks/device_s39.sh COMMIT [BUDGET]; PART=rest bash benchmarks/device_s39.sh COMMIT
set -u
commit=${1:-unknown}
budget=${2:-480}
part=${PART:-auto}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
h200_aims
(cd benchmarks && PYTHONPATH=.. step 150 python profile_offload.py --shape mixtral --layers 8 --budget-gib 5 \
    --expert-quant nf4 --experts auto gpu --tokens 16 --profile > "$OUT/profile-hybrid-b1.txt" 2>&1)
grep -v '^{' "$OUT/profile-hybrid-b1.txt" | grep -vE "^\s*$|Warning|warn" | head -90
echo "profile done at $(( $(date +%s) - t0 )) s"
PYTHONPATH=benchmarks:. step 220 python benchmarks/bench_plan.py --gpu local --cases dense moe moe-offload-nf4 moe-nf4 \
    --case-timeout 100 --time-budget "$(left 215)" --out "$OUT/plan-check-s39.json" 2>&1 \
    | grep -v '^{' | grep -E "^  [a-z_]|^(dense|moe)" | grep -E "%|^(dense|moe)" | tail -50
echo "plan done at $(( $(date +%s) - t0 )) s"
write_mix4
step 120 python -m ferrylm plan /tmp/mix4 --gpu local --gpu-memory-budget 2GiB --max-model-len 2048 --max-num-seqs 8 \
    --check 2>&1 | tail -40
echo "done at $(( $(date +%s) - t0 )) s"
