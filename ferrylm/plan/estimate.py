"""Speed estimate: decode and prefill tokens/s and time to first token from a roofline of each step (HBM
bytes, PCIe bytes, FLOPs) plus a per-layer launch overhead, with which resource binds.

A decode step of B sequences takes max(t_hbm, t_pcie, t_compute) + t_launch + t_comm:
    t_hbm     = (resident weights the step touches + KV read) / (HBM GB/s * HBM_EFF)
    t_pcie    = host-resident bytes the step needs / pinned H2D GB/s      (copies overlap compute)
    t_compute = 2 * active params * B / (TFLOP/s * MFU)
    t_launch  = layers * LAUNCH_S (eager) or LAUNCH_GRAPH_S (CUDA graphs)
    t_comm    = 2 all-reduces per layer under TP (ALLREDUCE_S + ring bytes over NVLink or PCIe)
A prefill chunk of T tokens: max(2 * active params * T / (TFLOP/s * MFU), streamed bytes / H2D) + t_launch.
The efficiencies are assumptions, not measurements: `ferry plan --check` measures; `docs/benchmarks.md`
holds predicted vs measured. Knows nothing about files or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

HBM_EFF = 0.8
"""Share of peak HBM bandwidth a decode step's GEMVs reach."""
MFU = 0.5
"""Share of peak tensor FLOP/s large GEMMs reach."""
LAUNCH_S = 150e-6
"""Per layer, eager PyTorch: ~10 kernels plus Python."""
LAUNCH_GRAPH_S = 15e-6
"""Per layer inside a CUDA graph."""
ALLREDUCE_S = 20e-6
"""Fixed cost of one tensor-parallel all-reduce (two per layer), on top of its bytes over the link."""


@dataclass(frozen=True)
class StepCost:
    hbm_bytes: float
    pcie_bytes: float
    flops: float
    layers: int
    graphs: bool = False
    comm_s: float = 0.0
    """Tensor-parallel all-reduces of the step (not overlapped with compute)."""


@dataclass(frozen=True)
class StepTime:
    seconds: float
    binding: str
    """hbm | pcie | compute | launch | comm"""
    parts: dict

    def rate(self, tokens: int) -> float:
        return tokens / self.seconds if self.seconds > 0 else float("inf")


def step_time(cost: StepCost, hbm_gbs: float, h2d_gbs: float, tflops: float) -> StepTime:
    parts = {"hbm": cost.hbm_bytes / (hbm_gbs * 1e9 * HBM_EFF),
             "pcie": cost.pcie_bytes / (h2d_gbs * 1e9) if cost.pcie_bytes else 0.0,
             "compute": cost.flops / (tflops * 1e12 * MFU),
             "launch": cost.layers * (LAUNCH_GRAPH_S if cost.graphs else LAUNCH_S), "comm": cost.comm_s}
    roof = max(("hbm", "pcie", "compute"), key=parts.get)
    binding = max(("launch", "comm"), key=parts.get) if max(parts["launch"], parts["comm"]) > parts[roof] else roof
    return StepTime(parts[roof] + parts["launch"] + parts["comm"], binding, parts)


def allreduce_s(tp: int, nbytes: float, link_gbs: float) -> float:
    """One ring all-reduce of `nbytes` over `tp` ranks."""
    return 0.0 if tp == 1 else ALLREDUCE_S + 2 * (tp - 1) / tp * nbytes / (link_gbs * 1e9)
