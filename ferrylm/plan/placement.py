"""The planner's placement: which tensor groups stay on the GPU and which live in pinned host memory,
from a byte budget, and what that costs per decode step on the PCIe link.

Order of residency (cheapest to keep in host memory last): norms and routers (tiny, read every step),
attention, the LM head, shared experts and dense MLPs (a miss streams the whole group every step), then
expert slots spread evenly over the MoE layers (a miss is one expert, only when routed to), and the
embeddings last (a lookup reads only the step's rows: host memory costs nothing per token).
TODO: replace by `ferrylm/offload/placement.py` (the engine's placement) once it is in main, so the plan
shows the engine's own decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrylm.plan.memory import TensorGroup

_ORDER = {"norm": 0, "router": 0, "attention": 1, "lm_head": 2, "shared_experts": 3, "mlp": 3, "experts": 4, "embed": 5}


@dataclass
class PlannedPlacement:
    gpu: list[TensorGroup] = field(default_factory=list)
    host: list[TensorGroup] = field(default_factory=list)

    @property
    def gpu_bytes(self) -> int:
        return sum(g.nbytes for g in self.gpu)

    @property
    def host_bytes(self) -> int:
        return sum(g.nbytes for g in self.host)

    @property
    def resident(self) -> bool:
        return not self.host

    def expert_resident_share(self) -> float:
        """Fraction of expert groups on the GPU (1.0 when the model has none)."""
        n = sum(1 for g in self.gpu + self.host if g.kind == "experts")
        return 1.0 if n == 0 else sum(1 for g in self.gpu if g.kind == "experts") / n

    def pcie_bytes_per_step(self, distinct_experts_per_layer: float) -> float:
        """Bytes copied to the GPU for one decode step: every host-resident dense group (the embeddings
        excepted: only looked-up rows move), plus the expected expert misses of each MoE layer when
        `distinct_experts_per_layer` experts are routed to and routing is uniform."""
        total = float(sum(g.nbytes for g in self.host if g.kind not in ("experts", "embed")))
        layers: dict[int, list[TensorGroup]] = {}
        for g in self.gpu + self.host:
            if g.kind == "experts":
                layers.setdefault(g.layer, []).append(g)
        host = {g.name for g in self.host}
        for gs in layers.values():
            share = sum(1 for g in gs if g.name in host) / len(gs)
            total += distinct_experts_per_layer * share * gs[0].nbytes
        return total


def place(groups: list[TensorGroup], budget: int) -> PlannedPlacement:
    """Fill `budget` device bytes in residency order; experts one round at a time across layers so each
    MoE layer gets the same number of resident slots."""
    out = PlannedPlacement()
    left = budget

    def put(gs: list[TensorGroup]) -> None:
        nonlocal left
        cost = sum(g.nbytes for g in gs)
        if cost <= left:
            out.gpu.extend(gs)
            left -= cost
        else:
            out.host.extend(gs)

    dense = sorted((g for g in groups if g.kind != "experts"), key=lambda g: (_ORDER[g.kind], g.layer or 0))
    for g in dense:
        if _ORDER[g.kind] < 4:
            put([g])
    rounds: dict[int, list[TensorGroup]] = {}
    for g in groups:
        if g.kind == "experts":
            rounds.setdefault(g.expert, []).append(g)
    for e in sorted(rounds):
        put(rounds[e])
    for g in dense:
        if _ORDER[g.kind] >= 4:
            put([g])
    return out


def distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts a layer routes `batch` tokens to, under uniform top-k routing."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)
