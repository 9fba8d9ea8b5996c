"""Paged attention microbenchmark: the Triton kernels against the torch path, one Llama-3-8B-shaped layer
(32 query heads, 8 KV heads, head_dim 128, bf16, 16-token blocks scattered over the pool).

Decode: batch 1/16/64 x context 1k/4k/16k, through `PagedAttention.forward` (K/V write + attention) as the
model runs it, replayed from a CUDA graph so launch overhead is not measured (decode runs graphed). Reports
the KV bytes read per second against the read bandwidth measured in the same run (a bf16 sum over 4 GiB),
for the torch path, the Triton kernel on a bf16 cache and on an fp8 cache (half the bytes; its roofline
is the same GB/s, so pct is against the bf16 bytes' time budget too: `pct_roofline_bf16_bytes`).
Prefill: a 2k-token prompt and a 2k chunk after a 2k cached prefix, TFLOP/s (causal FLOPs actually
needed) against the bf16 matmul rate measured in the same run.

    python benchmarks/bench_attention.py [--batches 1,16,64] [--contexts 1024,4096,16384] [--iters 20]
                                         [--splits N]   # force the flash-decoding split count (tuning)

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch

from ferrylm.kv.cache import KVCache
from ferrylm.layers.attention import PagedAttention
from ferrylm.layers.context import ForwardContext, forward_context
from gpu_timing import graphed_us  # benchmarks/gpu_timing.py (scripts run as python benchmarks/x.py)

H, HK, D, PAGE = 32, 8, 128, 16
DEV = torch.device("cuda")


def read_gb_s() -> float:
    x = torch.ones(2 << 30, dtype=torch.bfloat16, device=DEV)  # 4 GiB
    us = graphed_us(lambda: x.sum(), 5)
    return x.nbytes / us / 1e3


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=DEV)
    us = graphed_us(lambda: a @ a, 5)
    return 2 * 8192 ** 3 / us / 1e6


def step(starts: list[int], news: list[int], kv_dtype=None, seed: int = 0):
    """One layer's cache holding `starts[i]` tokens per sequence (scattered blocks) and q/k/v for the step."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    lens = [s + n for s, n in zip(starts, news)]
    need = [-(-L // PAGE) for L in lens]
    nblocks = sum(need) + 1
    perm = torch.randperm(nblocks, device=DEV, generator=g)
    width = max(need)
    tables = torch.zeros(len(lens), width, dtype=torch.long, device=DEV)
    at, slots = 0, []
    for i, n in enumerate(need):
        tables[i, :n] = perm[at:at + n]
        at += n
        pos = torch.arange(starts[i], lens[i], device=DEV)
        slots.append(tables[i, pos // PAGE] * PAGE + pos % PAGE)
    kv = KVCache(1, nblocks, PAGE, HK, D, torch.bfloat16, DEV, kv_dtype=kv_dtype)
    kv.k.normal_(generator=g) if kv_dtype is None else kv.k.copy_(torch.randn(kv.k.shape, device=DEV, generator=g))
    kv.v.normal_(generator=g) if kv_dtype is None else kv.v.copy_(torch.randn(kv.v.shape, device=DEV, generator=g))
    T = sum(news)
    q = torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, HK, D, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, HK, D, device=DEV, dtype=torch.bfloat16, generator=g)
    qsl = [0]
    for n in news:
        qsl.append(qsl[-1] + n)
    nd = sum(1 for n in news if n == 1)
    ctx = ForwardContext(query_start_loc=qsl, start_pos=starts, seq_lens=lens, slot_mapping=torch.cat(slots),
                         block_tables=tables, num_decodes=nd, kv_cache=kv,
                         decode_seq_lens=torch.tensor(lens[:nd], device=DEV) if nd else None,
                         decode_max_len=max(lens[:nd], default=0))
    return q, k, v, ctx


def run_layer(backend: str, q, k, v, ctx, iters: int) -> float:
    attn = PagedAttention(0, H, HK, D, D ** -0.5)
    attn.backend = backend

    def fn():
        with forward_context(ctx):
            attn(q, k, v)

    with torch.inference_mode():
        return graphed_us(fn, iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--splits", type=int, default=None, help="force the decode split count (default: heuristic)")
    a = p.parse_args()
    if a.splits:
        from ferrylm.layers import triton_attention

        triton_attention.decode_splits = lambda *args: a.splits
    bw, mm = read_gb_s(), matmul_tflops()
    print(f"{torch.cuda.get_device_name()}: read {bw:.0f} GB/s, bf16 matmul {mm:.0f} TFLOP/s")
    rows = []
    for B in map(int, a.batches.split(",")):
        for S in map(int, a.contexts.split(",")):
            bf16_bytes = B * S * HK * D * 2 * 2  # K and V, bf16
            row = {"case": "decode", "batch": B, "context": S, "kv_mb": round(bf16_bytes / 1e6, 1)}
            for name, backend, kvd in (("torch", "torch", None), ("triton", "triton", None),
                                       ("triton_fp8", "triton", torch.float8_e4m3fn)):
                q, k, v, ctx = step([S - 1] * B, [1] * B, kv_dtype=kvd)
                nbytes = bf16_bytes // (2 if kvd else 1) + (B * S * HK * 4 * 2 if kvd else 0)  # + fp32 scales
                try:
                    us = run_layer(backend, q, k, v, ctx, a.iters)
                except torch.OutOfMemoryError:
                    us = float("nan")
                del q, k, v, ctx
                torch.cuda.empty_cache()
                row[f"{name}_us"] = round(us, 2)
                row[f"{name}_gb_s"] = round(nbytes / us / 1e3, 1)
                row[f"{name}_pct_roofline"] = round(100 * nbytes / us / 1e3 / bw, 1)
            row["triton_fp8_pct_roofline_bf16_bytes"] = round(100 * bf16_bytes / row["triton_fp8_us"] / 1e3 / bw, 1)
            row["speedup"] = round(row["torch_us"] / row["triton_us"], 2)
            rows.append(row)
            print(f"decode B={B:3d} ctx={S:6d}: torch {row['torch_us']:9.1f} us ({row['torch_pct_roofline']:5.1f}%)  "
                  f"triton {row['triton_us']:8.1f} us ({row['triton_gb_s']:7.0f} GB/s, "
                  f"{row['triton_pct_roofline']:5.1f}%)  fp8 {row['triton_fp8_us']:8.1f} us  x{row['speedup']}")
    for name, starts, news in (("prefill 2k", [0], [2048]), ("chunk 2k after 2k cached", [2048], [2048])):
        n, s0 = news[0], starts[0]
        flops = 4 * H * D * sum(s0 + j + 1 for j in range(n))  # QK^T and PV over the keys each query sees
        row = {"case": name, "tokens": n, "cached": s0}
        for backend in ("torch", "triton"):
            q, k, v, ctx = step(starts, news)
            us = run_layer(backend, q, k, v, ctx, max(2, a.iters // 4))
            row[f"{backend}_us"] = round(us, 1)
            row[f"{backend}_tflops"] = round(flops / us / 1e6, 1)
            row[f"{backend}_pct_roofline"] = round(100 * flops / us / 1e6 / mm, 1)
        row["speedup"] = round(row["torch_us"] / row["triton_us"], 2)
        rows.append(row)
        print(f"{name:26s}: torch {row['torch_us']:8.1f} us ({row['torch_tflops']:6.1f} TFLOP/s)  "
              f"triton {row['triton_us']:8.1f} us ({row['triton_tflops']:6.1f} TFLOP/s)  x{row['speedup']}")
    print(json.dumps({"bench": "attention", "device": torch.cuda.get_device_name(), "splits": a.splits or "auto",
                      "read_gb_s": round(bw, 1),
                      "matmul_tflops": round(mm, 1), "shape": {"q_heads": H, "kv_heads": HK, "head_dim": D,
                                                                "block_size": PAGE}, "rows": rows}))


if __name__ == "__main__":
    main()
