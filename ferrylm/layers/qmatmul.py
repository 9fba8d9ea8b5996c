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
  Its packed layout is a fixed permutation of the codes that torch picks by CPU capability (`Int4Layout`,
  learnt once from torch's own conversion: AVX512 blocks of 64 rows, AVX2 of 32), so the original codes
  are dropped and read back from it exactly; the fp16 scales (and mins) are kept for exact dequantization.
  From `DENSE_FROM_T` tokens (prefill chunks; off by default, see there) the kernel is compute-bound and ~2x
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
- `Fp8NativeCPU`: fp8 per channel or group-wise (block-wise FP8 checkpoints load as groups of 128), where
  `layers/host_native` builds its AVX512-BF16 kernels: `gemv_fp8` at up to `host_native.MAX_TOKENS` tokens with
  bf16 activations (the exact e4m3 values times them, fp32 sums, each group's sum times its scale; on AMX tiles
  where the CPU grants them), the whole matrix in one call on the C pool; more tokens dequantize per call. A
  DeepSeek-V3 [4096, 2048] Linear at one token, 2-core Xeon: ~42 ms through `Dequantize` against 0.63 ms for the
  same weight dense in bf16 (session 24's review).
- `Dequantize`: everything else (nf4, fp8 without the native kernels, any device without a kernel): dequantize,
  then `F.linear`.
  The plain reference path.
On CUDA, `packed_linear.PackedTriton` (every format the fused MoE kernel reads: a Triton GEMM decoding tiles in
registers at decode, dense chunks for cuBLAS at prefill).
Activations come and go in the caller's dtype; the kernel casts at its edge. T tokens, K in, N out,
G = K / gs groups of a row. This module knows nothing about modules, checkpoints or where the tensor
came from.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Int4Layout:
    """Torch's CPU int4 packed layout on this build (`_convert_weight_to_int4pack_for_cpu`, a fixed permutation
    of the codes): blocks of `block` rows, each [K, block / 2] bytes; byte s of a column holds row `lo[s]`
    of the block in its low nibble and row `hi[s]` in its high. Torch chooses it by CPU capability (seen:
    AVX512 64 rows, s | s + 32; AVX2 32 rows, s | s + 16), so it is learnt from torch itself (`int4_layout`).
    The store's layout, for comparison: row n holds code 2c in the low nibble of byte c, 2c + 1 in the high.
    Torch ops only, so every method runs where the bytes lie (host, or a device slot after a copy)."""

    block: int
    lo: torch.Tensor  # [block / 2] rows of a block
    hi: torch.Tensor
    halves: bool = False
    """lo = the first half of the block's rows, hi = the second (both layouts seen): slices, not gathers."""
    where: torch.Tensor | None = None
    """[block] row of a block -> its byte in a column, + block / 2 for the high nibble (the inverse of lo, hi)."""

    def __post_init__(self):
        h = self.block // 2
        if not torch.equal(torch.sort(torch.cat((self.lo, self.hi))).values, torch.arange(self.block)):
            raise ValueError(f"int4 layout: lo and hi are no permutation of a block's {self.block} rows")
        object.__setattr__(self, "halves", torch.equal(self.lo, torch.arange(h))
                           and torch.equal(self.hi, torch.arange(h, self.block)))
        where = torch.empty(self.block, dtype=torch.long)
        where[self.lo], where[self.hi] = torch.arange(h), torch.arange(h, self.block)
        object.__setattr__(self, "where", where)

    def _take(self, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # v [b, block, ...] -> the block's rows `rows` (lo or hi), dim 1
        if self.halves:
            return v[:, int(rows[0]):int(rows[0]) + self.block // 2]
        return v.index_select(1, rows.to(v.device))

    def codes(self, packed: torch.Tensor, k: int, a: int, c: int) -> torch.Tensor:
        """Rows [a, a + c) (whole blocks) of `packed` [N, K/2] as codes [c, K] uint8, by views where it can."""
        b = self.block
        blocks = packed.view(-1, k, b // 2)[a // b:(a + c) // b]  # [c/b, K, b/2]
        both = torch.cat((blocks & 0xF, blocks >> 4), dim=-1)  # [c/b, K, b]: rows lo..., hi...
        if not self.halves:
            both = both.index_select(2, self.where.to(both.device))
        return both.transpose(1, 2).reshape(c, k)

    def rows(self, packed: torch.Tensor, k: int, idx: torch.Tensor) -> torch.Tensor:
        """Rows `idx` [R] of `packed` [N, K/2] as codes [R, K] uint8."""
        b = self.block
        w = self.where.to(idx.device)[idx % b]
        byte = packed.view(-1, k, b // 2)[idx // b, :, w % (b // 2)]  # [R, K]
        return torch.where((w < b // 2)[:, None], byte & 0xF, byte >> 4)

    def to_cpu_(self, q: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """q [N, K/2] (N whole blocks) from the store's layout to this one, in place, `chunk` rows at a time."""
        return self._relay_(q, True, chunk)

    def from_cpu_(self, q: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """The inverse of `to_cpu_`: what a copy of a re-laid expert does on arrival."""
        return self._relay_(q, False, chunk)

    def _relay_(self, q: torch.Tensor, to_cpu: bool, chunk: int) -> torch.Tensor:
        n, k2 = q.shape
        b, h = self.block, self.block // 2
        chunk = max(b, chunk // b * b)
        for a in range(0, n, chunk):
            c = min(chunk, n - a)
            rows = q[a:a + c]
            if to_cpu:
                v = rows.view(c // b, b, k2)
                lo, hi = self._take(v, self.lo).transpose(1, 2), self._take(v, self.hi).transpose(1, 2)
                out = torch.empty(c // b, k2, 2, h, dtype=torch.uint8, device=q.device)  # [b, c2, even|odd, s]
                torch.bitwise_or(lo & 0xF, hi << 4, out=out[:, :, 0])  # column 2 c2: both rows' low nibbles
                torch.bitwise_or(lo >> 4, hi & 0xF0, out=out[:, :, 1])  # column 2 c2 + 1: both high nibbles
            else:
                v = rows.view(c // b, k2, 2, h)
                ev, od = v[:, :, 0].transpose(1, 2), v[:, :, 1].transpose(1, 2)  # [b, s, c2]
                low, high = (ev & 0xF) | (od << 4), (ev >> 4) | (od & 0xF0)  # rows lo[s] / hi[s]
                if self.halves:
                    out = torch.cat((low, high), dim=1)
                else:
                    out = torch.empty(c // b, b, k2, dtype=torch.uint8, device=q.device)
                    out.index_copy_(1, self.lo.to(q.device), low)
                    out.index_copy_(1, self.hi.to(q.device), high)
            rows.copy_(out.view(c, k2))
        return q


_LAYOUT: list[Int4Layout | None] = []


def int4_layout() -> Int4Layout | None:
    """This build's `Int4Layout`, learnt once: rows of a probe tagged by their index (two nibbles, two
    conversions) give which rows each byte holds; the smallest block for which that reading reproduces
    torch's conversion of random codes exactly is the layout. None if none does (or the kernel is absent):
    then int4 kernels keep the store's codes beside theirs."""
    if not _LAYOUT:
        _LAYOUT.append(_learn_int4_layout())
    return _LAYOUT[0]


def _learn_int4_layout() -> Int4Layout | None:
    n, k = 256, 64
    try:
        lo = hi = torch.zeros(n * k // 2, dtype=torch.long)
        for digit in (0, 1):
            tag = ((torch.arange(n) >> 4 * digit) & 0xF)[:, None].expand(n, k).to(torch.int32).contiguous()
            b = torch._convert_weight_to_int4pack_for_cpu(tag, 2).reshape(-1).long()
            lo, hi = lo + ((b & 0xF) << 4 * digit), hi + ((b >> 4) << 4 * digit)
        g = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (2 * n, k), dtype=torch.int32, generator=g)
        want = torch._convert_weight_to_int4pack_for_cpu(codes, 2).reshape(2 * n, k // 2)
    except (RuntimeError, AttributeError):
        return None
    for block in (8, 16, 32, 64, 128, 256):
        try:
            layout = Int4Layout(block, lo[:block // 2].clone(), hi[:block // 2].clone())
        except ValueError:  # the bytes of a larger block
            continue
        if torch.equal(layout.to_cpu_(pack_nibbles(codes.to(torch.uint8))), want):
            return layout
    return None


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
            if qt.scheme == "fp8" and Fp8NativeCPU.usable(qt):
                return Fp8NativeCPU(qt)
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


FP8_NATIVE_MAX_T = 512
"""Most tokens `Fp8NativeCPU` runs natively, in calls of 16; more dequantize the weight per call. A [4096, 2048]
weight on the 2-core Xeon: ~0.6-1.1 ms a call of up to 16 tokens on AMX tiles, ~37 ms to dequantize."""


class Fp8NativeCPU(QuantKernel):
    name = "fp8-native"

    def __init__(self, qt: QuantizedTensor):
        super().__init__(qt)
        n, k = qt.shape
        self.group = qt.params.get("group_size") or k
        self.scale = qt.parts["scale"].float().reshape(n, -1).contiguous()  # [N, K / group]

    @staticmethod
    def usable(qt: QuantizedTensor) -> bool:
        from ferrylm.layers import host_native

        n, k = qt.shape
        group = qt.params.get("group_size") or k
        return (host_native.available() and host_native.nf4_bf16() and k % 32 == 0 and group % 32 == 0
                and qt.parts["q"].dim() == 2 and qt.parts["q"].stride(1) == 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from ferrylm.layers import host_native

        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)
        T, N = x2.shape[0], self.shape[0]
        if T == 0 or T > FP8_NATIVE_MAX_T:
            return F.linear(x, self.qt.dequantize(x.dtype))
        amx = host_native.fp8_amx(K, self.group)
        xb, out = x2.to(torch.bfloat16).contiguous(), torch.empty(T, N)
        step = host_native.MAX_TOKENS
        for t in range(0, T, step):  # (each call reads the weight once: a 16-token call costs about a 1-token one)
            host_native.gemv_fp8(xb[t:t + step], self.qt.parts["q"], self.scale, self.group, out[t:t + step],
                                 threads=torch.get_num_threads(), amx=amx)
        return out.to(x.dtype).view(*lead, N)


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
        # checked to give them exactly (whole blocks of a learnt layout; the first block verified here)
        self.layout = int4_layout()
        if self.layout is not None and n % self.layout.block == 0:
            b = self.layout.block
            if torch.equal(self.layout.codes(self.packed, k, 0, b), codes[:b].to(torch.uint8)):
                self.qt = QuantizedTensor(qt.scheme, qt.shape, {p: v for p, v in qt.parts.items() if p != "q"},
                                          dict(qt.params), qt.dtype)

    def _codes(self, a: int, c: int) -> torch.Tensor:
        # rows [a, a + c) (whole blocks) -> codes [c, K]
        return self.layout.codes(self.packed, self.shape[1], a, c)

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
        parts["q"] = pack_nibbles(self.layout.rows(self.packed, self.shape[1], idx))  # [R, K/2]
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
