"""Quantized matmul: `x @ W.T` computed on a `QuantizedTensor` where it lies, by the fastest kernel that
serves its scheme on its device. The kernel's own layout is derived once (`QuantKernel.for_tensor`, at
load) and cached beside the device-agnostic `QuantizedTensor`, never rebuilt per forward.

Kernels, by scheme, on CPU (each checked against `Dequantize` over a sweep of shapes in
tests/test_qmatmul.py):
- `Int4PackCPU`: int4 (Q4_0 / Q4_1 and re-quantized int4), torch's `_weight_int4pack_mm_for_cpu` with bf16
  activations. That kernel dequantizes as (q - 8) * scale + zero, so Q4_0 is (d, 0) and Q4_1 (d, m + 8d);
  scale and zero are rounded to bf16 (the activations' dtype; the kernel is ~100x slower on fp32 ones).
- `Int8PackCPU`: per-channel int8, torch's `_weight_int8pack_mm`, bf16 activations.
- `DenseBF16`: group-wise int8 (Q8_0: a tied embedding used as the LM head): dequantized once to a bf16
  weight for oneDNN's bf16 GEMM. No torch kernel takes group-wise int8 scales; this reads 2 bytes a weight
  instead of 1.06 (TODO: a Q8_0 GEMV of our own would halve the LM head's reads).
- `Dequantize`: everything else (nf4, fp8, any device without a kernel): dequantize, then `F.linear`.
  The plain reference path.
Activations come and go in the caller's dtype; the kernel casts at its edge. T tokens, K in, N out.
This module knows nothing about modules, checkpoints or where the tensor came from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrylm.weights.quant import QuantizedTensor, unpack_nibbles


class QuantKernel:
    """Computes x [T, K] -> [T, N] against one quantized weight."""

    name = "dequantize"

    def __init__(self, qt: QuantizedTensor):
        self.qt = qt

    @staticmethod
    def for_tensor(qt: QuantizedTensor, reference: bool = False) -> "QuantKernel":
        """The fastest kernel that serves `qt` where it lies (`reference`: the plain path)."""
        if not reference and qt.device.type == "cpu" and len(qt.shape) == 2:
            n, _ = qt.shape
            if qt.scheme == "int4" and n % 16 == 0:
                return Int4PackCPU(qt)
            if qt.scheme == "int8" and "group_size" not in qt.params:
                return Int8PackCPU(qt)
            if qt.scheme == "int8":
                return DenseBF16(qt)
        return Dequantize(qt)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads per call (its own copy of the weight)."""
        return self.qt.nbytes


class Dequantize(QuantKernel):
    name = "dequantize"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.qt.dequantize(x.dtype))


class Int4PackCPU(QuantKernel):
    name = "int4pack"

    def __init__(self, qt: QuantizedTensor):
        super().__init__(qt)
        n, k = qt.shape
        self.group_size = qt.params["group_size"]
        codes = unpack_nibbles(qt.parts["q"]).to(torch.int32)  # [N, K]
        self.packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)  # [N, K/2] uint8, kernel layout
        d = qt.parts["scale"].float()  # [N, G]
        zero = qt.parts["min"].float() + 8 * d if qt.params["zero"] == "min" else torch.zeros_like(d)
        self.scale_zero = torch.stack((d, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [G, N, 2]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, self.group_size, self.scale_zero)
        return out.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zero.nbytes


class Int8PackCPU(QuantKernel):
    name = "int8pack"

    def __init__(self, qt: QuantizedTensor):
        super().__init__(qt)
        self.scale = qt.parts["scale"].to(torch.bfloat16)  # [N]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qt.parts["q"], self.scale).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.qt.parts["q"].nbytes + self.scale.nbytes


class DenseBF16(QuantKernel):
    name = "dense-bf16"

    def __init__(self, qt: QuantizedTensor):
        super().__init__(qt)
        self.weight = qt.dequantize(torch.bfloat16)  # [N, K]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes
