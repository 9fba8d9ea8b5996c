"""Fused MoE on CUDA: the whole expert bank in two Triton grouped GEMMs, no host sync, graph-capturable.

The T * k (token, expert) assignments are sorted by expert on the device and each expert's run padded
to a multiple of BLOCK_M (`align`), so every row block of the sorted list belongs to one expert. GEMM 1
reads x rows by token and computes `act(x @ gate^T) * (x @ up^T)` for its block ([M_pad, I]); GEMM 2
multiplies by `down^T` and the routing weight ([M_pad, H]); the k rows of each token are summed in fp32.
Grid sizes use the static bound T * k + E * (BLOCK_M - 1) and blocks past the real end exit at once, so
nothing is read back to the host. `TorchExperts` (layers/moe.py) is the reference it is tested against.
Notation: T tokens, k experts per token, A = T * k assignments, E experts, H hidden, I expert inner size.
"""

from __future__ import annotations

import itertools
import os

import torch

from ferrylm.layers import fused_ops
from ferrylm.layers.moe import ExpertBackend, expert_row_cap
from ferrylm.layers.transfer import to_device

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the backend is never chosen there
    triton = None


ALIGN_KERNEL_ELEMENTS = 16384
"""`align` takes its one-launch kernel (`_align_small`) on CUDA while its [experts, assignments] and
[assignments, assignments] comparison tiles stay this small (decode steps); larger steps the torch ops."""


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int, kernel: bool | None = None):
    """-> (sorted assignment index per padded row [M_pad] (A = padding), expert of each row block
    [M_pad / BM], padded rows in use [1], padded row of each assignment [A]). Device ops only: ~20 small
    torch kernels (the plain form, the reference), or at decode sizes on CUDA one Triton launch with the same
    outputs (`kernel`: None chooses, True / False force one)."""
    flat = topk_ids.flatten()  # [A]
    A, E = flat.numel(), num_experts
    dev = flat.device
    if kernel is None:
        kernel = fused_ops.ENABLED and triton is not None and dev.type == "cuda" and align_kernel_fits(A, E)
    if kernel:
        return _align_kernel(flat, E, block_m)
    counts = torch.zeros(E, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # [A]
    sorted_e = flat[order]
    first = torch.cumsum(counts, 0) - counts  # first sorted index of each expert
    pos = (ends - padded)[sorted_e] + torch.arange(A, device=dev) - first[sorted_e]  # padded row of sorted i
    m_pad = _m_pad(A, E, block_m)
    rows = torch.full((m_pad,), A, dtype=torch.long, device=dev)
    rows[pos] = order
    inv = torch.empty(A, dtype=torch.long, device=dev)
    inv[order] = pos
    starts = torch.arange(0, m_pad, block_m, device=dev)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=E - 1)
    return rows, block_expert, ends[-1:], inv


def align_kernel_fits(A: int, E: int) -> bool:
    """`align` takes the one-launch kernel for A assignments over E experts (on CUDA): its comparison tiles
    stay within `ALIGN_KERNEL_ELEMENTS`."""
    return A > 0 and max(_p2(E) * _p2(A), _p2(A) ** 2) <= ALIGN_KERNEL_ELEMENTS


def _p2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _m_pad(A: int, E: int, block_m: int) -> int:
    return (A + E * (block_m - 1) + block_m - 1) // block_m * block_m


def padded_rows(A: int, E: int) -> int:
    """Rows of the grouped GEMM's intermediate and output buffers for A assignments over E experts (dense banks;
    packed ones take row blocks of at most 32, so fewer): every expert's rows padded to whole row blocks.
    `plan/memory.step_activation_bytes` counts the prefill's buffers with it."""
    return _m_pad(A, E, _blocks(A)[0])


def prefill_path(A: int, E: int, inter: int, packed: bool) -> str:
    """Which way `expert_rows` computes A assignments over E experts of `inter` columns in an eager step of a
    bank read directly (a bf16 bank on sm_90 for "grouped"; an offload round, `skip`, never takes "grouped"):
    "dequant" (packed, `dequant_rows`), "grouped" (dense, `grouped_rows`) or "kernel" (the Triton kernel; decode
    batches take `fused_moe_decode` before any of these)."""
    if packed:
        return "dequant" if PACKED_DENSE_MIN_ROWS is not None and A >= PACKED_DENSE_MIN_ROWS * E else "kernel"
    if GROUPED_MM_MIN_ROWS is not None and A >= GROUPED_MM_MIN_ROWS * E and inter >= GROUPED_MM_MIN_INTER:
        return "grouped"
    return "kernel"


