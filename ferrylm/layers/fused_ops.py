"""One Triton launch each for the small per-layer ops that torch runs as chains of kernels: RMSNorm (8 kernels
in `layers/norm.py`'s plain form), RoPE on q and k together (~13 in `layers/rotary.py`'s), the gated MLP's
silu(gate) * up (2), a token's sum of its expert rows (3) and the MoE router's softmax top-k (~6). At one decode
token each of those kernels is bound by its latency inside a CUDA graph (~2 us), not its bytes: the H200 measured
a graphed Llama-3-8B layer ~90 us above its weight reads with ~40 kernels a layer (docs/benchmarks.md).

Each kernel rounds where torch rounds, so the results are torch's bits or within an ulp of them:
- `rms_norm`: fp32 sum of squares (another summation order than torch's mean: the one difference), rsqrt,
  the normalised row rounded to x's dtype, then times the weight rounded to their promoted dtype; optionally
  the residual add before it (x + r rounded to the dtype, stored: the layer's residual stream).
- `rope`: cos / sin rounded to q's dtype, each product rounded, then the sum: torch's bits exactly. Compiled
  without FMA contraction: with it the H200 gave results an ulp off in every dtype (session 7).
- `silu_mul`: silu in fp32 rounded to the dtype, times up, rounded.
- `sum_rows`: a token's k expert rows added in fp32 (in order) and rounded once.
- `route`: the MoE router's fp32 softmax, top-k and renormalisation (~6 kernels in `layers/moe.route`); the
  same experts in the same order (equal probabilities: the lower expert first), weights within fp32 rounding.
- `lf_shift` (Yuan's localized filter at decode: its state row read, replaced, and the row pair concatenated; 5
  kernels): moves bits, torch's exactly. `attention_router` (Yuan2.0-M32's router after its matmul; 3): within
  fp32 rounding (another summation order, Triton's exp).
The plain torch forms stay the reference and the CPU path; `usable(x)` says when these run (a CUDA tensor,
Triton importable, `ENABLED`). Tested against the plain forms under Triton's interpreter (fp32, fp16) and on CUDA
(tests/test_fused_ops.py), compiled for sm_90 in every dtype (tests/test_sm90_compile.py).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs (CI): the plain torch forms are the only ones
    triton = None

ENABLED = True
"""Off: every caller takes its plain torch form (the reference); `layers/fused_moe.align`'s kernel follows it."""


def usable(x: torch.Tensor) -> bool:
    return ENABLED and triton is not None and x.is_cuda


