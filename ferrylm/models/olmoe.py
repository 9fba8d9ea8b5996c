"""OLMoE (`OlmoeForCausalLM`): Llama layout with RMSNorm over the whole q and k projections (not per
head), optional `clip_qkv` clamping, and a softmax top-k MoE without shared experts (`norm_topk_prob`
off by default). Routed experts run through `Experts`, the expert-backend seam.
"""

from __future__ import annotations

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.layers.linear import Linear
from ferrylm.layers.moe import Experts, route
from ferrylm.layers.norm import RMSNorm
from ferrylm.models.llama import LlamaAttention, LlamaForCausalLM


class OlmoeAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.q_norm = RMSNorm(self.hq * self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hk * self.d, cfg.rms_norm_eps)
        self.clip = cfg.raw.get("clip_qkv")

    def qkv(self, positions: torch.Tensor, x: torch.Tensor):
        # x: [T, H] -> q: [T, Hq, D]; k, v: [T, Hk, D]
        q, k, v = self.qkv_proj(x).split([self.hq * self.d, self.hk * self.d, self.hk * self.d], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)  # over all heads at once: [T, Hq * D], [T, Hk * D]
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k = self.rotary(positions, q.view(-1, self.hq, self.d), k.view(-1, self.hk, self.d))
        return q, k, v.view(-1, self.hk, self.d)


class OlmoeMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]
        weights, ids = route(self.gate(x), self.top_k, self.normalize)  # [T, k]
        return self.experts(x, ids, weights)


class OlmoeForCausalLM(LlamaForCausalLM):
    tensor_parallel = False  # q/k norms over the whole projections: not sharded yet
    make_mlp = staticmethod(OlmoeMoeBlock)  # graphs when every expert backend is graph-safe (`graph_safe`)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        for i, layer in enumerate(self.model.layers):  # the Llama layer with OLMoE's q/k norms
            layer.self_attn = OlmoeAttention(cfg, i)