def graph_token_limit(E: int, k: int, packed: bool) -> int | None:
    """The most tokens a CUDA-graph-captured step (decode graphs, piecewise prefill graphs) may hold over a bank of
    E experts, k a token, and still compute it on the path an eager step takes: a packed bank's `dequant_rows`
    reads its counts on the host, which a capture cannot, so a captured step past `PACKED_DENSE_MIN_ROWS` an
    expert would fall back to the kernel's in-tile decode (Mixtral NF4 resident, 2k-token prefill on an H100:
    450 tok/s in graphs, the same layers offloaded and eager ~6000). None: no bound."""
    if not packed or PACKED_DENSE_MIN_ROWS is None:
        return None
    return max(0, (PACKED_DENSE_MIN_ROWS * E - 1) // max(k, 1))


def prefill_bytes(A: int, E: int, hidden: int, inter: int, elt: int, packed: bool, fmt: str | None = None,
                  k: int = 1) -> int:
    """Device bytes `expert_rows` holds at its peak for A assignments (beside its input), on the path
    `prefill_path` takes; `plan/memory.step_activation_bytes` counts the MoE layer with it. kernel: the gated
    rows [I] and output [H] over the padded rows, then the gathered copy [H] of each assignment. grouped: the
    gathered input [H] and gate/up [2I], then gate/up and their product [I], then the product beside the output
    [H] and the weighting's fp32 rows (8 bytes an element at the multiply). dequant:
    the sorted input and the zeroed output [2H] throughout, and per decode group (`DEQUANT_BUFFER_BYTES`; at
    most `expert_row_cap` rows an expert, whatever the routing) the decoded w13 beside gate/up and product, then
    w2 beside product and output; then the weighting. A packed bank of kernel format `fmt` whose steps of A / k
    tokens take the decode kernel (`fused_moe_decode.taken_by_format`) holds its partials instead (`decode_bytes`)."""
    from ferrylm.layers import fused_moe_decode as fmd

    H, I = hidden, inter
    weighting = A * H * (8 + 2 * elt)
    path = prefill_path(A, E, I, packed)
    if path == "kernel" and packed and fmd.taken_by_format(fmt, A // k):
        return fmd.decode_bytes(A, E, H, I, fmd.by_format_config(fmt, False, A // k), elt)
    if path == "kernel":
        return (padded_rows(A, E) * (I + H) + A * H) * elt
    if path == "grouped":  # the gathered input is freed once gate/up exist; the product lives to the end
        return max(A * (H + 2 * I) * elt, 3 * A * I * elt, A * (I + H) * elt + A * H * 8)
    g = min(E, decode_group_experts(3 * I * H * elt))
    n = min(A, g * expert_row_cap(A, E))
    group = max(g * 2 * I * H + n * 3 * I, g * H * I + n * (I + H)) * elt
    return max(2 * A * H * elt + group, A * H * elt + weighting)


def _align_kernel(flat: torch.Tensor, E: int, block_m: int):
    A = flat.numel()
    m_pad = _m_pad(A, E, block_m)
    nb = m_pad // block_m
    rows = torch.empty(m_pad, dtype=torch.long, device=flat.device)
    block_expert = torch.empty(nb, dtype=torch.long, device=flat.device)
    used = torch.empty(1, dtype=torch.long, device=flat.device)
    inv = torch.empty(A, dtype=torch.long, device=flat.device)
    _align_small[(1,)](flat, rows, block_expert, used, inv, A, E, m_pad, nb, BM=block_m, BA=_p2(A), BE=_p2(E),
                       BR=64, num_warps=8 if max(_p2(A) * _p2(E), _p2(A) ** 2) > 4096 else 4)
    return rows, block_expert, used, inv


FORMATS = {"dense": 0, "int8": 1, "fp8": 2, "int4": 3, "int4min": 4, "nf4": 5}
"""Weight formats the kernel reads: dense (the activations' dtype), int8 (per channel or per group of a
row), fp8 (e4m3 bits, per channel or per group of a row), int4 (two codes a byte, sym or with a min per group), nf4 (two codes a
byte, fp32 absmax per group). Quantized tiles are decoded in fp32 exactly as `weights/quant.py`'s
dequantizers compute and rounded to the activations' dtype: the dot sees the dequantized weights' values
(in tiles twice as wide along K, so its sums run in another order than the dense kernel's)."""

if triton is not None:

    @triton.jit
    def _align_small(ids_ptr, rows_ptr, block_expert_ptr, used_ptr, inv_ptr, A, E, M_PAD, NB, BM: tl.constexpr,
                     BA: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr):
        # `align` in one program, by comparison tiles instead of a sort: an assignment's padded row is its
        # expert's first padded row plus the number of earlier assignments to the same expert (a stable order)
        a = tl.arange(0, BA)
        a_ok = a < A
        ids = tl.load(ids_ptr + a, mask=a_ok, other=-1).to(tl.int32)
        e = tl.arange(0, BE)
        e_ok = e < E
        counts = tl.sum((ids[None, :] == e[:, None]).to(tl.int32), axis=1)  # [BE]
        padded = (counts + BM - 1) // BM * BM
        ends = tl.cumsum(padded, axis=0)
        first = ends - padded  # each expert's first padded row
        same = (ids[None, :] == ids[:, None]) & (a[None, :] < a[:, None]) & a_ok[None, :]  # [a, earlier a']
        rank = tl.sum(same.to(tl.int32), axis=1)
        pos = tl.sum(tl.where(e[None, :] == ids[:, None], first[None, :], 0), axis=1) + rank  # [BA]
        tl.store(inv_ptr + a, pos.to(tl.int64), mask=a_ok)
        for r0 in range(0, M_PAD, BR):  # each padded row: the assignment placed there, else A
            r = r0 + tl.arange(0, BR)
            hit = (pos[None, :] == r[:, None]) & a_ok[None, :]  # [BR, BA]
            got = tl.sum(tl.where(hit, a[None, :], 0), axis=1)
            row = tl.where(tl.sum(hit.to(tl.int32), axis=1) > 0, got, A)
            tl.store(rows_ptr + r, row.to(tl.int64), mask=r < M_PAD)
        for b0 in range(0, NB, BR):  # a block's expert: how many experts' padded rows end at or before it
            b = b0 + tl.arange(0, BR)
            n = tl.sum(((ends[None, :] <= (b * BM)[:, None]) & e_ok[None, :]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, tl.minimum(n, E - 1).to(tl.int64), mask=b < NB)
        tl.store(used_ptr, tl.sum(tl.where(e_ok, padded, 0), axis=0).to(tl.int64))

    @triton.jit
    def _weight_tile(w_base, s_base, m_base, lut_ptr, rows, n_ok, k0, kleft, offs_k, stride_wn, stride_sn,
                     FMT: tl.constexpr, GS: tl.constexpr, PER_ROW: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_N: tl.constexpr):
        # -> [BK, BN]: weight rows `rows` (int64), columns k0 .. k0 + BK (kleft = K - k0 of them exist);
        # dense as stored, quantized as fp32 values
        k_ok = offs_k < kleft
        mask = k_ok[:, None] & n_ok[None, :]
        if FMT == 0:
            w = tl.load(w_base + rows[None, :] * stride_wn + (k0 + offs_k)[:, None], mask=mask, other=0.0)
        elif FMT == 1 or FMT == 2:  # a byte a weight: the int8 value, or e4m3 bits through the table
            if PER_ROW:
                s = tl.load(s_base + rows * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            else:  # a tile may span several groups: each element's own scale
                s = tl.load(s_base + rows[None, :] * stride_sn + ((k0 + offs_k) // GS)[:, None], mask=mask,
                            other=0.0).to(tl.float32)
            q = tl.load(w_base + rows[None, :] * stride_wn + (k0 + offs_k)[:, None], mask=mask, other=0)
            v = q.to(tl.float32) if FMT == 1 else tl.load(lut_ptr + q.to(tl.int32))
            w = v * s
        else:  # two codes a byte, column 2i in the low nibble: decode both halves, interleave the rows
            offs_h = tl.arange(0, BLOCK_K // 2)
            h_mask = (offs_h * 2 < kleft)[:, None] & n_ok[None, :]
            q = tl.load(w_base + rows[None, :] * stride_wn + (k0 // 2 + offs_h)[:, None], mask=h_mask,
                        other=0).to(tl.int32)  # [BK/2, BN]
            g = ((k0 + 2 * offs_h) // GS)[:, None]  # columns 2i and 2i + 1 share a group (GS is even)
            s = tl.load(s_base + rows[None, :] * stride_sn + g, mask=h_mask, other=0.0).to(tl.float32)
            lo = q & 15
            hi = q >> 4
            if FMT == 5:
                vlo = tl.load(lut_ptr + lo) * s
                vhi = tl.load(lut_ptr + hi) * s
            elif FMT == 3:
                vlo = (lo.to(tl.float32) - 8.0) * s
                vhi = (hi.to(tl.float32) - 8.0) * s
            else:
                m = tl.load(m_base + rows[None, :] * stride_sn + g, mask=h_mask, other=0.0).to(tl.float32)
                vlo = lo.to(tl.float32) * s + m
                vhi = hi.to(tl.float32) * s + m
            w = tl.reshape(tl.permute(tl.join(vlo, vhi), (0, 2, 1)), (BLOCK_K, BLOCK_N))
        return w

    @triton.jit
    def _nf4_select(c):
        # c: int32 codes 0..15 -> NF4 level (fp32), a binary tree of selects on the code's bits (the levels
        # are weights/quant.py's NF4_LEVELS, checked equal to the table by tests/test_fused_moe_decode.py)
        b0 = (c & 1) != 0
        b1 = (c & 2) != 0
        b2 = (c & 4) != 0
        p0 = tl.where(b0, -0.6961928009986877, -1.0)
        p1 = tl.where(b0, -0.39491748809814453, -0.5250730514526367)
        p2 = tl.where(b0, -0.18477343022823334, -0.28444138169288635)
        p3 = tl.where(b0, 0.0, -0.09105003625154495)
        p4 = tl.where(b0, 0.16093020141124725, 0.07958029955625534)
        p5 = tl.where(b0, 0.33791524171829224, 0.24611230194568634)
        p6 = tl.where(b0, 0.5626170039176941, 0.44070982933044434)
        p7 = tl.where(b0, 1.0, 0.7229568362236023)
        lo = tl.where(b2, tl.where(b1, p3, p2), tl.where(b1, p1, p0))
        hi = tl.where(b2, tl.where(b1, p7, p6), tl.where(b1, p5, p4))
        return tl.where((c & 8) != 0, hi, lo)

    @triton.jit
    def _expert_bases(w_ptr, ws_ptr, wm_ptr, e, stride_we, stride_se, MAPPED: tl.constexpr, ALIGN: tl.constexpr,
                      W_T: tl.constexpr, S_T: tl.constexpr):
        # expert e's codes, scales and mins (both kernels): a bank's rows, or with MAPPED each part's pointer
        # is a table of per-expert addresses (a device slot or mapped host rows; ALIGN: without the hint Triton
        # cannot vectorise loads through a loaded pointer, one element each)
        if MAPPED:
            w_base = tl.multiple_of(tl.load(w_ptr + e).to(tl.pointer_type(W_T)), ALIGN)
            s_base = tl.multiple_of(tl.load(ws_ptr + e).to(tl.pointer_type(S_T)), ALIGN)
            m_base = tl.multiple_of(tl.load(wm_ptr + e).to(tl.pointer_type(S_T)), ALIGN)
        else:
            w_base = w_ptr + e * stride_we
            s_base = ws_ptr + e * stride_se
            m_base = wm_ptr + e * stride_se
        return w_base, s_base, m_base

    @triton.jit
    def _grouped_gemm(a_ptr, w_ptr, ws_ptr, wm_ptr, lut_ptr, out_ptr, rows_ptr, block_expert_ptr, used_ptr,
                      scale_ptr, N, K, A, UP, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                      TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr, GATED: tl.constexpr,
                      SCALE: tl.constexpr, MAPPED: tl.constexpr, FMT: tl.constexpr, GS: tl.constexpr,
                      PER_ROW: tl.constexpr, W_T: tl.constexpr, S_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, ALIGN: tl.constexpr = 1):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(used_ptr):
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        assign = tl.load(rows_ptr + offs_m)  # [BM] assignment index, A for padding
        valid = assign < A
        a_rows = assign // TOP_K if A_BY_TOKEN else offs_m
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        w_base, s_base, m_base = _expert_bases(w_ptr, ws_ptr, wm_ptr, e, stride_we, stride_se, MAPPED, ALIGN, W_T, S_T)
        rows = offs_n.to(tl.int64)
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = _weight_tile(w_base, s_base, m_base, lut_ptr, rows, n_ok, k0, K - k0, offs_k, stride_wn, stride_sn,
                             FMT, GS, PER_ROW, BLOCK_K, BLOCK_N)
            acc = tl.dot(a, w.to(a.dtype), acc)
            if GATED:  # the up rows sit UP (the intermediate size; N unless split) rows below the gate rows
                wu = _weight_tile(w_base, s_base, m_base, lut_ptr, rows + UP, n_ok, k0, K - k0, offs_k, stride_wn,
                                  stride_sn, FMT, GS, PER_ROW, BLOCK_K, BLOCK_N)
                acc_up = tl.dot(a, wu.to(a.dtype), acc_up)
            a_ptrs += BLOCK_K
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up
        if SCALE:
            acc = acc * tl.load(scale_ptr + assign, mask=valid, other=0.0)[:, None]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])


    @triton.jit
    def _decode_experts(ids_ptr, w_ptr, ws_ptr, wm_ptr, lut_ptr, out_ptr, N, K, stride_we, stride_wn, stride_se,
                        stride_sn, stride_oe, stride_on, MAPPED: tl.constexpr, FMT: tl.constexpr, GS: tl.constexpr,
                        PER_ROW: tl.constexpr, W_T: tl.constexpr, S_T: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, ALIGN: tl.constexpr = 1):
        # out[j] <- expert ids[j] dense [N, K], tile by tile through the GEMM kernel's own decode (`_weight_tile`)
        j = tl.program_id(0)
        e = tl.load(ids_ptr + j).to(tl.int64)
        w_base, s_base, m_base = _expert_bases(w_ptr, ws_ptr, wm_ptr, e, stride_we, stride_se, MAPPED, ALIGN, W_T, S_T)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        k0 = tl.program_id(2) * BLOCK_K
        n_ok = offs_n < N
        w = _weight_tile(w_base, s_base, m_base, lut_ptr, offs_n.to(tl.int64), n_ok, k0, K - k0, offs_k, stride_wn,
                         stride_sn, FMT, GS, PER_ROW, BLOCK_K, BLOCK_N)  # [BK, BN]
        out = out_ptr + j * stride_oe + offs_n[:, None].to(tl.int64) * stride_on + (k0 + offs_k)[None, :]
        tl.store(out, tl.trans(w).to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & (offs_k < K - k0)[None, :])


    @triton.jit
    def _decode_experts_4bit(ids_ptr, w_ptr, ws_ptr, wm_ptr, out_ptr, N, K, stride_we, stride_wn, stride_se,
                             stride_sn, stride_oe, stride_on, MAPPED: tl.constexpr, FMT: tl.constexpr,
                             GS: tl.constexpr, PER_ROW: tl.constexpr, W_T: tl.constexpr, S_T: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALIGN: tl.constexpr = 1):
        # out[j] <- expert ids[j] dense [N, K] for two codes a byte: the bytes read along K as stored, one scale
        # (and min) a group broadcast over its codes, NF4 levels by the select tree, the two nibbles of a byte
        # interleaved in registers and written along K: no transposed tile (`_decode_experts`), no table loads.
        # The same fp32 values as `_weight_tile`'s (level or code times the scale, plus the min), rounded once.
        j = tl.program_id(0)
        e = tl.load(ids_ptr + j).to(tl.int64)
        w_base, s_base, m_base = _expert_bases(w_ptr, ws_ptr, wm_ptr, e, stride_we, stride_se, MAPPED, ALIGN, W_T, S_T)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        rows = offs_n.to(tl.int64)
        k0 = tl.program_id(2) * BLOCK_K
        HB: tl.constexpr = BLOCK_K // 2
        offs_b = tl.arange(0, HB)
        mask = n_ok[:, None] & (k0 + 2 * offs_b < K)[None, :]
        q = tl.load(w_base + rows[:, None] * stride_wn + (k0 // 2 + offs_b)[None, :], mask=mask,
                    other=0).to(tl.int32)  # [BN, HB]
        lo = q & 15
        hi = (q >> 4) & 15
        if FMT == 5:
            vlo, vhi = _nf4_select(lo), _nf4_select(hi)
        elif FMT == 3:
            vlo, vhi = (lo - 8).to(tl.float32), (hi - 8).to(tl.float32)
        else:
            vlo, vhi = lo.to(tl.float32), hi.to(tl.float32)
        G: tl.constexpr = 1 if PER_ROW or GS >= BLOCK_K else BLOCK_K // GS  # groups a tile (GS | BLOCK_K or BLOCK_K | GS)
        if PER_ROW:  # one group a row (GS >= K)
            offs_g = tl.arange(0, G)
            g_ok = n_ok[:, None]
        else:
            offs_g = k0 // GS + tl.arange(0, G)
            g_ok = n_ok[:, None] & (offs_g * GS < K)[None, :]
        s_ptrs = rows[:, None] * stride_sn + offs_g[None, :]
        s = tl.load(s_base + s_ptrs, mask=g_ok, other=0.0).to(tl.float32)[:, :, None]  # [BN, G, 1]
        # each group's GS / 2 bytes (the whole tile where G is 1) times its scale, plus its min
        wlo = tl.reshape(vlo, (BLOCK_N, G, HB // G)) * s
        whi = tl.reshape(vhi, (BLOCK_N, G, HB // G)) * s
        if FMT == 4:
            m = tl.load(m_base + s_ptrs, mask=g_ok, other=0.0).to(tl.float32)[:, :, None]
            wlo, whi = wlo + m, whi + m
        w = tl.reshape(tl.join(wlo, whi), (BLOCK_N, BLOCK_K))  # column 2i + t: byte i's nibble t
        offs_k = k0 + tl.arange(0, BLOCK_K)
        out = out_ptr + j * stride_oe + rows[:, None] * stride_on + offs_k[None, :]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & (offs_k < K)[None, :])


def _blocks(A: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small row blocks for decode (few rows per expert), wide for prefill."""
    if A <= 64:
        return 16, 64, 128
    if A <= 1024:
        return 32, 128, 64
    return 64, 128, 64


class ExpertWeights:
    """One side of an expert bank (w13 [E, 2I, H] or w2 [E, H, I]) as the kernel reads it: a format of
    `FORMATS`, the logical [E, N, K], the group size along K (K: one scale per row), and parts with the
    expert and row leading: q [E, N, K or K/2], scale [E, N, G], min [E, N, G] (int4min only)."""

    def __init__(self, fmt: str, shape, group: int, q: torch.Tensor, scale: torch.Tensor | None = None,
                 min: torch.Tensor | None = None):
        self.fmt, self.shape, self.group = fmt, tuple(shape), group
        self.parts = {k: v for k, v in (("q", q), ("scale", scale), ("min", min)) if v is not None}

    @staticmethod
    def stack(experts: list[list], dtype: torch.dtype) -> "ExpertWeights":
        """Per expert, its row pieces (e.g. [gate, up]) as `QuantizedTensor`s [n_i, K] of one scheme ->
        the stacked bank (the pieces' rows concatenated, then the experts stacked)."""
        kinds = set()
        parts: dict[str, list] = {}
        for pieces in experts:
            got = [_kernel_parts(_row_wise(p)) for p in pieces]
            kinds |= {(f, g, p.shape[1]) for (f, g, _), p in zip(got, pieces)}
            for name in got[0][2]:
                parts.setdefault(name, []).append(torch.cat([d[name] for _, _, d in got]))
        if len(kinds) != 1:
            raise ValueError(f"an expert bank's pieces must share one format, group and width, not {sorted(kinds)}")
        (fmt, group, k), = kinds
        n = sum(p.shape[0] for p in experts[0])
        bank = {name: torch.stack(v) for name, v in parts.items()}
        return ExpertWeights(fmt, (len(experts), n, k), group, bank["q"], bank.get("scale"), bank.get("min"))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def expert(self, e: int) -> "ExpertWeights":
        """Expert e alone (a bank of one, views)."""
        p = {k: v[e:e + 1] for k, v in self.parts.items()}
        return ExpertWeights(self.fmt, (1, *self.shape[1:]), self.group, p["q"], p.get("scale"), p.get("min"))

    def empty_like(self, n: int, device) -> "ExpertWeights":
        """A bank of n experts of this format, uninitialised, on `device` (cache slots)."""
        p = {k: torch.empty((n, *v.shape[1:]), dtype=v.dtype, device=device) for k, v in self.parts.items()}
        return ExpertWeights(self.fmt, (n, *self.shape[1:]), self.group, p["q"], p.get("scale"), p.get("min"))

    def copy_expert_(self, s: int, src: "ExpertWeights", e: int, non_blocking: bool = False) -> None:
        """Slot s <- expert e of `src`, part by part."""
        for k, v in self.parts.items():
            v[s].copy_(src.parts[k][e], non_blocking=non_blocking)

    @property
    def is_cuda(self) -> bool:
        return self.parts["q"].is_cuda

    def to(self, device) -> "ExpertWeights":
        p = {k: v.to(device) for k, v in self.parts.items()}
        return ExpertWeights(self.fmt, self.shape, self.group, p["q"], p.get("scale"), p.get("min"))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[E, N, K] dense: the plain-torch reference (`weights/quant.py`'s dequantizers), expert by expert."""
        from ferrylm.weights.quant import QuantizedTensor

        E, N, K = self.shape
        out = []
        for e in range(E):
            q, s = self.parts["q"][e], self.parts["scale"][e]
            if self.fmt == "nf4":
                qt = QuantizedTensor("nf4", (N, K), {"q": q.reshape(-1), "absmax": s.reshape(-1)},
                                     {"group_size": self.group, "double_quant": False})
            elif self.fmt in ("int8", "fp8"):
                grouped = self.group != K
                qt = QuantizedTensor(self.fmt, (N, K), {"q": q, "scale": s if grouped else s[:, 0]},
                                     {"group_size": self.group} if grouped else {})
            else:
                parts = {"q": q, "scale": s, **({"min": self.parts["min"][e]} if self.fmt == "int4min" else {})}
                qt = QuantizedTensor("int4", (N, K), parts, {"group_size": self.group,
                                                             "zero": "min" if self.fmt == "int4min" else "sym"})
            out.append(qt.dequantize(dtype))
        return torch.stack(out)


def piece_parts(qt) -> tuple[str, int, dict]:
    """A quantized expert piece [n, K] -> (kernel format, group along K, its parts with rows leading)."""
    return _kernel_parts(_row_wise(qt))


def expert_format(qt) -> str | None:
    """The kernel format a `QuantizedTensor` expert piece would be read in, None if it cannot be."""
    try:
        return _kernel_parts(_row_wise(qt))[0] if len(qt.shape) == 2 else None
    except ValueError:
        return None


def _row_wise(qt):
    """An NF4 tensor whose groups tile its rows, seen as row-wise parts ([N, K/2] codes, [N, K/gs] absmax)."""
    from ferrylm.weights.quant import QuantizedTensor, nf4_absmax

    if qt.scheme != "nf4":
        return qt
    n, k = qt.shape
    gs = qt.params["group_size"]
    if k % gs:
        raise ValueError(f"NF4 groups of {gs} do not tile rows of {k}: the kernel cannot read them")
    return QuantizedTensor("nf4", qt.shape, {"q": qt.parts["q"].view(n, k // 2),
                                             "scale": nf4_absmax(qt).float().view(n, k // gs)},
                           {"group_size": gs}, qt.dtype)


def _kernel_parts(qt) -> tuple[str, int, dict]:
    """A row-wise `QuantizedTensor` [N, K] -> (format, group along K, parts [N, ...])."""
    n, k = qt.shape
    p = qt.parts
    if qt.scheme in ("int8", "fp8"):
        gs = qt.params.get("group_size")
        return qt.scheme, gs or k, {"q": p["q"], "scale": p["scale"] if gs else p["scale"].view(n, 1)}
    if qt.scheme == "int4":
        fmt = "int4min" if qt.params["zero"] == "min" else "int4"
        parts = {"q": p["q"], "scale": p["scale"]}
        if fmt == "int4min":
            parts["min"] = p["min"]
        return fmt, qt.params["group_size"], parts
    if qt.scheme == "nf4":
        return "nf4", qt.params["group_size"], {"q": p["q"], "scale": p["scale"]}
    raise ValueError(f"the fused MoE kernel cannot read {qt.scheme!r} weights")


class WeightTable:
    """An expert bank addressed through device tables of per-expert addresses, one per part: each entry
    points at a device slot or at the expert's rows in pinned (mapped) host memory, which the kernel then
    reads in place over PCIe. `like` says the format and shape (a dense [E, N, K] tensor or `ExpertWeights`);
    each expert's rows of each part are contiguous."""

    def __init__(self, ptrs, like):
        self.ptrs = ptrs if isinstance(ptrs, dict) else {"q": ptrs}
        self.like = like
        self.shape = tuple(like.shape)

    @staticmethod
    def addresses(t: torch.Tensor) -> list[int]:
        """Per-expert addresses of a contiguous [E, ...] bank part (device or registered host memory)."""
        return [t.data_ptr() + e * t.stride(0) * t.element_size() for e in range(t.shape[0])]


_TL = {}
ALIGN_HINTS = True
"""Tell the kernels a table's per-expert addresses are 16-byte aligned where the bank's layout says so
(benchmarks/bench_mapped.py turns it off to time the unhinted baseline in the same run)."""


def _is_aligned(t: torch.Tensor) -> bool:
    """Every expert's rows of bank part `t` start on 16 bytes (its base and its expert stride): a table's
    addresses (device slots, host-tier pages) are laid out like the bank it describes."""
    return ALIGN_HINTS and t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0


_LUT: dict[tuple[str, torch.device], torch.Tensor] = {}


def _tl(dtype: torch.dtype):
    if not _TL:
        _TL.update({torch.int8: tl.int8, torch.uint8: tl.uint8, torch.int32: tl.int32, torch.bfloat16: tl.bfloat16,
                    torch.float16: tl.float16, torch.float32: tl.float32})
    return _TL[dtype]


def _lut(fmt: str, device: torch.device) -> torch.Tensor:
    from ferrylm.weights.quant import _FP8_VALUES, NF4_LEVELS

    key = (fmt, device)
    if key not in _LUT:
        _LUT[key] = (NF4_LEVELS if fmt == "nf4" else _FP8_VALUES if fmt == "fp8" else torch.zeros(1)).float().to(device)
    return _LUT[key]


def _weight_args(w, device: torch.device) -> dict:
    """Kernel arguments for a dense bank tensor, an `ExpertWeights` or a `WeightTable`."""
    table = isinstance(w, WeightTable)
    like = w.like if table else w
    if isinstance(like, torch.Tensor):  # dense
        q, scale, mn, fmt, group = like, None, None, "dense", 1
    else:
        q, scale, mn = like.parts["q"], like.parts.get("scale"), like.parts.get("min")
        fmt, group = like.fmt, like.group
    scale_like = scale if scale is not None else q  # formats without a part get a harmless stand-in
    if table:  # the tables hold each expert's address: no expert strides
        pw, ps, pm = (w.ptrs.get(k, w.ptrs["q"]) for k in ("q", "scale", "min"))
        we = se = 0
    else:
        pw, ps, pm = q, scale_like, mn if mn is not None else scale_like
        we, se = q.stride(0), scale_like.stride(0)
    aligned = all(_is_aligned(t) for t in (q, scale_like, mn) if t is not None)
    return dict(w_ptr=pw, ws_ptr=ps, wm_ptr=pm, lut_ptr=_lut(fmt, device), stride_we=we, stride_wn=q.stride(1),
                stride_se=se, stride_sn=scale_like.stride(1) if scale is not None else 0, MAPPED=table,
                FMT=FORMATS[fmt], GS=group, W_T=_tl(q.dtype), S_T=_tl(scale_like.dtype),
                ALIGN=16 if table and aligned else 1)


GROUPED_MM_MIN_ROWS: int | None = 512
"""Assignments per expert (on average) from which `expert_rows` computes a dense bank through torch's grouped
GEMM (`grouped_rows`: CUTLASS on sm_90) instead of the Triton kernel, for experts at least `GROUPED_MM_MIN_INTER`
wide. Measured by `benchmarks/bench_moe_prefill.py` on the H200 (session 9, results/moe-prefill-2026-12-02.json):
from 512 rows an expert the grouped GEMM is 1.43x the kernel on Mixtral's experts (14336 wide; 1.53x at 2048),
1.37x on Yuan2.0-M32's (8192), 1.16x on DeepSeek-V3's (2048) at 1024; below 512 they are within +-15% both ways;
on Qwen3-30B-A3B's 768-wide experts the kernel stays ahead (0.75x at 512). None: never."""

GROUPED_MM_MIN_INTER = 2048
"""The narrowest expert intermediate `GROUPED_MM_MIN_ROWS` applies to (see there)."""


def grouped_mm_usable(x: torch.Tensor, w13, w2) -> bool:
    """torch's grouped GEMM can compute these experts: dense bf16 banks (not packed, not a `WeightTable`) beside
    bf16 activations, row widths whole 16-byte lines, on the CPU or a CUDA device of compute capability 9.0."""
    if not hasattr(torch, "_grouped_mm") or not all(isinstance(w, torch.Tensor) for w in (w13, w2)):
        return False
    if not x.dtype == w13.dtype == w2.dtype == torch.bfloat16 or x.device != w13.device:
        return False
    if x.is_cuda and torch.cuda.get_device_capability(x.device) != (9, 0):
        return False
    return all(n % 8 == 0 for n in (*w13.shape[1:], w2.shape[2]))


def grouped_rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
    """`expert_rows`'s result (the weighted output of every assignment, [T * k, H]) through two grouped GEMMs over
    the assignments sorted by expert (`grouped_mm_usable` banks): gather, gate/up GEMM, silu(gate) * up, down GEMM,
    the routing weight in fp32, scatter back. No host sync: graph-capturable. It holds per assignment its input
    row [H], gate and up [2I], the product [I] and two output rows [H]: more than the Triton kernel's [I + 2H]."""
    T, k = topk_ids.shape
    E = w13.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [A]: assignments by expert
    # [E]: each expert's last row + 1 (scatter_add, not bincount: on CUDA bincount reads its range back to the host)
    counts = torch.zeros(E, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    h = _silu_mul(torch._grouped_mm(x.index_select(0, order // k), w13.transpose(1, 2), offs=offs))  # [A, I]
    return _weighted_unsorted(torch._grouped_mm(h, w2.transpose(1, 2), offs=offs), topk_weights, order)


PACKED_DENSE_MIN_ROWS: int | None = 32
"""Assignments per expert (on average) from which `expert_rows` computes a packed bank (`ExpertWeights`, read
directly) by decoding each expert it uses once into dense weights and running dense GEMMs on its rows
(`dequant_rows`), instead of the Triton kernel's in-tile decode, which decodes every weight tile once per row
block of at most 32 rows and reaches ~10 TFLOP/s (NF4) to ~18 (int4). Measured by
`benchmarks/bench_moe_prefill.py --packed` on the H200 (session 9, results/moe-prefill-2026-12-02.json): NF4
wins from 16 rows an expert on every shape (1.4x-1.5x at 16, 4.8x on Mixtral at 64, 24x at 512), int4 from 32
(0.88x / 0.95x at 16 on Qwen3-30B-A3B / Yuan2.0-M32, 1.7x-2.4x at 32-64). Eager steps only (one host read of
the counts). None: never."""

DEQUANT_BUFFER_BYTES = 256 << 20
"""`dequant_rows` decodes the experts it uses in groups whose dense weights fit this many bytes (at least one
expert a group): one decode launch and one grouped GEMM per group, so a bank of many small experts (Qwen3-30B-A3B:
128 of 9.4 MB) costs a few launches, while the transient stays bounded (the warm-up profile measures it)."""


def decode_group_experts(expert_dense_bytes: int) -> int:
    """Experts a `dequant_rows` decode group holds: as many as `DEQUANT_BUFFER_BYTES` takes of one expert's dense
    weights (gate, up and down), at least one. The plan prices a group's host time on this count (`estimate.
    DEQUANT_GROUP_S`); the engine also starts a group at each piece of an expert split by `expert_row_cap`."""
    return max(1, DEQUANT_BUFFER_BYTES // max(1, expert_dense_bytes))


DECODE_4BIT_TILE: tuple[int, int] | None = (16, 512)
"""(BLOCK_N, BLOCK_K) of `decode_experts`' kernel for two codes a byte (int4, int4min, NF4: `_decode_experts_4bit`,
bytes along K, a scale a group, NF4 by the select tree); None: those formats too take `_decode_experts`, whose
`_weight_tile` reads a transposed tile, two table loads and a scale load a byte (session 31, H100: the resident
8-layer NF4 Mixtral's 512-token prefill spent 19.8 ms of its 37.5 ms of kernels there, 1.1 TB/s of dense output).
Session 33 (H200, `benchmarks/bench_decode_experts.py`, eight NF4 Mixtral w13 experts): (16, 512) 1.06 ms, 1.78 TB/s
of bf16 written; (32, 256) 1.12; (64, 256) 1.22; (32, 128) 1.23; the tile decode 1.36 ms, 1.38 TB/s; bit-equal to
it, and its CUDA tests pass. In the resident 8-layer NF4 512-token prefill (`profile_prefill.py --tile4`) the decode
took 15.0 against 19.5 ms of 47.8 against 52.0 ms of device time; the offloaded 32-layer NF4 Mixtral under 16 GiB
(copy-bound) ran its 2k prefill at 5858 / 6567 against 6432 / 6096 tok/s and batch 64 at 213 / 213 against 206 /
214 (alternating, `benchmarks/device_s43.sh`): no change beyond noise there."""


def _triton_decodes(device: torch.device) -> bool:
    """`decode_experts` runs its Triton kernel here (CUDA, or the Triton interpreter); else the reference."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def decode_experts(w, experts: list[int], dtype: torch.dtype, out: torch.Tensor | None = None,
                   ids: torch.Tensor | None = None, args: dict | None = None) -> torch.Tensor:
    """Experts `experts` of a packed bank (`ExpertWeights` or a `WeightTable` over one) dense: [n, N, K] in
    `dtype` (into `out` when given). On CUDA one Triton launch: two codes a byte through `_decode_experts_4bit`
    (`DECODE_4BIT_TILE`), other formats through the fused kernel's own tile decode (`_weight_tile`), the same fp32
    values rounded once; elsewhere `ExpertWeights.dequantize` (the reference),
    expert by expert. `ids`: `experts` already as a device tensor (no host-to-device copy: graph-capturable);
    `args`: `_weight_args(w, device)` where the caller made them already."""
    like = w.like if isinstance(w, WeightTable) else w
    _, N, K = like.shape
    device = w.ptrs["q"].device if isinstance(w, WeightTable) else w.parts["q"].device
    if not _triton_decodes(device):
        if isinstance(w, WeightTable):
            raise ValueError("decode_experts: a WeightTable's experts decode on CUDA (or the Triton interpreter) only")
        dense = torch.cat([w.expert(e).dequantize(dtype) for e in experts])
        return dense if out is None else out.copy_(dense)
    out = torch.empty(len(experts), N, K, dtype=dtype, device=device) if out is None else out
    ids = to_device(experts, device) if ids is None else ids
    args = _weight_args(w, device) if args is None else args
    gs = args["GS"]
    if DECODE_4BIT_TILE is not None and args["FMT"] in (3, 4, 5) and gs % 2 == 0:
        BN, BK = DECODE_4BIT_TILE
        if gs >= K or gs % BK == 0 or BK % gs == 0:  # a tile's groups whole (or one a row)
            kw = {k: v for k, v in args.items() if k != "lut_ptr"}
            _decode_experts_4bit[(len(experts), triton.cdiv(N, BN), triton.cdiv(K, BK))](
                ids, out_ptr=out, N=N, K=K, stride_oe=out.stride(0), stride_on=out.stride(1), PER_ROW=gs >= K,
                BLOCK_N=BN, BLOCK_K=BK, **kw)
            return out
    BN, BK = 64, 128
    _decode_experts[(len(experts), triton.cdiv(N, BN), triton.cdiv(K, BK))](
        ids, out_ptr=out, N=N, K=K, stride_oe=out.stride(0), stride_on=out.stride(1), PER_ROW=gs >= K,
        BLOCK_N=BN, BLOCK_K=BK, **args)
    return out


def dequant_rows(x: torch.Tensor, w13, w2, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 skip: bool = False, counts: list[int] | None = None, experts: int | None = None) -> torch.Tensor:
    """`expert_rows`'s result for a packed bank (`ExpertWeights`, or a `WeightTable` over one: decoded where it
    lies), each expert it uses decoded once (`decode_experts`) in groups of at most `DEQUANT_BUFFER_BYTES` of
    dense weights, then per group the gate/up GEMM, silu(gate) * up and the down GEMM on that group's rows: torch's
    grouped GEMM where `grouped_mm_usable`, one matmul per expert else. With `skip`, ids equal to E are skipped
    (their rows 0), as `expert_rows` skips them. One host read of the per-expert counts (not for captured steps),
    unless the caller knows them: `counts`, the assignments of each id 0..E (E: skipped), as
    `torch.bincount(topk_ids.flatten(), minlength=E + 1)` would count them (the offload cache's rounds: a host
    read a round left the device idle while the host planned the next, ~30% of a packed prefill). `experts`: the
    model's expert count where the bank holds fewer (an offload cache's slots): the row cap is taken on it, so a
    round splits an expert as the resident step does and holds no more than the warm-up measured."""
    T, k = topk_ids.shape
    E, two_i, H = w13.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [A]: by expert, skipped ids (E) last
    if counts is None:
        counts = torch.bincount(flat, minlength=E + 1).tolist()
    elif len(counts) != E + 1 or sum(counts) != flat.numel():
        raise ValueError(f"dequant_rows: counts must give each of the {E + 1} ids' assignments ({flat.numel()} in all)")
    xs = x.index_select(0, order // k)  # [A, H]
    y = torch.zeros(flat.numel(), H, dtype=x.dtype, device=x.device)
    per = decode_group_experts(3 * two_i // 2 * H * x.element_size())
    groups = _decode_groups(counts[:E], per, expert_row_cap(flat.numel(), experts or E))
    # every group's expert ids and its GEMMs' row offsets cross in one copy each, and each side's kernel arguments
    # are made once: per group they cost the host more than the device's decode and GEMMs (a resident 512-token
    # NF4 Mixtral prefill left the H100 idle 25 ms of 63, in ~1200 gaps: session 31, `profile_prefill.py`)
    ids = to_device([e for g, _ in groups for e in g], x.device)
    # each group's offsets from a 16-byte boundary, as a fresh tensor of them would lie
    at, flat_offs = [], []
    for _, sizes in groups:
        at.append(len(flat_offs))
        flat_offs += list(itertools.accumulate(sizes)) + [0] * (-len(sizes) % 4)
    offs = to_device(flat_offs, x.device, torch.int32)
    on_triton = _triton_decodes(x.device)
    args13, args2 = (_weight_args(w13, x.device), _weight_args(w2, x.device)) if on_triton else (None, None)
    start = first = 0
    h = None
    for (group, sizes), o in zip(groups, at):
        n, g = sum(sizes), len(group)
        rows, out = xs[start:start + n], y[start:start + n]
        gids, goffs = ids[first:first + g], offs[o:o + g]
        # one side decoded at a time (w13's freed before w2's is made): the transient is the larger side's
        h = None  # the previous group's product: freed before this group's decode
        a13 = decode_experts(w13, group, x.dtype, ids=gids, args=args13)  # [g, 2I, H]
        h = _silu_mul(_group_mm(rows, a13, sizes, goffs))  # [n, I]
        del a13
        a2 = decode_experts(w2, group, x.dtype, ids=gids, args=args2)
        out.copy_(_group_mm(h, a2, sizes, goffs))  # [g, H, I] -> [n, H]
        del a2
        start, first = start + n, first + g
    del xs
    rows = h = None  # the last group's rows: not held through the weighting
    return _weighted_unsorted(y, topk_weights, order)


def _decode_groups(counts: list[int], per: int, cap: int) -> list[tuple[list[int], list[int]]]:
    """`dequant_rows`' decode groups in the rows' sorted order: (experts, their rows), at most `per` experts a
    group (each expert once) and at most `cap` rows an expert, an expert with more split into consecutive pieces
    that begin new groups."""
    groups: list[tuple[list[int], list[int]]] = []
    for e, c in enumerate(counts):
        while c > 0:
            r = min(c, cap)
            if not groups or len(groups[-1][0]) == per or groups[-1][0][-1] == e:  # a piece of the same expert
                groups.append(([], []))
            groups[-1][0].append(e)
            groups[-1][1].append(r)
            c -= r
    return groups


def _group_mm(rows: torch.Tensor, w: torch.Tensor, sizes: list[int], offs: torch.Tensor | None = None) -> torch.Tensor:
    """rows [n, K] in runs of `sizes` rows, run j times w[j] [N, K] transposed -> [n, N]: torch's grouped GEMM
    where `grouped_mm_usable`, a matmul per run else. `offs`: the runs' ends (int32 cumulative sizes) on the
    device where the caller has them."""
    if grouped_mm_usable(rows, w, w):
        if offs is None:
            offs = to_device(list(itertools.accumulate(sizes)), rows.device, torch.int32)
        return torch._grouped_mm(rows, w.transpose(1, 2), offs=offs)
    return torch.cat([r @ w[j].t() for j, r in enumerate(rows.split(sizes))])


def _silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """[n, 2I] (gate, up) -> silu(gate) * up [n, I]: one launch on CUDA (`fused_ops.silu_mul`), torch's ops else."""
    if fused_ops.usable(gu):
        return fused_ops.silu_mul(gu)
    gate, up = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _weighted_unsorted(y: torch.Tensor, topk_weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows y [A, H] of the assignments sorted by `order`, each times its routing weight (in fp32, rounded once),
    put back in `expert_rows`'s layout (row t * k + j)."""
    y = (y.float() * topk_weights.reshape(-1).float().index_select(0, order)[:, None]).to(y.dtype)
    return torch.empty_like(y).index_copy_(0, order, y)


def expert_rows(x: torch.Tensor, w13, w2, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, skip: bool = False, inter: int | None = None,
                decode=None, experts: int | None = None, counts: list[int] | None = None) -> torch.Tensor:
    """The weighted expert output of every assignment: [A, H] in x's dtype, row t * k + j for token t's
    j-th expert. `w13`/`w2` are device banks or `WeightTable`s (the same bits either way: only the address
    arithmetic differs). With `skip`, ids equal to E (w13.shape[0]) are skipped and their rows are 0: the
    offload cache computes the experts present on the device in rounds and adds the rows (exactly: each
    row is non-zero in one round only). With `inter`, only the first `inter` columns of each expert's
    intermediate are computed (any format: w13's first `inter` gate and up rows, w2's first `inter` columns
    of K, whose scales are those of their groups, so a packed bank needs no re-grouping; 4-bit codes: `inter`
    even): hybrid decode's host computes the others and the rows add up.
    `decode`: None takes the decode kernel where `fused_moe_decode.decode_config` says (T <= 16 tokens),
    False the plain kernel (the reference), a `DecodeConfig` the decode kernel with those tiles.
    `experts`: the model's expert count where the bank holds fewer (an offload cache's slots): the prefill path
    (`prefill_path`) is chosen on it, so a resident and an offloaded run of a step take the same one. `counts`:
    each id's assignments where the caller knows them (`dequant_rows` then reads none back)."""
    from ferrylm.layers import fused_moe_decode as fmd

    like2 = w2.like if isinstance(w2, WeightTable) else w2
    if inter is not None and not (0 < inter <= w2.shape[2] and (isinstance(like2, torch.Tensor) or inter % 2 == 0
                                                                or like2.fmt in ("int8", "fp8"))):
        raise ValueError(f"expert_rows: inter={inter} of {w2.shape[2]} columns (positive; even for two codes a byte)")
    T, k = topk_ids.shape
    E, two_i, H = w13.shape
    path = prefill_path(T * k, experts or E, two_i // 2, all(type(w) is ExpertWeights for w in (w13, w2))) \
        if decode is None and inter is None else "kernel"
    eager = not (x.is_cuda and torch.cuda.is_current_stream_capturing())
    if path == "dequant" and eager:  # before the decode kernel, whose NF4 tiles take any batch below it
        return dequant_rows(x, w13, w2, topk_ids, topk_weights, skip, counts, experts)
    if decode is not False:
        cfg = fmd.decode_config(topk_ids.shape[0], w13, w2, decode if isinstance(decode, fmd.DecodeConfig) else None,
                                inter)
        if cfg is None and isinstance(decode, fmd.DecodeConfig):
            raise ValueError(f"the decode kernel cannot run {decode}: "
                             f"{fmd.readable(w13, decode) or fmd.readable(w2, decode) or 'inter not whole words'}")
        if cfg is not None:
            return fmd.decode_rows(x, w13, w2, topk_ids, topk_weights, skip, cfg, inter)
    if path == "grouped" and not skip and grouped_mm_usable(x, w13, w2):
        return grouped_rows(x, w13, w2, topk_ids, topk_weights)
    up = two_i // 2
    I = up if inter is None else inter
    A = T * k
    BM, BN, BK = _blocks(A)
    if not all(isinstance(w, torch.Tensor) or isinstance(getattr(w, "like", None), torch.Tensor) for w in (w13, w2)):
        BM = min(BM, 32)  # packed tiles (twice as wide along K, decoded to fp32) at 64 rows overflow shared memory
    rows, block_expert, used, inv = align(topk_ids, E + skip, BM)
    if skip:  # the skip expert's blocks come last: stop before them
        used = (block_expert < E).sum().reshape(1) * BM  # block_expert ascends: its blocks before E's
        block_expert = block_expert.clamp(max=E - 1)
    m_pad = rows.numel()
    x = x.contiguous()
    h = torch.empty(m_pad, I, dtype=x.dtype, device=x.device)
    y = (torch.zeros if skip else torch.empty)(m_pad, H, dtype=x.dtype, device=x.device)
    scale = topk_weights.flatten().float().contiguous()  # [A]
    a13, a2 = _weight_args(w13, x.device), _weight_args(w2, x.device)
    grid1 = (m_pad // BM, triton.cdiv(I, BN))
    _grouped_gemm[grid1](x, out_ptr=h, rows_ptr=rows, block_expert_ptr=block_expert, used_ptr=used, scale_ptr=scale,
                         N=I, K=H, A=A, UP=up, stride_am=x.stride(0), stride_om=h.stride(0), TOP_K=k, A_BY_TOKEN=True,
                         GATED=True, SCALE=False, BLOCK_M=BM, BLOCK_N=BN, **_tiles(BK, a13, H), **a13)
    grid2 = (m_pad // BM, triton.cdiv(H, BN))
    _grouped_gemm[grid2](h, out_ptr=y, rows_ptr=rows, block_expert_ptr=block_expert, used_ptr=used, scale_ptr=scale,
                         N=H, K=I, A=A, UP=0, stride_am=h.stride(0), stride_om=y.stride(0), TOP_K=k, A_BY_TOKEN=False,
                         GATED=False, SCALE=True, BLOCK_M=BM, BLOCK_N=BN, **_tiles(BK, a2, I), **a2)
    return y[inv]


def _tiles(bk: int, args: dict, K: int) -> dict:
    """BLOCK_K and warps per format: packed tiles span twice the columns (as many bytes in flight per step
    as a dense tile: reads in place over PCIe are latency-bound) on twice the warps (their fp32 decode),
    where the doubled tile fits an H100/H200 SM's 227 KiB of shared memory: per-row int8 and int4 (sym).
    The others gather a 4-byte table value, scale or min per element, pipelined over 3 stages: doubled, a
    gated tile needs 264-392 KiB (nf4 the most) and fails at launch; at the dense width 132-196 KiB
    (tests/test_sm90_compile.py compiles every format for sm_90 and checks)."""
    if args["FMT"] == 0:
        return dict(BLOCK_K=bk, PER_ROW=True)
    per_row = args["GS"] >= K
    double = args["FMT"] == FORMATS["int4"] or (args["FMT"] == FORMATS["int8"] and per_row)
    return dict(BLOCK_K=min(2 * bk, 256) if double else bk, PER_ROW=per_row, num_warps=8)


def sum_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    # rows: [T * k, H] -> [T, H], the k experts of a token added in fp32 (on CUDA one launch: fused_ops.sum_rows)
    if fused_ops.usable(rows) and rows.dim() == 2 and rows.stride(-1) == 1 and k <= 16:
        return fused_ops.sum_rows(rows, k)
    return rows.view(-1, k, rows.shape[-1]).float().sum(1).to(rows.dtype)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; topk_ids/weights: [T, k] -> [T, H] (silu-gated experts)."""
    return sum_rows(expert_rows(x, w13, w2, topk_ids, topk_weights), topk_ids.shape[1])


class FusedExperts(ExpertBackend):
    """Resident bank on CUDA, silu-gated (every MoE family here); nothing read back to the host."""

    reads_host = False

    @staticmethod
    def supports(bank) -> bool:
        return FusedExperts.supports_tensors(bank.weights()[0], bank.act_name, bank.w13.dtype)

    @staticmethod
    def supports_tensors(w13, act: str, dtype: torch.dtype | None = None) -> bool:
        """A dense bank of the activations' dtype or an `ExpertWeights` of a kernel format, on CUDA."""
        dtype = dtype or w13.dtype
        return triton is not None and w13.is_cuda and act == "silu" and dtype in (torch.bfloat16, torch.float16)

    def forward(self, bank, x, topk_ids, topk_weights):
        return fused_experts(x, *bank.weights(), topk_ids, topk_weights)
