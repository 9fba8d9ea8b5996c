"""Mixture-of-experts building blocks: the top-k router and the expert bank.

`Experts` owns E gated MLPs and the token dispatch. The offload engine replaces where expert weights
come from by overriding `expert_weights(e)`; routing and dispatch stay the same.
Experts of a quantized ferry store arrive dequantized (dense w13/w2); keeping them packed is the offload
engine's job, through `expert_weights(e)` and the store's per-(layer, expert) groups.
"""

from __future__ import annotations

import torch
from torch import nn

from ferrylm.layers.activation import get_act


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # router_logits: [T, E] -> weights, ids: [T, k] (fp32 softmax like the references)
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Experts(nn.Module):
    """E gated MLPs: w13[e] = [gate; up] rows ([2I, H]), w2[e]: [H, I]; out = w2 @ (act(gate x) * up x)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, act: str = "silu"):
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter), requires_grad=False)
        self.act = get_act(act)

    def load(self, expert: int, part: str, tensor: torch.Tensor) -> None:
        """part: gate | up | down | gate_up (already stacked [2I, H])."""
        I = self.inter
        dst = {"gate": self.w13.data[expert, :I], "up": self.w13.data[expert, I:],
               "gate_up": self.w13.data[expert], "down": self.w2.data[expert]}[part]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"expert {expert} {part}: shape {tuple(tensor.shape)} does not fit {tuple(dst.shape)}")
        dst.copy_(tensor)

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w13[e], self.w2[e]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; topk_ids, topk_weights: [T, k] -> [T, H]
        T, k = topk_ids.shape
        flat = topk_ids.flatten()  # [T * k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // k  # token row of each sorted assignment
        w_sorted = topk_weights.flatten()[order].to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token_of[start:start + n]
            w13, w2 = self.expert_weights(e)
            gate, up = (x[rows] @ w13.t()).chunk(2, dim=-1)  # [n, I] each
            y = (self.act(gate) * up) @ w2.t()  # [n, H]
            out.index_add_(0, rows, y * w_sorted[start:start + n, None])
            start += n
        return out
