#!/usr/bin/env bash
# Session 32's last try (~350 s of budget left): the 4-bit kernel's CUDA tests and the tile sweep of device_s41.sh alone.
#   bash benchmarks/device_s42.sh COMMIT [BUDGET]
set -u
commit=${1:-unknown}
budget=${2:-200}
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
