"""One layer's host experts (`offload/host_experts.HostExperts`, the CPU side of the hybrid path) on every
bank format the engine holds, measured the way the engine calibrates (`offload/calibration.measure`): the
expert's copy to the device, the host's time at 1 / 4 / 16 / 64 tokens, at 1 token beside running copies,
the copy beside the host's compute, and (CUDA, pinned mapped banks) the fused kernel's in-place read rate
alone and beside the host; plus `HostExperts.rows` at one token and k experts (the call the graphed decode
path makes: its per-call overhead over the bare expert calls) and `cost_model.cpu_share`, the fraction of
non-resident bytes the host should take.

Baselines in the same run: this machine's plain multi-threaded read bandwidth (alone and beside a copy) and
the plain torch `expert_mlp` on the bf16 expert (what calibration timed before).
The banks are random bytes in each format's layout (E experts, allocated through the host tier: pinned and
mapped on CUDA), so building them costs no quantization.

    python benchmarks/bench_host_experts.py [--threads 16] [--shape mixtral] [--formats bf16 int4min nf4 ...]
        [--experts 4] [--k 2] [--out FILE]

The last line printed is JSON (per format: expert_bytes, copy_ms, cpu_ms {tokens}, cpu_gb_s (1 token),
cpu_beside_copy_ms, copy_beside_cpu_ms, inplace_gb_s, inplace_beside_cpu_gb_s, rows_ms, cpu_share, and for
a dense or per-channel int8 bank the GEMM the calibration chose: host_gemm, host_gemm_max_t, host_gemm_multi,
cpu_beside_copy_ms_by_gemm).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from ferrylm.layers.fused_moe import ExpertWeights
from ferrylm.layers.moe import expert_mlp
from ferrylm.offload import calibration
from ferrylm.offload.cost_model import cpu_share
from ferrylm.offload.host_experts import HostExperts
from ferrylm.offload.host_tier import HostTier
from bench_cpu_experts import read_bandwidth  # benchmarks/ (scripts run as python benchmarks/x.py)
from results import write_results  # benchmarks/results.py

SHAPES = {"mixtral": (4096, 14336), "qwen3-30b": (2048, 768), "qwen3-235b": (4096, 1536), "tiny": (256, 512)}
FORMATS = {  # name -> (kernel format, group, parts: name -> (dtype, columns per K or None for one column))
    "bf16": None,
    "int8": ("int8", None, {"q": (torch.int8, 1), "scale": (torch.float32, None)}),
    "int8-g32": ("int8", 32, {"q": (torch.int8, 1), "scale": (torch.float16, 1 / 32)}),
    "fp8": ("fp8", None, {"q": (torch.uint8, 1), "scale": (torch.float32, None)}),
    "int4": ("int4", 32, {"q": (torch.uint8, 1 / 2), "scale": (torch.float16, 1 / 32)}),
    "int4min": ("int4min", 32, {"q": (torch.uint8, 1 / 2), "scale": (torch.float16, 1 / 32),
                                "min": (torch.float16, 1 / 32)}),
    "nf4": ("nf4", 64, {"q": (torch.uint8, 1 / 2), "scale": (torch.float32, 1 / 64)}),
}


def side(host: HostTier, fmt: str, E: int, N: int, K: int):
    """A random bank side [E, N, K] in `fmt`, in host-tier memory."""
    g = torch.Generator().manual_seed(N * K)
    spec = FORMATS[fmt]
    if spec is None:
        return host.empty((E, N, K), torch.bfloat16).normal_(0, 0.02, generator=g)
    kfmt, group, parts = spec
    out = {}
    for name, (dtype, per_k) in parts.items():
        cols = 1 if per_k is None else int(K * per_k)
        t = host.empty((E, N, cols), dtype)
        if dtype == torch.int8:
            t.random_(-127, 128, generator=g)
        elif dtype == torch.uint8:  # fp8: finite positive e4m3 codes only (0x7f is NaN)
            t.random_(0, 0x7E if kfmt == "fp8" else 256, generator=g)
        else:
            t.uniform_(1e-3, 1.1e-2, generator=g)
        out[name] = t
    return ExpertWeights(kfmt, (E, N, K), group or K, out["q"], out.get("scale"), out.get("min"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shape", default="mixtral", choices=sorted(SHAPES))
    ap.add_argument("--formats", nargs="+", default=["bf16", "int8", "fp8", "int4", "int4min", "nf4"],
                    choices=list(FORMATS))
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--k", type=int, default=2, help="experts a token routes to, for the rows() call")
    ap.add_argument("--thread-sweep", type=int, nargs="*", default=[],
                    help="also time 1 token alone and beside copies with these torch thread counts (e.g. 15 14: "
                         "a core left to the thread that drives the device)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    H, I = SHAPES[a.shape]
    E = max(a.experts, a.k)
    bw = read_bandwidth()
    print(f"plain read: {bw:.1f} GB/s with {torch.get_num_threads()} threads", flush=True)
    rows = []
    for fmt in a.formats:
        host = HostTier(pin=cuda)
        w13, w2 = side(host, fmt, E, 2 * I, H), side(host, fmt, E, H, I)
        mapped = cuda and all(host.is_mapped(t) for s in (w13, w2)
                              for t in (s.parts.values() if isinstance(s, ExpertWeights) else (s,)))
        he = HostExperts(w13, w2, F.silu)
        t0 = time.perf_counter()
        m = calibration.measure(w13, w2, F.silu, device, he, mapped)
        took = time.perf_counter() - t0
        costs = calibration.costs_from(m)
        # rows() at one token, k experts (pinned inputs, as the graphed decode path hands them over)
        x = torch.randn(1, H, dtype=torch.bfloat16)
        ids = torch.arange(a.k)[None].clone()
        wts = torch.full((1, a.k), 1.0 / a.k)
        out = torch.empty(a.k, H, dtype=torch.bfloat16)
        if cuda:
            x, ids, wts, out = (t.pin_memory() for t in (x, ids, wts, out))
        he.rows(x, ids, wts, out)
        reps, t1 = 5, time.perf_counter()
        for r in range(reps):
            ids[0] = (torch.arange(a.k) + r * a.k) % E
            he.rows(x, ids, wts, out)
        rows_s = (time.perf_counter() - t1) / reps
        row = {"format": fmt, "bank_format": he.format, "expert_bytes": m["expert_bytes"], "copy_ms": m["copy_s"] * 1e3,
               "cpu_ms": {n: s * 1e3 for n, s in m["cpu_s"].items()},
               "cpu_gb_s": m["expert_bytes"] / m["cpu_s"]["1"] / 1e9,
               "cpu_beside_copy_ms": m["cpu_s_beside_copy"]["1"] * 1e3,
               "cpu_beside_copy_gb_s": m["expert_bytes"] / m["cpu_s_beside_copy"]["1"] / 1e9,
               "copy_beside_cpu_ms": m["copy_s_beside_cpu"] * 1e3,
               "inplace_gb_s": m.get("inplace_gbs"), "inplace_beside_cpu_gb_s": m.get("inplace_gbs_beside_cpu"),
               "rows_ms": rows_s * 1e3, "rows_overhead_ms": (rows_s - a.k * m["cpu_s"]["1"]) * 1e3,
               "cpu_share": cpu_share(costs), "measure_s": took,
               "kernel": type(he.expert(0).gate_up).__name__,
               "host_gemm": m.get("dense_gemm", m.get("packed_gemm")),
               "host_gemm_max_t": m.get("dense_gemm_max_t", m.get("packed_gemm_max_t")),
               "host_gemm_multi": m.get("dense_gemm_multi", m.get("packed_gemm_multi")),
               "cpu_beside_copy_ms_by_gemm": {g: s * 1e3 for g, s in m.get("cpu_s_beside_copy_by_gemm", {}).items()}}
        threads = torch.get_num_threads()
        sweep = {}
        copy = calibration._copier(w13, w2, device)
        x1 = torch.randn(1, H, dtype=he.dense_dtype)
        experts = [he.expert(e) for e in range(min(E, calibration.CYCLE))]
        one = lambda: [ex(x1) for ex in experts]  # noqa: E731
        for n in a.thread_sweep:
            torch.set_num_threads(n)
            alone = calibration._timeit(one, 5) / len(experts)
            with calibration._Beside(copy):
                beside = calibration._timeit(one, 5) / len(experts)
            sweep[n] = {"ms": alone * 1e3, "beside_copy_ms": beside * 1e3}
        torch.set_num_threads(threads)
        row["thread_sweep"] = sweep
        if fmt == "bf16":  # the baseline: plain torch expert_mlp, what calibration timed before
            xs = torch.randn(1, H, dtype=torch.bfloat16)
            ws = [(w13[e], w2[e]) for e in range(E)]
            row["expert_mlp_ms"] = calibration._timeit(lambda: [expert_mlp(xs, *w, F.silu) for w in ws]) / E * 1e3
        rows.append(row)
        print(" | ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        del he, w13, w2
        host.close()
    write_results("host_experts", rows, out=a.out, device=str(device), shape=a.shape,
                  threads=torch.get_num_threads(), read_bw_gb_s=bw)

if __name__ == "__main__":
    main()
