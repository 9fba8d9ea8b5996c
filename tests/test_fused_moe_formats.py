"""The fused MoE kernel on packed expert weights (int8, fp8, int4 sym/min, nf4) against the same kernel on
the dequantized weights (`weights/quant.py`'s plain-torch dequantizers) and against the per-expert torch
reference; read directly and through a `WeightTable` of per-expert addresses.

Runs on CUDA, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` set before Python starts, in
fp32: the interpreter has no bf16); skipped otherwise (CI has no Triton)."""

import pytest
import torch

from helpers import triton_device  # noqa: E402

CUDA = triton_device()

from ferrylm.layers.fused_moe import ExpertWeights, WeightTable, expert_rows, sum_rows  # noqa: E402
from ferrylm.layers.moe import Experts, TorchExperts  # noqa: E402
from ferrylm.weights import quant  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
DT = torch.bfloat16 if CUDA else torch.float32
FORMATS = {
    "int8": lambda t: quant.quantize_int8(t),
    "int8-g32": lambda t: quant.quantize_int8(t, 32),
    "fp8": lambda t: quant.quantize_fp8(t),
    "fp8-g64": lambda t: quant.quantize_fp8(t, 64),  # block-wise FP8 checkpoints load as row groups
    "int4-g32": lambda t: quant.quantize_int4(t, 32, "sym"),
    "int4min-g64": lambda t: quant.quantize_int4(t, 64, "min"),
    "nf4-g64": lambda t: quant.quantize_nf4(t, 64),
}


def bank(fmt: str, w13: torch.Tensor, w2: torch.Tensor):
    E, two_i, _ = w13.shape
    I = two_i // 2
    q = FORMATS[fmt]
    b13 = ExpertWeights.stack([[q(w13[e, :I]), q(w13[e, I:])] for e in range(E)], DT)
    b2 = ExpertWeights.stack([[q(w2[e])] for e in range(E)], DT)
    return b13.to(DEV), b2.to(DEV)


