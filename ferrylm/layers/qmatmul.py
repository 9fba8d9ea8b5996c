"""Quantized matmul: `x @ W.T` computed on a quantized weight where it lies, by the fastest kernel that
serves its scheme on its device. A kernel is built once at load (`QuantKernel.for_tensor`) from a
device-agnostic `QuantizedTensor` and then *is* the weight: it holds the one copy, in its own layout where
it has one, and gives the exact `QuantizedTensor` back (`tensor()`, `rows(idx)` for embedding lookups and
the LM head's exact top-logit pass, `dequantize()`), so no second copy is kept beside it.

Kernels, by scheme, on CPU (each checked against `Dequantize` over a sweep of shapes in
tests/test_qmatmul.py):
- `Int4PackCPU`: int4 (Q4_0 / Q4_1 and re-quantized int4), torch's `_weight_int4pack_mm_for_cpu` with bf16
  activations. That kernel dequantizes as (q - 8) * scale + zero, so Q4_0 is (d, 0) and Q4_1 (d, m + 8d);
  scale and zero are rounded to bf16 (the activations' dtype; the kernel is ~100x slower on fp32 ones).
  Its packed layout is a fixed permutation of the codes (blocks of 64 rows: [N/64, K, 32] bytes, row j of
  a block in the low nibble, row 32 + j in the high), so the original codes are dropped and read back
  from it exactly (`_unpack_rows`); the fp16 scales (and mins) are kept for exact dequantization. From
  `DENSE_FROM_T` tokens (prefill chunks; off by default, see there) the kernel is compute-bound and ~2x
  slower than oneDNN's bf16 GEMM, so there the weight is dequantized per call, `DEQUANT_CHUNK` rows at a time, into bf16 for the dense
  GEMM (measured on this machine, 1 thread, [3072, 576]: at T=500 34 ms int4pack vs 4 ms dequantize + 14 ms
  GEMM; at T=64 4.6 vs 2.2 + 2.9 ms, so the break-even is near T=100).
- `Int8PackCPU`: per-channel int8, torch's `_weight_int8pack_mm`, bf16 activations; shares the codes.
- `Int8GroupCPU`: group-wise int8 (Q8_0, e.g. a tied embedding used as the LM head). No torch kernel takes
  group-wise scales and `_weight_int8pack_mm` wants contiguous rows, so the codes are held once as
  [G, N, gs]: at T <= `GROUPED_MAX_T` tokens one `_weight_int8pack_mm` per group (unit scales, K = gs)
  accumulated in fp32 with the group's scale (reads 1.06 bytes a weight, no bf16 copy); for more tokens
  (compute-bound there) row chunks are dequantized into a bf16 buffer for oneDNN's GEMM, which gives
  exactly what a held bf16 copy gave, 1.3-3x slower than the copy at 4-16 tokens (TODO: a Q8_0 GEMM of
  our own for batched LM heads; the copy would double the head's memory).
- `Dequantize`: everything else (nf4, fp8 on CPU, any device without a kernel): dequantize, then `F.linear`.
  The plain reference path.
On CUDA, `packed_linear.PackedTriton` (every format the fused MoE kernel reads: a Triton GEMM decoding tiles in
registers at decode, dense chunks for cuBLAS at prefill).
Activations come and go in the caller's dtype; the kernel casts at its edge. T tokens, K in, N out,
G = K / gs groups of a row. This module knows nothing about modules, checkpoints or where the tensor
came from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrylm.weights.quant import QuantizedTensor, pack_nibbles, unpack_nibbles

GROUPED_MAX_T = 6
"""Most tokens for which the Q8_0 kernel runs per group (its cost grows ~linearly in tokens; chunked
dequantization costs about as much as 4-8 grouped tokens on the SmolLM2 head, measured on this machine)."""
DEQUANT_CHUNK = 2048
"""Rows the Q8_0 and int4 kernels dequantize at a time for many tokens (a multiple of 64)."""
DENSE_FROM_T: int | None = None
"""Tokens from which the int4 kernel dequantizes to bf16 and runs the dense GEMM instead (prefill); None:
never. Off by default: the two paths round differently (int4pack rounds scale and zero to bf16), so a
greedy answer would depend on how many tokens its step batched (tests/test_server.py's 32 concurrent streams
vs offline caught a flip). 128 measured ~1.7x faster prefill (docs/benchmarks.md). TODO: match the numerics."""
_INT4_BLOCK = 64
"""Rows per block of torch's CPU int4 packed layout."""


