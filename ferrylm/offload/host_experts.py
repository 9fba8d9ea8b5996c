"""One layer's host-resident experts computed on the host's cores where they lie (no weight copies): the CPU
side of the hybrid path. `HostExperts(w13, w2, act)` wraps a host bank (the host tier's [E, 2I, H] and
[E, H, I] tensors) and builds one `layers/cpu_experts.HostExpert` per expert on first use.

`rows(x, ids, weights, out)` computes the weighted output of every assignment whose expert id is >= 0 in
`ids` (the caller marks the assignments it keeps with -1) into `out`'s rows, in the layout of
`layers/fused_moe.expert_rows` (row t * k + j for token t's j-th expert) with every other row 0, so the
device adds them to its own rows exactly. It knows nothing about caches, streams or which thread runs it.
Shapes: T tokens, k experts a token, H hidden.
"""

from __future__ import annotations

import torch

from ferrylm.layers.cpu_experts import HostExpert


class HostExperts:
    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, act):
        if not isinstance(w13, torch.Tensor):
            raise NotImplementedError("host experts compute dense banks only (packed host banks: TODO issue 10)")
        self.w13, self.w2, self.act = w13, w2, act
        self._experts: dict[int, HostExpert] = {}

    def expert(self, e: int) -> HostExpert:
        if e not in self._experts:
            self._experts[e] = HostExpert(self.w13[e], self.w2[e], self.act)
        return self._experts[e]

    def rows(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> int:
        """x: [T, H]; ids, weights: [T, k] (ids -1 where another side computes); out: [>= T * k, H], written
        in rows [0, T * k). Returns the number of experts run."""
        T, k = ids.shape
        out[:T * k].zero_()
        flat = ids.flatten()  # [T * k]
        experts = torch.unique(flat[flat >= 0]).tolist()
        wflat = weights.flatten()
        for e in experts:
            a = (flat == e).nonzero().flatten()  # assignment rows of expert e, ascending
            y = self.expert(e)(x[a // k])  # [n, H]
            out[a] = (y.float() * wflat[a].float()[:, None]).to(out.dtype)
        return len(experts)
