"""A layer's host experts in one native call against one call an expert (`layers/cpu_experts.native_batched_experts`),
through `offload/host_experts.HostExperts.rows` as the hybrid engine calls it, on a bf16, NF4 or fp8 bank of a
many-small-expert shape (Qwen3-30B-A3B: 128 experts of 9.4 MB a layer in bf16) under "native". Each round routes
fresh tokens (top-k of E, uniform) and takes the experts left after `--gpu-share` of them are marked computed elsewhere (-1), so the bank
(1.2 GB) comes from DRAM, not cache. Baseline in the same run: a plain multi-threaded read of the host's memory
(the roofline: the experts' bytes at that rate).

    python benchmarks/bench_host_batched.py [--shape qwen3-30b] [--format bf16|nf4|fp8] [--tokens 1 4 16 64]
        [--threads 16] [--out FILE]

Per token count: experts run a call, ms a call batched and one by one (medians), and the batched native call alone
(its inputs gathered beforehand: what `rows`' Python around it costs), GB/s of expert bytes, and their ratio to the
read rate. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ferrylm.layers import cpu_experts as C
from ferrylm.layers import host_native
from ferrylm.offload.host_experts import HostExperts
from ferrylm.offload.host_tier import HostTier
from bench_cpu_experts import read_bandwidth  # benchmarks/ (scripts run as python benchmarks/x.py)
from bench_host_experts import side
from results import write_results  # benchmarks/results.py

SHAPES = {"qwen3-30b": (128, 8, 2048, 768), "qwen3-235b": (128, 8, 4096, 1536), "deepseek-v2-lite": (64, 6, 2048, 1408),
          "mixtral": (8, 2, 4096, 14336)}  # experts, k, hidden, intermediate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b", choices=sorted(SHAPES))
    ap.add_argument("--format", default="bf16", choices=["bf16", "nf4", "fp8"],
                    help="the bank's (random bytes in its layout)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--gpu-share", type=float, default=0.5, help="fraction of a round's experts computed elsewhere")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None, help="the tree's commit (a device checkout reports its base commit)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not host_native.nf4_bf16():
        raise SystemExit(f"needs the native AVX512-BF16 kernels: {host_native.why_unavailable() or 'no AVX512-BF16'}")
    E, k, H, I = SHAPES[args.shape]
    g = torch.Generator().manual_seed(0)
    host = HostTier(pin=False)
    he = HostExperts(side(host, args.format, E, 2 * I, H), side(host, args.format, E, H, I), F.silu)
    he.prepare()  # (NF4: each expert's kernels over views of the bank, built once)
    C.dense_gemm, C.dense_gemm_max_t, C.row_blocks_gemm = "native", 64, "native"
    read = read_bandwidth(1.0)
    print(f"{args.shape} {args.format}: {E} experts of {he.expert_bytes / 1e6:.1f} MB, k {k}, "
          f"{torch.get_num_threads()} threads, plain read {read:.1f} GB/s, AMX {host_native.amx()}")
    rows = []
    modes = ("batched", "one_by_one", "kernel")
    for T in args.tokens:
        times: dict[str, list[float]] = {m: [] for m in modes}
        used, kernel_used = [], []
        for r in range(args.rounds):
            for mode in modes[r % 3:] + modes[:r % 3]:  # rotate which goes first
                # fresh routing for each: the other's experts may still sit in the last-level cache
                ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
                experts = ids.unique()
                elsewhere = experts[torch.randperm(len(experts), generator=g)[:int(args.gpu_share * len(experts))]]
                ids[torch.isin(ids, elsewhere)] = -1
                used.append(len(ids[ids >= 0].unique()))
                x, w = torch.randn(T, H, generator=g).bfloat16(), torch.rand(T, k, generator=g)
                out = torch.empty(T * k, H, dtype=torch.bfloat16)
                C.native_batched_experts = mode != "one_by_one"
                if mode == "kernel":  # the native call alone, its inputs gathered beforehand (`rows` less its Python)
                    tokens = {e: (ids == e).sum().item() for e in ids[ids >= 0].unique().tolist()}
                    batch = he._native_batch(x, tokens, 0)
                    if not batch:  # fewer than `cpu_experts.native_batch_min` experts: no batched call to time
                        continue
                    kernel_used.append(len(batch))
                    xs = x.index_select(0, torch.cat([(ids == e).any(1).nonzero()[:, 0] for e in batch]))
                    t0 = time.perf_counter()
                    he._batched(xs, [tokens[e] for e in batch], batch, 0)
                else:
                    t0 = time.perf_counter()
                    he.rows(x, ids, w, out)
                times[mode].append(time.perf_counter() - t0)
        n = statistics.median(used)
        row = {"tokens": T, "experts_a_call": n}
        for mode in modes:
            if len(times[mode]) < 2:
                row |= {f"{mode}_ms": None, f"{mode}_gb_s": None, f"{mode}_of_read": None}
                continue
            ms = statistics.median(times[mode][1:]) * 1e3  # (the first round builds the per-expert kernels)
            gb_s = (statistics.median(kernel_used) if mode == "kernel" else n) * he.expert_bytes / ms / 1e6
            row |= {f"{mode}_ms": round(ms, 3), f"{mode}_gb_s": round(gb_s, 1),
                    f"{mode}_of_read": round(gb_s / read, 2)}
        row["speedup"] = round(row["one_by_one_ms"] / row["batched_ms"], 2) if row["batched_ms"] else None
        rows.append(row)
        print(f"  {T:3d} tokens, {n:5.1f} experts: batched {row['batched_ms']} ms ({row['batched_gb_s']} GB/s, "
              f"{row['batched_of_read']} of read; the native call alone {row['kernel_ms']} ms, "
              f"{row['kernel_of_read']}), one by one {row['one_by_one_ms']} ms ({row['one_by_one_gb_s']} GB/s): "
              f"{row['speedup']}x")
    write_results("host_batched", rows, args.out, **({"commit": args.commit} if args.commit else {}), shape=args.shape,
                  format=args.format, read_gb_s=round(read, 1), threads=torch.get_num_threads(),
                  amx=host_native.amx(), gpu_share=args.gpu_share)


if __name__ == "__main__":
    main()
