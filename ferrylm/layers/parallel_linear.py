"""Megatron-style sharded linear layers: column-parallel (output rows split: qkv, gate/up) and
row-parallel (input columns split, partial outputs summed across the TP group: o, down).

Each layer is a `Linear` of its local shape, so loading, quantized kernels and placement treat it as
any other; it adds `tp_part(attr, shard)`, the (dim, start, length) of the checkpoint tensor this rank
holds, which the loader (`models/base.py`) reads instead of the whole tensor. With a group of size 1 the
layers are exactly `Linear` (same shapes, same calls, same bits). They know nothing about processes:
the group (`parallel/group.py`) is captured when the layer is built.
Notation: Hq/Hk heads in the model, D head dim, r this rank, n ranks.
"""

from __future__ import annotations

import torch

from ferrylm.errors import ConfigError
from ferrylm.layers.linear import Linear
from ferrylm.parallel.group import TPGroup, current_group

Part = tuple[int, int, int] | None
"""(dim, start, length) of a checkpoint tensor that one rank holds; None: all of it."""


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads each rank caches: split when there are at least as many as ranks, else one, replicated
    (every rank of a KV head's share of query heads needs it)."""
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ConfigError(f"{num_kv_heads} KV heads cannot be split over tensor_parallel_size {tp}")
        return num_kv_heads // tp
    if tp % num_kv_heads:
        raise ConfigError(f"tensor_parallel_size {tp} is not a multiple of the model's {num_kv_heads} KV heads")
    return 1


class ColumnParallelLinear(Linear):
    """Output rows split evenly; each shard of a fused weight (gate, up) is split on its own, so rank r
    holds [its gate rows; its up rows] and the split in the forward stays the plain model's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shards: dict[str, tuple[int, int]] | None = None, group: TPGroup | None = None):
        g = self.tp = group or current_group()
        if not shards:
            n = g.split(out_features, "output features")
            super().__init__(in_features, n, bias)
            self.tp, self._parts = g, {None: (g.rank * n, n)}
            return
        local, parts, at = {}, {}, 0
        for name, (_, rows) in sorted(shards.items(), key=lambda kv: kv[1][0]):
            n = g.split(rows, f"{name} rows")
            local[name], parts[name], at = (at, n), (g.rank * n, n), at + n
        super().__init__(in_features, at, bias, local)
        self.tp, self._parts = g, parts

    def tp_part(self, attr: str, shard: str | None) -> Part:
        if self.tp.size == 1:
            return None
        if shard not in self._parts:  # one fused tensor in the checkpoint: its shards interleave per rank
            raise ConfigError(f"a fused checkpoint tensor cannot be sharded by rows (shards {sorted(self._parts)})")
        start, n = self._parts[shard]
        return (0, start, n)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v fused; rank r holds query heads [r Hq/n, (r+1) Hq/n) and the KV heads they attend with."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False):
        g = current_group()
        hq, hk, d = g.split(num_heads, "attention heads"), kv_heads_per_rank(num_kv_heads, g.size), head_dim
        first_kv = g.rank * hk if num_kv_heads >= g.size else g.rank * num_kv_heads // g.size
        q, kv = hq * d, hk * d
        Linear.__init__(self, hidden, q + 2 * kv, bias, {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)})
        self.tp = g
        self.num_heads, self.num_kv_heads = hq, hk
        self._parts = {"q": (g.rank * q, q), "k": (first_kv * d, kv), "v": (first_kv * d, kv)}


class RowParallelLinear(Linear):
    """Input columns split; each rank's partial product is summed over the group, then the bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group: TPGroup | None = None):
        g = group or current_group()
        n = g.split(in_features, "input features")
        super().__init__(n, out_features, bias)
        self.tp, self._start = g, g.rank * n

    def tp_part(self, attr: str, shard: str | None) -> Part:
        if self.tp.size == 1 or attr == "bias":
            return None
        return (1, self._start, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return Linear.forward(self, x)
        out = self.tp.all_reduce(self.matmul(x))  # [T, out]: the sum of every rank's columns
        return out if self.bias is None else out + self.bias


class StackedParallelLinear(Linear):
    """Several checkpoint tensors stacked by rows ([shard 0; shard 1; ...]) and split over the ranks as one
    stack: rank r holds stacked rows [r R/n, (r+1) R/n), whatever shards they fall in. For layouts read
    per head across the stack (Yuan's cat(q_proj(x), k_proj(x)) viewed as [heads, 2 D]). A shard none of
    whose rows a rank holds is not read there."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        """shards: name -> rows, in stack order."""
        g = current_group()
        n = g.split(sum(shards.values()), "stacked rows")
        lo, hi = g.rank * n, (g.rank + 1) * n
        local, parts, at, start = {}, {}, 0, 0
        for name, rows in shards.items():
            a, b = max(lo, start), min(hi, start + rows)
            if b > a:
                local[name], parts[name], at = (at, b - a), (a - start, b - a), at + b - a
            start += rows
        super().__init__(in_features, n, bias, local)
        self.tp, self._parts = g, parts

    def tp_part(self, attr: str, shard: str | None) -> Part:
        from ferrylm.layers.parallel_experts import SKIP

        if self.tp.size == 1:
            return None
        if shard not in self._parts:
            return SKIP
        return (0, *self._parts[shard])
