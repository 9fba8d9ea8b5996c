"""Yuan2.0 (2B / 51B / 102B, dense) and Yuan2.0-M32 (MoE with the attention router): one family, one file.

Both share the decoder layer. Attention is *localized-filtering* (LF) attention: Q and K come from
`LF(x) = RMSNorm_lf(conv2(conv1(x)) + x)`, where conv1 (H -> H/2) and conv2 (H/2 -> H) are causal 2-tap
convolutions over the token axis with bias and zero left padding; V comes from the unfiltered x.
`cat(q_proj(lf), k_proj(lf))` is read per head as [nh, 2 * hd]: the first hd values are that head's query,
the next hd its key. M32 differs only in its sizes (head_dim = attention_projection_size / nh, RoPE over
the first hidden / nh features of each head) and in its MLP: every layer is a 32-expert top-2 MoE whose
router is itself a tiny attention over experts.

The filter makes decoding stateful beyond KV: token t needs x[t-1] and conv1's output o1[t-1]. Those live
per sequence and layer in the engine's `SequenceStatePool` (`state_specs()`), 1.5 * H values per layer.
The state is read only when a step continues a sequence (`start_pos > 0`); a sequence that starts at
token 0 (new, or recomputed after preemption) uses the zero padding and never reads its row, so a row
left over from an earlier owner cannot leak. Prefill chunks carry it across steps like a decode does.
The model never sees forks: a forked sequence owns its own row (`SequenceStatePool.copy`).
Decode steps are CUDA-graph safe: a graphed step hands the state rows over as a device tensor
(`ForwardContext.state_rows`), the filter state is gathered and written in place with index_select /
index_copy_, and padded rows of a batch bucket read and write the pool's scratch row (`LFBatch`).

Choices that differ from a reference and why:
- `rope_dtype` (model option, `EngineConfig.model_overrides={"rope_dtype": ...}`). The M32 HF file builds
  its RoPE tables in bf16 (inv_freq, positions and the angle product all rounded to bf16; even
  `arange(bf16)` merges positions past 256). "bfloat16" reproduces that bit for bit and is what the
  golden test uses. The default is "float32", the table the vendor's own vLLM port builds: it is what
  the served M32 runs, it keeps every position of the 4k context distinct, and it is the same math as
  the training side's fp32 RoPE. The dense HF file is fp32 already, so fp32 is right for it too.
- Eod masking: the dense config says `reset_attention_mask=true`, which the HF *eager* path honours
  (rows after an `<eod>` cannot see columns up to it), but the path the real config serves
  (`use_flash_attention=true`) applies plain causal attention. We serve plain causal: it is the
  published serving behaviour, and an eod-aware mask would need a per-sequence segment mask inside paged
  attention for every step. Positions are never reset at eod in either reference, nor here. M32's config
  has `reset_attention_mask=false`, so both of its paths are plain causal anyway.

Notation: T tokens in the step, B sequences, H hidden, nh heads, hd head dim, P = nh * hd, E experts.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ConfigError
from ferrylm.layers import fused_ops
from ferrylm.layers.activation import get_act
from ferrylm.layers.attention import PagedAttention
from ferrylm.layers.context import get_forward_context
from ferrylm.layers.embedding import ParallelLMHead, ParallelVocabEmbedding, TiedLMHead
from ferrylm.layers.linear import Linear
from ferrylm.layers.moe import route
from ferrylm.layers.parallel_experts import SKIP, ParallelExperts, expert_bank
from ferrylm.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, StackedParallelLinear
from ferrylm.layers.norm import RMSNorm
from ferrylm.layers.rotary import RotaryEmbedding
from ferrylm.layers.transfer import to_device
from ferrylm.models.base import CausalLM
from ferrylm.parallel.group import current_group

log = logging.getLogger(__name__)

LF_NORM_EPS = 1e-6
"""The reference builds the LF output norm with its default eps, not `rms_norm_eps`."""

_ROPE_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_CONV = re.compile(r"\.lf_gate\.conv[12]\.weight$")
_W1 = re.compile(r"^(.*\.experts)\.(\d+)\.w1\.weight$")


# -- config -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class YuanShape:
    """The family-specific sizes, read from `ModelConfig.raw` (HF `YuanConfig` key names)."""

    hidden: int
    heads: int
    head_dim: int
    """attention_projection_size / heads (M32), hidden / heads (dense)."""
    rot_dim: int
    """hidden / heads in both: all of a dense head, the first half of an M32 head."""
    num_experts: int
    top_k: int
    expert_ffn: int
    norm_topk_prob: bool
    tied: bool

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "YuanShape":
        raw = cfg.raw
        heads = cfg.num_attention_heads
        proj = int(raw.get("attention_projection_size") or cfg.hidden_size)
        moe = raw.get("moe_config") or {}
        use_moe = bool(raw.get("use_moe", False)) and int(moe.get("moe_num_experts") or 0) > 0
        if use_moe and not moe.get("gated_linear_unit", True):
            raise ConfigError("Yuan M32 without gated_linear_unit is not supported")
        return cls(
            hidden=cfg.hidden_size, heads=heads, head_dim=proj // heads, rot_dim=cfg.hidden_size // heads,
            num_experts=int(moe.get("moe_num_experts") or 0) if use_moe else 0,
            top_k=int(moe.get("moe_top_k") or 2) if use_moe else 0,
            expert_ffn=int(moe.get("ffn_hidden_size") or 0) if use_moe else 0,
            norm_topk_prob=bool(moe.get("norm_topk_prob", True)),
            # YuanConfig's default is tied, and save_pretrained drops keys equal to the default
            tied=bool(raw.get("tie_word_embeddings", True)),
        )


# -- per-step filter bookkeeping --------------------------------------------------------------------------

@dataclass
class LFBatch:
    """Where each sequence's rows sit in the flat batch and where its filter state lives, built once a step.

    Two ways to build it. A step described on the host (`state_slots`, `start_pos`, `query_start_loc`)
    uploads those lists. A pure decode step whose context carries `state_rows` (CUDA-graph decode) reads
    nothing of the host: one row per sequence, rows from `state_rows`, "continues" from the device's
    `decode_seq_lens` (> 1), so a captured graph stays valid as sequences join, leave and reuse slots.
    """

    first: torch.Tensor | None
    """[B] long: row of each sequence's first token in this step (None for a device-built decode step)."""
    last: torch.Tensor | None
    """[B] long: row of its last token (the state to keep)."""
    cont: torch.Tensor
    """[B, 1] bool: the sequence continues (start_pos > 0), so its first token reads the stored state."""
    slots: torch.Tensor | None
    """[B] long: rows in the state pool; None when the step runs without a pool (fresh prefills only)."""
    state: object | None
    decode: bool = False
    """One token per sequence (T == B) and every input a device tensor: `shift` is two gathers and a copy."""

    @classmethod
    def from_context(cls, device: torch.device) -> "LFBatch":
        ctx = get_forward_context()
        if ctx.state_rows is not None:
            if ctx.num_decodes != ctx.num_seqs or ctx.state is None:
                raise RuntimeError("Yuan: state_rows is for a pure decode step over a state pool")
            return cls(first=None, last=None, cont=(ctx.decode_seq_lens > 1)[:, None], slots=ctx.state_rows,
                       state=ctx.state, decode=True)
        qsl = ctx.query_start_loc
        cont = [s > 0 for s in ctx.start_pos]
        has_pool = ctx.state is not None and all(s is not None for s in ctx.state_slots)
        if any(cont) and not has_pool:
            raise RuntimeError("Yuan: a step continues a sequence but the context has no filter state slot")
        return cls(
            first=to_device(qsl[:-1], device),  # through pinned memory: no stream sync at the step's start
            last=to_device(qsl[1:], device) - 1,
            cont=to_device(cont, device, torch.bool)[:, None],
            slots=to_device(ctx.state_slots, device) if has_pool else None,
            state=ctx.state if has_pool else None,
        )

    def shift_cat(self, x: torch.Tensor, name: str, layer: int) -> torch.Tensor:
        """[T, 2C] = [`shift(x)` | x], the conv's input; a decode step on CUDA does it in one launch."""
        if self.decode and fused_ops.usable(x):
            store = self.state[name].select(1, layer)  # [slots + 1, C]
            if fused_ops.lf_shift_fits(x, store):
                return fused_ops.lf_shift(x, store, self.slots, self.cont)
        return torch.cat((self.shift(x, name, layer), x), dim=-1)

    def shift(self, x: torch.Tensor, name: str, layer: int) -> torch.Tensor:
        """x: [T, C] -> the previous token's row of x for every token, then keep each sequence's last row.

        Inside a sequence's chunk the previous row is x[t-1]; at its first row it is the stored state of
        that sequence (continuing) or 0 (the reference's zero padding at token 0).
        """
        if self.decode:  # T == B: each row's previous token is its stored state
            store = self.state[name].select(1, layer)  # [slots + 1, C], a view of the pool
            stored = store.index_select(0, self.slots)  # [B, C], read before this step's rows overwrite it
            store.index_copy_(0, self.slots, x)  # padded rows all land on the scratch row
            return torch.where(self.cont, stored, torch.zeros_like(stored))
        prev = torch.empty_like(x)
        prev[1:] = x[:-1]
        if self.state is None:
            prev[self.first] = 0
            return prev
        store = self.state[name]  # [slots, L, C]
        stored = store[self.slots, layer]  # [B, C]
        prev[self.first] = torch.where(self.cont, stored, torch.zeros_like(stored))
        store[self.slots, layer] = x[self.last]
        return prev


