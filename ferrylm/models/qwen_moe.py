"""Qwen2-MoE (routed experts plus a shared expert behind a sigmoid gate) and Qwen3-MoE (routed only,
`norm_topk_prob`). Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step`, stay dense.
"""

from __future__ import annotations

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.layers.linear import Linear
from ferrylm.layers.moe import route
from ferrylm.layers.parallel_experts import expert_bank
from ferrylm.models.llama import GatedMLP, LlamaForCausalLM


class QwenMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.experts = expert_bank(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]
        weights, ids = route(self.gate(x), self.top_k, self.normalize)  # [T, k]
        out = self.experts(x, ids, weights)
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def qwen_moe_mlp(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    sparse = layer_idx not in cfg.mlp_only_layers and (layer_idx + 1) % cfg.decoder_sparse_step == 0
    return QwenMoeBlock(cfg) if sparse else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)


class QwenMoeForCausalLM(LlamaForCausalLM):
    make_mlp = staticmethod(qwen_moe_mlp)
