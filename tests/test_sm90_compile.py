"""Every Triton kernel of ferrylm compiled for sm_90 (H100/H200) without a GPU, at the meta-parameters the engine
launches for the models we serve, with its shared memory, registers and spills read from the compiled kernel.

How: each launcher (`fused_ops.rms_norm`, `triton_attention.paged_decode`, `fused_moe.expert_rows`, ...) runs on
CPU (or meta) tensors of a model's shapes with its kernels swapped for recorders, so the launcher's own code picks
the tiles, warps, stages and constexprs; each recorded launch is then bound and specialised as Triton's JIT would
bind it (`create_function_from_signature`, `_pack_args`: dtypes, int specialisation, 16-byte alignment) and compiled
for sm_90 with Triton's own ptxas. The shapes come from the engine's modules built on meta for the catalog's
configs (`plan/memory.meta_model`): every RMSNorm width, every (heads, KV heads, head dim, rotary width) of an
attention, every gated MLP's intermediate, every expert bank and router. Checked per kernel: shared memory within
an sm_90 block's 227 KiB (nf4 at a doubled BLOCK_K needed 392 KiB and failed at launch with `OutOfResources` on
the H200, session 5), registers within 64K a block, and at most `MAX_SPILL` bytes of local memory a thread
(spills). `-s` prints the table (kernel, shared bytes, registers, spilled bytes, config).

Needs Triton (not in CI's CPU install) and no TRITON_INTERPRET; skipped otherwise."""

from __future__ import annotations

import functools
import inspect
import os
import subprocess
import tempfile
from contextlib import contextmanager

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for sm_90: not under the interpreter", allow_module_level=True)
triton = pytest.importorskip("triton")

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from ferrylm.kv import cache as kv  # noqa: E402
from ferrylm.layers import fused_moe as fm  # noqa: E402
from ferrylm.layers import fused_moe_decode as fmd  # noqa: E402
from ferrylm.layers import fused_ops as fo  # noqa: E402
from ferrylm.layers import triton_attention as ta  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
SM90_SHARED = 232448  # bytes an H100/H200 block may use (the limit the H200 reported)
SM90_REGS = 65536  # registers a block may use
H200_SMS = 132
MAX_SPILL = 128
"""Bytes of spilled registers a thread may have (a few registers' worth, served from L1: the quantized-cache and
256-wide prefill tiles spill 16-80); more is a tile to shrink (fp32 attention spilled 0.5-10 KB at bf16's tiles)."""
MODELS = ("Llama-3-8B", "Qwen2-72B", "Mixtral-8x7B", "Qwen3-30B-A3B", "Yuan2-M32", "DeepSeek-V3", "SmolLM2-135M")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MOE_DTYPES = ("bf16", "fp16")  # `FusedExperts.supports_tensors`: the fused MoE kernels never run fp32
KERNEL_MODULES = (fo, kv, fm, fmd, ta)
TABLE: dict[tuple, tuple] = {}  # compile key -> (kernel, config, shared, regs, spills), printed at the end


# --- recording launches -------------------------------------------------------------------------------------------

class _Recorder:
    """Stands in for a JITFunction in its module: `kernel[grid](*args, **kw)` records (kernel, args, kw)."""

    def __init__(self, fn: JITFunction, got: list):
        self.fn, self.got = fn, got

    def __getitem__(self, grid):
        return lambda *args, **kw: self.got.append((self.fn, args, kw))


@contextmanager
def recorded():
    """Every kernel a launcher starts inside the block, recorded instead of run. Only the module attributes the
    launchers index with a grid are swapped: the kernels' own callees (`_attend`, `_weight_tile`) stay, and the
    compiles happen after the block, with the real functions back in place."""
    got: list = []
    saved = []
    for mod in KERNEL_MODULES:
        for name, fn in vars(mod).items():
            if isinstance(fn, JITFunction) and _launched(mod, name):
                saved.append((mod, name, fn))
                setattr(mod, name, _Recorder(fn, got))
    try:
        yield got
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


