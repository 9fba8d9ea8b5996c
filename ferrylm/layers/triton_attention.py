"""Paged attention kernels in Triton: decode and varlen prefill that read K/V from the cache blocks in place.

Both kernels walk a sequence's block table themselves (token t of sequence b lives in block
`block_tables[b, t // page]`, row `t % page`), so no [B, S] copy of the context is gathered and no [n, S]
mask is built. One program serves one KV head and a tile of its query heads (GQA: the group's heads share
each K/V tile read). Both handle a per-layer sliding window (the query at position p sees keys
p - W + 1 .. p), V narrower than K (`v_head_dim`), MLA's latent values (V = the first `DV` features of
the K row) and a quantized cache (fp8 e4m3 / int8 codes with one fp32 scale per token and head, folded
into the scores and the softmax weights, so tiles are never dequantized in memory).

Decode is flash-decoding: the context is cut into `splits` chunks per sequence, each program writes a
partial (normalised output, log-sum-exp) and a second kernel combines them. The grid and the split count
depend only on host values fixed for a CUDA graph (batch rows, the context bucket), lengths and tables
are read on the device: nothing here synchronises with the host, so a decode step can be captured.

Prefill takes every prefill sequence of the step in one launch: a host-built list of (sequence, first
query) tiles, each query tile attending causally, offset by the tokens already cached (prefix hits,
earlier chunks). Its own chunk's K/V are read back from the cache, where the layer just wrote them.

The plain torch path (`layers/attention.py`) is the reference these are tested against
(`tests/test_attention_kernels.py`). Notation: B decode rows, T tokens, H query heads, Hk KV heads,
G = H / Hk, D key features, DV value features, page = tokens per KV block.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs (CI): the torch path is the only one
    triton = None

HEAD_TILE = 16
"""Query heads per program (padded): tl.dot needs at least 16 rows, and a GQA group is 1-8 heads."""


def available(device: torch.device, kv_dtype: torch.dtype | None = None) -> bool:
    """Triton can run these kernels here: a CUDA device (fp8 codes need sm_89+), or the CPU under the
    Triton interpreter."""
    if triton is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    if device.type != "cuda":
        return False
    return kv_dtype != torch.float8_e4m3fn or torch.cuda.get_device_capability(device) >= (8, 9)


def _ieee(q: torch.Tensor) -> bool:
    """Dots in exact fp32: for fp32 models (tf32 would cost ~1e-3), and under the interpreter, whose
    bf16 tl.dot is wrong (its bf16 loads and stores are fine)."""
    return q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def _p2(n: int) -> int:
    """Tile extent for n features: a power of two, >= 16 (tl.dot's smallest operand side)."""
    return max(16, triton.next_power_of_2(n))


def _narrow_latent(d: int, dv: int, latent_values: int | None) -> bool:
    """MLA rows whose value tile is narrower than the key tile (values = the first DV of each cached key):
    key tiles of 64 then miscompile on sm_90 (H200, session 8: the tiny DeepSeek shape, D 40 / DV 32, gave
    wrong rows at a 16-token page and an illegal address at a 4-token one, exact under the interpreter;
    tiles of 32 and 16 were right). Real MLA rows (576 / 512) take 16-key tiles anyway."""
    return bool(latent_values) and _p2(dv) < _p2(d)


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(rows: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Context chunks per sequence so the grid fills the GPU (~4 programs an SM) at small batch and long
    context; each chunk keeps >= 128 tokens (two key tiles) so the partials stay a few % of the KV bytes.
    A function of host values only (a graph bucket's rows and context bound)."""
    sms = _sms(device) if device.type == "cuda" else 4
    want = -(-4 * sms // max(1, rows * kv_heads))
    return max(1, min(want, -(-max_len // 128), 64))


if triton is not None:

    @triton.jit
    def _attend(acc, l_i, m_i, q, n0, hi, pos, window, qk_scale, K, V, KS, VS, BT_ROW, kvh,
                s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_sb, s_st, s_vsb, s_vst,
                D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                PAGE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                QUANT: tl.constexpr, IEEE: tl.constexpr):
        """One key tile n0 .. n0 + BLOCK_N (keys >= hi masked) folded into the online softmax of the rows of q
        ([R, BLOCK_D], query positions `pos` [R]); CAUSAL / WINDOWED add the per-row position masks."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        nmask = offs_n < hi
        blk = tl.load(BT_ROW + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)  # the block of each key
        tok = offs_n % PAGE
        k = tl.load(K + (blk * s_kb + tok * s_kt + kvh * s_kh)[:, None] + offs_d[None, :],
                    mask=nmask[:, None] & (offs_d[None, :] < D), other=0.0)  # [BLOCK_N, BLOCK_D]
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))  # [R, BLOCK_N] fp32
        s = s * qk_scale
        if QUANT:
            s = s * tl.load(KS + blk * s_sb + tok * s_st + kvh, mask=nmask, other=0.0)[None, :]
        ok = nmask[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= pos[:, None])
        if WINDOWED:
            ok = ok & (offs_n[None, :] > pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet stays empty
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + (blk * s_vb + tok * s_vt + kvh * s_vh)[:, None] + offs_dv[None, :],
                    mask=nmask[:, None] & (offs_dv[None, :] < DV), other=0.0)  # [BLOCK_N, BLOCK_DV]
        if QUANT:
            p = p * tl.load(VS + blk * s_vsb + tok * s_vst + kvh, mask=nmask, other=0.0)[None, :]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        return acc, l_i, m_new

    # values that change step to step (table width, batch, tile count) are not specialised on: no recompiles
    @triton.jit(do_not_specialize=["window", "s_btb"])
    def _decode_kernel(Q, K, V, KS, VS, BT, LENS, OUT, PART, LSE, sm_scale, window,
                       s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_sb, s_st, s_vsb, s_vst, s_btb,
                       s_ob, s_oh,
                       H: tl.constexpr, G: tl.constexpr, HT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       DV: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                       SPLITS: tl.constexpr, WINDOWED: tl.constexpr, QUANT: tl.constexpr, IEEE: tl.constexpr):
        b = tl.program_id(0)
        pid_h = tl.program_id(1)  # KV head x head tile
        split = tl.program_id(2)
        TILES: tl.constexpr = (G + HT - 1) // HT
        kvh = pid_h // TILES
        g = (pid_h % TILES) * HT + tl.arange(0, HT)  # query head within the group
        gmask = g < G
        heads = kvh * G + g
        L = tl.load(LENS + b).to(tl.int32)
        lo = 0
        if WINDOWED:  # the new token at L - 1 sees keys L - W .. L - 1: the range is the whole mask
            lo = tl.maximum(L - window, 0)
        chunk = tl.cdiv(tl.cdiv(L - lo, SPLITS), BLOCK_N) * BLOCK_N
        start = lo + split * chunk
        end = tl.minimum(start + chunk, L)

        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :],
                    mask=gmask[:, None] & (offs_d[None, :] < D), other=0.0)  # [HT, BLOCK_D]
        qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
        m_i = tl.full([HT], float("-inf"), tl.float32)
        l_i = tl.zeros([HT], tl.float32)
        acc = tl.zeros([HT, BLOCK_DV], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            # pos (m_i here) is unused: the range itself is the mask
            acc, l_i, m_i = _attend(acc, l_i, m_i, q, n0, end, m_i, window, qk_scale, K, V, KS, VS, BT + b * s_btb,
                                    kvh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_sb, s_st, s_vsb, s_vst,
                                    D, BLOCK_D, DV, BLOCK_DV, PAGE, BLOCK_N, False, False, QUANT, IEEE)

        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        omask = gmask[:, None] & (offs_dv[None, :] < DV)
        if SPLITS == 1:
            tl.store(OUT + b * s_ob + heads[:, None] * s_oh + offs_dv[None, :], o.to(OUT.dtype.element_ty), mask=omask)
        else:  # PART: [B, H, SPLITS, DV] fp32; LSE: [B, H, SPLITS] (log2 domain; -inf for an empty chunk)
            row = (b * H + heads) * SPLITS + split
            tl.store(PART + row[:, None] * DV + offs_dv[None, :], o, mask=omask)
            tl.store(LSE + row, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=gmask)

    @triton.jit
    def _combine_kernel(PART, LSE, OUT, s_ob, s_oh, H: tl.constexpr, SPLITS: tl.constexpr,
                        BLOCK_S: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_dv = tl.arange(0, BLOCK_DV)
        smask = offs_s < SPLITS
        row = (b * H + h) * SPLITS + offs_s
        lse = tl.load(LSE + row, mask=smask, other=float("-inf"))  # [BLOCK_S]
        w = tl.exp2(lse - tl.max(lse, 0))  # chunk 0 is never empty (L >= 1), so the max is finite
        part = tl.load(PART + row[:, None] * DV + offs_dv[None, :], mask=smask[:, None] & (offs_dv[None, :] < DV),
                       other=0.0)  # [BLOCK_S, BLOCK_DV]
        o = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
        tl.store(OUT + b * s_ob + h * s_oh + offs_dv, o.to(OUT.dtype.element_ty), mask=offs_dv < DV)

    @triton.jit(do_not_specialize=["window", "B", "NT", "s_btb"])
    def _prefill_kernel(Q, K, V, KS, VS, BT, META, OUT, sm_scale, window, B, NT,
                        s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_sb, s_st, s_vsb, s_vst, s_btb,
                        s_ot, s_oh,
                        G: tl.constexpr, HT: tl.constexpr, BLOCK_Q: tl.constexpr, D: tl.constexpr,
                        BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr,
                        BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr, QUANT: tl.constexpr, IEEE: tl.constexpr):
        # META (int32): query_start_loc [B + 1] | start_pos [B] | seq_lens [B] | tile seq [NT] | tile q0 [NT]
        tile = tl.program_id(0)
        pid_h = tl.program_id(1)
        seq = tl.load(META + 3 * B + 1 + tile)
        q0 = tl.load(META + 3 * B + 1 + NT + tile)
        qs = tl.load(META + seq)
        n = tl.load(META + seq + 1) - qs
        start = tl.load(META + B + 1 + seq)
        L = tl.load(META + 2 * B + 1 + seq)
        TILES: tl.constexpr = (G + HT - 1) // HT
        kvh = pid_h // TILES
        r = tl.arange(0, BLOCK_Q * HT)  # rows: query token r // HT, head r % HT of this tile
        tq = q0 + r // HT
        g = (pid_h % TILES) * HT + r % HT
        rmask = (tq < n) & (g < G)
        heads = kvh * G + g
        pos = start + tq  # absolute position of each row's query
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        q = tl.load(Q + (qs + tq).to(tl.int64)[:, None] * s_qt + heads[:, None] * s_qh + offs_d[None, :],
                    mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0)  # [BLOCK_Q * HT, BLOCK_D]
        qk_scale = sm_scale * 1.4426950408889634
        hi = tl.minimum(L, start + q0 + BLOCK_Q)  # past the tile's last query
        bt_row = BT + seq.to(tl.int64) * s_btb
        m_i = tl.full([BLOCK_Q * HT], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * HT], tl.float32)
        acc = tl.zeros([BLOCK_Q * HT, BLOCK_DV], tl.float32)
        if WINDOWED:  # one masked loop from the first query's window start
            for n0 in range(tl.maximum(start + q0 - window + 1, 0), hi, BLOCK_N):
                acc, l_i, m_i = _attend(acc, l_i, m_i, q, n0, hi, pos, window, qk_scale, K, V, KS, VS, bt_row, kvh,
                                        s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_sb, s_st, s_vsb, s_vst,
                                        D, BLOCK_D, DV, BLOCK_DV, PAGE, BLOCK_N, True, True, QUANT, IEEE)
        else:  # key tiles wholly before the tile's first query need no mask; the rest are causal-masked
            diag = (start + q0) // BLOCK_N * BLOCK_N
            for n0 in range(0, diag, BLOCK_N):
                acc, l_i, m_i = _attend(acc, l_i, m_i, q, n0, hi, pos, window, qk_scale, K, V, KS, VS, bt_row, kvh,
                                        s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_sb, s_st, s_vsb, s_vst,
                                        D, BLOCK_D, DV, BLOCK_DV, PAGE, BLOCK_N, False, False, QUANT, IEEE)
            for n0 in range(diag, hi, BLOCK_N):
                acc, l_i, m_i = _attend(acc, l_i, m_i, q, n0, hi, pos, window, qk_scale, K, V, KS, VS, bt_row, kvh,
                                        s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_sb, s_st, s_vsb, s_vst,
                                        D, BLOCK_D, DV, BLOCK_DV, PAGE, BLOCK_N, True, False, QUANT, IEEE)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + (qs + tq).to(tl.int64)[:, None] * s_ot + heads[:, None] * s_oh + offs_dv[None, :],
                 o.to(OUT.dtype.element_ty), mask=rmask[:, None] & (offs_dv[None, :] < DV))


def _cache_args(k_cache, v_cache, k_scale, v_scale, latent_values):
    """(K, V, KS, VS, DV, the 10 strides) shared by both kernels; MLA's values are K's first DV features."""
    if latent_values:
        v_cache, v_scale = k_cache, k_scale
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    quant = k_scale is not None
    ks = k_scale if quant else k_cache  # any pointer: never read unless QUANT
    vs = v_scale if quant else k_cache
    dv = latent_values or v_cache.shape[-1]
    strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
               v_cache.stride(2), ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
               vs.stride(0) if quant else 0, vs.stride(1) if quant else 0)
    return k_cache, v_cache, ks, vs, dv, strides, quant


def _prepare(q, k_cache, v_cache, k_scale, v_scale, latent_values, out):
    """What both entry points set up: q with unit last stride, the output [rows, H, DV], the page size,
    the KV heads, the query heads per KV head and the cache arguments (`_cache_args`)."""
    Hk, page = k_cache.shape[2], k_cache.shape[1]
    args = _cache_args(k_cache, v_cache, k_scale, v_scale, latent_values)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = q.new_empty(*q.shape[:2], args[4])
    return q, out, page, Hk, q.shape[1] // Hk, args


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, max_len: int, window: int | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 latent_values: int | None = None, out: torch.Tensor | None = None,
                 splits: int | None = None) -> torch.Tensor:
    """One new token per row. q: [B, H, D]; k_cache: [N, page, Hk, D]; v_cache: [N, page, Hk, DV];
    block_tables: [B, nb]; seq_lens: [B] (>= 1, the new token included); max_len: a host bound on
    seq_lens (sets the split count); k_scale/v_scale: [N, page, Hk] fp32 for a quantized cache.
    -> out [B, H, DV] in q's dtype."""
    q, out, page, Hk, G, (K, V, KS, VS, DV, st, quant) = _prepare(q, k_cache, v_cache, k_scale, v_scale,
                                                                  latent_values, out)
    B, H, D = q.shape
    if B == 0:
        return out
    tiles = -(-G // HEAD_TILE)
    S = splits or decode_splits(B, Hk * tiles, max_len, q.device)
    part = lse = out  # unused without splits
    if S > 1:
        part = torch.empty(B, H, S, DV, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    big = D > 256  # MLA rows (576 features): smaller tiles keep the registers in bounds
    fp32 = q.dtype == torch.float32  # exact fp32 dots: on 4 warps or 2 stages they spill (sm_90 build)
    narrow = _narrow_latent(D, DV, latent_values)
    _decode_kernel[(B, Hk * tiles, S)](
        q, K, V, KS, VS, block_tables, seq_lens, out, part, lse, scale, window or 0,
        q.stride(0), q.stride(1), *st, block_tables.stride(0), out.stride(0), out.stride(1),
        H=H, G=G, HT=HEAD_TILE, D=D, BLOCK_D=_p2(D), DV=DV, BLOCK_DV=_p2(DV), PAGE=page,
        BLOCK_N=16 if big else 32 if fp32 or narrow else 64, SPLITS=S, WINDOWED=window is not None, QUANT=quant,
        IEEE=_ieee(q), num_warps=8 if big or fp32 else 4, num_stages=1 if big or fp32 else 3)
    if S > 1:
        _combine_kernel[(B, H)](part, lse, out, out.stride(0), out.stride(1), H=H, SPLITS=S,
                                BLOCK_S=triton.next_power_of_2(S), DV=DV, BLOCK_DV=_p2(DV), num_warps=4)
    return out


def prefill_meta(query_start_loc: list[int], start_pos: list[int], seq_lens: list[int], first: int,
                 block_q: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """The prefill kernel's per-step metadata, one int32 upload: query_start_loc | start_pos | seq_lens |
    (sequence, first query) of every query tile of sequences `first`.. -> (META, number of tiles)."""
    tile_seq, tile_q0 = [], []
    for i in range(first, len(seq_lens)):
        n = query_start_loc[i + 1] - query_start_loc[i]
        for q0 in range(0, n, block_q):
            tile_seq.append(i)
            tile_q0.append(q0)
    meta = torch.tensor([*query_start_loc, *start_pos, *seq_lens, *tile_seq, *tile_q0], dtype=torch.int32)
    return meta.to(device, non_blocking=True), len(tile_seq)


def prefill_block_q(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype | None = None) -> int:
    """Query tokens per prefill tile: rows = tokens x the head tile, 128 rows (16 for MLA's 576-wide rows,
    which pad to 1024 features: TODO a split 512 + 64 dot would let them take larger tiles; 32 in fp32, whose
    exact dots run on FMA units and spill registers at 64 rows or more on sm_90)."""
    ht = min(HEAD_TILE, triton.next_power_of_2(num_heads // num_kv_heads))
    rows = 16 if head_dim > 256 else 32 if dtype == torch.float32 else 128
    return max(1, rows // ht)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  meta: torch.Tensor, num_tiles: int, num_seqs: int, block_q: int, scale: float,
                  window: int | None = None, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, latent_values: int | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every prefill chunk in the step, K/V (the chunk's own included) read from the
    cache. q: [T, H, D] (the whole step's tokens; rows of decode sequences are not touched);
    block_tables: [num_seqs, nb]; meta, num_tiles from `prefill_meta(.., block_q)`. -> out [T, H, DV]."""
    q, out, page, Hk, G, (K, V, KS, VS, DV, st, quant) = _prepare(q, k_cache, v_cache, k_scale, v_scale,
                                                                  latent_values, out)
    T, H, D = q.shape
    if num_tiles == 0:
        return out
    ht = min(HEAD_TILE, triton.next_power_of_2(G))
    big = D > 256
    fp32 = q.dtype == torch.float32  # with `prefill_block_q`'s 32 rows: <= 40 B spilled on sm_90 (was 10 KB)
    narrow = _narrow_latent(D, DV, latent_values)
    _prefill_kernel[(num_tiles, Hk * -(-G // ht))](
        q, K, V, KS, VS, block_tables, meta, out, scale, window or 0, num_seqs, num_tiles,
        q.stride(0), q.stride(1), *st, block_tables.stride(0), out.stride(0), out.stride(1),
        G=G, HT=ht, BLOCK_Q=block_q, D=D, BLOCK_D=_p2(D), DV=DV, BLOCK_DV=_p2(DV), PAGE=page,
        BLOCK_N=16 if big or fp32 and D > 128 else 32 if fp32 or narrow else 64, WINDOWED=window is not None, QUANT=quant,
        IEEE=_ieee(q), num_warps=8 if big or D > 64 or fp32 else 4, num_stages=1 if big or fp32 else 2)
    return out
