#!/usr/bin/env bash
# Session 32's short call (ten starts failed; little budget left): the most telling parts of device_s38.sh and
# device_s39.sh. The CUDA tests of `decode_experts`' 4-bit kernel; `decode_experts` alone by tile (TB/s); where the
# hybrid batch-1 decode step of the 8-layer NF4 Mixtral under 5 GiB goes (`profile_offload.py --profile`); the plan
# checks of the NF4 Mixtral offloaded and resident (session 32's `estimate.DEQUANT_GBS`: the prefill replayed +25%).
#   bash benchmarks/device_s41.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-420}
part=rest
source "$(dirname "$0")/device_steps.sh"  # t0, left, step, h200_aims
h200_aims
bash benchmarks/gpu_tests.sh "$OUT/tests.txt" 90 "test_fused_moe_formats.py::decoded_experts or packed_experts_equal"
grep -E "passed|failed|^E |assert" "$OUT/tests.txt" | grep -v "^\[.*passed" | head -12
PYTHONPATH=. step 60 python -c "
import torch, time
from ferrylm.layers import fused_moe as F
from ferrylm.weights import quant
torch.manual_seed(0)
E, H, I = 8, 4096, 14336
b = F.ExpertWeights.stack([[quant.quantize_nf4(torch.randn(2 * I, H, device='cuda') * 0.02, 64)] for _ in range(E)],
                          torch.bfloat16)
out = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device='cuda')
ids = torch.arange(E, device='cuda')
res = {}
for tile in ((32, 256), (64, 256), (32, 128), (16, 512), None):
    F.DECODE_4BIT_TILE = tile
    F.decode_experts(b, list(range(E)), torch.bfloat16, out=out, ids=ids)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(5):
        F.decode_experts(b, list(range(E)), torch.bfloat16, out=out, ids=ids)
    torch.cuda.synchronize(); s = (time.perf_counter() - t) / 5
    res[tile] = out.clone() if tile in ((32, 256), None) else None
    print(f'decode_experts NF4 w13 x {E} tile {tile}: {s * 1e3:.2f} ms, {out.numel() * 2 / s / 1e12:.2f} TB/s of bf16 out')
print('4-bit kernel equals the tile decode:', torch.equal(res[(32, 256)], res[None]))
" 2>&1 | tail -7
echo "decode done at $(( $(date +%s) - t0 )) s"
(cd benchmarks && PYTHONPATH=.. step 150 python profile_offload.py --shape mixtral --layers 8 --budget-gib 5 \
    --expert-quant nf4 --experts auto gpu --tokens 16 --profile > "$OUT/profile-hybrid-b1.txt" 2>&1)
grep -v '^{' "$OUT/profile-hybrid-b1.txt" | grep -vE "^\s*$|Warning|warn" | cut -c1-160 | head -70
echo "profile done at $(( $(date +%s) - t0 )) s"
PYTHONPATH=benchmarks:. step 120 python benchmarks/bench_plan.py --gpu local --cases moe-offload-nf4 moe-nf4 \
    --case-timeout 60 --time-budget "$(left 115)" --out "$OUT/plan-check-s41.json" 2>&1 \
    | grep -v '^{' | grep -E "^  [a-z_]|^moe" | grep -E "%|^moe" | tail -30
echo "done at $(( $(date +%s) - t0 )) s"