if triton is not None:

    @triton.jit
    def _rms_norm(x_ptr, r_ptr, sum_ptr, w_ptr, out_ptr, N, stride_x, stride_r, stride_o, eps, BLOCK: tl.constexpr,
                  X_T: tl.constexpr, O_T: tl.constexpr, ADD: tl.constexpr):
        # with ADD: x + r first, rounded to the dtype and stored (the residual stream), then its norm
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < N
        x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        if ADD:
            x = (x + tl.load(r_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)).to(X_T)
            tl.store(sum_ptr + row * stride_o + offs, x, mask=ok)
            x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        y = (x * rstd).to(X_T).to(tl.float32)  # torch: (x * rsqrt(...)).to(dtype)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (w * y).to(O_T), mask=ok)

    @triton.jit
    def _rope(q_ptr, k_ptr, qo_ptr, ko_ptr, cs_ptr, pos_ptr, HQ, HK, stride_qt, stride_qh, stride_kt, stride_kh,
              D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, T_: tl.constexpr):
        # one token a program: its q heads then its k heads; out[j] = x[j] cos[j] + rotate_half(x)[j] sin[j]
        # for j < 2 HALF, x[j] past it; cs: [P, 2, 2 HALF] fp32
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        j = tl.arange(0, HALF)
        cs = cs_ptr + pos * 4 * HALF
        c_lo = tl.load(cs + j).to(T_).to(tl.float32)
        c_hi = tl.load(cs + HALF + j).to(T_).to(tl.float32)
        s_lo = tl.load(cs + 2 * HALF + j).to(T_).to(tl.float32)
        s_hi = tl.load(cs + 3 * HALF + j).to(T_).to(tl.float32)
        h = tl.arange(0, BLOCK_H)
        for side in tl.static_range(2):
            if side == 0:
                src, dst, nh, st, sh = q_ptr, qo_ptr, HQ, stride_qt, stride_qh
            else:
                src, dst, nh, st, sh = k_ptr, ko_ptr, HK, stride_kt, stride_kh
            ok = (h < nh)[:, None]
            base = src + t * st + h[:, None] * sh
            out = dst + (t * nh + h[:, None]) * D
            lo = tl.load(base + j[None, :], mask=ok, other=0.0).to(tl.float32)
            hi = tl.load(base + HALF + j[None, :], mask=ok, other=0.0).to(tl.float32)
            # torch: x * cos + rotate_half(x) * sin, each product rounded to the dtype, then their sum
            o_lo = (lo * c_lo).to(T_).to(tl.float32) + (-hi * s_lo).to(T_).to(tl.float32)
            o_hi = (hi * c_hi).to(T_).to(tl.float32) + (lo * s_hi).to(T_).to(tl.float32)
            tl.store(out + j[None, :], o_lo.to(T_), mask=ok)
            tl.store(out + HALF + j[None, :], o_hi.to(T_), mask=ok)
            if D > 2 * HALF:  # partial rotary: the rest passes through
                p = tl.arange(0, D - 2 * HALF)
                rest = tl.load(base + 2 * HALF + p[None, :], mask=ok, other=0.0)
                tl.store(out + 2 * HALF + p[None, :], rest, mask=ok)

    @triton.jit
    def _silu_mul(x_ptr, out_ptr, N, stride_x, stride_o, BLOCK: tl.constexpr, T_: tl.constexpr):
        # x: [T, 2N] gate then up -> out [T, N] = silu(gate) * up, rounded as torch rounds each op
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        g = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + N + offs, mask=ok, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(T_).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (s * u).to(T_), mask=ok)


