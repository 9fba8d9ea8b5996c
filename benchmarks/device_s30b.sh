#!/usr/bin/env bash
# Session 30's third call: the decode kernel's tests after `del p1`; the 32-layer NF4 Mixtral's batch 64 (+ 2k prefill)
# under 16 GiB with two staging slots (`CachedExperts.staging_slots`: the next layer's experts copied ahead of its
# routing; the second call, without: 195.5 / 215.7 tok/s, prefill 5076); the plan checks of the NF4 Mixtral offloaded
# and resident with the graph pools' floor (`offload/memory.graph_step_floor`) and the packed kernel's own rate
# (`plan/estimate.PACKED_DECODE_GBS`); then Qwen3-30B-A3B NF4 under 8 GiB at batch 64 (4 rows an expert, on the decode
# kernel since dd9dfae) if time is left.
#   bash benchmarks/device_s30b.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-380}
part=none
source "$(dirname "$0")/device_steps.sh"
h200_aims
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" 50 "test_fused_moe_decode.py::nf4 or splits"
grep -E "passed|failed|^E |assert" "$OUT/tests.txt" | grep -v "^\[.*passed" | head -8
(cd benchmarks && PYTHONPATH=.. step 100 python -c "
import sys
import bench_offload
from ferrylm.offload.expert_cache import CachedExperts
CachedExperts.staging_slots = 2
sys.argv = ['bench_offload.py', '--cases', 'mixtral-32L-nf4-b64', '--commit', '$commit', '--out', '$OUT/offload-b64-staging2.json']
bench_offload.main()
" 2>&1 | grep -v '^{' | grep -E "tok/s|Error|error" | sed "s/^/staging 2: /" | tail -6)
echo "staging done at $(( $(date +%s) - t0 )) s"
PYTHONPATH=benchmarks:. step 200 python benchmarks/bench_plan.py --gpu local --cases moe-offload-nf4 moe-nf4 \
    --case-timeout 120 --time-budget "$(left 200)" --out "$OUT/plan-check-s30b.json" 2>&1 | grep -v '^{' \
    | grep -E "^  [a-z_]|^moe" | grep -E "%|^moe" | tail -40
echo "plan done at $(( $(date +%s) - t0 )) s"
(cd benchmarks && PYTHONPATH=.. step 100 python -c "
import sys
import bench_offload
bench_offload.CASES['q64'] = lambda rows, h2d: bench_offload.case_offload(rows, h2d, 'qwen3-30b-a3b-nf4-experts',
    bench_offload.QWEN3_30B, 8, (64,), None, expert_quant='nf4')
sys.argv = ['bench_offload.py', '--cases', 'q64', '--commit', '$commit', '--out', '$OUT/offload-qwen3-nf4-b64.json']
bench_offload.main()
" 2>&1 | grep -v '^{' | grep -E "tok/s|Error|error" | tail -4)
echo "done at $(( $(date +%s) - t0 )) s"
