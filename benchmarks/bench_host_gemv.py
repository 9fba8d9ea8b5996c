"""Ways to compute one host MoE expert (gate_up -> silu * up -> down, `layers/cpu_experts.HostExpert`) on the
CPU at 1..16 tokens, where the GEMV is memory-bound: GB/s of weight bytes read per expert call, and that
rate over this machine's plain multi-threaded read bandwidth measured in the same run
(`bench_cpu_experts.read_bandwidth`). Each variant cycles over `--experts` distinct experts so the reads
come from DRAM; every variant of a shape is built before its timing starts (all held at once: ~7 GB for the
Mixtral shape with every variant). Variants (each marked `copy` when it needs the weights laid out otherwise than the bank
holds them: landing it means re-laying the bank at load, never a second copy):

- bf16 `plain`: `F.linear` on the [N, K] weight (oneDNN's brgemm matmul: it repacks weight blocks per call),
  the reference path; `split`: `layers/cpu_experts.SplitRows`, the weight's rows in one chunk per thread,
  each a single-threaded `F.linear` on its own Python worker thread (`dense_gemm = "split"`); `split-x2`,
  `split-x4`: 2 / 4 chunks a thread, taken by the threads as they come free;
  `native`: `F.linear` with oneDNN off (`onednn_off` here, a process-wide flag; not in the library: wrong beside
  other threads' matmuls in the engine, see docs/benchmarks.md; torch's own
  kernels, a vectorised GEMV at 1 token, per-element dot products above); `split-native`: both;
  `ferry-native`: the engine's native GEMV (`layers/host_native`, C with AVX-512; bf16 x on the AVX512-BF16 dot
  product over the C thread pool where the CPU has it, else fp32 x on the split pool's workers: `dense_gemm = "native"`;
  each GEMV on its own, torch's SiLU between); `ferry-expert`: the engine's `HostExpert` under that setting (with
  AVX512-BF16, the whole expert in one call on the C pool: `cpu_experts.native_fused_expert`; 2-16 tokens on AMX
  tiles where the CPU has them, `cpu_experts.native_amx`); `ferry-expert-avx`: the same with AMX off;
  `w@xT`: `W @ x.T` (oneDNN with the roles swapped, as `torch.mv`);
  `bmm`: one `torch.bmm` over the rows viewed as [threads, N/threads, K]; `fp32-rows`: rows converted to
  fp32 a few MB at a time and an fp32 GEMM (fp32 accumulation, as `RowBlocks` does for decoded formats);
  `pretransposed` (copy): x @ W.T held as [K, N]; `onednn-packed` (copy): oneDNN's own blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`: no per-call repack), an opaque
  tensor that torch cannot place over a bank's bytes; `split-packed` (copy): that layout per `split` chunk;
- int8 per channel: `int8pack` (`_weight_int8pack_mm`, `layers/qmatmul.Int8PackCPU`), `int8pack-split` and
  `int8pack-split-x4` (its rows split as bf16's `split` / `split-x4`: `layers/cpu_experts.Int8Split`);
- int4 group 32 with a min: `int4pack` (`_weight_int4pack_mm_for_cpu` over codes re-laid in place,
  `layers/cpu_experts.Int4InPlace`), `int4pack-split` and `int4pack-split-x4` (not in the library: each
  chunk needs its own contiguous scales, a re-laid copy of the expert's scale_zero).

`--beside h2d` (CUDA) / `memcpy` times everything beside a running copy (a pinned host -> GPU copy, as the
hybrid decode's GPU side runs; or one thread's memcpy), the ratios then against the plain read beside it:
statically partitioned kernels (torch's OpenMP team) lose most there, when one core is taken
(offload/calibration.py's docstring).

    python benchmarks/bench_host_gemv.py [--threads 16] [--shapes mixtral qwen3-30b yuan-m32]
        [--tokens 1 2 4 8 16] [--variants plain split ...] [--experts 3] [--runs 3] [--small] [--beside h2d]
        [--out FILE]

`--small`: shapes scaled down 4x in each dimension and fewer repetitions (a quick check on a small host).
Random weights (the values do not change the speed). The last line printed is JSON (rows: shape, format,
variant, copy, tokens, ms (per expert call), gb_s, of_read_bw; with `--runs` R > 1 each point is timed R
rounds that take the variants in turn (a shared machine's load falls on all alike), ms the median, ms_min /
ms_max the spread, load_avg_1m the machine's load then and vs_plain the median over rounds of plain's time
over the variant's in the same round), written to
benchmarks/results/host-gemv-<date>.json (`results.write_results`).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time

import torch
import torch.nn.functional as F

from ferrylm.layers import cpu_experts as C
from ferrylm.weights import quant as Q
from bench_cpu_experts import H2DCopy, read_bandwidth  # benchmarks/ (scripts run as python benchmarks/x.py)
from results import write_results  # benchmarks/results.py


@contextlib.contextmanager
def onednn_off():
    """torch's own CPU matmul kernels while inside (the process-wide oneDNN flag, given back after)."""
    was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = was

