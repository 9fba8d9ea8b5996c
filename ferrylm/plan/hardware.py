"""Hardware profiles: what the planner assumes about a GPU and a host, built in from vendors' data sheets
or read from this machine (`ferrylm.hw.probe`), and the `--gpu` / `--host` spellings that pick them.

    --gpu  "4xA800-80G-PCIe" | "H200" | "local"        COUNT x NAME (COUNT defaults to 1; "3xlocal": 3 GPUs
                                                       like this machine's first, as read)
    --host "2xXeon-8480C,1TB" | "EPYC-9654" | "local"  SOCKETS x CPU [, MEMORY]

Data-sheet figures are peaks: dense tensor TFLOP/s (no sparsity), HBM GB/s. `pinned_h2d_gbs` is what a
pinned host-to-device copy reaches in practice on that PCIe generation (about 80% of the link), the figure
offloading lives on; `ferry doctor` measures the real one. Knows nothing about models.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

from ferrylm.errors import ConfigError


@dataclass(frozen=True)
class GpuProfile:
    name: str
    memory_gb: float
    """HBM capacity, GB (10^9 bytes), the marketing figure; `memory_gib` (what CUDA reports) wins where set."""
    hbm_gbs: float
    """Peak memory bandwidth, GB/s."""
    tflops: dict
    """Dense tensor-core peak by dtype: bf16, fp16, fp8, int8 (absent: unsupported)."""
    pcie_gen: int
    pcie_width: int = 16
    pinned_h2d_gbs: float = 0.0
    """Effective pinned host->device GB/s (0: derived from the PCIe generation)."""
    nvlink_gbs: float = 0.0
    """GPU-to-GPU NVLink bandwidth per direction (0: peers talk over PCIe)."""
    memory_gib: float | None = None
    """Capacity in GiB as CUDA reports it (A100/A800/H100 80G: 79.2 GiB; see `GPUS`)."""
    source: str = "data sheet"

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30) if self.memory_gib else int(self.memory_gb * 1e9)

    @property
    def fp8(self) -> bool:
        return "fp8" in self.tflops

    @property
    def h2d_gbs(self) -> float:
        return self.pinned_h2d_gbs or PCIE_EFFECTIVE_GBS.get(self.pcie_gen, 12.0) * self.pcie_width / 16


@dataclass(frozen=True)
class HostProfile:
    name: str
    sockets: int
    cores_per_socket: int
    memory_channels_per_socket: int
    channel_gbs: float
    """Per channel peak (DDR4-3200: 25.6, DDR5-4800: 38.4)."""
    memory_gb: float
    avx512: bool = False
    amx: bool = False
    source: str = "data sheet"
    read_gbs: float = 0.0
    """Measured memory read rate of this host, GB/s (all threads; `--measure-bandwidth`); 0: not measured."""

    @property
    def read_rate_gbs(self) -> float:
        """What the host reads at: measured, else an assumed share of one node's data-sheet bandwidth (0 when
        neither is known, e.g. `--host local` unmeasured)."""
        from ferrylm.plan.estimate import HOST_READ_EFF

        return self.read_gbs or HOST_READ_EFF * self.bandwidth_per_node_gbs

    @property
    def numa_nodes(self) -> int:
        return self.sockets

    @property
    def bandwidth_per_node_gbs(self) -> float:
        return self.memory_channels_per_socket * self.channel_gbs

    @property
    def cores(self) -> int:
        return self.sockets * self.cores_per_socket

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)


PCIE_EFFECTIVE_GBS = {3: 12.0, 4: 25.0, 5: 50.0}
"""Pinned H2D a x16 link reaches in practice, by PCIe generation (peaks 15.8 / 31.5 / 63 GB/s)."""

GPUS = {g.name: g for g in [
    GpuProfile("A800-80G-PCIe", 85.9, 1935, {"bf16": 312, "fp16": 312, "int8": 624}, 4, memory_gib=79.2),
    GpuProfile("A800-80G-SXM", 85.9, 2039, {"bf16": 312, "fp16": 312, "int8": 624}, 4, nvlink_gbs=200, memory_gib=79.2),
    GpuProfile("A100-80G-PCIe", 85.9, 1935, {"bf16": 312, "fp16": 312, "int8": 624}, 4, memory_gib=79.2),
    GpuProfile("A100-80G-SXM", 85.9, 2039, {"bf16": 312, "fp16": 312, "int8": 624}, 4, nvlink_gbs=300, memory_gib=79.2),
    GpuProfile("A100-40G", 42.9, 1555, {"bf16": 312, "fp16": 312, "int8": 624}, 4, memory_gib=39.6),
    GpuProfile("H100-80G-SXM", 85.9, 3350, {"bf16": 989, "fp16": 989, "fp8": 1979, "int8": 1979}, 5, nvlink_gbs=450, memory_gib=79.2),
    GpuProfile("H100-80G-PCIe", 85.9, 2000, {"bf16": 756, "fp16": 756, "fp8": 1513, "int8": 1513}, 5, memory_gib=79.2),
    GpuProfile("H800-80G-SXM", 85.9, 3350, {"bf16": 989, "fp16": 989, "fp8": 1979, "int8": 1979}, 5, nvlink_gbs=200, memory_gib=79.2),
    GpuProfile("H200", 150.3, 4800, {"bf16": 989, "fp16": 989, "fp8": 1979, "int8": 1979}, 5, nvlink_gbs=450, memory_gib=140),
    GpuProfile("H20", 103.1, 4000, {"bf16": 148, "fp16": 148, "fp8": 296, "int8": 296}, 5, nvlink_gbs=450, memory_gib=96),
    GpuProfile("L40S", 48.3, 864, {"bf16": 362, "fp16": 362, "fp8": 733, "int8": 733}, 4, memory_gib=45),
    GpuProfile("L20", 48.3, 864, {"bf16": 119.5, "fp16": 119.5, "fp8": 239, "int8": 239}, 4, memory_gib=45),
    GpuProfile("RTX-4090", 25.8, 1008, {"bf16": 165, "fp16": 165, "fp8": 330, "int8": 661}, 4, memory_gib=24),
    GpuProfile("A10", 24.2, 600, {"bf16": 125, "fp16": 125, "int8": 250}, 4, memory_gib=22.5),
    GpuProfile("T4", 15.8, 320, {"fp16": 65, "int8": 130}, 3, memory_gib=15),
]}
"""Capacities are what CUDA reports as the card's total memory (`cudaMemGetInfo`, torch's `total_memory`: what the
engine sizes from), a little under the marketing figure and under nvidia-smi's: an 80 GB A100 / H100 79.2 GiB
(session 24's H100 run: the engine's KV pool was 1.1% (0.71 GB) under the plan's with 80 GiB, what 79.2 accounts for),
an A100 40 GB 39.6 GiB, the H200 ~140 GiB."""

HOSTS = {h.name: h for h in [
    HostProfile("Xeon-8480C", 1, 56, 8, 38.4, 512, avx512=True, amx=True),
    HostProfile("Xeon-8480+", 1, 56, 8, 38.4, 512, avx512=True, amx=True),
    HostProfile("Xeon-8358", 1, 32, 8, 25.6, 256, avx512=True),
    HostProfile("Xeon-6348", 1, 28, 8, 25.6, 256, avx512=True),
    HostProfile("Xeon-6454S", 1, 32, 8, 38.4, 256, avx512=True, amx=True),
    HostProfile("EPYC-9654", 1, 96, 12, 38.4, 768, avx512=True),
    HostProfile("EPYC-7763", 1, 64, 8, 25.6, 512),
    HostProfile("EPYC-7742", 1, 64, 8, 25.6, 512),
]}
"""Per socket; `memory_gb` is a typical fit, overridden by the ",1TB" part of --host."""


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9+]", "", s.lower())


def _count(spec: str) -> tuple[int, str]:
    m = re.match(r"^\s*(-?\d+)\s*[x*]\s*(.+)$", spec, re.I)
    return (int(m[1]), m[2].strip()) if m else (1, spec.strip())


def _find(table: dict, name: str, what: str):
    want = _norm(name)
    hits = [v for k, v in table.items() if _norm(k) == want] or [v for k, v in table.items() if _norm(k).startswith(want)]
    if len(hits) != 1:
        raise ConfigError(f"unknown {what} {name!r}" + (" (ambiguous)" if hits else "")
                          + f"; built in: {', '.join(table)}, or 'local'")
    return hits[0]


def parse_gpu(spec: str) -> tuple[int, GpuProfile]:
    """"4xA800-80G-PCIe" -> (4, profile); "local" reads this machine (NVML): its GPUs, profiled as its first;
    "3xlocal": 3 GPUs like that one (how the advice plans more of this machine's GPUs: NVML's name for them is no
    profile's)."""
    n, name = _count(spec)
    if n < 1:
        raise ConfigError(f"--gpu {spec!r}: the count must be at least 1")
    if not is_local(spec):
        return n, _find(GPUS, name, "GPU")
    from ferrylm.hw.probe import local_gpus

    gpus = local_gpus()
    if not gpus:
        raise ConfigError(f"--gpu {spec}: no NVIDIA GPU found here (NVML); name a profile, e.g. --gpu 1xH200")
    return (n if name != spec.strip() else len(gpus)), gpus[0]  # "3xlocal" counts 3, "local" what is here


def is_local(spec: str) -> bool:
    """Whether --gpu `spec` reads this machine's GPUs ("local", "3xlocal")."""
    return _count(spec)[1].lower() == "local"


def parse_host(spec: str) -> HostProfile:
    """"2xXeon-8480C,1TB" -> a host of 2 sockets with 1 TB; "local" reads /proc and /sys."""
    name, _, mem = spec.partition(",")
    if name.strip().lower() == "local":
        from ferrylm.hw.probe import local_host

        host = local_host()
    else:
        n, cpu = _count(name)
        if n < 1:
            raise ConfigError(f"--host {spec!r}: the socket count must be at least 1")
        base = _find(HOSTS, cpu, "host CPU")
        host = replace(base, name=f"{n}x{base.name}", sockets=n, memory_gb=base.memory_gb * n)
    if mem.strip():
        m = re.match(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(TB|GB|TiB|GiB|T|G)\s*$", mem, re.I)  # a number float() reads
        if not m:
            raise ConfigError(f"--host {spec!r}: memory must look like 512GB or 1TB")
        unit = m[2].upper()
        gb = float(m[1]) * {"TB": 1e3, "T": 1e3, "GB": 1, "G": 1, "TIB": 2**40 / 1e9, "GIB": 2**30 / 1e9}[unit]
        if not gb > 0:
            raise ConfigError(f"--host {spec!r}: the host's memory must be more than 0")
        host = replace(host, memory_gb=gb)
    return host


@functools.lru_cache(maxsize=None)
def measured_h2d_gbs(index: int = 0) -> float:
    """Pinned host-to-device GB/s of this machine's GPU `index`, measured once per process (`hw/bandwidth.py`)."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("--measure-bandwidth needs a CUDA GPU on this machine")
    from ferrylm.hw.bandwidth import gpu_gbs

    return gpu_gbs(index)["pinned_h2d_gbs"]


def with_measured_h2d(gpu: GpuProfile) -> GpuProfile:
    return replace(gpu, pinned_h2d_gbs=measured_h2d_gbs(), source=f"{gpu.source}, pinned H2D measured")


@functools.lru_cache(maxsize=None)
def measured_host_read_gbs() -> float:
    from ferrylm.hw.bandwidth import host_read_gbs

    return host_read_gbs()


def with_measured_read(host: HostProfile) -> HostProfile:
    return replace(host, read_gbs=measured_host_read_gbs(), source=f"{host.source}, read measured")
