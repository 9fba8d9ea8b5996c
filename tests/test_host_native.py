"""The native host GEMV kernels (`layers/host_native.py`) against torch in fp32, and the host expert paths that use
them ("native" in `layers/cpu_experts`) against their plain paths. Skipped where the kernels cannot be built
(no AVX-512F, no C compiler): the reason is printed."""

import os
import time

import pytest
import torch

from ferrylm.layers import cpu_experts as C
from ferrylm.layers import host_native as hn
from ferrylm.weights import quant as Q

pytestmark = pytest.mark.skipif(not hn.available(), reason=f"native host kernels: {hn.why_unavailable()}")


def _close(got, ref, x, w):
    # fp32 sums of K products in another order: within a few ulps of the sum of magnitudes; a bf16 result
    # also within its own rounding (2^-8 of each value)
    mag = x.float().abs() @ w.float().abs().t()
    bound = 1e-5 * mag + (2 ** -8 * ref.abs() if got.dtype == torch.bfloat16 else 0)
    err = (got.float() - ref).abs()
    assert (err <= bound).all(), (err.max().item(), bound.max().item())
    return err.max().item()


def _counting(monkeypatch, name):
    """Count the calls of host_native's `name` (the path under test really runs natively)."""
    calls, real = [], getattr(hn, name)
    monkeypatch.setattr(hn, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("T", [1, 2, 3, 7, 16])
def test_bf16_gemv_equals_torch(T):
    torch.manual_seed(T)
    N, K = 203, 320  # row blocks of 8, 4, 2 leave tails
    w = torch.randn(N, 2 * K).to(torch.bfloat16)[:, K // 2:K // 2 + K]  # a strided column window, as a split reads
    x = torch.randn(T, K, dtype=torch.bfloat16)
    out = torch.full((T, N + 8), float("nan"))[:, 4:4 + N]  # a strided output view
    hn.gemv_bf16(x.float().contiguous(), w, out)
    err = _close(out, x.float() @ w.float().t(), x, w)
    print(f"native bf16 GEMV T={T}: max |diff| vs torch fp32 {err:.2e}")


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,K", [(1, 512), (2, 512), (5, 512), (11, 1536), (16, 512)])
def test_nf4_gemv_equals_torch(T, K, bf16):
    """Both kernels (fp32 activations; AVX512-BF16 dot products where the CPU has them), odd N, K in several L1
    chunks (T = 11: 512 columns a chunk), and more than 8 tokens (passes of 8)."""
    if bf16 and not hn.nf4_bf16():
        pytest.skip("no AVX512-BF16 NF4 kernel on this CPU")
    torch.manual_seed(10 + T)
    N, g = 99, 64
    qt = Q.quantize_nf4(torch.randn(N, K) * .05, g)
    q, absmax = qt.parts["q"].view(N, K // 2), qt.parts["absmax"].view(N, K // g).float()
    w = qt.dequantize(torch.float32)
    if bf16:  # the bf16 kernel's weights: each level rounded to bf16, times its group's fp32 absmax
        codes = torch.stack([q & 0xF, q >> 4], dim=-1).view(N, K).long()
        w = Q.NF4_LEVELS.to(torch.bfloat16).float()[codes] * absmax.repeat_interleave(g, dim=1)
        assert (w - qt.dequantize(torch.float32)).abs().max() <= 2 ** -8 * absmax.max()
    x = torch.randn(T, K, dtype=torch.bfloat16)
    out = torch.empty(T, N)
    hn.gemv_nf4(hn.nf4_x(x, bf16=bf16), q, absmax, g, Q.NF4_LEVELS.float(), out)
    err = _close(out, x.float() @ w.t(), x, w)
    # a window of columns [128, K) (whole groups) reads the same codes: the host's share of a split expert
    c = 128
    out2 = torch.empty(T, N)
    hn.gemv_nf4(hn.nf4_x(x[:, c:], bf16=bf16), q[:, c // 2:], absmax[:, c // g:], g, Q.NF4_LEVELS.float(), out2)
    _close(out2, x[:, c:].float() @ w[:, c:].t(), x[:, c:], w[:, c:])
    print(f"native NF4 GEMV T={T}: max |diff| vs torch fp32 {err:.2e}")


@pytest.mark.skipif(not hn.nf4_bf16(), reason="no AVX512-BF16 kernels on this CPU")
def test_bf16_dot_gemv_equals_torch():
    """The one-token bf16-x kernel (`vdpbf16ps`): a column window with a K tail past its 128-wide steps, odd N."""
    torch.manual_seed(5)
    N, K = 77, 32 * 13
    w = torch.randn(N, 2 * K).to(torch.bfloat16)[:, 64:64 + K]
    x = torch.randn(1, K, dtype=torch.bfloat16)
    out = torch.full((1, N + 3), float("nan"))[:, 1:1 + N]
    hn.gemv_bf16_bx(x, w, out)
    err = _close(out, x.float() @ w.float().t(), x, w)
    print(f"native bf16 GEMV, bf16 x: max |diff| vs torch fp32 {err:.2e}")
    with pytest.raises(ValueError, match="bf16 x"):
        hn.gemv_bf16_bx(torch.zeros(hn.MAX_TOKENS + 1, K, dtype=torch.bfloat16), w, torch.empty(hn.MAX_TOKENS + 1, N))
    with pytest.raises(ValueError, match="bf16 x"):  # out of the wrong shape
        hn.gemv_bf16_bx(torch.zeros(2, K, dtype=torch.bfloat16), w, torch.empty(1, N))


@pytest.mark.skipif(not hn.nf4_bf16(), reason="no AVX512-BF16 kernels on this CPU")
@pytest.mark.parametrize("T", [2, 3, 4, 5, 8, 9, 16])
def test_bf16_dot_gemv_tokens_equals_torch(T):
    """The bf16-x GEMV at 2..16 tokens: K in several L1 chunks (at 16 tokens 1024 columns a chunk) with a tail past
    the S-wide steps, a column window, odd N, a strided output; every prefetch distance the same bits; the C pool's
    threads and chunks the one-threaded call's bits."""
    torch.manual_seed(T)
    N, K = 77, 32 * 71
    w = torch.randn(N, K + 96).to(torch.bfloat16)[:, 32:32 + K]
    x = torch.randn(T, K, dtype=torch.bfloat16)
    out = torch.full((T, N + 3), float("nan"))[:, 1:1 + N]
    hn.gemv_bf16_bx(x, w, out)
    err = _close(out, x.float() @ w.float().t(), x, w)
    print(f"native bf16 GEMV, bf16 x, {T} tokens: max |diff| vs torch fp32 {err:.2e}")
    for pf in (1, 2, 100):
        assert torch.equal(hn.gemv_bf16_bx(x, w, torch.empty(T, N), pf), out)
    for threads, chunk in ((2, 16), (3, 7), (2, 10_000)):
        assert torch.equal(hn.gemv_bf16_bx_mt(x, w, torch.full((T, N), float("nan")), threads, chunk, 2), out)


@pytest.mark.skipif(not hn.nf4_bf16(), reason="no AVX512-BF16 kernels on this CPU")
@pytest.mark.parametrize("T", [1, 3, 16])
def test_native_expert_equals_gemvs_and_torch_silu(T):
    """The whole SiLU expert in one call (`expert_silu_bf16`) against the same GEMVs one by one with torch's bf16 SiLU
    and product between (the fused call's own expf may differ from torch's in the last bit of a rare element: each
    mismatch within one bf16 rounding), on one thread and on the pool's; bf16 and fp32 outputs; bad shapes refused."""
    torch.manual_seed(20 + T)
    H, I = 96, 32 * 9  # a few h columns a chunk and a tail past EXPERT_SUB rows
    x = torch.randn(T, H, dtype=torch.bfloat16)
    w13, w2 = (torch.randn(2 * I, H) * .1).bfloat16(), (torch.randn(H, I) * .1).bfloat16()
    g = hn.gemv_bf16_bx(x, w13, torch.empty(T, 2 * I)).bfloat16()
    mid = torch.nn.functional.silu(g[:, :I]).mul_(g[:, I:])
    ref = hn.gemv_bf16_bx(mid, w2, torch.empty(T, H))
    one = hn.expert_silu_bf16(x, w13, w2, torch.empty(T, H), (1, I), (1, H))
    err = (one - ref).abs()
    assert (err <= 2 ** -7 * ref.abs().max()).all() and (err == 0).float().mean() > 0.99, err.max().item()
    print(f"native SiLU expert, {T} tokens: {(err > 0).sum().item()} of {err.numel()} outputs differ from the "
          f"GEMVs with torch's SiLU, max |diff| {err.max().item():.2e}")
    for split13, split2 in (((2, 32), (2, 16)), ((3, 64), (2, 40))):
        assert torch.equal(hn.expert_silu_bf16(x, w13, w2, torch.full((T, H), float("nan")), split13, split2, 0, 2),
                           one)
    assert torch.equal(hn.expert_silu_bf16(x, w13, w2, torch.empty(T, H, dtype=torch.bfloat16), (2, 32), (2, 16)),
                       one.bfloat16())
    with pytest.raises(ValueError, match="native expert"):
        hn.expert_silu_bf16(x, w2, w13, torch.empty(T, H), (1, I), (1, H))
    with pytest.raises(ValueError, match="refused"):
        hn.expert_silu_bf16(x, w13, w2, torch.empty(T, H), (0, I), (1, H))


@pytest.mark.skipif(not hn.nf4_bf16(), reason="no AVX512-BF16 kernels on this CPU")
@pytest.mark.parametrize("cols", [0, 64])
def test_native_experts_in_one_call_equal_one_by_one(cols):
    """Several experts of a bank in one call (`experts_silu_bf16`: one pass of the pool over all their h columns, one
    over all their w2 rows) give each expert the bits of its own `expert_silu_bf16` call: 1, 3 and 16 tokens side by
    side (AMX for those above one where the CPU has it), chunks that span two experts, on one thread and several,
    bf16 and fp32 outputs, the hybrid split's column window; mismatched shapes refused."""
    torch.manual_seed(30 + cols)
    E, H, I = 6, 96, 32 * 9
    w13 = (torch.randn(E, 2 * I, H) * .1).bfloat16()
    w2 = (torch.randn(E, H, I) * .1).bfloat16()
    ids, Ts = [4, 0, 5, 2], [3, 1, 16, 1]
    xs = [torch.randn(T, H, dtype=torch.bfloat16) for T in Ts]
    amx = [hn.amx() and T > 1 for T in Ts]
    for dtype in (torch.float32, torch.bfloat16):
        one = [hn.expert_silu_bf16(x, w13[e], w2[e], torch.empty(x.shape[0], H, dtype=dtype), (1, I), (1, H),
                                   amx=a, cols=cols) for x, e, a in zip(xs, ids, amx)]
        for split13, split2 in (((1, I), (1, H)), ((3, 40), (2, 56)), ((4, 32), (3, 96))):
            outs = [torch.full((x.shape[0], H), float("nan"), dtype=dtype) for x in xs]
            got = hn.experts_silu_bf16(xs, [w13[e] for e in ids], [w2[e] for e in ids], outs, split13, split2, 0, 2,
                                       amx=amx, cols=cols)
            assert all(torch.equal(g, o) for g, o in zip(got, one)), (dtype, split13, split2)
    with pytest.raises(ValueError, match="native experts"):
        hn.experts_silu_bf16(xs[:2], [w13[0], w13[1][:, :64]], [w2[0], w2[1]],
                             [torch.empty(T, H) for T in Ts[:2]], (1, I), (1, H))
    with pytest.raises(ValueError, match="native experts"):
        hn.experts_silu_bf16(xs, [w13[e] for e in ids], [w2[e] for e in ids], [torch.empty(1, H)] * 4, (1, I), (1, H))


@pytest.mark.skipif(not hn.nf4_bf16(), reason="no AVX512-BF16 kernels on this CPU")
@pytest.mark.parametrize("T", [1, 5])
def test_host_expert_fused_equals_unfused_and_plain(T, monkeypatch):
    """`HostExpert` under "native" runs one fused call (`native_fused_expert`) where it did two GEMVs and torch's
    ops: the same outputs, and within bf16 rounding of the plain oneDNN expert."""
    torch.manual_seed(T)
    H, I = 128, 320
    w13, w2 = (torch.randn(2 * I, H) * .1).bfloat16(), (torch.randn(H, I) * .1).bfloat16()
    e = C.HostExpert(w13, w2)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    plain = e(x)
    monkeypatch.setattr(C, "dense_gemm", "native")
    calls = _counting(monkeypatch, "expert_silu_bf16")
    fused = e(x)
    assert len(calls) == 1 and fused.dtype == x.dtype and fused.shape == x.shape
    monkeypatch.setattr(C, "native_fused_expert", False)
    unfused = e(x)
    assert len(calls) == 1
    diff = (fused.float() - unfused.float()).abs()
    assert (diff <= 2 ** -7 * unfused.float().abs().max()).all() and (diff == 0).float().mean() > 0.99
    assert (fused.float() - plain.float()).abs().max() <= 2 ** -6 * plain.float().abs().max()


@pytest.mark.skipif(not hn.amx(), reason="no AMX on this CPU (or the OS does not grant it)")
@pytest.mark.parametrize("T", [2, 3, 8, 16, 17, 33, 40, 64])
def test_amx_gemv_equals_torch_and_thread_split(T):
    """The AMX kernel at 2-64 tokens (above 16 in blocks of 16): within fp32 rounding of the K-long dot of the exact
    products, rows in pairs of tiles, one tile and a tail of fewer than 16 (N = 77), the same bits on any thread split
    (a row's tile products summed in order of K whichever rows share its tile), one token passed to the AVX512-BF16
    GEMV; more than 64 tokens (16 without tiles) refused."""
    torch.manual_seed(40 + T)
    N, K = 77, 1024
    x = torch.randn(T, K, dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    one = hn.gemv_bf16_bx_mt(x, w, torch.empty(T, N), 1, N, amx=True)
    _close(one, x.float() @ w.float().t(), x, w)
    for threads, chunk in ((2, 16), (3, 7), (4, 32)):
        assert torch.equal(hn.gemv_bf16_bx_mt(x, w, torch.full((T, N), float("nan")), threads, chunk, amx=True), one)
    x1 = x[:1].contiguous()
    assert torch.equal(hn.gemv_bf16_bx_mt(x1, w, torch.empty(1, N), 2, 16, amx=True),
                       hn.gemv_bf16_bx(x1, w, torch.empty(1, N)))
    if T > hn.MAX_TOKENS:
        with pytest.raises(ValueError, match="T <= 16"):
            hn.gemv_bf16_bx_mt(x, w, torch.empty(T, N), 2, 16)
    with pytest.raises(ValueError, match="T <= 64"):
        hn.gemv_bf16_bx_mt(torch.zeros(65, K, dtype=torch.bfloat16), w, torch.empty(65, N), 2, 16, amx=True)


@pytest.mark.skipif(not hn.amx(), reason="no AMX on this CPU (or the OS does not grant it)")
@pytest.mark.parametrize("T", [2, 5, 16, 33])
def test_amx_expert_equals_avx_expert_and_host_expert(T, monkeypatch):
    """The fused SiLU expert on AMX tiles (33 tokens: in blocks of 16) against the AVX512-BF16 one (the same roundings,
    sums in another order: within a bf16 rounding, nearly all equal) and against the plain oneDNN `HostExpert`;
    `HostExpert` under "native" takes the AMX kernel at more than one token (`cpu_experts.native_amx`), and above 16
    tokens only on tiles."""
    torch.manual_seed(60 + T)
    H, I = 128, 32 * 11
    x = torch.randn(T, H, dtype=torch.bfloat16)
    w13, w2 = (torch.randn(2 * I, H) * .1).bfloat16(), (torch.randn(H, I) * .1).bfloat16()
    if T <= hn.MAX_TOKENS:
        avx = hn.expert_silu_bf16(x, w13, w2, torch.empty(T, H), (2, 64), (2, 64))
    else:  # (the AVX512-BF16 kernel takes 16 tokens at a time)
        avx = torch.cat([hn.expert_silu_bf16(x[t:t + 16].contiguous(), w13, w2, torch.empty(min(16, T - t), H),
                                             (2, 64), (2, 64)) for t in range(0, T, 16)])
    amx = hn.expert_silu_bf16(x, w13, w2, torch.empty(T, H), (2, 64), (2, 64), amx=True)
    diff = (amx - avx).abs()
    assert (diff <= 2 ** -7 * avx.abs().max()).all() and (diff <= 1e-4 * avx.abs().max()).float().mean() > 0.95
    assert torch.equal(hn.expert_silu_bf16(x, w13, w2, torch.empty(T, H), (3, 32), (1, H), amx=True), amx)
    e = C.HostExpert(w13, w2)
    plain = e(x)
    monkeypatch.setattr(C, "dense_gemm", "native")
    monkeypatch.setattr(C, "dense_gemm_max_t", 64)  # (as the calibration sets it where native wins up to 64)
    got = []
    real = hn.expert_silu_bf16
    monkeypatch.setattr(hn, "expert_silu_bf16", lambda *a, **k: got.append(a[8] if len(a) > 8 else k.get("amx"))
                        or real(*a, **k))
    fused = e(x)
    assert got == [True]
    assert (fused.float() - plain.float()).abs().max() <= 2 ** -6 * plain.float().abs().max()
    monkeypatch.setattr(C, "native_amx", False)
    e(x)
    assert got == ([True, False] if T <= hn.MAX_TOKENS else [True])  # more than 16 without tiles: not fused


@pytest.mark.skipif(not hn.available(), reason="no native kernels here")
def test_amx_refused_where_absent(monkeypatch):
    """amx=True where the AMX kernel does not run is a clear error, not a silent fallback."""
    monkeypatch.setattr(hn, "_amx", False)
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="AMX"):
        hn.gemv_bf16_bx_mt(torch.zeros(2, 64, dtype=torch.bfloat16), w, torch.empty(2, 32), 1, 32, amx=True)


@pytest.mark.parametrize("pf", [0, 1, 3])
def test_bf16_gemv_prefetch_equals_torch(pf):
    """The one-token kernels (fp32 x, and bf16 x where the CPU has AVX512-BF16) at other prefetch distances compute
    the same."""
    torch.manual_seed(pf)
    N, K = 50, 256
    w = torch.randn(N, K).to(torch.bfloat16)
    x = torch.randn(1, K, dtype=torch.bfloat16)
    out = hn.gemv_bf16(x.float().contiguous(), w, torch.empty(1, N), pf)
    bx = hn.gemv_bf16_bx(x, w, torch.empty(1, N), pf) if hn.nf4_bf16() else out
    _close(out, x.float() @ w.float().t(), x, w)
    _close(bx, x.float() @ w.float().t(), x, w)
    # the read ceiling's sink: each row's pairs of bf16 summed as int32 lanes
    assert (hn.read_bf16(w, torch.empty(N)) == w.view(torch.int32).sum(dim=1, dtype=torch.int32).float()).all()


def test_native_refuses_what_it_cannot_compute():
    w = torch.zeros(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="refused"):
        hn.gemv_bf16(torch.zeros(hn.MAX_TOKENS + 1, 32), w, torch.empty(hn.MAX_TOKENS + 1, 4))
    with pytest.raises(ValueError, match="unit column stride"):
        hn.gemv_bf16(torch.zeros(1, 32), torch.zeros(32, 4, dtype=torch.bfloat16).t(), torch.empty(1, 4))


@pytest.mark.skipif(not hn.nf4_bf16(), reason="no AVX512-BF16 kernels on this CPU")
@pytest.mark.parametrize("threads,chunk", [(1, 16), (2, 16), (2, 10_000), (3, 7), (8, 32)])
def test_bf16_dot_gemv_on_c_threads_equals_one_thread(threads, chunk):
    """The one-token bf16-x GEMV and the read over the C pool's threads (`*_mt`; more threads than cores, chunks
    that do not divide the rows, one chunk for all) give the one-threaded call's bits, on a column window."""
    torch.manual_seed(threads)
    N, K = 333, 256
    w = torch.randn(N, 2 * K).to(torch.bfloat16)[:, 32:32 + K]
    x = torch.randn(1, K, dtype=torch.bfloat16)
    one = hn.gemv_bf16_bx(x, w, torch.empty(1, N))
    for _ in range(3):  # the pool's workers are reused from call to call
        assert torch.equal(hn.gemv_bf16_bx_mt(x, w, torch.full((1, N), float("nan")), threads, chunk), one)
    assert torch.equal(hn.read_bf16_mt(w, torch.full((N,), float("nan")), threads, chunk),
                       hn.read_bf16(w, torch.empty(N)))
    with pytest.raises(ValueError, match="refused"):
        hn.gemv_bf16_bx_mt(x, w, torch.empty(1, N), 0, chunk)


@pytest.mark.parametrize("c_threads", [True, False])
@pytest.mark.parametrize("pf", [0, 2])
@pytest.mark.parametrize("T", [1, 4])
def test_dense_gemm_native_equals_plain(T, pf, c_threads, monkeypatch):
    """`DenseGemm` by "native" (chunks on the pool, the C pool with `native_c_threads`, and on a single-threaded
    caller) against the plain GEMM."""
    torch.manual_seed(0)
    w = (torch.randn(1000, 256) * .05).to(torch.bfloat16)
    x = torch.randn(T, 256, dtype=torch.bfloat16)
    monkeypatch.setattr(C, "SPLIT_MIN_BYTES", 4096)
    monkeypatch.setattr(C, "dense_gemm", "native")
    monkeypatch.setattr(C, "NATIVE_PREFETCH_ROWS", pf)
    monkeypatch.setattr(C, "native_c_threads", c_threads)
    g = C.DenseGemm(w)
    assert len(g.native(2).kernels) > 2
    bx = hn.nf4_bf16()
    c_pool = bx and c_threads and torch.get_num_threads() > 1
    calls = _counting(monkeypatch, "gemv_bf16_bx_mt" if c_pool else "gemv_bf16_bx" if bx else "gemv_bf16")
    got, ref = g(x), x.float() @ w.float().t()
    if c_pool:  # one call for the whole matrix
        assert len(calls) == 1
    else:
        assert len(calls) == len(g.native(torch.get_num_threads()).kernels) if torch.get_num_threads() > 1 else calls
    assert got.dtype == x.dtype
    _close(got, ref, x, w)
    monkeypatch.setattr(C, "dense_gemm", "plain")
    plain = g(x)
    assert (got.float() - plain.float()).abs().max() <= 2 ** -7 * plain.float().abs().max()  # bf16 outputs


def test_row_blocks_native_equals_plain(monkeypatch):
    """An NF4 host expert side (`host_experts.side_kernel`) by "native" (the C pool's threads, and the Python pool's:
    the same bits) against its plain decode-then-GEMM path."""
    from ferrylm.layers.fused_moe import ExpertWeights
    from ferrylm.offload.host_experts import side_kernel

    torch.manual_seed(1)
    N, K = 640, 256
    side = ExpertWeights.stack([[Q.quantize_nf4(torch.randn(N, K) * .05, 64)] for _ in range(2)], torch.bfloat16)
    monkeypatch.setattr(C, "SPLIT_MIN_BYTES", 4096)
    kern = side_kernel(side, 1)
    assert kern.nf4 is not None
    w = side.dequantize(torch.float32)[1]
    if hn.nf4_bf16():  # the AVX512-BF16 kernel runs: its levels are rounded to bf16
        q, absmax = side.parts["q"][1].view(N, K // 2), side.parts["scale"][1].view(N, K // 64).float()
        codes = torch.stack([q & 0xF, q >> 4], dim=-1).view(N, K).long()
        w = Q.NF4_LEVELS.to(torch.bfloat16).float()[codes] * absmax.repeat_interleave(64, dim=1)
    for T in (1, 6):
        x = torch.randn(T, K, dtype=torch.bfloat16)
        monkeypatch.setattr(C, "row_blocks_gemm", "native")
        calls = _counting(monkeypatch, "gemv_nf4")
        got = kern(x)
        assert calls
        _close(got, x.float() @ w.t(), x, w)
        monkeypatch.setattr(C, "native_c_threads", False)
        assert torch.equal(kern(x), got)
        monkeypatch.setattr(C, "native_c_threads", True)
    if torch.get_num_threads() > 1:  # the C pool ran: one call for the whole side, threads > 1
        pooled = []
        real = hn.gemv_nf4
        monkeypatch.setattr(hn, "gemv_nf4", lambda *a, **kw: pooled.append(kw.get("threads", 1)) or real(*a, **kw))
        kern(x)
        assert len(pooled) == 1 and pooled[0] > 1
        plain = kern.plain(x)
        assert (got.float() - plain.float()).abs().max() <= 2 ** -6 * plain.float().abs().max()


@pytest.mark.skipif(not hn.nf4_bf16() or not hasattr(os, "fork"), reason="no AVX512-BF16 kernels, or no fork")
def test_c_thread_pool_works_in_a_forked_child():
    """A child forked after the C pool's workers started has none of them: the pool starts its own there (a
    child waiting on its parent's workers would hang)."""
    N, K = 256, 128
    w = torch.randn(N, K).to(torch.bfloat16)
    x = torch.randn(1, K, dtype=torch.bfloat16)
    want = hn.gemv_bf16_bx_mt(x, w, torch.empty(1, N), 3, 16).numpy().tobytes()  # workers started here
    out = torch.empty(1, N)
    pid = os.fork()
    if pid == 0:  # the child: no torch compute (its OpenMP state is not fork-safe), the kernel alone, its pool grown
        ok = all(hn.gemv_bf16_bx_mt(x, w, out, t, 16).numpy().tobytes() == want for t in (3, 2, 5, 3))
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, "the child's C-pool GEMV differed"
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's C-pool GEMV hung")


@pytest.mark.skipif(not hn.nf4_bf16(), reason="no AVX512-BF16 kernels on this CPU")
def test_c_thread_pool_under_concurrent_callers():
    """Three Python threads call the C-pool GEMV at once with thread counts that grow the pool between calls: every
    result has the one-threaded call's bits (one parallel call runs at a time; a worker started late takes only the
    jobs after it)."""
    import threading

    N, K = 3000, 256
    w = torch.randn(N, K).to(torch.bfloat16)
    x = torch.randn(1, K, dtype=torch.bfloat16)
    want = hn.gemv_bf16_bx(x, w, torch.empty(1, N))
    bad: list = []

    def run(seed):
        for i in range(60):
            got = hn.gemv_bf16_bx_mt(x, w, torch.empty(1, N), 1 + (i * 7 + seed) % 12, 1 + (i % 25) * 20)
            if not torch.equal(got, want):
                bad.append((seed, i))
    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a C-pool call hung"
    assert not bad


@pytest.mark.skipif(not hn.nf4_bf16(), reason="no AVX512-BF16 kernels on this CPU")
def test_fp8_gemv_reads_every_code_exactly():
    """`gemv_fp8` turns each of the 254 finite e4m3 codes into exactly its value (subnormals included); the two NaN
    codes read as +-480, as the host's `fp8_to_bf16` reads them."""
    q = torch.arange(256, dtype=torch.uint8).view(1, 256)
    vals = []
    for k0 in range(0, 256, 16):
        x = torch.zeros(16, 256, dtype=torch.bfloat16)
        x[torch.arange(16), k0 + torch.arange(16)] = 1
        vals.append(hn.gemv_fp8(x, q, torch.ones(1, 1), 256, torch.empty(16, 1))[:, 0])
    vals, ref = torch.cat(vals), Q._FP8_VALUES
    finite = ~torch.isnan(ref)
    assert torch.equal(vals[finite], ref[finite]) and vals[0x7F] == 480 and vals[0xFF] == -480


@pytest.mark.skipif(not hn.nf4_bf16(), reason="no AVX512-BF16 kernels on this CPU")
@pytest.mark.parametrize("T", [1, 2, 3, 5, 9, 16])
@pytest.mark.parametrize("group", [32, 128, None])
def test_fp8_gemv_equals_torch(T, group):
    """Per channel (None) and group-wise fp8 (block-wise FP8 checkpoints load as groups of 128): fp32 sums of exact
    products, each group's sum times its scale; the C pool's threads give the same bits."""
    torch.manual_seed(T)
    N, K = 203, 384
    w = torch.randn(N, K) * .05
    qt = Q.quantize_fp8(w, group)
    scale = qt.parts["scale"].float().view(N, -1).contiguous()
    x = torch.randn(T, K).to(torch.bfloat16)
    got = hn.gemv_fp8(x, qt.parts["q"], scale, group or K, torch.empty(T, N))
    _close(got, x.float() @ qt.dequantize(torch.float32).t(), x, qt.dequantize(torch.float32))
    assert torch.equal(hn.gemv_fp8(x, qt.parts["q"], scale, group or K, torch.empty(T, N), threads=2, chunk=7), got)
    with pytest.raises(ValueError, match="fp8 GEMV"):
        hn.gemv_fp8(x.float(), qt.parts["q"], scale, group or K, torch.empty(T, N))


@pytest.mark.parametrize("group", [None, 64])
def test_row_blocks_fp8_native_equals_plain(group, monkeypatch):
    """An fp8 host expert side (per channel, and group-wise) by "native" against its plain decode-then-GEMM path:
    the native one multiplies the exact e4m3 values and applies the scale to fp32 sums, the plain one rounds each
    weight (group-wise) or the output (per channel) to bf16, so they agree within bf16's rounding."""
    from ferrylm.layers.fused_moe import ExpertWeights
    from ferrylm.offload.host_experts import side_kernel

    torch.manual_seed(2)
    N, K = 320, 256
    side = ExpertWeights.stack([[Q.quantize_fp8(torch.randn(N, K) * .05, group)] for _ in range(2)], torch.bfloat16)
    kern = side_kernel(side, 1)
    assert kern.fp8 is not None
    for T in (1, 6):
        x = torch.randn(T, K, dtype=torch.bfloat16)
        monkeypatch.setattr(C, "row_blocks_gemm", "plain")
        plain = kern(x)
        monkeypatch.setattr(C, "row_blocks_gemm", "native")
        calls = _counting(monkeypatch, "gemv_fp8")
        got = kern(x)
        assert calls if hn.nf4_bf16() else not calls
        assert (got.float() - plain.float()).abs().max() <= 2 ** -7 * plain.float().abs().max()
        monkeypatch.setattr(C, "native_c_threads", False)
        assert torch.equal(kern(x), got)
        monkeypatch.setattr(C, "native_c_threads", True)


@pytest.mark.skipif(not hn.amx() or not hn.nf4_bf16(), reason="no AMX on this CPU (or the OS does not grant it)")
def test_row_blocks_fp8_native_avx_keeps_off_the_tiles(monkeypatch):
    """"native-avx" runs an fp8 side on the AVX512-BF16 kernel where "native" takes AMX tiles (the calibration
    races them at one token): the same products within fp32 sum order; a split row_blocks setting ("native-avx" at
    one token, "native" from two) sends each call to its own kernel."""
    from ferrylm.layers.fused_moe import ExpertWeights
    from ferrylm.offload.host_experts import side_kernel

    torch.manual_seed(5)
    N, K = 320, 256
    side = ExpertWeights.stack([[Q.quantize_fp8(torch.randn(N, K) * .05, 128)] for _ in range(2)], torch.bfloat16)
    kern = side_kernel(side, 1)
    seen = []
    real = hn.gemv_fp8

    def spy(*a, **kw):
        seen.append(kw.get("amx", False))
        return real(*a, **kw)

    monkeypatch.setattr(hn, "gemv_fp8", spy)
    for T in (1, 4):
        x = torch.randn(T, K, dtype=torch.bfloat16)
        got = {}
        for g in ("native", "native-avx"):
            monkeypatch.setattr(C, "row_blocks_gemm", g)
            seen.clear()
            got[g] = kern(x).float()
            assert seen and all(a == (g == "native") for a in seen), (g, seen)
        assert (got["native"] - got["native-avx"]).abs().max() <= 2 ** -7 * got["native"].abs().max()
    monkeypatch.setattr(C, "row_blocks_gemm", "native-avx")
    monkeypatch.setattr(C, "row_blocks_gemm_multi", "native")
    for T, tiles in ((1, False), (3, True)):
        seen.clear()
        kern(torch.randn(T, K, dtype=torch.bfloat16))
        assert seen and all(a == tiles for a in seen)


@pytest.mark.skipif(not hn.amx() or not hn.nf4_bf16(), reason="no AMX on this CPU (or the OS does not grant it)")
@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("group", [128, None])
def test_fp8_gemv_on_amx_equals_torch_and_thread_split(T, group):
    """The fp8 GEMV on AMX tiles (each group decoded into tile rows): the same products as torch within fp32 sum
    order, its bits independent of the thread split (rows 203: a 11-row tail tile), groups wider than its buffer
    refused."""
    torch.manual_seed(T)
    N, K = 203, 768
    qt = Q.quantize_fp8(torch.randn(N, K) * .05, group)
    scale = qt.parts["scale"].float().view(N, -1).contiguous()
    x = torch.randn(T, K).to(torch.bfloat16)
    w = qt.dequantize(torch.float32)
    got = hn.gemv_fp8(x, qt.parts["q"], scale, group or K, torch.empty(T, N), amx=True)
    _close(got, x.float() @ w.t(), x, w)
    assert torch.equal(hn.gemv_fp8(x, qt.parts["q"], scale, group or K, torch.empty(T, N), threads=2, chunk=48,
                                   amx=True), got)
    wide = Q.quantize_fp8(torch.randn(16, 1024), 512)
    with pytest.raises(ValueError, match="at most"):
        hn.gemv_fp8(x[:, :1].expand(T, 1024).contiguous(), wide.parts["q"], wide.parts["scale"], 512,
                    torch.empty(T, 16), amx=True)


@pytest.mark.parametrize("flags", [(), ("-DFERRY_NO_AMX",), ("-DFERRY_NO_BF16",)])
def test_every_fallback_build_compiles(flags, tmp_path):
    """Each build `_build` falls back to (a compiler without the AMX or the AVX512-BF16 targets) compiles: the
    session-24 review found the last one broken by the fp8 AMX kernel's helpers."""
    import subprocess

    src = tmp_path / "k.c"
    src.write_text(hn.SOURCE)
    r = subprocess.run([os.environ.get("CC", "cc"), *hn.FLAGS, *flags, str(src), *hn.LIBS, "-o", str(tmp_path / "k.so")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.skipif(not hn.nf4_bf16(), reason="no AVX512-BF16 kernels on this CPU")
@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("group", [128, None])
def test_fp8_expert_equals_gemvs_and_torch_silu(T, group):
    """`expert_silu_fp8` (gate, up, SiLU, down in one call) gives the bits of `gemv_fp8` twice with torch's bf16 SiLU
    and product between, on the AVX512-BF16 kernel and (where granted) on AMX tiles; fp32 out too."""
    torch.manual_seed(T)
    H, I = 256, 384
    a, b = Q.quantize_fp8(torch.randn(2 * I, H) * .05, group), Q.quantize_fp8(torch.randn(H, I) * .05, group)
    sa, sb = a.parts["scale"].float().view(2 * I, -1).contiguous(), b.parts["scale"].float().view(H, -1).contiguous()
    x = torch.randn(T, H).to(torch.bfloat16)
    for amx in (False, True) if hn.amx() else (False,):
        gu = hn.gemv_fp8(x, a.parts["q"], sa, group or H, torch.empty(T, 2 * I), amx=amx).to(torch.bfloat16)
        mid = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).contiguous()
        want = hn.gemv_fp8(mid, b.parts["q"], sb, group or I, torch.empty(T, H), amx=amx)
        for out in (torch.empty(T, H, dtype=torch.bfloat16), torch.empty(T, H)):
            got = hn.expert_silu_fp8(x, (a.parts["q"], sa, group or H), (b.parts["q"], sb, group or I), out, (2, 48),
                                     (2, 80), amx=amx)
            assert torch.equal(got, want.to(out.dtype)), (amx, out.dtype)


@pytest.mark.skipif(not hn.nf4_bf16(), reason="no AVX512-BF16 kernels on this CPU")
def test_fp8_host_expert_fused_equals_unfused(monkeypatch):
    """A host expert over fp8 banks (`HostExpert` of two `RowBlocks`) under "native" runs whole in one native call
    (`native_fused_expert`): the same bits as its two native GEMVs with torch's ops between."""
    from ferrylm.layers.fused_moe import ExpertWeights
    from ferrylm.offload.host_experts import HostExperts

    torch.manual_seed(5)
    E, H, I = 2, 256, 384
    w13 = ExpertWeights.stack([[Q.quantize_fp8(torch.randn(I, H) * .05, 128), Q.quantize_fp8(torch.randn(I, H) * .05, 128)]
                               for _ in range(E)], torch.bfloat16)
    w2 = ExpertWeights.stack([[Q.quantize_fp8(torch.randn(H, I) * .05, 128)] for _ in range(E)], torch.bfloat16)
    he = HostExperts(w13, w2, torch.nn.functional.silu)
    monkeypatch.setattr(C, "row_blocks_gemm", "native")
    for T in (1, 5):
        x = torch.randn(T, H, dtype=torch.bfloat16)
        calls = _counting(monkeypatch, "expert_silu_fp8")
        fused = he.expert(1)(x)
        assert calls
        monkeypatch.setattr(C, "native_fused_expert", False)
        assert torch.equal(he.expert(1)(x), fused)
        monkeypatch.setattr(C, "native_fused_expert", True)


@pytest.mark.skipif(not hn.nf4_bf16(), reason="no AVX512-BF16 kernels on this CPU")
@pytest.mark.parametrize("w2_group,cols", [(128, 0), (128, 128), (None, 96)])
def test_fp8_experts_in_one_call_equal_one_by_one(w2_group, cols):
    """Several fp8 experts of a bank in one call (`experts_silu_fp8`) give each expert the bits of its own
    `expert_silu_fp8` call: 1, 5 and 16 tokens side by side, on AMX tiles where the CPU has them (and not), chunks
    spanning two experts, bf16 and fp32 out, group-wise and per-channel w2, a column window; mixed groups refused."""
    from ferrylm.layers.fused_moe import ExpertWeights

    torch.manual_seed(29 + cols)
    E, H, I = 4, 256, 384
    w13 = ExpertWeights.stack([[Q.quantize_fp8(torch.randn(I, H) * .05, 128), Q.quantize_fp8(torch.randn(I, H) * .05, 128)]
                               for _ in range(E)], torch.bfloat16)
    w2 = ExpertWeights.stack([[Q.quantize_fp8(torch.randn(H, I) * .05, w2_group)] for _ in range(E)], torch.bfloat16)

    def side(bank, e):
        return bank.parts["q"][e], bank.parts["scale"][e].float().contiguous(), bank.group

    ids, Ts = [3, 0, 2], [5, 1, 16]
    xs = [torch.randn(T, H, dtype=torch.bfloat16) for T in Ts]
    for amx in ([False] * 3, [hn.amx()] * 3, [hn.amx(), False, hn.amx()]):
        for dtype in (torch.float32, torch.bfloat16):
            one = [hn.expert_silu_fp8(x, side(w13, e), side(w2, e), torch.empty(x.shape[0], H, dtype=dtype), (1, 64),
                                      (1, 64), amx=a, cols=cols) for x, e, a in zip(xs, ids, amx)]
            for split13, split2 in (((1, I), (1, H)), ((3, 64), (2, 96)), ((4, 96), (3, 320))):
                outs = [torch.full((x.shape[0], H), float("nan"), dtype=dtype) for x in xs]
                got = hn.experts_silu_fp8(xs, [side(w13, e) for e in ids], [side(w2, e) for e in ids], outs, split13,
                                          split2, amx=amx, cols=cols)
                assert all(torch.equal(g, o) for g, o in zip(got, one)), (amx, dtype, split13, split2)
    other = ExpertWeights.stack([[Q.quantize_fp8(torch.randn(H, I) * .05, 64)]], torch.bfloat16)
    with pytest.raises(ValueError, match="native fp8 experts"):
        hn.experts_silu_fp8(xs[:2], [side(w13, 3), side(w13, 0)], [side(w2, 3), side(other, 0)],
                            [torch.empty(T, H) for T in Ts[:2]], (1, 64), (1, 64))


@pytest.mark.skipif(not hn.nf4_bf16(), reason="no AVX512-BF16 kernels on this CPU")
@pytest.mark.parametrize("w2_group", [128, None])
def test_fp8_split_window_in_one_call_equals_the_window_kernels(w2_group, monkeypatch):
    """Hybrid decode's host part of an fp8 expert (its intermediate columns [c, I)) runs in one native call
    (`HostExpert.window`, `expert_silu_fp8(cols=c)`): the same bits as the window's own kernels (gate, up and
    down `RowBlocks` over the window, torch's SiLU between), group-wise and per-channel w2, on each fp8 path here;
    a window off w2's scale groups is refused by name."""
    from ferrylm.layers.fused_moe import ExpertWeights
    from ferrylm.offload.host_experts import HostExperts

    torch.manual_seed(7)
    E, H, I = 2, 256, 384
    w13 = ExpertWeights.stack([[Q.quantize_fp8(torch.randn(I, H) * .05, 128), Q.quantize_fp8(torch.randn(I, H) * .05, 128)]
                               for _ in range(E)], torch.bfloat16)
    w2 = ExpertWeights.stack([[Q.quantize_fp8(torch.randn(H, I) * .05, w2_group)] for _ in range(E)], torch.bfloat16)
    he = HostExperts(w13, w2, torch.nn.functional.silu)
    paths = ("native", "native-avx") if hn.amx() else ("native",)
    for path in paths:
        monkeypatch.setattr(C, "row_blocks_gemm", path)
        for T, c in ((1, 128), (4, 256)):
            x = torch.randn(T, H, dtype=torch.bfloat16)
            calls = _counting(monkeypatch, "expert_silu_fp8")
            got = he._columns(1, x, c)
            assert calls and got.shape == (T, H)
            monkeypatch.setattr(C, "native_fused_expert", False)  # the window's three kernels, torch's ops between
            want = he._columns(1, x, c)
            monkeypatch.setattr(C, "native_fused_expert", True)
            assert torch.equal(got, want), (path, T, c)
    if w2_group:  # 32 columns in: off w2's scale groups, refused by name
        whole = he.expert(0)
        x = torch.randn(1, H, dtype=torch.bfloat16)
        assert not whole.window_fits(x, 32) and whole.window_fits(x, 128)
        with pytest.raises(ValueError, match="group 128"):
            hn.expert_silu_fp8(x, whole.gate_up.fp8, whole.down.fp8, torch.empty(1, H), (1, 64), (1, 64), cols=32)


@pytest.mark.skipif(not hn.nf4_bf16(), reason="no AVX512-BF16 kernels on this CPU")
@pytest.mark.parametrize("cols", [0, 128])
def test_nf4_experts_in_one_call_equal_one_by_one(cols):
    """Several NF4 experts of a bank in one call (`experts_silu_nf4`) give each expert the bits of its own
    `expert_silu_nf4` call (1, 5 and 16 tokens side by side; chunks spanning two experts; bf16 and fp32 out; a column
    window); experts of different groups refused."""
    from ferrylm.layers.fused_moe import ExpertWeights

    torch.manual_seed(19 + cols)
    E, H, I = 4, 256, 384
    w13 = ExpertWeights.stack([[Q.quantize_nf4(torch.randn(I, H) * .05, 64), Q.quantize_nf4(torch.randn(I, H) * .05, 64)]
                               for _ in range(E)], torch.bfloat16)
    w2 = ExpertWeights.stack([[Q.quantize_nf4(torch.randn(H, I) * .05, 128)] for _ in range(E)], torch.bfloat16)

    def side(bank, e):
        return bank.parts["q"][e], bank.parts["scale"][e].float().contiguous(), bank.group

    ids, Ts = [3, 0, 2], [5, 1, 16]
    xs = [hn.nf4_x(torch.randn(T, H, dtype=torch.bfloat16), 64, bf16=True) for T in Ts]
    for dtype in (torch.float32, torch.bfloat16):
        one = [hn.expert_silu_nf4(x, side(w13, e), side(w2, e), torch.empty(x.shape[0], H, dtype=dtype), (1, 64),
                                  (1, 64), cols=cols) for x, e in zip(xs, ids)]
        for split13, split2 in (((1, I), (1, H)), ((3, 64), (2, 96)), ((3, 160), (3, 320))):
            outs = [torch.full((x.shape[0], H), float("nan"), dtype=dtype) for x in xs]
            got = hn.experts_silu_nf4(xs, [side(w13, e) for e in ids], [side(w2, e) for e in ids], outs, split13,
                                      split2, cols=cols)
            assert all(torch.equal(g, o) for g, o in zip(got, one)), (dtype, split13, split2)
    other = ExpertWeights.stack([[Q.quantize_nf4(torch.randn(H, I) * .05, 64)]], torch.bfloat16)
    with pytest.raises(ValueError, match="native NF4 experts"):
        hn.experts_silu_nf4(xs[:2], [side(w13, 3), side(w13, 0)], [side(w2, 3), side(other, 0)],
                            [torch.empty(T, H) for T in Ts[:2]], (1, 64), (1, 64))


@pytest.mark.skipif(not hn.nf4_bf16(), reason="no AVX512-BF16 kernels on this CPU")
def test_nf4_host_expert_in_one_call_equals_its_three_kernels(monkeypatch):
    """A host expert over NF4 banks under "native" runs whole in one native call (`host_native.expert_silu_nf4`):
    the same bits as its two native GEMVs with torch's SiLU and product between, at 1-16 tokens, to bf16 and fp32
    outputs; and so does hybrid decode's host part, the intermediate columns [c, I) (`HostExperts._columns`); a
    window off w2's groups is refused by name."""
    from ferrylm.layers.fused_moe import ExpertWeights
    from ferrylm.offload.host_experts import HostExperts

    torch.manual_seed(9)
    E, H, I = 2, 256, 384
    w13 = ExpertWeights.stack([[Q.quantize_nf4(torch.randn(I, H) * .05, 64), Q.quantize_nf4(torch.randn(I, H) * .05, 64)]
                               for _ in range(E)], torch.bfloat16)
    # w2 in groups of 128, w13 of 64: a kernel that took one side's group for the other's fails
    w2 = ExpertWeights.stack([[Q.quantize_nf4(torch.randn(H, I) * .05, 128)] for _ in range(E)], torch.bfloat16)
    he = HostExperts(w13, w2, torch.nn.functional.silu)
    monkeypatch.setattr(C, "row_blocks_gemm", "native")
    for T in (1, 5, 16):
        x = torch.randn(T, H, dtype=torch.bfloat16)
        calls = _counting(monkeypatch, "expert_silu_nf4")
        fused = he.expert(1)(x)
        assert calls, T
        monkeypatch.setattr(C, "native_fused_expert", False)
        unfused = he.expert(1)(x)
        monkeypatch.setattr(C, "native_fused_expert", True)
        assert torch.equal(fused, unfused), T
        whole = he.expert(1)
        y32 = hn.expert_silu_nf4(hn.nf4_x(x, 64, bf16=True), whole.gate_up.nf4, whole.down.nf4, torch.empty(T, H),
                                 (2, 96), (2, 64))
        assert torch.equal(y32.to(torch.bfloat16), fused)
    for T, c in ((1, 128), (4, 256)):
        x = torch.randn(T, H, dtype=torch.bfloat16)
        calls = _counting(monkeypatch, "expert_silu_nf4")
        got = he._columns(0, x, c)
        assert calls and got.shape == (T, H)
        monkeypatch.setattr(C, "native_fused_expert", False)  # the window's three kernels, torch's ops between
        want = he._columns(0, x, c)
        monkeypatch.setattr(C, "native_fused_expert", True)
        assert torch.equal(got, want), (T, c)
    whole = he.expert(0)
    x = torch.randn(1, H, dtype=torch.bfloat16)
    assert not whole.window_fits(x, 32) and whole.window_fits(x, 128)
    assert not whole.window_fits(x, 64)  # on 64 columns but off w2's groups of 128
    with pytest.raises(ValueError, match="group 128"):
        hn.expert_silu_nf4(hn.nf4_x(x, 64, bf16=True), whole.gate_up.nf4, whole.down.nf4, torch.empty(1, H),
                           (1, 64), (1, 64), cols=64)