if triton is not None:

    @triton.jit
    def _route(logits_ptr, w_ptr, ids_ptr, E, stride_l, K: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr,
               NORM: tl.constexpr):
        # one token a program: fp32 softmax over its E router logits, the K largest (the first of equals), their
        # weights renormalised to sum to 1 with NORM
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BE)
        ok = e < E
        x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=-float("inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = tl.where(ok, p, 0.0)
        p = p / tl.sum(p, axis=0)
        # chosen by `s`: p with NaN above everything (as torch.topk orders it), so a NaN logit still yields K
        # distinct experts < E (an id out of range would fault the expert kernels' gathers)
        s = tl.where(ok, tl.where(p != p, float("inf"), p), -2.0)
        j = tl.arange(0, BK)
        vals = tl.zeros((BK,), dtype=tl.float32)
        ids = tl.zeros((BK,), dtype=tl.int64)
        for r in tl.static_range(K):
            m = tl.max(s, axis=0)
            i = tl.min(tl.where(s == m, e, BE), axis=0)  # the first expert at the maximum
            vals = tl.where(j == r, tl.sum(tl.where(e == i, p, 0.0), axis=0), vals)
            ids = tl.where(j == r, i.to(tl.int64), ids)
            s = tl.where(e == i, -1.0, s)
        if NORM:
            vals = vals / tl.sum(vals, axis=0)
        tl.store(w_ptr + t * K + j, vals, mask=j < K)
        tl.store(ids_ptr + t * K + j, ids, mask=j < K)


    @triton.jit
    def _sum_rows(rows_ptr, out_ptr, H, stride_r, stride_o, K: tl.constexpr, BLOCK: tl.constexpr, T_: tl.constexpr):
        # out[t] = sum_j rows[t * K + j] in fp32, j in order, rounded once
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < H
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(K):
            acc += tl.load(rows_ptr + (t * K + j) * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_o + offs, acc.to(T_), mask=ok)



if triton is not None:

    @triton.jit
    def _lf_shift(x_ptr, store_ptr, slots_ptr, cont_ptr, out_ptr, C, stride_x, stride_s, stride_o,
                  BLOCK: tl.constexpr):
        # one decode row a program (a block of its C features): out[b] = [cont[b] ? store[slot[b]] : 0 | x[b]],
        # then store[slot[b]] = x[b] (the read first: padded rows share the scratch slot, their outputs unused)
        b = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < C
        slot = tl.load(slots_ptr + b).to(tl.int64)
        keep = tl.load(cont_ptr + b) != 0
        x = tl.load(x_ptr + b * stride_x + offs, mask=ok, other=0.0)
        prev = tl.load(store_ptr + slot * stride_s + offs, mask=ok & keep, other=0.0)
        tl.store(out_ptr + b * stride_o + offs, prev, mask=ok)
        tl.store(out_ptr + b * stride_o + C + offs, x, mask=ok)
        tl.store(store_ptr + slot * stride_s + offs, x, mask=ok)

    @triton.jit
    def _attn_router(qkv_ptr, out_ptr, E, stride_t, BE: tl.constexpr):
        # one token a program: qkv [T, 3E] fp32 (q, k, v) -> out[i] = sum_j softmax_j(q_i k_j) v_j
        t = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BE)
        ok = i < E
        base = qkv_ptr + t * stride_t
        q = tl.load(base + i, mask=ok, other=0.0)
        k = tl.load(base + E + i, mask=ok, other=0.0)
        v = tl.load(base + 2 * E + i, mask=ok, other=0.0)
        s = tl.where(ok[None, :], q[:, None] * k[None, :], float("-inf"))  # [BE, BE]
        p = tl.exp(s - tl.max(s, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        tl.store(out_ptr + t * E + i, tl.sum(p * v[None, :], axis=1), mask=ok)


def sum_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    """`layers/fused_moe.sum_rows` in one launch: rows [T * k, H] -> [T, H], each token's k rows added in fp32."""
    A, H = rows.shape
    out = torch.empty(A // k, H, dtype=rows.dtype, device=rows.device)
    if A:
        BLOCK = min(1024, triton.next_power_of_2(H))
        _sum_rows[(A // k, triton.cdiv(H, BLOCK))](rows, out, H, rows.stride(0), out.stride(0), K=k, BLOCK=BLOCK,
                                                   T_=_tl(rows.dtype))
    return out


def route_usable(router_logits: torch.Tensor, top_k: int) -> bool:
    return usable(router_logits) and route_fits(router_logits, top_k)


def route_fits(router_logits: torch.Tensor, top_k: int) -> bool:
    """The kernel's shapes (any device): [T, E] rows with unit stride, E <= 1024 experts, k <= 16."""
    return (router_logits.dim() == 2 and router_logits.stride(-1) == 1 and router_logits.shape[-1] <= 1024
            and top_k <= 16)


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`layers/moe.route` in one launch: router_logits [T, E] -> fp32 weights [T, k] and int64 ids [T, k], the
    k largest softmax probabilities in descending order (equal ones: the lower expert first)."""
    T, E = router_logits.shape
    w = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    if T:
        _route[(T,)](router_logits, w, ids, E, router_logits.stride(0), K=top_k, BK=triton.next_power_of_2(top_k),
                     BE=triton.next_power_of_2(E), NORM=normalize)
    return w, ids


def _tl(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """`layers/norm.RMSNorm`'s forward in one launch: x [..., N] with unit stride along N. With `residual`
    (x's shape and dtype): (x + residual, its norm), as `s = x + residual; norm(s)` computes them."""
    shape, N = x.shape, x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    total = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    if x2.shape[0]:
        _rms_norm[(x2.shape[0],)](x2, r2, total, weight, out, N, x2.stride(0), r2.stride(0), out.stride(0),
                                  float(eps), BLOCK=triton.next_power_of_2(N), X_T=_tl(x.dtype), O_T=_tl(out_dtype),
                                  ADD=residual is not None, num_warps=4 if N <= 4096 else 8)
    if residual is None:
        return out.view(shape)
    return total.view(shape), out.view(shape)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, rot: int):
    """`layers/rotary.RotaryEmbedding`'s forward for a table of every position ([P, 2, rot] fp32): q [T, Hq, D]
    and k [T, Hk, D] (unit stride along D; any token / head strides) -> new contiguous q, k."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    qo, ko = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if T:
        bh = triton.next_power_of_2(max(HQ, HK))
        # a program holds [BLOCK_H, D] values of each side: past 2048 on 4 warps ptxas spills (32 or 64 heads of
        # 128 features; tests/test_sm90_compile.py reads the spills of the sm_90 build)
        _rope[(T,)](q, k, qo, ko, table, positions, HQ, HK, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                    D=D, HALF=rot // 2, BLOCK_H=bh, T_=_tl(q.dtype), num_warps=4 if bh * D <= 2048 else 8,
                    enable_fp_fusion=False)  # no FMA: x cos and r sin each rounded, as torch's two kernels do
    return qo, ko


def rope_usable(q: torch.Tensor, k: torch.Tensor, rot: int) -> bool:
    return usable(q) and rope_fits(q, k, rot)


def rope_fits(q: torch.Tensor, k: torch.Tensor, rot: int) -> bool:
    """The kernel's shapes (any device): power-of-two half rotation and pass-through width, unit stride along D."""
    pw2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    rest = q.shape[-1] - rot
    return (q.dim() == 3 and k.dim() == 3 and q.dtype == k.dtype and pw2(rot // 2) and rot % 2 == 0
            and (rest == 0 or pw2(rest)) and q.stride(-1) == 1 and k.stride(-1) == 1)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2N] (gate, up) -> silu(gate) * up [T, N], one launch."""
    T, N2 = x.shape
    N = N2 // 2
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T:
        BLOCK = min(1024, triton.next_power_of_2(N))
        _silu_mul[(T, triton.cdiv(N, BLOCK))](x, out, N, x.stride(0), out.stride(0), BLOCK=BLOCK, T_=_tl(x.dtype))
    return out


def lf_shift(x: torch.Tensor, store: torch.Tensor, slots: torch.Tensor, cont: torch.Tensor) -> torch.Tensor:
    """Yuan's localized-filter shift for a pure decode step in one launch (`models/yuan.LFBatch.shift_cat`'s plain
    form is an index_select, an index_copy_, a where and a cat): x [B, C] (unit stride), store [slots + 1, C] (any
    row stride, unit along C), slots [B] long, cont [B] bool -> [B, 2C] = [previous token's row | x], the previous
    row the stored one where cont, else 0; store[slots] = x afterwards."""
    B, C = x.shape
    out = torch.empty(B, 2 * C, dtype=x.dtype, device=x.device)
    if B:
        BLOCK = min(1024, triton.next_power_of_2(C))
        _lf_shift[(B, triton.cdiv(C, BLOCK))](x, store, slots, cont.reshape(-1).view(torch.int8), out, C, x.stride(0),
                                             store.stride(0), out.stride(0), BLOCK=BLOCK)
    return out


def lf_shift_fits(x: torch.Tensor, store: torch.Tensor) -> bool:
    """The kernel's shapes (any device): 2-D rows with unit stride along C, one dtype."""
    return (x.dim() == 2 and x.stride(-1) == 1 and store.dim() == 2 and store.stride(-1) == 1
            and store.dtype == x.dtype)


def attention_router(qkv: torch.Tensor, E: int) -> torch.Tensor:
    """Yuan2.0-M32's router after its matmul in one launch (`models/yuan.AttentionRouter`'s plain form: two bmm and a
    softmax): qkv [T, 3E] fp32 (unit stride) -> router logits [T, E] fp32, within fp32 rounding of the plain form
    (another summation order, Triton's exp)."""
    T = qkv.shape[0]
    out = torch.empty(T, E, dtype=torch.float32, device=qkv.device)
    if T:
        _attn_router[(T,)](qkv, out, E, qkv.stride(0), BE=triton.next_power_of_2(E), num_warps=4 if E <= 32 else 8)
    return out


def attention_router_fits(qkv: torch.Tensor, E: int) -> bool:
    """[E, E] scores a program: E <= 64 (M32 has 32)."""
    return qkv.dim() == 2 and qkv.stride(-1) == 1 and qkv.dtype == torch.float32 and E <= 64
