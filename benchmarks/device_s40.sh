#!/usr/bin/env bash
# Written in session 32 (not yet run). Staging behind its token gate (`CachedExperts.stage_min_tokens`, 256: shorter
# steps never stage), two slots against none, alternating: the 8-layer NF4 batch-1 decode under 5 GiB first (session
# 31 without the gate: 12.54 against 10.34 ms a step; with it the 32-token prompts stage nothing, so the two should
# match), then the 32-layer NF4 Mixtral under 16 GiB (2k prefill: session 31 5844 against 4816 tok/s; batch 64).
# If the decode matches and the prefill gain holds, set `CachedExperts.staging_slots = 2`.
#   bash benchmarks/device_s40.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-480}
part=${PART:-auto}
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
h200_aims
for r in 1 2; do
for n in 2 0; do
(cd benchmarks && PYTHONPATH=.. step 60 python profile_offload.py --shape mixtral --layers 8 --expert-quant nf4 \
    --budget-gib 5 --experts auto --tokens 16 --staging $n 2>&1 | grep '^{"experts"' | cut -c1-400 | sed "s/^/b1 run $r staging $n: /")
done
done
echo "b1 done at $(( $(date +%s) - t0 )) s"
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
echo "done at $(( $(date +%s) - t0 )) s"
