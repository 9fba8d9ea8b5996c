#!/usr/bin/env bash
# The next device call (written in session 30, not yet run). On the H200 with PART unset: the issue-10 aims alone
# (`h200_aims`), then call again with PART=rest. Otherwise: the decode kernel's NF4 tests after session 30's `del p1`;
# the 32-layer NF4 Mixtral's batch 64 (+ 2k prefill) under 16 GiB with two staging slots and without, in one call
# (session 30 without: 195.5 / 215.7 tok/s against a 318 floor, prefill 5076); the plan checks of the NF4 Mixtral
# offloaded and resident (an unseen run for session 30's refit `estimate.PACKED_DECODE_GBS` and the graph pools' floor
# `offload/memory.graph_step_floor`); Qwen3-30B-A3B NF4 under 8 GiB at batch 64 with the NF4 rule and the old bound.
#   bash benchmarks/device_s36.sh COMMIT [BUDGET]; PART=rest bash benchmarks/device_s36.sh COMMIT
set -u
commit=${1:-unknown}
budget=${2:-560}
part=${PART:-auto}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
h200_aims
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" 50 "test_fused_moe_decode.py::nf4 or splits"
grep -E "passed|failed|^E |assert" "$OUT/tests.txt" | grep -v "^\[.*passed" | head -8
for n in 2 0; do
(cd benchmarks && PYTHONPATH=.. step 90 python -c "
import sys
import bench_offload
from ferrylm.offload.expert_cache import CachedExperts
CachedExperts.staging_slots = $n
sys.argv = ['bench_offload.py', '--cases', 'mixtral-32L-nf4-b64', '--commit', '$commit', '--out', '$OUT/offload-b64-staging$n.json']
bench_offload.main()
" 2>&1 | grep -v '^{' | grep -E "tok/s|Error|error" | sed "s/^/staging $n: /" | tail -6)
echo "staging $n done at $(( $(date +%s) - t0 )) s"
done
PYTHONPATH=benchmarks:. step 200 python benchmarks/bench_plan.py --gpu local --cases moe-offload-nf4 moe-nf4 \
    --case-timeout 120 --time-budget "$(left 200)" --out "$OUT/plan-check-s36.json" 2>&1 | grep -v '^{' \
    | grep -E "^  [a-z_]|^moe" | grep -E "%|^moe" | tail -40
echo "plan done at $(( $(date +%s) - t0 )) s"
for bound in None 32; do
(cd benchmarks && PYTHONPATH=.. step 100 python -c "
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
echo "done at $(( $(date +%s) - t0 )) s"
