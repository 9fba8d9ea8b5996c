"""The fused MoE's prefill GEMMs: the Triton grouped kernel (`fused_moe.expert_rows(..., decode=False)`) against
torch's grouped GEMM (`fused_moe.grouped_rows`, CUTLASS on sm_90) on dense bf16 banks of real shapes, at prefill
token counts, with uniform random routing. Per case: milliseconds, TFLOP/s (2 x 3 x H x I per assignment) and
the share of the matmul rate a plain 8192^3 bf16 GEMM reaches in the same run; the two paths' max difference.
It prints the smallest assignments-per-expert from which the grouped GEMM wins on every shape: the value for
`fused_moe.GROUPED_MM_MIN_ROWS` (session 8: the Triton kernel's prefill reached ~0.2 of peak in `bench_plan.py`).
`--packed nf4|int4|int8`: packed banks instead, the kernel's in-tile decode against `fused_moe.dequant_rows`
(each expert decoded once, then dense GEMMs; its "grouped" columns), for `fused_moe.PACKED_DENSE_MIN_ROWS`.

    PYTHONPATH=. python benchmarks/bench_moe_prefill.py            # on the H200, ~1-2 minutes
    PYTHONPATH=. python benchmarks/bench_moe_prefill.py --packed nf4
    PYTHONPATH=. python benchmarks/bench_moe_prefill.py --smoke    # CPU: tiny shapes, the grouped path only
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from results import write_results  # benchmarks/results.py

SHAPES = {  # name: (experts, top_k, hidden, expert intermediate)
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "yuan2-m32": (32, 2, 2048, 8192),
    "deepseek-v3-64e": (64, 8, 7168, 2048),  # 64 of its 256 experts: the same GEMM shapes, a quarter the bank
}


def time_ms(fn, iters: int, cuda: bool) -> float:
    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[256, 1024, 2048, 8192])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--packed", choices=["nf4", "int4", "int8"],
                    help="a packed bank instead: the Triton kernel's in-tile decode against `dequant_rows` (each "
                         "expert decoded once, dense GEMMs): the value for `fused_moe.PACKED_DENSE_MIN_ROWS`")
    ap.add_argument("--decode-kernel", action="store_true",
                    help="with --packed: also time `fused_moe_decode`'s kernel with its by-format tiles at every "
                         "token count (its bound: `BY_FORMAT_MAX_TOKENS`)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, the grouped (or dequant) path only")
    ap.add_argument("--out")
    a = ap.parse_args()
    from ferrylm.layers import fused_moe

    cuda = torch.cuda.is_available() and not a.smoke
    dev = "cuda" if cuda else "cpu"
    if not cuda and not a.smoke:
        raise SystemExit("bench_moe_prefill: needs a CUDA GPU (or --smoke for a CPU run on tiny shapes)")
    peak = None
    if cuda:
        m = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        peak = 2 * 8192 ** 3 / (time_ms(lambda: m @ m, 5, cuda) / 1e3) / 1e12
        del m
        print(f"plain 8192^3 bf16 GEMM: {peak:.0f} TFLOP/s", flush=True)
    if a.smoke and a.out is None:  # a smoke run is no result
        import tempfile

        a.out = os.path.join(tempfile.mkdtemp(prefix="moe-prefill-"), "smoke.json")
    rows = []
    for name in (a.shapes if not a.smoke else a.shapes[:1]):
        E, k, H, I = SHAPES[name] if not a.smoke else (8, 2, 64, 64)
        g = torch.Generator(device=dev).manual_seed(0)
        w13 = (torch.randn(E, 2 * I, H, device=dev, generator=g) * 0.02).bfloat16()
        w2 = (torch.randn(E, H, I, device=dev, generator=g) * 0.02).bfloat16()
        if a.packed:
            from ferrylm.weights import quant

            q = {"nf4": lambda t: quant.quantize_nf4(t, 64), "int4": lambda t: quant.quantize_int4(t, 32, "min"),
                 "int8": lambda t: quant.quantize_int8(t)}[a.packed]
            w13 = fused_moe.ExpertWeights.stack([[q(w13[e, :I].float()), q(w13[e, I:].float())] for e in range(E)],
                                                torch.bfloat16)
            w2 = fused_moe.ExpertWeights.stack([[q(w2[e].float())] for e in range(E)], torch.bfloat16)
        elif not fused_moe.grouped_mm_usable(torch.empty(1, H, dtype=torch.bfloat16, device=dev), w13, w2):
            raise SystemExit(f"bench_moe_prefill: torch's grouped GEMM cannot run {name} here (sm_90 and bf16 only)")
        for T in a.tokens if not a.smoke else [16, 64]:
            x = torch.randn(T, H, device=dev, generator=g).bfloat16()
            logits = torch.randn(T, E, device=dev, generator=g)
            w, ids = torch.softmax(logits, -1).topk(k, -1)
            flops = 2 * 3 * T * k * H * I
            row = dict(shape=name, tokens=T, experts=E, top_k=k, hidden=H, inter=I, rows_per_expert=T * k / E)
            grouped = (lambda: fused_moe.dequant_rows(x, w13, w2, ids, w)) if a.packed else \
                (lambda: fused_moe.grouped_rows(x, w13, w2, ids, w))  # "grouped": the path that would replace it
            row["grouped_ms"] = time_ms(grouped, a.iters, cuda)
            row["grouped_tflops"] = flops / (row["grouped_ms"] / 1e3) / 1e12
            if cuda:
                triton_ = lambda: fused_moe.expert_rows(x, w13, w2, ids, w, decode=False)  # noqa: E731
                row["triton_ms"] = time_ms(triton_, a.iters, cuda)
                row["triton_tflops"] = flops / (row["triton_ms"] / 1e3) / 1e12
                row["grouped_vs_triton"] = row["triton_ms"] / row["grouped_ms"]
                row["grouped_share_of_gemm"] = row["grouped_tflops"] / peak
                row["triton_share_of_gemm"] = row["triton_tflops"] / peak
                ref = triton_().float()
                row["max_rel_diff"] = ((grouped().float() - ref).abs().max() / ref.abs().max()).item()
                if a.packed and a.decode_kernel:  # the decode kernel with its by-format tiles, past its token bound
                    from ferrylm.layers import fused_moe_decode as fmd

                    cfg = fmd.by_format_config(a.packed, False, T)
                    if fmd.readable(w13, cfg) is None and fmd.readable(w2, cfg) is None:
                        dec = lambda: fused_moe.expert_rows(x, w13, w2, ids, w, decode=cfg)  # noqa: E731
                        row["decode_ms"] = time_ms(dec, a.iters, cuda)
                        row["decode_vs_triton"] = row["triton_ms"] / row["decode_ms"]
                        row["decode_vs_grouped"] = row["grouped_ms"] / row["decode_ms"]
                        row["decode_max_rel_diff"] = ((dec().float() - ref).abs().max() / ref.abs().max()).item()
            rows.append(row)
            print({k_: round(v, 3) if isinstance(v, float) else v for k_, v in row.items()}, flush=True)
        del w13, w2
        if cuda:
            torch.cuda.empty_cache()
    wins = sorted({r["rows_per_expert"] for r in rows if r.get("grouped_vs_triton", 0) > 1.0})
    threshold = next((t for t in wins if all(r.get("grouped_vs_triton", 0) > 1.0 for r in rows
                                             if r["rows_per_expert"] >= t)), None)
    print(f"grouped GEMM wins from {threshold} assignments per expert on every shape" if threshold is not None
          else "grouped GEMM does not win on every shape at any measured size", flush=True)
    write_results("moe-prefill", rows, out=a.out, gemm_tflops=peak, packed=a.packed,
                  **{"dequant_min_rows" if a.packed else "grouped_min_rows": threshold})


if __name__ == "__main__":
    main()