@functools.lru_cache(maxsize=None)
def _launched(mod, name: str) -> bool:
    return f"{name}[" in inspect.getsource(mod)


# --- compiling and reading resources ------------------------------------------------------------------------------

def _resources(cubin: bytes) -> dict:
    """REG / SHARED / LOCAL of the kernel from cuobjdump (LOCAL: per-thread local memory, i.e. spills; the
    driver's n_spills is LOCAL / 4)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in (item.split(":") for item in line.split() if ":" in item and "[" not in item)}


def _describe(constexprs: dict, options) -> str:
    skip = {"X_T", "O_T", "T_", "W_T", "S_T"}
    parts = [f"{k}={getattr(v, 'name', v)}" for k, v in constexprs.items() if k not in skip]
    return " ".join(parts + [f"w{options.num_warps}", f"s{options.num_stages}"])


def compile_launch(fn: JITFunction, args: tuple, kwargs: dict) -> tuple:
    """One recorded launch, bound and specialised as `JITFunction.run` does, compiled for sm_90 -> its table row
    (kernel, config, shared bytes, registers, spilled bytes per thread, warps)."""
    binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(BACKEND, kwargs, bound, spec, opts)
    cexp = {fn.arg_names[p[0]]: v for p, v in constexprs.items() if signature[fn.arg_names[p[0]]] == "constexpr"}
    dtypes = ",".join(sorted({v for v in signature.values() if v.startswith("*")}))
    key = (fn.__name__, tuple(signature.items()), repr(sorted(constexprs.items(), key=str)), repr(attrs),
           repr(sorted(options.__dict__.items())))
    if key not in TABLE:
        ck = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
        res = _resources(ck.asm["cubin"])
        TABLE[key] = (fn.__name__, f"{dtypes} {_describe(cexp, options)}", ck.metadata.shared, res["REG"],
                      res["LOCAL"] + res["STACK"], options.num_warps)
    return TABLE[key]


def check(launches: list) -> list[tuple]:
    """Compile every recorded launch; each fits an sm_90 block: shared memory, registers (allocated in eights a
    thread), spills within `MAX_SPILL`."""
    assert launches, "the launcher started no kernel"
    rows = [compile_launch(*launch) for launch in launches]
    for name, cfg, shared, regs, spills, warps in rows:
        assert shared <= SM90_SHARED, f"{name} {cfg}: {shared} bytes of shared memory > {SM90_SHARED}"
        assert -(-regs // 8) * 8 * 32 * warps <= SM90_REGS, f"{name} {cfg}: {regs} registers x {warps} warps"
        assert spills <= MAX_SPILL, f"{name} {cfg}: {spills} bytes of local memory a thread (register spills)"
    return rows


@pytest.fixture(scope="module", autouse=True)
def _print_table():
    yield
    print(f"\n{'kernel':16} {'shared':>7} {'regs':>4} {'spill':>5}  config")
    for name, cfg, shared, regs, spills, _ in sorted(TABLE.values()):
        print(f"{name:16} {shared:7d} {regs:4d} {spills:5d}  {cfg}")


# --- the engine's shapes -------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def shapes(model: str) -> dict:
    """What the engine's modules for `model` (built on meta, as the runner builds them; a few layers: the shapes
    repeat) hand the kernels: RMSNorm widths, (Hq, Hk, D, rot) of each rotary, attentions, gated MLP widths,
    MoE banks and routers."""
    from ferrylm.config import ModelConfig
    from ferrylm.layers.attention import PagedAttention
    from ferrylm.layers.moe import Experts
    from ferrylm.layers.norm import RMSNorm
    from ferrylm.layers.rotary import RotaryEmbedding
    from ferrylm.models.llama import GatedMLP
    from ferrylm.plan.catalog import resolve_model
    from ferrylm.plan.memory import meta_model

    if model == "SmolLM2-135M":
        from ferrylm.default_model import default_model_path

        try:
            _, raw = resolve_model(str(default_model_path()))
        except Exception as e:  # the embedded model's package is not installed here
            pytest.skip(f"embedded SmolLM2 not found: {e}")
    else:
        _, raw = resolve_model(model)
    cfg = ModelConfig.from_hf(raw)
    layers = min(cfg.num_hidden_layers, int(raw.get("first_k_dense_replace", 0)) + 2)
    m = meta_model(dict(raw, num_hidden_layers=layers))
    from ferrylm.models.yuan import AttentionRouter, LocalizedFilter

    out = dict(norms=set(), rope=set(), attn=set(), mlp=set(), moe=set(), lf=set(), router=set(), cfg=cfg)
    for mod in m.modules():
        if isinstance(mod, LocalizedFilter):  # the shift's two widths: the input and conv1's output
            out["lf"] |= {mod.conv1.in_features // 2, mod.conv1.out_features}
        if isinstance(mod, AttentionRouter):
            out["router"].add(mod.query.out_features)
        if isinstance(mod, RMSNorm):
            out["norms"].add(mod.weight.shape[0])
        rot, attn = getattr(mod, "rotary", None), getattr(mod, "attn", None)
        if isinstance(rot, RotaryEmbedding) and isinstance(attn, PagedAttention) and not rot.length_dependent:
            out["rope"].add((attn.num_heads, attn.num_kv_heads, rot.head_dim, rot.rot_dim))
        if isinstance(mod, PagedAttention):
            dv = mod.head_dim if cfg.v_cache_dim is None else cfg.v_cache_dim
            out["attn"].add((mod.num_heads, mod.num_kv_heads, mod.head_dim, dv, mod.latent_values, mod.window))
        if isinstance(mod, GatedMLP) and mod.silu:
            out["mlp"].add(mod.inter)
        if isinstance(getattr(mod, "experts", None), Experts):
            e = mod.experts
            routed = "route(" in inspect.getsource(type(mod).forward)  # DeepSeek's sigmoid router is torch
            out["moe"].add((e.num_experts, e.hidden, e.inter, mod.top_k, getattr(mod, "normalize", True), routed))
    return out


def _need(model: str, kind: str):
    got = shapes(model)[kind]
    if not got:
        pytest.skip(f"{model} has no {kind}")
    return sorted(got, key=str)


MODEL_DTYPES = [(m, d) for m in MODELS for d in DTYPES]
MOE_MODELS = [(m, d) for m in ("Mixtral-8x7B", "Qwen3-30B-A3B", "Yuan2-M32", "DeepSeek-V3") for d in MOE_DTYPES]


# --- fused_ops and the KV write ------------------------------------------------------------------------------------

@pytest.mark.parametrize("model,dt", MODEL_DTYPES)
def test_fused_ops_fit_sm90(model, dt):
    """`layers/fused_ops.py` at every width the model hands it: RMSNorm with and without the residual add, RoPE
    on q and k, silu * up, the router's softmax top-k, the sum of a token's expert rows, and Yuan's filter shift and
    attention router."""
    dtype = DTYPES[dt]
    s = shapes(model)
    T = 3
    with recorded() as got:
        for n in _need(model, "norms"):
            x = torch.zeros(T, n, dtype=dtype)
            fo.rms_norm(x, torch.ones(n, dtype=dtype), 1e-6)
            fo.rms_norm(x, torch.ones(n, dtype=dtype), 1e-6, torch.zeros_like(x))
        for hq, hk, d, rot in s["rope"]:
            q, k = torch.zeros(T, hq, d, dtype=dtype), torch.zeros(T, hk, d, dtype=dtype)
            table = torch.zeros(8, 2, rot)
            if fo.rope_fits(q, k, rot):
                fo.rope(torch.zeros(T, dtype=torch.long), q, k, table, rot)
        for inter in s["mlp"]:
            fo.silu_mul(torch.zeros(T, 2 * inter, dtype=dtype))
        for E, H, _, k, norm, routed in s["moe"]:
            logits = torch.zeros(T, E, dtype=dtype)
            if routed and fo.route_fits(logits, k):
                fo.route(logits, k, norm)
            fo.sum_rows(torch.zeros(T * k, H, dtype=dtype), k)
        for C in s["lf"]:  # a layer of the state pool: a strided view
            store = torch.zeros(5, 3, C, dtype=dtype).select(1, 1)
            fo.lf_shift(torch.zeros(T, C, dtype=dtype), store, torch.zeros(T, dtype=torch.long),
                        torch.ones(T, 1, dtype=torch.bool))
        for E in s["router"]:
            qkv = torch.zeros(T, 3 * E)
            if fo.attention_router_fits(qkv, E):
                fo.attention_router(qkv, E)
    for row in check(got):
        print(model, dt, row)


@pytest.mark.parametrize("model,dt", MODEL_DTYPES)
def test_write_kv_fits_sm90(model, dt):
    """`kv/cache.write_kv` for every attention whose head widths it takes (`_kernel_writes`: powers of two; MLA's
    576-wide latent rows go through `index_copy_`), a paged cache of the engine's block size."""
    from ferrylm.config import CacheConfig

    dtype = DTYPES[dt]
    bs = CacheConfig().block_size
    got = []
    for _, hk, d, dv, _, _ in _need(model, "attn"):
        kc, vc = torch.zeros(4, bs, hk, d, dtype=dtype), torch.zeros(4, bs, hk, dv, dtype=dtype)
        k, v = torch.zeros(3, hk, d, dtype=dtype), torch.zeros(3, hk, dv, dtype=dtype)
        if not kv.write_kv_fits(kc, vc, k, v):
            continue
        with recorded() as got_:
            kv.write_kv(kc, vc, torch.arange(3), k, v)
        got += got_
    if not got:
        pytest.skip(f"{model}: no attention takes the write kernel")
    check(got)


