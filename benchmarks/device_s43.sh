#!/usr/bin/env bash
# Session 33: `fused_moe.DECODE_4BIT_TILE` (16, 512) against the tile decode (None), alternating, on the 32-layer NF4
# Mixtral under 16 GiB with two staging slots (batch 64 and the 2k prefill, whose copied experts the kernel decodes).
# The kernel alone: 1.78 against 1.38 TB/s (session 33, H200, bench_decode_experts.py).
#   bash benchmarks/device_s43.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-300}
part=rest
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
for r in 1 2; do
for t in 16,512 none; do
tile=None; [ $t != none ] && tile="($t)"
(cd benchmarks && PYTHONPATH=.. step 100 python -c "
import sys
import bench_offload
from ferrylm.layers import fused_moe
from ferrylm.offload.expert_cache import CachedExperts
CachedExperts.staging_slots = 2
fused_moe.DECODE_4BIT_TILE = $tile
sys.argv = ['bench_offload.py', '--cases', 'mixtral-32L-nf4-b64', '--commit', '$commit', '--out', '$OUT/offload-b64-tile${t/,/x}-run$r.json']
bench_offload.main()
" 2>&1 | grep -v '^{' | grep -E "tok/s|Error|error" | sed "s/^/run $r tile $t: /" | tail -4)
echo "run $r tile $t done at $(( $(date +%s) - t0 )) s"
done
done
echo "done at $(( $(date +%s) - t0 )) s"
