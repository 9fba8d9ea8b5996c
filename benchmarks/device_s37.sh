#!/usr/bin/env bash
# The second device call of session 31. On the H200 with PART unset: the issue-10 aims alone (`h200_aims`). Otherwise:
# where the resident NF4 Mixtral's 512-token prefill spends its time (the plan predicts it 46-58% too fast); then
# two staging slots against none, alternating, on the 32-layer NF4 Mixtral under 16 GiB (batch 64 and a 2k prefill;
# session 31's first call, one run each: 236.6 / 220.8 tok/s at batch 64, 6110 / 5064 at 2k, against session 29's
# alternating 6400 / 5710 against 6031 / 6131); then the 8-layer NF4 batch-1 decode under 5 GiB with and without
# (session 29: 10.45 / 10.34 against 9.59 / 9.32 ms a step).
#   bash benchmarks/device_s37.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-500}
part=${PART:-auto}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
h200_aims
(cd benchmarks && PYTHONPATH=.. step 100 python profile_prefill.py --layers 8 --expert-quant nf4 --tokens 512 \
    > "$OUT/profile-prefill-nf4-resident.txt" 2>&1; grep -v '^{' "$OUT/profile-prefill-nf4-resident.txt" | tail -26)
echo "profile done at $(( $(date +%s) - t0 )) s"
for r in 1 2; do
for n in 2 0; do
(cd benchmarks && PYTHONPATH=.. step 100 python -c "
import sys
import bench_offload
from ferrylm.offload.expert_cache import CachedExperts
CachedExperts.staging_slots = $n
sys.argv = ['bench_offload.py', '--cases', 'mixtral-32L-nf4-b64', '--commit', '$commit', '--out', '$OUT/offload-b64-staging$n-run$r.json']
bench_offload.main()
" 2>&1 | grep -v '^{' | grep -E "tok/s|Error|error" | sed "s/^/run $r staging $n: /" | tail -4)
echo "run $r staging $n done at $(( $(date +%s) - t0 )) s"
done
done
for n in 2 0; do
(cd benchmarks && PYTHONPATH=.. step 60 python profile_offload.py --shape mixtral --layers 8 --expert-quant nf4 \
    --budget-gib 5 --experts auto --tokens 16 --staging $n 2>&1 | grep '^{"experts"' | cut -c1-400 | sed "s/^/b1 staging $n: /")
done
echo "done at $(( $(date +%s) - t0 )) s"
