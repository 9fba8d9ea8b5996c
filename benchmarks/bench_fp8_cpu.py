"""fp8 on the CPU, each fast path beside its plain path in one run (session 24):

- "linear": an FP8 checkpoint's Linear (blocks of 128, a DeepSeek-V3 [4096, 2048] shape by default) through
  `qmatmul.Fp8NativeCPU` against `Dequantize` (the plain path: dequantize, then `F.linear`) and the same weight dense
  in bf16 (`F.linear`), at several token counts; the weight stays hot in cache between calls, as a Linear's does
  not in a real step, so these are the kernels' compute costs.
- "expert": fp8 host experts (Qwen3-30B-A3B shape, blocks of 128, `--experts` cycled so reads come from DRAM) whole
  in one native call (`host_native.expert_silu_fp8`) against its two GEMVs with torch's SiLU between, on AMX tiles
  and on the AVX512-BF16 kernel, and the same experts in bf16 (the fused native bf16 expert).
- "window": hybrid decode's host part of a split fp8 expert (columns [I/3, I)) in one native call against the
  window's three kernels with torch's ops between (session 25).

Median ms of `--reps` timings. Writes benchmarks/results/fp8-cpu-<date>.json.

    PYTHONPATH=. python benchmarks/bench_fp8_cpu.py [--cases linear expert] [--tokens 1 4 32] [--experts 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import write_results  # noqa: E402

from ferrylm.layers import cpu_experts as C  # noqa: E402
from ferrylm.layers import host_native  # noqa: E402
from ferrylm.layers.fused_moe import ExpertWeights  # noqa: E402
from ferrylm.layers.qmatmul import Dequantize, QuantKernel  # noqa: E402
from ferrylm.offload.host_experts import HostExperts  # noqa: E402
from ferrylm.weights import quant as Q  # noqa: E402


def median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2] * 1e3


def case_linear(rows: list, a) -> None:
    torch.manual_seed(0)
    w = torch.randn(a.out_features, a.in_features) * 0.02
    qt = Q.quantize_fp8(w, 128)
    native, plain, dense = QuantKernel.for_tensor(qt), Dequantize(qt), w.to(torch.bfloat16)
    for T in a.tokens:
        x = torch.randn(T, a.in_features)
        row = {"case": "linear", "shape": [a.out_features, a.in_features], "tokens": T, "kernel": native.name,
               "native_ms": median_ms(lambda: native(x), a.reps), "plain_ms": median_ms(lambda: plain(x), a.reps),
               "dense_bf16_ms": median_ms(lambda: F.linear(x.to(torch.bfloat16), dense), a.reps)}
        row["native_vs_plain"] = row["plain_ms"] / row["native_ms"]
        row["native_vs_dense_bf16"] = row["dense_bf16_ms"] / row["native_ms"]
        rows.append(row)
        print(row, flush=True)


def fp8_banks(E: int, H: int, I: int) -> tuple:
    """Seeded random fp8 expert banks (w13, w2) in blocks of 128, as an FP8 checkpoint's experts are held."""
    torch.manual_seed(0)
    w13 = ExpertWeights.stack([[Q.quantize_fp8(torch.randn(I, H) * .02, 128), Q.quantize_fp8(torch.randn(I, H) * .02, 128)]
                               for _ in range(E)], torch.bfloat16)
    w2 = ExpertWeights.stack([[Q.quantize_fp8(torch.randn(H, I) * .02, 128)] for _ in range(E)], torch.bfloat16)
    return w13, w2


def case_expert(rows: list, a) -> None:
    E, H, I = a.experts, a.hidden, a.inter
    w13, w2 = fp8_banks(E, H, I)
    fp8 = HostExperts(w13, w2, F.silu)
    bf16 = HostExperts(w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16), F.silu)
    C.row_blocks_gemm = C.dense_gemm = "native"
    saved = (C.native_fused_expert, C.native_fp8_amx)

    def cycle(he):
        return lambda: [he.expert(e)(x) for e in range(E)]

    try:
        for T in [t for t in a.tokens if t <= host_native.MAX_TOKENS]:
            x = torch.randn(T, H, dtype=torch.bfloat16)
            row = {"case": "expert", "hidden": H, "inter": I, "experts_cycled": E, "tokens": T}
            for fused in (True, False):
                for amx in ((True, False) if host_native.amx() else (False,)):
                    C.native_fused_expert, C.native_fp8_amx = fused, amx
                    key = f"fp8_{'fused' if fused else 'unfused'}_{'amx' if amx else 'avx'}_ms"
                    row[key] = median_ms(cycle(fp8), a.reps) / E
            C.native_fused_expert, C.native_fp8_amx = saved
            row["bf16_native_ms"] = median_ms(cycle(bf16), a.reps) / E
            rows.append(row)
            print(row, flush=True)
    finally:
        C.native_fused_expert, C.native_fp8_amx = saved


def case_window(rows: list, a) -> None:
    """Hybrid decode's host part of a split fp8 expert, columns [c, I) at c = I / 3 rounded to the split unit
    (`HostExperts._columns`): one native call (`HostExpert.window`) against the window's three kernels with
    torch's SiLU and product between (`native_fused_expert` off), experts cycled from DRAM."""
    E, H, I = a.experts, a.hidden, a.inter
    w13, w2 = fp8_banks(E, H, I)
    he = HostExperts(w13, w2, F.silu)
    c = max(he.split_unit, I // 3 // he.split_unit * he.split_unit)
    C.row_blocks_gemm = "native"
    saved = C.native_fused_expert
    try:
        for T in [t for t in a.tokens if t <= host_native.MAX_TOKENS]:
            x = torch.randn(T, H, dtype=torch.bfloat16)
            row = {"case": "window", "hidden": H, "inter": I, "cols_from": c, "experts_cycled": E, "tokens": T}
            for fused in (True, False):
                C.native_fused_expert = fused
                row[f"fp8_window_{'fused' if fused else 'three_kernels'}_ms"] = median_ms(
                    lambda: [he._columns(e, x, c) for e in range(E)], a.reps) / E
            C.native_fused_expert = saved
            row["fused_vs_three"] = row["fp8_window_three_kernels_ms"] / row["fp8_window_fused_ms"]
            rows.append(row)
            print(row, flush=True)
    finally:
        C.native_fused_expert = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["linear", "expert", "window"], choices=("linear", "expert", "window"))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--in-features", type=int, default=2048)
    ap.add_argument("--out-features", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not host_native.available() or not host_native.nf4_bf16():
        sys.exit(f"the native fp8 kernels do not run here: {host_native.why_unavailable() or 'no AVX512-BF16'}")
    rows: list = []
    for case in a.cases:
        {"linear": case_linear, "expert": case_expert, "window": case_window}[case](rows, a)
    write_results("fp8-cpu", rows, out=a.out, threads=torch.get_num_threads(), amx=host_native.amx())


if __name__ == "__main__":
    main()
