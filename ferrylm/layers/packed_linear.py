"""Packed Linear weights computed on the GPU where they lie (device memory, or a streamed layer's buffer): a
`QuantKernel` over every format the fused MoE kernel reads (NF4, int4 sym / min, int8 per channel or group, fp8).

- Few tokens (T < `DENSE_FROM_T`: decode): one Triton launch, `_packed_gemm`, decodes each weight tile in
  registers through the fused MoE kernel's own `fused_moe._weight_tile` and accumulates in fp32, or (by format,
  `DECODE_KERNEL`) `fused_moe_decode`'s split-K GEMV on the weight as a bank of one expert: either reads the
  packed bytes once. Graph-capturable (no host sync, no host-to-device copy).
- More tokens (prefill): the weight is decoded into dense rows, at most `CHUNK_BYTES` of them at a time, by the
  fused kernel's decode launch (`fused_moe.decode_experts`), and each chunk multiplied by cuBLAS. The plain path
  (`qmatmul.Dequantize`) makes the whole dense weight per call (0.97 GB for Qwen2-72B's gate/up, plus its fp32
  intermediates), which a budgeted engine must hold as activations.
Both round each weight to the activations' dtype once, as `Dequantize` does; checked against it in
tests/test_packed_linear.py (CUDA, or the CPU under Triton's interpreter) and tests/test_cuda.py.

The kernel reads its parts from `self.qt` at every call, as views, so a layer streamer may re-point them
(`Linear.packed_parts`). NF4 with double-quantized absmax decodes its absmax per call (a G-element transient).
"""

from __future__ import annotations

import os

import torch

from ferrylm.layers import fused_moe
from ferrylm.layers.qmatmul import QuantKernel
from ferrylm.weights.quant import QuantizedTensor, nf4_absmax

triton = fused_moe.triton
if triton is not None:
    import triton.language as tl

    _weight_tile = fused_moe._weight_tile

    @triton.jit
    def _packed_gemm(a_ptr, w_ptr, ws_ptr, wm_ptr, lut_ptr, out_ptr, T, N, K, stride_am, stride_wn, stride_sn,
                     stride_om, FMT: tl.constexpr, GS: tl.constexpr, PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # out [T, N] = a [T, K] @ W.T, W's tiles decoded as the fused MoE kernel decodes an expert's
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < T
        n_ok = offs_n < N
        rows = offs_n.to(tl.int64)
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=m_ok[:, None] & (offs_k < K - k0)[None, :], other=0.0)
            w = _weight_tile(w_ptr, ws_ptr, wm_ptr, lut_ptr, rows, n_ok, k0, K - k0, offs_k, stride_wn, stride_sn,
                             FMT, GS, PER_ROW, BLOCK_K, BLOCK_N)
            acc = tl.dot(a, w.to(a.dtype), acc)
            a_ptrs += BLOCK_K
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

DENSE_FROM_T = fused_moe.PACKED_DENSE_MIN_ROWS or 32
"""Tokens from which the weight is decoded to dense chunks for cuBLAS (the fused MoE's measured threshold for
decoding an expert once: the in-tile decode reaches 8-18 TFLOP/s at prefill sizes, docs/benchmarks.md)."""
DECODE_KERNEL: str | dict = {"nf4": "splitk", "int4": "splitk", "int4min": "splitk"}
"""The decode-side kernel, one for all formats or by format (others "tile"): "tile" (`_packed_gemm`: one program an
N tile walks all of K, tiles decoded as the fused MoE's plain kernel decodes them) or "splitk" (`fused_moe_decode`'s
split-K GEMV: 32-bit word loads, K split over programs, a deterministic reduce; the weight as a bank of one
expert). Measured (H200, session 11, `bench_packed_linear.py`, 1-16 tokens): NF4 split-K 2.3-3.2x the tile kernel
(Qwen2-72B gate/up 0.97 vs 2.52 ms at 1 token; the plain `Dequantize` 3.91), int4 split-K 1.2-2.0x except Llama-8B
gate/up at 1 token (0.33 vs 0.26), int8 the tile kernel 1.3-2x (0.23 vs 0.29 ms on Qwen2-72B gate/up, at the HBM read
rate there)."""
CHUNK_BYTES = 128 << 20
"""Most dense bytes one prefill chunk decodes (the transient this kernel adds to a step)."""
ENABLED = True
"""False: CUDA engines keep the plain `Dequantize` path (tests and benchmarks compare the two)."""


def _decode_kernel(fmt: str) -> str:
    return DECODE_KERNEL if isinstance(DECODE_KERNEL, str) else DECODE_KERNEL.get(fmt, "tile")