# --- attention -----------------------------------------------------------------------------------------------------

KV_CODES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


def _caches(hk, d, dv, dtype, kv_dtype=None):
    from ferrylm.config import CacheConfig

    bs, cd = CacheConfig().block_size, kv_dtype or dtype
    kc, vc = torch.zeros(6, bs, hk, d, dtype=cd), torch.zeros(6, bs, hk, dv, dtype=cd)
    scales = (torch.zeros(6, bs, hk), torch.zeros(6, bs, hk) if dv else None) if kv_dtype is not None else (None, None)
    return kc, vc, scales


def _attention_launches(hq, hk, d, dv, latent, window, dtype, kv_dtype=None, monkeypatch=None) -> list:
    """The decode launches (one row at a long context: split; three rows at a short one: not split) and a prefill
    of two chunks over cached prefixes, as `PagedAttention._triton` starts them."""
    kc, vc, (ks, vs) = _caches(hk, d, dv, dtype, kv_dtype)
    kw = dict(window=window, k_scale=ks, v_scale=vs, latent_values=latent)
    with recorded() as got:
        for B, max_len in ((1, 8192), (3, 64)):
            q = torch.zeros(B, hq, d, dtype=dtype)
            ta.paged_decode(q, kc, vc, torch.zeros(B, 4, dtype=torch.long), torch.full((B,), 5), hq ** -0.5,
                            max_len, **kw)
        block_q = ta.prefill_block_q(hq, hk, d, dtype)
        qsl, start, lens = [0, 20, 23], [16, 7], [36, 10]
        meta, tiles = ta.prefill_meta(qsl, start, lens, 0, block_q, torch.device("cpu"))
        ta.paged_prefill(torch.zeros(23, hq, d, dtype=dtype), kc, vc, torch.zeros(2, 4, dtype=torch.long), meta,
                         tiles, 2, block_q, hq ** -0.5, **kw)
    return got


