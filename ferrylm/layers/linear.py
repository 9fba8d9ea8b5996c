"""Linear layers. `Linear` holds one dense weight; fused projections (qkv, gate_up) are one `Linear`
whose rows are filled shard by shard at load time, so a step does one matmul instead of three.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shards: dict[str, tuple[int, int]] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.shards = shards or {}
        """shard id -> (first row, rows) of a fused weight, e.g. {"q": (0, 576), "k": (576, 192), ...}."""

    def load(self, name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """Copy a checkpoint tensor (`name` is `weight` or `bias`) into all rows or into one shard."""
        param = getattr(self, name)
        if shard is not None:
            a, n = self.shards[shard]
            param = param.data.narrow(0, a, n)
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
        param.data.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
