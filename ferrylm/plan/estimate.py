"""Speed estimate: decode and prefill tokens/s and time to first token from a roofline of each step (HBM
bytes, PCIe bytes, FLOPs) plus the serial parts (experts read in place over PCIe, host overhead, launches),
with which resource binds.

A decode step of B sequences takes max(t_hbm, t_copy, t_compute) + t_mapped + t_host + t_launch + t_comm:
    t_hbm     = (resident weights the step touches + KV read) / (HBM GB/s * HBM_EFF)
                + experts read from HBM / (HBM GB/s * moe_hbm_eff(tokens per expert))
    t_copy    = bytes the copy engine moves (streamed layers, copy-path expert misses) / pinned H2D GB/s
                (copies overlap compute)
    t_compute = 2 * active params * B / (TFLOP/s * MFU)
    t_mapped  = decode steps of up to `CachedExperts.mapped_tokens` tokens with experts in host memory: one
                fused launch reads the hits from HBM and the misses in place from mapped host memory at
                pinned H2D GB/s * INPLACE_EFF, side by side, while (hybrid decode, the engine's default for
                dense experts) the host's cores compute a share of the misses at HOST_EXPERT_EFF of the host's
                read rate, the share balanced as the engine balances it: max(hits, GPU misses, host misses)
                (hits at least every expert's resident time: a miss never speeds the kernel up),
                serial with the other kernels (and then not in t_hbm)
    t_host    = copy-path MoE layers (larger steps, or a mapped path off): CACHED_EXPERT_S per expert touched
    t_launch  = layers * LAUNCH_S (eager) or LAUNCH_GRAPH_S (CUDA graphs)
    t_comm    = 2 all-reduces per layer under TP (ALLREDUCE_S + ring bytes over NVLink or PCIe)
Packed experts (int4 / NF4) are read at `PACKED_TIME` of a dense expert's time, resident and in place.
A prefill chunk of T tokens: max(2 * active params * T / (TFLOP/s * MFU), streamed bytes / H2D) + t_launch.
The constants marked "measured" come from one H200 session (docs/benchmarks.md); the others are assumptions
until `ferry plan --check` / `benchmarks/bench_plan.py` measure them. Knows nothing about files or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

HBM_EFF = 0.8
"""Share of peak HBM bandwidth a decode step's GEMVs reach."""
MOE_HBM_EFF = 0.27
"""Measured: share of peak HBM bandwidth the fused MoE kernel reaches reading resident experts with one token
per expert (two bf16 Mixtral experts, 705 MB, in 0.54 ms on the H200: 1.3 of 4.8 TB/s; `bench_mapped.py`);
the 8-layer resident Mixtral's 228 tok/s at batch 1 is that kernel's time and little else. At batch 32
(8 tokens per expert) the same model's 3656 tok/s is 54% of peak: `moe_hbm_eff` fits the two."""

MFU = 0.5
"""Share of peak tensor FLOP/s large GEMMs reach."""
LAUNCH_S = 150e-6
"""Per layer, eager PyTorch: ~10 kernels plus Python."""
LAUNCH_GRAPH_S = 15e-6
"""Per layer inside a CUDA graph."""
ALLREDUCE_S = 20e-6
"""Fixed cost of one tensor-parallel all-reduce (two per layer), on top of its bytes over the link."""
INPLACE_EFF = 0.85
"""Measured: the fused MoE kernel reading dense experts in place from mapped host memory reaches 45-47 GB/s
against the copy engine's 54.6 (H200, `benchmarks/bench_mapped.py`, 2026-12-01)."""
PACKED_TIME = {"nf4": (5.4, 0.92), "int4": (5.4, 0.92)}
"""Packed expert format -> (resident, in place) time to read one expert, relative to the same expert dense in
bf16. Measured for NF4 g64 (H200, two Mixtral experts at one token: resident 2.94 vs 0.54 ms, in place 13.7 vs
14.9 ms): the first packed kernel is latency-bound, so 4-bit experts buy memory (more of them resident, a
higher hit rate) but not time per expert. int4 is not measured: assumed equal to NF4."""
HOST_EXPERT_EFF = 0.37
"""Measured: bf16 experts at one token computed on the host's cores while host-to-device copies run reach 0.37
of the host's memory read rate (lent H200 host, 16 threads: a Mixtral expert at 33.4 GB/s beside H2D, read
90.7 GB/s alone; `benchmarks/bench_cpu_experts.py`). The hybrid decode path's host side runs at this."""
HOST_READ_EFF = 0.6
"""Assumed: share of one node's data-sheet memory bandwidth a host sustains reading (when not measured)."""
CACHED_EXPERT_S = 0.4e-3
"""Measured (fitted): host time per expert a copy-path MoE layer touches (one sync, dispatch and launches
per expert, eager): Qwen3-30B-A3B under 8 GiB decodes 6.27 tok/s at batch 1 on that path, ~3.2 ms a layer
beyond its copies with 8 experts touched; Mixtral (2 touched) < 0.8 ms (H200, docs/benchmarks.md)."""


