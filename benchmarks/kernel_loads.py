"""How wide the fused MoE kernels' global loads are: compiles them for sm_90 (no GPU needed: Triton's own
ptxas) and counts the load instructions in the PTX by width, for the plain kernel (`_grouped_gemm`) read
through a `WeightTable` with and without the 16-byte alignment hint, and for the decode kernel
(`_decode_gemm`). A table's per-expert pointer is loaded from memory, so without the hint Triton knows
nothing of its alignment and reads one element a load (`ld.global.b8` per int8 code); 16-byte loads show
as `ld.global.v4.b32` or `cp.async.cg` (16-byte async copies).

    PYTHONPATH=. python benchmarks/kernel_loads.py      # one JSON line at the end
"""

from __future__ import annotations

import collections
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ferrylm.layers import fused_moe as fm
from ferrylm.layers import fused_moe_decode as fmd
from results import write_results  # benchmarks/results.py (scripts run as python benchmarks/x.py)

TARGET = GPUTarget("cuda", 90, 32)
# Mixtral's w13 side: int8 per channel, NF4 g64, bf16
FORMATS = {"bf16": (0, tl.bfloat16, 4096), "int8": (1, tl.int8, 4096), "nf4": (5, tl.uint8, 64)}
DIVISIBLE = {"a_ptr", "w_ptr", "ws_ptr", "wm_ptr", "lut_ptr", "out_ptr", "p_ptr", "rows_ptr", "block_expert_ptr",
             "used_ptr", "scale_ptr", "N", "HALF", "UP", "K", "K_W", "split_w", "stride_am", "stride_wn", "stride_we", "stride_se",
             "stride_om", "stride_ps"}


def loads(fn, sig: dict, constexprs: dict, num_warps: int, num_stages: int = 3) -> dict:
    """Global load instructions by kind in the PTX of `fn` compiled for sm_90 (pointers and strides
    assumed 16-divisible, as Triton specialises them at launch)."""
    names = list(sig)
    sig = {**sig, **{k: "constexpr" for k in constexprs}}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in names if k in DIVISIBLE}
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=TARGET,
                        options=dict(num_warps=num_warps, num_stages=num_stages))
    return dict(collections.Counter(re.findall(r"(ld\.global[\.\w]*|cp\.async\.c[ag])", ck.asm["ptx"])))


def plain(fmt: str, align: int) -> dict:
    f, wt, gs = FORMATS[fmt]
    sig = dict(a_ptr="*bf16", w_ptr="*i64", ws_ptr="*i64", wm_ptr="*i64", lut_ptr="*fp32", out_ptr="*bf16",
               rows_ptr="*i64", block_expert_ptr="*i64", used_ptr="*i64", scale_ptr="*fp32", N="i32", K="i32",
               A="i32", UP="i32", stride_am="i32", stride_we="i32", stride_wn="i32", stride_se="i32", stride_sn="i32",
               stride_om="i32")
    ce = dict(TOP_K=2, A_BY_TOKEN=True, GATED=True, SCALE=False, MAPPED=True, FMT=f, GS=gs, PER_ROW=gs == 4096,
              W_T=wt, S_T=tl.float32, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128 if f == 0 else 256, ALIGN=align)
    return loads(fm._grouped_gemm, sig, ce, 4 if f == 0 else 8)


def decode(fmt: str, cfg: fmd.DecodeConfig) -> dict:
    f, wt, gs = FORMATS[fmt]
    sig = dict(a_ptr="*bf16", w_ptr="*i64", ws_ptr="*i64", wm_ptr="*i64", lut_ptr="*fp32", p_ptr="*fp32",
               rows_ptr="*i64", block_expert_ptr="*i64", used_ptr="*i64", N="i32", HALF="i32", UP="i32", K_W="i32", A="i32", a_div="i32",
               split_w="i32", stride_am="i32", stride_we="i32", stride_wn="i32", stride_se="i32", stride_sn="i32",
               stride_ps="i32")
    ce = dict(MAPPED=True, ALIGN=16, FMT=f, GS=gs, PER_ROW=gs == 4096, CPW=fmd._cpw("dense" if f == 0 else fmt),
              W_T=tl.bfloat16 if f == 0 else tl.int32, S_T=tl.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
              BLOCK_K=cfg.block_k, DOT=cfg.dot, NF4_SELECT=cfg.nf4_select, EVEN_K=True)
    return loads(fmd._decode_gemm, sig, ce, cfg.num_warps, cfg.num_stages)


def main() -> None:
    rows = []
    for fmt in FORMATS:
        for align in (1, 16):
            rows.append({"kernel": "plain", "format": fmt, "align_hint": align, "loads": plain(fmt, align)})
            print(rows[-1], flush=True)
        for cfg in fmd.sweep_configs("dense" if fmt == "bf16" else fmt)[:1] + fmd.sweep_configs(fmt)[6:7]:
            rows.append({"kernel": "decode", "format": fmt, "config": cfg.__dict__, "loads": decode(fmt, cfg)})
            print(rows[-1], flush=True)
    write_results("kernel_loads", rows, target="sm_90")


if __name__ == "__main__":
    main()
