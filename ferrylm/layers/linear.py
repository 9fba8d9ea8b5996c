"""Linear layers. `Linear` holds one dense weight; fused projections (qkv, gate_up) are one `Linear`
whose rows are filled shard by shard at load time, so a step does one matmul instead of three.

A `Linear` may instead hold its weight quantized (`QuantizedTensor`s from a ferry store or a GGUF file, one
per shard of a fused weight, copied to where the loader places the weight): `finish_load()` keeps that form
when the pieces cover every row (the dense weight is then released) and builds the matmul kernel for it
once (`layers/qmatmul.py`: row-wise pieces are concatenated into one kernel, so a fused projection stays
one matmul); pieces that cover only part of a fused weight are dequantized into the dense weight at load.
Once the kernels are built they hold the only copy of the weight (`qweight`, the load-time staging, is
emptied; `packed_shards` names what was kept packed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.layers.params import compute_device, device_for, placed_empty, replace, writable
from ferrylm.layers.qmatmul import QuantKernel
from ferrylm.weights.quant import QuantizedTensor


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shards: dict[str, tuple[int, int]] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.shards = shards or {}
        """shard id -> (first row, rows) of a fused weight, e.g. {"q": (0, 576), "k": (576, 192), ...}."""
        self.qweight: dict[str | None, QuantizedTensor] = {}
        """Quantized weight pieces by shard id (None: the whole weight); kept only if they cover all rows."""
        self.packed_nbytes: int | None = None
        """Bytes the weight will keep packed (noted before placement from a quantized source)."""
        self.kernels: list[QuantKernel] = []
        """Matmul kernels over `qweight` in row order (one when the pieces concatenate), built at load."""
        self.packed_shards: list[str | None] = []
        """The shard ids (None: the whole weight) held packed by `kernels`, in row order."""

    def load(self, name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """Copy a checkpoint tensor (`name` is `weight` or `bias`) into all rows or into one shard."""
        if isinstance(tensor, QuantizedTensor):
            if name == "weight":
                return self._load_quantized(tensor, shard)
            tensor = tensor.dequantize(self.bias.dtype)
        param = writable(self, name)
        if shard is not None:
            a, n = self.shards[shard]
            param = param.narrow(0, a, n)
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
        param.copy_(tensor)

    def _load_quantized(self, qt: QuantizedTensor, shard: str | None) -> None:
        rows = self.shards[shard][1] if shard is not None else self.out_features
        if tuple(qt.shape) != (rows, self.in_features):
            raise ValueError(f"shape {tuple(qt.shape)} does not fit {(rows, self.in_features)}")
        self.qweight[shard] = _placed(self, qt)  # owned memory where the weight is placed, not a view of the file

    def finish_load(self) -> None:
        """Called once every checkpoint tensor is in: quantized compute if the pieces cover all rows."""
        if not self.qweight:
            return
        whole = None in self.qweight or (self.shards and set(self.qweight) == set(self.shards))
        if whole:
            order = [None] if None in self.qweight else sorted(self.shards, key=lambda s: self.shards[s][0])
            self.qweight = {s: self.qweight[s] for s in order}  # row order, as forward concatenates them
            pieces = list(self.qweight.values())
            if len(pieces) > 1 and all(p.row_wise for p in pieces) and len({(p.scheme, str(p.params)) for p in pieces}) == 1:
                pieces = [_placed(self, QuantizedTensor.cat(pieces))]
            # on a GPU engine, pieces in host memory belong to a streamed layer: its copies land on the device,
            # so the kernel is the device's (the host's packed layouts would never see them)
            self.kernels = [QuantKernel.for_tensor(p, compute=compute_device()) for p in pieces]
            self.packed_shards, self.qweight = order, {}  # the kernels hold the weight now, once
            replace(self, "weight", torch.empty(0, dtype=self.weight.dtype, device=device_for(self, "weight")))
            return
        pieces, self.qweight = self.qweight, {}
        for shard, qt in pieces.items():
            self.load("weight", qt.dequantize(self.weight.dtype), shard)

    def packed_parts(self) -> list[tuple[QuantizedTensor, str]]:
        """(tensor, part name) of every packed part the kernels read (a layer streamer re-points them). For
        the reference kernels a streamed layer gets; a CPU kernel holds its own layout (`QuantKernel.tensor()`)."""
        return [(k.qt, name) for k in self.kernels for name in k.qt.parts]

    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as a dense [out, in] tensor (dequantized when held quantized)."""
        if not self.kernels:
            return self.weight if dtype is None else self.weight.to(dtype)
        dtype = dtype or self.weight.dtype
        pieces = [k.dequantize(dtype) for k in self.kernels]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)  # [out, in]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T without the bias (a row-parallel layer adds it once, after the sum over ranks)."""
        if self.kernels:
            return self.kernels[0](x) if len(self.kernels) == 1 else torch.cat([k(x) for k in self.kernels], dim=-1)
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            out = self.matmul(x)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


def _placed(module: nn.Module, qt: QuantizedTensor) -> QuantizedTensor:
    """A copy of `qt` whose parts lie where `module.weight` is placed (device, or the pinned host tier)."""
    parts = {}
    for k, v in qt.parts.items():
        parts[k] = placed_empty(module, "weight", v.shape, v.dtype)
        parts[k].copy_(v)
    return QuantizedTensor(qt.scheme, qt.shape, parts, dict(qt.params), qt.dtype)
