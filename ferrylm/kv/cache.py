"""The cache tensors: paged K/V blocks for every layer, and per-sequence state rows for models that keep
state that is not KV (Yuan2.0's filter inputs).

Which block or row belongs to which sequence is decided elsewhere (`kv/block_manager.py`,
`kv/state_pool.py`); this module only owns memory and the read/write primitives attention uses.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs (CI): index_copy_ writes
    triton = None

WRITE_KERNEL = True
"""On CUDA, a step's K and V rows go to their slots in one Triton launch (`_write_kv`) where the shapes allow,
instead of one `index_copy_` each (the same bytes: a copy); off, the `index_copy_` path (the reference)."""


KV_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
"""Quantized cache element types (`CacheConfig.kv_cache_dtype`), each with a per-(token, head) scale."""
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, Hk, D] -> (codes [T, Hk, D] of `dtype`, scales [T, Hk] fp32) with x ~ codes * scale.
    Symmetric, absmax over each row's D features: the row's largest value maps to the code range's end."""
    xf = x.float()
    scale = xf.abs().amax(-1).clamp_min(1e-8) / QMAX[dtype]  # [T, Hk]
    y = xf / scale[..., None]
    if dtype == torch.int8:
        y = y.round_()
    return y.clamp_(-QMAX[dtype], QMAX[dtype]).to(dtype), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # codes: [..., D]; scale: [...] -> [..., D] of `dtype`
    return (codes.float() * scale[..., None]).to(dtype)


