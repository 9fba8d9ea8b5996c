"""The decode-shaped fused MoE kernel: few tokens (T <= `DECODE_MAX_TOKENS`), built for bytes in flight.

At decode each routed expert sees a handful of rows, so the GEMMs are GEMVs bound by how many weight
bytes are in flight, above all when the weights are read in place from mapped host memory over PCIe
(`WeightTable`). The plain kernel (`fused_moe._grouped_gemm`) walks all of K in one program per N tile;
this one differs where that costs requests in flight:
- split-K: the grid is (row blocks of one expert, N tiles, K splits); each split writes fp32 partials
  [S, A, N] by assignment, and a small second kernel sums the splits (deterministic: no atomics) and
  applies silu(gate) * up (GEMM 1) or the routing weight (GEMM 2), so GEMM 1 runs over w13's 2I rows as
  one plain GEMM.
- packed codes are read as int32 words (4 int8/fp8 codes or 8 nibbles a word) with a 16-byte alignment
  hint on every base address, so each thread issues 16-byte loads even through a table of addresses
  (without it Triton reads through a loaded pointer one element a load); code j of a word is unpacked with
  shifts and multiplied with the activations' columns CPW * i + j (the dot runs over K in another order,
  so nothing is interleaved in registers).
- scales are loaded once per group (or once per row): where a tile lies inside one group the dot runs on
  the unscaled codes and the tile's sum is scaled (and, int4min, shifted by min * sum(a)); otherwise one
  scale per word. NF4 levels come from a 16-entry table in L1 (`nf4_select=False`) or a tree of 15
  selects on the code's bits with the levels as immediates (`nf4_select=True`); fp8 e4m3 by the
  hardware conversion.
Results equal `weights/quant.py`'s dequantize-then-matmul within rounding (the scale is applied to sums,
not to each weight).
TODO(issue 8): NF4 reads ~450 GB/s of codes from HBM (3.35-4.8 TB/s there), bound by the decode's ~25 integer ops a code
(the select tree; FMA rows of one run as slow as dot tiles, so not the MMA's layout). A byte-permute lookup (PTX
`prmt.b32` through `tl.inline_asm_elementwise`: two permutes over the 16 levels' bf16 bytes select four codes' high
or low bytes at once) would take ~3-4 ops a code; the levels then round to bf16 before the scale, so results move by
an ulp from the select tree's. Needs a GPU to build and time (the interpreter runs no inline asm). The plain kernel stays the reference and the prefill path; `decode_config` says
when this one is used. Notation as in fused_moe.py: T tokens, k per token, A = T * k, E, H, I; S splits;
CPW codes per 32-bit word; BW = BLOCK_K / CPW words per row of a tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ferrylm.layers.fused_moe import FORMATS, WeightTable, _is_aligned, _lut, _tl, align, triton

if triton is not None:
    import triton.language as tl

DECODE_MAX_TOKENS = 0
"""Batches of at most this many tokens take the decode kernel (`expert_rows(decode=None)`); 0 turns it off.
Off until the H200 sweep (`benchmarks/bench_mapped.py --sweep`) shows it beating the plain kernel (16 is the
intended bound); tests and the sweep select it explicitly."""
BY_FORMAT_MAX_TOKENS = {"nf4": None, "fp8": 32}
"""Formats that take the decode kernel at batches of at most this many tokens whatever `DECODE_MAX_TOKENS` says,
with `by_format_config`'s tiles (fp8 only where the GPU converts e4m3 itself: `native_fp8`); None: at any batch
`fused_moe.expert_rows` does not give to `dequant_rows` (fewer than `PACKED_DENSE_MIN_ROWS` rows an expert, or a
graph capture).
NF4 lost its bound of 32 in session 30: between it and `dequant_rows` (Mixtral 33-127 tokens, Qwen3-30B-A3B 33-511)
the plain kernel decoded NF4 tiles at ~10 TFLOP/s, and the 32-layer NF4 Mixtral's batch 64 under 16 GiB ran at 0.32 of
its PCIe floor (96 tok/s, ~280 ms a step of expert work).
fp8 joined in session 26: the plain kernel decodes e4m3 through a 256-entry table and loads a scale per element, and
on the H100 it took 0.27 / 0.38 ms (per channel / groups of 128) for one Qwen3-30B-A3B layer at 1 token from HBM,
where the tiles `by_format_config` picks took 0.041 / 0.044 (at 4 tokens 0.47 / 1.19 against 0.097 / 0.105); in
place at the PCIe rate either way (`bench_mapped.py --mixed`, CUDA-graphed;
results/mapped-mixed-2026-12-06-s26-h100-graphed.json)."""
TARGET_PROGRAMS = 1024
"""Auto split-K aims at about this many programs per GEMM (~8 per SM of an H100/H200)."""


@dataclass(frozen=True)
class DecodeConfig:
    """Tile configuration of the decode kernel (`benchmarks/bench_mapped.py --sweep` sweeps these)."""

    block_m: int = 16
    """Rows per block (one expert's rows). 16 with `dot`; FMA blocks may be 1..16 (a power of 2; an expert
    with more rows than block_m gets several blocks, each reading its weights again)."""
    block_n: int = 64
    """Output features per program."""
    block_k: int = 128
    """Reduction columns per loop step (codes, not bytes). With `dot`, block_k / CPW >= 16."""
    split_k13: int = 0
    """K splits of GEMM 1 (K = H); 0: chosen from `TARGET_PROGRAMS`."""
    split_k2: int = 0
    """K splits of GEMM 2 (K = I); 0: chosen from `TARGET_PROGRAMS`."""
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True
    """tl.dot (tensor cores, block_m >= 16) or FMA broadcast-and-sum (any block_m; GEMV-like at 1 row)."""
    nf4_select: bool = False
    """NF4 levels by a select tree (registers) instead of an L1 table lookup."""

    def splits(self, split: int, blocks: int, n: int, K: int) -> int:
        """K splits for a GEMM of `blocks` row blocks, N = n and reduction K (split 0: auto)."""
        steps = -(-K // self.block_k)
        if split <= 0:
            tiles = blocks * -(-n // self.block_n)
            split = 1
            while split * tiles < TARGET_PROGRAMS and 4 * split <= steps:  # >= 2 steps a split
                split *= 2
        return max(1, min(split, steps))


def _cpw(fmt: str) -> int:
    return 1 if fmt == "dense" else 8 if fmt in ("int4", "int4min", "nf4") else 4


def readable(w, cfg: DecodeConfig) -> str | None:
    """Why this kernel cannot read bank side `w` ([E, N, K] dense, `ExpertWeights` or `WeightTable`) with
    `cfg`, None when it can."""
    like = w.like if isinstance(w, WeightTable) else w
    fmt = "dense" if isinstance(like, torch.Tensor) else like.fmt
    cpw = _cpw(fmt)
    K = like.shape[2]
    if fmt != "dense":
        q = like.parts["q"]
        if q.shape[-1] % 4 or q.stride(-1) != 1 or q.stride(1) % 4 or q.stride(0) % 4:
            return f"{fmt} codes of {q.shape[-1]} bytes a row cannot be read as 32-bit words"
        if like.group < K and like.group % cpw:
            return f"groups of {like.group} split a 32-bit word of {cpw} codes"
    if cfg.dot and (cfg.block_m < 16 or cfg.block_k // cpw < 16 or cfg.block_n < 16):
        return f"tl.dot needs block_m, block_n and block_k / {cpw} >= 16"
    if cfg.block_k % cpw or cfg.block_m & (cfg.block_m - 1):
        return f"block_k must be a multiple of {cpw} codes and block_m a power of 2"
    return None


def decode_config(T: int, w13, w2, cfg: DecodeConfig | None = None, inter: int | None = None) -> DecodeConfig | None:
    """The rule: a batch of T <= DECODE_MAX_TOKENS tokens whose banks both sides can read in 32-bit words
    takes the decode kernel (with `cfg`, default `DecodeConfig()`); larger batches, and prefill, the plain
    kernel (its row blocks reuse each weight tile across up to 64 rows and cuBLAS-like tiling pays). A bank cut
    at `inter` (hybrid decode's GPU columns) is read by either, dense or packed: `inter` a multiple of the
    format's codes a word (hybrid decode's c is a multiple of `offload/host_experts.HostExperts.split_unit`)."""
    like = w2.like if isinstance(w2, WeightTable) else w2
    fmt = "dense" if isinstance(like, torch.Tensor) else like.fmt
    explicit = cfg is not None  # a config asked for by name skips the token bound
    if not explicit and taken_by_format(fmt, T) and (fmt != "fp8" or native_fp8()):
        cfg = by_format_config(fmt, isinstance(w2, WeightTable), T)
    elif not explicit and T > DECODE_MAX_TOKENS:
        return None
    cfg = cfg or DecodeConfig()
    if triton is None:
        return None
    if inter is not None and not isinstance(like, torch.Tensor) and inter % _cpw(like.fmt):
        return None  # GEMM 2 reads whole 32-bit words of K
    return cfg if readable(w13, cfg) is None and readable(w2, cfg) is None else None


def native_fp8() -> bool:
    """The current GPU converts e4m3 in hardware (compute capability 8.9+: Ada, Hopper and later); the decode kernel
    reads fp8 codes that way, and elsewhere fp8 banks stay on the plain kernel's table."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def by_format_config(fmt: str, mapped: bool, T: int) -> DecodeConfig:
    """fp8: at one token FMA rows of one (block_m 1, 32 outputs a program; its auto K split depends on the
    assignments alone, as rows of one pad nothing), above it the default dot tiles with K split 4 ways in both GEMMs:
    fixed, because the auto rule counts the bank's padded row blocks, and an offload cache's slot bank (fewer
    experts, a skip id) would then split K otherwise than the resident bank and sum in another order. Against the
    best of `bench_mapped.py --mixed`'s configurations (H100, session 26; per channel and in groups of 128): the best
    at one token, within 0-9% at 4 tokens.
    NF4: the tiles `BY_FORMAT_MAX_TOKENS` formats take: wide K tiles, 8 warps, NF4 levels from the select tree, K split
    2 / 4 ways (GEMM 1 / 2). Session 12's sweep (`bench_mapped.py --sweep --formats nf4 --where nf4_select=True`):
    the best read in place at 1 and 8 tokens (4.17 ms) and within 4% of the best from HBM (0.448 ms at 1 token
    against 0.432 for FMA rows of one, which take 12 ms in place). One configuration for both, so a bank read
    through a table (offloaded) sums in the order the resident bank does and the two stay equal bit for bit."""
    if fmt == "fp8":
        return (DecodeConfig(block_m=1, dot=False, block_n=32, block_k=128) if T == 1
                else DecodeConfig(split_k13=4, split_k2=4))
    return DecodeConfig(block_k=256, num_warps=8, split_k13=2, split_k2=4, nf4_select=True)


