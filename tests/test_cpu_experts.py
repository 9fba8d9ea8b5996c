"""The host expert kernel (`layers/cpu_experts.HostExpert`) against its plain fp32 reference, per format
and token count, on expert-like shapes (scaled down so the test stays fast).

Tolerance: the fast path runs bf16 activations through two matmuls and the activation, so each output
carries a few bf16 roundings (relative step 2^-8) of sums of |terms|: we bound the error elementwise by
2^-6 * (|mid| @ |w2|^T) + 2^-6 * |ref| + 1e-5, where mid is the reference's intermediate. The weights are
the same quantized values on both sides, so quantization error is not in the comparison.
"""

import threading

import pytest
import torch
import torch.nn.functional as F

from ferrylm.layers.cpu_experts import HostExpert, host_expert_reference
from ferrylm.weights import quant as Q

SHAPES = [(256, 128), (128, 384)]  # (H, I): a Mixtral-like I > H and a Qwen3-MoE-like I < H


def _weights(h, i, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * i, h, generator=g) * 0.05, torch.randn(h, i, generator=g) * 0.05


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_host_expert_matches_reference(fmt, shape):
    h, i = shape
    w13, w2 = _weights(h, i, hash((fmt, shape)) % 2**31)
    expert = HostExpert.quantize(w13, w2, fmt)
    if fmt == "bf16":  # the fast path computes on the bf16 weights: so does the reference
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    else:
        w13, w2 = expert.gate_up.tensor(), expert.down.tensor()
    worst_err = 0.0
    for t in (1, 4, 16, 33):
        x = torch.randn(t, h)
        out = expert(x)
        ref = host_expert_reference(x, w13, w2)
        assert out.shape == (t, h) and out.dtype == x.dtype
        dense13 = w13.dequantize(torch.float32) if isinstance(w13, Q.QuantizedTensor) else w13.float()
        dense2 = w2.dequantize(torch.float32) if isinstance(w2, Q.QuantizedTensor) else w2.float()
        g, u = (x @ dense13.t()).chunk(2, dim=-1)
        mid = (F.silu(g) * u).abs()
        bound = 2 ** -6 * mid @ dense2.abs().t() + 2 ** -6 * ref.abs() + 1e-5
        err = (out - ref).abs()
        assert (err <= bound).all(), f"{fmt} {shape} T={t}: max err {err.max():.3e}, worst excess {(err - bound).max():.3e}"
        worst_err = max(worst_err, err.max().item())
    print(f"{fmt} {shape}: max |fast - reference| {worst_err:.3e} over T = 1, 4, 16, 33")


def test_packed_experts_hold_fewer_bytes():
    w13, w2 = _weights(256, 128, 0)
    sizes = {f: HostExpert.quantize(w13, w2, f).nbytes for f in ("bf16", "int8", "int4")}
    assert sizes["int4"] < sizes["int8"] < sizes["bf16"] == 2 * (w13.numel() + w2.numel())


def test_runs_on_worker_threads():
    """Two threads computing experts at once give what each gives alone (no shared scratch state)."""
    experts = [HostExpert.quantize(*_weights(256, 128, s), "int4") for s in (1, 2)]
    x = torch.randn(4, 256)
    alone = [e(x) for e in experts]
    got = [None, None]

    def run(j):
        got[j] = experts[j](x)
    threads = [threading.Thread(target=run, args=(j,)) for j in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(torch.equal(a, b) for a, b in zip(alone, got))


def test_bad_shapes_and_formats_are_named():
    w13, w2 = _weights(256, 128, 0)
    with pytest.raises(ValueError, match="does not fit"):
        HostExpert(w13[:100], w2)
    with pytest.raises(ValueError, match="unknown host expert format"):
        HostExpert.quantize(w13, w2, "fp4")
