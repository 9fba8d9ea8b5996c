"""Quantized matmul kernels against the plain path (`dequantize()` then `F.linear` in fp32), over a sweep of
shapes and token counts; the packed `Linear` (fused shards) and the quantized embedding / LM heads against
their dense equivalents.

Tolerance: the CPU kernels take bf16 activations and bf16 scales and return bf16, so each product carries
at most ~3 bf16 roundings: |out - ref| <= 2^-7 * (|x| @ |W|^T) + 1e-6 elementwise.
"""

import pytest
import torch
import torch.nn.functional as F

from ferrylm.layers.embedding import LMHead, TiedLMHead, VocabEmbedding, refine_top
from ferrylm.layers.linear import Linear
from ferrylm.layers.qmatmul import Fp8NativeCPU, QuantKernel
from ferrylm.weights import quant as Q

FORMATS = {
    "q4_0": lambda w: Q.quantize_int4(w, 32, "sym"),
    "q4_1": lambda w: Q.quantize_int4(w, 32, "min"),
    "int4-g128": lambda w: Q.quantize_int4(w, 128, "min"),
    "q8_0": lambda w: Q.quantize_int8(w, 32),
    "int8": lambda w: Q.quantize_int8(w),
    "nf4": lambda w: Q.quantize_nf4(w, 64),
    "fp8": lambda w: Q.quantize_fp8(w),
    "fp8-g64": lambda w: Q.quantize_fp8(w, 64),  # block-wise FP8 checkpoints load as row groups
}
EXPECTED_KERNEL = {"q4_0": "int4pack", "q4_1": "int4pack", "int4-g128": "int4pack", "q8_0": "int8group",
                   "int8": "int8pack", "nf4": "dequantize", "fp8": "fp8-native", "fp8-g64": "fp8-native"}
if not Fp8NativeCPU.usable(Q.quantize_fp8(torch.ones(32, 64))):  # no AVX512-BF16 kernels here: the plain path
    EXPECTED_KERNEL.update({"fp8": "dequantize", "fp8-g64": "dequantize"})
SHAPES = [(64, 128), (960, 576), (576, 1536), (48, 256)]
SKIP = {("int4-g128", (960, 576))}  # 576 is no multiple of 128


def _check(out, x, w):
    ref = F.linear(x.float(), w)
    bound = 2 ** -7 * F.linear(x.abs().float(), w.abs()) + 1e-6
    worst = ((out.float() - ref).abs() - bound).max().item()
    return (out.float() - ref).abs().max().item(), worst


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_dequantize_then_matmul(fmt, shape):
    if (fmt, shape) in SKIP:
        pytest.skip("row length no multiple of the group")
    torch.manual_seed(hash((fmt, shape)) % 2**31)
    n, k = shape
    qt = FORMATS[fmt](torch.randn(n, k) * 0.05)
    kern = QuantKernel.for_tensor(qt)
    assert kern.name == EXPECTED_KERNEL[fmt]
    w = qt.dequantize(torch.float32)
    for t, dtype in ((1, torch.float32), (2, torch.bfloat16), (7, torch.float32), (16, torch.bfloat16),
                     (64, torch.float32), (130, torch.bfloat16)):
        x = torch.randn(t, k).to(dtype)
        out = kern(x)
        assert out.shape == (t, n) and out.dtype == dtype
        err, worst = _check(out, x, w)
        assert worst <= 0, f"{fmt} {shape} T={t} {dtype}: max err {err:.3e} exceeds the bf16 bound by {worst:.3e}"
    print(f"{fmt} {shape} kernel={kern.name}: max |err| {err:.3e} (T=130)")


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "int4-g128", "q8_0", "int8"])
def test_kernel_gives_the_exact_weight_back(fmt):
    """A kernel holds the only copy: `tensor()`, `rows()` and `dequantize()` equal the loaded weight's."""
    torch.manual_seed(3)
    qt = FORMATS[fmt](torch.randn(192, 256) * 0.05)
    kern = QuantKernel.for_tensor(qt)
    back = kern.tensor()
    assert back.scheme == qt.scheme and back.params == qt.params and tuple(back.shape) == tuple(qt.shape)
    for p, v in qt.parts.items():
        assert torch.equal(back.parts[p], v), p
    idx = torch.tensor([191, 0, 64, 63, 100, 0])
    rows = kern.rows(idx)
    assert torch.equal(rows.dequantize(), qt.dequantize()[idx])
    assert torch.equal(kern.dequantize(torch.bfloat16), qt.dequantize(torch.bfloat16))
    if fmt.startswith("q4") or fmt.startswith("int4"):
        assert "q" not in kern.qt.parts  # the codes live only in the kernel's packed layout
        assert kern.nbytes < qt.nbytes + kern.packed.nbytes
    print(f"{fmt}: kernel {kern.name} holds {kern.nbytes} bytes for a {qt.nbytes}-byte weight")