if triton is not None:
    # the per-expert addresses, shared with the plain kernel; NF4 levels by a select tree, shared with `decode_experts`
    from ferrylm.layers.fused_moe import _expert_bases, _nf4_select


    @triton.jit
    def _code(words, lut_ptr, J: tl.constexpr, FMT: tl.constexpr, NF4_SELECT: tl.constexpr):
        # words: [BW, BN] int32 -> code J of each word as fp32, unscaled (int8 value, e4m3 value, q - 8,
        # q, NF4 level); dense tiles come back as they are
        if FMT == 0:
            v = words
        elif FMT == 1:  # signed byte J: shift it to the top, arithmetic shift back
            v = ((words << (24 - 8 * J)) >> 24).to(tl.float32)
        elif FMT == 2:
            v = ((words >> (8 * J)) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            c = (words >> (4 * J)) & 15
            if FMT == 3:
                v = (c - 8).to(tl.float32)
            elif FMT == 4:
                v = c.to(tl.float32)
            elif NF4_SELECT:
                v = _nf4_select(c)
            else:
                v = tl.load(lut_ptr + c)
        return v

    @triton.jit
    def _decode_gemm(a_ptr, w_ptr, ws_ptr, wm_ptr, lut_ptr, p_ptr, rows_ptr, block_expert_ptr, used_ptr,
                     N, HALF, UP, K_W, A, a_div, split_w, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ps,
                     MAPPED: tl.constexpr, ALIGN: tl.constexpr, FMT: tl.constexpr, GS: tl.constexpr,
                     PER_ROW: tl.constexpr, CPW: tl.constexpr, W_T: tl.constexpr, S_T: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                     NF4_SELECT: tl.constexpr, EVEN_K: tl.constexpr):
        # partials p[pid_k, assignment, n] (fp32) of a @ w^T over this program's split of K; output n reads
        # weight row n below HALF, UP + n - HALF from there (GEMM 1 with `inter`: the first HALF gate rows and
        # the first HALF up rows, which start at UP)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        if pid_m * BLOCK_M >= tl.load(used_ptr):
            return
        BW: tl.constexpr = BLOCK_K // CPW
        GROUP_TILE: tl.constexpr = (not PER_ROW) and GS % BLOCK_K == 0  # a tile inside one group
        WORD_SCALE: tl.constexpr = FMT != 0 and (not PER_ROW) and (not GROUP_TILE)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        assign = tl.load(rows_ptr + offs_m)  # [BM] assignment index, A for padding
        valid = assign < A
        a_rows = (assign // a_div).to(tl.int64)  # GEMM 1 reads x by token (a_div = k), GEMM 2 h by assignment
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        w_base, s_base, m_base = _expert_bases(w_ptr, ws_ptr, wm_ptr, e, stride_we, stride_se, MAPPED, ALIGN, W_T, S_T)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        rows = tl.where(offs_n < HALF, offs_n, offs_n + (UP - HALF)).to(tl.int64)
        offs_w = tl.arange(0, BW)
        # the loop runs in words (K_W = K / CPW a row, split_w a split): offsets in words keep the
        # divisibility Triton needs to see 16-byte vectors
        w_lo = pid_k * split_w
        w_hi = tl.minimum(K_W, w_lo + split_w)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for w0 in range(w_lo, w_hi, BW):
            k0 = w0 * CPW
            kw = k0 + offs_w * CPW  # [BW] first column of each word
            # EVEN_K (whole tiles): no mask along K, so the mask is constant along a thread's words
            w_ok = w0 + offs_w < w_hi
            mask = w_ok[:, None] & n_ok[None, :] if not EVEN_K else n_ok[None, :]
            words = tl.load(w_base + rows[None, :] * stride_wn + (w0 + offs_w)[:, None], mask=mask,
                            other=0)  # [BW, BN]
            if WORD_SCALE:  # one scale (and min) per word: a word never straddles a group (GS % CPW == 0)
                s_off = rows[None, :] * stride_sn + (kw // GS)[:, None]
                s_w = tl.load(s_base + s_off, mask=mask, other=0.0).to(tl.float32)
                if FMT == 4:
                    m_w = tl.load(m_base + s_off, mask=mask, other=0.0).to(tl.float32)
            if GROUP_TILE:
                t = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                a_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
            else:
                t = acc
            for j in tl.static_range(CPW):
                a = tl.load(a_ptr + a_rows[:, None] * stride_am + (kw + j)[None, :],
                            mask=valid[:, None] & w_ok[None, :], other=0.0)  # [BM, BW]
                v = _code(words, lut_ptr, j, FMT, NF4_SELECT)
                if WORD_SCALE:
                    v = v * s_w
                    if FMT == 4:
                        v = v + m_w
                if DOT:
                    t = tl.dot(a, v.to(a.dtype), t)
                else:
                    t += tl.sum(a.to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
                if GROUP_TILE and FMT == 4:
                    a_sum += tl.sum(a.to(tl.float32), axis=1)
            if GROUP_TILE:  # the tile's one group: scale its sum (sum_k a (q s + m) = s sum_k a q + m sum_k a)
                s_off = rows * stride_sn + k0 // GS
                s_t = tl.load(s_base + s_off, mask=n_ok, other=0.0).to(tl.float32)
                t = t * s_t[None, :]
                if FMT == 4:
                    t += a_sum[:, None] * tl.load(m_base + s_off, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                acc += t
            else:
                acc = t
        if PER_ROW and FMT != 0:  # one scale a row: applied to the whole split's sum
            acc = acc * tl.load(s_base + rows * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        p = p_ptr + pid_k * stride_ps + assign[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(p, acc, mask=valid[:, None] & n_ok[None, :])

    @triton.jit
    def _decode_reduce(p_ptr, out_ptr, scale_ptr, ids_ptr, N, splits, stride_ps, E, GATED: tl.constexpr,
                       SCALE: tl.constexpr, SKIP: tl.constexpr, BLOCK: tl.constexpr):
        # out[a, n] = epilogue(sum_s p[s, a, n]): silu(gate) * up (gate at n, up at N + n) or * routing weight
        a = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        width = 2 * N if GATED else N
        g = tl.zeros((BLOCK,), dtype=tl.float32)
        u = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(splits):
            row = p_ptr + s * stride_ps + a.to(tl.int64) * width  # S * A * N < 2**31: int32 is enough
            g += tl.load(row + offs, mask=ok, other=0.0)
            if GATED:
                u += tl.load(row + N + offs, mask=ok, other=0.0)
        if GATED:
            g = g * tl.sigmoid(g) * u
        if SCALE:
            g = g * tl.load(scale_ptr + a)
        if SKIP:  # skipped assignments were never computed: their rows are 0
            g = tl.where(tl.load(ids_ptr + a) < E, g, 0.0)
        tl.store(out_ptr + a.to(tl.int64) * N + offs, g.to(out_ptr.dtype.element_ty), mask=ok)


def _args(w, device: torch.device) -> dict:
    """Kernel arguments for one bank side: dense [E, N, K], `ExpertWeights` or `WeightTable`. Packed codes
    are passed as int32 words ([E, N, KB / 4]); strides are in the units of each part's pointer."""
    table = isinstance(w, WeightTable)
    like = w.like if table else w
    if isinstance(like, torch.Tensor):
        fmt, group, q, scale, mn = "dense", like.shape[2], like, None, None
    else:
        fmt, group = like.fmt, like.group
        q, scale, mn = like.parts["q"].view(torch.int32), like.parts.get("scale"), like.parts.get("min")
    scale_like = scale if scale is not None else q
    aligned = all(_is_aligned(t) for t in (q, scale_like, mn) if t is not None)
    if table:
        pw, ps, pm = (w.ptrs.get(name, w.ptrs["q"]) for name in ("q", "scale", "min"))
        we = se = 0
    else:
        pw, ps, pm = q, scale_like, mn if mn is not None else scale_like
        we, se = q.stride(0), scale_like.stride(0)
    return dict(w_ptr=pw, ws_ptr=ps, wm_ptr=pm, lut_ptr=_lut(fmt, device), stride_we=we, stride_wn=q.stride(1),
                stride_se=se, stride_sn=scale_like.stride(1) if scale is not None else 0, MAPPED=table,
                ALIGN=16 if aligned else 1, FMT=FORMATS[fmt], GS=group,
                PER_ROW=group >= like.shape[2] and fmt != "int4min",  # a min cannot wait for the end
                CPW=_cpw(fmt), W_T=_tl(q.dtype), S_T=_tl(scale_like.dtype))


def _split(cfg: DecodeConfig, S: int, K: int, cpw) -> tuple[int, int]:
    """(splits, columns a split) for S splits asked of K: whole tiles and a multiple of 16 words a split
    (so word offsets stay 16-byte aligned), and no empty split."""
    cpw = _cpw(cpw) if isinstance(cpw, str) else cpw
    unit = math.lcm(cfg.block_k, 16 * cpw)
    k_split = -(-(-(-K // S)) // unit) * unit  # ceil(K / S) rounded up to the unit
    return -(-K // k_split), k_split


def _gemm(a: torch.Tensor, w, rows, block_expert, used, nblocks: int, A: int, a_div: int, split: int,
          cfg: DecodeConfig, inter: int | None = None, gated: bool = False) -> torch.Tensor:
    """Partials [S, A, N] fp32 of a (rows by token or by assignment) times bank side w^T, split over K.
    With `inter`: GEMM 1 (`gated`) reads the first `inter` gate and up rows (N = 2 inter), GEMM 2 the first
    `inter` columns of each row (K = inter)."""
    _, N, K = w.shape
    half, up = N, N
    if inter is not None and gated:
        half, up, N = inter, N // 2, 2 * inter
    elif inter is not None:
        K = inter
    args = _args(w, a.device)
    cpw = args["CPW"]
    S, k_split = _split(cfg, cfg.splits(split, nblocks, N, K), K, cpw)
    p = torch.empty(S, A, N, dtype=torch.float32, device=a.device)
    grid = (nblocks, triton.cdiv(N, cfg.block_n), S)
    _decode_gemm[grid](a, p_ptr=p, rows_ptr=rows, block_expert_ptr=block_expert, used_ptr=used, N=N, HALF=half, UP=up, A=A,
                       a_div=a_div, split_w=k_split // cpw, K_W=K // cpw, stride_am=a.stride(0), stride_ps=p.stride(0),
                       BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT=cfg.dot,
                       NF4_SELECT=cfg.nf4_select, EVEN_K=K % cfg.block_k == 0, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, **args)
    return p


def _reduce(p: torch.Tensor, N: int, dtype, scale, ids, E: int, gated: bool, skip: bool) -> torch.Tensor:
    S, A, _ = p.shape
    out = torch.empty(A, N, dtype=dtype, device=p.device)
    BLOCK = 1024
    _decode_reduce[(A, triton.cdiv(N, BLOCK))](p, out, scale, ids, N, S, p.stride(0), E, GATED=gated,
                                               SCALE=not gated, SKIP=skip, BLOCK=BLOCK)
    return out


def taken_by_format(fmt: str | None, T: int) -> bool:
    """A bank of kernel format `fmt` at T tokens takes the decode kernel's by-format tiles (`BY_FORMAT_MAX_TOKENS`;
    fp8 counted whether or not this GPU converts e4m3: a plan's upper estimate)."""
    if fmt not in BY_FORMAT_MAX_TOKENS:
        return False
    bound = BY_FORMAT_MAX_TOKENS[fmt]
    return bound is None or T <= bound


def decode_bytes(A: int, E: int, hidden: int, inter: int, cfg: DecodeConfig, elt: int = 2) -> int:
    """Device bytes `decode_rows` holds at its peak for A assignments over a bank of E experts (beside its input):
    the fp32 partials of GEMM 1 [S1, A, 2I] beside the gated rows [A, I], then those rows beside GEMM 2's partials
    [S2, A, H] and the output [A, H]. A captured step keeps them in its graph pool (`offload/memory.py`
    `graph_step_floor`). Auto splits are bounded by the most row blocks A assignments can fill."""
    blocks = min(A, -(-A // cfg.block_m) + E)
    s1 = cfg.splits(cfg.split_k13, blocks, 2 * inter, hidden)
    s2 = cfg.splits(cfg.split_k2, blocks, hidden, inter)
    return max(4 * s1 * A * 2 * inter + elt * A * inter, elt * A * inter + 4 * s2 * A * hidden + elt * A * hidden)


def decode_rows(x: torch.Tensor, w13, w2, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                skip: bool = False, cfg: DecodeConfig | None = None, inter: int | None = None) -> torch.Tensor:
    """`fused_moe.expert_rows` for decode batches: [A, H] in x's dtype, row t * k + j for token t's j-th
    expert (ids equal to E skipped with `skip`, their rows 0; with `inter` only the first `inter` columns
    of the intermediate). Device ops only, no host sync: graph-safe."""
    cfg = cfg or DecodeConfig()
    T, k = topk_ids.shape
    E, two_i, H = w13.shape
    I = two_i // 2 if inter is None else inter
    A = T * k
    BM = cfg.block_m
    rows, block_expert, used, _ = align(topk_ids, E + skip, BM)
    if skip:  # the skip expert's blocks come last: stop before them
        used = (block_expert < E).sum().reshape(1) * BM
        block_expert = block_expert.clamp(max=E - 1)
    nblocks = min(rows.numel() // BM, A)  # every block in use holds at least one assignment
    x = x.contiguous()
    scale = topk_weights.flatten().float().contiguous()  # [A]
    ids = topk_ids.flatten().contiguous()  # [A]
    p1 = _gemm(x, w13, rows, block_expert, used, nblocks, A, k, cfg.split_k13, cfg, inter, gated=True)  # [S1, A, 2I]
    h = _reduce(p1, I, x.dtype, scale, ids, E, gated=True, skip=skip)  # [A, I]
    del p1  # GEMM 2's partials may take its memory (`decode_bytes` counts the two apart)
    p2 = _gemm(h, w2, rows, block_expert, used, nblocks, A, 1, cfg.split_k2, cfg, inter)  # [S2, A, H]
    return _reduce(p2, H, x.dtype, scale, ids, E, gated=False, skip=skip)  # [A, H]


def sweep_configs(fmt: str) -> list[DecodeConfig]:
    """The tile configurations `benchmarks/bench_mapped.py --sweep` times for a format (splits are swept
    there separately: they are runtime arguments and compile nothing)."""
    base = [DecodeConfig(),
            DecodeConfig(block_n=32),
            DecodeConfig(block_n=128, num_warps=8),
            DecodeConfig(block_k=256, num_warps=8),
            DecodeConfig(num_stages=2),
            DecodeConfig(num_stages=4),
            DecodeConfig(block_m=1, dot=False, block_n=64, block_k=64 if fmt == "nf4" else 128),
            DecodeConfig(block_m=1, dot=False, block_n=32, block_k=128, num_warps=4),
            DecodeConfig(block_m=2, dot=False, block_n=64, block_k=128, num_warps=8)]
    if fmt == "nf4":
        base += [replace(c, nf4_select=True) for c in (base[0], base[6], base[3], base[7])]
    return base

