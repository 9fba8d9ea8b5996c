"""`fused_moe.decode_experts` alone on eight NF4 Mixtral experts (w13), by `DECODE_4BIT_TILE` (None: the tile decode),
in ms and TB/s of bf16 written, and whether the 4-bit kernel's output equals the tile decode's. CUDA only.

    PYTHONPATH=. python benchmarks/bench_decode_experts.py
"""

import time

import torch

from ferrylm.layers import fused_moe as F
from ferrylm.weights import quant


def main() -> None:
    torch.manual_seed(0)
    E, H, I = 8, 4096, 14336
    b = F.ExpertWeights.stack([[quant.quantize_nf4(torch.randn(2 * I, H, device="cuda") * 0.02, 64)]
                               for _ in range(E)], torch.bfloat16)
    out = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="cuda")
    ids = torch.arange(E, device="cuda")
    res = {}
    for tile in ((32, 256), (64, 256), (32, 128), (16, 512), None):
        F.DECODE_4BIT_TILE = tile
        F.decode_experts(b, list(range(E)), torch.bfloat16, out=out, ids=ids)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            F.decode_experts(b, list(range(E)), torch.bfloat16, out=out, ids=ids)
        torch.cuda.synchronize()
        s = (time.perf_counter() - t) / 5
        if tile in ((32, 256), None):
            res[tile] = out.clone()
        print(f"decode_experts NF4 w13 x {E} tile {tile}: {s * 1e3:.2f} ms, {out.numel() * 2 / s / 1e12:.2f} TB/s of bf16 out")
    print("4-bit kernel equals the tile decode:", torch.equal(res[(32, 256)], res[None]))


if __name__ == "__main__":
    main()
