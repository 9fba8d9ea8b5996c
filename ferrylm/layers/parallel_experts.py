"""ParallelExperts: an expert bank sharded over the tensor-parallel group, two ways.

- tensor-parallel (default): every rank holds every expert, with its 1/n share of the intermediate
  features (gate/up rows, down columns); each rank's backend computes the routed sum on its share and
  the partial outputs are summed over the group (one all-reduce of [T, H], like a row-parallel layer).
- expert-parallel (`expert_parallel`): rank r holds whole experts [r E/n, (r+1) E/n); it computes only
  the assignments routed to them (each one a row with k = 1, so any `ExpertBackend` runs it) and the
  group sums the outputs. All-reduce rather than all-to-all: the router is replicated and every rank
  already holds every token's hidden state (attention is tensor-parallel), so the exchange all-to-all
  would save is the input dispatch, which is free here; the combine is one all-reduce of [T, H], the
  same collective the attention block already pays. All-to-all pays off when tokens are sharded too
  (data-parallel attention), which ferrylm does not do.

The router stays outside (replicated `Linear`), so every rank picks the same experts. With a group of
size 1 it is `Experts`. Notation: T tokens, k experts per token, H hidden, I intermediate, E experts.
"""

from __future__ import annotations

import torch

from ferrylm.layers.context import costliest_routing_on
from ferrylm.layers.moe import Experts, costliest_ids
from ferrylm.parallel.group import current_group

SKIP = "skip"
"""`tp_part` of an expert this rank does not hold: the loader does not read it."""


def expert_bank(num_experts: int, hidden: int, inter: int, act: str = "silu") -> Experts:
    """The bank a model declares: `ParallelExperts` in a tensor-parallel group, else the plain `Experts`
    (one process keeps exactly the bank it always had)."""
    cls = ParallelExperts if current_group().size > 1 else Experts
    return cls(num_experts, hidden, inter, act)


class ParallelExperts(Experts):
    def __init__(self, num_experts: int, hidden: int, inter: int, act: str = "silu"):
        g = current_group()
        self.ep = g.size > 1 and g.expert_parallel
        if self.ep:
            local = g.split(num_experts, "experts")
            super().__init__(local, hidden, inter, act)
            self.first_expert = g.rank * local
        else:
            super().__init__(num_experts, hidden, g.split(inter, "expert intermediate size"), act)
            self.first_expert = 0
        self.tp = g

    def tp_part(self, expert: int, part: str):
        """Which slice of checkpoint tensor `part` (gate | up | down) of global `expert` this rank reads."""
        if self.tp.size == 1:
            return None
        if self.ep:
            return None if self.first_expert <= expert < self.first_expert + self.num_experts else SKIP
        I, r = self.inter, self.tp.rank
        return (1, r * I, I) if part == "down" else (0, r * I, I)  # down: [H, I]; gate, up: [I, H]

    def shard_gate_up(self, w: torch.Tensor) -> torch.Tensor:
        """A stacked [gate; up] checkpoint tensor [2 I, H] -> this rank's [its gate rows; its up rows]."""
        if self.tp.size == 1 or self.ep:
            return w
        full, I, r = w.shape[0] // 2, self.inter, self.tp.rank
        return torch.cat([w[r * I:(r + 1) * I], w[full + r * I:full + (r + 1) * I]])

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; topk_ids, topk_weights: [T, k] (global expert ids) -> [T, H]
        if costliest_routing_on():  # the warm-up: each rank measures the most a prompt can route to it
            if self.ep and topk_ids.shape[1] <= self.num_experts:  # every assignment on this rank's own experts
                topk_ids = self.first_expert + costliest_ids(topk_ids, self.num_experts, self.backend.warm_experts())
            else:  # every rank holds every expert (its share of the columns): an offload cache's experts first
                topk_ids = costliest_ids(topk_ids, self.num_experts * (self.tp.size if self.ep else 1),
                                         () if self.ep else self.backend.warm_experts())
        if self.tp.size == 1:
            return super().forward(x, topk_ids, topk_weights)
        if not self.ep:
            return self.tp.all_reduce(self.backend.forward(self, x, topk_ids, topk_weights))
        local = topk_ids - self.first_expert
        rows, cols = ((local >= 0) & (local < self.num_experts)).nonzero(as_tuple=True)  # [M] assignments held here
        out = torch.zeros_like(x)
        if rows.numel():
            y = self.backend.forward(self, x[rows], local[rows, cols, None], topk_weights[rows, cols, None])  # [M, H]
            out.index_add_(0, rows, y)
        return self.tp.all_reduce(out)