def table(b: ExpertWeights) -> WeightTable:
    return WeightTable({k: torch.tensor(WeightTable.addresses(v), device=DEV) for k, v in b.parts.items()}, b)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_packed_experts_equal_dequantized(fmt):
    torch.manual_seed(1)
    E, H, I, k = 4, 128, 192, 2
    w13, w2 = torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05
    b13, b2 = bank(fmt, w13, w2)
    d13, d2 = b13.dequantize(DT), b2.dequantize(DT)
    assert b13.nbytes < d13.numel() * d13.element_size() * (0.6 if DT == torch.bfloat16 else 0.3)
    for T in (1, 7, 70) + ((600,) if CUDA else ()):  # decode and prefill tile shapes (600 x 2 rows: the widest)
        x = torch.randn(T, H, device=DEV).to(DT)
        ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(T)])
        w = torch.rand(T, k, device=DEV)
        want = expert_rows(x, d13, d2, ids, w, decode=False)  # the plain kernel (decode: test_fused_moe_decode.py)
        got = expert_rows(x, b13, b2, ids, w, decode=False)
        assert torch.equal(expert_rows(x, table(b13), table(b2), ids, w, decode=False), got)
        worst = (got.float() - want.float()).abs().max().item()
        ref_bank = Experts(E, H, I)
        ref_bank.w13.data, ref_bank.w2.data = d13.double(), d2.double()
        ref = TorchExperts().forward(ref_bank, x.double(), ids, w.double())
        rel = ((sum_rows(got, k).double() - ref).norm() / ref.norm()).item()
        print(f"packed {fmt} T={T}: max |diff| vs dequantized kernel {worst:.2e}, rel err vs fp64 reference {rel:.2e}")
        # the same decoded values; packed tiles are twice as wide along K, so the sums run in another order
        assert worst <= 2e-2 * want.float().abs().max().item() + 1e-6
        assert rel < (2e-2 if DT == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("tile", ["4bit", "plain"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_decoded_experts_equal_the_reference_dequantize(fmt, tile, monkeypatch):
    """`fused_moe.decode_experts` (the packed prefill's decode-once step: one launch) gives exactly
    `ExpertWeights.dequantize`'s values for the experts asked, in their order, read directly and through a
    `WeightTable`; shapes not whole tiles on either axis; two codes a byte through their own kernel
    (`DECODE_4BIT_TILE`, "4bit") and through the fused kernel's tile decode ("plain")."""
    from ferrylm.layers import fused_moe
    from ferrylm.layers.fused_moe import decode_experts

    if tile == "plain":
        monkeypatch.setattr(fused_moe, "DECODE_4BIT_TILE", None)
    elif not fmt.startswith(("int4", "nf4")):
        pytest.skip("one byte a code: the plain tile decode only")
    else:
        monkeypatch.setattr(fused_moe, "DECODE_4BIT_TILE", fused_moe.DECODE_4BIT_TILE or (32, 256))
    torch.manual_seed(3)
    E, H, I = 5, 192, 320  # K (H or I) a multiple of every group, not of the 128- or 256-column tile
    w13, w2 = torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05
    b13, b2 = bank(fmt, w13, w2)
    for b in (b13, b2):
        want = b.dequantize(DT)[[3, 0, 4]]
        for src in (b, table(b)):
            got = decode_experts(src, [3, 0, 4], DT)
            assert got.shape == want.shape and got.dtype == DT
            assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()


@pytest.mark.parametrize("tile", [(16, 512), (32, 256), (16, 64)], ids=["tile-16x512", "tile-32x256", "tile-16x64"])
@pytest.mark.parametrize("fmt", ["int4", "int4min", "nf4"])
def test_the_4bit_decode_runs_every_group_layout(fmt, tile, monkeypatch):
    """`_decode_experts_4bit` itself runs (a spy on its launch) and equals `ExpertWeights.dequantize` exactly where a
    tile holds several groups, one group, part of one (groups wider than the tile), one group a row (group >= K), and
    where K is no whole number of tiles."""
    from ferrylm.layers import fused_moe
    from ferrylm.layers.fused_moe import decode_experts

    make = {"nf4": lambda t, g: quant.quantize_nf4(t, g), "int4": lambda t, g: quant.quantize_int4(t, g, "sym"),
            "int4min": lambda t, g: quant.quantize_int4(t, g, "min")}[fmt]
    launched = []
    kernel = fused_moe._decode_experts_4bit

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(fused_moe, "DECODE_4BIT_TILE", tile)
    monkeypatch.setattr(fused_moe, "_decode_experts_4bit", Spy())
    torch.manual_seed(4)
    for group, K in ((32, 96), (64, 64), (128, 384), (256, 512), (512, 1024)):
        if group > 256 and fmt != "nf4":  # int4 groups stop at 256
            continue
        w = torch.randn(3, 24, K) * 0.05
        b = ExpertWeights.stack([[make(w[e], group)] for e in range(3)], DT).to(DEV)
        launched.clear()
        got = decode_experts(b, [2, 0], DT)
        assert launched, f"group {group}, K {K}: the 4-bit kernel did not run"
        want = b.dequantize(DT)[[2, 0]]
        assert torch.equal(got, want), (group, K, (got.float() - want.float()).abs().max().item())


@pytest.mark.parametrize("decode", [None, False], ids=["decode-kernel", "plain-kernel"])
def test_columns_of_the_intermediate_add_up(decode):
    """`expert_rows(..., inter=c)` computes each expert on its first c intermediate columns (hybrid decode's
    GPU share; the host computes the rest): the two ranges add up to the whole expert, directly and through
    a table of per-expert addresses; on the decode kernel (T <= 16) and the plain one."""
    torch.manual_seed(2)
    E, H, I, k = 4, 128, 256, 2
    w13, w2 = (torch.randn(E, 2 * I, H) * 0.05).to(DEV, DT), (torch.randn(E, H, I) * 0.05).to(DEV, DT)
    t13 = WeightTable(torch.tensor(WeightTable.addresses(w13), device=DEV), w13)
    t2 = WeightTable(torch.tensor(WeightTable.addresses(w2), device=DEV), w2)
    for T in (1, 3):
        x = torch.randn(T, H, device=DEV).to(DT)
        ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(T)])
        w = torch.rand(T, k, device=DEV)
        c = 128
        first = expert_rows(x, t13, t2, ids, w, inter=c, decode=decode)
        rest = torch.zeros_like(first)
        for a, e in enumerate(ids.flatten().tolist()):  # the host's columns, in plain torch
            xa = x[a // k].float()
            g, u = w13[e][c:I].float() @ xa, w13[e][I + c:].float() @ xa
            rest[a] = (w.flatten()[a] * (w2[e][:, c:].float() @ (torch.nn.functional.silu(g) * u))).to(DT)
        whole = expert_rows(x, w13, w2, ids, w, decode=decode)
        worst = (first.float() + rest.float() - whole.float()).abs().max().item()
        print(f"columns [0, {c}) + [{c}, {I}) vs whole, T={T}: max |diff| {worst:.2e}")
        assert worst <= (2e-2 if DT == torch.bfloat16 else 1e-5) * whole.float().abs().max().item()
        assert (first.float() - whole.float()).abs().max().item() > 1e-3  # the range is not the whole


@pytest.mark.parametrize("kernel", ["decode-kernel", "plain-kernel"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_packed_columns_of_the_intermediate_add_up(fmt, kernel):
    """Packed banks cut at `inter=c` (hybrid decode's GPU share on int8 / fp8 / int4 / nf4 experts): the GPU's
    columns [0, c) equal the plain torch expert on the dequantized weights restricted to them, and with the
    host's columns [c, I) (plain torch too) add up to the whole packed expert; read through a table of
    per-expert addresses, as the mapped cache reads them, on the decode kernel (explicit config) and the plain
    one. c = 128 and 64: multiples of every format's group along K (I) here."""
    from ferrylm.layers.fused_moe_decode import DecodeConfig

    decode = DecodeConfig() if kernel == "decode-kernel" else False
    torch.manual_seed(3)
    E, H, I, k = 4, 128, 256, 2
    b13, b2 = bank(fmt, torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05)
    d13, d2 = b13.dequantize(torch.float32), b2.dequantize(torch.float32)  # [E, 2I, H], [E, H, I]
    for T, c in ((1, 128), (3, 64)):  # c = 64: GEMM 2's last K tile partly masked on both kernels
        x = torch.randn(T, H, device=DEV).to(DT)
        ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(T)])
        w = torch.rand(T, k, device=DEV)
        first = expert_rows(x, table(b13), table(b2), ids, w, inter=c, decode=decode)  # [A, H]
        whole = expert_rows(x, table(b13), table(b2), ids, w, decode=decode)
        want_first, rest = torch.zeros(T * k, H), torch.zeros(T * k, H)
        for a, e in enumerate(ids.flatten().tolist()):  # plain torch, fp32, per column range
            xa = x[a // k].float()
            for lo, hi, out in ((0, c, want_first), (c, I, rest)):
                g, u = d13[e][lo:hi].float() @ xa, d13[e][I + lo:I + hi].float() @ xa
                out[a] = w.flatten()[a].float() * (d2[e][:, lo:hi].float() @ (torch.nn.functional.silu(g) * u))
        scale = whole.float().abs().max().item()
        tol = (2e-2 if DT == torch.bfloat16 else 1e-5) * scale
        d_first = (first.float().cpu() - want_first).abs().max().item()
        d_sum = (first.float().cpu() + rest - whole.float().cpu()).abs().max().item()
        print(f"{fmt} {kernel} T={T}: columns [0, {c}) vs torch {d_first:.2e}, [0, {c}) + [{c}, {I}) vs whole "
              f"{d_sum:.2e} (scale {scale:.2e})")
        assert d_first <= tol and d_sum <= tol
        assert (first.float() - whole.float()).abs().max().item() > 1e-2 * scale  # the range is not the whole
    if b2.fmt in ("int4", "int4min", "nf4"):  # two codes a byte: a column split between them is refused
        with pytest.raises(ValueError, match="even"):
            expert_rows(x, b13, b2, ids, w, inter=c - 1, decode=decode)


@pytest.mark.parametrize("T,k,E,bm", [(1, 2, 8, 16), (16, 2, 9, 16), (1, 8, 129, 16), (8, 8, 129, 32), (64, 2, 8, 64)])
def test_align_kernel_equals_the_plain_align(T, k, E, bm):
    """`align`'s one-launch kernel (decode sizes) gives the plain torch ops' outputs exactly: the padded rows,
    each block's expert, the rows in use and each assignment's row (ties in a stable order)."""
    from ferrylm.layers.fused_moe import align

    g = torch.Generator().manual_seed(T * E + k)
    ids = torch.randint(0, E, (T, k), generator=g).to(DEV)
    ids[0, 0] = E - 1  # the last expert (the skip id when E counts it) in use
    plain, kernel = align(ids, E, bm, kernel=False), align(ids, E, bm, kernel=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, kernel))