# -- layers -----------------------------------------------------------------------------------------------

class LocalizedFilter(nn.Module):
    """LF(x) = RMSNorm(conv2(conv1(x)) + x), both convs causal 2-tap with zero left padding.

    The checkpoint's Conv2d weights [out, in, 2, 1] are stored as one Linear over [x[t-1], x[t]]:
    weight [out, 2 * in] = [tap 0 | tap 1], so each conv is one matmul.
    """

    def __init__(self, hidden: int, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.conv1 = Linear(2 * hidden, hidden // 2, bias=True)
        self.conv2 = Linear(hidden, hidden, bias=True)
        self.output_layernorm = RMSNorm(hidden, LF_NORM_EPS)

    @staticmethod
    def conv_weight(w: torch.Tensor) -> torch.Tensor:
        # w: [out, in, 2, 1] (tap 0 reads t-1, tap 1 reads t) -> [out, 2 * in]
        return w[..., 0].permute(0, 2, 1).reshape(w.shape[0], 2 * w.shape[1])

    def forward(self, x: torch.Tensor, lf: LFBatch) -> torch.Tensor:
        # x: [T, H]
        i = self.layer_idx
        o1 = self.conv1(lf.shift_cat(x, "lf_x", i))  # [T, H/2]
        o2 = self.conv2(lf.shift_cat(o1, "lf_o1", i))  # [T, H]
        return self.output_layernorm.add_forward(o2, x)[1]  # norm(o2 + x), one launch on CUDA


class BF16RefRotary(RotaryEmbedding):
    """The M32 HF reference's RoPE table: inv_freq, positions, angles and cos/sin all computed in bf16."""

    def _build(self, device: torch.device) -> torch.Tensor:
        inv_freq = self.inv_freq.to(device).float().to(torch.bfloat16)  # [rot/2]
        t = torch.arange(self.max_positions, dtype=torch.bfloat16, device=device)  # merges positions past 256, as the reference does
        freqs = torch.einsum("i,j->ij", t, inv_freq)  # [P, rot/2] bf16
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, rot]
        return torch.stack((emb.cos(), emb.sin())).float().transpose(0, 1).contiguous()  # [P, 2, rot]


class YuanAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, shape: YuanShape, layer_idx: int, rope_dtype: torch.dtype):
        super().__init__()
        # this tensor-parallel rank's heads (all of them in one process); the filter is replicated
        self.nh, self.hd = current_group().split(shape.heads, "attention heads"), shape.head_dim
        proj, H = shape.heads * self.hd, shape.hidden
        # q_proj and k_proj fused into one matmul (the loader fills the shards; v reads another input); a
        # head reads 2 hd rows of the [q_proj; k_proj] stack, so ranks split the stack, not each shard
        self.qkv_proj = StackedParallelLinear(H, {"q": proj, "k": proj})
        self.v_proj = ColumnParallelLinear(H, proj)
        self.o_proj = RowParallelLinear(proj, H)
        self.lf_gate = LocalizedFilter(H, layer_idx)
        rotary_cls = BF16RefRotary if rope_dtype == torch.bfloat16 else RotaryEmbedding
        self.rotary = rotary_cls(self.hd, shape.rot_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.attn = PagedAttention(layer_idx, self.nh, self.nh, self.hd, scale=self.hd ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, lf: LFBatch) -> torch.Tensor:
        # x: [T, H] (already input-normed)
        f = self.lf_gate(x, lf)  # [T, H]
        qk = self.qkv_proj(f).view(-1, self.nh, 2 * self.hd)  # [T, nh, 2hd] = cat(q_proj(f), k_proj(f))
        q, k = qk.split(self.hd, dim=-1)  # [T, nh, hd] each: per-head interleave, not a q/k split
        v = self.v_proj(x).view(-1, self.nh, self.hd)  # V from the unfiltered input
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q.contiguous(), k.contiguous(), v))


