"""The host expert kernel (`layers/cpu_experts.HostExpert`) against its plain fp32 reference, per format
and token count, on expert-like shapes (scaled down so the test stays fast).

Tolerance: the fast path runs bf16 activations through two matmuls and the activation, so each output
carries a few bf16 roundings (relative step 2^-8) of sums of |terms|: we bound the error elementwise by
2^-6 * (|mid| @ |w2|^T) + 2^-6 * |ref| + 1e-5, where mid is the reference's intermediate. The weights are
the same quantized values on both sides, so quantization error is not in the comparison.

`offload/host_experts.HostExperts` (one layer's experts over a host bank) is checked the same way on every
bank format the engine holds (dense fp32 / bf16 / fp16, packed int8, group-wise int8, fp8, int4, int4min,
nf4), its weighted rows scaled by the routing weight (+1e-4 absolute); an fp32 bank must give exactly the
resident CPU path's bits.
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
    assert same_on_two_threads(experts, torch.randn(4, 256))


def same_on_two_threads(experts, x) -> bool:
    """Each of two experts run on its own thread at once gives what it gives alone."""
    alone = [e(x) for e in experts]
    got = [None, None]

    def run(j):
        got[j] = experts[j](x)
    threads = [threading.Thread(target=run, args=(j,)) for j in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return all(torch.equal(a, b) for a, b in zip(alone, got))


def test_bad_shapes_and_formats_are_named():
    w13, w2 = _weights(256, 128, 0)
    with pytest.raises(ValueError, match="does not fit"):
        HostExpert(w13[:100], w2)
    with pytest.raises(ValueError, match="unknown host expert format"):
        HostExpert.quantize(w13, w2, "fp4")


# -- one layer's host experts (`offload/host_experts.HostExperts`) on every bank format ----------------

BANK_FORMATS = {  # name -> quantizer of one [n, K] piece (None: a dense bank of that dtype)
    "float32": None, "bfloat16": None, "float16": None,
    "int8": lambda w: Q.quantize_int8(w), "int8-g32": lambda w: Q.quantize_int8(w, 32),
    "fp8": lambda w: Q.quantize_fp8(w), "int4": lambda w: Q.quantize_int4(w, 32, "sym"),
    "int4min": lambda w: Q.quantize_int4(w, 32, "min"), "nf4": lambda w: Q.quantize_nf4(w, 64),
}


def _bank(fmt: str, E: int, h: int, i: int):
    """A random bank in `fmt` -> (w13, w2 as the host holds them, their dequantized fp32 [E, ...] values)."""
    from ferrylm.layers.fused_moe import ExpertWeights

    g = torch.Generator().manual_seed(E * h + i)
    w13, w2 = torch.randn(E, 2 * i, h, generator=g) * 0.05, torch.randn(E, h, i, generator=g) * 0.05
    make = BANK_FORMATS[fmt]
    if make is None:
        dt = getattr(torch, fmt)
        return w13.to(dt), w2.to(dt), w13.to(dt).float(), w2.to(dt).float()
    p13 = ExpertWeights.stack([[make(w13[e, :i]), make(w13[e, i:])] for e in range(E)], torch.bfloat16)
    p2 = ExpertWeights.stack([[make(w2[e])] for e in range(E)], torch.bfloat16)
    return p13, p2, p13.dequantize(torch.float32), p2.dequantize(torch.float32)


@pytest.mark.parametrize("fmt", list(BANK_FORMATS))
def test_host_experts_every_bank_format(fmt):
    """`HostExperts.rows` against the plain reference (`host_expert_reference` on the dequantized fp32 expert,
    weighted): exact for an fp32 bank (it computes `expert_mlp` in fp32); else within the bound of the
    module docstring (bf16 / fp16 activations; the same quantized weight values on both sides, so
    quantization error is not compared). Rows of assignments marked -1 are 0, and the experts run counted."""
    from ferrylm.layers.moe import expert_mlp
    from ferrylm.offload.host_experts import HostExperts, bank_format

    E, h, i, k = 4, 128, 192, 2
    w13, w2, d13, d2 = _bank(fmt, E, h, i)
    he = HostExperts(w13, w2, F.silu)
    assert bank_format(w13) == he.format
    worst = 0.0
    for T in (1, 5):
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, h, generator=g).to(d13.dtype if fmt == "float32" else torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k]
        ids[0, 1] = -1  # the device keeps this one
        weights = torch.rand(T, k, generator=g)
        out = torch.full((T * k + 3, h), 7.0, dtype=x.dtype)
        n = he.rows(x, ids, weights, out)
        assert n == len(set(ids[ids >= 0].tolist()))
        assert (out[1] == 0).all() and (out[T * k:] == 7).all()  # a kept row is 0; rows past T * k untouched
        wf = weights.flatten()
        for e in set(ids[ids >= 0].tolist()):
            a = (ids.flatten() == e).nonzero().flatten()  # expert e's assignment rows, computed together
            xe = x[a // k]
            if fmt == "float32":  # the bits the resident CPU path computes (one GEMM over the expert's rows)
                ref = (expert_mlp(xe, w13[e], w2[e], F.silu) * wf[a][:, None]).to(out.dtype)
                assert torch.equal(out[a], ref), f"{fmt}: expert {e} differs by {(out[a] - ref).abs().max()}"
                continue
            ref = host_expert_reference(xe, d13[e], d2[e]) * wf[a][:, None]
            gt, u = (xe.float() @ d13[e].t()).chunk(2, dim=-1)
            mid = (F.silu(gt) * u).abs()
            bound = (2 ** -6 * mid @ d2[e].abs().t()) * wf[a][:, None] + 2 ** -6 * ref.abs() + 1e-4
            err = (out[a].float() - ref).abs()
            assert (err <= bound).all(), f"{fmt} T={T} expert {e}: max err {err.max():.3e}"
            worst = max(worst, err.max().item())
    print(f"host experts {fmt} ({he.expert(0).gate_up.__class__.__name__}): max |rows - reference| {worst:.3e}")


def test_host_experts_read_the_bank_in_place():
    """Packed experts are computed on views of the bank's bytes: the per-channel int8 kernel holds the bank's
    own codes, and nf4 (decoded in row blocks) holds no weight tensor of its own."""
    from ferrylm.layers.cpu_experts import RowBlocks
    from ferrylm.offload.host_experts import HostExperts

    w13, w2, _, _ = _bank("int8", 2, 128, 192)
    k = HostExperts(w13, w2, F.silu).expert(1).gate_up
    assert k.qt.parts["q"].data_ptr() == w13.parts["q"][1].data_ptr()
    w13, w2, _, _ = _bank("nf4", 2, 128, 192)
    he = HostExperts(w13, w2, F.silu)
    assert isinstance(he.expert(0).gate_up, RowBlocks) and he.expert(0).nbytes == he.expert_bytes


@pytest.mark.parametrize("zero", ["sym", "min"])
def test_row_blocks_decode_int4_rows_no_kernel_takes(zero):
    """int4 sides whose rows are no multiple of 16 (torch's int4pack wants them) decode in row blocks."""
    from ferrylm.layers.cpu_experts import RowBlocks
    from ferrylm.layers.fused_moe import ExpertWeights
    from ferrylm.offload.host_experts import side_kernel

    side = ExpertWeights.stack([[Q.quantize_int4(torch.randn(24, 64), 32, zero)] for _ in range(2)], torch.bfloat16)
    kern = side_kernel(side, 1)
    assert isinstance(kern, RowBlocks)
    x = torch.randn(3, 64)
    ref = x @ side.dequantize(torch.float32)[1].t()
    err = (kern(x) - ref).abs().max().item()
    assert err <= 2 ** -6 * (x.abs() @ side.dequantize(torch.float32)[1].abs().t()).max().item(), err


def test_fp8_codes_decode_exactly():
    """Every finite e4m3 code (subnormals, zeros of both signs) decodes by moving bits to its exact value."""
    from ferrylm.offload.host_experts import fp8_to_bf16

    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # the NaNs
    got = fp8_to_bf16(codes.view(2, -1)).float().flatten()
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


def test_host_experts_rows_on_a_worker_while_another_thread_builds():
    """The decode worker calls `rows` while a background thread prepares kernels (int4's re-layout): each
    expert is built once and the rows equal a single-threaded run's."""
    from ferrylm.offload.host_experts import HostExperts

    w13, w2, _, _ = _bank("int4min", 6, 128, 192)
    x = torch.randn(3, 128).bfloat16()
    ids = torch.tensor([[0, 5], [2, -1], [5, 3]])
    weights = torch.rand(3, 2)
    alone = torch.empty(6, 128, dtype=torch.bfloat16)
    HostExperts(w13, w2, F.silu).rows(x, ids, weights, alone)
    he = HostExperts(w13, w2, F.silu)
    built = []
    orig = he.expert

    def prepare():
        for e in range(6):
            built.append(id(orig(e)))
    outs = [torch.empty(6, 128, dtype=torch.bfloat16) for _ in range(4)]
    threads = [threading.Thread(target=prepare)] + [
        threading.Thread(target=he.rows, args=(x, ids, weights, o)) for o in outs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(torch.equal(o, alone) for o in outs)
    assert len(set(built)) == 6 and all(he.expert(e) is he.expert(e) for e in range(6))


@pytest.mark.parametrize("zero", ["sym", "min"])
def test_int4_cpu_layout_in_place_round_trip_and_kernel(zero, monkeypatch):
    """The in-place re-layout gives exactly torch's own int4pack layout (the bytes `Int4PackCPU` holds),
    back again exactly, and `Int4InPlace` over the re-laid bytes gives `Int4PackCPU`'s bits at every token
    count, through the dequantizing branch for many tokens too."""
    from ferrylm.layers import qmatmul
    from ferrylm.layers.cpu_experts import Int4InPlace, int4_from_cpu_layout_, int4_layout_matches, int4_to_cpu_layout_

    assert int4_layout_matches()
    monkeypatch.setattr(qmatmul, "DEQUANT_CHUNK", 128)  # the chunked dequantizing branch on a small weight
    g = torch.Generator().manual_seed(3)
    for n, k in ((64, 64), (4096 + 192, 96)):  # one block; more rows than a re-layout chunk
        qt = Q.quantize_int4(torch.randn(n, k, generator=g), 32, zero)
        ref = qmatmul.Int4PackCPU(qt)
        q = qt.parts["q"].clone()
        assert torch.equal(int4_to_cpu_layout_(q), ref.packed)
        kern = Int4InPlace(qt, q)
        assert kern.packed.data_ptr() == q.data_ptr() and "q" not in kern.qt.parts
        for T, dense_from in ((1, None), (5, None), (9, 8)):
            monkeypatch.setattr(qmatmul, "DENSE_FROM_T", dense_from)
            x = torch.randn(T, k, generator=g).bfloat16()
            assert torch.equal(kern(x), ref(x)), (n, T)
        assert torch.equal(int4_from_cpu_layout_(q), qt.parts["q"])


def test_laid_int4_host_experts_hold_one_copy_and_the_same_bits():
    """`HostExperts.lay`: the laid experts' kernels compute over the bank's own (re-laid) bytes, their rows are
    bit-identical to the copied kernels', a copy of a laid expert re-laid on arrival is the store's bytes,
    and `unlay` gives the bank back byte for byte."""
    from ferrylm.offload.host_experts import HostExperts

    E = 4
    w13, w2, _, _ = _bank("int4min", E, 128, 192)
    orig = [w13.parts["q"].clone(), w2.parts["q"].clone()]
    x = torch.randn(3, 128).bfloat16()
    ids, weights = torch.tensor([[0, 1], [2, -1], [1, 3]]), torch.rand(3, 2)
    copied = torch.empty(6, 128, dtype=torch.bfloat16)
    HostExperts(w13, w2, F.silu).rows(x, ids, weights, copied)
    he = HostExperts(w13, w2, F.silu)
    assert he.can_lay
    he.expert(1)  # built (a copy) before it is laid: rebuilt over the bank
    he.lay([1, 2])
    assert he.laid == {1, 2} and not torch.equal(w13.parts["q"][1], orig[0][1])
    assert torch.equal(w13.parts["q"][0], orig[0][0])  # others untouched
    laid = torch.empty(6, 128, dtype=torch.bfloat16)
    he.rows(x, ids, weights, laid)
    assert torch.equal(laid, copied)
    for e in (1, 2):
        k13, k2 = he.expert(e).gate_up, he.expert(e).down
        assert k13.packed.data_ptr() == w13.parts["q"][e].data_ptr() and k2.packed.data_ptr() == w2.parts["q"][e].data_ptr()
    assert he.expert(0).gate_up.packed.data_ptr() != w13.parts["q"][0].data_ptr()  # not laid: its own copy
    slots = w13.empty_like(2, "cpu")
    slots.copy_expert_(1, w13, 2)
    he.arrived(slots, 1, 2)
    assert torch.equal(slots.parts["q"][1], orig[0][2])
    he.unlay([1, 2])
    assert not he.laid and torch.equal(w13.parts["q"], orig[0]) and torch.equal(w2.parts["q"], orig[1])


def test_a_cache_copies_laid_experts_in_the_stores_layout():
    """A cache over an int4 bank with experts laid for the host: copied misses (re-laid on arrival) give the
    resident reference exactly, as before the lay."""
    from ferrylm.layers.fused_moe import ExpertWeights
    from ferrylm.layers.moe import Experts
    from ferrylm.offload.expert_cache import CachedExperts
    from ferrylm.offload.placed_weights import OffloadStats

    torch.manual_seed(0)
    E, H, I, T, k = 4, 128, 192, 6, 2
    bank = Experts(E, H, I)
    make = BANK_FORMATS["int4min"]
    bank.packed = (ExpertWeights.stack([[make(torch.randn(I, H) * .05), make(torch.randn(I, H) * .05)]
                                        for _ in range(E)], torch.float32),
                   ExpertWeights.stack([[make(torch.randn(H, I) * .05)] for _ in range(E)], torch.float32))
    bank.w13.data, bank.w2.data = torch.empty(0), torch.empty(0)
    x = torch.randn(T, H)
    weights, ids = torch.softmax(torch.randn(T, E), -1).topk(k, dim=-1)
    ref = bank.forward(x, ids, weights)
    cache = CachedExperts(bank, *bank.packed, 2, [0], set(), "lru", torch.device("cpu"), None, OffloadStats(), 0,
                          use_fused=False)
    cache.host_experts.lay([1, 2, 3])
    assert cache.host_experts.laid == {1, 2, 3}
    assert torch.equal(cache.forward(bank, x, ids, weights), ref)


# -- the split dense GEMM (`layers/cpu_experts.SplitRows`, dense_gemm = "split") against the plain one ----

@pytest.mark.parametrize("gemm", ["split", "split-x4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_dense_gemm_matches_plain(dtype, gemm, monkeypatch):
    """`dense_gemm = "split"` / "split-x4" (the rows in 1 / 4 chunks a thread, each a single-threaded
    F.linear on a pool worker) against the plain path (one F.linear) on the same weights, T = 1..33, on 4
    and 3 threads. Tolerance: every output element is the same full-length dot product on both paths, so
    they differ at most by the kernels' accumulation order inside a chunk: |split - plain| <= 2^-7 *
    (|mid| @ |w2|^T) + 2^-8 * |plain| + 1e-5 elementwise (about one rounding of the output and of the
    intermediate), where mid is the plain path's intermediate. The max difference and whether the bits
    agree are printed."""
    from ferrylm.layers import cpu_experts as C

    monkeypatch.setattr(C, "SPLIT_MIN_BYTES", 1024)  # chunks of a test-sized weight
    before = torch.get_num_threads()
    h, i = 256, 1024
    w13, w2 = (w.to(dtype) for w in _weights(h, i, 7))
    expert = HostExpert(w13, w2, dense_dtype=dtype)
    per = C.chunks_per_thread(gemm)
    worst, same = 0.0, True
    try:
        for threads in (4, 3):
            torch.set_num_threads(threads)
            split = expert.gate_up.split(threads, per)
            assert len(split.kernels) == threads * per and split.workers == threads
            for t in (1, 2, 4, 8, 16, 33):
                x = torch.randn(t, h).to(dtype)
                monkeypatch.setattr(C, "dense_gemm", "plain")
                plain = expert(x)
                monkeypatch.setattr(C, "dense_gemm", gemm)
                got = expert(x)
                assert got.shape == plain.shape and got.dtype == plain.dtype
                g, u = F.linear(x, w13).float().chunk(2, dim=-1)
                mid = (F.silu(g) * u).abs()
                bound = 2 ** -7 * mid @ w2.float().abs().t() + 2 ** -8 * plain.float().abs() + 1e-5
                err = (got.float() - plain.float()).abs()
                assert (err <= bound).all(), f"T={t}: max err {err.max():.3e}"
                worst, same = max(worst, err.max().item()), same and torch.equal(got, plain)
    finally:
        torch.set_num_threads(before)
    print(f"{gemm} vs plain ({dtype}): max |split - plain| {worst:.3e}, bit-identical: {same}")


def test_split_chunks_are_views_that_cover_the_rows(monkeypatch):
    """The split holds views of the weight's own rows (no copy), contiguous, aligned, covering [0, N) once;
    small weights take fewer chunks (one: the plain GEMM), and an fp32 weight never splits."""
    from ferrylm.layers import cpu_experts as C

    w = torch.randn(1000, 64).bfloat16()
    monkeypatch.setattr(C, "SPLIT_MIN_BYTES", 128 * 64 * 2)
    kern = C.DenseGemm(w)
    chunks = kern.split(16).kernels
    assert len(chunks) == 1000 * 64 * 2 // C.SPLIT_MIN_BYTES == 7
    rows = 0
    for k in chunks:
        assert k.w.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
        assert k.w.data_ptr() == w[rows].data_ptr() and (rows % C.SPLIT_ALIGN == 0)
        rows += k.w.shape[0]
    assert rows == 1000
    assert len(C.split_bounds(1000, 64 * 2, 16, align=64)) == 7
    assert C.split_bounds(100, 2, 16) == [(0, 100)]  # too small to split
    monkeypatch.setattr(C, "dense_gemm", "split")
    fp32 = C.DenseGemm(torch.randn(1000, 64))
    x = torch.randn(2, 64)
    assert torch.equal(fp32(x), F.linear(x, fp32.w)) and not fp32._splits


def test_split_pool_keeps_torch_threads_and_serves_threads_at_once(monkeypatch):
    """The pool's workers run torch single-threaded, but threads started afterwards still get the caller's
    count; two threads splitting at once get what each gets alone."""
    from ferrylm.layers import cpu_experts as C

    monkeypatch.setattr(C, "SPLIT_MIN_BYTES", 1024)
    monkeypatch.setattr(C, "dense_gemm", "split")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        # after an op too: torch sets a thread's count lazily on its first op
        inside = C.split_pool(3).submit(lambda: F.linear(torch.randn(2, 8), torch.randn(4, 8)) is not None and
                                        torch.get_num_threads()).result()
        seen = []
        th = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        th.start()
        th.join()
        assert inside == 1 and seen == [3] and torch.get_num_threads() == 3
        experts = [HostExpert(*(w.bfloat16() for w in _weights(256, 128, s))) for s in (1, 2)]
        assert same_on_two_threads(experts, torch.randn(4, 256))
    finally:
        torch.set_num_threads(before)


def test_column_split_takes_the_dense_gemm_path(monkeypatch):
    """`HostExperts.rows(..., cols=c)` (a dense bank's intermediate columns [c, I)) gives the same rows
    through the split GEMM as through the plain one (bound as in the split test above, summed over k)."""
    from ferrylm.layers import cpu_experts as C
    from ferrylm.offload.host_experts import HostExperts

    monkeypatch.setattr(C, "SPLIT_MIN_BYTES", 1024)
    w13, w2, _, _ = _bank("bfloat16", 4, 128, 192)
    he = HostExperts(w13, w2, F.silu)
    x = torch.randn(3, 128).bfloat16()
    ids, weights = torch.tensor([[0, 1], [2, -1], [1, 3]]), torch.rand(3, 2)
    outs = {}
    for g in ("plain", "split-x4"):
        monkeypatch.setattr(C, "dense_gemm", g)
        outs[g] = torch.empty(6, 128, dtype=torch.bfloat16)
        assert he.rows(x, ids, weights, outs[g], cols=64) == 4
    err = (outs["split-x4"].float() - outs["plain"].float()).abs()
    assert err.max() <= 2 ** -7 * outs["plain"].float().abs().max() + 1e-4, err.max()


def test_gemm_at_takes_the_multi_token_path_between_2_and_max_t(monkeypatch):
    """`gemm_at`: the one-token choice at 1 token, `{name}_multi` (where set) at 2..`{name}_max_t`, plain above; no
    multi: the one-token choice throughout."""
    from ferrylm.layers import cpu_experts as C

    monkeypatch.setattr(C, "dense_gemm", "plain")
    monkeypatch.setattr(C, "dense_gemm_max_t", 8)
    monkeypatch.setattr(C, "dense_gemm_multi", "native")
    assert [C.gemm_at("dense_gemm", t) for t in (1, 2, 8, 9)] == ["plain", "native", "native", "plain"]
    monkeypatch.setattr(C, "dense_gemm", "split")
    monkeypatch.setattr(C, "dense_gemm_multi", None)
    assert [C.gemm_at("dense_gemm", t) for t in (1, 8, 9)] == ["split", "split", "plain"]


def test_dense_gemm_max_t_sends_larger_calls_to_the_plain_gemm(monkeypatch):
    """`dense_gemm_max_t` sends larger calls of a split path to the plain one."""
    from ferrylm.layers import cpu_experts as C

    h, i = 256, 512
    w13, w2 = (w.bfloat16() for w in _weights(h, i, 9))
    expert = HostExpert(w13, w2)
    calls = []
    orig = C.SplitRows.__call__
    monkeypatch.setattr(C.SplitRows, "__call__", lambda self, x: calls.append(x.shape[0]) or orig(self, x))
    monkeypatch.setattr(C, "SPLIT_MIN_BYTES", 1024)
    monkeypatch.setattr(C, "dense_gemm", "split")
    monkeypatch.setattr(C, "dense_gemm_max_t", 2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for t in (1, 2, 4):
            expert(torch.randn(t, h).bfloat16())
    finally:
        torch.set_num_threads(before)
    assert calls == [1, 1, 2, 2]  # gate_up and down at 1 and 2 tokens; 4 tokens went the plain way



def test_int8_split_matches_plain(monkeypatch):
    """Per-channel int8 experts (`Int8Split`, the codes where they lie) split into row chunks by `packed_gemm`
    give the plain `_weight_int8pack_mm`'s output within the split test's bound (each output is one row's sum
    on both paths; the bits are printed), hold views of the same codes, and keep `Int8PackCPU`'s interface."""
    from ferrylm.layers import cpu_experts as C
    from ferrylm.layers.qmatmul import Int8PackCPU

    monkeypatch.setattr(C, "SPLIT_MIN_BYTES", 1024)
    h, i = 256, 1024
    w13, w2 = _weights(h, i, 11)
    expert = HostExpert.quantize(w13, w2, "int8")
    assert isinstance(expert.gate_up, C.Int8Split) and isinstance(expert.gate_up, Int8PackCPU)
    d13, d2 = expert.gate_up.dequantize(torch.float32), expert.down.dequantize(torch.float32)
    before = torch.get_num_threads()
    worst, same = 0.0, True
    try:
        torch.set_num_threads(3)
        for gemm in ("split", "split-x4"):
            split = expert.gate_up.split(3, C.chunks_per_thread(gemm))
            q = expert.gate_up.qt.parts["q"]
            assert all(k.qt.parts["q"].untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
                       for k in split.kernels)
            for t in (1, 4, 16):
                x = torch.randn(t, h).bfloat16()
                monkeypatch.setattr(C, "packed_gemm", "plain")
                plain = expert(x)
                monkeypatch.setattr(C, "packed_gemm", gemm)
                got = expert(x)
                g, u = (x.float() @ d13.t()).chunk(2, dim=-1)
                bound = 2 ** -7 * (F.silu(g) * u).abs() @ d2.abs().t() + 2 ** -8 * plain.float().abs() + 1e-5
                err = (got.float() - plain.float()).abs()
                assert (err <= bound).all(), f"{gemm} T={t}: {err.max():.3e}"
                worst, same = max(worst, err.max().item()), same and torch.equal(got, plain)
    finally:
        torch.set_num_threads(before)
    print(f"int8 split vs plain: max diff {worst:.3e}, bit-identical: {same}")


@pytest.mark.parametrize("fmt", ["nf4", "fp8", "int8-g64"])
def test_row_blocks_split_over_the_pool_equals_plain(fmt, monkeypatch):
    """`RowBlocks` on the split pool (chunks of rows, each decoded and multiplied by one worker) gives the plain
    path's bits: every output column is the same block GEMM over all of K either way. Chunks small enough that
    the weight really splits (and unevenly: rows not a multiple of the chunk), the per-channel scale sliced."""
    from ferrylm.layers import cpu_experts
    from ferrylm.layers.fused_moe import ExpertWeights
    from ferrylm.offload.host_experts import side_kernel

    make = {"nf4": lambda w: Q.quantize_nf4(w, 64), "fp8": Q.quantize_fp8,
            "int8-g64": lambda w: Q.quantize_int8(w, 64)}
    torch.manual_seed(0)
    N, K = 1000, 256
    side = ExpertWeights.stack([[make[fmt](torch.randn(N, K) * .05)] for _ in range(2)], torch.bfloat16)
    kern = side_kernel(side, 1)
    assert isinstance(kern, cpu_experts.RowBlocks)
    monkeypatch.setattr(cpu_experts, "SPLIT_MIN_BYTES", 4096)
    monkeypatch.setattr(cpu_experts, "ROW_BLOCK_BYTES", 64 * 2 * K)  # several blocks a chunk
    kern = side_kernel(side, 1)  # built again under the small blocks
    assert len(kern.split(2).kernels) > 2
    for T in (1, 5):
        x = torch.randn(T, K, dtype=torch.bfloat16)
        plain = kern.plain(x)
        got = kern.split(2)(x)
        assert torch.equal(got, plain), (got - plain).abs().max()
        w = side.dequantize(torch.float32)[1]
        assert (plain.float() - x.float() @ w.t()).abs().max() <= 2 ** -6 * (x.float().abs() @ w.abs().t()).max()
