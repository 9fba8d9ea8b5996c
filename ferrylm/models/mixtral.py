"""Mixtral: Llama attention with a sparse MoE block (softmax router, top-k, renormalised weights)."""

from __future__ import annotations

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.layers.linear import Linear
from ferrylm.layers.moe import route
from ferrylm.layers.parallel_experts import expert_bank
from ferrylm.models.llama import LlamaForCausalLM


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.experts = expert_bank(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]
        weights, ids = route(self.gate(x), self.top_k, normalize=True)  # [T, k]
        return self.experts(x, ids, weights)


class MixtralForCausalLM(LlamaForCausalLM):
    make_mlp = staticmethod(SparseMoeBlock)
    mlp_name = "block_sparse_moe"
