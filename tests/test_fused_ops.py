"""The one-launch forms against the plain torch ones they replace on CUDA: `layers/fused_ops.py`'s RMSNorm (and
with the residual add), RoPE, silu * up, router and expert row sum (`layers/norm.py`, `layers/rotary.py`,
`models/llama.GatedMLP`, `layers/moe.route`, `layers/fused_moe.sum_rows`) and `kv/cache.write_kv`: RoPE, the
KV write and short sums bit for bit, the others within their last bit (summation order; Triton's exp). Runs on
CUDA (fp32, bf16, fp16), or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` before Python starts; fp32
and fp16: the interpreter rounds fp32 -> bf16 by truncation, not to nearest as the GPU does, so bf16 bits are
checked on CUDA only); skipped otherwise (CI). The edge cases are the served models' shapes: hidden 576 / 2048 /
7168 / 8192 (non-powers of two pad the tile), head dims 64 / 128 / 256 and MLA's 64-wide rope part over 128 heads
(DeepSeek-V3), batches of 1 and 3 and a graph bucket of 4 whose padded row writes the KV cache's scratch block."""

import pytest
import torch
import torch.nn.functional as F

from helpers import triton_device  # noqa: E402

CUDA = triton_device()

from ferrylm.layers import fused_ops  # noqa: E402
from ferrylm.layers.norm import RMSNorm  # noqa: E402
from ferrylm.layers.rotary import RotaryEmbedding  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if CUDA else [torch.float32, torch.float16]
ULP = {torch.float32: 2 ** -22, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}  # relative spacing (fp32: twice)


def plain(fn):
    """Run `fn` with the fused forms off (the reference)."""
    was = fused_ops.ENABLED
    fused_ops.ENABLED = False
    try:
        return fn()
    finally:
        fused_ops.ENABLED = was


def random_norm(n: int, eps: float, dtype: torch.dtype, g: torch.Generator) -> RMSNorm:
    """An RMSNorm of width n with random weights drawn from g, in `dtype`."""
    norm = RMSNorm(n, eps).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=g).to(DEV))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,weight_fp32", [(64, False), (4096, False), (200, True)])
def test_rms_norm_equals_the_plain_form(dtype, n, weight_fp32):
    g = torch.Generator().manual_seed(n)
    norm = random_norm(n, 1e-5, torch.float32 if weight_fp32 else dtype, g)
    x = (torch.randn(7, n, generator=g) * 3).to(DEV, dtype)
    ref = plain(lambda: norm(x))
    got = fused_ops.rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    err = (got.float() - ref.float()).abs().max().item()
    ulp = ULP[ref.dtype]
    print(f"rms_norm {dtype} n={n}: max diff {err:.3e}")
    assert err <= 2 * ulp * ref.float().abs().max().item()
    x3 = x.view(7, 1, n).expand(7, 2, n)[:, 1]  # a strided view: copied, same result
    assert torch.equal(fused_ops.rms_norm(x3, norm.weight, norm.eps), got)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,rot", [(64, 64), (128, 64)])
def test_rope_equals_the_plain_form_bit_for_bit(dtype, d, rot):
    g = torch.Generator().manual_seed(d + rot)
    T, hq, hk = 5, 6, 2
    rope = RotaryEmbedding(d, rot, 512, 10000.0).to(DEV)
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).to(DEV, dtype)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)  # strided views, as the model splits them
    q, k = q.view(T, hq, d), k.view(T, hk, d)
    pos = torch.tensor([0, 3, 17, 300, 511], device=DEV)
    assert fused_ops.rope_usable(q, k, rot) or not CUDA
    ref_q, ref_k = plain(lambda: rope(pos, q, k))
    got_q, got_k = fused_ops.rope(pos, q, k, rope._table(q.device), rot)
    print(f"rope {dtype} d={d} rot={rot}: max diff q {(got_q.float() - ref_q.float()).abs().max():.3e}")
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_the_plain_form(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 2 * 3000, generator=g) * 4).to(DEV, dtype)
    gate, up = x.split(3000, dim=-1)
    ref = F.silu(gate) * up
    got = fused_ops.silu_mul(x)
    err = (got.float() - ref.float()).abs()
    ulp = 2 * ULP[dtype]  # silu(gate) is rounded before the product: an ulp there (Triton's exp) is two here
    print(f"silu_mul {dtype}: max diff {err.max():.3e}")
    assert (err <= ulp * ref.float().abs() + 1e-6).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_the_residual_add(dtype):
    """`RMSNorm.add_forward`: (x + r, norm(x + r)) in one launch equals the two steps: the sum bit for bit,
    the norm within the plain norm's bound."""
    g = torch.Generator().manual_seed(11)
    n = 512
    norm = random_norm(n, 1e-6, dtype, g)
    x, r = ((torch.randn(3, n, generator=g) * 2).to(DEV, dtype) for _ in range(2))
    ref_s, ref_h = plain(lambda: norm.add_forward(x, r))
    s, h = fused_ops.rms_norm(x, norm.weight, norm.eps, r)
    assert torch.equal(s, ref_s)
    ulp = ULP[dtype]
    assert (h.float() - ref_h.float()).abs().max().item() <= 2 * ulp * ref_h.float().abs().max().item()


