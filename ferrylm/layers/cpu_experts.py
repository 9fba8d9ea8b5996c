"""One MoE expert's gated MLP computed on the host's cores, from the weights in the format they are held
in on the host (bf16 dense, or int8 / int4 packed through `layers/qmatmul.py`'s CPU kernels), for the
hybrid path's cold experts. `HostExpert` holds one expert (gate and up fused into one [2I, H] matmul, then
down [H, I]); calling it runs a batch of T tokens. Torch's kernels release the GIL, so a worker thread can
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


def _kernel(w: torch.Tensor | Q.QuantizedTensor):
    """A matmul x -> x @ w.T: a packed kernel for a QuantizedTensor, oneDNN's bf16 GEMM for a dense one."""
    if isinstance(w, Q.QuantizedTensor):
        return QuantKernel.for_tensor(w)
    w = w.to(torch.bfloat16).contiguous()
    return lambda x: F.linear(x, w)


class HostExpert:
    """One expert on the host: `HostExpert(w13, w2)(x)` = w2 @ (act(gate x) * up x) for x [T, H].

    w13: [2I, H] (gate rows, then up rows) and w2: [H, I], each a dense tensor (computed in bf16) or a
    `QuantizedTensor` (int8 per channel, int8 group-wise, int4 group-wise: kept packed, one copy)."""

    def __init__(self, w13: torch.Tensor | Q.QuantizedTensor, w2: torch.Tensor | Q.QuantizedTensor,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        self.inter, self.hidden = w2.shape[1], w2.shape[0]
        if tuple(w13.shape) != (2 * self.inter, self.hidden):
            raise ValueError(f"w13 {tuple(w13.shape)} does not fit w2 {tuple(w2.shape)}: expected "
                             f"{(2 * self.inter, self.hidden)}")
        self.gate_up, self.down = _kernel(w13), _kernel(w2)
        self.act = act
        self.nbytes = sum(k.nbytes if isinstance(k, QuantKernel) else 2 * n for k, n in
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
        # x: [T, H] -> [T, H], in x's dtype; computed with bf16 activations
        xb = x.to(torch.bfloat16)
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
