#!/usr/bin/env bash
# Session 30's third call: the decode kernel's tests after `del p1`; the plan checks of the NF4 Mixtral offloaded and
# resident with the graph pools' floor (`offload/memory.graph_step_floor`) and the packed kernel's own rate
# (`plan/estimate.PACKED_DECODE_GBS`); then Qwen3-30B-A3B NF4 under 8 GiB at batch 64 (A = 512: 4 rows an expert, on
# the decode kernel since dd9dfae) against the old bound in the same call.
#   bash benchmarks/device_s30b.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-480}
part=none
source "$(dirname "$0")/device_steps.sh"
h200_aims
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" 60 "test_fused_moe_decode.py::nf4 or splits"
grep -E "passed|failed|^E |assert" "$OUT/tests.txt" | grep -v "^\[.*passed" | head -8
PYTHONPATH=benchmarks:. step 230 python benchmarks/bench_plan.py --gpu local --cases moe-offload-nf4 moe-nf4 \
    --case-timeout 140 --time-budget "$(left 230)" --out "$OUT/plan-check-s30b.json" 2>&1 | grep -v '^{' \
    | grep -E "^  [a-z_]|^moe" | grep -E "%|^moe" | tail -40
echo "plan done at $(( $(date +%s) - t0 )) s"
for bound in None 32; do
(cd benchmarks && PYTHONPATH=.. step 110 python -c "
import sys
import bench_offload
from ferrylm.layers import fused_moe_decode as f
f.BY_FORMAT_MAX_TOKENS['nf4'] = $bound
bench_offload.CASES['q64'] = lambda rows, h2d: bench_offload.case_offload(rows, h2d, 'qwen3-30b-a3b-nf4-experts',
    bench_offload.QWEN3_30B, 8, (64,), None, expert_quant='nf4')
sys.argv = ['bench_offload.py', '--cases', 'q64', '--commit', '$commit', '--out', '$OUT/offload-qwen3-nf4-b64-bound$bound.json']
bench_offload.main()
" 2>&1 | grep -v '^{' | grep -E "tok/s|Error|error" | sed "s/^/bound $bound: /" | tail -4)
echo "qwen3 b64 bound $bound done at $(( $(date +%s) - t0 )) s"
done