@pytest.fixture
def h200_splits(monkeypatch):
    """`decode_splits` as it counts on an H200 (132 SMs): the split count is a constexpr."""
    orig = ta.decode_splits
    monkeypatch.setattr(ta, "_sms", lambda device: H200_SMS)
    monkeypatch.setattr(ta, "decode_splits", lambda r, h, m, device: orig(r, h, m, torch.device("cuda")))


@pytest.mark.parametrize("model,dt", MODEL_DTYPES)
def test_attention_fits_sm90(model, dt, h200_splits):
    """`layers/triton_attention.py`: flash-decoding (split and not, and its combine) and the varlen prefill, at
    each of the model's attentions (MLA: 576-wide latent rows, values the first 512)."""
    got = []
    for hq, hk, d, dv, latent, window in _need(model, "attn"):
        got += _attention_launches(hq, hk, d, dv, latent, window, DTYPES[dt])
    assert {fn.__name__ for fn, _, _ in got} == {"_decode_kernel", "_combine_kernel", "_prefill_kernel"}
    for row in check(got):
        print(model, dt, row)


@pytest.mark.parametrize("model", ["Llama-3-8B", "Qwen3-30B-A3B", "SmolLM2-135M", "DeepSeek-V3"])
@pytest.mark.parametrize("variant", ["window", "fp8", "int8"])
def test_attention_variants_fit_sm90(model, variant, h200_splits):
    """The same kernels with a sliding window (4096) or a quantized cache (codes + fp32 scales), bf16."""
    got = []
    for hq, hk, d, dv, latent, window in _need(model, "attn"):
        got += _attention_launches(hq, hk, d, dv, latent, 4096 if variant == "window" else window, torch.bfloat16,
                                   KV_CODES.get(variant))
    check(got)


