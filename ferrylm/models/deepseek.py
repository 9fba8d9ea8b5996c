"""DeepSeek-V2 and V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): multi-head latent attention
(MLA) and a routed + shared expert MoE after `first_k_dense_replace` dense layers.

MLA runs in its absorbed form, as one query head group over a single cached row per token: the row is
c = RMSNorm(latent) [R] followed by the rotated shared rope key [r] (`KVCache` with one head of R + r
features and no V). Per head h, with kv_b_proj split into W_UK[h] [n, R] and W_UV[h] [v, R]:
  score = (q_nope W_UK[h]) . c + q_pe . k_pe   and   out = (softmax @ c) W_UV[h]^T,
which equals decompressing K/V first (transformers' way) but caches R + r values per token instead of
H * (n + r + v). Routing: V2 fp32 softmax, greedy or group-limited; V3 sigmoid with
`e_score_correction_bias` choosing experts, groups ranked by their two best scores. Both scale the
weights by `routed_scaling_factor`. Notation: T tokens, H heads, n/r/v nope/rope/value head dims,
R kv_lora_rank.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.errors import ConfigError
from ferrylm.layers.attention import PagedAttention
from ferrylm.layers.linear import Linear
from ferrylm.layers.moe import Experts, route_group_limited, route_sigmoid_biased
from ferrylm.layers.norm import RMSNorm
from ferrylm.layers.rotary import RotaryEmbedding
from ferrylm.models.base import CausalLM
from ferrylm.models.llama import GatedMLP

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class DeepseekShape:
    """The family's own config.json fields (HF names), checked once."""

    v3: bool
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    group_limited: bool
    """V2's `topk_method`: group_limited_greedy (True) or greedy."""
    rope_interleave: bool

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "DeepseekShape":
        raw, v3 = cfg.raw, cfg.model_type == "deepseek_v3"
        method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        allowed = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
        if method not in allowed:
            raise ConfigError(f"unsupported topk_method {method!r} for {cfg.architecture}; supported: {', '.join(allowed)}")
        scoring = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
        if scoring != ("sigmoid" if v3 else "softmax"):
            raise ConfigError(f"unsupported scoring_func {scoring!r} for {cfg.architecture}")
        n_group = int(raw.get("n_group") or 1)
        if cfg.num_experts % n_group:
            raise ConfigError(f"n_routed_experts ({cfg.num_experts}) is not a multiple of n_group ({n_group})")
        return cls(
            v3=v3, q_lora_rank=raw.get("q_lora_rank"), kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw.get("qk_nope_head_dim", 128)), qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw.get("v_head_dim", 128)), n_routed_experts=cfg.num_experts,
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            first_k_dense_replace=int(raw.get("first_k_dense_replace", 3 if v3 else 0)),
            n_group=n_group, topk_group=int(raw.get("topk_group") or 1),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
            group_limited=method == "group_limited_greedy",
            # V2's reference rotates interleaved pairs (complex form); V3 says so with rope_interleave
            rope_interleave=bool(raw.get("rope_interleave", True)) if v3 else True,
        )


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): the rotate-half layout. q and k are
    permuted alike, so their dot products are those of the interleaved rotation."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, s: DeepseekShape, layer_idx: int):
        super().__init__()
        H, self.h = cfg.hidden_size, cfg.num_attention_heads
        self.n, self.r, self.v, self.R = s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim, s.kv_lora_rank
        qd, bias = self.h * (self.n + self.r), cfg.attention_bias
        self.q_lora = s.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = Linear(H, s.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank)  # the reference's default eps, not rms_norm_eps
            self.q_b_proj = Linear(s.q_lora_rank, qd)
        else:
            self.q_proj = Linear(H, qd)
        self.kv_a_proj_with_mqa = Linear(H, self.R + self.r, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.R)
        self.kv_b_proj = Linear(self.R, self.h * (self.n + self.v))
        self.o_proj = Linear(self.h * self.v, H, bias=bias)
        self.interleave = s.rope_interleave
        self.rotary = RotaryEmbedding(self.r, self.r, cfg.context_limit, cfg.rope_theta, cfg.rope_scaling,
                                      native_positions=cfg.max_position_embeddings)
        scale = (self.n + self.r) ** -0.5
        rs = cfg.rope_scaling or {}
        factor = float(rs.get("factor") or 1.0)
        if rs.get("rope_type", rs.get("type")) == "yarn" and rs.get("mscale_all_dim") and factor > 1:
            m = 0.1 * rs["mscale_all_dim"] * math.log(factor) + 1.0
            scale *= m * m  # yarn's softmax temperature, squared into the scale as the reference does
        self.attn = PagedAttention(layer_idx, self.h, 1, self.R + self.r, scale, latent_values=self.R)

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.dense_weight().view(self.h, self.n + self.v, self.R)  # [H, n + v, R]
        return w[:, :self.n], w[:, self.n:]  # W_UK [H, n, R], W_UV [H, v, R]

    def qkv(self, positions: torch.Tensor, x: torch.Tensor):
        # x: [T, H] -> q: [T, h, R + r]; k: [T, 1, R + r] (the cache row); v: [T, 1, 0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(-1, self.h, self.n + self.r).split([self.n, self.r], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.R, self.r], dim=-1)  # [T, R], [T, r]
        c, k_pe = self.kv_a_layernorm(c), k_pe[:, None, :]  # k_pe: [T, 1, r]
        if self.interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        w_uk, _ = self._kv_b()
        q_lat = torch.einsum("thn,hnR->thR", q_nope, w_uk)  # [T, h, R]
        k = torch.cat((c[:, None, :], k_pe), dim=-1)  # [T, 1, R + r]
        return torch.cat((q_lat, q_pe), dim=-1), k, k.new_empty(k.shape[0], 1, 0)

    def out(self, attn_out: torch.Tensor) -> torch.Tensor:
        # attn_out: [T, h * R] (softmax-weighted latents per head) -> [T, H]
        _, w_uv = self._kv_b()
        o = torch.einsum("thR,hvR->thv", attn_out.view(-1, self.h, self.R), w_uv)  # [T, h, v]
        return self.o_proj(o.flatten(1))


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, s: DeepseekShape):
        super().__init__()
        self.s, self.top_k, self.normalize = s, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = DeepseekRouter(cfg.hidden_size, s.n_routed_experts, s.v3)
        self.experts = Experts(s.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
        shared = cfg.moe_intermediate_size * s.n_shared_experts
        self.shared_experts = GatedMLP(cfg.hidden_size, shared, cfg.hidden_act) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]
        s, logits = self.s, self.gate(x)  # [T, E] fp32
        if s.v3:
            weights, ids = route_sigmoid_biased(logits, self.gate.e_score_correction_bias, self.top_k, s.n_group,
                                                s.topk_group, self.normalize, s.routed_scaling_factor)
        else:
            groups = s.n_group if s.group_limited else 1
            weights, ids = route_group_limited(logits, self.top_k, groups, s.topk_group, self.normalize,
                                               s.routed_scaling_factor)
        out = self.experts(x, ids, weights)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekRouter(nn.Module):
    """Router weight (and V3's correction bias) kept in fp32, as the reference keeps them."""

    def __init__(self, hidden: int, num_experts: int, with_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
                                        if with_bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight.float())  # [T, E]


