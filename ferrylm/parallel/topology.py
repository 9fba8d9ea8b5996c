"""Which GPU each rank takes. With `tp_groups auto`, the ranks of one tensor-parallel group (stage-major
rank order: stage s = ranks s*tp .. s*tp+tp-1) go to GPUs that share a NUMA node - one CPU socket's
PCIe root - and, within it, a PCIe switch, so the per-layer all-reduces never cross the socket link;
pipeline stages (one hidden-state transfer per step) span sockets instead. Each rank is also bound to its
GPU's NUMA node (host memory and threads). On the CPU, or with `in-order`, rank r takes device r.

`plan_groups` is the pure rule (tested with made-up machines); `probe_gpus` reads the machine from torch
and sysfs (`/sys/bus/pci/devices/<bus id>/numa_node` and the bridge chain of its real path).
It knows nothing about process groups or models.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPU:
    index: int
    numa_node: int
    """-1 when the machine does not say."""
    bridges: tuple[str, ...] = ()
    """PCI bridges from the root port down to the GPU (its switch is the last one or two)."""


def plan_groups(gpus: list[GPU], tp: int, pp: int) -> tuple[list[int], list[str]]:
    """(GPU index for each rank, lines saying why). GPUs are ordered by NUMA node, then by PCI path, so
    consecutive ranks (one TP group) share the closest link the machine has."""
    world = tp * pp
    if len(gpus) < world:
        from ferrylm.errors import ConfigError

        raise ConfigError(f"{world} ranks need {world} GPUs, the machine has {len(gpus)}")
    ordered = sorted(gpus, key=lambda g: (g.numa_node, g.bridges, g.index))[:world]
    order = [g.index for g in ordered]
    why = []
    for s in range(pp):
        group = ordered[s * tp:(s + 1) * tp]
        nodes = sorted({g.numa_node for g in group})
        where = f"NUMA node {nodes[0]}" if len(nodes) == 1 else f"NUMA nodes {nodes}"
        shared = os.path.commonprefix([g.bridges for g in group]) if tp > 1 else ()
        switch = f", under PCI bridge {shared[-1]}" if shared else ""
        why.append(f"stage {s}: TP group on GPUs {[g.index for g in group]} ({where}{switch})")
        if len(nodes) > 1 and nodes[0] >= 0:
            why.append(f"stage {s}: its all-reduces cross the CPU socket link; a smaller tensor_parallel_size "
                       f"with more pipeline stages keeps each group on one socket")
    return order, why


def _numa_node(bus_id: str) -> int:
    try:
        with open(f"/sys/bus/pci/devices/{bus_id}/numa_node") as f:
            return int(f.read())
    except (OSError, ValueError):
        return -1


def _bridges(bus_id: str) -> tuple[str, ...]:
    """The PCI devices between the root complex and the GPU, from sysfs's real path of the device."""
    path = os.path.realpath(f"/sys/bus/pci/devices/{bus_id}")
    parts = [p for p in path.split("/") if ":" in p and "." in p]
    return tuple(parts[:-1])


def probe_gpus() -> list[GPU]:
    import torch

    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        bus = getattr(p, "pci_bus_id", None)
        if bus is None:
            out.append(GPU(i, -1))
            continue
        bus_id = f"{getattr(p, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(p, 'pci_device_id', 0):02x}.0"
        out.append(GPU(i, _numa_node(bus_id), _bridges(bus_id)))
    return out


def device_order(config, world: int) -> list[int] | None:
    """GPU index of each local rank, or None (rank r on device r; always on the CPU). Logs the groups."""
    if not config.device.startswith("cuda") or config.parallel.tp_groups == "in-order":
        return None
    gpus = probe_gpus()
    pc = config.parallel
    order, why = plan_groups(gpus, pc.tensor_parallel_size, world // pc.tensor_parallel_size)
    for line in why:
        log.warning("tp-groups auto: %s", line)
    return order


def numa_node_of(config, gpu: int) -> int | None:
    """The NUMA node a rank on `gpu` is bound to (`tp_groups auto` on CUDA with no --numa-node of its own)."""
    if not config.device.startswith("cuda") or config.parallel.tp_groups == "in-order" or config.numa_node is not None:
        return config.numa_node
    node = next((g.numa_node for g in probe_gpus() if g.index == gpu), -1)
    return node if node >= 0 else None
