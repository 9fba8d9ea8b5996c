"""RMSNorm, computed in fp32 like the HF reference so logits match exactly (on CUDA in one Triton launch,
`layers/fused_ops.rms_norm`; this plain form is the reference and the CPU path)."""

import torch
from torch import nn

from ferrylm.layers import fused_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ops.usable(x):
            return fused_ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its norm): one launch on CUDA (`fused_ops.rms_norm` with the residual), the same bits
        as the two steps."""
        if fused_ops.usable(x) and x.shape == residual.shape and x.dtype == residual.dtype:
            return fused_ops.rms_norm(x, self.weight, self.eps, residual)
        s = x + residual
        return s, self(s)
