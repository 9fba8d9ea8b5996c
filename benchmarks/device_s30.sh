#!/usr/bin/env bash
# Session 30's call: where the NF4 decode kernel beats the plain kernel's in-tile decode and `dequant_rows` past its
# token bound (32: `fused_moe_decode.BY_FORMAT_MAX_TOKENS`), then the 32-layer NF4 Mixtral's batch 64 under 16 GiB with
# the bound at 127 (session 30's first call: 96.2 tok/s against a 300.5 PCIe floor with the plain kernel).
#   bash benchmarks/device_s30.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-560}
part=none
source "$(dirname "$0")/device_steps.sh"
h200_aims
PYTHONPATH=. step 200 python benchmarks/bench_moe_prefill.py --packed nf4 --decode-kernel --iters 10 \
    --shapes mixtral-8x7b qwen3-30b-a3b yuan2-m32 --tokens 16 32 64 96 128 256 --out "$OUT/moe-nf4-window.json" 2>&1 \
    | python -c "
import sys, ast
for line in sys.stdin:
    if line.startswith('{'):
        r = ast.literal_eval(line)
        print(r['shape'], r['tokens'], 'rows/e', r['rows_per_expert'], 'dequant', r['grouped_ms'], 'plain', r.get('triton_ms'),
              'decode', r.get('decode_ms'), 'diff', r.get('decode_max_rel_diff'))
    else:
        print(line.rstrip())
"
echo "kernels done at $(( $(date +%s) - t0 )) s"
bound=${BOUND:-127}
(cd benchmarks && PYTHONPATH=.. step 300 python -c "
import sys
from ferrylm.layers import fused_moe_decode as f
f.BY_FORMAT_MAX_TOKENS['nf4'] = $bound
sys.argv = ['bench_offload.py', '--cases', 'mixtral-32L-nf4-b64', '--commit', '$commit', '--out', '$OUT/offload-b64-bound$bound.json']
import bench_offload
bench_offload.main()
" 2>&1 | grep -v '^{' | grep -E "tok/s|Error|error" | tail -12)
echo "done at $(( $(date +%s) - t0 )) s"