def _capturing(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def usable(qt: QuantizedTensor, device: torch.device) -> bool:
    """This kernel serves `qt` computed on `device`: Triton there (CUDA, or the interpreter on the CPU), a 2-D
    weight in a format the fused kernel reads, with K a multiple of its group."""
    if not ENABLED or triton is None or len(qt.shape) != 2:
        return False
    if not (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    return fused_moe.expert_format(qt) is not None


class PackedTriton(QuantKernel):
    name = "packed-triton"

    def __init__(self, qt: QuantizedTensor):
        super().__init__(qt)
        self._ids: dict[torch.device, torch.Tensor] = {}  # [1] zeros: the one "expert" of the decode launch
        self._rows: dict[tuple, tuple] = {}  # (device, T) -> the split-K kernel's row tables (kept if built eagerly)

    def _weights(self) -> fused_moe.ExpertWeights:
        """The weight as a bank of one expert, views of the parts where they lie now."""
        qt = self.qt
        if qt.scheme == "nf4" and "absmax" not in qt.parts:  # double-quantized: its absmax decoded per call
            qt = QuantizedTensor("nf4", qt.shape, {"q": qt.parts["q"], "absmax": nf4_absmax(qt).float()},
                                 qt.params, qt.dtype)
        fmt, group, parts = fused_moe.piece_parts(qt)
        p = {k: v.unsqueeze(0) for k, v in parts.items()}
        return fused_moe.ExpertWeights(fmt, (1, *qt.shape), group, p["q"], p.get("scale"), p.get("min"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        T, (N, _) = x2.shape[0], self.shape
        w = self._weights()
        out = torch.empty(T, N, dtype=x.dtype, device=x.device)
        if T >= DENSE_FROM_T:
            self._dense_chunks(x2, w, out)
        elif T and not (_decode_kernel(w.fmt) == "splitk" and self._splitk(x2, w, out)):
            self._tile(x2, w, out)
        return out.view(*lead, N)

    def _tile(self, x: torch.Tensor, w: fused_moe.ExpertWeights, out: torch.Tensor) -> None:
        """out <- x @ W.T through `_packed_gemm`."""
        T, (N, K) = x.shape[0], self.shape
        args = fused_moe._weight_args(w, x.device)
        BM, BN, BK = fused_moe._blocks(T)
        _packed_gemm[(triton.cdiv(T, BM), triton.cdiv(N, BN))](
            x, args["w_ptr"], args["ws_ptr"], args["wm_ptr"], args["lut_ptr"], out, T, N, K, x.stride(0),
            args["stride_wn"], args["stride_sn"], out.stride(0), FMT=args["FMT"], GS=args["GS"],
            PER_ROW=args["GS"] >= K, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK)

    def _splitk(self, x: torch.Tensor, w: fused_moe.ExpertWeights, out: torch.Tensor) -> bool:
        """out <- x @ W.T through the split-K decode kernel (False where it cannot read W's layout)."""
        from ferrylm.layers import fused_moe_decode as fmd

        cfg = fmd.DecodeConfig()
        if fmd.readable(w, cfg) is not None:
            return False
        T, (N, _) = x.shape[0], self.shape
        key = (x.device, T)
        tables = self._rows.get(key)
        if tables is None:  # T rows of one expert: the MoE kernels' own row blocks (device ops only: capturable)
            ids = torch.zeros(T, dtype=torch.long, device=x.device)
            rows, block_expert, used, _ = fused_moe.align(ids[:, None], 1, cfg.block_m)
            ones = torch.ones(T, dtype=torch.float32, device=x.device)
            tables = (rows, block_expert, used, ones, ids, min(rows.numel() // cfg.block_m, T))
            if not _capturing(x):  # a capture's tensors are written at replay only: not kept
                self._rows[key] = tables
        rows, block_expert, used, ones, ids, nb = tables
        p = fmd._gemm(x, w, rows, block_expert, used, nb, T, 1, cfg.split_k2, cfg)  # [S, T, N] fp32
        out.copy_(fmd._reduce(p, N, x.dtype, ones, ids, 1, gated=False, skip=False))
        return True

    def _dense_chunks(self, x: torch.Tensor, w: fused_moe.ExpertWeights, out: torch.Tensor) -> None:
        """out <- x @ W.T, W decoded `CHUNK_BYTES` of dense rows at a time (`fused_moe.decode_experts`) for cuBLAS."""
        N, K = self.shape
        rows = max(64, CHUNK_BYTES // (K * x.element_size()) // 64 * 64)
        ids = self._ids.get(x.device)
        if ids is None:
            ids = torch.zeros(1, dtype=torch.long, device=x.device)
            if not _capturing(x):  # made inside a capture, its zeros would be written at replay only
                self._ids[x.device] = ids
        buf = torch.empty(1, min(rows, N), K, dtype=x.dtype, device=x.device)
        for a in range(0, N, rows):
            n = min(rows, N - a)
            part = {k: v[:, a:a + n] for k, v in w.parts.items()}
            chunk = fused_moe.ExpertWeights(w.fmt, (1, n, K), w.group, part["q"], part.get("scale"), part.get("min"))
            dense = fused_moe.decode_experts(chunk, [0], x.dtype, out=buf[:, :n], ids=ids)[0]
            if n == N:
                torch.matmul(x, dense.t(), out=out)
            else:
                out[:, a:a + n] = x @ dense.t()