@pytest.mark.parametrize("E,k,normalize", [(8, 2, True), (128, 8, True), (60, 4, False), (32, 2, True)])
def test_route_equals_the_plain_router(E, k, normalize):
    """`fused_ops.route` picks `layers/moe.route`'s experts in its order, weights within fp32 rounding."""
    from ferrylm.layers.moe import route

    g = torch.Generator().manual_seed(E + k)
    logits = (torch.randn(9, E, generator=g) * 3).to(DEV)
    ref_w, ref_ids = plain(lambda: route(logits, k, normalize))
    w, ids = fused_ops.route(logits, k, normalize)
    assert torch.equal(ids, ref_ids)
    print(f"route E={E} k={k}: max weight diff {(w - ref_w).abs().max():.3e}")
    assert torch.allclose(w, ref_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("E,k", [(8, 2), (128, 8)])
def test_route_of_nan_logits_picks_experts_in_range(E, k):
    """A NaN router logit (a bad activation, or a graph warm-up on scratch inputs) still routes each token to k
    distinct experts below E, as torch.topk does: an id of E would fault the expert kernels' gathers (a device
    assert that ends the process; session 12's 2k-prompt MoE prefill on the H200). Finite rows as before."""
    from ferrylm.layers.moe import route

    g = torch.Generator().manual_seed(E)
    logits = torch.randn(4, E, generator=g).to(DEV)
    logits[1, 3] = float("nan")
    logits[2] = float("nan")
    w, ids = fused_ops.route(logits, k, True)
    ids = ids.cpu()
    assert ((ids >= 0) & (ids < E)).all(), ids
    assert all(len(set(row.tolist())) == k for row in ids)
    ref_w, ref_ids = plain(lambda: route(logits, k, True))
    assert torch.equal(ids[[0, 3]], ref_ids.cpu()[[0, 3]])
    assert torch.allclose(w[[0, 3]], ref_w[[0, 3]], rtol=1e-5, atol=1e-7)
    assert torch.isnan(w[1]).all() and torch.isnan(w[2]).all()  # the NaN stays visible in the weights


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 2, 8])
def test_sum_rows_equals_the_plain_sum(dtype, k):
    """`fused_ops.sum_rows` (one launch) against `layers/fused_moe.sum_rows`' torch ops: within fp32 rounding
    of the sum before the one rounding to the dtype (k = 1, 2: the same bits)."""
    from ferrylm.layers.fused_moe import sum_rows

    g = torch.Generator().manual_seed(k)
    rows = torch.randn(5 * k, 3000, generator=g).to(DEV, dtype)
    ref = plain(lambda: sum_rows(rows, k))
    got = fused_ops.sum_rows(rows, k)
    if k <= 2:
        assert torch.equal(got, ref)
    ulp = 2 * ULP[dtype] if dtype == torch.float32 else ULP[dtype]
    assert ((got.float() - ref.float()).abs() <= ulp * ref.float().abs() + 1e-5).all()


