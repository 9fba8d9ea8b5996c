"""Measured bandwidths: host memory read, and per GPU pinned / pageable host-to-device, pinned
device-to-host and HBM copy rate, plus a pinning test at the size a plan needs (in 1 GiB chunks).
Each figure is the best of a few timed repetitions after a warm-up. Runs only when asked
(`ferry doctor --measure`): it allocates memory and takes seconds.
TODO: per NUMA node (bind the measuring thread and buffer to each node, e.g. with os.sched_setaffinity
and a first-touch buffer) - today it measures from wherever the process runs.
"""

from __future__ import annotations

import time

import torch

MIB = 2**20


def _best(fn, reps: int = 5) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def host_read_gbs(size_mib: int = 256) -> float:
    """One thread's worth of torch reading a buffer that does not fit in cache (a sum)."""
    x = torch.ones(size_mib * MIB // 4)
    return x.numel() * 4 / _best(lambda: x.sum().item()) / 1e9


def gpu_gbs(index: int, size_mib: int = 256) -> dict:
    dev = torch.device("cuda", index)
    n = size_mib * MIB
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8)
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    d2 = torch.empty_like(d)

    def timed(copy) -> float:
        def run():
            copy()
            torch.cuda.synchronize(dev)
        return n / _best(run) / 1e9

    return {"pinned_h2d_gbs": timed(lambda: d.copy_(pinned, non_blocking=True)),
            "pageable_h2d_gbs": timed(lambda: d.copy_(pageable)),
            "pinned_d2h_gbs": timed(lambda: pinned.copy_(d, non_blocking=True)),
            "hbm_copy_gbs": 2 * timed(lambda: d2.copy_(d))}  # read + write


def pin_test(want_gb: float) -> float:
    """GB of host memory that could be pinned, up to `want_gb`, in 1 GiB chunks (all freed after)."""
    chunks = []
    try:
        while len(chunks) * 2**30 < want_gb * 1e9:
            chunks.append(torch.empty(2**30, dtype=torch.uint8, pin_memory=True))
    except RuntimeError:
        pass
    got = len(chunks) * 2**30 / 1e9
    del chunks
    return got


def measure(pin_gb: float = 0.0) -> dict:
    out: dict = {"host_read_gbs": host_read_gbs(), "gpus": {}}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            r = gpu_gbs(i)
            if pin_gb:
                r["pinned_ok_gb"], r["pinned_want_gb"] = pin_test(pin_gb), pin_gb
            out["gpus"][i] = r
    return out
