"""Host time of the mapped caches' slot policy per decode step (CPU, seconds): `DuelingPolicy.observe` and
`choose` on random batch-1 routing, the engine's default policy, at a layer and expert count (default the
Qwen3-30B-A3B shape: 48 layers, 128 experts, top-8, 16 slots). The policy runs on the engine thread after each
step is queued (`offload/routing_tally.py`), so on a fast step its time is the step's.

    PYTHONPATH=. python benchmarks/bench_slot_policy_host.py [--layers 48] [--experts 128] [--steps 200]

Run it on two commits to compare (the figure is this host's). Ends with one JSON line (benchmarks/results.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import write_results  # noqa: E402

from ferrylm.offload.slot_policy import DuelingPolicy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    L, E = a.layers, a.experts
    resident = torch.zeros(L, E, dtype=torch.bool)
    resident[:, :a.slots] = True
    pinned = torch.zeros(L, E, dtype=torch.bool)
    policy = DuelingPolicy(L, E, resident, pinned, [0] * L)
    times, promoted = [], 0
    for _ in range(a.steps):
        counts = torch.zeros(L, E).scatter_(1, torch.randint(0, E, (L, a.top_k)), 1.0)
        t = time.perf_counter()
        policy.observe(counts)
        out = policy.choose(resident, pinned, [set() for _ in range(L)], [0] * L)
        times.append(time.perf_counter() - t)
        for i, e, v in out:  # the engine's books: e in, its victim out
            resident[i, e], resident[i, v] = True, False
        promoted += len(out)
    ms = sorted(times)[len(times) // 2] * 1e3
    print(f"{L} layers x {E} experts: {ms:.2f} ms a step (median of {a.steps}), {promoted / a.steps:.1f} promotions a step")
    write_results("slot-policy-host", [{"layers": L, "experts": E, "top_k": a.top_k, "slots": a.slots,
                                        "steps": a.steps, "ms_per_step": ms,
                                        "promotions_per_step": promoted / a.steps}], out=a.out)


if __name__ == "__main__":
    main()