@pytest.mark.parametrize("dv", [64, 0])
def test_kv_write_kernel_equals_index_copy(dv):
    """`kv/cache.write_kv` (one launch for a step's K and V rows) writes what `index_copy_` writes, from strided
    views as the model's qkv split gives them; MLA's empty V (dv 0) writes K only."""
    from ferrylm.kv import cache as C

    g = torch.Generator().manual_seed(dv)
    N, bs, hk, dk, T = 6, 4, 2, 64, 5
    qkv = torch.randn(T, (2 * hk) * dk + hk * dv, generator=g).to(DEV)
    k = qkv[:, :hk * dk].view(T, hk, dk)
    v = qkv[:, 2 * hk * dk:].view(T, hk, dv)
    slots = torch.tensor([3, 0, 17, 9, 22], device=DEV)
    ref_k, ref_v = torch.zeros(N, bs, hk, dk, device=DEV), torch.zeros(N, bs, hk, dv, device=DEV)
    ref_k.view(-1, hk, dk).index_copy_(0, slots, k)
    if dv:
        ref_v.view(-1, hk, dv).index_copy_(0, slots, v)
    got_k, got_v = torch.zeros_like(ref_k), torch.zeros_like(ref_v)
    C.write_kv(got_k, got_v, slots, k, v)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [576, 2048, 7168])
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_rms_norm_at_the_served_widths(dtype, n, rows):
    """Hidden sizes of SmolLM2 (576), Qwen3-MoE / Yuan (2048) and DeepSeek-V3 (7168): the tile pads to a power of
    two and the padding must not enter the sum; plain and residual-add forms, every row count a step has."""
    g = torch.Generator().manual_seed(n + rows)
    norm = random_norm(n, 1e-6, dtype, g)
    x, r = ((torch.randn(rows, n, generator=g) * 2).to(DEV, dtype) for _ in range(2))
    bound = 2 * ULP[dtype]
    ref = plain(lambda: norm(x))
    got = fused_ops.rms_norm(x, norm.weight, norm.eps)
    err = (got.float() - ref.float()).abs().max().item()
    print(f"rms_norm {dtype} n={n} rows={rows}: max diff {err:.3e}")
    assert err <= bound * ref.float().abs().max().item()
    ref_s, ref_h = plain(lambda: norm.add_forward(x, r))
    s, h = fused_ops.rms_norm(x, norm.weight, norm.eps, r)
    assert torch.equal(s, ref_s)
    assert (h.float() - ref_h.float()).abs().max().item() <= bound * ref_h.float().abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_residual_aliasing_its_input(dtype):
    """The residual may be x itself or rows of the same storage (the kernel reads both before it writes, into
    fresh outputs): the same results as the two plain steps, inputs unchanged."""
    g = torch.Generator().manual_seed(5)
    n = 576
    norm = random_norm(n, 1e-6, dtype, g)
    buf = torch.randn(6, n, generator=g).to(DEV, dtype)
    before = buf.clone()
    for x, r in ((buf[:3], buf[:3]), (buf[:3], buf[3:]), (buf[1:4], buf[:3])):  # itself, the rest, overlapping
        ref_s, ref_h = plain(lambda: norm.add_forward(x, r))
        s, h = fused_ops.rms_norm(x, norm.weight, norm.eps, r)
        assert torch.equal(s, ref_s)
        assert (h.float() - ref_h.float()).abs().max().item() <= 2 * ULP[dtype] * ref_h.float().abs().max().item()
        assert torch.equal(buf, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,hq,hk,d,rot", [(1, 9, 3, 64, 64), (3, 32, 8, 128, 128), (4, 16, 16, 256, 128),
                                           (3, 128, 1, 64, 64)])
def test_rope_at_the_served_head_shapes(dtype, T, hq, hk, d, rot):
    """SmolLM2 (9 / 3 heads of 64), Llama-3 (32 / 8 of 128), Yuan (256-wide heads, half rotated) and DeepSeek-V3's
    rope part (128 q heads, one shared k head of 64): torch's bits."""
    g = torch.Generator().manual_seed(hq + d)
    rope = RotaryEmbedding(d, rot, 4096, 10000.0).to(DEV)
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).to(DEV, dtype)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(T, hq, d), k.view(T, hk, d)
    pos = torch.tensor([0, 7, 4095, 300][:T], device=DEV)
    assert fused_ops.rope_fits(q, k, rot)
    ref_q, ref_k = plain(lambda: rope(pos, q, k))
    got_q, got_k = fused_ops.rope(pos, q, k, rope._table(q.device), rot)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 768), (4, 14336)])
def test_silu_mul_at_the_served_widths(dtype, rows, inter):
    """SmolLM2's 1536, Qwen3-MoE's 768 (one tile, masked) and Llama-3's 14336 (14 tiles) intermediates."""
    g = torch.Generator().manual_seed(inter + rows)
    x = (torch.randn(rows, 2 * inter, generator=g) * 4).to(DEV, dtype)
    gate, up = x.split(inter, dim=-1)
    ref = F.silu(gate) * up
    got = fused_ops.silu_mul(x)
    assert ((got.float() - ref.float()).abs() <= 2 * ULP[dtype] * ref.float().abs() + 1e-6).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,H", [(2, 4096), (8, 2048), (8, 7168)])
def test_sum_rows_at_the_served_widths(dtype, k, H):
    """Mixtral (2 of 4096), Qwen3-MoE (8 of 2048), DeepSeek-V3 (8 of 7168: not a multiple of the 1024 tile)."""
    from ferrylm.layers.fused_moe import sum_rows

    g = torch.Generator().manual_seed(k + H)
    rows = torch.randn(3 * k, H, generator=g).to(DEV, dtype)
    ref = plain(lambda: sum_rows(rows, k))
    got = fused_ops.sum_rows(rows, k)
    assert ((got.float() - ref.float()).abs() <= 2 * ULP[dtype] * ref.float().abs() + 1e-5).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,dk,dv", [(3, 64, 64), (8, 128, 128), (16, 256, 256), (4, 128, 0)])