def test_q8_0_chunked_path_over_many_chunks(monkeypatch):
    """Above GROUPED_MAX_T tokens the Q8_0 kernel dequantizes row chunks (here 100 rows, a 60-row tail)."""
    from ferrylm.layers import qmatmul

    monkeypatch.setattr(qmatmul, "DEQUANT_CHUNK", 100)
    torch.manual_seed(4)
    qt = FORMATS["q8_0"](torch.randn(960, 576) * 0.05)
    kern = QuantKernel.for_tensor(qt)
    x = torch.randn(9, 576)
    want = F.linear(x.bfloat16(), qt.dequantize(torch.bfloat16)).float()  # what a held bf16 copy gave
    assert torch.equal(kern(x), want)
    _, worst = _check(kern(x[:2]), x[:2], qt.dequantize(torch.float32))  # the grouped path
    assert worst <= 0


def test_int4_dense_path_over_row_chunks(monkeypatch):
    """From DENSE_FROM_T tokens the int4 kernel dequantizes row chunks (here 128 rows, a 64-row tail) for the
    bf16 GEMM: within the bf16 bound of the plain path, and the unchunked dense product to within one bf16
    rounding of the output (oneDNN may block K differently for a chunk's rows than for the whole weight: on an
    AVX512 host 5 of 124,800 outputs came out one bf16 ulp apart)."""
    from ferrylm.layers import qmatmul

    monkeypatch.setattr(qmatmul, "DENSE_FROM_T", 128)  # opt-in (off by default)
    torch.manual_seed(5)
    qt = FORMATS["q4_1"](torch.randn(960, 576) * 0.05)
    kern = QuantKernel.for_tensor(qt)
    x = torch.randn(130, 576)
    whole = kern(x)
    monkeypatch.setattr(qmatmul, "DEQUANT_CHUNK", 128)
    chunked = kern(x)
    _, worst = _check(chunked, x, qt.dequantize(torch.float32))
    assert worst <= 0
    torch.testing.assert_close(chunked, whole, rtol=2 ** -7, atol=1e-5)  # one bf16 ulp


def test_reference_kernel_is_the_plain_path():
    qt = FORMATS["q4_1"](torch.randn(64, 64))
    x = torch.randn(3, 64)
    ref = QuantKernel.for_tensor(qt, reference=True)
    assert ref.name == "dequantize"
    assert torch.equal(ref(x), F.linear(x, qt.dequantize(torch.float32)))


def test_rows_not_a_multiple_of_16_fall_back():
    qt = FORMATS["q4_0"](torch.randn(40, 64))
    assert QuantKernel.for_tensor(qt).name == "dequantize"


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "nf4"])
def test_packed_fused_linear_equals_dense(fmt):
    """qkv from three packed shards: one kernel over the concatenated rows (row-wise formats), same output
    as the dense Linear filled with the dequantized shards."""
    torch.manual_seed(0)
    shards = {"q": (0, 64), "k": (64, 32), "v": (96, 32)}
    pieces = {s: FORMATS[fmt](torch.randn(n, 128) * 0.05) for s, (_, n) in shards.items()}
    with torch.device("meta"):  # the loader builds on meta; the pieces carry the device
        packed = Linear(128, 128, shards=shards)
    dense = Linear(128, 128, shards=shards)
    for s, qt in pieces.items():
        packed.load("weight", qt, shard=s)
        dense.load("weight", qt.dequantize(torch.float32), shard=s)
    packed.finish_load()
    dense.finish_load()
    assert packed.packed_shards == ["q", "k", "v"] and packed.weight.numel() == 0 and not packed.qweight
    assert len(packed.kernels) == (3 if fmt == "nf4" else 1)
    x = torch.randn(5, 128)
    _, worst = _check(packed(x), x, dense.weight.data)
    assert worst <= 0


