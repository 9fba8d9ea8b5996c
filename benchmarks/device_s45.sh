#!/usr/bin/env bash
# Session 34, a second call after `device_s44.sh`: (1) `ferry plan DIR --check` as a user runs it on a random Mixtral
# written by transformers (4 layers, 2.4 GB) under 2 GiB, now that `--check` decodes untimed until hybrid's share
# settles (session 33: memory within aims, decode -29/-30%, prefill +99%); (2) the resident fused MoE on the 8-layer
# Mixtral at batch 1 and 32 against the active-weight HBM roofline and transformers (issue 8: batch 32 was never set
# beside the roofline; `bench_offload.case_resident`).
#   bash benchmarks/device_s45.sh COMMIT [BUDGET]   (~330 s)
set -u
commit=${1:-unknown}
budget=${2:-330}
part=rest
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
write_mix4
step 120 python -m ferrylm plan /tmp/mix4 --gpu local --gpu-memory-budget 2GiB --max-model-len 2048 --max-num-seqs 8 \
    --check > "$OUT/plan-check-mix4-user.txt" 2>&1
grep -vE "Warning|warn" "$OUT/plan-check-mix4-user.txt" | tail -32
echo "mix4 check done at $(( $(date +%s) - t0 )) s"
(cd benchmarks && PYTHONPATH=.. step 200 python -c "
import json
import bench_offload
rows = []
bench_offload.case_resident(rows, bench_offload.hbm_bandwidth())
json.dump({'commit': '$commit', 'rows': rows}, open('$OUT/resident-8L.json', 'w'), default=str)
" 2>&1 | grep -E "^resident|failed" | tail -8)
echo "done at $(( $(date +%s) - t0 )) s"
