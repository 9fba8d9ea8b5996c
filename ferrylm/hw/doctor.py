"""`ferry doctor`'s checks: judge readings of the machine (`probe.py`, `bandwidth.py`) for serving.

Each check gives ok / warn / fail / skip, the value found, what is expected, why it matters and the
command that fixes it. Checks are pure functions of readings, so tests judge fixture readings; doctor
changes nothing itself (`--write-fixes` writes the commands into a script for a person to review). A fix says
where it acts (`Check.scope`: the machine until reboot, the shell that starts ferry, or a note for a person) and,
where it does not last by itself, its lasting form (`Check.persist`), so the script says what each line changes.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from ferrylm.hw.probe import GpuReadings, HostReadings

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
MACHINE, SHELL, NOTE = "machine", "shell", "note"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    value: str
    expected: str = ""
    why: str = ""
    fix: str = ""
    """A shell command (or a note starting with '#') that fixes it; empty when nothing to do."""
    scope: str = ""
    """Where `fix` acts. MACHINE: a kernel or device setting, as root, from now until reboot. SHELL: a limit or
    variable of the shell that runs it and of what that shell starts, so it must run in the shell that starts ferry
    (for a service: the unit's setting that `persist` names). NOTE: something for a person to do or to start ferry
    with; never run by the script. Left empty: NOTE for a fix starting with '#', MACHINE for another; "" without
    a fix."""
    persist: str = ""
    """The lasting form of a fix that ends at reboot or with its shell: a command writing an /etc file (as root),
    or a note ('#') saying where the setting goes (a unit, the kernel command line); empty when there is none."""

    def __post_init__(self):
        scope = "" if not self.fix else self.scope or (NOTE if self.fix.startswith("#") else MACHINE)
        object.__setattr__(self, "scope", scope)

    def to_dict(self) -> dict:
        return asdict(self)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _sysctl(key: str, value) -> dict:
    """A sysctl's fix (now, until reboot) and its lasting form (a file systemd-sysctl reads at boot)."""
    return dict(fix=f"sysctl -w {key}={value}", persist=f"echo '{key} = {value}' > /etc/sysctl.d/90-ferrylm-{key}.conf")


def _sysfs(path: str, value: str, name: str, now: str | None = None) -> dict:
    """A /sys setting's fix (now, until reboot) and its lasting form (a line systemd-tmpfiles writes at boot; its
    `w` lines take globs)."""
    return dict(fix=now or f"echo {value} > {path}", persist=f"echo 'w {path} - - - - {value}' > /etc/tmpfiles.d/ferrylm-{name}.conf")


def _unlimited(n) -> bool:
    return n is None or n < 0 or n >= 2**62


def _limit(item: str, flag: str, value: str, hard_ok: bool, hard: str, unit: str) -> dict:
    """An RLIMIT's fix: raise the soft limit of the shell that starts ferry to `value` (in ulimit's and limits.conf's
    unit), which works without root when the hard limit allows it (`hard_ok`; `hard` is the hard limit as said),
    and its lasting form for new logins (PAM's limits.d, the hard line only where the hard limit is too low, so a
    higher one is not lowered; `*` does not cover root) or a service's unit."""
    lines = [f"'* soft {item} {value}'"] + ([] if hard_ok else [f"'* hard {item} {value}'"])
    return dict(fix=f"ulimit -S{flag} {value}" + ("" if hard_ok else f"  # fails until the hard limit ({hard}) is "
                                                    "raised: part 2 and a new login, or the unit's setting"),
                scope=SHELL,
                persist=(f"printf '%s\\n' {' '.join(lines)} > /etc/security/limits.d/90-ferrylm-{item}.conf  "
                         f"# new logins; a systemd service: {unit}"))


# -- host ----------------------------------------------------------------------------------------------

def host_checks(h: HostReadings, need_host_bytes: int = 0) -> list[Check]:
    """`need_host_bytes`: pinned host memory the plan needs (0: not known)."""
    out = []
    nodes = len(h.numa_nodes)
    out.append(Check("numa", OK, f"{nodes or 1} node(s), {h.sockets or '?'} socket(s), {h.logical_cpus} CPUs",
                     "", "a process on one node reading another node's memory gets about half the bandwidth",
                     "# run the server under numactl --cpunodebind=N --membind=N with N the GPU's node" if nodes > 1
                     else ""))
    if h.governor is None:
        out.append(Check("cpu_governor", SKIP, "no cpufreq", "performance", "a power-saving governor slows CPU experts "
                         "and the Python step loop"))
    else:
        good = h.governor == "performance"
        fix = _sysfs("/sys/devices/system/cpu/cpu*/cpufreq/scaling_governor", "performance", "governor",
                     now="cpupower frequency-set -g performance")
        out.append(Check("cpu_governor", OK if good else WARN, h.governor, "performance",
                         "a power-saving governor slows CPU experts and the Python step loop", **({} if good else fix)))
    if h.no_turbo is not None or h.boost is not None:
        off = h.no_turbo == 1 or h.boost == 0
        fix = (_sysfs("/sys/devices/system/cpu/intel_pstate/no_turbo", "0", "turbo") if h.no_turbo == 1
               else _sysfs("/sys/devices/system/cpu/cpufreq/boost", "1", "turbo"))
        out.append(Check("cpu_turbo", WARN if off else OK, "off" if off else "on", "on",
                         "turbo off caps single-thread speed: the step loop and CPU experts run slower",
                         **(fix if off else {})))
    else:
        out.append(Check("cpu_turbo", SKIP, "not exposed", "on"))
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in h.flags]
    status = FAIL if "avx2" not in h.flags else OK if "avx512f" in h.flags else WARN
    out.append(Check("cpu_isa", status, ", ".join(isa) or "none of avx2/avx512", "avx512f (+ avx512_bf16, amx_tile)",
                     "CPU experts run on vector units: without AVX-512 they are about half as fast, without AVX2 unusable",
                     "" if status == OK else "# no fix: use GPU experts or a newer CPU"))
    thp_ok = h.thp in (None, "madvise", "never")
    out.append(Check("transparent_hugepages", OK if thp_ok else WARN, h.thp or "unknown", "madvise",
                     "'always' lets khugepaged compact memory under a running server: latency spikes",
                     **({} if thp_ok else _sysfs("/sys/kernel/mm/transparent_hugepage/enabled", "madvise", "thp"))))
    out.append(Check("hugepages", OK, str(h.hugepages_total or 0), "", "reserved huge pages are memory the server "
                     "cannot use for weights or pinned staging unless it asks for them", ""))
    if h.swappiness is not None:
        good = h.swappiness <= 10
        out.append(Check("swappiness", OK if good else WARN, str(h.swappiness), "<= 10",
                         "swapping out a memory-mapped store or host-resident weights stalls decode for seconds",
                         **({} if good else _sysctl("vm.swappiness", 1))))
    if h.overcommit is not None:
        good = h.overcommit != 2
        out.append(Check("overcommit", OK if good else WARN, str(h.overcommit), "0 or 1",
                         "strict overcommit (2) refuses the large reservations of pinned pools and mapped stores",
                         **({} if good else _sysctl("vm.overcommit_memory", 0))))
    if h.numa_balancing is not None:
        bad = h.numa_balancing == 1 and nodes > 1
        out.append(Check("numa_balancing", WARN if bad else OK, str(h.numa_balancing), "0 on multi-node hosts",
                         "automatic NUMA balancing migrates hot pages (host-resident weights) while they are read",
                         **(_sysctl("kernel.numa_balancing", 0) if bad else {})))
    if h.memlock is not None:
        soft, hard = h.memlock
        unlimited = _unlimited(soft)
        short = not unlimited and need_host_bytes > soft
        # up to a hard limit that covers the plan (ulimit -l counts KiB), else unlimited (which needs it raised)
        fix = (_limit("memlock", "l", "unlimited", True, "", "LimitMEMLOCK=infinity") if _unlimited(hard) else
               _limit("memlock", "l", str(hard // 1024), True, "", f"LimitMEMLOCK={hard}") if hard >= need_host_bytes
               else _limit("memlock", "l", "unlimited", False, _gib(hard), "LimitMEMLOCK=infinity"))
        out.append(Check("memlock_limit", WARN if short else OK, "unlimited" if unlimited else _gib(soft),
                         f">= {_gib(need_host_bytes)}" if need_host_bytes else "what the plan pins (--plan-host-gb)",
                         "pinning host memory with mlock/cudaHostRegister (and RDMA) is capped by RLIMIT_MEMLOCK",
                         **(fix if short else {})))
    if h.nofile is not None:
        good = h.nofile[0] >= 65536
        out.append(Check("open_files_limit", OK if good else WARN, str(h.nofile[0]), ">= 65536",
                         "each client connection and each store shard takes a file descriptor",
                         **({} if good else _limit("nofile", "n", "65536", _unlimited(h.nofile[1]) or h.nofile[1] >= 65536,
                                                   str(h.nofile[1]), "LimitNOFILE=65536"))))
    if h.max_map_count is not None:
        good = h.max_map_count >= 262144
        out.append(Check("max_map_count", OK if good else WARN, str(h.max_map_count), ">= 262144",
                         "memory-mapped weights need one mapping per region; at the limit mmap fails",
                         **({} if good else _sysctl("vm.max_map_count", 1048576))))
    if h.aspm is not None:
        bad = h.aspm in ("powersave", "powersupersave")
        out.append(Check("pcie_aspm", WARN if bad else OK, h.aspm, "default or performance",
                         "ASPM power states add latency to every small PCIe transfer (expert copies)",
                         **(_sysfs("/sys/module/pcie_aspm/parameters/policy", "performance", "aspm") if bad else {})))
    if h.oom_score_adj is not None:
        bad = h.oom_score_adj > 0
        out.append(Check("oom_score", WARN if bad else OK, str(h.oom_score_adj), "<= 0",
                         "a positive score makes the server the first process the OOM killer picks",
                         **(dict(fix="echo -500 > /proc/$$/oom_score_adj  # lowering it needs root (CAP_SYS_RESOURCE)",
                                 scope=SHELL, persist="# a systemd service: OOMScoreAdjust=-500 in its unit")
                            if bad else {})))
    limit = h.cgroup_memory_max
    if limit is None:
        out.append(Check("cgroup_memory", OK, "unlimited", f">= {_gib(need_host_bytes)}" if need_host_bytes else ""))
    else:
        short = need_host_bytes and limit < need_host_bytes
        out.append(Check("cgroup_memory", FAIL if short else OK, _gib(limit),
                         f">= {_gib(need_host_bytes)}" if need_host_bytes else "",
                         "the container's memory limit kills the server when pinned weights exceed it",
                         "# raise the container's memory limit (docker --memory, k8s resources.limits)" if short else ""))
    if h.mem_available is not None and need_host_bytes:
        short = h.mem_available < need_host_bytes
        out.append(Check("host_memory", FAIL if short else OK, f"{_gib(h.mem_available)} available",
                         f">= {_gib(need_host_bytes)}", "host-resident weights must fit in free host memory",
                         "# free memory, add RAM, or quantize (ferry convert --quant)" if short else ""))
    enc = (h.locale or "").lower()
    utf8 = "utf-8" in enc or "utf8" in enc
    var = h.locale_var or "LANG"  # the variable that decides: LC_ALL over LC_CTYPE over LANG
    out.append(Check("locale", OK if utf8 else WARN, f"{var}={h.locale}" if h.locale else "unset (C)", "a UTF-8 locale",
                     "a non-UTF-8 locale garbles CJK text in logs and terminal output (Yuan, Qwen)",
                     **({} if utf8 else dict(fix=f"export {var}=C.UTF-8", scope=SHELL,
                                             persist=f"# a systemd service: Environment={var}=C.UTF-8; a login: "
                                                     "~/.profile"))))
    return out


def disk_checks(paths: dict[str, dict | None], need_bytes: int = 0) -> list[Check]:
    """`paths`: label -> `probe.disk_usage()` result. A path that does not exist warns, and its nearest existing
    parent's file system is judged in its place (said so)."""
    out = []
    for label, d in paths.items():
        if d is None:
            out.append(Check(f"disk_{label}", SKIP, "cannot stat"))
            continue
        low_inodes = d["inodes_total"] and d["inodes_free"] < max(10000, d["inodes_total"] // 20)
        full = low_inodes or d["bytes_free"] < need_bytes
        status = FAIL if full else WARN if d["bytes_free"] < 10 * 2**30 else OK
        free = f"{_gib(d['bytes_free'])} and {d['inodes_free']:,} inodes free on {d['path']}"
        fix = "" if status == OK else f"# free space on {d['path']} (df -h; df -i)"
        why = "a full disk or exhausted inodes fails conversion, logging and checkpoints in odd ways"
        if not d.get("exists", True):
            why = "a path that does not exist is a typo or not made yet: nothing there to load or log into; " + why
            status = FAIL if full else WARN
            free = f"{d['asked']} does not exist; {free}, its nearest existing parent"
            fix = f"# {d['asked']} does not exist: check the path" + (f"; {fix[2:]}" if fix else "")
        out.append(Check(f"disk_{label}", status, free,
                         f"an existing path, >= {_gib(max(need_bytes, 10 * 2**30))} and >= 5% inodes free", why, fix))
    return out


def host_kernels_check(why_unavailable: str | None, nf4_bf16: bool = False, amx: bool = False,
                       cpu_has_amx: bool = False) -> Check:
    """`why_unavailable`: `layers/host_native.why_unavailable()` (None: the native host kernels built); `nf4_bf16`:
    `host_native.nf4_bf16()` (the AVX512-BF16 NF4 kernel runs here); `amx`: `host_native.amx()` (bf16 experts at 2-64
    tokens on AMX tiles); `cpu_has_amx`: the CPU's flags name amx_tile and amx_bf16."""
    if why_unavailable is None:
        value = ("native AVX-512 GEMV built" + (", NF4 and fp8 on AVX512-BF16" if nf4_bf16 else "")
                 + (", bf16 at 2-64 tokens and fp8 on AMX" if amx else ""))
        why = ("hybrid decode's host experts read bf16 / NF4 / fp8 weights at DRAM speed"
               + ("" if nf4_bf16 else " (NF4 on the fp32 kernel and fp8 on torch's decode: this CPU or compiler "
                                      "lacks AVX512-BF16)"))
        if cpu_has_amx and not amx:
            return Check("host_kernels", WARN, value, "built, with AMX",
                         why + "; this CPU has AMX but the kernels do not use it (they need the AVX512-BF16 build, a C "
                         "compiler that takes -mamx-bf16, and an OS that grants the tile registers: Linux >= 5.16, "
                         "no seccomp filter on arch_prctl): batched host experts (2-64 tokens) run ~2x slower",
                         "# gcc >= 11 and Linux >= 5.16; then rm -r ~/.cache/ferrylm/kernels")
        return Check("host_kernels", OK, value, "built", why)
    if "AVX-512" in why_unavailable or "FERRYLM_NO_NATIVE" in why_unavailable:
        fix = "" if "AVX-512" in why_unavailable else "unset FERRYLM_NO_NATIVE"
        return Check("host_kernels", WARN, why_unavailable, "built",
                     "host experts fall back to torch's paths (bf16 ~0.6x, NF4 ~0.05x the native rate): "
                     "hybrid decode gains less or turns off", fix, scope=SHELL)
    return Check("host_kernels", WARN, why_unavailable, "built",
                 "the native host kernels are compiled at first use with the system's C compiler; without them "
                 "host experts fall back to torch's paths (NF4 hybrid decode stays off)",
                 "# install a C compiler (e.g. apt install gcc) or set CC")


def log_level_check(env_value: str | None) -> Check:
    """`env_value`: $FERRY_LOG_LEVEL as the shell that starts ferry has it (None: unset); judged by the functions
    `ferry` sets its logging from (`ferrylm.cli.parse_log_level`, `log_level`), without -v (a flag of each run, not
    of the machine)."""
    import logging

    from ferrylm.cli import LOG_LEVEL_ENV, log_level, parse_log_level

    where = f"{LOG_LEVEL_ENV}={env_value}" if env_value else f"{LOG_LEVEL_ENV} unset"
    why = ("DEBUG lets every library log at the root (asyncio, httpx, torch's compiler): lines per step and "
           "request cost tokens/s")
    fix = f"unset {LOG_LEVEL_ENV}  # and drop it from the service's environment or the login's profile"
    if parse_log_level(env_value) is None:
        return Check("log_level", WARN, f"{where}: not a level", "INFO or quieter",
                     "every ferry command warns at start-up and logs at WARNING: the value is not doing what it was "
                     "set for", fix, scope=SHELL)
    level = log_level(False, {} if env_value is None else {LOG_LEVEL_ENV: env_value})
    bad = level < logging.INFO
    return Check("log_level", WARN if bad else OK, f"{logging.getLevelName(level)} ({where})",
                 "INFO or quieter", why, fix if bad else "", scope=SHELL)


# -- GPUs ----------------------------------------------------------------------------------------------

def gpu_checks(gpus: list[GpuReadings], nvml_present: bool) -> list[Check]:
    if not gpus:
        why = "no NVIDIA driver answered NVML" if nvml_present else "nvidia-ml-py is not installed or no driver"
        return [Check("gpu", SKIP, "no GPU found", "", why, "" if nvml_present else "pip install nvidia-ml-py")]
    out = []
    for g in gpus:
        p = f"gpu{g.index}"
        out.append(Check(f"{p}_model", OK, f"{g.name}, {_gib(g.memory_total)}, driver {g.driver}, CUDA {g.cuda}"))
        if g.pcie_gen and g.pcie_gen_max and g.pcie_width and g.pcie_width_max:
            down = g.pcie_width < g.pcie_width_max or g.pcie_gen < g.pcie_gen_max
            out.append(Check(f"{p}_pcie_link", WARN if down else OK, f"gen {g.pcie_gen} x{g.pcie_width}",
                             f"gen {g.pcie_gen_max} x{g.pcie_width_max}",
                             "a downtrained link cuts host-to-GPU bandwidth (offloaded weights); idle GPUs drop the "
                             "generation to save power, so re-check under load (ferry doctor --measure)",
                             "# reseat the card or check the slot's lanes in the BIOS if it stays low under load"
                             if down else ""))
        if g.persistence is not None:
            out.append(Check(f"{p}_persistence", OK if g.persistence else WARN, "on" if g.persistence else "off", "on",
                             "without persistence mode the driver re-initialises the GPU for each process (seconds)",
                             **({} if g.persistence else dict(
                                 fix=f"nvidia-smi -i {g.index} -pm 1",
                                 persist="systemctl enable nvidia-persistenced  # the driver's daemon keeps it on "
                                         "from boot (where the driver package ships it)"))))
        if g.ecc is not None:
            errs = g.ecc_uncorrected or 0
            out.append(Check(f"{p}_ecc", FAIL if errs else OK, f"{'on' if g.ecc else 'off'}, {errs} uncorrected",
                             "0 uncorrected", "uncorrected ECC errors corrupt results silently or crash kernels",
                             f"# drain GPU {g.index}, then reset it (nvidia-smi -i {g.index} -r); replace it if they "
                             "recur" if errs else ""))
        if g.temperature_c is not None:
            hot = g.temperature_c >= 85
            out.append(Check(f"{p}_temperature", WARN if hot else OK, f"{g.temperature_c} C", "< 85 C",
                             "hot GPUs throttle clocks", "# check airflow and fan settings" if hot else ""))
        out += clock_checks(g)
        node = ("unknown" if g.numa_node is None else f"node {g.numa_node}" if g.numa_node >= 0
                else "no NUMA affinity reported (-1: one node, or firmware that does not say)")
        out.append(Check(f"{p}_numa", OK, node, "", "pin the server's CPU threads and host memory to this node"))
    if len(gpus) > 1:
        out += topology_checks(gpus)
    return out


# -- between GPUs: links and tensor-parallel groups ---------------------------------------------------

LINKS = ("NVLINK", "INTERNAL", "SINGLE", "MULTIPLE", "HOSTBRIDGE", "NODE", "SYSTEM")
"""The links between two GPUs, closest first: NVLink, then NVML's topology levels (one board, one PCIe switch,
several switches, one host bridge, one NUMA node, across the CPU sockets' interconnect)."""
CROSS_SOCKET = LINKS.index("SYSTEM")


def link_rank(gpus: list[GpuReadings], a: int, b: int) -> int:
    """How far apart GPUs `a` and `b` are: the position of their link in LINKS (len(LINKS) when unknown); without
    P2P, at least NODE's (NCCL then copies through host memory)."""
    g = next(g for g in gpus if g.index == a)
    lvl = g.p2p.get(b)
    rank = LINKS.index(lvl) if lvl in LINKS else len(LINKS)
    return max(rank, LINKS.index("NODE")) if g.p2p_read.get(b) is False else rank


def _link_name(rank: int) -> str:
    return LINKS[rank] if rank < len(LINKS) else "unknown"


def tp_groups(gpus: list[GpuReadings], size: int) -> tuple[list[list[int]], int] | None:
    """The GPUs in groups of `size` for tensor parallelism, and the rank of the farthest link inside any group (-1
    for groups of one); None when there are fewer GPUs. The farthest link is as close as any grouping allows
    (each link rank is tried, closest first, until the GPUs split into n // size groups using no farther link);
    among those groupings, the one whose groups' own farthest links add up least (so most groups sit on close
    links), searched exhaustively up to `_SEARCH_VISITS` steps. GPUs left over when `size` does not divide their
    number are in no group."""
    idx = sorted(g.index for g in gpus)
    n = len(idx)
    if not 1 <= size <= n:
        return None
    rank = {(a, b): link_rank(gpus, a, b) for a in idx for b in idx if a != b}
    for t in sorted(set(rank.values())) or [0]:
        if sum(len(c) // size for c in _clusters(idx, rank, t)) < n // size:
            continue  # too few GPUs joined by links this close: no grouping (and no search through them)
        groups = _closest_groups(idx, size, rank, t)
        if groups is not None:
            return groups, max(_farthest(g, rank) for g in groups)
    return None  # not reached: at the farthest rank any grouping will do


_SEARCH_VISITS = 20000
"""Steps `_closest_groups` takes past its first grouping in search of a closer one (8 GPUs need a few hundred)."""


def _clusters(idx: list[int], rank: dict, t: int) -> list[list[int]]:
    """The GPUs joined by links of rank <= t (connected components)."""
    seen, out = set(), []
    for i in idx:
        if i not in seen:
            todo, c = [i], []
            seen.add(i)
            while todo:
                a = todo.pop()
                c.append(a)
                for b in idx:
                    if b not in seen and rank[a, b] <= t:
                        seen.add(b)
                        todo.append(b)
            out.append(c)
    return out


def _farthest(group, rank) -> int:
    return max((rank[a, b] for a, b in itertools.combinations(group, 2)), default=-1)


def _closest_groups(idx: list[int], size: int, rank: dict, t: int) -> list[list[int]] | None:
    """`len(idx) // size` groups of `size` GPUs whose links are all of rank <= t, with the least sum of each group's
    farthest link (branch and bound; each GPU's closest partners tried first); None when there are none."""
    need, best, visits = len(idx) // size, [None, None], [0]

    def search(free: list[int], groups: list, cost: int, spares: int) -> None:
        if best[0] is not None and (cost >= best[0] or visits[0] > _SEARCH_VISITS):
            return
        if len(groups) == need:
            best[:] = [cost, groups]
            return
        visits[0] += 1
        first, rest = free[0], free[1:]
        near = sorted((j for j in rest if rank[first, j] <= t), key=lambda j: (rank[first, j], j))
        for others in itertools.combinations(near, size - 1):
            far = _farthest((first, *others), rank)
            if far <= t:
                search([j for j in rest if j not in others], groups + [sorted((first, *others))], cost + far, spares)
        if spares:  # or leave `first` out of every group
            search(rest, groups, cost, spares - 1)

    search(idx, [], 0, len(idx) - need * size)
    return best[1]


def topology_checks(gpus: list[GpuReadings]) -> list[Check]:
    """The links between the GPUs, and the tensor-parallel groups they make (each power-of-two size)."""
    idx = sorted(g.index for g in gpus)
    pairs: dict[str, list[str]] = {}
    for a in idx:
        for b in idx:
            if a < b:
                g = next(g for g in gpus if g.index == a)
                name = g.p2p.get(b) or "unknown"
                pairs.setdefault(name + (", no P2P" if g.p2p_read.get(b) is False else ""), []).append(f"{a}-{b}")
    order = {name: (LINKS.index(name.split(",")[0]) if name.split(",")[0] in LINKS else len(LINKS), name)
             for name in pairs}
    value = "; ".join(f"{name}: " + (", ".join(p) if len(p) <= 4 else f"{len(p)} pairs")
                      for name, p in sorted(pairs.items(), key=lambda kv: order[kv[0]]))
    blocked = [p for name, ps in pairs.items() if name.endswith("no P2P") and order[name][0] < CROSS_SOCKET
               for p in ps]
    out = [Check("gpu_topology", WARN if blocked else OK, value, "P2P between GPUs on one socket",
                 "tensor-parallel all-reduces run every layer over these links; without P2P they go through host "
                 "memory" + (f" (no P2P between {', '.join(blocked)} on one socket)" if blocked else ""),
                 "# P2P off on one socket: check ACS in the BIOS (or a VM's PCIe passthrough) and "
                 "`nvidia-smi topo -p2p r`" if blocked else "")]
    if all(name == "unknown" for name in pairs):
        out.append(Check("gpu_tp_groups", SKIP, "NVML did not report the topology", "TP groups on one socket, with P2P"))
        return out
    lines, fits = [], 1
    size = 2
    while size <= len(idx):
        groups, worst = tp_groups(gpus, size)
        spare = sorted(set(idx) - {i for g in groups for i in g})
        lines.append(f"TP {size}: " + " ".join("[" + ",".join(map(str, g)) + "]" for g in groups)
                     + f" over {_link_name(worst)}" + (f" (GPU {','.join(map(str, spare))} spare)" if spare else ""))
        if worst < CROSS_SOCKET:
            fits = size
        size *= 2
    if fits == 1:
        status, why = WARN, ("no two GPUs share a socket with P2P: every tensor-parallel all-reduce crosses the "
                             "socket link or host memory; pipeline stages (one transfer per step) cross it cheaper")
        fix = (f"# split the model by layers across them: --pipeline-parallel-size {len(idx)} "
               "(--tensor-parallel-size 1), or one server per GPU")
    else:
        status = OK
        why = (f"TP up to {fits} keeps each group on one socket"
               + (f"; beyond it, pipeline stages cross the sockets cheaper (TP {fits} x PP {len(idx) // fits})"
                  if fits < len(idx) else "")
               + f". One TP {fits} group: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES="
               f"{','.join(map(str, tp_groups(gpus, fits)[0][0]))} "
               "(NVML's indices are PCI order; CUDA's default order may differ); all GPUs: --tp-groups auto (the "
               "default: groups by NUMA node and PCIe switch)")
        fix = ""
    out.append(Check("gpu_tp_groups", status, "; ".join(lines), "TP groups on one socket, with P2P", why, fix))
    return out


HW_SLOWDOWN = ("hw slowdown", "hw thermal", "power brake")
"""Clock event reasons where the GPU's own protection cuts the clocks (by half or more): a fault, not a setting."""


def clock_checks(g: GpuReadings) -> list[Check]:
    """The clocks and why they are where they are (NVML's clock event reasons), then the two settings that lower
    them: a power limit below the default and applications clocks below the default."""
    p = f"gpu{g.index}"
    parts = [f"{n} {now} of {top} MHz" for n, now, top in (("SM", g.sm_clock, g.sm_clock_max),
                                                         ("memory", g.mem_clock, g.mem_clock_max))
             if now is not None and top]
    reasons = g.throttle
    parts.append("reasons: " + ("not reported" if reasons is None else ", ".join(reasons) or "none"))
    hw = [r for r in reasons or () if r in HW_SLOWDOWN]
    expected = "no hardware or thermal slowdown"
    power_low = bool(g.power_limit_w and g.power_limit_default_w
                     and g.power_limit_w < 0.98 * g.power_limit_default_w)  # the driver rounds: a watt or two is it
    if hw:
        out = [Check(f"{p}_clocks", FAIL, "; ".join(parts), expected,
                     "the GPU's own protection cuts its clocks by half or more (overheating, or a power supply or "
                     "board that signals it cannot deliver): it runs at a fraction of the rate the plan assumes",
                     f"# check GPU {g.index}'s cooling and power feed: nvidia-smi -i {g.index} -q -d "
                     "PERFORMANCE,TEMPERATURE,POWER and the BMC's event log")]
    elif "sw thermal" in (reasons or ()):
        out = [Check(f"{p}_clocks", WARN, "; ".join(parts), expected,
                     "the driver lowers the clocks to keep the GPU under its temperature limit",
                     "# check airflow, fans and the inlet temperature")]
    else:
        notes = {"idle": "idle: clocks drop at rest, so read them again under load (while ferry serves)",
                 "power cap": (f"power cap at a lowered limit (see {p}_power_limit)" if power_low
                               else "power cap at the default limit: normal under full load"),
                 "applications clocks": "held at the applications clocks (see the applications-clock check)"}
        why = "; ".join(notes[r] for r in reasons or () if r in notes)
        out = [Check(f"{p}_clocks", OK, "; ".join(parts), expected,
                     why or "the plan assumes the data sheet's clocks; slowdown reasons say when a GPU runs below them")]
    if g.power_limit_w and g.power_limit_default_w:
        out.append(Check(f"{p}_power_limit", WARN if power_low else OK,
                         f"{g.power_limit_w:.0f} W", f"the default {g.power_limit_default_w:.0f} W",
                         "a power limit below the default caps the clocks under load (reason 'power cap'): decode "
                         "and prefill run below the rate the plan assumes",
                         **(dict(fix=f"nvidia-smi -i {g.index} -pl {g.power_limit_default_w:.0f}",
                                 persist="# nvidia-smi -pl lasts until reboot or a driver reload: run it from a "
                                         "boot unit (after nvidia-persistenced), or remove whatever lowers it")
                            if power_low else {})))
    if g.app_sm_clock and g.app_sm_clock_default:
        low = g.app_sm_clock < g.app_sm_clock_default
        out.append(Check(f"{p}_app_clocks", WARN if low else OK, f"SM {g.app_sm_clock} MHz",
                         f"the default {g.app_sm_clock_default} MHz",
                         "applications clocks set below the default hold the GPU below its boost under load",
                         f"nvidia-smi -i {g.index} -rac" if low else ""))
    return out


# -- measured ------------------------------------------------------------------------------------------

NODE_SLOW = 0.8
"""A NUMA node whose rate is below this share of the best node's is worth binding away from."""


def bandwidth_checks(m: dict, gpu: bool) -> list[Check]:
    """`m`: `bandwidth.measure()` results (GB/s); thresholds are what serving assumes (plan.hardware)."""
    threads = f" ({m['host_read_threads']} threads)" if "host_read_threads" in m else ""
    out = [Check("host_memory_read", OK, f"{m['host_read_gbs']:.1f} GB/s{threads}", "",
                 "CPU experts and host-to-GPU copies are bounded by it")]
    out += _node_checks(m, gpu)
    if not gpu:
        out.append(Check("h2d_bandwidth", SKIP, "no CUDA device", "", "pinned host-to-GPU copies feed offloaded weights"))
        return out
    from ferrylm.plan.hardware import PCIE_EFFECTIVE_GBS

    for i, r in m.get("gpus", {}).items():
        want = PCIE_EFFECTIVE_GBS.get(r.get("pcie_gen") or 4, 25.0) * 0.8
        low = r["pinned_h2d_gbs"] < want
        pageable_d2h = f", pageable {r['pageable_d2h_gbs']:.1f}" if "pageable_d2h_gbs" in r else ""
        out.append(Check(f"gpu{i}_h2d", WARN if low else OK,
                         f"pinned {r['pinned_h2d_gbs']:.1f}, pageable {r['pageable_h2d_gbs']:.1f}, "
                         f"D2H pinned {r['pinned_d2h_gbs']:.1f}{pageable_d2h} GB/s", f"pinned >= {want:.0f} GB/s",
                         "offloaded weights cross this link every decode step",
                         "# check the PCIe link (lspci -vv) and run from the GPU's NUMA node" if low else ""))
        out.append(Check(f"gpu{i}_hbm_copy", OK, f"{r['hbm_copy_gbs']:.0f} GB/s", ""))
        if "pinned_ok_gb" in r:
            ok = r["pinned_ok_gb"] >= r["pinned_want_gb"]
            out.append(Check(f"gpu{i}_pinning", OK if ok else FAIL, f"{r['pinned_ok_gb']:.0f} GB pinned",
                             f"{r['pinned_want_gb']:.0f} GB", "the plan keeps that much host memory pinned",
                             "" if ok else "# raise memlock / cgroup limits or lower the host-resident weights"))
    return out


def _node_checks(m: dict, gpu: bool) -> list[Check]:
    """Per NUMA node: memory read, and each GPU's pinned H2D from that node's memory; a node well below the
    best is a warn whose fix binds the server to the best one (the GPU's own node, when it is the best)."""
    nodes = m.get("nodes")
    if not nodes:
        return [Check("numa_bandwidth", SKIP, m.get("per_node", "not measured per node"), "",
                      "on a multi-socket host, memory and PCIe rates depend on the node the server runs on")]
    out = []
    best = max(nodes, key=lambda n: nodes[n]["host_read_gbs"])
    for n, r in sorted(nodes.items()):
        slow = r["host_read_gbs"] < NODE_SLOW * nodes[best]["host_read_gbs"]
        out.append(Check(f"node{n}_memory_read", WARN if slow else OK, f"{r['host_read_gbs']:.1f} GB/s (one thread on {r['cpus']} CPUs)",
                         f">= {NODE_SLOW:.0%} of node {best}'s {nodes[best]['host_read_gbs']:.1f}",
                         "host experts and copies read the memory of the node the server's threads run on",
                         f"numactl --cpunodebind={best} --membind={best} ferry serve ..." if slow else "", scope=NOTE))
    for i, g in (m.get("gpus") or {}).items() if gpu else ():
        rates = {n: r["gpus"][i]["pinned_h2d_gbs"] for n, r in nodes.items() if i in r.get("gpus", {})}
        if not rates:
            continue
        top = max(rates, key=rates.get)
        home = g.get("numa_node")
        target = home if home in rates and rates[home] >= NODE_SLOW * rates[top] else top
        slow = sorted(n for n, v in rates.items() if v < NODE_SLOW * rates[top])
        out.append(Check(f"gpu{i}_h2d_by_node", WARN if slow else OK,
                         ", ".join(f"node {n} {v:.1f}" for n, v in sorted(rates.items())) + " GB/s pinned",
                         f"every node >= {NODE_SLOW:.0%} of the best" + (f" (GPU {i} hangs off node {home})"
                                                                          if home is not None else ""),
                         "offloaded weights cross from the memory of the node they were pinned on",
                         f"numactl --cpunodebind={target} --membind={target} ferry serve ..." if slow else "",
                         scope=NOTE))
    return out


def summary(checks: list[Check]) -> dict:
    return {s: sum(1 for c in checks if c.status == s) for s in (OK, WARN, FAIL, SKIP)}


FIXES_HEADER = """\
#!/bin/sh
# Written by `ferry doctor --write-fixes`; doctor changed nothing. Review every line before running any.
# Where a fix acts decides how to run it:
#   sudo sh FILE            part 1: kernel and device settings, from now until reboot
#   sudo sh FILE --persist  part 1, and part 2: those settings and the limits of part 3 written to /etc, to last
#                           across reboots (a file for the same setting that sorts later overrides them)
#   . FILE                  part 3, in the shell that starts ferry: limits and environment last only in the shell
#                           that sets them and what it starts (`sh FILE` sets them in a shell that ends with the
#                           script); for a service, put the unit settings named beside them in its unit
# Notes at the end are for a person: nothing here runs them.
"""


def fixes_script(checks: list[Check]) -> str:
    """The fixes of every warn and fail check as a POSIX shell script for a person to review, in parts by where a
    fix acts (FIXES_HEADER says how to run each). Parts 1 and 2 run only as root, part 2 only with --persist."""
    todo = [c for c in checks if c.status in (WARN, FAIL) and c.fix]

    def block(c: Check, *lines: str) -> list[str]:
        return [f"# {c.name}: {c.value} (expected {c.expected})", *(ln for ln in lines if ln), ""]

    def note(text: str) -> str:
        return text if text.startswith("#") else f"# {text}"

    machine = [ln for c in todo if c.scope == MACHINE
               for ln in block(c, c.fix, c.persist if c.persist.startswith("#") else "")]
    lasting = [ln for c in todo if c.persist and not c.persist.startswith("#") for ln in block(c, c.persist)]
    shell = [ln for c in todo if c.scope == SHELL for ln in block(c, c.fix, c.persist if c.persist.startswith("#")
                                                                   else "# to last: part 2, then a new login" if c.persist else "")]
    notes = [ln for c in todo if c.scope == NOTE for ln in block(c, note(c.fix), note(c.why))]
    out = [FIXES_HEADER]
    if machine or lasting:
        out += ['if [ "$(id -u)" -ne 0 ]; then',
                '    echo "ferry doctor fixes: not root: parts 1 and 2 (this machine\'s settings) skipped" >&2',
                "else", "", "# -- part 1: this machine, from now until reboot (as root) --", ""]
        out += machine or ["# (nothing)", ""]
        if lasting:
            out += ['if [ "${1-}" = --persist ]; then', "",
                    "# -- part 2: the same at every boot: files systemd-sysctl (/etc/sysctl.d), systemd-tmpfiles",
                    "# (/etc/tmpfiles.d) and PAM at login (/etc/security/limits.d) read --", "", *lasting, "fi"]
        out += ["fi", ""]
    if shell:
        out += ["# -- part 3: the shell that starts ferry (source this file there: . FILE) --", "", *shell]
    if notes:
        out += ["# -- notes: for a person to do; nothing runs them --", "", *notes]
    if not (machine or lasting or shell or notes):
        out += ["# nothing to fix", ""]
    return "\n".join(out)