def test_kv_write_at_the_served_shapes_with_a_padded_row(dtype, hk, dk, dv):
    """A graph bucket of 4 for 3 sequences, block size 16: real rows at offsets inside their blocks, the padded
    row to the scratch block's first slot (`DecodeGraphs` pads with it; no -1 slots). Real slots get exactly
    `index_copy_`'s rows, every other slot but the scratch one stays as it was."""
    from ferrylm.kv import cache as C

    g = torch.Generator().manual_seed(hk * dk + dv)
    N, bs, T = 5, 16, 4
    scratch = N - 1
    qkv = torch.randn(T, (2 * hk) * dk + hk * dv, generator=g).to(DEV, dtype)
    k = qkv[:, :hk * dk].view(T, hk, dk)
    v = qkv[:, 2 * hk * dk:].view(T, hk, dv)
    slots = torch.tensor([0 * bs + 15, 2 * bs + 3, 1 * bs + 0, scratch * bs], device=DEV)
    fill = lambda d: torch.randn(N, bs, hk, d, generator=g).to(DEV, dtype)  # noqa: E731 (recycled memory)
    ref_k, ref_v = fill(dk), fill(dv)
    got_k, got_v = ref_k.clone(), ref_v.clone()
    assert C.write_kv_fits(got_k, got_v, k, v)
    ref_k.view(-1, hk, dk).index_copy_(0, slots, k)
    if dv:
        ref_v.view(-1, hk, dv).index_copy_(0, slots, v)
    C.write_kv(got_k, got_v, slots, k, v)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", [2048, 1024, 300])
def test_lf_shift_equals_the_plain_shift(dtype, C):
    """Yuan's localized-filter shift at decode (`models/yuan.LFBatch.shift_cat`), at M32's widths (hidden 2048 and
    its half) and a ragged one: the conv input and the state pool afterwards, bit for bit. Rows: two continuing
    sequences, one starting (its previous row is 0, not the stale state), and a padded graph row on the scratch
    slot; the layer is a strided view of the pool, as the engine's is."""
    from ferrylm.models.yuan import LFBatch

    g = torch.Generator().manual_seed(C)
    S, L, layer = 4, 3, 1
    pool = torch.randn(S + 1, L, C, generator=g).to(DEV, dtype)  # row S: the scratch row
    x = torch.randn(4, C, generator=g).to(DEV, dtype)
    slots = torch.tensor([2, 0, S, 3], device=DEV)
    cont = torch.tensor([[True], [False], [True], [True]], device=DEV)
    ref_pool = pool.clone()
    lf = LFBatch(first=None, last=None, cont=cont, slots=slots, state={"lf_x": ref_pool}, decode=True)
    ref = plain(lambda: lf.shift_cat(x, "lf_x", layer))
    got = fused_ops.lf_shift(x, pool.select(1, layer), slots, cont)
    assert torch.equal(got, ref) and torch.equal(pool, ref_pool)
    assert torch.equal(got[1, :C], torch.zeros_like(x[1])) and torch.equal(pool[2, layer], x[0])


@pytest.mark.parametrize("E", [32, 16, 48])
def test_attention_router_equals_the_plain_router(E):
    """Yuan2.0-M32's attention router after its one fp32 matmul, against the plain two bmm and softmax: within
    fp32 rounding (summation order, Triton's exp), and the same top-2 experts."""
    from ferrylm.layers.moe import route
    from ferrylm.models.yuan import AttentionRouter

    g = torch.Generator().manual_seed(E)
    H, T = 256, 7
    router = AttentionRouter(H, E)
    with torch.no_grad():
        for m in (router.query, router.key, router.value):
            m.weight.copy_(torch.randn(E, H, generator=g) * 0.05)
    router = router.to(DEV, torch.bfloat16)
    router.finish_load()
    x = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
    ref = plain(lambda: router(x))
    got = fused_ops.attention_router(F.linear(x.float(), router.qkv32), E)
    worst = (got - ref).abs().max().item()
    print(f"attention router E={E}: max diff {worst:.3e} (logit scale {ref.abs().max():.2f})")
    assert worst <= 1e-5 * max(1.0, ref.abs().max().item())
    assert torch.equal(plain(lambda: route(got, 2, True))[1], plain(lambda: route(ref, 2, True))[1])
