"""Read the machine without changing it: CPU, memory, NUMA, kernel settings and limits from /proc and
/sys (under a `root` folder, so tests run on fixture trees), and GPUs through NVML (`nvidia-ml-py`) when
it is installed and a driver answers. Every reader returns plain values or None when a file is absent;
nothing here judges a value (`doctor.py` does).
"""

from __future__ import annotations

import os
import re
import resource
import shutil
from dataclasses import dataclass, field


def read(root: str, path: str) -> str | None:
    """A /proc or /sys file's text (stripped), or None when absent or unreadable."""
    try:
        with open(os.path.join(root, path.lstrip("/")), encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _int(s: str | None) -> int | None:
    try:
        return int(s.split()[0]) if s else None
    except (ValueError, IndexError):
        return None


def _meminfo(text: str | None) -> dict[str, int]:
    """`Key: N kB` lines (also a node's `Node 0 Key: N kB`) -> bytes."""
    out = {}
    for line in (text or "").splitlines():
        m = re.match(r"^(?:Node \d+ )?(\w+(?:\(\w+\))?):\s+(\d+)(?: kB)?$", line.strip())
        if m:
            out[m[1]] = int(m[2]) * (1024 if line.strip().endswith("kB") else 1)
    return out


def _cpulist(s: str | None) -> list[int]:
    cpus: list[int] = []
    for part in (s or "").split(","):
        if "-" in part:
            a, b = part.split("-")
            cpus += range(int(a), int(b) + 1)
        elif part.strip():
            cpus.append(int(part))
    return cpus


@dataclass
class HostReadings:
    cpu_model: str | None = None
    sockets: int | None = None
    logical_cpus: int = 0
    flags: set = field(default_factory=set)
    mem_total: int | None = None
    mem_available: int | None = None
    numa_nodes: dict = field(default_factory=dict)
    """node id -> {"cpus": [...], "mem_total": bytes}"""
    governor: str | None = None
    no_turbo: int | None = None
    """intel_pstate/no_turbo (1 = turbo off), None when absent."""
    boost: int | None = None
    """cpufreq/boost (0 = off), None when absent."""
    thp: str | None = None
    """transparent_hugepage/enabled, the bracketed choice."""
    hugepages_total: int | None = None
    swappiness: int | None = None
    overcommit: int | None = None
    numa_balancing: int | None = None
    max_map_count: int | None = None
    aspm: str | None = None
    """pcie_aspm policy, the bracketed choice."""
    oom_score_adj: int | None = None
    cgroup_memory_max: int | None = None
    """cgroup v2 memory.max in bytes (None: unlimited or not found)."""
    memlock: tuple | None = None
    nofile: tuple | None = None
    locale: str | None = None
    """The character encoding's locale: LC_ALL, else LC_CTYPE, else LANG (the first set and not empty)."""
    locale_var: str | None = None
    """Which of those variables `locale` came from (None: none set)."""


def _bracketed(s: str | None) -> str | None:
    m = re.search(r"\[(\w+)\]", s or "")
    return m[1] if m else (s or None)


def read_host(root: str = "/", env: dict | None = None) -> HostReadings:
    env = os.environ if env is None else env
    h = HostReadings()
    cpuinfo = read(root, "/proc/cpuinfo") or ""
    physical = set()
    for line in cpuinfo.splitlines():
        k, _, v = line.partition(":")
        k, v = k.strip(), v.strip()
        if k == "processor":
            h.logical_cpus += 1
        elif k == "model name" and h.cpu_model is None:
            h.cpu_model = v
        elif k == "physical id":
            physical.add(v)
        elif k == "flags" and not h.flags:
            h.flags = set(v.split())
    h.sockets = len(physical) or None
    mem = _meminfo(read(root, "/proc/meminfo"))
    h.mem_total, h.mem_available = mem.get("MemTotal"), mem.get("MemAvailable")
    h.hugepages_total = mem.get("HugePages_Total")
    node_dir = os.path.join(root, "sys/devices/system/node")
    if os.path.isdir(node_dir):
        for d in sorted(os.listdir(node_dir)):
            if re.fullmatch(r"node\d+", d):
                nm = _meminfo(read(root, f"/sys/devices/system/node/{d}/meminfo"))
                h.numa_nodes[int(d[4:])] = {"cpus": _cpulist(read(root, f"/sys/devices/system/node/{d}/cpulist")),
                                             "mem_total": nm.get("MemTotal")}
    h.governor = read(root, "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
    h.no_turbo = _int(read(root, "/sys/devices/system/cpu/intel_pstate/no_turbo"))
    h.boost = _int(read(root, "/sys/devices/system/cpu/cpufreq/boost"))
    h.thp = _bracketed(read(root, "/sys/kernel/mm/transparent_hugepage/enabled"))
    h.swappiness = _int(read(root, "/proc/sys/vm/swappiness"))
    h.overcommit = _int(read(root, "/proc/sys/vm/overcommit_memory"))
    h.numa_balancing = _int(read(root, "/proc/sys/kernel/numa_balancing"))
    h.max_map_count = _int(read(root, "/proc/sys/vm/max_map_count"))
    h.aspm = _bracketed(read(root, "/sys/module/pcie_aspm/parameters/policy"))
    h.oom_score_adj = _int(read(root, "/proc/self/oom_score_adj"))
    h.cgroup_memory_max = _cgroup_memory_max(root)
    if root == "/":
        h.memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        h.nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    h.locale_var = next((v for v in ("LC_ALL", "LC_CTYPE", "LANG") if env.get(v)), None)
    h.locale = env[h.locale_var] if h.locale_var else None
    return h


def _cgroup_memory_max(root: str) -> int | None:
    cg = read(root, "/proc/self/cgroup") or ""
    for line in cg.splitlines():
        if line.startswith("0::"):
            v = read(root, f"/sys/fs/cgroup{line[3:].rstrip('/')}/memory.max") or read(root, "/sys/fs/cgroup/memory.max")
            return None if v in (None, "max") else _int(v)
    v = read(root, "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # cgroup v1
    n = _int(v)
    return None if n is None or n >= 2**62 else n


def disk_usage(path: str) -> dict | None:
    """Bytes and inodes free on the file system holding `path`: `asked` is the path, `exists` whether it does, and
    `path` the folder measured (the path itself, or its nearest existing parent when it does not exist)."""
    asked = p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return {"path": p, "asked": asked, "exists": p == asked, "bytes_free": shutil.disk_usage(p).free,
            "inodes_free": st.f_favail, "inodes_total": st.f_files}


# -- GPUs through NVML ----------------------------------------------------------------------------------

@dataclass
class GpuReadings:
    index: int
    name: str
    memory_total: int
    driver: str | None = None
    cuda: str | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    persistence: bool | None = None
    ecc: bool | None = None
    ecc_uncorrected: int | None = None
    temperature_c: int | None = None
    sm_clock: int | None = None
    sm_clock_max: int | None = None
    mem_clock: int | None = None
    mem_clock_max: int | None = None
    app_sm_clock: int | None = None
    """The applications clock set for the SM (MHz): what the GPU boosts to under load."""
    app_sm_clock_default: int | None = None
    power_limit_w: float | None = None
    power_limit_default_w: float | None = None
    throttle: list | None = field(default_factory=list)
    """NVML's active clock event ("throttle") reasons, named as `_THROTTLE` names them, idle included; None when
    the driver does not say."""
    numa_node: int | None = None
    bus_id: str | None = None
    p2p: dict = field(default_factory=dict)
    """other GPU index -> the link between them: NVLINK where NVML's P2P status says NVLink, else NVML's topology
    level (INTERNAL, SINGLE, MULTIPLE, HOSTBRIDGE, NODE, SYSTEM; "unknown" when it does not answer)."""
    p2p_read: dict = field(default_factory=dict)
    """other GPU index -> whether NVML says peer-to-peer reads work between them (None: it does not say)."""


def nvml():
    """The pynvml module, initialised, or None (not installed or no driver)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    return pynvml


def read_gpus(root: str = "/") -> list[GpuReadings]:
    nv = nvml()
    if nv is None:
        return []
    out = []

    def q(fn, *a):
        try:
            return fn(*a)
        except Exception:
            return None

    try:
        n = nv.nvmlDeviceGetCount()
        driver = q(nv.nvmlSystemGetDriverVersion)
        cuda = q(nv.nvmlSystemGetCudaDriverVersion)
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        for i, hd in enumerate(handles):
            name = q(nv.nvmlDeviceGetName, hd)
            mem = q(nv.nvmlDeviceGetMemoryInfo, hd)
            pci = q(nv.nvmlDeviceGetPciInfo, hd)
            bus = (pci.busId.decode() if isinstance(pci.busId, bytes) else pci.busId) if pci else None
            ecc = q(nv.nvmlDeviceGetEccMode, hd)
            reasons = q(getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)  # NVML >= 12.2's name
                        or getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None), hd)
            persistence = q(nv.nvmlDeviceGetPersistenceMode, hd)
            power, power_default = q(nv.nvmlDeviceGetPowerManagementLimit, hd), q(
                nv.nvmlDeviceGetPowerManagementDefaultLimit, hd)  # mW
            g = GpuReadings(
                i, name.decode() if isinstance(name, bytes) else str(name), mem.total if mem else 0,
                driver=driver.decode() if isinstance(driver, bytes) else driver,
                cuda=f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None,
                pcie_gen=q(nv.nvmlDeviceGetCurrPcieLinkGeneration, hd),
                pcie_gen_max=q(nv.nvmlDeviceGetMaxPcieLinkGeneration, hd),
                pcie_width=q(nv.nvmlDeviceGetCurrPcieLinkWidth, hd),
                pcie_width_max=q(nv.nvmlDeviceGetMaxPcieLinkWidth, hd),
                persistence=None if persistence is None else persistence == 1,
                ecc=None if ecc is None else bool(ecc[0]),
                ecc_uncorrected=q(nv.nvmlDeviceGetTotalEccErrors, hd, 1, 1),  # uncorrected, volatile
                temperature_c=q(nv.nvmlDeviceGetTemperature, hd, 0),
                sm_clock=q(nv.nvmlDeviceGetClockInfo, hd, 1), sm_clock_max=q(nv.nvmlDeviceGetMaxClockInfo, hd, 1),
                mem_clock=q(nv.nvmlDeviceGetClockInfo, hd, 2), mem_clock_max=q(nv.nvmlDeviceGetMaxClockInfo, hd, 2),
                app_sm_clock=q(nv.nvmlDeviceGetApplicationsClock, hd, 1),
                app_sm_clock_default=q(nv.nvmlDeviceGetDefaultApplicationsClock, hd, 1),
                power_limit_w=power / 1000 if power else None,
                power_limit_default_w=power_default / 1000 if power_default else None,
                throttle=None if reasons is None else _throttle_names(reasons), bus_id=bus)
            if bus:
                g.numa_node = _int(read(root, f"/sys/bus/pci/devices/{bus.lower()[-12:]}/numa_node"))
            out.append(g)
        for i, hi in enumerate(handles):
            for j, hj in enumerate(handles):
                if i != j:
                    lvl = q(nv.nvmlDeviceGetTopologyCommonAncestor, hi, hj)
                    nvlink = q(nv.nvmlDeviceGetP2PStatus, hi, hj, 2)  # NVML_P2P_CAPS_INDEX_NVLINK; 0: STATUS_OK
                    p2p_read = q(nv.nvmlDeviceGetP2PStatus, hi, hj, 0)  # NVML_P2P_CAPS_INDEX_READ
                    out[i].p2p[j] = "NVLINK" if nvlink == 0 else _TOPO.get(lvl, "unknown" if lvl is None else str(lvl))
                    out[i].p2p_read[j] = None if p2p_read is None else p2p_read == 0
    finally:
        q(nv.nvmlShutdown)
    return out


_TOPO = {0: "INTERNAL", 10: "SINGLE", 20: "MULTIPLE", 30: "HOSTBRIDGE", 40: "NODE", 50: "SYSTEM"}
_THROTTLE = {0x1: "idle", 0x2: "applications clocks", 0x4: "power cap", 0x8: "hw slowdown", 0x10: "sync boost",
             0x20: "sw thermal", 0x40: "hw thermal", 0x80: "power brake", 0x100: "display clocks"}
"""NVML's clock event reason bits (nvmlClocksEventReason*, formerly nvmlClocksThrottleReason*)."""


def _throttle_names(mask: int) -> list[str]:
    return [n for bit, n in _THROTTLE.items() if mask & bit]


# -- as planner profiles ---------------------------------------------------------------------------------

def local_gpus():
    """This machine's GPUs as planner `GpuProfile`s: the data-sheet profile whose name matches NVML's
    (bandwidth, TFLOP/s), with the memory CUDA reports (NVML's where no CUDA torch sees the card) and the PCIe
    link NVML reports; where CUDA sees them, only the GPUs this process sees, in CUDA's order."""
    from dataclasses import replace

    from ferrylm.plan.hardware import GpuProfile

    out = []
    gpus = read_gpus()
    cuda = _cuda_totals()  # PCI address -> CUDA's total, in CUDA's order (the visible devices only)
    if cuda and any(_pci(g.bus_id) in cuda for g in gpus):  # the devices this process sees, in CUDA's order
        order = list(cuda)
        gpus = sorted((g for g in gpus if _pci(g.bus_id) in cuda), key=lambda g: order.index(_pci(g.bus_id)))
    for g in gpus:
        base = profile_for(g.name)
        if base is None:
            base = GpuProfile(g.name, 0, 1000, {"bf16": 100, "fp16": 100}, 4, source="guess")
        total = cuda.get(_pci(g.bus_id)) or g.memory_total
        out.append(replace(base, name=g.name, memory_gb=total / 1e9, memory_gib=total / 2**30,
                           pcie_gen=g.pcie_gen_max or base.pcie_gen, pcie_width=g.pcie_width or base.pcie_width,
                           source="NVML + " + base.source))
    return out


def _pci(bus_id: str | None) -> tuple[int, int, int] | None:
    """NVML's "00000000:19:00.0" -> (domain, bus, device)."""
    try:
        dom, bus, dev = bus_id.split(":")
        return int(dom, 16), int(bus, 16), int(dev.split(".")[0], 16)
    except (AttributeError, ValueError):
        return None


def _cuda_totals() -> dict:
    """(domain, bus, device) -> the total memory CUDA reports, for each GPU this process sees (CUDA's order,
    after CUDA_VISIBLE_DEVICES): what the engine sizes from (NVML's total is ~0.5 GiB more on an H100, and
    NVML's indices are not CUDA's). Empty without a CUDA build of torch that sees a GPU."""
    try:
        import torch

        if not torch.cuda.is_available():
            return {}
        out = {}
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out[(p.pci_domain_id, p.pci_bus_id, p.pci_device_id)] = p.total_memory
        return out
    except Exception:  # a broken driver, or a torch without the PCI fields: NVML's figures
        return {}


FAMILY_WORDS = ("rtx",)
"""Profile name parts that name a family, not a chip: the chip is that word and the next ("RTX-4090": rtx4090)."""


def profile_for(nvml_name: str):
    """The data-sheet profile an NVML name is ("NVIDIA H100 PCIe" -> H100-80G-PCIe): the chip must be one of the
    name's words or two adjacent words joined (so A10 is not an A100, H20 not an H200, RTX-4090 not an RTX 3090 or
    RTX 6000), a memory size the name states must be the profile's, then the most other name parts (form factor)
    win; None when no chip matches."""
    from ferrylm.plan.hardware import GPUS

    words = re.findall(r"[a-z0-9]+", nvml_name.lower())
    tokens = set(words) | {a + b for a, b in zip(words, words[1:])}
    said = {m + "g" for m in re.findall(r"(\d+)gb?\b", " ".join(words))}  # "80GB" -> 80g
    key = "".join(words)
    best, score = None, 0
    for name, prof in GPUS.items():
        parts = [re.sub(r"[^a-z0-9]", "", t) for t in name.lower().split("-")]
        chip, rest = (parts[0] + parts[1], parts[2:]) if parts[0] in FAMILY_WORDS and len(parts) > 1 else \
            (parts[0], parts[1:])
        memory = [t for t in rest if re.fullmatch(r"\d+g", t)]
        if chip not in tokens or (said and memory and not said & set(memory)):
            continue
        n = 1 + sum(1 for t in rest if t in key)
        if n > score:
            best, score = prof, n
    return best


def local_host():
    """This machine as a planner `HostProfile` (memory bandwidth unknown until measured: 0)."""
    from ferrylm.plan.hardware import HostProfile

    h = read_host()
    sockets = h.sockets or max(1, len(h.numa_nodes))
    return HostProfile(h.cpu_model or "local", sockets, max(1, h.logical_cpus // sockets), 0, 0.0,
                       (h.mem_total or 0) / 1e9, avx512="avx512f" in h.flags, amx="amx_tile" in h.flags,
                       source="/proc, /sys")