def moe_hbm_eff(tokens_per_expert: float) -> float:
    """0.27 at one token per expert, 0.54 at eight (both measured, H200), as t^(1/3) between; at most HBM_EFF."""
    return min(HBM_EFF, MOE_HBM_EFF * max(tokens_per_expert, 1.0) ** (1 / 3))


@dataclass(frozen=True)
class StepCost:
    hbm_bytes: float
    pcie_bytes: float
    """Bytes the copy engine moves host -> device (overlapped with compute)."""
    flops: float
    layers: int
    graphs: bool = False
    comm_s: float = 0.0
    """Tensor-parallel all-reduces of the step (not overlapped with compute)."""
    expert_hbm_bytes: float = 0.0
    """Dense-equivalent bytes of experts the fused MoE kernel reads from HBM (at `moe_hbm_eff`)."""
    tokens_per_expert: float = 1.0
    expert_all_bytes: float = 0.0
    """Mapped steps: dense-equivalent bytes of every expert the step uses, as if all were resident. Its HBM
    time is the floor of the experts' time: misses read in place never make the kernel faster than all-resident
    (without it a higher hit rate could predict a slower step, the hits' HBM share growing)."""
    host_experts_s: float = 0.0
    """Hybrid decode: seconds the host's cores spend on their share of the misses, beside the kernel (mapped;
    on the copy path, a term of the roofline's max)."""
    mapped: bool = False
    """Misses read in place: one fused launch reads hits from HBM and misses over PCIe side by side, so the
    experts take max(hits, in-place reads), serial with the step's other kernels."""
    inplace_bytes: float = 0.0
    """Dense-equivalent bytes the fused kernel reads in place over PCIe (serial with the step's kernels)."""
    host_s: float = 0.0
    """Host overhead of copy-path MoE layers (serial)."""


@dataclass(frozen=True)
class StepTime:
    seconds: float
    binding: str
    """hbm | pcie | host (host RAM: experts computed on the host's cores) | compute | launch | comm"""
    parts: dict

    def rate(self, tokens: int) -> float:
        return tokens / self.seconds if self.seconds > 0 else float("inf")


def step_time(cost: StepCost, hbm_gbs: float, h2d_gbs: float, tflops: float) -> StepTime:
    eff = hbm_gbs * 1e9 * moe_hbm_eff(cost.tokens_per_expert)
    experts = max(cost.expert_hbm_bytes, cost.expert_all_bytes if cost.mapped else 0.0) / eff
    inplace = cost.inplace_bytes / (h2d_gbs * 1e9 * INPLACE_EFF) if cost.inplace_bytes else 0.0
    parts = {"hbm": cost.hbm_bytes / (hbm_gbs * 1e9 * HBM_EFF) + (0.0 if cost.mapped else experts),
             "pcie": cost.pcie_bytes / (h2d_gbs * 1e9) if cost.pcie_bytes else 0.0,
             "compute": cost.flops / (tflops * 1e12 * MFU),
             "mapped_experts": max(experts, inplace, cost.host_experts_s) if cost.mapped else 0.0,
             "host_experts": 0.0 if cost.mapped else cost.host_experts_s,
             "host": cost.host_s,
             "launch": cost.layers * (LAUNCH_GRAPH_S if cost.graphs else LAUNCH_S), "comm": cost.comm_s}
    roof = max(("hbm", "pcie", "compute", "host_experts"), key=parts.get)  # host experts beside the copies
    seconds = parts[roof] + parts["mapped_experts"] + parts["host"] + parts["launch"] + parts["comm"]
    by_resource = {"hbm": (parts["hbm"] if roof == "hbm" else 0.0) + (experts if cost.mapped and experts >= inplace else 0.0),
                   "compute": parts["compute"] if roof == "compute" else 0.0,
                   "pcie": (parts["pcie"] if roof == "pcie" else 0.0) + (inplace if cost.mapped and inplace > experts else 0.0),
                   "host": (cost.host_experts_s if cost.mapped and cost.host_experts_s > max(experts, inplace) else 0.0)
                   + (parts["host_experts"] if roof == "host_experts" else 0.0),
                   "launch": parts["launch"] + parts["host"], "comm": parts["comm"]}
    return StepTime(seconds, max(by_resource, key=by_resource.get), parts)


def allreduce_s(tp: int, nbytes: float, link_gbs: float) -> float:
    """One ring all-reduce of `nbytes` over `tp` ranks."""
    return 0.0 if tp == 1 else ALLREDUCE_S + 2 * (tp - 1) / tp * nbytes / (link_gbs * 1e9)
