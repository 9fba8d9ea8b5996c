#!/usr/bin/env bash
# Session 30's call. NF4 banks now take the decode kernel at every batch below `dequant_rows` (dd9dfae; before, past 32
# tokens the plain kernel's in-tile decode): its CUDA tests, then the 32-layer NF4 Mixtral's batch 64 (+ 2k prefill)
# under 16 GiB with the new rule and with the old bound (32) in the same call (session 30's first call, old rule:
# 96.2 tok/s against a 300.5 PCIe floor), then the three NF4 paths (decode kernel, plain kernel, dequant_rows) per
# token count on three shapes.
#   bash benchmarks/device_s30.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-540}
part=none
source "$(dirname "$0")/device_steps.sh"
h200_aims
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" 40 "test_fused_moe_decode.py::nf4_takes or decode_rule" 130 \
    "peak_stays_within_the_budget or cached_experts_fused_rounds or mapped_experts_equal"
grep -E "passed|failed|^E |assert" "$OUT/tests.txt" | grep -v "^\[.*passed" | head -8
echo "tests done at $(( $(date +%s) - t0 )) s"
for bound in None 32; do
(cd benchmarks && PYTHONPATH=.. step 170 python -c "
import sys
from ferrylm.layers import fused_moe_decode as f
f.BY_FORMAT_MAX_TOKENS['nf4'] = $bound
sys.argv = ['bench_offload.py', '--cases', 'mixtral-32L-nf4-b64', '--commit', '$commit', '--out', '$OUT/offload-b64-bound$bound.json']
import bench_offload
bench_offload.main()
" 2>&1 | grep -v '^{' | grep -E "tok/s|Error|error" | sed "s/^/bound $bound: /" | tail -6)
echo "b64 bound $bound done at $(( $(date +%s) - t0 )) s"
done
PYTHONPATH=. step 200 python benchmarks/bench_moe_prefill.py --packed nf4 --decode-kernel --iters 10 \
    --shapes mixtral-8x7b qwen3-30b-a3b yuan2-m32 --tokens 16 32 64 96 128 256 --out "$OUT/moe-nf4-window.json" 2>&1 \
    | python -c "
import sys, ast
for line in sys.stdin:
    if line.startswith("{'shape"):
        r = ast.literal_eval(line)
        print(r['shape'], r['tokens'], 'rows/e', r['rows_per_expert'], 'dequant', r['grouped_ms'], 'plain', r.get('triton_ms'),
              'decode', r.get('decode_ms'), 'diff', r.get('decode_max_rel_diff'))
    else:
        print(line.rstrip())
"
echo "done at $(( $(date +%s) - t0 )) s"
