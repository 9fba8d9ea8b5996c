"""Does the host's one-token bf16 GEMV read an expert at the host's memory speed, alone and beside the copy road?
The question behind hybrid decode's batch-1 ceiling (issue 10): on the H200 host the engine's host side reads a
bf16 expert at ~57 GB/s alone (oneDNN), ~33-37 beside the device's reads, where a plain 16-thread read streams
~93 alone and ~70 beside pinned copies.

One Mixtral-shaped expert's two matrices (w13 [2I, H], w2 [H, I], bf16), cycled over `--experts` experts so the
reads come from DRAM, at each `--threads`; ms an expert and GB/s of its bytes for:
  - torch-sum: torch's multi-threaded sum of one flat buffer of the experts' bytes (`bench_cpu_experts.read_bandwidth`'s
    way: the plain read);
  - read: `host_native.read_bf16` over the rows in the split pool's chunks (`cpu_experts.native_split`, as the engine
    runs "native"): the access pattern's ceiling, loads and an integer add, no GEMV;
  - native pf=D: `host_native.gemv_bf16` on the same chunks with the software prefetch D rows ahead
    (`host_native.gemv_bf16`'s `prefetch`; 0: the hardware prefetchers alone; the engine's "native" runs
    `cpu_experts.NATIVE_PREFETCH_ROWS`);
  - native-bx pf=D: the same with bf16 x on the AVX512-BF16 dot product (`host_native.gemv_bf16_bx`);
  - read-c, native-bx-c pf=D: the read and the bf16-x GEMV on the same chunks from `host_native`'s pool of C
    threads, one call a matrix (`read_bf16_mt`, `gemv_bf16_bx_mt`: what the engine runs at one token where the CPU
    has AVX512-BF16, `cpu_experts.native_c_threads`);
  - plain: oneDNN's `F.linear` on torch's threads (`cpu_experts.dense_gemm = "plain"`).
Each alone and, with CUDA, beside a pinned host -> GPU copy loop (`bench_cpu_experts.H2DCopy`, the copy road's
traffic), with that copy's GB/s. Rounds take the variants in turn; the median is kept.

    PYTHONPATH=. python benchmarks/bench_host_stream.py [--threads 8 16] [--prefetch 0 1 2 4] [--experts 3]
        [--rounds 5] [--small] [--out FILE]

The last line printed is JSON (benchmarks/results/host-stream-<date>.json).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from ferrylm.layers import cpu_experts as C
from ferrylm.layers import host_native
from bench_cpu_experts import H2DCopy  # benchmarks/ (scripts run as python benchmarks/x.py)
from results import write_results  # benchmarks/results.py


def chunked(ws: list[torch.Tensor], threads: int, kernel) -> list[C.SplitRows]:
    """Per matrix, a `SplitRows` over the engine's native chunks whose chunk (a, c) runs kernel(w[a:a + c])."""
    return [C.native_split(w.shape[0], w.shape[1] * w.element_size(), threads,
                           lambda a, c, w=w: kernel(w[a:a + c])) for w in ws]


def _split(w: torch.Tensor, threads: int) -> tuple[int, int]:
    """(threads, rows a chunk) of w as the engine runs it on the C pool (`cpu_experts.c_pool_split`)."""
    return C.c_pool_split(w.shape[0], w.shape[1] * w.element_size(), threads)


