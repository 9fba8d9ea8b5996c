"""One MoE expert's gated MLP computed on the host's cores, from the weights in the format they are held
in on the host (dense, or int8 / int4 packed through `layers/qmatmul.py`'s CPU kernels, or any other
packed format through `RowBlocks`), for the hybrid path's cold experts. `HostExpert` holds one expert
(gate and up fused into one [2I, H] matmul, then down [H, I]); calling it runs a batch of T tokens. Torch's kernels release the GIL, so a worker thread can
run experts while the main thread drives the GPU.

Dense weights go through `DenseGemm`, by the path `dense_gemm` names: "plain" (`F.linear`: oneDNN's GEMM on
torch's intra-op threads, the reference) or "split" (`SplitRows`: the rows in one contiguous chunk per
thread, each chunk a single-threaded `F.linear` on a worker of a shared pool of Python threads,
`split_pool`; "split-x4": four chunks a thread). (Torch's own GEMV with oneDNN switched off, fastest at 1
token on the 2-core box, was tried and removed: it flips a process-wide flag beside other threads' matmuls,
and graphed hybrid decode on the H200 host ended 1.8 off in logits with it, tests/test_cuda.py
`test_hybrid_decode_with_each_dense_gemm`.)
All read the weight where it lies, in its own layout (no copy); every output element is one
full-length dot product either way. At 1..16 tokens the GEMM is bound by memory reads, and which path
streams them faster depends on the machine (benchmarks/bench_host_gemv.py), so the hybrid calibration
measures both and sets `dense_gemm` (offload/calibration.py).

`host_expert_reference` is the plain path every format is tested against (tests/test_cpu_experts.py):
the same dequantized weights in fp32 through `layers/moe.expert_mlp`.
It knows nothing about routing, caches or placement; any thread may call it (the split pool is shared).
Shapes: T tokens, H hidden, I the expert's intermediate size.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.nn.functional as F

from ferrylm.layers import host_native
from ferrylm.layers.moe import expert_mlp
from ferrylm.layers.qmatmul import Int4PackCPU, Int8PackCPU, QuantKernel, int4_layout
from ferrylm.weights import quant as Q

FORMATS = ("bf16", "int8", "int4")
DENSE_GEMMS = ("plain", "split", "split-x4", "native")
dense_gemm = "plain"
"""How `HostExpert` multiplies dense bf16 / fp16 weights at up to `dense_gemm_max_t` tokens (read at each
call; more tokens take the plain path): "plain", one oneDNN GEMM on torch's intra-op threads (the
reference); "split", `SplitRows` (the weight's rows in one chunk per thread, each chunk a single-threaded
oneDNN GEMM on a worker thread of its own: the same bits as plain where oneDNN does not split K);
"split-x4", four chunks per thread, taken by the workers as they come free (a core another thread holds
delays a quarter of a share, not a whole one); "native", `layers/host_native`'s AVX-512 GEMV over chunks
of rows (fp32 accumulation, not plain's bits; bf16 weights with K a multiple of 16, else "split"). Which is
fastest depends on the machine (benchmarks/bench_host_gemv.py, bench_host_rowblocks.py): the hybrid calibration
measures them and sets this (offload/calibration.py). fp32 weights always take the plain path (an fp32 bank
computes `expert_mlp`'s bits)."""
NATIVE_PREFETCH_ROWS = 0
"""Rows ahead "native" prefetches at one token (`host_native.gemv_bf16`'s `prefetch`; 0: the hardware prefetchers
alone). benchmarks/bench_host_stream.py, a Mixtral expert beside a pinned copy at ~54 GB/s: on the H200 host (Xeon)
2 rows ahead read 48.7 GB/s against 37.4 on 8 threads (bf16 x: 50.5 against 40.2) and 47.5 against 40.7 on 16;
on the 2-core EPYC box it loses (32.5 -> 25.7 alone). Left at 0: offered as a calibration choice (session 20), the
prefetching GEMV won the calibration's one-token race beside copies at 8 threads, and the engine then decoded
Mixtral-16L at 4.84 tok/s against 8.94 with the plain native GEMV on the 14 threads chosen before (the host's
expert call took 10.9 ms in the engine against 6.8 in the benchmark): the thread choice beside copies does not stand
for the decode's in-place reads. TODO: choose threads and prefetch beside in-place reads, then offer it again."""
NATIVE_PREFETCH_ROWS_MULTI = 2
"""Rows ahead the bf16-x native GEMV prefetches at 2..16 tokens (`host_native.gemv_bf16_bx`'s `prefetch`): it reads
K in chunks whose x stays in L1, so a row is read in runs of a few KB that the hardware's stream prefetchers do not
follow across. 2-core box, a Mixtral w13 from DRAM on the C pool's 2 threads, GB/s at 0 / 1 / 2 / 4 rows ahead:
8 tokens 16.7 / 36.5 / 36.5 / 35.3, 16 tokens 12.9 / 22.7 / 26.6 / 26.1, 4 tokens 34.5 / 40.7 / 39.9 / 40.0 (oneDNN
31 at 4 and 8, 24 at 16)."""
native_bf16_dot = True
"""Whether "native" runs a one-token bf16 call on the AVX512-BF16 dot product (`host_native.gemv_bf16_bx`: bf16 x,
no conversion of the weights; where the CPU has it) instead of the fp32 kernel. 2-core box, a Mixtral expert from
DRAM on 2 threads: 36.8 GB/s against 22.0 (the fp32 kernel) and 13.4 (oneDNN), at the native read's 37.7
(benchmarks/bench_host_stream.py). The products are exact in fp32 either way; the sums differ in order."""
native_c_threads = True
"""Whether "native" runs a matrix in one call on `host_native`'s pool of C threads (the one-token bf16-x GEMV,
`gemv_bf16_bx_mt`; `RowBlocks`' NF4 GEMV at any token count, `gemv_nf4(threads=)`) instead of a call a row chunk
from the Python workers of `split_pool` (`SplitRows`): the same rows, chunks and bits. Why: on the H200 host (16
vCPUs) the Python workers' row chunks read 40 GB/s on 16 threads where a plain read streams 85, and 53 against 54
on 8 (benchmarks/bench_host_stream.py "read", session 21), and the NF4 GEMV ran slower on 16 threads than on 8 (7.19
against 4.98 ms an expert, session 17): each chunk's call waits its turn at the GIL. Not yet measured on that host
(docs/benchmarks.md, pending)."""
native_fused_expert = True
"""Whether a SiLU expert on dense bf16 weights (or on fp8 `RowBlocks`: `host_native.expert_silu_fp8`, the same bits
as its two GEMVs with torch's SiLU between) runs whole in one native call where "native" takes it on the C pool
(`host_native.expert_silu_bf16`: gate and up, the SiLU product, down; the same bits as the GEMVs one by one with
torch's SiLU between) rather than two GEMV calls and torch's ops between them. Why: each torch op large enough to run
on the calling thread's OpenMP team leaves that team spinning for a while, and the spinners take cores from the C
pool's workers. 2-core box, a Mixtral w13 at 2 and 4 tokens: 7.3-9.9 ms against 5.4-6.3 after an
`out.to(bfloat16)` of the GEMV's [T, 2I] output, as fast as without it under `OMP_WAIT_POLICY=PASSIVE`."""
native_batched_experts = True
"""Whether a layer's host experts that each run as one native call (`native_fused_expert`: dense bf16, NF4, fp8) run as
one call together (`host_native.experts_silu_bf16` / `experts_silu_nf4` / `experts_silu_fp8`, from
`offload/host_experts.HostExperts.rows` and `outputs`): the same bits, one wake-up of the C pool a pass for all of
them. Why: an expert call costs the pool's wake-up and hand-offs twice and Python's ops around it, ~0.35 ms a 9.4
MB Qwen3-30B-A3B expert on the H200 host where its bytes take ~0.1 at the host's read rate (docs/benchmarks.md,
session 28); many small experts a layer pay that each. Session 42, H100 box (`benchmarks/bench_host_batched.py`):
1.6-4.8x on a Qwen3 layer's experts; the engine's Qwen3 batch 16 with every miss on the host 8.82 -> 21.35 tok/s."""
native_batch_min = 2
"""Fewest experts `native_batched_experts` batches into one call (fewer take their own calls: one expert batched is its
own call plus the batching's Python: the gather, the pointer arrays, the weighting; a decode layer often has one miss).
Not yet tuned on a machine."""
native_amx = True
"""Whether "native" runs bf16 calls of 2-64 tokens on the C pool on AMX tiles where the CPU has them
(`host_native.amx()`: `gemv_bf16_bx_mt(amx=True)`, `expert_silu_bf16(amx=True)`) instead of the AVX512-BF16 kernel,
which issues one `vdpbf16ps` a token per 32 weights and so turns compute-bound from ~4 tokens: on the 2-core box
(Xeon, AMX) one thread read a Mixtral w13 at 13.6-14.9 GB/s at 1-16 tokens on tiles, where the fused AVX512-BF16
expert read 10.2 GB/s on two threads at 16 tokens and oneDNN 17 (`benchmarks/bench_host_gemv.py`, variant
ferry-expert; `ferry-expert-avx` without tiles). One token keeps the AVX512-BF16 GEMV (one `vdpbf16ps` a 64-byte
line: bound by the bytes already). Above 16 tokens (up to `host_native.MAX_TOKENS_AMX`, 64) the tokens go in blocks
of 16 over rows held in L2."""
native_fp8_amx = True
"""Whether `RowBlocks`' native fp8 GEMV runs on AMX tiles where the CPU has them (`host_native.gemv_fp8(amx=True)`:
each group of codes decoded into bf16 tile rows in L1, then tile multiplies), at every token count: its AVX512-BF16
kernel spends a `vdpbf16ps` a token per 32 weights on top of the decode. 2-core Xeon, an 8192 x 4096 fp8 weight
(groups of 128) from DRAM on 2 threads: 2.1-2.4 ms at 1-16 tokens on tiles against 3.2 / 4.7 / 15.5 ms at 1 / 4 / 16
on the AVX512-BF16 kernel, and 2.6-3.1 ms for the same weight in bf16 (`gemv_bf16_bx_mt`)."""
dense_gemm_max_t = 16
"""Most tokens a call takes `dense_gemm` (or `dense_gemm_multi`) at; more take "plain" (set by the calibration)."""
dense_gemm_multi = None
"""The path at 2..`dense_gemm_max_t` tokens where it differs from the one-token choice `dense_gemm` (None: the same):
the calibration races them apart, since on an AMX host "native" can lose the one-token race to oneDNN and still win at
2-16 tokens on tiles (`gemm_at`)."""
PACKED_GEMMS = ("plain", "split", "split-x4")
packed_gemm = "plain"
"""The same choice for per-channel int8 experts (`Int8Split`): torch's `_weight_int8pack_mm` on its
OpenMP team, or its rows split over the pool as `dense_gemm`'s "split" / "split-x4" (the same bits: each
output is one row's sum either way). Set by the calibration for an int8 bank."""
packed_gemm_max_t = 16
"""Most tokens a call takes `packed_gemm` at."""
packed_gemm_multi = None
"""`packed_gemm`'s path at 2..`packed_gemm_max_t` tokens where it differs (None: the same; see `dense_gemm_multi`)."""
SPLIT_MIN_BYTES = 1 << 20
"""Fewest weight bytes a `SplitRows` chunk takes (fewer chunks than threads below it; one: the plain GEMM):
a hand-off to a worker costs ~10-50 us, what ~1 MB of weights takes to stream at tens of GB/s."""
SPLIT_ALIGN = 64
"""Chunk boundaries fall on multiples of this many rows (cache lines; whole blocks of torch's CPU int4 layout, 32 or 64
rows as seen)."""

_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _single_threaded() -> None:
    # torch sets a thread's count from the process-wide one on its first op (lazily): take that first, or
    # the first op on the worker would set it back to the caller's count
    torch.get_num_threads()
    torch.set_num_threads(1)


def split_pool(n: int) -> ThreadPoolExecutor:
    """The shared pool of `n` worker threads, each running torch single-threaded, started on first use by
    the calling thread (so they inherit its CPU binding: the expert worker's, `hw/cpu_binding.bind_thread`)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(n)
        if pool is None:
            pool = ThreadPoolExecutor(n, thread_name_prefix="ferry-gemv", initializer=_single_threaded)
            barrier = threading.Barrier(n, timeout=60)
            for f in [pool.submit(barrier.wait) for _ in range(n)]:  # all n threads started (and set to 1) now
                f.result()
            # torch.set_num_threads(1) on the workers also set the count threads started later begin with:
            # give that back (this thread's own count is unchanged)
            torch.set_num_threads(torch.get_num_threads())
            _POOLS[n] = pool
    return pool


def usable(choices: tuple[str, ...]) -> tuple[str, ...]:
    """`choices` less "native" where `layers/host_native`'s kernels are unavailable, and less "native-avx" where no
    tiles run (it is "native" there) (what a calibration times)."""
    return tuple(g for g in choices if not g.startswith("native") or host_native.available()
                 and (g != "native-avx" or (host_native.amx() and native_fp8_amx)))


NATIVE_CHUNKS_PER_THREAD = 2
"""Row chunks a worker takes on average on the native paths."""


def native_split(n: int, row_bytes: int, threads: int, kernel: Callable[[int, int], Callable]) -> "SplitRows":
    """A `SplitRows` over chunks of n rows for a native kernel: `kernel(a, c)` gives rows [a, a + c)'s
    x32 -> [T, c] fp32 callable."""
    bounds = split_bounds(n, row_bytes, threads * NATIVE_CHUNKS_PER_THREAD)
    return SplitRows([kernel(a, c) for a, c in bounds], 0, workers=threads)


@functools.lru_cache(maxsize=256)
def c_pool_split(n: int, row_bytes: int, threads: int) -> tuple[int, int]:
    """(threads, rows a chunk) for a native kernel over n rows on `host_native`'s C pool: `native_split`'s chunks,
    no more threads than chunks (per call on the hot path: cached)."""
    bounds = split_bounds(n, row_bytes, threads * NATIVE_CHUNKS_PER_THREAD)
    return min(threads, len(bounds)), bounds[0][1]


def gemm_at(name: str, tokens: int) -> str:
    """The path the setting `name` ("dense_gemm", "packed_gemm", "row_blocks_gemm") gives a call of `tokens` tokens:
    its one-token choice, `{name}_multi` (where set) at 2..`{name}_max_t`, "plain" above (read at each call)."""
    g = globals()
    if tokens > g[f"{name}_max_t"]:
        return "plain"
    multi = g[f"{name}_multi"]
    return g[name] if tokens == 1 or multi is None else multi


def use_amx(tokens: int) -> bool:
    """Whether a native bf16 call of `tokens` tokens on the C pool runs on AMX tiles (`native_amx`)."""
    return native_amx and tokens > 1 and host_native.amx()


def chunks_per_thread(gemm: str) -> int:
    """"split" -> 1, "split-x4" -> 4 ("native" -> 1: its own chunks, `native_split`)."""
    return int(gemm.partition("-x")[2] or 1)


def split_bounds(n: int, row_bytes: int, parts: int, align: int = SPLIT_ALIGN) -> list[tuple[int, int]]:
    """[(first row, rows)] of at most `parts` balanced chunks of n rows, each >= `SPLIT_MIN_BYTES` (at
    least one chunk), boundaries on multiples of `align` rows."""
    parts = max(1, min(parts, n * row_bytes // SPLIT_MIN_BYTES, n // align))
    edges = [round(n * j / parts / align) * align for j in range(parts)] + [n]
    return [(a, b - a) for a, b in zip(edges, edges[1:]) if b > a]


class SplitRows:
    """x @ W.T with W's rows split into chunks, `kernels[j]` computing chunk j's columns of the output on the
    `workers` threads of `split_pool(workers)` (default one per chunk; single-threaded each: the chunks
    stream disjoint, contiguous runs of the weight, one per core), each worker taking the next chunk as it
    comes free (one hand-off a worker per call, whatever the chunk count). The kernels hold views of the
    weight: no copy. Thread-safe."""

    name = "split-rows"

    def __init__(self, kernels: list[Callable[[torch.Tensor], torch.Tensor]], nbytes: int,
                 workers: int | None = None):
        self.kernels, self.nbytes = kernels, nbytes
        self.workers = min(workers or len(kernels), len(kernels))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, N]: chunk j's [T, c_j] concatenated
        if len(self.kernels) == 1:
            return self.kernels[0](x)
        out: list[torch.Tensor | None] = [None] * len(self.kernels)
        chunks, lock = iter(range(len(self.kernels))), threading.Lock()

        def take() -> None:  # one hand-off a worker; each takes the next chunk as it comes free
            while True:
                with lock:
                    j = next(chunks, None)
                if j is None:
                    return
                out[j] = self.kernels[j](x)
        pool = split_pool(self.workers)
        for f in [pool.submit(take) for _ in range(self.workers)]:
            f.result()
        return torch.cat(out, dim=1)


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) by the path `dense_gemm` names, for a dense weight (a view: e.g. a bank's column range)
    no `DenseGemm` holds; its chunks are views made per call (a few us each)."""
    return DenseGemm(w)(x)


class Linear:
    """x -> F.linear(x, w): one `SplitRows` chunk of a dense weight (`w` a view of its rows)."""

    def __init__(self, w: torch.Tensor):
        self.w = w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)


class DenseGemm:
    """x @ w.T for a dense [N, K] weight, by the path `dense_gemm` names at call time: F.linear, or (bf16 /
    fp16 weights) `SplitRows` over views of w's rows, chunked for the calling thread's torch thread count."""

    name = "dense"

    def __init__(self, w: torch.Tensor):
        self.w = w
        self.shape = tuple(w.shape)
        self.nbytes = w.numel() * w.element_size()
        self._splits: dict[tuple[int, int], SplitRows] = {}

    def split(self, threads: int, per_thread: int = 1) -> SplitRows:
        """The `SplitRows` over `threads * per_thread` chunks (fewer for a small weight: `split_bounds`) on
        `threads` workers, built once."""
        s = self._splits.get((threads, per_thread))
        if s is None:
            n, k = self.shape
            bounds = split_bounds(n, k * self.w.element_size(), threads * per_thread)
            s = self._splits[threads, per_thread] = SplitRows([Linear(self.w[a:a + c]) for a, c in bounds],
                                                              self.nbytes, workers=threads)
        return s

    def native_rows(self, a: int, c: int, prefetch: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
        """Rows [a, a + c) by the native GEMV: x [T, K] -> [T, c] fp32; x fp32, or bf16 (the AVX512-BF16
        dot-product kernel, `native_bf16_dot`); `prefetch` rows ahead (`gemv_bf16`: at one token)."""
        w = self.w[a:a + c]

        def run(x: torch.Tensor) -> torch.Tensor:
            if x.dtype == torch.bfloat16:
                return host_native.gemv_bf16_bx(x, w, torch.empty(x.shape[0], c), prefetch)
            return host_native.gemv_bf16(x, w, torch.empty(x.shape[0], c), prefetch)
        return run

    def native(self, threads: int, prefetch: int = 0) -> SplitRows:
        """The native GEMV over chunks of w's rows on `threads` workers (x -> [T, N] fp32), built once."""
        s = self._splits.get((threads, -1 - prefetch))
        if s is None:
            n, k = self.shape
            s = self._splits[threads, -1 - prefetch] = native_split(
                n, k * self.w.element_size(), threads, lambda a, c: self.native_rows(a, c, prefetch))
        return s

    def native_fits(self, x: torch.Tensor) -> bool:
        T = x.shape[0]
        if not (self.w.dtype == torch.bfloat16 and self.w.stride(1) == 1 and self.shape[1] % 16 == 0
                and host_native.available()):
            return False
        return T <= host_native.MAX_TOKENS or (  # more: only the AMX call on the C pool
            T <= host_native.MAX_TOKENS_AMX and use_amx(T) and native_c_threads and native_bf16_dot
            and x.dtype == torch.bfloat16 and self.shape[1] % 32 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g = gemm_at("dense_gemm", x.shape[0])
        if g == "plain" or self.w.dtype == torch.float32:
            return F.linear(x, self.w)
        threads = torch.get_num_threads()
        if g == "native" and self.native_fits(x):
            bx = (native_bf16_dot and x.dtype == torch.bfloat16 and self.shape[1] % 32 == 0
                  and host_native.nf4_bf16())
            xn = x.contiguous() if bx else x.float().contiguous()
            pf = NATIVE_PREFETCH_ROWS if x.shape[0] == 1 else NATIVE_PREFETCH_ROWS_MULTI if bx else 0
            if bx and (threads > 1 or use_amx(x.shape[0])) and native_c_threads:  # one call (C pool; AMX tiles)
                n, k = self.shape
                out = torch.empty(x.shape[0], n)
                host_native.gemv_bf16_bx_mt(xn, self.w, out, *c_pool_split(n, k * self.w.element_size(), threads), pf,
                                            use_amx(x.shape[0]))
                return out.to(x.dtype)
            run = self.native_rows(0, self.shape[0], pf) if threads == 1 else self.native(threads, pf)
            return run(xn).to(x.dtype)
        if threads == 1:  # (the pool's own workers)
            return F.linear(x, self.w)
        return self.split(threads, chunks_per_thread(g))(x)


ROW_BLOCK_BYTES = 4 << 20
"""Bytes of bf16 weights `RowBlocks` decodes at a time (a few MB: the buffer stays in cache for the GEMM)."""


ROW_BLOCKS_GEMMS = ("plain", "split", "native", "native-avx")
row_blocks_gemm = "split"
"""How `RowBlocks` runs at up to `row_blocks_gemm_max_t` tokens (read at each call): "split" on the split pool (rows
in chunks, each decoded and multiplied by one single-threaded worker; when the caller has more than one torch
thread) or "plain" (the blocks one after another on the caller's threads). Torch's decode ops barely scale with
threads (`index_select`, NF4's level lookup: 0.80 -> 0.66 ms a MB of codes from 1 to 2 threads on the 2-core box;
149 ms a Mixtral expert on the H200 host's 16), which the chunks spread over the cores; where the decode's ops do
scale (group-wise int8 on the 2-core box) plain can win; "native" (NF4 and fp8, else "split"): `layers/host_native`'s
AVX-512 NF4 / fp8 GEMV over chunks of rows, the codes decoded in registers (fp8 on AMX tiles where the CPU has them,
`native_fp8_amx`); "native-avx": fp8 on the AVX512-BF16 kernel even where tiles run (small experts at one token can
be faster there: the calibration races the two; NF4 has no tile path, so the same as "native"). The hybrid calibration measures them and sets it
(benchmarks/bench_host_rowblocks.py). The same bits either way: each output column is one block's GEMM over all
of K."""
row_blocks_gemm_max_t = 16
"""Most tokens a call takes `row_blocks_gemm` at."""
row_blocks_gemm_multi = None
"""`row_blocks_gemm`'s path at 2..`row_blocks_gemm_max_t` tokens where it differs (None: the same)."""
_NF4_LEVELS32 = Q.NF4_LEVELS.float().contiguous()  # what the native NF4 GEMV reads
ROW_BLOCKS_CHUNKS_PER_THREAD = 2
"""Chunks a worker takes on average (a worker that comes free takes the next: a core held by another thread
delays only its own chunk)."""


class RowBlocks:
    """x @ W.T for a packed weight that no CPU kernel reads (nf4, fp8, group-wise int8, odd-sized int4):
    `decode(a, c)` gives rows [a, a + c) as bf16 [c, K], a block at a time, each block multiplied by oneDNN's
    bf16 GEMM into its columns of the output; no dequantized copy of the whole weight is made. With
    `out_scale` [N] (per-channel formats) the codes decode exactly to bf16 and the fp32 scale multiplies the
    output columns instead of every weight."""

    name = "row-blocks"

    def __init__(self, shape: tuple[int, int], decode: Callable[[int, int], torch.Tensor], nbytes: int,
                 out_scale: torch.Tensor | None = None, nf4: tuple | None = None, fp8: tuple | None = None):
        self.shape, self.decode, self.nbytes, self.out_scale = tuple(shape), decode, nbytes, out_scale
        self.nf4 = nf4
        """NF4 weights: (codes [N, K/2] uint8, absmax [N, K/group] fp32, group), what "native" reads."""
        self.fp8 = fp8
        """fp8 weights: (codes [N, K] uint8, scales [N, K/group] fp32, group; K: per channel), what "native" reads
        (`host_native.gemv_fp8`: the scales inside, so `out_scale` is not applied on that path)."""
        self.block = max(16, ROW_BLOCK_BYTES // (2 * shape[1]) // 16 * 16)
        self._splits: dict[int, SplitRows] = {}

    def split(self, threads: int) -> SplitRows:
        """The `SplitRows` over chunks of rows (`ROW_BLOCKS_CHUNKS_PER_THREAD` a thread, fewer for a small
        weight: `split_bounds`), each a `RowBlocks` decoding its own rows, on `threads` workers; built once."""
        s = self._splits.get(threads)
        if s is None:
            n, k = self.shape
            bounds = split_bounds(n, max(1, self.nbytes // n), threads * ROW_BLOCKS_CHUNKS_PER_THREAD)
            chunks = [self._rows(a, c).plain for a, c in bounds]  # (plain: each worker runs torch single-threaded)
            s = self._splits[threads] = SplitRows(chunks, self.nbytes, workers=threads)
        return s

    def _rows(self, a: int, c: int) -> "RowBlocks":
        """Rows [a, a + c) as a RowBlocks of their own."""
        if (a, c) == (0, self.shape[0]):
            return self
        scale = None if self.out_scale is None else self.out_scale[a:a + c]
        decode = self.decode  # (not self: a chunk holding its parent would make a reference cycle)
        return RowBlocks((c, self.shape[1]), lambda a2, c2: decode(a + a2, c2),
                         self.nbytes * c // self.shape[0], out_scale=scale)

    def native_rows(self, a: int, c: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Rows [a, a + c) by the native GEMV: x as `native_x` makes it -> [T, c] fp32."""
        if self.fp8 is not None:
            q, scale, group = self.fp8
            q, scale = q[a:a + c], scale[a:a + c]
            return lambda xb: host_native.gemv_fp8(xb, q, scale, group, torch.empty(xb.shape[0], c),
                                                   amx=self.fp8_amx(xb.shape[0]))
        q, absmax, group = self.nf4
        q, absmax = q[a:a + c], absmax[a:a + c]
        return lambda x32: host_native.gemv_nf4(x32, q, absmax, group, _NF4_LEVELS32, torch.empty(x32.shape[0], c))

    def fp8_amx(self, tokens: int) -> bool:
        """The native fp8 GEMV of a call of `tokens` tokens runs on AMX tiles (`native_fp8_amx`, the path "native"
        rather than "native-avx", the CPU grants them, groups it takes)."""
        return (native_fp8_amx and gemm_at("row_blocks_gemm", tokens) == "native"
                and host_native.fp8_amx(self.shape[1], self.fp8[2]))

    def native_ok(self, T: int) -> bool:
        """Whether the native GEMV can take these weights at T tokens here."""
        if T > host_native.MAX_TOKENS or not host_native.available():
            return False
        if self.fp8 is not None:
            return host_native.nf4_bf16()
        return self.nf4 is not None and self.out_scale is None

    def native_x(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] as the native GEMV reads it, made once a call."""
        if self.fp8 is not None:
            return x.to(torch.bfloat16).contiguous()
        return host_native.nf4_x(x, self.nf4[2])

    def native(self, threads: int) -> SplitRows:
        """The native NF4 GEMV over chunks of rows on `threads` workers (x32 -> [T, N] fp32), built once."""
        s = self._splits.get(-threads)
        if s is None:
            n = self.shape[0]
            s = self._splits[-threads] = native_split(n, max(1, self.nbytes // n), threads, self.native_rows)
        return s

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        threads, T = torch.get_num_threads(), x.shape[0]
        g = gemm_at("row_blocks_gemm", T)
        if g == "plain":
            return self.plain(x)
        if g.startswith("native") and self.native_ok(T):
            x32 = self.native_x(x)
            if threads > 1 and native_c_threads:  # the whole matrix in one call on the C pool
                n = self.shape[0]
                pool_threads, chunk = c_pool_split(n, max(1, self.nbytes // n), threads)
                if self.fp8 is not None:
                    q, scale, group = self.fp8
                    out = host_native.gemv_fp8(x32, q, scale, group, torch.empty(T, n), threads=pool_threads,
                                               chunk=chunk, amx=self.fp8_amx(T))
                else:
                    q, absmax, group = self.nf4
                    out = host_native.gemv_nf4(x32, q, absmax, group, _NF4_LEVELS32, torch.empty(T, n),
                                               threads=pool_threads, chunk=chunk)
                return out.to(x.dtype)
            run = self.native_rows(0, self.shape[0]) if threads == 1 else self.native(threads)
            return run(x32).to(x.dtype)
        if g != "plain" and threads > 1:
            return self.split(threads)(x)
        return self.plain(x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks one after another on the calling thread's torch threads."""
        # x: [T, K] -> [T, N] in x's dtype
        n = self.shape[0]
        xb = x.to(torch.bfloat16)
        out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        for a in range(0, n, self.block):
            c = min(self.block, n - a)
            torch.matmul(xb, self.decode(a, c).t(), out=out[:, a:a + c])
        if self.out_scale is not None:
            return out.float().mul_(self.out_scale).to(x.dtype)
        return out.to(x.dtype)


def int4_to_cpu_layout_(q: torch.Tensor) -> torch.Tensor:
    """Store layout -> torch's CPU int4 layout, in place (`qmatmul.Int4Layout`; only where
    `int4_layout_matches`)."""
    return int4_layout().to_cpu_(q)


def int4_from_cpu_layout_(q: torch.Tensor) -> torch.Tensor:
    """Torch's CPU int4 layout -> the store's, in place: what a copy of a re-laid expert does on arrival."""
    return int4_layout().from_cpu_(q)


def int4_layout_matches(rows: int = 0) -> bool:
    """Whether this build's int4 layout is known (`qmatmul.int4_layout`) and `rows` is whole blocks of it."""
    layout = int4_layout()
    return layout is not None and rows % layout.block == 0


class Int4InPlace(Int4PackCPU):
    """`Int4PackCPU` over codes already in torch's CPU layout where they lie (an int4 host bank re-laid in
    place): the same kernel and arithmetic, so the same bits, and no second copy of the codes. `qt` carries
    the scales (and mins), `packed` [N, K/2] the re-laid codes (a view of the bank)."""

    def __init__(self, qt: Q.QuantizedTensor, packed: torch.Tensor):
        QuantKernel.__init__(self, Q.QuantizedTensor(qt.scheme, qt.shape, {p: v for p, v in qt.parts.items()
                                                                          if p != "q"}, dict(qt.params), qt.dtype))
        self.group_size, self.packed, self.layout = qt.params["group_size"], packed, int4_layout()
        d = qt.parts["scale"].float()  # [N, G], as Int4PackCPU builds it
        zero = qt.parts["min"].float() + 8 * d if qt.params["zero"] == "min" else torch.zeros_like(d)
        self.scale_zero = torch.stack((d, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [G, N, 2]


class Int8Split(Int8PackCPU):
    """`Int8PackCPU` (per-channel int8, the codes where they lie) that also runs split into row chunks as
    `DenseGemm` does, by `packed_gemm`: each chunk an `Int8PackCPU` over views of the codes' rows (with its
    own bf16 scales: 2 bytes a row in all, next to K bytes of codes)."""

    def __init__(self, qt: Q.QuantizedTensor):
        super().__init__(qt)
        self._splits: dict[tuple[int, int], SplitRows] = {}

    def split(self, threads: int, per_thread: int = 1) -> SplitRows:
        s = self._splits.get((threads, per_thread))
        if s is None:
            (n, k), q, sc = self.shape, self.qt.parts["q"], self.qt.parts["scale"]
            rows = [Int8PackCPU(Q.QuantizedTensor("int8", (c, k), {"q": q[a:a + c], "scale": sc[a:a + c]}, {},
                                                  self.qt.dtype)) for a, c in split_bounds(n, k, threads * per_thread)]
            s = self._splits[threads, per_thread] = SplitRows(rows, self.nbytes, workers=threads)
        return s

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g, threads = gemm_at("packed_gemm", x.shape[0]), torch.get_num_threads()
        if g == "plain" or threads == 1:
            return super().__call__(x)
        return self.split(threads, chunks_per_thread(g))(x)


def _kernel(w, dense_dtype: torch.dtype):
    """A matmul x -> x @ w.T: a packed kernel for a QuantizedTensor (`Int8Split` for per-channel int8), the
    kernel itself for one already built (`RowBlocks`), the GEMM of `dense_dtype` for a dense tensor (no copy
    when it is already of that dtype)."""
    if isinstance(w, Q.QuantizedTensor):
        if (w.scheme == "int8" and "group_size" not in w.params and w.device.type == "cpu"
                and len(w.shape) == 2):
            return Int8Split(w)
        return QuantKernel.for_tensor(w)
    if not isinstance(w, torch.Tensor):
        return w
    return DenseGemm(w.to(dense_dtype).contiguous())


class HostExpert:
    """One expert on the host: `HostExpert(w13, w2)(x)` = w2 @ (act(gate x) * up x) for x [T, H].

    w13: [2I, H] (gate rows, then up rows) and w2: [H, I], each a dense tensor (computed in `dense_dtype`,
    bf16 by default; the activations then run in that dtype too), a `QuantizedTensor` (int8 per channel,
    int8 group-wise, int4 group-wise: kept packed, one copy) or a `RowBlocks` kernel (bf16 activations)."""

    def __init__(self, w13, w2, act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
                 dense_dtype: torch.dtype = torch.bfloat16):
        self.inter, self.hidden = w2.shape[1], w2.shape[0]
        if tuple(w13.shape) != (2 * self.inter, self.hidden):
            raise ValueError(f"w13 {tuple(w13.shape)} does not fit w2 {tuple(w2.shape)}: expected "
                             f"{(2 * self.inter, self.hidden)}")
        self.gate_up, self.down = _kernel(w13, dense_dtype), _kernel(w2, dense_dtype)
        dense = isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
        self.compute_dtype = dense_dtype if dense else torch.bfloat16
        """The activations' dtype inside (a dense fp32 expert computes exactly as `layers/moe.expert_mlp`)."""
        self.act = act
        size = dense_dtype.itemsize
        self.nbytes = sum(k.nbytes if hasattr(k, "nbytes") else size * n for k, n in
                          ((self.gate_up, w13.shape[0] * w13.shape[1]), (self.down, w2.shape[0] * w2.shape[1])))
        """Bytes of weights one call reads."""

    @staticmethod
    def quantize(w13: torch.Tensor, w2: torch.Tensor, fmt: str, group_size: int = 32,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> "HostExpert":
        """From dense weights in `fmt` (bf16 | int8 per channel | int4 group-wise with a min)."""
        if fmt == "bf16":
            return HostExpert(w13, w2, act)
        if fmt == "int8":
            return HostExpert(Q.quantize_int8(w13), Q.quantize_int8(w2), act)
        if fmt == "int4":
            return HostExpert(Q.quantize_int4(w13, group_size, "min"), Q.quantize_int4(w2, group_size, "min"), act)
        raise ValueError(f"unknown host expert format {fmt!r}; choose one of {', '.join(FORMATS)}")

    def fused(self, x: torch.Tensor) -> bool:
        """Whether this call runs as one native call (`native_fused_expert`)."""
        g, d = self.gate_up, self.down
        if isinstance(g, RowBlocks) and isinstance(d, RowBlocks):
            return self._fused_fp8(x) or self._fused_nf4(x)
        return isinstance(g, DenseGemm) and isinstance(d, DenseGemm) and native_expert_fits(x, g.w, d.w, self.act)

    def _fused_fp8(self, x: torch.Tensor) -> bool:
        g, d = self.gate_up, self.down
        return (native_fused_expert and g.fp8 is not None and d.fp8 is not None and self.act is F.silu
                and native_c_threads and gemm_at("row_blocks_gemm", x.shape[0]).startswith("native")
                and g.native_ok(x.shape[0]) and d.native_ok(x.shape[0])
                and g.fp8_amx(x.shape[0]) == d.fp8_amx(x.shape[0]))

    def _fused_nf4(self, x: torch.Tensor) -> bool:
        """An NF4 SiLU expert whose GEMVs run "native" on the AVX512-BF16 kernel (both sides' columns and groups
        multiples of 64: `host_native.nf4_x`'s bf16 layout) takes one native call (`host_native.expert_silu_nf4`)."""
        g, d = self.gate_up, self.down
        return (native_fused_expert and g.nf4 is not None and d.nf4 is not None and self.act is F.silu
                and native_c_threads and host_native.nf4_bf16()
                and gemm_at("row_blocks_gemm", x.shape[0]).startswith("native")
                and g.native_ok(x.shape[0]) and d.native_ok(x.shape[0])
                and all(b.shape[1] % 64 == 0 and b.nf4[2] % 64 == 0 for b in (g, d)))

    def window_fits(self, x: torch.Tensor, cols: int) -> bool:
        """Whether this packed expert's intermediate columns [cols, I) run as one native call (`window`): its fused
        fp8 or NF4 path takes x, and the window starts on 32 (fp8; NF4: 64) columns and on a scale group of w2."""
        if not isinstance(self.gate_up, RowBlocks):
            return False
        if self._fused_fp8(x):
            g2 = self.down.fp8[2]
            return cols % 32 == 0 and 0 <= cols < self.inter and (g2 == self.inter or cols % g2 == 0)
        if self._fused_nf4(x):
            return cols % 64 == 0 and cols % self.down.nf4[2] == 0 and 0 <= cols < self.inter
        return False

    def window(self, x: torch.Tensor, cols: int = 0) -> torch.Tensor:
        """Gate, up, SiLU and down of an fp8 or NF4 expert (its intermediate columns [cols, I): the hybrid split's
        host part) in one native call (`host_native.expert_silu_fp8` / `expert_silu_nf4`): [T, H] bf16."""
        threads, T, H = torch.get_num_threads(), x.shape[0], self.hidden
        n = self.inter - cols
        out = torch.empty(T, H, dtype=torch.bfloat16)
        if self.gate_up.nf4 is not None:
            return host_native.expert_silu_nf4(
                host_native.nf4_x(x, self.gate_up.nf4[2], bf16=True), self.gate_up.nf4, self.down.nf4, out,
                c_pool_split(n, H, threads), c_pool_split(H, n // 2, threads), cols=cols)
        return host_native.expert_silu_fp8(
            x.to(torch.bfloat16).contiguous(), self.gate_up.fp8, self.down.fp8, out,
            c_pool_split(n, 2 * H, threads), c_pool_split(H, n, threads), amx=self.gate_up.fp8_amx(T), cols=cols)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H], in x's dtype; computed with `compute_dtype` activations
        if self.fused(x):
            if isinstance(self.gate_up, RowBlocks):  # fp8 / NF4: gate, up, SiLU and down in one native call
                return self.window(x).to(x.dtype)
            return native_expert(x, self.gate_up.w, self.down.w)
        xb = x.to(self.compute_dtype)
        h = self.gate_up(xb)  # [T, 2I]
        gate, up = h[:, :self.inter], h[:, self.inter:]  # [T, I] views
        mid = self.act(gate).mul_(up)  # [T, I], a fresh contiguous tensor
        return self.down(mid).to(x.dtype)


def native_expert_fits(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: Callable, cols: int = 0) -> bool:
    """Whether a SiLU expert over dense w13 [2I, H], w2 [H, I] (its columns [cols, I)) runs as one native call
    (`native_fused_expert`, under "native" on the C pool with bf16 x)."""
    H, I = w2.shape
    return (native_fused_expert and gemm_at("dense_gemm", x.shape[0]) == "native" and native_bf16_dot
            and native_c_threads and act is F.silu and x.dtype == torch.bfloat16
            and x.shape[0] <= host_native.max_tokens(use_amx(x.shape[0]))
            and w13.dtype == torch.bfloat16 and w2.dtype == torch.bfloat16 and w13.stride(1) == 1
            and w2.stride(1) == 1 and tuple(w13.shape) == (2 * I, H) and H % 32 == 0 and I % 32 == 0
            and cols % 32 == 0 and 0 <= cols < I and host_native.nf4_bf16())


def native_experts(x: torch.Tensor, tokens: list[int], w13s: list[torch.Tensor], w2s: list[torch.Tensor],
                   cols: int = 0) -> torch.Tensor:
    """`native_expert` for several experts at once in one native call (`native_batched_experts`), the pool's rows
    counted over all of them: x [sum(tokens), H] bf16, expert i's rows next after expert i - 1's (each fits
    `native_expert_fits`; one shape). [sum(tokens), H] bf16, each expert's rows the bits `native_expert` gives."""
    threads = torch.get_num_threads()
    H, I = w2s[0].shape
    n, m = I - cols, len(tokens)
    y = torch.empty(x.shape[0], H, dtype=torch.bfloat16)
    host_native.experts_silu_bf16(
        list(x.contiguous().split(tokens)), w13s, w2s, list(y.split(tokens)), c_pool_split(m * n, 4 * H, threads),
        c_pool_split(m * H, 2 * n, threads), NATIVE_PREFETCH_ROWS, NATIVE_PREFETCH_ROWS_MULTI,
        [use_amx(t) for t in tokens], cols)
    return y


def native_packed_experts(x: torch.Tensor, tokens: list[int], experts: list[HostExpert], cols: int = 0) -> torch.Tensor:
    """`native_experts` for NF4 or fp8 SiLU experts of one bank (each one whose window [cols, I) runs as one native
    call alone: `HostExpert.window_fits`, `window`): one native call (`host_native.experts_silu_nf4` /
    `experts_silu_fp8`). [sum(tokens), H] bf16, each expert's rows the bits its `window` gives."""
    threads = torch.get_num_threads()
    first = experts[0]
    H, n, m = first.hidden, first.inter - cols, len(experts)
    y = torch.empty(x.shape[0], H, dtype=torch.bfloat16)
    outs = list(y.split(tokens))
    if first.gate_up.nf4 is not None:
        xs = list(host_native.nf4_x(x, first.gate_up.nf4[2], bf16=True).split(tokens))
        host_native.experts_silu_nf4(xs, [e.gate_up.nf4 for e in experts], [e.down.nf4 for e in experts], outs,
                                     c_pool_split(m * n, H, threads), c_pool_split(m * H, n // 2, threads), cols=cols)
    else:
        xs = list(x.to(torch.bfloat16).contiguous().split(tokens))
        host_native.experts_silu_fp8(xs, [e.gate_up.fp8 for e in experts], [e.down.fp8 for e in experts], outs,
                                     c_pool_split(m * n, 2 * H, threads), c_pool_split(m * H, n, threads),
                                     amx=[first.gate_up.fp8_amx(t) for t in tokens], cols=cols)
    return y


def native_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, cols: int = 0) -> torch.Tensor:
    """The SiLU expert (its intermediate columns [cols, I)) in one native call on the C pool (`native_expert_fits`):
    [T, H] bf16."""
    threads = torch.get_num_threads()
    H, I = w2.shape
    n = I - cols
    return host_native.expert_silu_bf16(
        x.contiguous(), w13, w2, torch.empty(x.shape[0], H, dtype=torch.bfloat16), c_pool_split(n, 4 * H, threads),
        c_pool_split(H, 2 * n, threads), NATIVE_PREFETCH_ROWS, NATIVE_PREFETCH_ROWS_MULTI, use_amx(x.shape[0]), cols)


def host_expert_reference(x: torch.Tensor, w13: torch.Tensor | Q.QuantizedTensor,
                          w2: torch.Tensor | Q.QuantizedTensor,
                          act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """The plain path: the weights dequantized to fp32, `layers/moe.expert_mlp` in fp32. x: [T, H] -> [T, H] fp32."""
    def dense(w):
        return w.dequantize(torch.float32) if isinstance(w, Q.QuantizedTensor) else w.float()
    return expert_mlp(x.float(), dense(w13), dense(w2), act)