class DeepseekDecoderLayer(nn.Module):
    """pre -> attention -> post, like the Llama layer (engine/cuda_graph.py's protocol)."""

    def __init__(self, cfg: ModelConfig, s: DeepseekShape, layer_idx: int):
        super().__init__()
        self.self_attn = MLAttention(cfg, s, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        dense = layer_idx < s.first_k_dense_replace or not s.n_routed_experts
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act) if dense else DeepseekMoE(cfg, s)

    def pre(self, positions: torch.Tensor, x: torch.Tensor):
        return self.self_attn.qkv(positions, self.input_layernorm(x))

    def post(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.out(attn_out)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.post(x, self.self_attn.attn(*self.pre(positions, x)))


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, s: DeepseekShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, s, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(CausalLM):
    """The forward is `CausalLM`'s segment chain (embed, layers, norm); layers keep `pre`/`post`."""

    cuda_graphs = True  # tests/test_cuda.py -k deepseek_graph: graphed == eager on the H200 (session 9, v_head_dim 16
    # and 12), once the Triton prefill kernel took 32-key tiles over narrow latent rows (`triton_attention._narrow_latent`)
    """MLA decode reads no host values (the absorbed matmuls, the latent cache row, routing on the device);
    the routed experts need a graph-safe backend too (`CausalLM.graph_safe`: the fused kernel, bf16/fp16)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config, self.shape = cfg, DeepseekShape.from_config(cfg)
        self.model = DeepseekModel(cfg, self.shape)
        self.tied = cfg.tie_word_embeddings
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    dense_linears = ("kv_b_proj",)
    """Absorbed MLA reads kv_b_proj as a dense weight every step (`MLAttention._kv_b`): kept dense at load, never
    packed (an FP8 checkpoint's would be dequantized twice a layer a step)."""

    def skips(self, name: str) -> bool:
        # V3 checkpoints carry multi-token-prediction layers past num_hidden_layers: not used for decoding (and never
        # read: an FP8 release's layer 61 is ~11.7B weights to decode for nothing)
        m = _LAYER.match(name)
        return bool(m and int(m[1]) >= self.config.num_hidden_layers)

    def map_weight(self, name: str, tensor: torch.Tensor) -> bool:
        return self.tied and name == "lm_head.weight"
