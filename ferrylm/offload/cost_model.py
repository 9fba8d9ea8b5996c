"""The hybrid cost model: for one layer's cache misses, which to copy to the device and which to compute
on the host's cores where they lie. A plain function of measured inputs (`offload/calibration.py`).

The copy engine and the CPU pool are two queues that run at the same time as each other and as the GPU.
A miss copied costs `copy_s` on the copy queue (then GPU time, small beside it); a miss computed on the
CPU costs `cpu_s(tokens)` on the CPU queue, plus moving its rows across twice (negligible for decode).
Misses go, largest CPU cost first, to whichever queue would finish earlier with it (LPT scheduling of
two machines): the layer waits for the later queue, so balancing them is what shortens the step.
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


def split_misses(tokens: dict[int, int], costs: Costs, mode: str = "auto") -> tuple[list[int], list[int]]:
    """tokens: miss expert -> tokens routed to it. Returns (copy, cpu) expert lists.
    mode: auto (balance the two queues), gpu (copy all), cpu (compute all on the host)."""
    if mode == "gpu" or not tokens:
        return sorted(tokens), []
    if mode == "cpu":
        return [], sorted(tokens)
    copy, cpu, t_copy, t_cpu = [], [], 0.0, 0.0
    for e in sorted(tokens, key=lambda e: (-costs.cpu_s(tokens[e]), e)):
        c = costs.cpu_s(tokens[e])
        if t_cpu + c < t_copy + costs.copy_s:
            cpu.append(e)
            t_cpu += c
        else:
            copy.append(e)
            t_copy += costs.copy_s
    return sorted(copy), sorted(cpu)


def makespan(tokens: dict[int, int], costs: Costs, copy: list[int], cpu: list[int]) -> float:
    """The later of the two queues' finish times for a split (what the layer waits for)."""
    return max(len(copy) * costs.copy_s, sum(costs.cpu_s(tokens[e]) for e in cpu))
