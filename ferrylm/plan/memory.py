"""The memory model: bytes of every tensor group of a model, of KV per token and of per-sequence state,
counted from the model itself so that the planner and the engine agree by construction.

`meta_model(cfg)` builds the engine's own module (`models.registry.model_class`) on the `meta` device:
no memory, exact shapes. `tensor_groups(model)` cuts its parameters into the groups placement works
with: `embed`, `lm_head`, and per layer `attention`, `norm`, `router`, `shared_experts`, `mlp` (dense) and
one group per expert. `WeightFormat` says how many bytes a parameter takes as the engine holds it (model
dtype, or quantized Linear weights from a ferry store; experts stay dense, as `layers/moe.py` keeps them).
KV bytes come from `KVCache.bytes_per_block`, the function the engine sizes its pool with.

Families without a model class (DeepSeek-V3) are counted analytically from config.json (`analytical_groups`,
formulas below) so they can still be planned; those counts are checked against published totals only.
Knows nothing about hardware or speed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from ferrylm.config import ModelConfig

KINDS = ("embed", "lm_head", "attention", "norm", "router", "shared_experts", "mlp", "experts")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TensorGroup:
    """Parameters that are placed together."""

    name: str
    """e.g. `embed`, `layers.3.attention`, `layers.3.experts.5`."""
    kind: str
    """One of KINDS."""
    layer: int | None
    expert: int | None
    params: tuple[str, ...]
    """Parameter names (an expert owns row `expert` of its bank's parameters)."""
    numel: int
    nbytes: int
    """As the engine holds it (see `WeightFormat`)."""


@dataclass(frozen=True)
class WeightFormat:
    """How the engine holds weights: the model dtype, optionally with quantized Linear weights."""

    dtype: str = "bfloat16"
    quant: str | None = None
    """int8 | fp8 | nf4 (a ferry store converted with --quant), None = dense."""
    group_size: int = 64
    """NF4 group size."""

    def param_bytes(self, name: str, shape: tuple[int, ...], expert_bank: bool = False) -> int:
        """Bytes of one parameter. Quantized as `weights/convert.py` quantizes (2-D+, not embeddings, LM
        head, norms or routers) and as the engine keeps it (Linear weights packed, expert banks dense)."""
        numel = math.prod(shape)
        dense = numel * DTYPE_BYTES[self.dtype]
        if self.quant is None or expert_bank or len(shape) < 2:
            return dense
        from ferrylm.weights.convert import high_precision

        if high_precision(name):
            return dense
        rows = numel // shape[-1]
        if self.quant in ("int8", "fp8"):
            return numel + 4 * rows  # 1-byte codes + one fp32 scale per output channel
        if self.quant == "nf4":
            groups = -(-numel // self.group_size)
            return groups * self.group_size // 2 + 4 * groups  # two codes a byte + one fp32 absmax per group
        raise ValueError(f"unknown quantization {self.quant!r}")


def meta_model(cfg: ModelConfig | dict, dtype: str = "bfloat16") -> nn.Module:
    """The engine's module for `cfg`, built on the meta device with `dtype` as the default dtype (as the
    model runner builds it): exact parameter shapes and dtypes, no memory."""
    from ferrylm.models.registry import model_class

    mc = cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_hf(cfg)
    cls = model_class(mc)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(_DTYPES[dtype])
    try:
        try:
            with torch.device("meta"):
                return cls(mc)
        except NotImplementedError:  # a module computes tables from meta tensors in __init__: see below
            return _params_on_meta(cls, mc)
    finally:
        torch.set_default_dtype(prev)


def _params_on_meta(cls, mc: ModelConfig) -> nn.Module:
    """Build on the CPU with every parameter moved to meta as it is registered (buffers such as RoPE tables
    stay real). `torch.empty` of a parameter is never touched before the move, so it costs no memory.
    TODO: drop once every module builds under `torch.device("meta")` (the lead's meta-build change)."""
    orig = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":  # tied weights arrive already on meta
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        orig(self, name, param)

    nn.Module.register_parameter = register
    try:
        return cls(mc)
    finally:
        nn.Module.register_parameter = orig


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def _kind(rest: str, layer: int | None, is_norm: bool, has_bank: bool) -> str:
    if is_norm:
        return "norm"
    if layer is None:
        return "embed" if "embed" in rest else "lm_head" if rest.startswith("lm_head") else "norm"
    if "shared_expert" in rest:
        return "shared_experts"
    if rest.startswith("self_attn."):
        return "attention"
    if has_bank and re.match(r"^[^.]+\.gate(\.|$)", rest):
        return "router"
    return "mlp"


def tensor_groups(model: nn.Module, fmt: WeightFormat | None = None) -> list[TensorGroup]:
    """The model's parameters as tensor groups, with bytes as `fmt` holds them (default: as they are).
    Works on a model built on `meta`. A tied LM head is one tensor: it appears once, as `lm_head` (it must
    sit where the head runs)."""
    from ferrylm.layers.moe import Experts
    from ferrylm.layers.norm import RMSNorm

    def nbytes(name: str, p: torch.Tensor, bank: bool = False) -> int:
        if fmt is None:
            return p.numel() * p.element_size()
        return fmt.param_bytes(name, tuple(p.shape), expert_bank=bank)

    banks = {name: m for name, m in model.named_modules() if isinstance(m, Experts)}
    norms = {name for name, m in model.named_modules() if isinstance(m, RMSNorm)}
    bank_layers = {int(m[1]) for b in banks if (m := _LAYER.match(b + "."))}
    plain: dict[tuple[str, int | None], list[tuple[str, int, int]]] = {}
    for pname, p in model.named_parameters():  # shared (tied) tensors appear once
        mod = pname.rpartition(".")[0]
        if mod in banks:
            continue
        m = _LAYER.match(pname)
        layer = int(m[1]) if m else None
        kind = _kind(m[2] if m else pname, layer, mod in norms, layer in bank_layers)
        plain.setdefault((kind, layer), []).append((pname, p.numel(), nbytes(pname, p)))
    groups = []
    tied = getattr(model, "tied", None)
    if tied is None:
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for (kind, layer), ps in plain.items():
        if tied and kind == "embed":
            kind = "lm_head"
        name = kind if layer is None else f"layers.{layer}.{kind}"
        groups.append(TensorGroup(name, kind, layer, None, tuple(n for n, _, _ in ps),
                                  sum(n for _, n, _ in ps), sum(b for _, _, b in ps)))
    for bname, bank in banks.items():
        layer = int(_LAYER.match(bname + ".")[1])
        ps = [(f"{bname}.{n}", p) for n, p in bank.named_parameters()]
        E = bank.num_experts
        numel = sum(p.numel() for _, p in ps) // E
        per = sum(nbytes(n, p, bank=True) for n, p in ps) // E
        for e in range(E):
            groups.append(TensorGroup(f"layers.{layer}.experts.{e}", "experts", layer, e,
                                      tuple(n for n, _ in ps), numel, per))
    return groups


# -- families without a model class: counted from config.json ---------------------------------------------

def analytical_groups(cfg: dict, fmt: WeightFormat) -> list[TensorGroup]:
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

    def g(name, kind, layer, numel, quantized=True, expert=None):
        nbytes = fmt.param_bytes("x.weight", (numel // H, H)) if quantized and fmt.quant else numel * b
        return TensorGroup(name, kind, layer, expert, (), numel, nbytes)

    out = [g("embed", "embed", None, V * H, False), g("lm_head", "lm_head", None, V * H, False),
           g("norm", "norm", None, H, False)]
    for i in range(L):
        out += [g(f"layers.{i}.attention", "attention", i, attn), g(f"layers.{i}.norm", "norm", i, 2 * H, False)]
        if i < dense_layers:
            out.append(g(f"layers.{i}.mlp", "mlp", i, 3 * H * I))
            continue
        out += [g(f"layers.{i}.router", "router", i, E * H + E, False),
                g(f"layers.{i}.shared_experts", "shared_experts", i, 3 * H * Im * shared)]
        out += [TensorGroup(f"layers.{i}.experts.{e}", "experts", i, e, (), 3 * H * Im, 3 * H * Im * b)
                for e in range(E)]
    return out


def analytical_kv_bytes_per_token(cfg: dict, kv_dtype_bytes: int) -> int:
    """MLA caches the compressed latent and the shared rope key per token and layer: kv_lora + rope values."""
    return cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * kv_dtype_bytes


# -- KV cache and per-sequence state ------------------------------------------------------------------------

def kv_bytes_per_block(mc: ModelConfig, block_size: int, kv_dtype: str) -> int:
    """The engine's own sizing function (`KVCache.bytes_per_block`)."""
    from ferrylm.kv.cache import KVCache

    return KVCache.bytes_per_block(mc.num_hidden_layers, block_size, mc.num_key_value_heads, mc.head_dim,
                                   _DTYPES[kv_dtype])


def kv_pool_bytes(mc: ModelConfig, num_blocks: int, block_size: int, kv_dtype: str) -> int:
    """What `KVCache(num_blocks)` allocates: the blocks plus its one scratch block."""
    return (num_blocks + 1) * kv_bytes_per_block(mc, block_size, kv_dtype)


KV_SHARE = 0.85
"""Share of the device memory free after loading that the KV pool takes when no size is given."""
CPU_KV_CAP = 2 * 2**30
"""On the CPU the pool holds every sequence at full length, capped at this many bytes."""


def kv_pool_blocks(per_block: int, *, num_blocks: int | None = None, memory_gb: float | None = None,
                   free_bytes: int | None = None, max_num_seqs: int = 1, max_model_len: int = 1,
                   block_size: int = 16) -> int:
    """Blocks in the KV pool, by the engine's rule (`engine/model_runner.py` `_allocate_kv`): an explicit
    count, else `memory_gb`, else KV_SHARE of the device's free memory (`free_bytes`, CUDA), else (CPU)
    every sequence at full length capped at CPU_KV_CAP.
    TODO(lead): have `_allocate_kv` call this, so the engine and the planner share the rule, not a copy."""
    if num_blocks is not None:
        return num_blocks
    if memory_gb is not None:
        return int(memory_gb * 2**30 // per_block)
    if free_bytes is not None:
        return int(KV_SHARE * free_bytes // per_block)
    need = max_num_seqs * -(-max_model_len // block_size)
    return min(need, CPU_KV_CAP // per_block)


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
