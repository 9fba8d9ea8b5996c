"""Measured bandwidths: host memory read, and per GPU pinned / pageable host-to-device and device-to-host and
HBM copy rate, plus a pinning test at the size a plan needs (in 1 GiB chunks). Each figure is the best of a
few timed repetitions after a warm-up. Runs only when asked (`ferry doctor --measure`): it allocates memory
and takes seconds.

Per NUMA node: the measuring thread is bound to the node's CPUs (`os.sched_setaffinity`, restored after)
and torch runs on that one thread, so the buffers it allocates and fills are first-touched on that node
(Linux's default local allocation): host memory read and host<->GPU copies from each node's own memory. A
machine with one node (or a process allowed onto one node's CPUs only) is measured once, and the result says
so. Knows nothing about judging the figures (`doctor.py`).
"""

from __future__ import annotations

import contextlib
import os
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
    """Torch (on its current threads) reading a buffer that does not fit in cache (a sum); the buffer is
    allocated and filled here, so its pages sit on the node of the CPUs the filling threads run on."""
    x = torch.ones(size_mib * MIB // 4)
    return x.numel() * 4 / _best(lambda: x.sum().item()) / 1e9


def gpu_gbs(index: int, size_mib: int = 256, hbm: bool = True, keep: list | None = None) -> dict:
    """`keep`: a list that takes the pinned buffer, so it is not freed (and reused) after."""
    dev = torch.device("cuda", index)
    n = size_mib * MIB
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    if keep is not None:
        keep.append(pinned)
    pageable = torch.ones(n, dtype=torch.uint8)  # written: first-touched where this thread runs
    d = torch.empty(n, dtype=torch.uint8, device=dev)

    def timed(copy) -> float:
        def run():
            copy()
            torch.cuda.synchronize(dev)
        return n / _best(run) / 1e9

    out = {"pinned_h2d_gbs": timed(lambda: d.copy_(pinned, non_blocking=True)),
           "pageable_h2d_gbs": timed(lambda: d.copy_(pageable)),
           "pinned_d2h_gbs": timed(lambda: pinned.copy_(d, non_blocking=True)),
           "pageable_d2h_gbs": timed(lambda: pageable.copy_(d))}
    if hbm:
        d2 = torch.empty_like(d)
        out["hbm_copy_gbs"] = 2 * timed(lambda: d2.copy_(d))  # read + write
    return out


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


def allowed_nodes(numa_nodes: dict) -> dict[int, list[int]]:
    """node -> the CPUs of that node this process may run on (`probe.HostReadings.numa_nodes`); nodes with
    none are left out (a cpuset can shut a process out of a node)."""
    allowed = os.sched_getaffinity(0)
    out = {}
    for node, info in sorted(numa_nodes.items()):
        cpus = [c for c in info.get("cpus", []) if c in allowed]
        if cpus:
            out[node] = cpus
    return out


@contextlib.contextmanager
def bound_to(cpus: list[int]):
    """Run this thread, and torch on this thread only, on `cpus`; both restored after."""
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(1)  # intra-op threads would run (and first-touch) wherever they were started
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, before)


def measure_nodes(nodes: dict[int, list[int]], gpus: list[int], size_mib: int = 256, keep: list | None = None) -> dict:
    """Per node: host read and host<->GPU copy rates with the thread and buffers on that node. `keep` holds
    every pinned buffer until the caller drops it: torch caches freed pinned blocks, and a reused block
    would sit on the node that first touched it."""
    keep = [] if keep is None else keep
    out = {}
    for node, cpus in nodes.items():
        with bound_to(cpus):
            out[node] = {"cpus": len(cpus), "threads": 1, "host_read_gbs": host_read_gbs(size_mib),
                         "gpus": {i: gpu_gbs(i, size_mib, hbm=False, keep=keep) for i in gpus}}
    return out


def measure(pin_gb: float = 0.0, numa_nodes: dict | None = None, size_mib: int = 256) -> dict:
    """`numa_nodes`: the host's nodes (`probe.read_host().numa_nodes`); with two or more this process may
    use, host read and copies are measured from each (`nodes`), else once (`per_node` says which)."""
    gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    out: dict = {"host_read_gbs": host_read_gbs(size_mib), "host_read_threads": torch.get_num_threads(), "gpus": {}}
    keep: list = []
    for i in gpus:
        r = gpu_gbs(i, size_mib, keep=keep)
        if pin_gb:
            r["pinned_ok_gb"], r["pinned_want_gb"] = pin_test(pin_gb), pin_gb
        out["gpus"][i] = r
    nodes = allowed_nodes(numa_nodes or {})
    if len(nodes) > 1:
        out["nodes"] = measure_nodes(nodes, gpus, size_mib, keep)
        out["per_node"] = f"measured from each of {len(nodes)} NUMA nodes"
    else:
        total = len(numa_nodes or {}) or 1
        out["per_node"] = ("one NUMA node: measured once" if total == 1 else
                           f"this process may run on one of {total} NUMA nodes only: measured once")
    return out
