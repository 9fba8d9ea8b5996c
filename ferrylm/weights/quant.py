"""Weight-only quantization schemes and the `QuantizedTensor` that carries packed weights in memory.

Four schemes, each a pair of plain-torch functions (quantize, dequantize) that are the reference every
faster kernel is checked against:

- `int8`: per-output-channel symmetric INT8. scale[n] = absmax(row n) / 127.
  Bound: |w - deq| <= scale[n] / 2 per element.
  With `group_size` (2-D weights): one fp16 scale per `group_size` values of a row; group 32 is exactly
  llama.cpp's Q8_0 (w = d * q).
- `int4`: group-wise 4-bit along each row (2-D weights), codes 0..15 and one fp16 scale per group;
  `zero="sym"`: w = d * (q - 8) (llama.cpp's Q4_0 at group 32); `zero="min"`: w = d * q + m with an fp16
  min per group (Q4_1 at group 32). Bound: |w - deq| <= d / 2 (+ the fp16 rounding of d and m); d for
  "sym", whose largest-magnitude value maps to -8 so the other end clamps at +7.
- `fp8`: per-output-channel FP8 e4m3 (`torch.float8_e4m3fn`, max 448). scale[n] = absmax(row n) / 448.
  Bound: |w - deq| <= max(2**-4 * |w|, 2**-10 * scale[n]) (half an ulp of a 3-bit mantissa; half the
  smallest subnormal near zero). With `group_size` (2-D weights): one fp32 scale per `group_size` values of a
  row, scale [N, G]; `from_fp8_blocks` reads the block-wise FP8 of DeepSeek-V3's and Qwen3's FP8 releases
  (one scale per 128 x 128 block) into that layout exactly.
- `nf4`: group-wise 4-bit NormalFloat (QLoRA's 16 levels) over the row-major flattened weight, one fp32
  absmax per group of `group_size` (64 or 128) values. Optional double quantization stores the absmaxes
  as int8 around their mean with one fp32 scale per 256 groups (QLoRA's 8-bit second level).
  Bound: |w - deq| <= NF4_MAX_HALF_GAP * absmax_g (+ the absmax's own int8 error when double-quantized).

A `QuantizedTensor` is a bag of named parts (packed codes, scales) plus the scheme, its parameters and
the logical shape; the store writes the parts as they are and maps them back zero-copy. This module
knows nothing about files, checkpoints or models.
Notation: N output channels (rows), K input features, M = N*K values, G groups, B double-quant blocks.
Channels are the leading dim (a 4-D conv weight [out, in, kh, kw] has `out`), except 3-D stacked expert
weights [E, N, K], which get one scale per (expert, row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SCHEMES = ("int8", "nf4", "fp8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)
GROUP_SIZES = (64, 128)
DQ_BLOCK = 256
"""Groups per fp32 scale when NF4 absmaxes are double-quantized."""
DQ_MAX_REL_ERR = 0.125
"""Largest relative error of a double-quantized absmax; beyond it the tensor keeps fp32 absmaxes."""

# QLoRA's NF4 levels: quantiles of N(0, 1) scaled to [-1, 1], with an exact zero.
NF4_LEVELS = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
])
NF4_MAX_HALF_GAP = float((NF4_LEVELS[1:] - NF4_LEVELS[:-1]).max() / 2)
_NF4_MIDPOINTS = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2
# byte -> (low nibble level, high nibble level) as one 8-byte word: one `take` decodes two codes
# (`take` and `index_select` are several times faster on the CPU than advanced indexing)
_NF4_PAIRS = torch.stack([NF4_LEVELS[torch.arange(256) & 0xF], NF4_LEVELS[torch.arange(256) >> 4]], dim=-1)
_NF4_PAIR_WORDS = _NF4_PAIRS.contiguous().view(torch.float64).view(256)
FP8_MAX = 448.0
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # e4m3 bits -> value
_LUTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def _lut(name: str, table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A lookup table on `device`, copied there once."""
    key = (name, device)
    if key not in _LUTS:
        _LUTS[key] = table.to(device)
    return _LUTS[key]