SHAPES = {"mixtral": (4096, 14336), "qwen3-30b": (2048, 768), "yuan-m32": (2048, 8192)}  # (H, expert I)
BF16 = ["plain", "split", "split-x2", "split-x4", "native", "split-native", "w@xT", "bmm", "fp32-rows", "pretransposed",
        "onednn-packed", "split-packed", "ferry-native", "ferry-expert", "ferry-expert-avx"]
INT8 = ["int8pack", "int8pack-split", "int8pack-split-x4"]
INT4 = ["int4pack", "int4pack-split", "int4pack-split-x4"]
COPY = {"pretransposed", "onednn-packed", "split-packed"}


class MemcpyLoop(H2DCopy):
    """A background thread copying a 256 MiB host buffer over and over on one torch thread (a stand-in for the
    copy engine's reads off the GPU host); started and stopped as `H2DCopy`."""

    def __init__(self, mib: int = 256):
        self.src = torch.empty(mib << 20, dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.stop, self.copied = threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        torch.get_num_threads()  # torch's lazy per-thread init first, then one thread
        torch.set_num_threads(1)
        while not self.stop.is_set():
            self.dst.copy_(self.src)
            self.copied += self.src.nbytes


class Kernel:
    """A built matmul x [T, K] -> [T, N] with the shape and bytes `HostExpert` asks of a kernel."""

    def __init__(self, fn, shape, nbytes):
        self.fn, self.shape, self.nbytes = fn, tuple(shape), nbytes

    def __call__(self, x):
        return self.fn(x)


def dense_kernel(variant: str, w: torch.Tensor) -> Kernel:
    """w: [N, K] bf16 -> the variant's matmul (holding w, or the re-laid copy that would replace it)."""
    n, k = w.shape
    nb = w.numel() * w.element_size()
    threads = torch.get_num_threads()
    if variant in ("plain", "native"):
        fn = lambda x: F.linear(x, w)  # noqa: E731
    elif variant == "ferry-native":  # the engine's `dense_gemm = "native"`: layers/host_native's GEMV on the pool
        g = C.DenseGemm(w)

        def fn(x):
            before, C.dense_gemm = C.dense_gemm, "native"
            try:
                return g(x)
            finally:
                C.dense_gemm = before
    elif variant in ("split", "split-x2", "split-x4", "split-native"):
        fn = C.DenseGemm(w).split(threads, C.chunks_per_thread(variant.removesuffix("-native")))
    elif variant == "w@xT":
        fn = lambda x: (w @ x.t()).t()  # noqa: E731
    elif variant == "bmm":
        p = max(d for d in range(1, threads + 1) if n % d == 0)
        wb = w.view(p, n // p, k)  # [P, N/P, K]

        def fn(x):  # x: [T, K] -> [P, N/P, T] -> [T, N]
            return torch.bmm(wb, x.t().unsqueeze(0).expand(p, k, x.shape[0])).permute(2, 0, 1).reshape(x.shape[0], n)
    elif variant == "fp32-rows":
        block = max(16, C.ROW_BLOCK_BYTES // (4 * k) // 16 * 16)
        buf = torch.empty(block, k)  # one fp32 block, reused (a fresh large one per block page-faults)

        def fn(x):
            xf = x.float()
            out = []
            for a in range(0, n, block):
                c = min(block, n - a)
                out.append(F.linear(xf, buf[:c].copy_(w[a:a + c])))
            return torch.cat(out, 1).to(x.dtype)
    elif variant == "pretransposed":
        wt = w.t().contiguous()  # [K, N]
        fn = lambda x: x @ wt  # noqa: E731
    elif variant == "onednn-packed":
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        fn = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
    elif variant == "split-packed":
        chunks = [torch.ops.mkldnn._reorder_linear_weight(w[a:a + c], 1)
                  for a, c in C.split_bounds(n, k * w.element_size(), threads)]
        fn = C.SplitRows([lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                          for p in chunks], nb)
    else:
        raise ValueError(f"unknown bf16 variant {variant!r}")
    return Kernel(fn, (n, k), nb)


def int8_kernel(variant: str, q: torch.Tensor, s: torch.Tensor) -> Kernel:
    """q [N, K] int8, s [N] fp32 (per channel)."""
    n, k = q.shape
    qt = lambda a, c: Q.QuantizedTensor("int8", (c, k), {"q": q[a:a + c], "scale": s[a:a + c]}, {},  # noqa: E731
                                        torch.bfloat16)
    from ferrylm.layers.qmatmul import Int8PackCPU
    if variant == "int8pack":
        fn = Int8PackCPU(qt(0, n))
    else:
        threads, per = torch.get_num_threads(), C.chunks_per_thread(variant.removeprefix("int8pack-"))
        fn = C.SplitRows([Int8PackCPU(qt(a, c)) for a, c in C.split_bounds(n, k, threads * per)], 0, threads)
    return Kernel(fn, (n, k), q.nbytes + s.nbytes)


def int4_kernel(variant: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, gs: int) -> Kernel:
    """q [N, K/2] codes already re-laid in torch's CPU layout, d / m [N, K/gs] fp16 scales and mins."""
    n, k = q.shape[0], 2 * q.shape[1]

    def kern(a, c):
        qt = Q.QuantizedTensor("int4", (c, k), {"q": q[a:a + c], "scale": d[a:a + c], "min": m[a:a + c]},
                               {"group_size": gs, "zero": "min"}, torch.bfloat16)
        return C.Int4InPlace(qt, q[a:a + c])
    if variant == "int4pack":
        fn = kern(0, n)
    else:
        threads, per = torch.get_num_threads(), C.chunks_per_thread(variant.removeprefix("int4pack-"))
        fn = C.SplitRows([kern(a, c) for a, c in C.split_bounds(n, k // 2, threads * per, C.int4_layout().block)], 0,
                         threads)
    return Kernel(fn, (n, k), q.nbytes + d.nbytes + m.nbytes)


def dense_weights(H: int, I: int, seed: int) -> list[torch.Tensor]:
    """Random bf16 w13 [2I, H] and w2 [H, I] of one expert."""
    g = torch.Generator().manual_seed(seed)
    return [torch.empty(n, k, dtype=torch.bfloat16).normal_(0, 0.02, generator=g) for n, k in ((2 * I, H), (H, I))]


def make_expert(variant: str, H: int, I: int, seed: int, dense=None) -> C.HostExpert:
    """`dense`: the expert's bf16 weights (`dense_weights`), shared by the bf16 variants."""
    g = torch.Generator().manual_seed(seed)
    sides = ((2 * I, H), (H, I))  # w13 [2I, H], w2 [H, I]
    if variant in INT8:
        ks = [int8_kernel(variant, torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                          torch.rand(n, generator=g) * 1e-3) for n, k in sides]
    elif variant in INT4:
        gs = 32
        ks = [int4_kernel(variant, C.int4_to_cpu_layout_(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8,
                                                                       generator=g)),
                          (torch.rand(n, k // gs, generator=g) * 1e-3).half(),
                          (torch.rand(n, k // gs, generator=g) * -1e-3).half(), gs) for n, k in sides]
    elif variant in ("ferry-expert", "ferry-expert-avx"):  # the engine's HostExpert under "native": one fused call
        e = NativeExpert(*(dense or dense_weights(H, I, seed)))
        e.amx = variant == "ferry-expert"
        return e
    else:
        ks = [dense_kernel(variant, w) for w in dense or dense_weights(H, I, seed)]
    return C.HostExpert(*ks)


class NativeExpert(C.HostExpert):
    """`HostExpert` over dense bf16 weights, called with `dense_gemm = "native"` (where the CPU has AVX512-BF16:
    the whole expert in one native call on the C pool, `cpu_experts.native_fused_expert`)."""

    amx = True  # cpu_experts.native_amx during the call

    def __call__(self, x):
        saved = C.dense_gemm, C.native_amx, C.dense_gemm_max_t
        C.dense_gemm, C.native_amx = "native", self.amx
        C.dense_gemm_max_t = C.host_native.max_tokens(C.use_amx(2))  # (above: plain, as the engine would)
        try:
            return super().__call__(x)
        finally:
            C.dense_gemm, C.native_amx, C.dense_gemm_max_t = saved


def fmt_of(variant: str) -> str:
    return "int8" if variant in INT8 else "int4" if variant in INT4 else "bf16"


FIGURE_S = 0.6
"""Seconds one figure may take past its first passes: a slow variant runs fewer passes (at least 2)."""


def time_expert(experts, x, reps: int) -> float:
    """Seconds per expert call: the median of up to `reps` passes over the experts, after one warm pass."""
    for e in experts:
        e(x)
    times = []
    while len(times) < reps and (len(times) < 2 or sum(times) * len(experts) < FIGURE_S):
        t = time.perf_counter()
        for e in experts:
            e(x)
        times.append((time.perf_counter() - t) / len(experts))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--variants", nargs="+", default=BF16 + INT8 + INT4, choices=BF16 + INT8 + INT4)
    ap.add_argument("--experts", type=int, default=3, help="distinct experts cycled (defeats the caches)")
    ap.add_argument("--reps", type=int, default=None, help="passes over the experts per figure (default 5, 3 small)")
    ap.add_argument("--runs", type=int, default=1,
                    help="rounds per point, each timing every variant in turn: the median is kept, the min and "
                         "max recorded (the spread), and the median ratio to plain within a round (vs_plain)")
    ap.add_argument("--small", action="store_true", help="shapes / 4 in each dimension, fewer repetitions")
    ap.add_argument("--beside", choices=["none", "h2d", "memcpy"], default="none",
                    help="time everything beside a running copy: pinned host -> GPU (CUDA), or a one-thread memcpy")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import os
    torch.set_num_threads(a.threads or os.cpu_count())
    torch.set_grad_enabled(False)
    reps = a.reps or (3 if a.small else 5)
    bw = bw_alone = read_bandwidth(0.25 if a.small else 1.0)
    threads = torch.get_num_threads()
    print(f"plain read: {bw:.1f} GB/s with {threads} threads", flush=True)
    beside = contextlib.ExitStack()
    if a.beside != "none":
        copier = beside.enter_context(H2DCopy() if a.beside == "h2d" else MemcpyLoop())
        bw = read_bandwidth(0.25 if a.small else 1.0)
        print(f"plain read beside the {a.beside} copy: {bw:.1f} GB/s (the ratios below are to this)", flush=True)
    flags = set()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    rows, t0 = [], time.perf_counter()
    for shape in a.shapes:
        H, I = SHAPES[shape]
        if a.small:
            H, I = H // 4, I // 4
        dense = ([dense_weights(H, I, seed) for seed in range(a.experts)] if any(v in BF16 for v in a.variants)
                 else [None] * a.experts)
        # every variant's experts built first, then each point timed in `--runs` rounds that take the variants
        # in turn: a shared machine's load then falls on all of them alike, and the ratio to plain in the same
        # round (`vs_plain`) is steadier than either figure
        built = {v: [make_expert(v, H, I, seed, dense[seed]) for seed in range(a.experts)] for v in a.variants}
        for t in a.tokens:
            x = torch.randn(t, H).bfloat16()
            times = {v: [] for v in a.variants}
            for _ in range(a.runs):
                for variant, experts in built.items():
                    mode = onednn_off() if variant.endswith("native") else contextlib.nullcontext()
                    with mode:
                        times[variant].append(time_expert(experts, x, reps))
            load = os.getloadavg()[0]
            for variant, experts in built.items():
                runs = sorted(times[variant])
                sec, nbytes = statistics.median(runs), experts[0].nbytes
                gb_s = nbytes / sec / 1e9
                row = {"shape": shape, "H": H, "I": I, "format": fmt_of(variant), "variant": variant,
                       "copy": variant in COPY, "tokens": t, "ms": sec * 1e3, "gb_s": gb_s, "of_read_bw": gb_s / bw,
                       "expert_bytes": nbytes, "beside": a.beside}
                spread = ""
                if a.runs > 1:  # the spread over rounds, the machine's load then (it is shared), the paired ratio
                    row.update(ms_min=runs[0] * 1e3, ms_max=runs[-1] * 1e3, runs=a.runs, load_avg_1m=load)
                    spread = f"  [{runs[0] * 1e3:.2f}, {runs[-1] * 1e3:.2f}]"
                    if "plain" in times:
                        ratios = sorted(p / v for p, v in zip(times["plain"], times[variant]))
                        row["vs_plain"] = statistics.median(ratios)
                        spread += f"  x{row['vs_plain']:.2f} plain ({ratios[0]:.2f}-{ratios[-1]:.2f})"
                rows.append(row)
                print(f"{shape:10s} {row['format']:5s} {variant:14s} T={t:<3d} {sec * 1e3:8.3f} ms "
                      f"{gb_s:7.1f} GB/s  {gb_s / bw:5.2f} of read{spread}", flush=True)
        del built
        del dense
    best = {}
    for r in rows:
        key = f"{r['shape']}/{r['format']}/T{r['tokens']}"
        if not r["copy"] and (key not in best or r["gb_s"] > best[key]["gb_s"]):
            best[key] = {"variant": r["variant"], "gb_s": round(r["gb_s"], 1), "of_read_bw": round(r["of_read_bw"], 2)}
    print("fastest in the bank's layout:", best, flush=True)
    beside.close()
    copy_gb_s = getattr(copier, "gb_s", None) if a.beside != "none" else None
    write_results("host_gemv", rows, out=a.out, threads=threads, read_bw_gb_s=bw, read_bw_alone_gb_s=bw_alone,
                  beside=a.beside, beside_copy_gb_s=copy_gb_s, small=a.small,
                  cpu_capability=torch.backends.cpu.get_cpu_capability(),
                  cpu_flags=sorted(f for f in flags if f.startswith(("avx512", "amx"))), best=best,
                  took_s=time.perf_counter() - t0)


if __name__ == "__main__":
    main()
