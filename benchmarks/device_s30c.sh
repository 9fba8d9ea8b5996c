#!/usr/bin/env bash
# Session 30's last call (a short budget): the decode kernel's tests after `del p1`, then the 32-layer NF4 Mixtral's
# batch 64 (+ 2k prefill) under 16 GiB with two staging slots and without, in the same call.
#   bash benchmarks/device_s30c.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-200}
part=none
source "$(dirname "$0")/device_steps.sh"
h200_aims
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" 45 "test_fused_moe_decode.py::nf4 or splits"
grep -E "passed|failed|^E |assert" "$OUT/tests.txt" | grep -v "^\[.*passed" | head -8
for n in 2 0; do
(cd benchmarks && PYTHONPATH=.. step 80 python -c "
import sys
import bench_offload
from ferrylm.offload.expert_cache import CachedExperts
CachedExperts.staging_slots = $n
sys.argv = ['bench_offload.py', '--cases', 'mixtral-32L-nf4-b64', '--commit', '$commit', '--out', '$OUT/offload-b64-staging$n.json']
bench_offload.main()
" 2>&1 | grep -v '^{' | grep -E "tok/s|Error|error" | sed "s/^/staging $n: /" | tail -6)
echo "staging $n done at $(( $(date +%s) - t0 )) s"
done
