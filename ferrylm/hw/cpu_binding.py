"""CPU placement of the process: torch's thread count and binding to one NUMA node (its CPUs through
`sched_setaffinity`, its memory through the `set_mempolicy` system call, so no libnuma is needed).

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
    if threads is not None:
        torch.set_num_threads(threads)