def gather(cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[blocks] as `dtype`, dequantized when `scale` is given: [n, bs, Hk, D] for blocks [n].
    The plain attention path's read of a layer's K or V (`KVCache.layer`, `KVCache.scales`)."""
    if scale is None:
        return cache.index_select(0, blocks)
    codes = cache.view(torch.uint8).index_select(0, blocks).view(cache.dtype)  # no float8 index_select everywhere
    return dequantize(codes, scale.index_select(0, blocks), dtype)


class KVCache:
    """K and V for L layers, each [num_blocks + 1, block_size, kv_heads, head_dim] (V may be narrower:
    `v_head_dim`, 0 for MLA, whose K row is the compressed latent + rope key and holds the values too).

    The extra block at index `num_blocks` is scratch: padded rows of a CUDA-graph batch write there, and
    the block manager (which knows only `num_blocks`) never hands it out.

    A quantized cache (`kv_dtype` fp8 e4m3 or int8) stores codes and one fp32 scale per (token, KV head)
    beside them, `k_scale`/`v_scale` [L, num_blocks + 1, block_size, kv_heads]: set when the row is
    written, so there is nothing to calibrate, no state shared across rows, and a CUDA graph that writes
    the cache stays valid. Per row rather than per head or tensor because a static scale must be known
    before the first token (int8 has no headroom to guess with) and a running one would invalidate rows
    already written; it costs 4 bytes per head row (3% at head_dim 128)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, v_head_dim: int | None = None,
                 kv_dtype: torch.dtype | None = None):
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.kv_dtype = kv_dtype or dtype
        self.quantized = self.kv_dtype in QMAX
        # Zeroed, not empty: batched decode reads whole blocks and masks the unwritten tail, and a masked
        # weight of 0 times a garbage NaN in recycled memory is still NaN.
        self.k = torch.zeros(shape, dtype=self.kv_dtype, device=device)
        # v_head_dim 0: no V (MLA reads its values from the cached latent in K)
        self.v = torch.zeros((*shape[:-1], head_dim if v_head_dim is None else v_head_dim), dtype=self.kv_dtype,
                             device=device)
        self.k_scale = self.v_scale = None
        if self.quantized:  # ones, not zeros: an unwritten row dequantizes to its (zero) codes, never NaN
            self.k_scale = torch.ones(shape[:-1], dtype=torch.float32, device=device)
            if self.v.shape[-1]:
                self.v_scale = torch.ones(shape[:-1], dtype=torch.float32, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, v_head_dim: int | None = None, kv_dtype: torch.dtype | None = None) -> int:
        kv_dtype = kv_dtype or dtype
        vd = head_dim if v_head_dim is None else v_head_dim
        per_token = num_kv_heads * (head_dim + vd) * torch.tensor([], dtype=kv_dtype).element_size()
        if kv_dtype in QMAX:  # one fp32 scale per head row of K, and of V where there is one
            per_token += num_kv_heads * 4 * (1 + (vd > 0))
        return num_layers * block_size * per_token

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def scales(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer i's (k_scale, v_scale) [N + 1, bs, Hk] fp32, or (None, None) for an unquantized cache."""
        if not self.quantized:
            return None, None
        return self.k_scale[i], None if self.v_scale is None else self.v_scale[i]

    def write(self, i: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: [T]; k, v: [T, Hk, D]
        ks, vs = self.scales(i)
        if ks is None and _kernel_writes(self.k[i], self.v[i], k, v):
            write_kv(self.k[i], self.v[i], slots, k, v)
            return
        self._write(self.k[i], ks, slots, k)
        if v.shape[-1]:  # MLA passes no values: they live in the K row
            self._write(self.v[i], vs, slots, v)

    def _write(self, cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor) -> None:
        # cache: [N, bs, Hk, D]; scale: [N, bs, Hk]; x: [T, Hk, D]
        if scale is None:
            cache.view(-1, *x.shape[1:]).index_copy_(0, slots, x.to(cache.dtype))
            return
        codes, s = quantize(x, cache.dtype)
        # index_copy_ has no float8 kernel on every device: copy the bytes
        cache.view(torch.uint8).view(-1, *x.shape[1:]).index_copy_(0, slots, codes.view(torch.uint8))
        scale.view(-1, x.shape[1]).index_copy_(0, slots, s)



def _pw2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _kernel_writes(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """`write_kv` applies: CUDA, Triton and `write_kv_fits`."""
    return WRITE_KERNEL and triton is not None and k.is_cuda and write_kv_fits(k_cache, v_cache, k, v)


def write_kv_fits(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The kernel's shapes (any device): the cache's dtype, power-of-two head widths, unit stride along them."""
    return (k.dtype == k_cache.dtype == v_cache.dtype
            and v.dtype == k.dtype and _pw2(k.shape[-1]) and (v.shape[-1] == 0 or _pw2(v.shape[-1]))
            and k.stride(-1) == 1 and (v.shape[-1] == 0 or v.stride(-1) == 1)
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k.shape[0] > 0)


if triton is not None:

    @triton.jit
    def _write_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, HK, stride_kt, stride_kh, stride_vt, stride_vh,
                  DK: tl.constexpr, DV: tl.constexpr, BH: tl.constexpr):
        # one token a program: its Hk heads of K (and V) into cache row `slots[t]` ([slots, Hk, D] rows)
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        h = tl.arange(0, BH)[:, None]
        ok = h < HK
        dk = tl.arange(0, DK)[None, :]
        tl.store(kc_ptr + (slot * HK + h) * DK + dk, tl.load(k_ptr + t * stride_kt + h * stride_kh + dk, mask=ok),
                 mask=ok)
        if DV > 0:
            dv = tl.arange(0, DV)[None, :]
            tl.store(vc_ptr + (slot * HK + h) * DV + dv,
                     tl.load(v_ptr + t * stride_vt + h * stride_vh + dv, mask=ok), mask=ok)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k_cache / v_cache: a layer's [N, bs, Hk, D] blocks; slots [T]; k, v [T, Hk, D]: rows t to slots[t], one
    launch (what `index_copy_` on each does)."""
    T, HK, DK = k.shape
    _write_kv[(T,)](k, v, k_cache, v_cache, slots, HK, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                    DK=DK, DV=v.shape[-1], BH=triton.next_power_of_2(HK))


class SequenceStatePool:
    """Named per-sequence state tensors, each [num_slots + 1, *shape]; a sequence owns one row of each.

    The extra row at index `num_slots` is scratch, like the KV cache's scratch block: padded rows of a
    CUDA-graph decode batch read and write it, and the slot pool (which knows only `num_slots`) never
    hands it out."""

    def __init__(self, num_slots: int, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 device: torch.device | str):
        self.num_slots = num_slots
        self.tensors = {name: torch.zeros((num_slots + 1, *shape), dtype=dt, device=device)
                        for name, (shape, dt) in specs.items()}

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def reset(self, slot: int) -> None:
        for t in self.tensors.values():
            t[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        """Fork: the child gets its own copy of the parent's state, never a shared row."""
        for t in self.tensors.values():
            t[dst].copy_(t[src])
