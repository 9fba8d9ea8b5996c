"""Quantization schemes against their stated bounds: INT8 / FP8 per channel, NF4 group-wise (with and
without double-quantized scales), over a sweep of shapes and dtypes; plus NF4 against a brute-force
nearest-level reference and the `QuantizedTensor` plumbing (dtype, device, copy).
"""

import pytest
import torch

from ferrylm.weights import quant as Q

SHAPES = [(64, 128), (33, 17), (1, 64), (7,), (3, 4, 5), (256, 96)]
CASES = [("int8", {}), ("fp8", {}), ("nf4", {"group_size": 64}), ("nf4", {"group_size": 128}),
         ("nf4", {"group_size": 64, "double_quant": True})]
# relative Frobenius error one should expect on Gaussian weights (a sanity ceiling, not the bound)
TYPICAL = {"int8": 0.012, "fp8": 0.035, "nf4": 0.12}


@pytest.mark.parametrize("scheme,kw", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_round_trip_within_bound(scheme, kw, shape, dtype):
    torch.manual_seed(hash((scheme, shape)) % 2**31)
    w = (torch.randn(shape) * 0.05).to(dtype)
    qt = Q.quantize(w, scheme, **kw)
    back = qt.dequantize()
    assert back.dtype == dtype and tuple(back.shape) == tuple(shape)
    err = (w.float() - qt.dequantize(torch.float32)).abs()
    bound = Q.error_bound(w, qt)
    worst = (err - bound).max().item()
    print(f"{scheme} {kw} {shape} {dtype}: max |err| {err.max():.3e}, max (err - bound) {worst:.3e}")
    assert worst <= 0, "dequantized values exceed the scheme's bound"
    if w.numel() >= 1024:
        rel = (err.norm() / w.float().norm()).item()
        assert rel < TYPICAL[scheme]


def test_outliers_and_zero_rows():
    w = torch.randn(8, 256) * 0.02
    w[0] = 0  # all-zero channel / group
    w[3, 7] = 5.0  # a large outlier
    for scheme, kw in CASES:
        qt = Q.quantize(w, scheme, **kw)
        back = qt.dequantize()
        assert torch.isfinite(back).all()
        assert back[0].abs().max() == 0
        assert ((w - back).abs() <= Q.error_bound(w, qt)).all(), scheme


def test_nf4_matches_nearest_level_reference():
    torch.manual_seed(1)
    w = torch.randn(4, 64)
    qt = Q.quantize_nf4(w, group_size=64)
    absmax = w.abs().amax(dim=1, keepdim=True)  # [4, 1]: one group per row here
    idx = ((w / absmax)[..., None] - Q.NF4_LEVELS).abs().argmin(dim=-1)  # brute force nearest level
    ref = Q.NF4_LEVELS[idx] * absmax
    assert torch.allclose(qt.dequantize(), ref, atol=1e-7)
    codes = torch.stack([qt.parts["q"] & 0xF, qt.parts["q"] >> 4], dim=-1).view(-1)  # low nibble first
    assert torch.equal(codes.long(), idx.view(-1))
    assert qt.parts["q"].numel() == w.numel() // 2  # 4 bits a value


def test_nf4_double_quant_is_smaller_and_falls_back_when_it_cannot_hold_the_scales():
    w = torch.randn(512, 512) * 0.02
    plain, dq = Q.quantize_nf4(w, 64), Q.quantize_nf4(w, 64, double_quant=True)
    assert dq.params["double_quant"] and "absmax_q" in dq.parts
    assert dq.nbytes < plain.nbytes
    w2 = w.clone()
    w2[0, 0] = 1000.0  # one group's absmax dwarfs the rest: int8 around the mean cannot represent them
    fb = Q.quantize_nf4(w2, 64, double_quant=True)
    assert fb.params["double_quant"] is False and "absmax" in fb.parts
    assert ((w2 - fb.dequantize()).abs() <= Q.error_bound(w2, fb)).all()


def test_fp8_exact_on_representable_values():
    row = torch.tensor([448.0, -448.0, 1.0, 0.5, -0.25, 0.0, 2.0 ** -9, 240.0])
    qt = Q.quantize_fp8(row[None, :])
    assert torch.equal(qt.dequantize()[0], row)


def test_int8_per_channel_scales():
    w = torch.tensor([[1.0, -0.5], [0.01, 0.02]])
    qt = Q.quantize_int8(w)
    assert torch.allclose(qt.parts["scale"], torch.tensor([1.0 / 127, 0.02 / 127]))
    assert qt.parts["q"].dtype == torch.int8


def test_quantized_tensor_to_and_dtype():
    w = torch.randn(16, 64)
    qt = Q.quantize(w, "nf4")
    moved = qt.to("cpu", copy=True)
    assert moved.parts["q"].data_ptr() != qt.parts["q"].data_ptr()
    assert torch.equal(moved.dequantize(), qt.dequantize())
    assert qt.dequantize(torch.float16).dtype == torch.float16
    assert qt.nbytes == sum(p.numel() * p.element_size() for p in qt.parts.values())
    with pytest.raises(ValueError):
        Q.quantize(w, "int3")


# -- group-wise int4 / int8 (llama.cpp's Q4_0, Q4_1, Q8_0 at group 32) -------------------------------

GROUPED = [("int4", {"group_size": 32, "zero": "sym"}), ("int4", {"group_size": 32, "zero": "min"}),
           ("int4", {"group_size": 128, "zero": "min"}), ("int8", {"group_size": 32})]


def _grouped(w, scheme, kw):
    return Q.quantize_int4(w, **kw) if scheme == "int4" else Q.quantize_int8(w, **kw)


@pytest.mark.parametrize("scheme,kw", GROUPED, ids=str)
@pytest.mark.parametrize("shape", [(64, 128), (3, 256), (130, 384)], ids=str)
def test_grouped_round_trip_within_bound(scheme, kw, shape):
    torch.manual_seed(sum(shape))
    w = torch.randn(shape) * 0.05
    gs = kw["group_size"]
    w[1, :gs] = 0  # an all-zero group
    qt = _grouped(w, scheme, kw)
    assert qt.row_wise and all(p.shape[0] == shape[0] for p in qt.parts.values())
    err = (w - qt.dequantize()).abs()
    worst = (err - Q.error_bound(w, qt)).max().item()
    print(f"{scheme} {kw} {shape}: max |err| {err.max():.3e}, max (err - bound) {worst:.3e}")
    assert worst <= 0
    assert qt.dequantize()[1, :gs].abs().max() == 0
    bits = 4 if scheme == "int4" else 8
    assert qt.parts["q"].numel() * 8 == w.numel() * bits


def test_int4_codes_follow_the_stated_formulas():
    """Hand-built codes and scales: dequantize is exactly d*(q-8) (sym) / d*q + m (min), even k low nibble."""
    codes = torch.arange(64).remainder(16).view(2, 32)  # [2, 32]: each row one group
    d = torch.tensor([[0.5], [0.25]], dtype=torch.float16)
    m = torch.tensor([[-1.0], [2.0]], dtype=torch.float16)
    packed = Q.pack_nibbles(codes)
    assert packed[0, 0] == codes[0, 0] | (codes[0, 1] << 4)
    assert torch.equal(Q.unpack_nibbles(packed), codes.to(torch.uint8))
    sym = Q.QuantizedTensor("int4", (2, 32), {"q": packed, "scale": d}, {"group_size": 32, "zero": "sym"})
    asym = Q.QuantizedTensor("int4", (2, 32), {"q": packed, "scale": d, "min": m}, {"group_size": 32, "zero": "min"})
    assert torch.equal(sym.dequantize(), (codes - 8) * d.float())
    assert torch.equal(asym.dequantize(), codes * d.float() + m.float())


def test_rows_and_cat_keep_the_packing():
    torch.manual_seed(0)
    a, b = torch.randn(6, 64), torch.randn(4, 64)
    for scheme, kw in GROUPED:
        kw = {**kw, "group_size": min(kw["group_size"], 64)}
        qa, qb = _grouped(a, scheme, kw), _grouped(b, scheme, kw)
        both = Q.QuantizedTensor.cat([qa, qb])
        assert both.shape == (10, 64)
        assert torch.equal(both.dequantize(), torch.cat([qa.dequantize(), qb.dequantize()]))
        idx = torch.tensor([9, 0, 3])
        assert torch.equal(both.rows(idx).dequantize(), both.dequantize()[idx])


@pytest.mark.parametrize("shape", [(96, 320), (33, 17), (4096,)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group_size", [64, 128])
def test_nf4_equals_bitsandbytes(shape, dtype, group_size):
    """ferrylm's NF4 is bitsandbytes' NF4 (0.50.2, `quantize_4bit(quant_type="nf4")`, no double quantization): the
    same 4-bit codes (bitsandbytes puts the first of a pair in the high nibble, ferrylm in the low), the same fp32
    absmax per group, the same 16 levels (bitsandbytes' `state.code`) and so the same dequantized weights in the
    weight's dtype (its definition: level x absmax in fp32, then the dtype). So a quality delta of NF4 (SmolLM2's
    +35% perplexity) is NF4's, not this implementation's. bitsandbytes' own CPU `dequantize_4bit` is compared too,
    where it agrees with that definition: on one AVX512 host, 0.50.2's kernel at blocksize 128 scaled 237 of the
    240 blocks of a (96, 320) weight with the wrong absmax (its own round trip then errs by up to 0.096 on weights of
    scale 0.05, ferrylm's 0.025; blocksize 64 and small tensors exact), which is its defect, reported here, not
    asserted on."""
    bnb = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(group_size)
    w = (torch.randn(shape) * 0.05).to(dtype)
    q, state = bnb.quantize_4bit(w, blocksize=group_size, quant_type="nf4")
    ours = Q.quantize_nf4(w, group_size)
    m = w.numel()
    theirs = torch.stack((q.view(-1) >> 4, q.view(-1) & 0xF), dim=-1).view(-1)[:m]  # element codes
    mine = torch.stack((ours.parts["q"] & 0xF, ours.parts["q"] >> 4), dim=-1).view(-1)[:m]  # (ours pad the last group)
    assert torch.equal(theirs, mine)
    assert torch.equal(state.absmax.float(), ours.parts["absmax"])
    assert torch.equal(state.code.float().cpu(), Q.NF4_LEVELS.float())
    absmax = state.absmax.float().repeat_interleave(group_size)[:m]
    want = (state.code.float().cpu()[theirs.long()] * absmax).to(dtype).view(shape)  # bitsandbytes' definition
    got = ours.dequantize(dtype)
    print(f"{shape} {dtype} g{group_size}: max |ferrylm - bitsandbytes' definition| "
          f"{(got.float() - want.float()).abs().max():.3g}")
    assert got.dtype == want.dtype and torch.equal(got, want)
    kernel = bnb.dequantize_4bit(q, state).view(shape)
    if torch.equal(kernel, want):
        assert torch.equal(got, kernel)
    else:
        bad = (kernel.float() - want.float()).abs().view(-1)[: m // group_size * group_size]
        print(f"  bitsandbytes' CPU dequantize_4bit disagrees with its own codes and absmax in "
              f"{int((bad.view(-1, group_size).amax(1) > 0).sum())} blocks (its defect)")
        assert group_size > 64  # seen only above blocksize 64; exact at 64 on every host so far


@pytest.mark.parametrize("shape", [(64, 128), (33, 64), (256, 96)], ids=str)
def test_fp8_group_wise_within_bound(shape):
    """fp8 with one fp32 scale per group of a row (what block-wise FP8 checkpoints load as)."""
    torch.manual_seed(3)
    w = torch.randn(shape) * 0.05
    w[1, :32] *= 1e6  # a group far larger than the rest of its row: its own scale
    qt = Q.quantize_fp8(w, 32)
    assert qt.parts["scale"].shape == (shape[0], shape[1] // 32) and qt.parts["scale"].dtype == torch.float32
    err = (w - qt.dequantize(torch.float32)).abs()
    assert (err <= Q.error_bound(w, qt)).all()
    per_channel = (w - Q.quantize_fp8(w).dequantize(torch.float32)).abs()  # the rest of row 1 falls to subnormals
    assert err[1, 32:].max() * 10 < per_channel[1, 32:].max()


def test_fp8_blocks_read_as_row_groups_exactly():
    """`from_fp8_blocks`: a [ceil(N/bn), ceil(K/bk)] block-scaled e4m3 weight as row groups of bk, the same values
    as `fp8_block_dequantize`; K no multiple of bk, or scales of another shape, give None."""
    g = torch.Generator().manual_seed(5)
    codes = (torch.randn(40, 64, generator=g) * 60).to(torch.float8_e4m3fn)
    s = torch.rand(3, 4, generator=g) + 0.01
    qt = Q.from_fp8_blocks(codes, s, (16, 16), torch.bfloat16)
    ref = codes.float() * s.repeat_interleave(16, 0)[:40].repeat_interleave(16, 1)
    assert torch.equal(qt.dequantize(torch.float32), ref)
    assert torch.equal(Q.fp8_block_dequantize(codes, s, (16, 16), torch.float32), ref)
    assert qt.dequantize().dtype == torch.bfloat16 and qt.nbytes == 40 * 64 + 40 * 4 * 4
    assert Q.from_fp8_blocks(codes[:, :40], s[:, :3], (16, 16), torch.bfloat16) is None  # 40 % 16
    assert Q.from_fp8_blocks(codes, s[:2], (16, 16), torch.bfloat16) is None


SLICEABLE = {"nf4": lambda w: Q.quantize_nf4(w, 64), "nf4-dq": lambda w: Q.quantize(w, "nf4", 64, double_quant=True),
             "int4min": lambda w: Q.quantize_int4(w, 32, "min"), "int4sym": lambda w: Q.quantize_int4(w, 32, "sym"),
             "int8": Q.quantize_int8, "int8-g32": lambda w: Q.quantize_int8(w, group_size=32), "fp8": Q.quantize_fp8}


@pytest.mark.parametrize("make", list(SLICEABLE.values()), ids=list(SLICEABLE))
def test_a_tensor_parallel_slice_stays_packed_and_exact(make):
    """`QuantizedTensor.narrow` (a tensor-parallel rank's slice of a Linear weight): rows, or columns in whole scale
    groups and code bytes, still packed, dequantizing to exactly the whole tensor's slice at a share of its bytes; a
    slice that would cut a group gives None (the loader reads it dense)."""
    torch.manual_seed(0)
    qt = make(torch.randn(96, 256))
    full = qt.dequantize(torch.float32)
    for dim, start, length in ((0, 32, 32), (0, 48, 48), (1, 128, 128), (1, 64, 64)):
        part = qt.narrow(dim, start, length)
        assert part is not None and torch.equal(part.dequantize(torch.float32), full.narrow(dim, start, length))
        assert part.nbytes < 0.6 * qt.nbytes
    grouped = "scale" not in qt.parts or qt.parts["scale"].dim() == 2
    assert (qt.narrow(1, 8, 40) is None) == grouped  # a per-channel scale covers any columns
    assert qt.narrow(1, 250, 10) is None  # past the end