# --- fused MoE -----------------------------------------------------------------------------------------------------

BANK_FORMATS = {  # name -> how the store quantizes an expert piece (weights/quant.py)
    "int8": lambda w: _quant().quantize_int8(w), "int8-g64": lambda w: _quant().quantize_int8(w, 64),
    "fp8": lambda w: _quant().quantize_fp8(w), "int4": lambda w: _quant().quantize_int4(w, 32, "sym"),
    "int4min": lambda w: _quant().quantize_int4(w, 64, "min"), "nf4": lambda w: _quant().quantize_nf4(w, 64)}


def _quant():
    from ferrylm.weights import quant

    return quant


def _bank(fmt: str, E: int, N: int, K: int, dtype, mapped: bool):
    """One side of an expert bank [E, N, K] on meta (no memory) laid out as the engine holds it: dense in the
    activations' dtype, or the parts `ExpertWeights.stack` makes of the store's quantized pieces (their dtypes and
    per-row widths scaled from a small piece); `mapped`: through a `WeightTable` of per-expert addresses."""
    if fmt == "dense":
        like = torch.empty(E, N, K, dtype=dtype, device="meta")
    else:
        k0 = 256
        small = fm.ExpertWeights.stack([[BANK_FORMATS[fmt](torch.randn(16, k0))]], dtype)
        per_row = small.group >= k0  # one scale a row: [E, N, 1] at any K
        width = lambda name, w: 1 if per_row and name != "q" else w * K // k0  # noqa: E731
        parts = {name: torch.empty(E, N, width(name, p.shape[-1]), dtype=p.dtype, device="meta")
                 for name, p in small.parts.items()}
        like = fm.ExpertWeights(small.fmt, (E, N, K), K if per_row else small.group, parts["q"], parts.get("scale"),
                                parts.get("min"))
    if not mapped:
        return like
    ptrs = {name: torch.zeros(E, dtype=torch.long) for name in (("q",) if fmt == "dense" else like.parts)}
    return fm.WeightTable(ptrs, like)


def _moe_launches(E, H, I, k, dtype, fmt, mapped, tokens, decode=None) -> list:
    w13, w2 = _bank(fmt, E, 2 * I, H, dtype, mapped), _bank(fmt, E, H, I, dtype, mapped)
    got = []
    for T in tokens:
        ids = torch.arange(T * k).remainder(E).view(T, k)
        with recorded() as got_:
            fm.expert_rows(torch.zeros(T, H, dtype=dtype), w13, w2, ids, torch.ones(T, k), decode=decode)
        got += got_
    return got


PREFILL_TOKENS = (1, 16, 300, 1024)  # `_blocks`' three tile regimes at every top-k we serve (A = T * k)


