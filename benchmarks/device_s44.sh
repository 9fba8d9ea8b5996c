#!/usr/bin/env bash
# Session 33: the share tuner's last candidate, share 0 (hybrid off). The 8-layer NF4 Mixtral under 5 GiB at batch 1
# ran 13.2 ms a step with `--experts auto` against 9.0 with `--experts gpu` (profile_offload.py, this session): the
# re-balance, then the tuner (now timing 0 last), then auto as served against copy-only and cpu-only, alternating
# (`bench_offload.case_hybrid_packed`). Then the graphed tuner's CUDA test; then (not with PART=short) the NF4 plan
# checks on the session's new decode-pass constants, staging on.
#   bash benchmarks/device_s44.sh COMMIT [BUDGET]   (~450 s whole; PART=short ~270)
set -u
commit=${1:-unknown}
budget=${2:-300}
part=rest
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
(cd benchmarks && PYTHONPATH=.. step 200 python -c "
import json
import bench_offload
rows = []
bench_offload.case_hybrid_packed(rows, 55.0, layers=8, expert_quant='nf4', budget_gib=5, batches=(1,))
json.dump({'commit': '$commit', 'rows': rows}, open('$OUT/hybrid-nf4-8L-tuner.json', 'w'), default=str)
" 2>&1 | grep -vE "^\{|Warning|warn" | cut -c1-300 | tail -14)
echo "tuner case done at $(( $(date +%s) - t0 )) s"
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" "$(left 90)" "test_cuda.py::test_hybrid_share_tuner_settles_on_a_graphed_engine"
grep -E "passed|failed|^E |assert|tuned" "$OUT/tests.txt" | head -8
echo "tests done at $(( $(date +%s) - t0 )) s"
[ "${PART:-}" = short ] && exit 0
# the plan checks on session 33's decode-pass constants, staging on (resident NF4 prefill replayed +3.8% / +4.5%)
PYTHONPATH=benchmarks:. step 150 python benchmarks/bench_plan.py --gpu local --cases moe-nf4 moe-offload-nf4 \
    --case-timeout 70 --time-budget "$(left 145)" --out "$OUT/plan-check-s44.json" 2>&1 \
    | grep -v '^{' | grep -E "^  [a-z_]|^moe" | grep -E "%|^moe" | tail -30
echo "done at $(( $(date +%s) - t0 )) s"
