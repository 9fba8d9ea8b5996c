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

`cpu_share` also counts what a host call costs beyond its bytes, measured in the engine
(`placed_weights._start_host_decode`, through the real hand-off): `handoff_s`, the device-visible round trip of
one layer's hand-off with no host work (host nodes, the worker's wake-up, the rows' copies back), and
`call_s`, an expert call's fixed cost (dispatch, the thread team's start). On the H200 host the bytes of a
Qwen3-30B-A3B expert (9.4 MB) take ~0.1 ms where a hand-off cost ~0.5 ms (session 9: batch-1 decode 17.6 ms
a step split, 10.6 ms unsplit), so a layer whose misses take the device less than the fixed costs gets share 0:
hybrid decode stays off.
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
    handoff_s: float = 0.0
    """Device-visible seconds of one layer's hand-off to the host with no work (the hybrid decode path)."""
    call_s: float = 0.0
    """Host seconds one expert call costs beyond its bytes (part of `cpu_s`; what splitting an expert repeats)."""

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
    if cpu and max(t_copy, t_cpu) > (1 - SPLIT_MARGIN) * len(tokens) * costs.copy_s:
        return sorted(tokens), []  # the host's gain is within the model's error: copy all
    return sorted(copy), sorted(cpu)


SPLIT_MARGIN = 0.2
"""The host takes copy-road misses only when the split is predicted this much shorter than copying them all. The
model's host time is an expert's calibrated time; the engine's host steps cost more (the rows' gather and scatter,
the join): on the H200 a 2k prefill of Mixtral 16L bf16 (~512 tokens an expert) was predicted ~12% shorter
with one or two experts a layer on the host and ran 30% slower (2002 tok/s against 2865 copying all, session 19).
Decode steps of a few tokens an expert, where the host wins by half, are unaffected."""


MIN_SHARE = 0.1
"""Below this balanced share hybrid decode stays off: the saving it predicts (s of the misses' device time) is
smaller than what the model leaves out (the split's second in-place launch, the host's traffic beside the
device's reads). Measured on the H200: Mixtral 32 layers with NF4 experts under 16 GiB, whose host NF4 kernel
runs 0.5 GB/s, balanced at 0.02 and decoded 5.51 tok/s against 6.36 with the host off (batch 1; 26.1 against
29.0 at batch 16; `bench_offload.py --cases hybrid32-nf4`, session 10)."""


def balanced_share(device_s: float, fixed_s: float, host_s: float) -> float:
    """The share s of a layer's missed bytes for the host, so that both sides finish together: the misses take
    the device `device_s` alone, the host `fixed_s + s * host_s`; (1 - s) device_s = fixed_s + s host_s.
    0 when that s is below `MIN_SHARE` (hybrid does not pay), in particular when the fixed cost alone is no
    shorter than the device's time."""
    if device_s <= fixed_s or device_s + host_s <= 0:
        return 0.0
    s = min(1.0, (device_s - fixed_s) / (device_s + host_s))
    return s if s >= MIN_SHARE else 0.0


def cpu_share(costs: Costs, inplace_rate_gbs: float | None = None, tokens: int = 1, misses: float = 1.0,
              split: bool = True) -> float:
    """The fraction of a layer's non-resident expert bytes to give the host so that both sides finish
    together. The device reads `misses` experts (expected per layer and step) in place at `inplace_rate_gbs`
    (default the measured `costs.inplace_gbs`, else the copy rate); the host pays `handoff_s` per layer, then
    with `split` (every miss split along its intermediate) `call_s` per miss and the rest of
    `cpu_s_beside_copy(tokens)` in proportion to its columns, else (whole experts) `cpu_s_beside_copy` per
    expert it takes. With no fixed costs this is r_cpu / (r_cpu + r_device) whatever `misses`.
    `tokens`: tokens per expert."""
    if costs.expert_bytes <= 0:
        raise ValueError("cpu_share needs the expert's bytes (Costs.expert_bytes)")
    gbs = inplace_rate_gbs if inplace_rate_gbs is not None else costs.inplace_gbs
    dev_s = costs.expert_bytes / (gbs * 1e9) if gbs is not None else costs.copy_s
    host_s = costs.cpu_s_beside_copy(tokens)
    fixed = costs.handoff_s
    if split:
        call = min(costs.call_s, host_s)
        fixed, host_s = fixed + misses * call, host_s - call
    return balanced_share(misses * dev_s, fixed, misses * host_s)


def makespan(tokens: dict[int, int], costs: Costs, copy: list[int], cpu: list[int]) -> float:
    """The later of the two queues' finish times for a split (what the layer waits for)."""
    cpu_s = costs.cpu_s_beside_copy if copy else costs.cpu_s
    return max(len(copy) * costs.copy_s, sum(cpu_s(tokens[e]) for e in cpu))