@dataclass
class QuantizedTensor:
    """Packed weight + scales. `dequantize()` gives the dense tensor of `shape` back."""

    scheme: str
    """int8 | nf4 | fp8 | int4"""
    shape: tuple[int, ...]
    """Logical (dequantized) shape, e.g. [N, K]."""
    parts: dict[str, torch.Tensor]
    """int8/fp8: q [N, K] (int8 / uint8 bits of e4m3), scale [N] fp32 (group-wise: [N, K/group_size], int8 fp16,
    fp8 fp32).
    nf4: q [ceil(M/G_size)*G_size/2] uint8 (two codes per byte, low nibble first), and either
    absmax [G] fp32 or (double-quantized) absmax_q [G] int8, absmax_scale [B] fp32, absmax_mean [1] fp32.
    int8 with group_size: q [N, K] int8, scale [N, K/gs] fp16.
    int4: q [N, K/2] uint8 (codes k=2i in the low nibble, 2i+1 in the high), scale [N, K/gs] fp16, and
    min [N, K/gs] fp16 when zero="min". Every part has the rows leading, so rows can be gathered or
    concatenated part by part."""
    params: dict = field(default_factory=dict)
    """Scheme parameters: nf4 -> group_size, double_quant; int8 and fp8 -> group_size (absent: per channel);
    int4 -> group_size, zero ("sym" | "min")."""
    dtype: torch.dtype = torch.float32
    """The high-precision dtype the weight had (and dequantizes to by default)."""

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts.values())

    @property
    def device(self) -> torch.device:
        return self.parts["q"].device

    def to(self, device, copy: bool = False) -> "QuantizedTensor":
        parts = {k: v.to(device, copy=copy) for k, v in self.parts.items()}
        return QuantizedTensor(self.scheme, self.shape, parts, dict(self.params), self.dtype)

    def dequantize(self, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        q = self if device is None else self.to(device)
        out = _DEQUANT[self.scheme](q)  # fp32, on q's device
        return out.to(dtype or self.dtype)

    @property
    def row_wise(self) -> bool:
        """Every part is [N, ...] over the rows of a 2-D weight (rows can be gathered and concatenated)."""
        return len(self.shape) == 2 and self.scheme in ("int4", "int8", "fp8")

    def rows(self, idx: torch.Tensor) -> "QuantizedTensor":
        """The rows `idx` [R] of a row-wise tensor, still packed (an embedding lookup decodes only these)."""
        parts = {k: v.index_select(0, idx) for k, v in self.parts.items()}
        return QuantizedTensor(self.scheme, (idx.numel(), self.shape[1]), parts, dict(self.params), self.dtype)

    def narrow(self, dim: int, start: int, length: int, contiguous: bool = True) -> "QuantizedTensor | None":
        """Rows (dim 0) or columns (dim 1) [start, start + length) of a 2-D weight, still packed: a tensor-parallel
        rank's slice (`CausalLM._tp_part`). None where the slice would cut a scale group or a byte of two codes, or
        for a layout that does not lie by rows (the caller reads that slice dense). NF4 is viewed by rows when its
        groups tile the rows (K a multiple of the group size); a double-quantized absmax is kept as the fp32
        values it decodes to, so the slice dequantizes to exactly the whole tensor's values. `contiguous=False`:
        views where they can be (its shape and bytes, without copying the slice)."""
        if len(self.shape) != 2 or dim not in (0, 1) or not 0 <= start < start + length <= self.shape[dim]:
            return None
        N, K = self.shape
        params = dict(self.params)
        if self.scheme == "nf4":
            gs = params["group_size"]
            if K % gs:
                return None
            parts = {"q": self.parts["q"][: N * K // 2].view(N, K // 2),
                     "absmax": nf4_absmax(self)[: N * K // gs].view(N, K // gs)}
            params["double_quant"] = False
        elif self.row_wise:
            parts = dict(self.parts)
        else:
            return None
        out = {}
        for name, t in parts.items():
            if t.shape[0] != N:
                return None
            if dim == 0:
                out[name] = t.narrow(0, start, length)
                continue
            if t.dim() == 1:  # one scale a row: every column's
                out[name] = t
                continue
            unit = K // t.shape[1]  # weight columns per column of this part (codes a byte, a scale's group)
            if unit * t.shape[1] != K or start % unit or length % unit:
                return None
            out[name] = t.narrow(1, start // unit, length // unit)
        shape = (length, K) if dim == 0 else (N, length)
        if self.scheme == "nf4" and contiguous:
            out = {k: v.contiguous().view(-1) for k, v in out.items()}
        elif contiguous:  # (not: views, NF4's by rows; the bytes are the same)
            out = {k: v.contiguous() for k, v in out.items()}
        return QuantizedTensor(self.scheme, shape, out, params, self.dtype)

    @staticmethod
    def cat(pieces: list["QuantizedTensor"]) -> "QuantizedTensor":
        """Row-wise tensors of one scheme stacked along the rows (fused qkv / gate_up pieces)."""
        a = pieces[0]
        if len(pieces) == 1:
            return a
        if not all(p.row_wise and p.scheme == a.scheme and p.params == a.params and p.shape[1] == a.shape[1]
                   for p in pieces):
            raise ValueError("only row-wise pieces of one scheme and width can be concatenated")
        parts = {k: torch.cat([p.parts[k] for p in pieces]) for k in a.parts}
        return QuantizedTensor(a.scheme, (sum(p.shape[0] for p in pieces), a.shape[1]), parts, dict(a.params), a.dtype)


# -- INT8 per channel ------------------------------------------------------------------------------

def _rows(w: torch.Tensor) -> torch.Tensor:
    # any shape -> [N, K]: N the output channels; stacked experts [E, N, K] -> [E*N, K]
    if w.dim() == 3:
        return w.reshape(-1, w.shape[-1])
    return w.reshape(w.shape[0], -1) if w.dim() > 1 else w.reshape(1, -1)


def _channel_scale(w2: torch.Tensor, qmax: float) -> torch.Tensor:
    amax = w2.abs().amax(dim=1)  # [N]
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> QuantizedTensor:
    if group_size:
        return _quantize_int8_groups(w, group_size)
    w2 = _rows(w.float())  # [N, K]
    scale = _channel_scale(w2, 127.0)  # [N]
    q = torch.round(w2 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedTensor("int8", tuple(w.shape), {"q": q, "scale": scale}, {}, w.dtype)


def _dequant_int8(qt: QuantizedTensor) -> torch.Tensor:
    if "group_size" in qt.params:  # w = d * q, in the order gguf's Q8_0 reference multiplies
        n, k = qt.shape
        q = qt.parts["q"].float().view(n, -1, qt.params["group_size"])  # [N, G, gs]
        return q.mul_(qt.parts["scale"].float()[..., None]).view(n, k)
    return qt.parts["q"].float().mul_(qt.parts["scale"][:, None]).reshape(qt.shape)


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    # w: [N, K] -> [N, G, gs]
    if w.dim() != 2 or w.shape[1] % group_size:
        raise ValueError(f"group-wise int4/int8/fp8 needs a 2-D weight whose rows are a multiple of {group_size} "
                         f"long, not {tuple(w.shape)}")
    return w.float().view(w.shape[0], -1, group_size)


def _fp16_scale(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float16)
    return torch.where(x > 0, x, torch.ones_like(x))


def _quantize_int8_groups(w: torch.Tensor, group_size: int) -> QuantizedTensor:
    g = _groups(w, group_size)  # [N, G, gs]
    d = _fp16_scale(g.abs().amax(dim=-1) / 127.0)  # [N, G]
    q = torch.round(g / d.float()[..., None]).clamp_(-127, 127).to(torch.int8).view(w.shape)
    return QuantizedTensor("int8", tuple(w.shape), {"q": q, "scale": d}, {"group_size": group_size}, w.dtype)


# -- INT4 group-wise (Q4_0 / Q4_1) -----------------------------------------------------------------

def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    # codes: [N, K] 0..15 -> [N, K/2] uint8, even k in the low nibble
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    # packed: [N, K/2] uint8 -> codes [N, K] uint8
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).view(packed.shape[0], -1)


def quantize_int4(w: torch.Tensor, group_size: int = 32, zero: str = "min") -> QuantizedTensor:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, not {group_size}")
    g = _groups(w, group_size)  # [N, G, gs]
    if zero == "sym":  # llama.cpp's Q4_0 rounding: the value of largest magnitude maps to code 0 (-8)
        big = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True))[..., 0]  # [N, G], signed
        d = (big / -8.0).to(torch.float16)
        d = torch.where(d != 0, d, torch.ones_like(d))
        q = torch.round(g / d.float()[..., None] + 8).clamp_(0, 15)
        parts = {"scale": d}
    elif zero == "min":
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [N, G]
        d = _fp16_scale((hi - lo) / 15.0)
        m = lo.to(torch.float16)
        q = torch.round((g - m.float()[..., None]) / d.float()[..., None]).clamp_(0, 15)
        parts = {"scale": d, "min": m}
    else:
        raise ValueError(f"int4 zero must be 'sym' or 'min', not {zero!r}")
    q = pack_nibbles(q.view(w.shape))
    return QuantizedTensor("int4", tuple(w.shape), {"q": q, **parts}, {"group_size": group_size, "zero": zero}, w.dtype)


def _dequant_int4(qt: QuantizedTensor) -> torch.Tensor:
    # the order of gguf's reference: Q4_0 d * (q - 8); Q4_1 d * q + m
    n, k = qt.shape
    q = unpack_nibbles(qt.parts["q"]).float().view(n, -1, qt.params["group_size"])  # [N, G, gs]
    d = qt.parts["scale"].float()[..., None]
    if qt.params["zero"] == "sym":
        return q.sub_(8).mul_(d).view(n, k)
    return q.mul_(d).add_(qt.parts["min"].float()[..., None]).view(n, k)


# -- FP8 e4m3 per channel --------------------------------------------------------------------------

def quantize_fp8(w: torch.Tensor, group_size: int | None = None) -> QuantizedTensor:
    if group_size:
        g = _groups(w, group_size)  # [N, G, gs]
        amax = g.abs().amax(dim=-1)
        d = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [N, G] fp32
        q = (g / d[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).view(w.shape)
        return QuantizedTensor("fp8", tuple(w.shape), {"q": q, "scale": d}, {"group_size": group_size}, w.dtype)
    w2 = _rows(w.float())  # [N, K]
    scale = _channel_scale(w2, FP8_MAX)  # [N]
    q = (w2 / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return QuantizedTensor("fp8", tuple(w.shape), {"q": q, "scale": scale}, {}, w.dtype)


def _dequant_fp8(qt: QuantizedTensor) -> torch.Tensor:
    q = qt.parts["q"]  # [N, K] e4m3 bits
    vals = torch.take(_lut("fp8", _FP8_VALUES, q.device), q.long())  # [N, K] fp32
    if "group_size" in qt.params:
        n, k = qt.shape
        return vals.view(n, -1, qt.params["group_size"]).mul_(qt.parts["scale"].float()[..., None]).view(n, k)
    return vals.mul_(qt.parts["scale"][:, None]).reshape(qt.shape)


def fp8_block_dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype) -> torch.Tensor:
    """A block-wise FP8 weight as DeepSeek-V3 and Qwen3 FP8 checkpoints store it (e4m3 `weight` [N, K],
    fp32 `weight_scale_inv` [ceil(N/bn), ceil(K/bk)], w = e4m3 value * scale of its block), dense in `dtype`:
    the fp32 product, then rounded, as `from_fp8_blocks(...).dequantize(dtype)` gives it."""
    n, k = w.shape
    bn, bk = block
    s = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    vals = torch.take(_lut("fp8", _FP8_VALUES, w.device), w.view(torch.uint8).long())  # [N, K] fp32
    return vals.mul_(s).to(dtype)


def fp8_blocks_nbytes(shape: tuple[int, ...], block_k: int) -> int | None:
    """Bytes `from_fp8_blocks` holds for a block-wise FP8 weight of `shape` (codes plus an fp32 scale per row and
    block of K), None where it gives None (not 2-D, K no multiple of the block)."""
    if len(shape) != 2 or shape[1] % block_k:
        return None
    n, k = shape
    return n * k + n * (k // block_k) * 4


def from_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                    dtype: torch.dtype) -> QuantizedTensor | None:
    """A block-wise FP8 weight (see `fp8_block_dequantize`) as a group-wise `fp8` QuantizedTensor: the same
    codes, each block's scale repeated over its rows (groups of bk along K), so it dequantizes to exactly the
    same values. None when K is no multiple of bk (a row would end in a part group)."""
    if w.dim() != 2 or scale_inv.dim() != 2:
        return None
    n, k = w.shape
    bn, bk = block
    if k % bk or scale_inv.shape != (-(-n // bn), k // bk):
        return None
    scale = scale_inv.float().repeat_interleave(bn, 0)[:n].contiguous()  # [N, K/bk]
    return QuantizedTensor("fp8", (n, k), {"q": w.view(torch.uint8), "scale": scale}, {"group_size": bk}, dtype)


# -- NF4 group-wise --------------------------------------------------------------------------------

def quantize_nf4(w: torch.Tensor, group_size: int = 64, double_quant: bool = False) -> QuantizedTensor:
    if group_size % 2 or group_size <= 0:
        raise ValueError(f"NF4 group size must be a positive even number, not {group_size}")
    flat = w.float().reshape(-1)  # [M]
    m = flat.numel()
    pad = (-m) % group_size
    g = torch.nn.functional.pad(flat, (0, pad)).view(-1, group_size)  # [G, gs]
    absmax = g.abs().amax(dim=1)  # [G]
    absmax = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    parts: dict[str, torch.Tensor] = {}
    if double_quant:
        absmax_q, absmax_scale, mean = _double_quant(absmax)
        used = _double_dequant(absmax_q, absmax_scale, mean)
        # a group far below its block's largest absmax would get a scale back that is off by a large
        # factor (even negative): such a tensor keeps its fp32 absmaxes (its manifest entry says
        # double_quant=false). DQ_MAX_REL_ERR bounds the scale error double quantization may add.
        double_quant = bool(((used - absmax).abs() <= DQ_MAX_REL_ERR * absmax).all())
        if double_quant:
            parts.update(absmax_q=absmax_q, absmax_scale=absmax_scale, absmax_mean=mean)
            absmax = used  # quantize against the absmax we will store
    if not double_quant:
        parts["absmax"] = absmax
    codes = torch.bucketize(g / absmax[:, None], _NF4_MIDPOINTS.to(w.device)).to(torch.uint8).view(-1)  # [G*gs]
    parts["q"] = codes[0::2] | (codes[1::2] << 4)  # [G*gs/2]
    return QuantizedTensor("nf4", tuple(w.shape), {"q": parts.pop("q"), **parts},
                           {"group_size": group_size, "double_quant": double_quant}, w.dtype)


def _double_quant(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mean = absmax.mean().reshape(1)
    c = absmax - mean  # [G]
    pad = (-c.numel()) % DQ_BLOCK
    blocks = torch.nn.functional.pad(c, (0, pad)).view(-1, DQ_BLOCK)  # [B, 256]
    s = blocks.abs().amax(dim=1) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))  # [B]
    q = torch.round(blocks / s[:, None]).clamp_(-127, 127).to(torch.int8).view(-1)[: c.numel()]
    return q, s, mean


def _double_dequant(q: torch.Tensor, s: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    pad = (-q.numel()) % DQ_BLOCK
    blocks = torch.nn.functional.pad(q.float(), (0, pad)).view(-1, DQ_BLOCK)  # [B, 256]
    return (blocks * s[:, None]).view(-1)[: q.numel()] + mean


def nf4_absmax(qt: QuantizedTensor) -> torch.Tensor:
    """The per-group absmax [G] as dequantization uses it."""
    p = qt.parts
    if "absmax" in p:
        return p["absmax"]
    return _double_dequant(p["absmax_q"], p["absmax_scale"], p["absmax_mean"])


def _dequant_nf4(qt: QuantizedTensor) -> torch.Tensor:
    gs = qt.params["group_size"]
    packed = qt.parts["q"]
    words = torch.take(_lut("nf4", _NF4_PAIR_WORDS, packed.device), packed.long())  # [M/2] fp64 bit pairs
    vals = words.view(torch.float32).view(-1, gs)  # [G, gs]
    m = 1
    for d in qt.shape:
        m *= d
    return vals.mul_(nf4_absmax(qt)[:, None]).view(-1)[:m].view(qt.shape)


_DEQUANT = {"int8": _dequant_int8, "fp8": _dequant_fp8, "nf4": _dequant_nf4, "int4": _dequant_int4}


def quantize(w: torch.Tensor, scheme: str, group_size: int = 64, double_quant: bool = False,
             zero: str = "min") -> QuantizedTensor:
    """Quantize a floating-point weight with one of `SCHEMES` (int8 is per channel unless `group_size` is
    given for it explicitly through `quantize_int8`)."""
    if scheme == "int8":
        return quantize_int8(w)
    if scheme == "int4":
        return quantize_int4(w, group_size, zero)
    if scheme == "fp8":
        return quantize_fp8(w)
    if scheme == "nf4":
        return quantize_nf4(w, group_size, double_quant)
    raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")


def error_bound(w: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    """Per-element bound on |w - qt.dequantize()| that the scheme guarantees (tests check against it)."""
    w = w.float()
    eps = 1e-6 * w.abs()  # fp32 rounding of the scale multiply
    if qt.scheme == "int4" or (qt.scheme == "int8" and "group_size" in qt.params):
        gs = qt.params["group_size"]
        d = qt.parts["scale"].float().abs()[..., None].expand(*qt.parts["scale"].shape, gs).reshape(w.shape)
        # (Q4_0's d carries the sign of the largest-magnitude value, which maps to -8); so a value near +absmax clamps at +7: up to d off;
        # otherwise half a step, plus a little where fp16-rounded d or m make an end code clamp
        half = 1.0 if qt.params.get("zero") == "sym" else 0.5
        return d * half * 1.01 + 2 ** -10 * w.abs() + eps
    if qt.scheme == "int8":
        return (qt.parts["scale"][:, None] / 2).expand(_rows(w).shape).reshape(w.shape) * 1.0001 + eps
    if qt.scheme == "fp8":
        if "group_size" in qt.params:
            gs = qt.params["group_size"]
            scale = qt.parts["scale"].float()[..., None].expand(*qt.parts["scale"].shape, gs).reshape(w.shape)
        else:
            scale = qt.parts["scale"][:, None].expand(_rows(w).shape).reshape(w.shape)
        return torch.maximum(w.abs() * 2.0 ** -4, scale * 2.0 ** -10) * 1.0001 + eps
    gs = qt.params["group_size"]
    m = w.numel()
    pad = (-m) % gs
    g = torch.nn.functional.pad(w.reshape(-1), (0, pad)).view(-1, gs)  # [G, gs]
    true_amax = g.abs().amax(dim=1)
    used = nf4_absmax(qt)
    # |w - l*a'| <= |w/a' - l| a' ; w/a' can exceed 1 by (a - a')/a' when a' < a
    bound = NF4_MAX_HALF_GAP * used + (true_amax - used).clamp(min=0)
    return bound[:, None].expand(g.shape).reshape(-1)[:m].view(w.shape) * 1.0001 + eps