class QuantKernel:
    """Computes x [T, K] -> [T, N] against one quantized weight, and holds that weight."""

    name = "dequantize"

    def __init__(self, qt: QuantizedTensor):
        self.qt = qt
        self.shape = tuple(qt.shape)
        self.row_wise = qt.row_wise

    @staticmethod
    def for_tensor(qt: QuantizedTensor, reference: bool = False, compute: torch.device | None = None) -> "QuantKernel":
        """The fastest kernel that serves `qt` computed on `compute` (default: where it lies; a streamed layer's
        weight lies in host memory and is computed on the GPU); `reference`: the plain path."""
        compute = qt.device if compute is None else torch.device(compute)
        if not reference and compute.type != "cpu":
            from ferrylm.layers import packed_linear

            return packed_linear.PackedTriton(qt) if packed_linear.usable(qt, compute) else Dequantize(qt)
        if not reference and qt.device.type == "cpu" and len(qt.shape) == 2:
            n, _ = qt.shape
            if qt.scheme == "int4" and n % 16 == 0:
                return Int4PackCPU(qt)
            if qt.scheme == "int8" and "group_size" not in qt.params:
                return Int8PackCPU(qt)
            if qt.scheme == "int8":
                return Int8GroupCPU(qt)
        return Dequantize(qt)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tensor(self) -> QuantizedTensor:
        """The weight, exactly as it was loaded (rebuilt from the kernel's layout where it has its own)."""
        return self.qt

    def rows(self, idx: torch.Tensor) -> QuantizedTensor:
        """Rows `idx` [R] of a row-wise weight, still packed."""
        return self.tensor().rows(idx)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.tensor().dequantize(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes the kernel holds (and reads per call, give or take its scales)."""
        return self.qt.nbytes


class Dequantize(QuantKernel):
    name = "dequantize"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.qt.dequantize(x.dtype))


class Int4PackCPU(QuantKernel):
    name = "int4pack"

    def __init__(self, qt: QuantizedTensor):
        super().__init__(qt)
        n, k = qt.shape
        self.group_size = qt.params["group_size"]
        codes = unpack_nibbles(qt.parts["q"]).to(torch.int32)  # [N, K]
        self.packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)  # [N, K/2] uint8, kernel layout
        d = qt.parts["scale"].float()  # [N, G]
        zero = qt.parts["min"].float() + 8 * d if qt.params["zero"] == "min" else torch.zeros_like(d)
        self.scale_zero = torch.stack((d, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [G, N, 2]
        # the layout is torch's, not ours: drop our copy of the codes only where reading them back is
        # checked to give them exactly (whole 64-row blocks; the first block verified here)
        probe = torch.arange(min(n, _INT4_BLOCK))
        if n % _INT4_BLOCK == 0 and torch.equal(self._unpack_rows(probe), codes[:_INT4_BLOCK].to(torch.uint8)):
            self.qt = QuantizedTensor(qt.scheme, qt.shape, {p: v for p, v in qt.parts.items() if p != "q"},
                                      dict(qt.params), qt.dtype)

    def _unpack_rows(self, idx: torch.Tensor) -> torch.Tensor:
        # packed: [N, K/2] -> [N/64, K, 32] bytes; row b*64 + j: low nibble (j < 32) / high (j >= 32) of [b, :, j % 32]
        n, k = self.shape
        blocks = self.packed.view(-1, k, _INT4_BLOCK // 2)
        half = _INT4_BLOCK // 2
        byte = blocks[idx // _INT4_BLOCK, :, idx % half]  # [R, K]
        return torch.where((idx % _INT4_BLOCK < half)[:, None], byte & 0xF, byte >> 4)  # [R, K] codes

    def _codes(self, a: int, c: int) -> torch.Tensor:
        # rows [a, a + c) (multiples of 64), by views: [c/64, K, 32] bytes -> [c/64, K, 64] codes -> [c, K]
        k = self.shape[1]
        blocks = self.packed.view(-1, k, _INT4_BLOCK // 2)[a // _INT4_BLOCK:(a + c) // _INT4_BLOCK]
        return torch.cat((blocks & 0xF, blocks >> 4), dim=-1).transpose(1, 2).reshape(c, k)

    def _dequant_rows(self, a: int, c: int, dtype: torch.dtype) -> torch.Tensor:
        # gguf's order, as quant._dequant_int4: Q4_0 d * (q - 8); Q4_1 d * q + m -> [c, K]
        if "q" in self.qt.parts:
            return self.qt.dequantize(dtype)[a:a + c]
        q = self._codes(a, c).float().view(c, -1, self.group_size)  # [c, G, gs]
        d = self.qt.parts["scale"][a:a + c].float()[..., None]
        if self.qt.params["zero"] == "sym":
            w = q.sub_(8).mul_(d)
        else:
            w = q.mul_(d).add_(self.qt.parts["min"][a:a + c].float()[..., None])
        return w.view(c, -1).to(dtype)

    def tensor(self) -> QuantizedTensor:
        if "q" in self.qt.parts:
            return self.qt
        return QuantizedTensor(self.qt.scheme, self.qt.shape, {"q": pack_nibbles(self._codes(0, self.shape[0])),
                                                               **self.qt.parts}, dict(self.qt.params), self.qt.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._dequant_rows(0, self.shape[0], dtype or self.qt.dtype)

    def rows(self, idx: torch.Tensor) -> QuantizedTensor:
        if "q" in self.qt.parts:
            return self.qt.rows(idx)
        parts = {p: v.index_select(0, idx) for p, v in self.qt.parts.items()}
        parts["q"] = pack_nibbles(self._unpack_rows(idx))  # [R, K/2]
        return QuantizedTensor(self.qt.scheme, (idx.numel(), self.shape[1]), parts, dict(self.qt.params), self.qt.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if DENSE_FROM_T is not None and x.shape[0] >= DENSE_FROM_T:  # row chunks, so the bf16 temporary stays small for expert-sized weights
            n = self.shape[0]
            xb = x.to(torch.bfloat16)
            if "q" in self.qt.parts or n <= DEQUANT_CHUNK:
                return F.linear(xb, self.dequantize(torch.bfloat16)).to(x.dtype)
            out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
            for a in range(0, n, DEQUANT_CHUNK):
                c = min(DEQUANT_CHUNK, n - a)
                out[:, a:a + c] = F.linear(xb, self._dequant_rows(a, c, torch.bfloat16))
            return out.to(x.dtype)
        if x.dtype == torch.bfloat16:  # no cast dispatches on the bf16 path (120 matmuls a token on SmolLM2)
            return torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scale_zero)
        out = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, self.group_size, self.scale_zero)
        return out.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zero.nbytes + self.qt.nbytes


class Int8PackCPU(QuantKernel):
    name = "int8pack"

    def __init__(self, qt: QuantizedTensor):
        super().__init__(qt)
        self.scale = qt.parts["scale"].to(torch.bfloat16)  # [N]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            return torch._weight_int8pack_mm(x, self.qt.parts["q"], self.scale)
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qt.parts["q"], self.scale).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.qt.nbytes + self.scale.nbytes


class Int8GroupCPU(QuantKernel):
    name = "int8group"

    def __init__(self, qt: QuantizedTensor):
        super().__init__(qt)
        n, k = qt.shape
        self.gs = qt.params["group_size"]
        self.codes = qt.parts["q"].view(n, -1, self.gs).transpose(0, 1).contiguous()  # [G, N, gs]
        self.scale = qt.parts["scale"]  # [N, G] fp16, as loaded
        self.scale_t = self.scale.t().float().contiguous()  # [G, N] fp32, per-group multipliers
        self.ones = torch.ones(n, dtype=torch.bfloat16)
        self.dtype = qt.dtype
        self.qt = None  # the codes live in `codes` only

    def tensor(self) -> QuantizedTensor:
        return self.rows(torch.arange(self.shape[0]))

    def rows(self, idx: torch.Tensor) -> QuantizedTensor:
        q = self.codes.index_select(1, idx).transpose(0, 1).reshape(idx.numel(), -1)  # [G, R, gs] -> [R, K]
        return QuantizedTensor("int8", (idx.numel(), self.shape[1]), {"q": q, "scale": self.scale.index_select(0, idx)},
                               {"group_size": self.gs}, self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if x.shape[0] <= GROUPED_MAX_T:
            xg = xb.view(x.shape[0], -1, self.gs).transpose(0, 1).contiguous()  # [G, T, gs]
            mm, codes, scale, ones = torch._weight_int8pack_mm, self.codes, self.scale_t, self.ones
            out = mm(xg[0], codes[0], ones).float().mul_(scale[0])  # [T, N] fp32
            for g in range(1, codes.shape[0]):
                out.addcmul_(mm(xg[g], codes[g], ones), scale[g])
            return out.to(x.dtype)
        n, k = self.shape
        out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        w32 = torch.empty(min(DEQUANT_CHUNK, n), k // self.gs, self.gs)  # [C, G, gs]
        wb = torch.empty(w32.shape[0], k, dtype=torch.bfloat16)  # [C, K]
        for a in range(0, n, DEQUANT_CHUNK):
            c = min(DEQUANT_CHUNK, n - a)
            # w = d * q in fp32 then rounded to bf16: the same weight a held bf16 copy would be
            torch.mul(self.codes[:, a:a + c].transpose(0, 1), self.scale_t[:, a:a + c].t()[..., None], out=w32[:c])
            wb[:c].copy_(w32[:c].view(c, k))
            out[:, a:a + c] = F.linear(xb, wb[:c])
        return out.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.scale_t.nbytes
