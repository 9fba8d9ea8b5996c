#!/usr/bin/env bash
# Session 37's leftovers for one device call: (1) the plan checks of session 37's constants (the copy road's split
# priced for dense banks, `estimate.HOST_EXPERT_EFF_NATIVE`, `hit_rate.sampled_promotions`) on the offloaded bf16 and
# NF4 8-layer Mixtrals, which session 37 ran on H100 boxes only; on the H200 box, whose host the 0.27 dense rate was
# fitted on, they say whether 0.51 holds there; (2) the offloaded NF4 batch-1 step profiled again: session 37's
# profile showed the device idle ~4.6 ms a step in ~2.5 ms gaps behind `cudaEventSynchronize` (is the idle real or the
# profiler's?), and `--experts gpu` against `auto`.
# The plan checks run on an H200 only (session 37 ran them on the H100), unless CHECKS=1.
#   bash benchmarks/device_s46.sh COMMIT [BUDGET]   (~420 s; ~150 s on an H100)
set -u
commit=${1:-unknown}
budget=${2:-420}
part=rest
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu; commit $commit"
[[ $gpu == *H200* || ${CHECKS:-} == 1 ]] && PYTHONPATH=benchmarks:. step 260 python benchmarks/bench_plan.py --gpu local --cases moe-offload-bf16 moe-offload-nf4 \
    --case-timeout 125 --time-budget "$(left 255)" --out "$OUT/plan-check-s46.json" 2>&1 \
    | grep -v '^{' | grep -E "^  [a-z_]|^moe" | grep -E "%|^moe" | cut -c1-220 | tail -34
echo "plan checks done at $(( $(date +%s) - t0 )) s"
(cd benchmarks && PYTHONPATH=.. step 150 python profile_offload.py --shape mixtral --layers 8 --expert-quant nf4 \
    --budget-gib 5 --experts gpu auto --tokens 16 --profile > "$OUT/profile-nf4-b1.txt" 2>&1)
grep -E "^\{\"experts|decode step timeline|per decode step" "$OUT/profile-nf4-b1.txt" | cut -c1-400
echo "done at $(( $(date +%s) - t0 )) s"
