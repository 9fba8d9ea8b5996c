"""The decode-shaped fused MoE kernel (`layers/fused_moe_decode.py`: split-K, int32 word loads, per-group
scales) against the torch dequantize-then-matmul reference (`ExpertWeights.dequantize` + `TorchExperts` in
fp64) and against the plain kernel, for every packed format, M = 1, 2, 8 tokens, resident banks and tables
of per-expert addresses (the mapped layout), and the tile configurations the benchmark sweeps.

Runs on CUDA, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` set before Python starts, in
fp32: the interpreter has no bf16); skipped otherwise (CI has no Triton). Real Mixtral shapes and CUDA
graph capture are in tests/test_cuda.py."""

from dataclasses import replace

import pytest
import torch

from helpers import triton_device  # noqa: E402

CUDA = triton_device()

from ferrylm.layers import fused_moe_decode as fmd  # noqa: E402
from ferrylm.layers.fused_moe import ExpertWeights, WeightTable, expert_rows, sum_rows  # noqa: E402
from ferrylm.layers.moe import Experts, TorchExperts  # noqa: E402
from ferrylm.weights import quant  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
DT = torch.bfloat16 if CUDA else torch.float32
REL = 2e-2 if CUDA else 1e-5  # relative error vs the fp64 reference: bf16 rounding on CUDA, fp32 sums here
FORMATS = {
    "int8": lambda t: quant.quantize_int8(t),
    "int8-g32": lambda t: quant.quantize_int8(t, 32),
    "fp8": lambda t: quant.quantize_fp8(t),
    "fp8-g64": lambda t: quant.quantize_fp8(t, 64),  # block-wise FP8 checkpoints load as row groups
    "int4-g32": lambda t: quant.quantize_int4(t, 32, "sym"),
    "int4min-g64": lambda t: quant.quantize_int4(t, 64, "min"),
    "nf4-g64": lambda t: quant.quantize_nf4(t, 64),
}
E, H, I, K_TOP = 4, 128, 64, 2  # I = 64: GEMM 2's K is half a default tile (the masked path)
# the default (tl.dot, 16 rows), a GEMV-like FMA tile of one row with its own splits, FMA on 2 rows
CONFIGS = {"dot": fmd.DecodeConfig(), "fma1": fmd.DecodeConfig(block_m=1, dot=False, block_k=64, split_k13=2,
                                                                 split_k2=1),
           "fma2": fmd.DecodeConfig(block_m=2, dot=False, block_n=32, split_k13=1, split_k2=2)}


def bank(fmt: str, w13: torch.Tensor, w2: torch.Tensor):
    q = FORMATS[fmt]
    n, i = w13.shape[0], w13.shape[1] // 2
    b13 = ExpertWeights.stack([[q(w13[e, :i]), q(w13[e, i:])] for e in range(n)], DT)
    b2 = ExpertWeights.stack([[q(w2[e])] for e in range(n)], DT)
    return b13.to(DEV), b2.to(DEV)


def table(b) -> WeightTable:
    parts = {"q": b} if isinstance(b, torch.Tensor) else b.parts
    return WeightTable({k: torch.tensor(WeightTable.addresses(v), device=DEV) for k, v in parts.items()}, b)


def routing(T: int, n: int = E, k: int = K_TOP, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(T)]).to(DEV)
    return ids, torch.rand(T, k, generator=g).to(DEV)


