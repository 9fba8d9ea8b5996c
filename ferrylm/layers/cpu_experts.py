"""One MoE expert's gated MLP computed on the host's cores, from the weights in the format they are held
in on the host (dense, or int8 / int4 packed through `layers/qmatmul.py`'s CPU kernels, or any other
packed format through `RowBlocks`), for the hybrid path's cold experts. `HostExpert` holds one expert
(gate and up fused into one [2I, H] matmul, then down [H, I]); calling it runs a batch of T tokens. Torch's kernels release the GIL, so a worker thread can
run experts while the main thread drives the GPU.

`host_expert_reference` is the plain path every format is tested against (tests/test_cpu_experts.py):
the same dequantized weights in fp32 through `layers/moe.expert_mlp`.
It knows nothing about routing, caches, placement or which thread calls it.
Shapes: T tokens, H hidden, I the expert's intermediate size.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ferrylm.layers.moe import expert_mlp
from ferrylm.layers.qmatmul import QuantKernel
from ferrylm.weights import quant as Q

FORMATS = ("bf16", "int8", "int4")


ROW_BLOCK_BYTES = 4 << 20
"""Bytes of bf16 weights `RowBlocks` decodes at a time (a few MB: the buffer stays in cache for the GEMM)."""


class RowBlocks:
    """x @ W.T for a packed weight that no CPU kernel reads (nf4, fp8, group-wise int8, odd-sized int4):
    `decode(a, c)` gives rows [a, a + c) as bf16 [c, K], a block at a time, each block multiplied by oneDNN's
    bf16 GEMM into its columns of the output; no dequantized copy of the whole weight is made. With
    `out_scale` [N] (per-channel formats) the codes decode exactly to bf16 and the fp32 scale multiplies the
    output columns instead of every weight."""

    name = "row-blocks"

    def __init__(self, shape: tuple[int, int], decode: Callable[[int, int], torch.Tensor], nbytes: int,
                 out_scale: torch.Tensor | None = None):
        self.shape, self.decode, self.nbytes, self.out_scale = tuple(shape), decode, nbytes, out_scale
        self.block = max(16, ROW_BLOCK_BYTES // (2 * shape[1]) // 16 * 16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, N] in x's dtype
        n = self.shape[0]
        xb = x.to(torch.bfloat16)
        out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        for a in range(0, n, self.block):
            c = min(self.block, n - a)
            torch.matmul(xb, self.decode(a, c).t(), out=out[:, a:a + c])
        if self.out_scale is not None:
            return out.float().mul_(self.out_scale).to(x.dtype)
        return out.to(x.dtype)


def _kernel(w, dense_dtype: torch.dtype):
    """A matmul x -> x @ w.T: a packed kernel for a QuantizedTensor, the kernel itself for one already built
    (`RowBlocks`), the GEMM of `dense_dtype` for a dense tensor (no copy when it is already of that dtype)."""
    if isinstance(w, Q.QuantizedTensor):
        return QuantKernel.for_tensor(w)
    if not isinstance(w, torch.Tensor):
        return w
    w = w.to(dense_dtype).contiguous()
    return lambda x: F.linear(x, w)


class HostExpert:
    """One expert on the host: `HostExpert(w13, w2)(x)` = w2 @ (act(gate x) * up x) for x [T, H].

    w13: [2I, H] (gate rows, then up rows) and w2: [H, I], each a dense tensor (computed in `dense_dtype`,
    bf16 by default; the activations then run in that dtype too), a `QuantizedTensor` (int8 per channel,
    int8 group-wise, int4 group-wise: kept packed, one copy) or a `RowBlocks` kernel (bf16 activations)."""

    def __init__(self, w13, w2, act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
                 dense_dtype: torch.dtype = torch.bfloat16):
        self.inter, self.hidden = w2.shape[1], w2.shape[0]
        if tuple(w13.shape) != (2 * self.inter, self.hidden):
            raise ValueError(f"w13 {tuple(w13.shape)} does not fit w2 {tuple(w2.shape)}: expected "
                             f"{(2 * self.inter, self.hidden)}")
        self.gate_up, self.down = _kernel(w13, dense_dtype), _kernel(w2, dense_dtype)
        dense = isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
        self.compute_dtype = dense_dtype if dense else torch.bfloat16
        """The activations' dtype inside (a dense fp32 expert computes exactly as `layers/moe.expert_mlp`)."""
        self.act = act
        size = dense_dtype.itemsize
        self.nbytes = sum(k.nbytes if hasattr(k, "nbytes") else size * n for k, n in
                          ((self.gate_up, w13.shape[0] * w13.shape[1]), (self.down, w2.shape[0] * w2.shape[1])))
        """Bytes of weights one call reads."""

    @staticmethod
    def quantize(w13: torch.Tensor, w2: torch.Tensor, fmt: str, group_size: int = 32,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> "HostExpert":
        """From dense weights in `fmt` (bf16 | int8 per channel | int4 group-wise with a min)."""
        if fmt == "bf16":
            return HostExpert(w13, w2, act)
        if fmt == "int8":
            return HostExpert(Q.quantize_int8(w13), Q.quantize_int8(w2), act)
        if fmt == "int4":
            return HostExpert(Q.quantize_int4(w13, group_size, "min"), Q.quantize_int4(w2, group_size, "min"), act)
        raise ValueError(f"unknown host expert format {fmt!r}; choose one of {', '.join(FORMATS)}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H], in x's dtype; computed with `compute_dtype` activations
        xb = x.to(self.compute_dtype)
        h = self.gate_up(xb)  # [T, 2I]
        gate, up = h[:, :self.inter], h[:, self.inter:]  # [T, I] views
        mid = self.act(gate).mul_(up)  # [T, I], a fresh contiguous tensor
        return self.down(mid).to(x.dtype)


def host_expert_reference(x: torch.Tensor, w13: torch.Tensor | Q.QuantizedTensor,
                          w2: torch.Tensor | Q.QuantizedTensor,
                          act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """The plain path: the weights dequantized to fp32, `layers/moe.expert_mlp` in fp32. x: [T, H] -> [T, H] fp32."""
    def dense(w):
        return w.dequantize(torch.float32) if isinstance(w, Q.QuantizedTensor) else w.float()
    return expert_mlp(x.float(), dense(w13), dense(w2), act)
