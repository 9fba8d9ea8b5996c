"""Mixture-of-experts building blocks: the routers (softmax top-k; DeepSeek's group-limited and
sigmoid + correction-bias variants), the expert bank and its compute backends.

`Experts` owns E gated MLPs' weights; how they compute is its `backend` (an `ExpertBackend`), chosen by
the model runner: `TorchExperts` (the per-expert loop, the reference every other backend is tested
against), `FusedExperts` (`layers/fused_moe.py`: one Triton grouped GEMM, no host sync, graph-capturable)
for resident banks on CUDA, and `offload.expert_cache.CachedExperts` for banks that live in host memory.
Every backend computes `out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t])`.
Experts of a quantized ferry store arrive dequantized (dense w13/w2), unless the bank is `packing` (set by
the model runner on CUDA, where the fused kernel reads packed tiles): then they stay packed in
`Experts.packed` (`layers.fused_moe.ExpertWeights`, a quarter of the bytes for 4-bit formats; each piece
written where the placement puts it as it arrives) and w13/w2 are empty.
"""

from __future__ import annotations

import torch
from torch import nn

from ferrylm.layers import fused_ops
from ferrylm.layers.activation import get_act
from ferrylm.layers.context import costliest_routing_on, live_assignments, recording
from ferrylm.layers.params import writable


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # router_logits: [T, E] -> weights, ids: [T, k] (fp32 softmax like the references); on CUDA one launch
    if fused_ops.route_usable(router_logits, top_k):
        return fused_ops.route(router_logits, top_k, normalize)
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    # group_scores: [T, G] -> [T, E] bool, True for experts in the `topk_group` best groups of each token
    T, G = group_scores.shape
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, torch.topk(group_scores, topk_group, dim=-1).indices, True)
    return keep[:, :, None].expand(T, G, num_experts // G).reshape(T, num_experts)


def route_group_limited(router_logits: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1,
                        normalize: bool = False, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: fp32 softmax; with `n_group` > 1 only the `topk_group` groups whose best expert
    scores highest stay eligible (node-limited routing); top-k of those, times `routed_scaling_factor`."""
    # router_logits: [T, E] -> weights, ids: [T, k]
    scores = torch.softmax(router_logits.float(), dim=-1)
    T, E = scores.shape
    if n_group > 1:
        mask = _group_mask(scores.view(T, n_group, E // n_group).amax(dim=-1), topk_group, E)
        scores = scores.masked_fill(~mask, 0.0)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def route_sigmoid_biased(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
                         n_group: int = 1, topk_group: int = 1, normalize: bool = True,
                         scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 (`noaux_tc`): sigmoid scores; the correction bias only chooses (groups ranked by the
    sum of their two best biased scores, then top-k), the weights are the unbiased scores."""
    # router_logits: [T, E]; correction_bias: [E] -> weights, ids: [T, k]
    scores = torch.sigmoid(router_logits.float())
    choice = scores + correction_bias.float()
    T, E = scores.shape
    if n_group > 1:
        group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        choice = choice.masked_fill(~_group_mask(group_scores, topk_group, E), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def costliest_ids(topk_ids: torch.Tensor, num_experts: int, first: list[int] = ()) -> torch.Tensor:
    """Routing [T, k] for the warm-up step that sizes the KV pool (`context.costliest_routing`): the assignments
    spread evenly over half the experts (every other one; half rounded up), each taking at most `expert_row_cap`
    rows, the most any backend computes of one expert at once whatever the prompt (more are computed in pieces),
    distinct within a token;
    random tokens through a random or trained router stay near the uniform share. Paths whose buffers do not
    depend on the routing (the Triton kernel's padded rows, the grouped GEMM) hold the same either way. Under
    expert parallelism each rank routes every assignment to its own experts (`ParallelExperts`). `first`: experts
    taken before the others (`ExpertBackend.warm_experts`: an offload cache's, whose hits compute in one round,
    each decoded group as full as a real prompt's can be). Not the most for a packed bank whose decode group
    (`fused_moe.DEQUANT_BUFFER_BYTES`) holds more than half the experts: its decoded weights; tiny shapes only
    (below ~45M weights a layer)."""
    T, k = topk_ids.shape
    m = max(k, (num_experts + 1) // 2)  # an odd count: each at most the cap
    chosen: list[int] = []
    for e in [*first, *(j * num_experts // m for j in range(m)), *range(num_experts)]:  # then every other expert
        if len(chosen) < m and 0 <= e < num_experts and e not in chosen:
            chosen.append(e)
    i = torch.arange(T * k, device=topk_ids.device) % m
    return torch.tensor(chosen, dtype=topk_ids.dtype, device=topk_ids.device)[i].reshape(T, k)


class Experts(nn.Module):
    """E gated MLPs: w13[e] = [gate; up] rows ([2I, H]), w2[e]: [H, I]; out = w2 @ (act(gate x) * up x)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, act: str = "silu"):
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter), requires_grad=False)
        self.act_name = act
        self.act = get_act(act)
        self.backend: ExpertBackend = TorchExperts()
        self.routing_counts: torch.Tensor | None = None
        """[E] long on the device while profiling: how many assignments each expert got."""
        self.routing_trace: torch.Tensor | None = None
        """[S + 1, E] bool on the device while tracing (`expert_profile.start_trace`): row t the experts the t-th
        one-token step used (its last row a sink for steps past S); `routing_trace_pos` [1] long the next row."""
        self.routing_trace_pos: torch.Tensor | None = None
        self.packing = False
        """Keep quantized experts packed (`load` stashes them; `finish_load` stacks and places them)."""
        self.packed = None
        """(w13, w2) as `ExpertWeights` when the bank holds packed experts; w13/w2 are then empty."""
        self.packed_nbytes: int | None = None
        """Bytes of one packed expert (set with `packing`, before placement)."""
        self.packed_format: str | None = None
        """The fused kernel's format of its packed experts (`fused_moe.FORMATS`; set with `packing`)."""
        self._sides: dict[str, object] = {}  # w13 / w2 -> the packed bank being filled

    def load(self, expert: int, part: str, tensor) -> None:
        """part: gate | up | down | gate_up (already stacked [2I, H]); `tensor` may be a `QuantizedTensor`."""
        from ferrylm.weights.quant import QuantizedTensor

        if isinstance(tensor, QuantizedTensor):
            if self.packing:
                self._load_packed(expert, part, tensor)
                return
            tensor = tensor.dequantize()
        elif self.packing:  # its first expert arrived packed: the bank is packed, a dense piece has no place
            raise ValueError(f"expert {expert} {part} is stored dense in a bank whose experts are packed")
        I = self.inter
        w = writable(self, "w2" if part == "down" else "w13")
        dst = {"gate": w[expert, :I], "up": w[expert, I:], "gate_up": w[expert], "down": w[expert]}[part]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"expert {expert} {part}: shape {tuple(tensor.shape)} does not fit {tuple(dst.shape)}")
        dst.copy_(tensor)

    def _load_packed(self, expert: int, part: str, qt) -> None:
        """Write a packed piece straight into its side's bank, allocated (where the placement puts the side)
        when its first piece arrives: the model never holds a second copy."""
        from ferrylm.layers.fused_moe import ExpertWeights, piece_parts
        from ferrylm.layers.params import placed_empty

        attr = "w2" if part == "down" else "w13"
        fmt, group, parts = piece_parts(qt)
        side = self._sides.get(attr)
        rows = self.hidden if attr == "w2" else 2 * self.inter
        if side is None:
            bank = {k: placed_empty(self, attr, (self.num_experts, rows, *v.shape[1:]), v.dtype) for k, v in parts.items()}
            side = self._sides[attr] = ExpertWeights(fmt, (self.num_experts, rows, qt.shape[1]), group, bank["q"],
                                                     bank.get("scale"), bank.get("min"))
        if (fmt, group) != (side.fmt, side.group) or set(parts) != set(side.parts):
            raise ValueError(f"expert {expert} {part}: packed as {fmt}/{group}, the bank as {side.fmt}/{side.group}")
        I = self.inter
        lo = {"gate": 0, "up": I, "gate_up": 0, "down": 0}[part]
        for k, v in parts.items():
            dst = side.parts[k][expert, lo:lo + v.shape[0]]
            if tuple(dst.shape) != tuple(v.shape):
                raise ValueError(f"expert {expert} {part}: packed shape {tuple(v.shape)} does not fit {tuple(dst.shape)}")
            dst.copy_(v)

    def finish_load(self) -> None:
        """Packed experts: w13/w2 become empty; the banks are `packed`."""
        from ferrylm.layers.params import device_for, replace

        if not self._sides:
            return
        if set(self._sides) != {"w13", "w2"}:
            raise ValueError(f"packed experts: only {sorted(self._sides)} arrived packed")
        for attr in ("w13", "w2"):
            replace(self, attr, torch.empty(0, dtype=self.w13.dtype, device=device_for(self, attr)))
        self.packed = (self._sides["w13"], self._sides["w2"])
        self._sides = {}

    def weights(self) -> tuple:
        """(w13, w2): dense [E, 2I, H] / [E, H, I] tensors, or packed `ExpertWeights`."""
        return self.packed if self.packed is not None else (self.w13, self.w2)

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.packed is not None:  # the reference path decodes one expert at a time
            return tuple(side.expert(e).dequantize(self.w13.dtype)[0] for side in self.packed)
        return self.w13[e], self.w2[e]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; topk_ids, topk_weights: [T, k] -> [T, H]
        if costliest_routing_on():
            topk_ids = costliest_ids(topk_ids, self.num_experts, self.backend.warm_experts())
        if self.routing_counts is not None and recording():  # device-side: profiling keeps graphs, adds no sync
            self.routing_counts.scatter_add_(0, topk_ids.flatten(), live_assignments(topk_ids))  # padded rows: 0
        if self.routing_trace is not None and recording() and topk_ids.shape[0] == 1:  # a one-token step
            row = torch.zeros(1, self.num_experts, dtype=torch.bool, device=self.routing_trace.device)
            row.index_fill_(1, topk_ids[0].to(row.device), True)  # a Scalar fill: no host tensor inside a capture
            self.routing_trace.index_copy_(0, self.routing_trace_pos, row)  # device-side: graph-safe, no sync
            self.routing_trace_pos.add_(1).clamp_(max=self.routing_trace.shape[0] - 1)
        return self.backend.forward(self, x, topk_ids, topk_weights)


class ExpertBackend:
    """How a bank computes. Host-reading backends set `reads_host = True` (no CUDA graph capture)."""

    reads_host = True

    def forward(self, bank: Experts, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def warm_experts(self) -> list[int]:
        """Experts the warm-up's costliest routing takes first (`costliest_ids`): an offload cache's (its hits then
        compute together, as a real prompt's may); none for a bank that holds every expert alike."""
        return []


def dispatch(topk_ids: torch.Tensor, num_experts: int):
    """Sort the T * k assignments by expert: (counts per expert on the host, token row and assignment
    index of each sorted assignment). One host sync: the counts."""
    k = topk_ids.shape[1]
    flat = topk_ids.flatten()  # [T * k]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return counts, order // k, order


def expert_row_cap(A: int, E: int) -> int:
    """Rows of one expert computed at once for A assignments over E experts (the model's count): twice the uniform
    share. An expert routed more rows (a skewed prompt: one token repeated) is computed in pieces of this many, so a
    step's transient is bounded whatever its routing, and the warm-up that sizes the KV pool measures that bound
    (`context.costliest_routing`). Every device backend splits an expert into the same pieces (they depend on A and
    E only; an offload round counts its skipped ids in A), so their bits stay equal; the host's expert jobs (hybrid)
    compute theirs whole, in host memory."""
    return max(1, -(-2 * A // E))


ROW_CAP_DEVICES = ("cuda",)
"""Devices whose steps cap an expert's rows (`row_cap`): where a measured warm-up sizes the KV pool. The CPU engine's
memory is the host's, so its GEMMs stay whole (and its bits as before)."""


def row_cap(x: torch.Tensor, A: int, E: int) -> int | None:
    """`expert_row_cap` for a step on x's device, None where `ROW_CAP_DEVICES` leaves it out."""
    return expert_row_cap(A, E) if x.device.type in ROW_CAP_DEVICES else None


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act, cap: int | None = None) -> torch.Tensor:
    # x: [n, H]; w13: [2I, H]; w2: [H, I] -> [n, H]; at most `cap` rows at once (`expert_row_cap`)
    if cap is not None and x.shape[0] > cap:
        out = torch.empty(x.shape[0], w2.shape[0], dtype=x.dtype, device=x.device)
        for i in range(0, x.shape[0], cap):
            out[i:i + cap] = expert_mlp(x[i:i + cap], w13, w2, act)
        return out
    gate, up = (x @ w13.t()).chunk(2, dim=-1)  # [n, I] each
    return (act(gate) * up) @ w2.t()


def combine(x: torch.Tensor, counts: list[int], rows: torch.Tensor, w_sorted: torch.Tensor,
            outputs: dict[int, torch.Tensor]) -> torch.Tensor:
    """out[t] = sum of weighted expert outputs, added in ascending expert order whatever order they were
    computed in, so every backend that computes the same expert outputs returns the same bits."""
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out.index_add_(0, rows[start:start + n], outputs[e] * w_sorted[start:start + n, None])
        start += n
    return out


class TorchExperts(ExpertBackend):
    """The reference: one gated MLP per expert that has tokens, weights read through `expert_weights`."""

    def forward(self, bank, x, topk_ids, topk_weights):
        counts, rows, order = dispatch(topk_ids, bank.num_experts)
        w_sorted = topk_weights.flatten()[order].to(x.dtype)
        outputs, start, cap = {}, 0, row_cap(x, topk_ids.numel(), bank.num_experts)
        for e, n in enumerate(counts):
            if n:
                outputs[e] = expert_mlp(x[rows[start:start + n]], *bank.expert_weights(e), bank.act, cap)
            start += n
        return combine(x, counts, rows, w_sorted, outputs)