def reference(d13, d2, x, ids, w) -> torch.Tensor:
    """The plain-torch path on the dequantized weights, in fp64: [T, H]."""
    ref_bank = Experts(d13.shape[0], d13.shape[2], d13.shape[1] // 2)
    ref_bank.w13.data, ref_bank.w2.data = d13.double(), d2.double()
    return TorchExperts().forward(ref_bank, x.double(), ids, w.double())


@pytest.fixture(scope="module")
def weights():
    torch.manual_seed(1)
    return torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05


@pytest.mark.parametrize("fmt,cfg,tokens", [(f, "dot", (1, 2, 8)) for f in FORMATS]
                         + [(f, c, (1, 2)) for f in ("int8", "nf4-g64") for c in ("fma1", "fma2")])
def test_decode_kernel_equals_dequantized_reference(fmt, cfg, tokens, weights):
    b13, b2 = bank(fmt, *weights)
    d13, d2 = b13.dequantize(DT), b2.dequantize(DT)
    c = CONFIGS[cfg]
    for T in tokens:
        x = torch.randn(T, H, device=DEV).to(DT)
        ids, w = routing(T, seed=T)
        got = expert_rows(x, b13, b2, ids, w, decode=c)
        assert torch.equal(expert_rows(x, table(b13), table(b2), ids, w, decode=c), got)  # mapped layout
        plain = expert_rows(x, b13, b2, ids, w, decode=False)
        ref = reference(d13, d2, x, ids, w)
        out = sum_rows(got, K_TOP).double()
        rel = ((out - ref).norm() / ref.norm()).item()
        worst = (got.float() - plain.float()).abs().max().item()
        print(f"decode {fmt} {cfg} T={T}: rel err vs fp64 dequantized reference {rel:.2e}, "
              f"max |diff| vs plain kernel {worst:.2e}")
        assert rel < REL
        assert worst <= 2e-2 * plain.float().abs().max().item() + 1e-6


@pytest.mark.parametrize("cfg", ["dot", "fma2"])
def test_decode_kernel_dense_and_uneven_k(cfg):
    """Dense banks, and K that is no multiple of the tile (the masked path): int8 with H = I = 96."""
    torch.manual_seed(2)
    h, i = 96, 96
    w13, w2 = torch.randn(E, 2 * i, h) * 0.05, torch.randn(E, h, i) * 0.05
    b13, b2 = bank("int8", w13, w2)
    c = CONFIGS[cfg]
    for name, (a, b) in {"int8": (b13, b2), "dense": (w13.to(DEV, DT), w2.to(DEV, DT))}.items():
        d13, d2 = (a.dequantize(DT), b.dequantize(DT)) if name == "int8" else (a, b)
        x = torch.randn(3, h, device=DEV).to(DT)
        ids, w = routing(3, seed=5)
        got = expert_rows(x, a, b, ids, w, decode=c)
        assert torch.equal(expert_rows(x, table(a), table(b), ids, w, decode=c), got)
        ref = reference(d13, d2, x, ids, w)
        rel = ((sum_rows(got, K_TOP).double() - ref).norm() / ref.norm()).item()
        print(f"decode {name} H={h} I={i} {cfg}: rel err vs fp64 reference {rel:.2e}")
        assert rel < REL


def test_splits_agree_and_skip_rows_are_zero(weights):
    """Any split of K gives the same sums (up to fp32 order); ids equal to E are skipped with zero rows,
    as the plain kernel's `skip`."""
    torch.manual_seed(4)
    h, i = 256, 128  # splits hold whole tiles and 16-word multiples (64 int8 codes): up to 4 and 2 here
    s13, s2 = bank("int8-g32", torch.randn(E, 2 * i, h) * 0.05, torch.randn(E, h, i) * 0.05)
    x = torch.randn(2, h, device=DEV).to(DT)
    ids, w = routing(2, seed=3)
    base = fmd.DecodeConfig(block_k=64, split_k13=1, split_k2=1)
    one = expert_rows(x, s13, s2, ids, w, decode=base)
    for k13, k2 in ((2, 2), (4, 1), (64, 64)):  # 64: more splits than tiles, clamped
        many = expert_rows(x, s13, s2, ids, w, decode=replace(base, split_k13=k13, split_k2=k2))
        assert (many - one).abs().max().item() <= 1e-5 * one.abs().max().item() + 1e-7
    assert fmd._split(base, 64, h, "int8") == (4, 64) and fmd._split(base, 64, 512, "nf4") == (4, 128)
    b13, b2 = bank("nf4-g64", *weights)
    x = torch.randn(2, H, device=DEV).to(DT)
    skipped = ids.clone()
    skipped[0, 1] = E
    got = expert_rows(x, b13, b2, skipped, w, skip=True, decode=fmd.DecodeConfig())
    plain = expert_rows(x, b13, b2, skipped, w, skip=True, decode=False)
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # row t * k + j = 0 * 2 + 1
    assert (got - plain).abs().max().item() <= 2e-2 * plain.abs().max().item() + 1e-6


def test_nf4_select_tree_equals_table():
    """The select tree's immediates are weights/quant.py's NF4 levels: every code reads back the same through the
    tree as through the table, bit for bit, and each the level within TF32's rounding. (On Hopper both read
    -0.6958 for -0.69619: Triton turns the FMA path's broadcast-multiply-sum into a TF32 dot, whose inputs keep 10
    mantissa bits; the CPU interpreter multiplies in fp32. `benchmarks/diag_nf4_select.py`, session 25, H100.)"""
    n = 16
    codes = torch.arange(16, dtype=torch.uint8).repeat(n * 2 * 64 // 16)  # row r, column c: code c % 16
    w = torch.zeros(1, 2 * n, 64)
    qt = quant.quantize_nf4(w[0], 64)
    qt.parts["q"] = (codes[0::2] | (codes[1::2] << 4))[: qt.parts["q"].numel()]
    b13 = ExpertWeights.stack([[qt]], DT).to(DEV)
    want = b13.dequantize(torch.float32)[0]  # [2n, 64]: the table's levels (absmax 1)
    assert set(want[:, :16].unique().tolist()) == set(quant.NF4_LEVELS.tolist())
    x = torch.eye(64, device=DEV)[:16].to(DT)  # row a picks column a: GEMM 1 reads the levels back
    ids = torch.zeros(16, 1, dtype=torch.long, device=DEV)
    got = {}
    for sel in (False, True):
        cfg = fmd.DecodeConfig(nf4_select=sel, block_m=16, dot=False, block_k=64)
        got[sel] = fmd._gemm(x, b13, *fmd.align(ids, 1, 16)[:3], 1, 16, 1, 1, cfg).sum(0)  # x @ w13^T [A, 2n]
    assert torch.equal(got[True], got[False])
    assert torch.allclose(got[False], want[:, :16].T.float(), rtol=2 ** -10, atol=0)


@pytest.mark.parametrize("fmt", ["fp8", "fp8-g64"])
def test_fp8_takes_the_decode_kernel_by_format(fmt, weights, monkeypatch):
    """fp8 banks at up to `BY_FORMAT_MAX_TOKENS["fp8"]` tokens take the decode kernel's fp8 tiles where the GPU
    converts e4m3 itself (the plain kernel's table decode was 6-12x slower there), the plain kernel elsewhere and
    above the bound; the tiles' result equals the fp64 dequantized reference, resident and through a table."""
    b13, b2 = bank(fmt, *weights)
    d13, d2 = b13.dequantize(DT), b2.dequantize(DT)
    monkeypatch.setattr(fmd, "native_fp8", lambda: False)
    assert fmd.decode_config(1, b13, b2) is None or fmd.DECODE_MAX_TOKENS > 0  # no e4m3 conversion: the table
    monkeypatch.setattr(fmd, "native_fp8", lambda: True)
    assert fmd.decode_config(1, b13, b2) == fmd.by_format_config("fp8", False, 1)
    assert not fmd.decode_config(1, b13, b2).dot and fmd.decode_config(4, b13, b2).dot
    bound = fmd.BY_FORMAT_MAX_TOKENS["fp8"]
    assert fmd.decode_config(bound, b13, b2) is not None
    assert fmd.decode_config(bound + 1, b13, b2) is None or fmd.DECODE_MAX_TOKENS > bound
    for T in (1, 4):
        x = torch.randn(T, H, device=DEV).to(DT)
        ids, w = routing(T, seed=T)
        got = expert_rows(x, b13, b2, ids, w)  # decode=None: the rule
        assert torch.equal(got, expert_rows(x, b13, b2, ids, w, decode=fmd.by_format_config("fp8", False, T)))
        assert torch.equal(expert_rows(x, table(b13), table(b2), ids, w), got)  # offloaded = resident, bit for bit
        ref = reference(d13, d2, x, ids, w)
        rel = ((sum_rows(got, K_TOP).double() - ref).norm() / ref.norm()).item()
        print(f"{fmt} T={T} by format: rel err vs fp64 dequantized reference {rel:.2e}")
        assert rel < REL
    # an offload cache's round: a slot bank of 2 experts (1 and 3) with a skip id; its rows equal the resident
    # bank's bit for bit. The K splits must not follow the bank's padded row blocks (the auto rule does): above one
    # token they are fixed (at one token rows of one pad nothing); these shapes are too small for the auto rule to
    # differ, so the config is checked too
    assert all(fmd.by_format_config("fp8", m, T).split_k13 > 0 and fmd.by_format_config("fp8", m, T).split_k2 > 0
               for m in (False, True) for T in (2, 4, 32))
    held = [1, 3]
    s13, s2 = (ExpertWeights(b.fmt, (len(held), *b.shape[1:]), b.group, *(b.parts[n][held] for n in ("q", "scale")))
               for b in (b13, b2))
    for T in (4, 8):
        x = torch.randn(T, H, device=DEV).to(DT)
        ids, w = routing(T, seed=10 + T)
        slot = torch.full((E,), len(held), dtype=torch.long, device=DEV)
        slot[held] = torch.arange(len(held), device=DEV)
        got = expert_rows(x, s13, s2, slot[ids], w, skip=True, experts=E)
        want = expert_rows(x, b13, b2, ids, w)
        on = (slot[ids] < len(held)).flatten()
        assert on.any() and torch.equal(got[on], want[on]) and not got[~on].any(), T


def test_nf4_takes_the_decode_kernel_below_the_dequant_path(weights):
    """NF4 banks take the decode kernel's by-format tiles at every batch below `dequant_rows`' rows an expert
    (`BY_FORMAT_MAX_TOKENS["nf4"]` None; until session 30 the plain kernel's in-tile decode past 32 tokens): past 32
    tokens too the rule's result equals the tiles asked for by name, bit for bit, and the same bank read through a
    table (offloaded = resident); it stays within REL of the fp64 reference; at `PACKED_DENSE_MIN_ROWS` rows an
    expert `dequant_rows` takes over."""
    from ferrylm.layers import fused_moe

    b13, b2 = bank("nf4-g64", *weights)
    d13, d2 = b13.dequantize(DT), b2.dequantize(DT)
    cfg = fmd.by_format_config("nf4", False, 1)
    dequant_from = fused_moe.PACKED_DENSE_MIN_ROWS * E // K_TOP  # tokens
    for T in (33, dequant_from - 1):
        assert fmd.decode_config(T, b13, b2) == cfg
        x = torch.randn(T, H, device=DEV).to(DT)
        ids, w = routing(T, seed=T)
        got = expert_rows(x, b13, b2, ids, w)
        assert torch.equal(got, expert_rows(x, b13, b2, ids, w, decode=cfg))
        assert torch.equal(expert_rows(x, table(b13), table(b2), ids, w), got)
        ref = reference(d13, d2, x, ids, w)
        rel = ((sum_rows(got, K_TOP).double() - ref).norm() / ref.norm()).item()
        print(f"nf4 T={T}: decode kernel by format, rel err vs fp64 dequantized reference {rel:.2e}")
        assert rel < REL
    T = dequant_from
    x = torch.randn(T, H, device=DEV).to(DT)
    ids, w = routing(T, seed=5)
    assert torch.equal(expert_rows(x, b13, b2, ids, w), fused_moe.dequant_rows(x, b13, b2, ids, w))


def test_decode_rule(monkeypatch):
    assert fmd.decode_config(1, torch.zeros(E, 2 * I, H, device=DEV, dtype=DT),
                             torch.zeros(E, H, I, device=DEV, dtype=DT)) is None or fmd.DECODE_MAX_TOKENS > 0
    monkeypatch.setattr(fmd, "DECODE_MAX_TOKENS", 16)  # the intended bound (shipped off until measured)
    w13 = torch.zeros(E, 2 * I, H, device=DEV, dtype=DT)
    w2 = torch.zeros(E, H, I, device=DEV, dtype=DT)
    assert fmd.decode_config(1, w13, w2) == fmd.DecodeConfig()
    assert fmd.decode_config(fmd.DECODE_MAX_TOKENS, w13, w2) is not None
    assert fmd.decode_config(fmd.DECODE_MAX_TOKENS + 1, w13, w2) is None  # prefill: the plain kernel
    odd = ExpertWeights("int8", (E, 2 * I, 6), 6, torch.zeros(E, 2 * I, 6, dtype=torch.int8, device=DEV),
                        torch.ones(E, 2 * I, 1, device=DEV))
    assert "32-bit words" in fmd.readable(odd, fmd.DecodeConfig())
    assert fmd.decode_config(1, odd, w2) is None
    assert "tl.dot" in fmd.readable(w13, fmd.DecodeConfig(block_m=4))
    x = torch.zeros(1, 6, device=DEV, dtype=DT)
    ids, w = routing(1)
    with pytest.raises(ValueError, match="decode kernel cannot run"):
        expert_rows(x, odd, w2, ids, w, decode=fmd.DecodeConfig())
    # auto splits: enough programs for a GEMV (2 experts, Mixtral's down projection), none for tiny ones
    c = fmd.DecodeConfig()
    assert c.splits(0, 2, 4096, 14336) >= 8 and c.splits(0, 2, 28672, 4096) >= 2
    assert c.splits(0, 4, 256, 128) == 1 and c.splits(3, 4, 256, 128) == 1
