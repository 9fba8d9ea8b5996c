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

import torch

from ferrylm.layers.moe import ExpertBackend

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the backend is never chosen there
    triton = None


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """-> (sorted assignment index per padded row [M_pad] (A = padding), expert of each row block
    [M_pad / BM], padded rows in use [1], padded row of each assignment [A]). Device ops only."""
    flat = topk_ids.flatten()  # [A]
    A, E = flat.numel(), num_experts
    dev = flat.device
    counts = torch.zeros(E, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # [A]
    sorted_e = flat[order]
    first = torch.cumsum(counts, 0) - counts  # first sorted index of each expert
    pos = (ends - padded)[sorted_e] + torch.arange(A, device=dev) - first[sorted_e]  # padded row of sorted i
    m_pad = (A + E * (block_m - 1) + block_m - 1) // block_m * block_m
    rows = torch.full((m_pad,), A, dtype=torch.long, device=dev)
    rows[pos] = order
    inv = torch.empty(A, dtype=torch.long, device=dev)
    inv[order] = pos
    starts = torch.arange(0, m_pad, block_m, device=dev)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=E - 1)
    return rows, block_expert, ends[-1:], inv


if triton is not None:

    @triton.jit
    def _grouped_gemm(a_ptr, w_ptr, out_ptr, rows_ptr, block_expert_ptr, used_ptr, scale_ptr,
                      N, K, A, stride_am, stride_we, stride_wn, stride_om,
                      TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr, GATED: tl.constexpr,
                      SCALE: tl.constexpr, MAPPED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
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
        if MAPPED:  # w_ptr is a table of each expert's address: a device slot or pinned host memory
            w_base = tl.load(w_ptr + e).to(tl.pointer_type(a_ptr.dtype.element_ty))
        else:
            w_base = w_ptr + e * stride_we
        w_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
        n_ok = offs_n[None, :] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
            acc = tl.dot(a, w, acc)
            if GATED:  # the up rows sit N rows below the gate rows of w13
                wu = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok, other=0.0)
                acc_up = tl.dot(a, wu, acc_up)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up
        if SCALE:
            acc = acc * tl.load(scale_ptr + assign, mask=valid, other=0.0)[:, None]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def _blocks(A: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small row blocks for decode (few rows per expert), wide for prefill."""
    if A <= 64:
        return 16, 64, 128
    if A <= 1024:
        return 32, 128, 64
    return 64, 128, 64


class WeightTable:
    """An expert bank addressed through a device table of per-expert addresses: each entry points at a
    device slot or at the expert's rows in pinned (mapped) host memory, which the kernel then reads in
    place over PCIe. `shape` is the bank's [E, N, K]; each expert's [N, K] is contiguous."""

    def __init__(self, ptrs: torch.Tensor, shape: tuple[int, int, int], dtype: torch.dtype):
        self.ptrs, self.shape, self.dtype = ptrs, tuple(shape), dtype

    @staticmethod
    def addresses(t: torch.Tensor) -> list[int]:
        """Per-expert addresses of a contiguous [E, N, K] bank (device or registered host memory)."""
        return [t.data_ptr() + e * t.stride(0) * t.element_size() for e in range(t.shape[0])]


def _weight_args(w) -> tuple:
    """(kernel pointer argument, expert stride, row stride, MAPPED) for a tensor bank or a `WeightTable`."""
    if isinstance(w, WeightTable):
        return w.ptrs, 0, w.shape[2], True
    return w, w.stride(0), w.stride(1), False


def expert_rows(x: torch.Tensor, w13, w2, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, skip: bool = False) -> torch.Tensor:
    """The weighted expert output of every assignment: [A, H] in x's dtype, row t * k + j for token t's
    j-th expert. `w13`/`w2` are device banks or `WeightTable`s (the same bits either way: only the address
    arithmetic differs). With `skip`, ids equal to E (w13.shape[0]) are skipped and their rows are 0: the
    offload cache computes the experts present on the device in rounds and adds the rows (exactly: each
    row is non-zero in one round only)."""
    T, k = topk_ids.shape
    E, two_i, H = w13.shape
    I = two_i // 2
    A = T * k
    BM, BN, BK = _blocks(A)
    rows, block_expert, used, inv = align(topk_ids, E + skip, BM)
    if skip:  # the skip expert's blocks come last: stop before them
        used = torch.searchsorted(block_expert, torch.tensor([E], device=x.device)) * BM
        block_expert = block_expert.clamp(max=E - 1)
    m_pad = rows.numel()
    x = x.contiguous()
    h = torch.empty(m_pad, I, dtype=x.dtype, device=x.device)
    y = (torch.zeros if skip else torch.empty)(m_pad, H, dtype=x.dtype, device=x.device)
    scale = topk_weights.flatten().float().contiguous()  # [A]
    p13, se13, sn13, mapped13 = _weight_args(w13)
    p2, se2, sn2, mapped2 = _weight_args(w2)
    grid1 = (m_pad // BM, triton.cdiv(I, BN))
    _grouped_gemm[grid1](x, p13, h, rows, block_expert, used, scale, I, H, A, x.stride(0), se13, sn13,
                         h.stride(0), TOP_K=k, A_BY_TOKEN=True, GATED=True, SCALE=False, MAPPED=mapped13,
                         BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK)
    grid2 = (m_pad // BM, triton.cdiv(H, BN))
    _grouped_gemm[grid2](h, p2, y, rows, block_expert, used, scale, H, I, A, h.stride(0), se2, sn2,
                         y.stride(0), TOP_K=k, A_BY_TOKEN=False, GATED=False, SCALE=True, MAPPED=mapped2,
                         BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK)
    return y[inv]


def sum_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    # rows: [T * k, H] -> [T, H], the k experts of a token added in fp32
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
        return FusedExperts.supports_tensors(bank.w13, bank.act_name)

    @staticmethod
    def supports_tensors(w13: torch.Tensor, act: str) -> bool:
        return triton is not None and w13.is_cuda and act == "silu" and w13.dtype in (torch.bfloat16, torch.float16)

    def forward(self, bank, x, topk_ids, topk_weights):
        return fused_experts(x, bank.w13, bank.w2, topk_ids, topk_weights)
