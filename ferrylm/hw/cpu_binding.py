"""CPU placement of the process: torch's thread count and binding to one NUMA node (its CPUs through
`sched_setaffinity`, its memory through the `set_mempolicy` system call, so no libnuma is needed); and of
one thread (the host expert worker: `bind_thread`) and one range of host memory (`bind_memory`, mbind).

Linux only for NUMA; it knows nothing about models or the engine.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

import torch

from ferrylm.errors import ConfigError

log = logging.getLogger(__name__)
_NODES = "/sys/devices/system/node"
_MPOL_BIND = 2
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]"""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            a, _, b = part.partition("-")
            cpus += range(int(a), int(b or a) + 1)
    return cpus


def numa_nodes() -> dict[int, list[int]]:
    """NUMA node -> its CPUs ({} where the kernel does not say)."""
    if not os.path.isdir(_NODES):
        return {}
    nodes = {}
    for d in sorted(os.listdir(_NODES)):
        if d.startswith("node") and d[4:].isdigit():
            with open(os.path.join(_NODES, d, "cpulist")) as f:
                nodes[int(d[4:])] = parse_cpulist(f.read())
    return nodes


def _bind_memory(node: int) -> bool:
    nr = _SYS_SET_MEMPOLICY.get(platform.machine())
    if nr is None:
        return False
    mask = ctypes.c_ulong(1 << node)
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(nr, _MPOL_BIND, ctypes.byref(mask), ctypes.c_ulong(node + 2)) == 0


def check_threads(threads: int | None, cpus: list[int] | None = None, what: str = "--threads") -> None:
    """A warning when `threads` (a flag's value; None: not given) exceed the CPUs they run on (`cpus`, None: those this
    thread may run on): threads past the cores take turns (64 on 2 cores: a small MoE decoded 2.7x slower)."""
    if threads is None:
        return
    have = len(cpus) if cpus else len(os.sched_getaffinity(0))
    if threads > have:
        log.warning("%s %d: more threads than the %d CPU(s) they run on, so they take turns (slower); use %d or fewer",
                    what, threads, have, have)


def bind_cpu(threads: int | None = None, numa_node: int | None = None) -> None:
    """Apply `--threads` / `--numa-node`; either may be None (leave as is)."""
    if threads is not None and threads < 1:
        raise ConfigError(f"threads must be >= 1, not {threads}")
    if numa_node is not None:
        nodes = numa_nodes()
        if numa_node not in nodes:
            have = ", ".join(map(str, sorted(nodes))) or "none reported"
            raise ConfigError(f"--numa-node {numa_node}: no such NUMA node (this machine has: {have})")
        if len(nodes) == 1:
            log.warning("--numa-node %d: this machine has one NUMA node; binding changes nothing", numa_node)
        cpus = nodes[numa_node]
        os.sched_setaffinity(0, cpus)
        if not _bind_memory(numa_node):
            log.warning("--numa-node %d: could not bind memory to the node (CPUs are bound)", numa_node)
        threads = threads or len(cpus)
    check_threads(threads)  # against the CPUs the process now runs on (the node's, when bound)
    if threads is not None:
        torch.set_num_threads(threads)


# -- one thread (the host expert worker) and one range of memory (its experts' banks) -------------------

_SYS_MBIND = {"x86_64": 237, "aarch64": 235}
_SYS_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}
_MPOL_MF_MOVE = 2
_MPOL_F_ADDR = 2
_PAGE = 4096


def _pages(t: torch.Tensor) -> tuple[int, int]:
    """(start, length) of the whole pages inside t's bytes (a neighbour's page is never touched)."""
    start = -(-t.data_ptr() // _PAGE) * _PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // _PAGE * _PAGE
    return start, max(end - start, 0)


def bind_memory(t: torch.Tensor, node: int) -> bool:
    """Bind the pages of host tensor `t` to NUMA node `node` (mbind MPOL_BIND; pages already touched move
    where the kernel can move them: pinned pages cannot, so bind before pinning). False if it failed."""
    nr = _SYS_MBIND.get(platform.machine())
    start, length = _pages(t)
    if nr is None or not 0 <= node < 64:
        return False
    if length == 0:
        return True
    mask = ctypes.c_ulong(1 << node)
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(nr, ctypes.c_void_p(start), ctypes.c_ulong(length), _MPOL_BIND, ctypes.byref(mask),
                        ctypes.c_ulong(node + 2), ctypes.c_uint(_MPOL_MF_MOVE)) == 0


def memory_policy(t: torch.Tensor) -> tuple[int, int] | None:
    """(policy mode, node mask) of the first whole page of `t` (get_mempolicy), None where unknown."""
    nr = _SYS_GET_MEMPOLICY.get(platform.machine())
    start, length = _pages(t)
    if nr is None or length == 0:
        return None
    mode, mask = ctypes.c_int(0), ctypes.c_ulong(0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(nr, ctypes.byref(mode), ctypes.byref(mask), ctypes.c_ulong(64), ctypes.c_void_p(start),
                    ctypes.c_ulong(_MPOL_F_ADDR)) != 0:
        return None
    return mode.value, mask.value


def node_cpus(numa_node: int, what: str = "--cpu-numa-node") -> list[int] | None:
    """The CPUs of `numa_node`; None (with a warning) on a machine of one node, where binding changes nothing;
    a `ConfigError` naming the nodes there are for a node that does not exist."""
    nodes = numa_nodes()
    if numa_node not in nodes:
        have = ", ".join(map(str, sorted(nodes))) or "none reported"
        raise ConfigError(f"{what} {numa_node}: no such NUMA node (this machine has: {have})")
    if len(nodes) == 1:
        log.warning("%s %d: this machine has one NUMA node; binding changes nothing", what, numa_node)
        return None
    return nodes[numa_node]


def bind_thread(cpus: list[int], threads: int | None = None, tid: int = 0) -> None:
    """Bind one thread to `cpus`: the caller (tid 0: Linux's sched_setaffinity binds that thread only), or
    the thread of native id `tid` (before it starts torch work); the OpenMP threads torch starts from it
    afterwards inherit the mask. `threads`: torch's intra-op thread count (None: one per CPU)."""
    os.sched_setaffinity(tid, cpus)
    torch.set_num_threads(threads or len(cpus))


def worker_pool(cpus: list[int] | None, threads: int | None = None, name: str = "ferry-cpu-experts"):
    """A one-thread executor whose thread is bound to `cpus` (None: unbound) with `threads` torch threads
    (None: one per bound CPU, or torch's default when unbound)."""
    from concurrent.futures import ThreadPoolExecutor

    def init():
        if cpus:
            bind_thread(cpus, threads)
        elif threads:
            torch.set_num_threads(threads)
    return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=init)
