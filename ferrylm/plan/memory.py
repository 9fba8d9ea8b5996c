"""The memory model: bytes of every tensor group of a model, of KV per token and of per-sequence state,
counted from the model itself so that the planner and the engine agree by construction.

`meta_model(cfg)` builds the engine's own module (`models.registry.model_class`) on the `meta` device:
no memory, exact shapes. Its tensor groups are the engine's (`offload.placement.group_tensors`: `embed`,
`lm_head`, per layer `attention`, `norm`, `router`, `shared_experts`, `mlp`, one group per expert);
`weight_groups` re-counts their bytes for a `WeightFormat` (a ferry store's quantized weights, counted by
the converter's own quantizer on meta; experts packed where the engine keeps them packed: int4, NF4). The KV pool and the placement are decided by `offload/memory.py`, the functions
the model runner calls at start-up; KV bytes per block come from `KVCache.bytes_per_block`.

Families without a model class are planned from config.json where a formula exists (`analytical_groups`:
DeepSeek-V2/V3, checked against the DeepSeek module's own count and the published total).
Knows nothing about hardware or speed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.offload.placement import KINDS, TensorGroup, group_tensors
from ferrylm.weights.quant import fp8_blocks_nbytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


QUANT_SCHEMES = ("int8", "fp8", "nf4", "int4", "q8_0")
"""`ferry convert --quant` choices a plan can count."""


@functools.lru_cache(maxsize=4096)
def stored_bytes(name: str, shape: tuple[int, ...], scheme: str, group_size: int = 64) -> int | None:
    """Bytes `ferry convert --quant scheme` stores the tensor `name` of `shape` in, None when it stays in high
    precision. Counted by running the converter's own choice and quantizer on a `meta` tensor: exact, no
    arithmetic of its own."""
    from ferrylm.weights.convert import ConvertOptions, quantize_stored, stored_scheme

    opts = ConvertOptions(quant=scheme, group_size=group_size)
    t = torch.empty(shape, device="meta")
    chosen = stored_scheme(name, t, opts)
    return None if chosen is None else quantize_stored(t, chosen, opts).nbytes


@functools.lru_cache(maxsize=256)
def packed_expert_bytes(inter: int, hidden: int, scheme: str, group_size: int = 64) -> int | None:
    """Bytes one expert (gate [I, H], up [I, H], down [H, I]) keeps when the engine holds it packed, None
    when it would be dense: as `CausalLM.pack_experts` decides, a bank packs only when all three pieces are
    stored in one kernel format the engine keeps packed (`models/base.py` ENGINE_PACKED_FORMATS: int4, int8,
    NF4, fp8)."""
    from ferrylm.layers.fused_moe import expert_format
    from ferrylm.models.base import ENGINE_PACKED_FORMATS
    from ferrylm.weights.convert import ConvertOptions, quantize_stored, stored_scheme

    opts = ConvertOptions(quant=scheme, group_size=group_size)
    total, fmts = 0, set()
    for name, shape in (("e.gate_proj.weight", (inter, hidden)), ("e.up_proj.weight", (inter, hidden)),
                        ("e.down_proj.weight", (hidden, inter))):
        t = torch.empty(shape, device="meta")
        chosen = stored_scheme(name, t, opts)
        if chosen is None:
            return None
        qt = quantize_stored(t, chosen, opts)
        fmts.add(expert_format(qt))
        total += qt.nbytes
    return total if len(fmts) == 1 and fmts <= ENGINE_PACKED_FORMATS else None


@dataclass(frozen=True)
class WeightFormat:
    """How the engine holds weights: the model dtype, optionally a store's quantized weights."""

    dtype: str = "bfloat16"
    quant: str | None = None
    """A ferry store converted with `--quant` (int8 | fp8 | nf4 | int4 | q8_0): Linear weights stay packed
    (embeddings, LM head, norms and routers stay in high precision), and so do its experts where the engine
    keeps them packed (int4, nf4). None = dense."""
    group_size: int = 64
    """NF4 / int4 group size (`ferry convert --group-size`)."""
    expert_quant: str | None = None
    """The experts' scheme when it differs from `quant` (e.g. a store whose experts alone are NF4); None:
    `quant`'s."""
    fp8_block: int | None = None
    """A block-wise FP8 checkpoint (DeepSeek-V3, Qwen3 FP8; `quant` "fp8"): its blocks' width along K. Its FP8
    weights load as fp8 row groups of that many with an fp32 scale each (`weights/quant.from_fp8_blocks`); a
    weight whose rows are no multiple of it is dequantized at load."""

    dense_params: frozenset = frozenset()
    """Parameter names held dense whatever the store (`tp_dense_params`: a tensor-parallel rank's slice that would
    cut a scale group)."""
    experts_packed: bool = True
    """False: the engine dequantizes the experts at load whatever their scheme (`ModelRunner` packs expert banks
    for a half-precision dtype only: the fused kernel's activations)."""

    @property
    def experts_scheme(self) -> str | None:
        return self.expert_quant or self.quant

    def param_bytes(self, name: str, shape: tuple[int, ...]) -> int:
        """Bytes of one (non-expert) parameter as the engine keeps it: packed where the store quantized it."""
        dense = math.prod(shape) * DTYPE_BYTES[self.dtype]
        if self.quant is None or len(shape) < 2 or name in self.dense_params:
            return dense
        n = stored_bytes(name, tuple(shape), self.quant, self.group_size)
        if n is not None and self.fp8_block and self.quant == "fp8":
            n = fp8_blocks_nbytes(tuple(shape), self.fp8_block)
        return dense if n is None else n

    def expert_bytes(self, inter: int, hidden: int) -> int | None:
        """Bytes of one packed expert, None: the engine holds this bank dense."""
        s = self.experts_scheme
        if not self.experts_packed:
            return None
        if s == "fp8" and self.fp8_block:
            parts = [fp8_blocks_nbytes(shape, self.fp8_block) for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
            return None if None in parts else sum(parts)
        return None if s is None else packed_expert_bytes(inter, hidden, s, self.group_size)


def tp_dense_params(cfg: ModelConfig, fmt: WeightFormat, tp: int, dtype: str = "bfloat16") -> frozenset:
    """Weights a tensor-parallel rank reads dense from a `fmt` store: a row-parallel Linear's whose rank slice of
    columns would cut a scale group (`QuantizedTensor.narrow` of the converter's own quantizer on `meta` says None;
    e.g. Qwen2-72B's down_proj at --tp 4: 7392 columns a rank, NF4 groups of 64). Empty for a model that refuses TP."""
    from ferrylm.errors import ConfigError
    from ferrylm.layers.parallel_linear import RowParallelLinear
    from ferrylm.parallel.group import TPGroup, building
    from ferrylm.weights.convert import ConvertOptions, quantize_stored, stored_scheme

    if tp == 1 or fmt.quant is None:
        return frozenset()
    try:
        with building(TPGroup(0, tp)):
            model = meta_model(cfg, dtype)
    except ConfigError:
        return frozenset()
    opts = ConvertOptions(quant=fmt.quant, group_size=fmt.group_size)
    out = set()
    for name, mod in model.named_modules():
        if not isinstance(mod, RowParallelLinear):
            continue
        t = torch.empty(mod.out_features, mod.in_features * tp, device="meta")
        chosen = stored_scheme(f"{name}.weight", t, opts)
        if chosen is not None and quantize_stored(t, chosen, opts).narrow(1, 0, mod.in_features, False) is None:
            out.add(f"{name}.weight")
    return frozenset(out)


def meta_model(cfg: ModelConfig | dict, dtype: str = "bfloat16") -> nn.Module:
    """The engine's module for `cfg`, built on the meta device with `dtype` as the default dtype (as the
    model runner builds it): exact parameter shapes and dtypes, no memory."""
    from ferrylm.models.registry import model_class

    mc = cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_hf(cfg)
    cls = model_class(mc)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(_DTYPES[dtype])
    try:
        with torch.device("meta"):  # as the model runner builds it
            return cls(mc)
    finally:
        torch.set_default_dtype(prev)


def weight_groups(model: nn.Module, fmt: WeightFormat | None = None) -> list[TensorGroup]:
    """The engine's tensor groups of `model` (built on meta), with bytes as `fmt` holds them (default: as
    built). Quantization re-counts every non-expert group from its parameters' shapes."""
    groups = group_tensors(model)
    if fmt is None or (fmt.quant is None and fmt.expert_quant is None):
        return groups
    params = dict(model.named_parameters(remove_duplicate=False))
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    dense = getattr(model, "dense_linears", ())  # held dense whatever the source (`CausalLM.dense_linears`)

    def nbytes(n: str) -> int:
        held = params[n].numel() * params[n].element_size()  # as built (a router the model keeps in fp32)
        if dense and n.rsplit(".", 2)[-2] in dense:
            return held
        packed = fmt.param_bytes(n, shapes[n])
        return held if packed == math.prod(shapes[n]) * DTYPE_BYTES[fmt.dtype] else packed

    out = []
    for g in groups:
        if g.kind != "experts":
            g = replace(g, nbytes=sum(nbytes(n) for n in g.params))
        else:
            _, two_i, hidden = shapes[g.params[0]]  # w13: [E, 2I, H]
            packed = fmt.expert_bytes(two_i // 2, hidden)
            g = replace(g, nbytes=packed) if packed is not None else g
        out.append(g)
    return out


@dataclass(frozen=True)
class ParamCount:
    total: int
    experts: int
    """Of `total`, the routed experts' parameters."""
    num_experts: int
    top_k: int

    @property
    def active(self) -> int:
        """Parameters one token touches: all but the routed experts it is not sent to."""
        return self.total - self.experts + (self.experts * self.top_k // self.num_experts if self.num_experts else 0)


def param_count(model: nn.Module) -> ParamCount:
    from ferrylm.layers.moe import Experts

    total = sum(p.numel() for p in model.parameters())  # shared (tied) tensors once
    banks = [m for m in model.modules() if isinstance(m, Experts)]
    experts = sum(p.numel() for b in banks for p in b.parameters())
    cfg = getattr(model, "config", None)
    return ParamCount(total, experts, banks[0].num_experts if banks else 0,
                      getattr(cfg, "num_experts_per_tok", 0) if banks else 0)


# -- families without a model class: counted from config.json ---------------------------------------------

def analytical_groups(cfg: dict, fmt: WeightFormat) -> tuple[list[TensorGroup], ParamCount]:
    """DeepSeek-V3 (MLA attention, `first_k_dense_replace` dense layers, shared + routed experts), from
    config.json alone. Per layer: attention = q_a [q_lora, H] + q_a_norm + q_b [heads*(nope+rope), q_lora]
    + kv_a [kv_lora + rope, H] + kv_a_norm + kv_b [heads*(nope+v), kv_lora] + o [H, heads*v]; dense MLP
    3*H*I; router [E, H] (+ E bias); shared experts 3*H*(n_shared*I_moe); each expert 3*H*I_moe. The MTP
    module (num_nextn_predict_layers) is not loaded for serving and not counted."""
    if cfg.get("model_type") not in ("deepseek_v3", "deepseek_v2"):
        raise ValueError(f"no analytical count for model_type {cfg.get('model_type')!r}")
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, ql, kvl = cfg["num_attention_heads"], cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    E, Im, I = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    shared, dense_layers = cfg.get("n_shared_experts") or 0, cfg.get("first_k_dense_replace", 0)
    q = (ql * H + ql + heads * (nope + rope) * ql) if ql else heads * (nope + rope) * H
    attn = q + (kvl + rope) * H + kvl + heads * (nope + vd) * kvl + H * heads * vd
    b = DTYPE_BYTES[fmt.dtype]
    numel = 0

    def g(name, kind, layer, n, quantized=True, expert=None):
        nonlocal numel
        numel += n
        if kind == "experts":
            nbytes = fmt.expert_bytes(Im, H) or n * b
        else:
            nbytes = fmt.param_bytes("x.weight", (n // H, H)) if quantized and fmt.quant else n * b
        return TensorGroup(name, kind, layer, expert, (), nbytes)

    out = [g("embed", "embed", None, V * H, False), g("lm_head", "lm_head", None, V * H, False),
           g("norm", "norm", None, H, False)]
    for i in range(L):
        out += [g(f"layers.{i}.attention", "attention", i, attn), g(f"layers.{i}.norm", "norm", i, 2 * H, False)]
        if i < dense_layers:
            out.append(g(f"layers.{i}.mlp", "mlp", i, 3 * H * I))
            continue
        out += [g(f"layers.{i}.router", "router", i, E * H + E, False),
                g(f"layers.{i}.shared_experts", "shared_experts", i, 3 * H * Im * shared)]
        out += [g(f"layers.{i}.experts.{e}", "experts", i, 3 * H * Im, expert=e) for e in range(E)]
    experts = (L - dense_layers) * E * 3 * H * Im
    return out, ParamCount(numel, experts, E, int(cfg["num_experts_per_tok"]))


def analytical_kv_bytes_per_token(cfg: dict, kv_dtype_bytes: int) -> int:
    """MLA caches the compressed latent and the shared rope key per token and layer: kv_lora + rope values."""
    return cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * kv_dtype_bytes


# -- KV cache and per-sequence state ------------------------------------------------------------------------

def kv_bytes_per_block(mc: ModelConfig, block_size: int, kv_dtype: str, cache_dtype: str = "auto") -> int:
    """The engine's own sizing function (`KVCache.bytes_per_block`); `cache_dtype` fp8 | int8: quantized."""
    from ferrylm.kv.cache import KV_DTYPES, KVCache

    return KVCache.bytes_per_block(mc.num_hidden_layers, block_size, mc.num_key_value_heads, mc.head_dim,
                                   _DTYPES[kv_dtype], mc.v_cache_dim, KV_DTYPES.get(cache_dtype))


def kv_pool(nbytes: int, per_block: int, block_size: int) -> tuple[int, int]:
    """(bytes, tokens) of the pool the engine allocates for a KV budget of `nbytes`: whole blocks
    (`ModelRunner._allocate_kv`) plus `KVCache`'s one scratch block."""
    blocks = nbytes // per_block
    return (blocks + 1) * per_block, blocks * block_size


def state_bytes_per_seq(model: nn.Module) -> int:
    """Per-sequence state that is not KV (Yuan's filter rows), from the model's own `state_specs()`."""
    specs = model.state_specs() if hasattr(model, "state_specs") else None
    if not specs:
        return 0
    return sum(math.prod(shape) * torch.tensor([], dtype=dt).element_size() for shape, dt in specs.values())


def summarize(groups: list[TensorGroup]) -> dict[str, int]:
    """kind -> bytes, in KINDS order (kinds with no group left out)."""
    out = {k: 0 for k in KINDS}
    for g in groups:
        out[g.kind] += g.nbytes
    return {k: v for k, v in out.items() if v}


# -- the warm-up step the CUDA engine measures before sizing its KV pool --------------------------------------

CUBLAS_WORKSPACE_BYTES = 32 * 2**20
"""A cuBLAS workspace the warm-up step allocates through the caching allocator. Measured (H200, session 8,
`bench_plan.py`): the dense and resident MoE warm-ups peak 293.6 and 304.2 MB above what the weights left, which
the live tensors counted below (260 and 270.5 MB) leave at ~33.5 MB, this size; a second one is held from the
load on (`LOAD_WORKSPACE_BYTES`)."""
LOAD_WORKSPACE_BYTES = 32 * 2**20
"""Device bytes the engine holds beyond its placed weights and RoPE table once it has loaded (before the
warm-up): measured 32 MiB (+ 0-5 MiB of expert-cache tables and hand-off buffers when offloaded) in all four
`bench_plan.py` cases on the H200 (session 8), the size of torch's cuBLAS workspace on Hopper. Counted for every
GPU (an older one's is smaller: over-counted there, the safe side)."""


def rope_table_bytes(model: nn.Module | None, cfg: ModelConfig, max_model_len: int) -> int:
    """Device bytes of the RoPE tables the model runner builds before sizing the KV pool
    (`layers/rotary.RotaryEmbedding._table`: [positions, 2, rot] fp32, one per distinct rotary shape, positions
    capped at the engine's context). Counted from the model's own rotary modules, or for a family planned from
    config.json one table of its rotary width."""
    from ferrylm.layers.rotary import RotaryEmbedding

    if model is None:
        rot = int(cfg.raw.get("qk_rope_head_dim") or cfg.head_dim * cfg.partial_rotary_factor)
        return max_model_len * 2 * rot * 4
    # one table per (rotary shape, capped length), as `_table` caches them
    tables = {(m._key, min(m.max_positions, max_model_len)): m.rot_dim for m in model.modules()
              if isinstance(m, RotaryEmbedding)}
    return sum(p * 2 * rot * 4 for (_, p), rot in tables.items())


def step_activation_bytes(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                          elt: int, packed_experts: bool = False, cached_experts: bool = False,
                          round_bank: int | None = None, resident_experts: bool = True,
                          experts_format: str | None = None) -> tuple[int, int]:
    """(estimate, floor) of the device bytes `ModelRunner._warmup_peak` measures: a prefill of the token budget
    T and the logits of min(T, max_num_seqs) rows. The peak is the widest block's live tensors on top of the
    residual stream and the block's normed input: attention (qkv, its rotated q / k, the output), a dense MLP
    (gate_up [T, 2I], act(gate) and its product with up: 4I), fused MoE (`layers/fused_moe.prefill_bytes`, on the
    path `expert_rows` takes for the bank, `packed_experts` or dense, beside the layer's input and attention
    output, which the layer's `post` still holds; router logits fp32; with `cached_experts` (experts in host memory,
    computed in rounds: `offload/expert_cache.CachedExperts._forward_fused`) the running sum of the rounds before
    [T * k, H] beside a round's buffers, which on the kernel path pad the rows over the cache's bank, `round_bank`
    experts (`Placement.largest_cache`) and the skipped id; the larger of that and a resident layer's count while
    `resident_experts`: some MoE layer holds all its experts on the device; a packed bank of `experts_format` that
    the decode kernel computes at this size holds its partials, `fused_moe_decode.decode_bytes`), shared experts as a
    dense MLP; or the
    logits (lm_head
    output and its fp32 copy); plus
    `CUBLAS_WORKSPACE_BYTES`. The floor counts only what must coexist: the widest GEMM's input and output (or
    the logits). `benchmarks/bench_plan.py` prints the measured figure beside it (H200, session 8: dense +2.9%,
    resident MoE within 0.1% of this count; H100, sessions 25 and 29 replayed: offloaded Qwen3 bf16 -3.0%, NF4 Mixtral
    -0.0%, `tests/test_plan.py`)."""
    T = min(max_num_batched_tokens, max_model_len)
    S = min(T, max_num_seqs)
    H, D, h, hk = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, max(1, cfg.num_key_value_heads)
    qkv = (h + 2 * hk) * D
    widths = [(qkv + (h + hk) * D + h * D, qkv)]  # (live width, widest GEMM output), per token
    moe_layers = cfg.num_experts and cfg.moe_intermediate_size
    dense_layers = cfg.intermediate_size and (not moe_layers or cfg.mlp_only_layers or cfg.decoder_sparse_step > 1
                                              or cfg.raw.get("first_k_dense_replace"))
    if dense_layers:
        widths.append((4 * cfg.intermediate_size, 2 * cfg.intermediate_size))
    if moe_layers:
        from ferrylm.layers.fused_moe import padded_rows, prefill_bytes, prefill_path
        from ferrylm.layers.fused_moe_decode import taken_by_format
        from ferrylm.offload.memory import kernel_format

        k, E, I = max(cfg.num_experts_per_tok, 1), cfg.num_experts, cfg.moe_intermediate_size
        A = T * k
        fmt = kernel_format(experts_format) if packed_experts else None
        resident = prefill_bytes(A, E, H, I, elt, packed_experts, fmt, k)
        if not cached_experts:
            moe = resident
        elif fmt is not None and prefill_path(A, E, I, True) != "dequant" and taken_by_format(fmt, T):
            moe = resident + A * H * elt  # a round's partials over every assignment, the running sum beside
        elif prefill_path(A, E, I, packed_experts) != "dequant":  # (a round never takes "grouped")
            # a round on the kernel: its rows padded over the cache's bank and the skipped id, the running sum beside
            moe = (padded_rows(A, (round_bank or E) + 1) * (I + H) + 2 * A * H) * elt
        else:  # rounds decoding each expert once: their running sum [T * k, H] beside a round's buffers
            moe = resident + A * H * elt
        if cached_experts and resident_experts:  # a layer held whole runs the resident path in the same step
            moe = max(moe, resident)
        widths.append((2 * H + moe // (T * elt) + E * 4 // elt, k * I))
    if cfg.shared_expert_intermediate_size:
        widths.append((4 * cfg.shared_expert_intermediate_size, 2 * cfg.shared_expert_intermediate_size))
    logits = S * cfg.vocab_size * (elt + 4)
    estimate = max(T * elt * (2 * H + max(w for w, _ in widths)), logits + T * H * elt) + CUBLAS_WORKSPACE_BYTES
    floor = max(T * elt * (H + max(g for _, g in widths)), logits)
    return estimate, floor