def test_quantized_embedding_and_tied_head():
    torch.manual_seed(0)
    V, H = 512, 64
    qt = FORMATS["q8_0"](torch.randn(V, H))
    with torch.device("meta"):
        emb = VocabEmbedding(V, H)
    dense = VocabEmbedding(V, H)
    emb.load("weight", qt)
    dense.load("weight", qt.dequantize(torch.float32))
    emb.finish_load()
    ids = torch.tensor([3, 511, 0, 3])
    assert torch.equal(emb(ids), dense(ids))  # lookups decode the gathered rows exactly
    head, dense_head = TiedLMHead(emb), TiedLMHead(dense)
    assert not list(head.parameters())  # the table is listed once, under the embedding
    h = torch.randn(4, H)
    got, want = head(h), dense_head(h)
    assert got.dtype == torch.float32
    top = want.topk(8, dim=-1).indices
    # the highest logits are recomputed in fp32: equal to the dense head's up to summation order
    torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    _, worst = _check(got, h, dense.weight.data)
    assert worst <= 0


def test_refine_top_replaces_only_the_top_logits():
    torch.manual_seed(1)
    qt = FORMATS["q4_1"](torch.randn(256, 32))
    h = torch.randn(2, 32)
    exact = F.linear(h, qt.dequantize(torch.float32))
    rough = exact.bfloat16().float()
    out = refine_top(rough.clone(), h, qt)
    top = rough.topk(64, dim=-1).indices
    torch.testing.assert_close(out.gather(-1, top), exact.gather(-1, top), rtol=1e-6, atol=1e-6)
    mask = torch.ones_like(out, dtype=torch.bool).scatter_(-1, top, False)
    assert torch.equal(out[mask], rough[mask])


def test_untied_lm_head_packed_matches_dense():
    torch.manual_seed(2)
    qt = FORMATS["q4_0"](torch.randn(320, 64))
    head, dense = LMHead(64, 320), LMHead(64, 320)
    head.load("weight", qt)
    dense.load("weight", qt.dequantize(torch.float32))
    head.finish_load()
    h = torch.randn(3, 64)
    assert torch.equal(head(h).argmax(-1), dense(h).argmax(-1))


@pytest.mark.parametrize("block,pairs", [(32, "halves"), (64, "halves"), (16, "adjacent")])
def test_int4_layouts_round_trip_and_read_back(block, pairs):
    """`Int4Layout` for each layout torch uses by CPU capability (AVX2 32-row blocks and AVX512 64, rows s | s + b/2
    in a byte; the plain build's adjacent rows 2s | 2s + 1, through the gather path): store -> layout -> store is
    exact in place, and the codes and any rows read back from the laid bytes are the original codes. This build's
    own layout is learnt and checked against torch's conversion in tests/test_cpu_experts.py."""
    from ferrylm.layers.qmatmul import Int4Layout
    from ferrylm.weights.quant import pack_nibbles

    h = block // 2
    lo, hi = (torch.arange(h), torch.arange(h, block)) if pairs == "halves" else (torch.arange(0, block, 2),
                                                                                  torch.arange(1, block, 2))
    layout = Int4Layout(block, lo, hi)
    assert layout.halves == (pairs == "halves")
    g = torch.Generator().manual_seed(block)
    n, k = 4 * block, 48
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    q = pack_nibbles(codes)
    laid = layout.to_cpu_(q.clone(), chunk=2 * block)
    assert not torch.equal(laid, q)
    # byte s of column c in block b holds row lo[s] low, hi[s] high: the definition, checked directly
    byte = laid.view(-1, k, h)[1, 5]
    assert torch.equal(byte & 0xF, codes[block + lo, 5]) and torch.equal(byte >> 4, codes[block + hi, 5])
    assert torch.equal(layout.codes(laid, k, block, 2 * block), codes[block:3 * block])
    idx = torch.tensor([0, block - 1, block + 3, n - 1, 7])
    assert torch.equal(layout.rows(laid, k, idx), codes[idx])
    assert torch.equal(layout.from_cpu_(laid, chunk=3 * block), q)
