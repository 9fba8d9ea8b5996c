"""Packed Linear weights on the GPU path (`layers/packed_linear.py`): the Triton kernel (decode shapes) and the
dense-chunk path (prefill shapes) against the plain `Dequantize` path on the same packed weight, per format.

Runs on CUDA, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` set before Python starts, in fp32:
the interpreter has no bf16); skipped otherwise (CI has no Triton)."""

import pytest
import torch

from helpers import triton_device  # noqa: E402

CUDA = triton_device()

from ferrylm.layers import packed_linear  # noqa: E402
from ferrylm.layers.qmatmul import Dequantize, QuantKernel  # noqa: E402
from ferrylm.weights import quant  # noqa: E402
from test_fused_moe_formats import DEV, DT, FORMATS as BANK_FORMATS  # noqa: E402  (the kernels' formats, one list)

FORMATS = {**BANK_FORMATS, "nf4-g64-dq": lambda t: quant.quantize_nf4(t, 64, double_quant=True)}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("T,kernel", [(1, "tile"), (5, "tile"), (1, "splitk"), (5, "splitk"), (40, "tile")])
def test_packed_linear_equals_the_dequantize_path(fmt, T, kernel, monkeypatch):
    monkeypatch.setattr(packed_linear, "DECODE_KERNEL", kernel)
    monkeypatch.setattr(packed_linear, "CHUNK_BYTES", 64 * 256 * 2)  # prefill: several chunks of 64 rows
    g = torch.Generator().manual_seed(T)
    N, K = 200, 256  # N not a multiple of the tiles: the edge masks
    qt = FORMATS[fmt](torch.randn(N, K, generator=g) * 0.05).to(DEV)
    x = torch.randn(T, K, generator=g).to(DEV, DT)
    assert packed_linear.usable(qt, torch.device(DEV))
    # a CUDA engine picks it; on the CPU (the interpreter) the engine keeps its CPU kernels, so build it here
    k = QuantKernel.for_tensor(qt, compute=torch.device(DEV)) if CUDA else packed_linear.PackedTriton(qt)
    assert isinstance(k, packed_linear.PackedTriton)
    got, ref = k(x), Dequantize(qt)(x)
    assert got.shape == (T, N) and got.dtype == DT
    diff = (got.float() - ref.float()).abs().max().item()
    print(f"{fmt} T={T} {kernel}: max |diff| {diff:.2e}")
    assert diff <= (2e-2 if DT == torch.bfloat16 else 1e-4) * ref.float().abs().max().item() + 1e-5


def test_packed_linear_reads_its_parts_where_they_are_now():
    """A layer streamer re-points the parts (`Linear.packed_parts`): the kernel must read the new ones."""
    qt = quant.quantize_nf4(torch.randn(128, 128) * 0.05, 64).to(DEV)
    other = quant.quantize_nf4(torch.randn(128, 128) * 0.05, 64).to(DEV)
    k = packed_linear.PackedTriton(qt)
    x = torch.randn(3, 128).to(DEV, DT)
    before = k(x)
    for name in qt.parts:
        qt.parts[name] = other.parts[name]
    after = k(x)
    assert not torch.allclose(before, after)
    assert (after.float() - Dequantize(other)(x).float()).abs().max().item() < 1e-2 * after.float().abs().max().item() + 1e-5


def test_off_switch_keeps_the_plain_path(monkeypatch):
    monkeypatch.setattr(packed_linear, "ENABLED", False)
    qt = quant.quantize_nf4(torch.randn(64, 128) * 0.05, 64).to(DEV)
    assert not packed_linear.usable(qt, torch.device(DEV))
    if CUDA:
        assert isinstance(QuantKernel.for_tensor(qt, compute=torch.device(DEV)), Dequantize)