@pytest.mark.parametrize("model,dt", MOE_MODELS)
def test_fused_moe_dense_fits_sm90(model, dt):
    """`fused_moe.expert_rows` on the model's resident dense bank (the default MoE path on CUDA) at decode and
    prefill sizes, and read in place through `WeightTable`s (the offloaded path)."""
    got = []
    for E, H, I, k, _, _ in _need(model, "moe"):
        got += _moe_launches(E, H, I, k, DTYPES[dt], "dense", False, PREFILL_TOKENS)
        got += _moe_launches(E, H, I, k, DTYPES[dt], "dense", True, (1, 300))
    for row in check(got):
        print(model, dt, row)


@pytest.mark.parametrize("fmt", list(BANK_FORMATS))
@pytest.mark.parametrize("model", ["Mixtral-8x7B", "Qwen3-30B-A3B", "DeepSeek-V3"])
def test_fused_moe_packed_fits_sm90(model, fmt):
    """Packed banks (the engine keeps int4 / int4min / nf4 packed; int8 / fp8 the kernel reads in tests), resident
    and through tables, bf16: `_tiles` keeps each format's tiles in shared memory."""
    got = []
    for E, H, I, k, _, _ in _need(model, "moe"):
        for mapped in (False, True):
            got += _moe_launches(E, H, I, k, torch.bfloat16, fmt, mapped, (1, 300, 1024))
    check(got)


@pytest.mark.parametrize("model", ["Mixtral-8x7B", "Qwen3-30B-A3B", "Yuan2-M32", "DeepSeek-V3"])
def test_align_kernel_fits_sm90(model):
    """`_align_small` at every decode batch (graph buckets 1..16 tokens and 3) for which `align` takes it, at the
    row blocks the plain and the decode kernels align to."""
    got = []
    for E, _, _, k, _, _ in _need(model, "moe"):
        for T in (1, 2, 3, 4, 8, 16):
            if not fm.align_kernel_fits(T * k, E):
                continue
            for bm in {fm._blocks(T * k)[0], fmd.DecodeConfig().block_m}:
                with recorded() as got_:
                    fm.align(torch.zeros(T, k, dtype=torch.long), E, bm, kernel=True)
                got += got_
    check(got)


@pytest.mark.parametrize("fmt", ["dense", *BANK_FORMATS])
def test_fused_moe_decode_fits_sm90(fmt):
    """`layers/fused_moe_decode.py` (off by default, `DECODE_MAX_TOKENS = 0`) at every tile configuration
    `bench_mapped.py --sweep` times (`sweep_configs`), Qwen3-30B-A3B's banks through tables, bf16."""
    E, H, I, k, _, _ = _need("Qwen3-30B-A3B", "moe")[0]
    got = []
    for cfg in fmd.sweep_configs(fmt):
        got += _moe_launches(E, H, I, k, torch.bfloat16, fmt, True, (1, 4), decode=cfg)
    check(got)


def test_every_launched_kernel_is_compiled_here():
    """A kernel added to a module outside `KERNEL_MODULES` would reach the GPU uncompiled: every ferrylm module
    holding Triton kernels is one of them, and (when the whole file ran: this test is last) every kernel a
    launcher starts was compiled above."""
    import importlib
    import pkgutil

    import ferrylm

    launched = set()
    for info in pkgutil.walk_packages(ferrylm.__path__, "ferrylm."):
        src = importlib.util.find_spec(info.name).origin
        if src and src.endswith(".py") and "triton.jit" in open(src).read():
            mod = importlib.import_module(info.name)
            assert mod in KERNEL_MODULES, f"{info.name} has Triton kernels this test does not compile"
            launched |= {n for n, f in vars(mod).items() if isinstance(f, JITFunction) and _launched(mod, n)}
    assert len(launched) >= 13
    compiled = {row[0] for row in TABLE.values()}
    if len(compiled) > 1:  # not this test alone
        assert launched <= compiled, f"launched kernels no test compiled: {sorted(launched - compiled)}"