def variants(experts: list[list[torch.Tensor]], threads: int, prefetch: list[int]) -> dict:
    """name -> (setup, one expert's call (e, x) -> None); x [1, H] fp32 for the native paths, bf16 for plain."""
    flat = torch.cat([w.reshape(-1) for ws in experts for w in ws]).view(len(experts), -1)  # the same bytes, flat
    out: dict = {"torch-sum": (None, lambda e, x: flat[e].sum())}
    if host_native.available():
        def read(w):
            return lambda x: host_native.read_bf16(w, torch.empty(w.shape[0])).view(1, -1)
        reads = [chunked(ws, threads, read) for ws in experts]
        out["read"] = (None, lambda e, x: [s(x) for s in reads[e]])
        split = {id(w): _split(w, threads) for ws in experts for w in ws}

        def read_c(e, x):  # the same chunks on the C pool: one call a matrix
            for w in experts[e]:
                host_native.read_bf16_mt(w, torch.empty(w.shape[0]), *split[id(w)])
        out["read-c"] = (None, read_c)
        for d in prefetch:
            def gemv(w, d=d):
                return lambda x: host_native.gemv_bf16(x, w, torch.empty(1, w.shape[0]), d)
            gemvs = [chunked(ws, threads, gemv) for ws in experts]

            def native(e, x, gemvs=gemvs):
                g, u = gemvs[e][0](x).chunk(2, dim=1)  # [1, 2I] -> gate, up
                gemvs[e][1]((F.silu(g) * u).contiguous())
            out[f"native pf={d}"] = (None, native)
    if host_native.available() and host_native.nf4_bf16():
        for d in prefetch:
            def gemv_bx(w, d=d):
                return lambda x: host_native.gemv_bf16_bx(x, w, torch.empty(1, w.shape[0]), d)
            bxs = [chunked(ws, threads, gemv_bx) for ws in experts]

            def native_bx(e, x, bxs=bxs):
                g, u = bxs[e][0](x.bfloat16()).chunk(2, dim=1)
                bxs[e][1]((F.silu(g) * u).bfloat16())
            out[f"native-bx pf={d}"] = (None, native_bx)

            def native_bx_c(e, x, d=d):  # the engine's one-token path with `native_c_threads`
                w13, w2 = experts[e]
                y = host_native.gemv_bf16_bx_mt(x.bfloat16(), w13, torch.empty(1, w13.shape[0]), *split[id(w13)], d)
                g, u = y.chunk(2, dim=1)
                h = (F.silu(g) * u).bfloat16()
                host_native.gemv_bf16_bx_mt(h, w2, torch.empty(1, w2.shape[0]), *split[id(w2)], d)
            out[f"native-bx-c pf={d}"] = (None, native_bx_c)

    def plain(e, x):
        w13, w2 = experts[e]
        g, u = F.linear(x, w13).chunk(2, dim=1)
        F.linear(F.silu(g) * u, w2)
    out["plain"] = (None, plain)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    ap.add_argument("--prefetch", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--experts", type=int, default=3, help="distinct experts cycled (defeats the caches)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="shapes / 4 in each dimension (a quick check)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    H, I = (1024, 3584) if a.small else (4096, 14336)
    g = torch.Generator().manual_seed(0)
    experts = [[(torch.randn(2 * I, H, generator=g) * .02).bfloat16(),
                (torch.randn(H, I, generator=g) * .02).bfloat16()] for _ in range(a.experts)]
    nbytes = sum(w.numel() * w.element_size() for w in experts[0])
    besides = ["none"] + (["h2d"] if torch.cuda.is_available() else [])
    rows = []
    for beside in besides:
        for threads in a.threads:
            torch.set_num_threads(threads)
            vs = variants(experts, threads, a.prefetch)
            xs = {"plain": torch.randn(1, H).bfloat16()}
            x32 = torch.randn(1, H)
            times: dict[str, list[float]] = {v: [] for v in vs}
            with H2DCopy() if beside == "h2d" else contextlib.nullcontext() as copier:
                for r in range(a.rounds + 1):
                    for name, (setup, call) in vs.items():
                        if setup is not None:
                            setup()
                        x = xs.get(name, x32)
                        t = time.perf_counter()
                        for e in range(a.experts):
                            call(e, x)
                        if r:  # the first round warms every path (pools, pages)
                            times[name].append((time.perf_counter() - t) / a.experts)
            copy_gb_s = getattr(copier, "gb_s", None)
            for name, ts in times.items():
                s = statistics.median(ts)
                row = {"variant": name, "threads": threads, "beside": beside, "ms": round(s * 1e3, 3),
                       "gb_s": round(nbytes / s / 1e9, 2), "ms_min": round(min(ts) * 1e3, 3),
                       "ms_max": round(max(ts) * 1e3, 3), "copy_gb_s": copy_gb_s and round(copy_gb_s, 1)}
                rows.append(row)
                print(f"beside {beside:4s} threads {threads:2d} {name:12s} {row['ms']:8.2f} ms  {row['gb_s']:6.1f} GB/s"
                      + (f"  (copy {copy_gb_s:.1f} GB/s)" if copy_gb_s else ""), flush=True)
    write_results("host-stream", rows, out=a.out, H=H, I=I, expert_bytes=nbytes, experts=a.experts)


if __name__ == "__main__":
    main()
