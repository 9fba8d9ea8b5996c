"""Device time of a call, as the engine runs its decode steps: captured in a CUDA graph and replayed (eager timing
of a small kernel measures the host's launches). Shared by the benchmarks that time kernels."""

from __future__ import annotations

import torch


def graphed_us(fn, iters: int) -> float:
    """Microseconds per call: `iters` calls captured in one CUDA graph, replayed and timed with events."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compile, autotune caches, allocator
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / iters)
    return best