class YuanMLP(nn.Module):
    """down(gate(x) * act(up(x))): Yuan puts the activation on up_proj, not gate_proj."""

    def __init__(self, hidden: int, inter: int, act: str):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, 2 * inter, shards={"up": (0, inter), "gate": (inter, inter)})
        self.inter = self.gate_up_proj.shards["up"][1]  # this tensor-parallel rank's share
        self.down_proj = RowParallelLinear(inter, hidden)
        self.act = get_act(act)
        self.silu = act in ("silu", "swish")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ug = self.gate_up_proj(x)  # [T, 2I]: up, gate
        if self.silu and ug.dim() == 2 and fused_ops.usable(ug):
            return self.down_proj(fused_ops.silu_mul(ug))  # silu(up) * gate in one launch, as torch rounds
        up, gate = ug.split(self.inter, dim=-1)  # [T, I] each
        return self.down_proj(gate * self.act(up))


class AttentionRouter(nn.Module):
    """M32's router: per token, attention over the E experts, in fp32.

    q, k, v = query(x), key(x), value(x) (each [E]); A = softmax_j(q_i * k_j) (no scaling);
    router_logits = A @ v. The three weights are kept once more as one fp32 [3E, H] matrix (`finish_load`): one
    matmul a layer instead of three matmuls and three weight casts (0.8 MB a layer at M32's shape).
    """

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.query = Linear(hidden, num_experts)
        self.key = Linear(hidden, num_experts)
        self.value = Linear(hidden, num_experts)
        self.qkv32: torch.Tensor | None = None

    def finish_load(self) -> None:
        """Called once every checkpoint tensor is in and every Linear finished (`CausalLM.load_weights`). The copy
        is a plain attribute, not a buffer: the planner's weight count leaves out its ~0.8 MB a layer."""
        held = not any(m.weight.is_meta and not m.kernels for m in (self.query, self.key, self.value))
        self.qkv32 = self._weight32() if held else None  # (None: a layer another pipeline stage holds)

    def _weight32(self) -> torch.Tensor:
        return torch.cat([m.dense_weight(torch.float32).detach() for m in (self.query, self.key, self.value)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> router logits [T, E] fp32
        x, E = x.float(), self.query.out_features
        w = self.qkv32
        if w is None or w.device != x.device:  # (a layer streamed in from the host tier brings its own weights)
            w = self._weight32()
        qkv = F.linear(x, w)  # [T, 3E]
        if fused_ops.usable(qkv) and fused_ops.attention_router_fits(qkv, E):
            return fused_ops.attention_router(qkv, E)  # the rest in one launch
        q, k, v = qkv.split(E, dim=-1)  # [T, E] each
        a = torch.softmax(torch.bmm(q[:, :, None], k[:, None, :]), dim=-1)  # [T, E, E]
        v = v[:, :, None]  # [T, E, 1]
        return torch.bmm(a, v)[:, :, 0]  # [T, E]


class YuanMoE(nn.Module):
    """Every M32 layer: attention router, top-k of its softmax renormalised, gated experts (w1 = [gate; up])."""

    def __init__(self, cfg: ModelConfig, shape: YuanShape):
        super().__init__()
        self.top_k, self.normalize = shape.top_k, shape.norm_topk_prob
        self.gate = AttentionRouter(shape.hidden, shape.num_experts)
        self.experts = expert_bank(shape.num_experts, shape.hidden, shape.expert_ffn, cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]
        weights, ids = route(self.gate(x), self.top_k, self.normalize)  # [T, k]
        return self.experts(x, ids, weights)


class YuanDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shape: YuanShape, layer_idx: int, rope_dtype: torch.dtype):
        super().__init__()
        self.self_attn = YuanAttention(cfg, shape, layer_idx, rope_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (YuanMoE(cfg, shape) if shape.num_experts
                    else YuanMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act))

    def forward(self, positions: torch.Tensor, h: torch.Tensor, lf: LFBatch) -> torch.Tensor:
        h, x = self.post_attention_layernorm.add_forward(self.self_attn(positions, self.input_layernorm(h), lf), h)
        return h + self.mlp(x)


class YuanModel(nn.Module):
    def __init__(self, cfg: ModelConfig, shape: YuanShape, rope_dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = ParallelVocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(YuanDecoderLayer(cfg, shape, i, rope_dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class YuanForCausalLM(CausalLM):
    """Yuan2.0 dense and Yuan2.0-M32 (selected by `use_moe` / `moe_config` in config.json).

    Options (`EngineConfig.model_overrides`): `rope_dtype` "float32" (default) or "bfloat16" (the M32 HF
    reference's tables, see the module docstring).
    """

    cuda_graphs = True  # graph-safe (tests/test_decode_graphs.py on the CPU); on the H200 (session 7) graphed decode
    # equals eager bit for bit, dense fp32 and M32 bf16, and a graphed step launches without a sync (test_cuda.py)
    expert_w1_stacked = True
    """M32 checkpoints hold each expert's gate and up rows stacked in one `w1` ([2I, H]) and no `w3`."""
    """Decode reads no host values when the step carries `state_rows` (`LFBatch`); M32 needs a graph-safe
    expert backend too (`CausalLM.graph_safe`)."""
    tensor_parallel = True
    """Heads, MLP, experts and vocabulary sharded; each rank runs the (small) LF filter and the attention
    router on the whole hidden state, so its filter state is its own full copy (docs/parallel.md)."""

    def __init__(self, cfg: ModelConfig, rope_dtype: str | torch.dtype = "float32"):
        super().__init__()
        if isinstance(rope_dtype, str):
            try:
                rope_dtype = _ROPE_DTYPES[rope_dtype]
            except KeyError:
                raise ConfigError(f"Yuan rope_dtype {rope_dtype!r}: choose float32 or bfloat16") from None
        if rope_dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"Yuan rope_dtype {rope_dtype}: choose float32 or bfloat16")
        shape = YuanShape.from_config(cfg)
        assert cfg.head_dim == shape.head_dim, "ModelConfig.from_hf reads attention_projection_size"
        if cfg.raw.get("reset_attention_mask"):
            log.info("Yuan: reset_attention_mask is set; serving plain causal attention (the flash path)")
        self.config, self.shape, self.rope_dtype = cfg, shape, rope_dtype
        self.model = YuanModel(cfg, shape, rope_dtype)
        self.tied = shape.tied
        if self.tied:  # the embedding table's own matmul
            self.lm_head = TiedLMHead(self.model.embed_tokens)
        else:
            self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)

    def _tp_part(self, name: str, params):
        if m := _W1.match(name):  # stacked [gate; up]: read whole, split by `shard_gate_up` (experts of
            bank = self.get_submodule(m[1])  # another rank are not read at all)
            return SKIP if isinstance(bank, ParallelExperts) and bank.tp_part(int(m[2]), "gate") == SKIP else None
        return super()._tp_part(name, params)

    def begin_step(self, device: torch.device) -> LFBatch:
        return LFBatch.from_context(device)

    def run_layer(self, i: int, positions: torch.Tensor, h: torch.Tensor, lf: LFBatch) -> torch.Tensor:
        return self.model.layers[i](positions, h, lf)

    def state_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per sequence: the last filter input x (H) and the last conv1 output (H/2), for every layer."""
        L, H = self.config.num_hidden_layers, self.shape.hidden
        dtype = self.model.embed_tokens.weight.dtype
        return {"lf_x": ((L, H), dtype), "lf_o1": ((L, H // 2), dtype)}

    def map_weight(self, name: str, tensor: torch.Tensor) -> bool | set[str]:
        if _CONV.search(name) and len(tensor.shape) == 4:  # Conv2d [out, in, 2, 1] -> Linear [out, 2 * in]
            # (a 2-D tensor is in the Linear's layout already: a source of this model's own names)
            self.get_submodule(name.rsplit(".", 1)[0]).load("weight", LocalizedFilter.conv_weight(tensor))
            return True
        if m := _W1.match(name):  # M32's w1 is [gate; up] stacked already
            bank = self.get_submodule(m[1])
            if isinstance(bank, ParallelExperts):  # its own index and share
                e, tensor = int(m[2]) - bank.first_expert, bank.shard_gate_up(tensor)
            else:
                e = int(m[2])
            bank.load(e, "gate_up", tensor)
            return {f"{m[1]}:{e}:gate_up"}
        # A tied checkpoint may still carry lm_head.weight (a copy of the embeddings): nothing to do.
        return self.tied and name == "lm_head.weight"

