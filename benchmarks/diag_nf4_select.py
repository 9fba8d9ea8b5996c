"""One-off diagnosis (session 24): tests/test_fused_moe_decode.py::test_nf4_select_tree_equals_table failed on an
H100; print how p differs from the fp32 levels (row order, bf16 rounding) for both NF4 decode paths."""
import torch

from ferrylm.layers import fused_moe_decode as fmd
from ferrylm.layers.fused_moe import ExpertWeights
from ferrylm.weights import quant

DEV, DT = "cuda", torch.bfloat16
n = 16
codes = torch.arange(16, dtype=torch.uint8).repeat(n * 2 * 64 // 16)
qt = quant.quantize_nf4(torch.zeros(2 * n, 64), 64)
qt.parts["q"] = (codes[0::2] | (codes[1::2] << 4))[: qt.parts["q"].numel()]
b13 = ExpertWeights.stack([[qt]], DT).to(DEV)
want = b13.dequantize(torch.float32)[0][:, :16].T.float()
x = torch.eye(64, device=DEV)[:16].to(DT)
ids = torch.zeros(16, 1, dtype=torch.long, device=DEV)
print("align rows", fmd.align(ids, 1, 16)[0][:20].tolist())
for sel in (False, True):
    cfg = fmd.DecodeConfig(nf4_select=sel, block_m=16, dot=False, block_k=64)
    p = fmd._gemm(x, b13, *fmd.align(ids, 1, 16)[:3], 1, 16, 1, 1, cfg).sum(0)
    d = (p - want).abs()
    print(f"select={sel} p {tuple(p.shape)} {p.dtype}: max diff {d.max().item():.3e} at {divmod(d.argmax().item(), p.shape[1])}; "
          f"equal to bf16-rounded levels: {torch.equal(p, want.to(DT).float())}; rows permuted: "
          f"{sorted(map(tuple, p.tolist())) == sorted(map(tuple, want.tolist())) and not torch.equal(p, want)}")
    print("  p row 1:", [round(v, 5) for v in p[1, :4].tolist()], "want row 1:", [round(v, 5) for v in want[1, :4].tolist()])
