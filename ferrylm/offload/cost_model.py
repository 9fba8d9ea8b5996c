"""The hybrid cost model: for one layer's cache misses, which to copy to the device and which to compute
on the host's cores where they lie. A plain function of measured inputs (`offload/calibration.py`).

The copy engine and the CPU pool are two queues that run at the same time as each other and as the GPU.
A miss copied costs `copy_s` on the copy queue (then GPU time, small beside it); a miss computed on the
CPU costs `cpu_s(tokens)` on the CPU queue, plus moving its rows across twice (negligible for decode).
Misses go, largest CPU cost first, to whichever queue would finish earlier with it (LPT scheduling of
two machines): the layer waits for the later queue, so balancing them is what shortens the step. The CPU
queue is costed beside copies (`cpu_s_beside_copy`): the two share the host's memory bandwidth.

`cpu_share` is the same balance for the in-place decode path, in bytes: the fraction of a layer's
non-resident expert bytes to compute on the host so that the host and the device's in-place reads finish
together.

TODO (issue 10, where it stands after session 9): the model has no fixed per-call host cost. On the H200 host,
batch-1 decode of the Qwen3-30B-A3B shape (9.4 MB experts, 16 layers, 4 GiB) ran 17.6 ms a step under `auto`
(share 0.28, every miss split along its intermediate) and 10.6 ms with copies / in-place reads only
(`benchmarks/profile_offload.py`, docs/benchmarks.md "session 9"): each host call cost 0.58 ms busy where the
bytes say ~0.1. The split should be s = (b / r_dev - F) / (b / r_dev + b / r_cpu) with F that per-call cost,
measured in the engine (host busy per call less its bytes' time) rather than by `offload/calibration.py`'s
isolated runs, and hybrid decode off (share 0) where a layer's misses take the device less than F.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Costs:
    copy_s: float
    """Seconds to copy one expert host -> device (its bytes / measured pinned bandwidth)."""
    cpu_s: Callable[[int], float]
    """Seconds for the host to run one expert on n tokens."""
    cpu_beside_factor: float = 1.0
    """How much slower a host expert runs while copies are in flight (measured at 1 token; >= 1)."""
    expert_bytes: int = 0
    """Bytes of one expert as the host holds it (its format's)."""
    inplace_gbs: float | None = None
    """GB/s at which the device reads an expert in place from host memory (CUDA, mapped banks), if measured."""

    def cpu_s_beside_copy(self, n: int) -> float:
        """Seconds for the host to run one expert on n tokens while copies run."""
        return self.cpu_s(n) * self.cpu_beside_factor


def split_misses(tokens: dict[int, int], costs: Costs, mode: str = "auto") -> tuple[list[int], list[int]]:
    """tokens: miss expert -> tokens routed to it. Returns (copy, cpu) expert lists.
    mode: auto (balance the two queues), gpu (copy all), cpu (compute all on the host)."""
    if mode == "gpu" or not tokens:
        return sorted(tokens), []
    if mode == "cpu":
        return [], sorted(tokens)
    copy, cpu, t_copy, t_cpu = [], [], 0.0, 0.0
    for e in sorted(tokens, key=lambda e: (-costs.cpu_s(tokens[e]), e)):
        c = costs.cpu_s_beside_copy(tokens[e])
        if t_cpu + c < t_copy + costs.copy_s:
            cpu.append(e)
            t_cpu += c
        else:
            copy.append(e)
            t_copy += costs.copy_s
    return sorted(copy), sorted(cpu)


def cpu_share(costs: Costs, inplace_rate_gbs: float | None = None, tokens: int = 1) -> float:
    """The fraction of a layer's non-resident expert bytes to give the host so that both sides finish
    together: the host reads bytes at expert_bytes / cpu_s_beside_copy(tokens) (it runs beside the device's
    reads), the device at `inplace_rate_gbs` (default the measured `costs.inplace_gbs`, else the copy rate),
    so the host takes r_cpu / (r_cpu + r_device). `tokens`: tokens per expert."""
    if costs.expert_bytes <= 0:
        raise ValueError("cpu_share needs the expert's bytes (Costs.expert_bytes)")
    r_cpu = costs.expert_bytes / costs.cpu_s_beside_copy(tokens)
    gbs = inplace_rate_gbs if inplace_rate_gbs is not None else costs.inplace_gbs
    r_dev = gbs * 1e9 if gbs is not None else costs.expert_bytes / costs.copy_s
    return r_cpu / (r_cpu + r_dev) if r_cpu + r_dev > 0 else 0.0


def makespan(tokens: dict[int, int], costs: Costs, copy: list[int], cpu: list[int]) -> float:
    """The later of the two queues' finish times for a split (what the layer waits for)."""
    cpu_s = costs.cpu_s_beside_copy if copy else costs.cpu_s
    return max(len(copy) * costs.copy_s, sum(cpu_s(tokens[e]) for e in cpu))
