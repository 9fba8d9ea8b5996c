"""`ferry doctor`: the probe on fixture /proc and /sys trees, each check's judgement on fake readings
(host, disk, NVML, measured bandwidth), the JSON schema, the fixes script, and a real run on this machine
(no GPU here: the GPU checks say skip)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from ferrylm.hw import doctor, probe
from ferrylm.hw.probe import GpuReadings, HostReadings


def _tree(root, files: dict[str, str]) -> str:
    for path, text in files.items():
        f = root / path.lstrip("/")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return str(root)


CPU = "processor : {i}\nmodel name : Intel(R) Xeon(R) Platinum 8480C\nphysical id : {s}\nflags : fpu avx2 {extra}\n\n"


def _host_files(bad: bool) -> dict[str, str]:
    extra = "avx512f avx512_bf16 amx_tile"
    files = {
        "/proc/cpuinfo": "".join(CPU.format(i=i, s=i // 2, extra="" if bad else extra) for i in range(4)),
        "/proc/meminfo": "MemTotal:       1048576000 kB\nMemAvailable:   1000000000 kB\nHugePages_Total:       0\n",
        "/sys/devices/system/node/node0/cpulist": "0-1", "/sys/devices/system/node/node1/cpulist": "2-3",
        "/sys/devices/system/node/node0/meminfo": "Node 0 MemTotal:       524288000 kB\n",
        "/sys/devices/system/node/node1/meminfo": "Node 1 MemTotal:       524288000 kB\n",
        "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor": "powersave" if bad else "performance",
        "/sys/devices/system/cpu/intel_pstate/no_turbo": "1" if bad else "0",
        "/sys/kernel/mm/transparent_hugepage/enabled": "[always] madvise never" if bad else "always [madvise] never",
        "/proc/sys/vm/swappiness": "60" if bad else "1",
        "/proc/sys/vm/overcommit_memory": "2" if bad else "0",
        "/proc/sys/kernel/numa_balancing": "1" if bad else "0",
        "/proc/sys/vm/max_map_count": "65530" if bad else "1048576",
        "/sys/module/pcie_aspm/parameters/policy": "default performance [powersave]" if bad else "[default] performance",
        "/proc/self/oom_score_adj": "500" if bad else "0",
        "/proc/self/cgroup": "0::/ferry\n",
        "/sys/fs/cgroup/ferry/memory.max": str(64 * 2**30) if bad else "max",
    }
    return files


def test_probe_reads_a_fixture_tree(tmp_path):
    h = probe.read_host(_tree(tmp_path, _host_files(bad=True)), env={"LANG": "C"})
    assert h.cpu_model.startswith("Intel") and h.sockets == 2 and h.logical_cpus == 4
    assert h.numa_nodes == {0: {"cpus": [0, 1], "mem_total": 524288000 * 1024},
                            1: {"cpus": [2, 3], "mem_total": 524288000 * 1024}}
    assert (h.governor, h.no_turbo, h.thp, h.aspm, h.swappiness) == ("powersave", 1, "always", "powersave", 60)
    assert h.cgroup_memory_max == 64 * 2**30 and h.mem_total == 1048576000 * 1024 and h.locale == "C"


@pytest.mark.parametrize("bad", [True, False])
def test_host_checks_judge_readings(tmp_path, bad):
    h = probe.read_host(_tree(tmp_path, _host_files(bad)), env={"LANG": "C" if bad else "en_US.UTF-8"})
    h.memlock, h.nofile = (2**20, 2**20) if bad else (-1, -1), (1024, 1024) if bad else (65536, 65536)
    checks = {c.name: c for c in doctor.host_checks(h, need_host_bytes=100 * 2**30)}
    expect_warn = ["cpu_governor", "cpu_turbo", "transparent_hugepages", "swappiness", "overcommit", "numa_balancing",
                   "memlock_limit", "open_files_limit", "max_map_count", "pcie_aspm", "oom_score", "locale", "cpu_isa"]
    for name in expect_warn:
        assert checks[name].status == ("warn" if bad else "ok"), (name, checks[name])
        assert bool(checks[name].fix) == bad, name
    assert checks["cgroup_memory"].status == ("fail" if bad else "ok")  # 64 GiB limit < 100 GiB the plan pins
    assert checks["host_memory"].status == "ok"
    assert checks["numa"].fix.startswith("#") and "numactl" in checks["numa"].fix


def test_disk_and_log_checks():
    full = {"path": "/data", "bytes_free": 50 * 2**30, "inodes_free": 100, "inodes_total": 10**6}
    roomy = {"path": "/data", "bytes_free": 500 * 2**30, "inodes_free": 9 * 10**5, "inodes_total": 10**6}
    got = {c.name: c.status for c in doctor.disk_checks({"model": full, "logs": roomy, "x": None}, need_bytes=2**30)}
    assert got == {"disk_model": "fail", "disk_logs": "ok", "disk_x": "skip"}  # inodes, not bytes, ran out
    assert doctor.disk_checks({"m": roomy}, need_bytes=600 * 2**30)[0].status == "fail"
    assert doctor.host_kernels_check(None).status == "ok"
    assert "AVX512-BF16" in doctor.host_kernels_check(None, nf4_bf16=True).value
    assert "AMX" in doctor.host_kernels_check(None, True, amx=True, cpu_has_amx=True).value
    unused = doctor.host_kernels_check(None, True, amx=False, cpu_has_amx=True)
    assert unused.status == "warn" and "5.16" in unused.fix
    no_cc = doctor.host_kernels_check("no C compiler ran ([Errno 2] No such file or directory: 'cc')")
    assert no_cc.status == "warn" and "compiler" in no_cc.fix
    assert doctor.host_kernels_check("the CPU has no AVX-512F").fix == ""


def _gpu(i, **kw) -> GpuReadings:
    base = dict(name="NVIDIA H200", memory_total=141 * 10**9, driver="570.1", cuda="12.8", pcie_gen=5, pcie_gen_max=5,
                pcie_width=16, pcie_width_max=16, persistence=True, ecc=True, ecc_uncorrected=0, temperature_c=40,
                numa_node=0, p2p={})
    return GpuReadings(i, **{**base, **kw})


def test_gpu_checks_judge_nvml_readings():
    assert [(c.name, c.status) for c in doctor.gpu_checks([], nvml_present=False)] == [("gpu", "skip")]
    good = {c.name: c.status for c in doctor.gpu_checks([_gpu(0, p2p={1: "NODE"}), _gpu(1, p2p={0: "NODE"})], True)}
    assert all(s == "ok" for s in good.values()) and good["gpu_topology"] == good["gpu_tp_groups"] == "ok"
    bad = doctor.gpu_checks([_gpu(0, pcie_width=8, persistence=False, ecc_uncorrected=3, temperature_c=90,
                                  throttle=["hw thermal"], p2p={1: "SYSTEM"}, sm_clock=1200, sm_clock_max=1980),
                             _gpu(1, numa_node=1, p2p={0: "SYSTEM"})],
                            True)
    got = {c.name: c for c in bad}
    assert got["gpu0_pcie_link"].status == "warn" and got["gpu0_pcie_link"].value == "gen 5 x8"
    assert got["gpu0_persistence"].fix == "nvidia-smi -i 0 -pm 1"
    assert got["gpu0_ecc"].status == "fail" and got["gpu0_temperature"].status == "warn"
    assert got["gpu0_temperature"].value == "90 C"
    assert got["gpu0_clocks"].status == "fail" and got["gpu1_numa"].value == "node 1"
    assert got["gpu_topology"].value == "SYSTEM: 0-1" and got["gpu_tp_groups"].status == "warn"
    assert "--pipeline-parallel-size 2" in got["gpu_tp_groups"].fix
    # NVML's -1 (the lent H200, one node): said as such, not as a node called -1
    (numa,) = [c for c in doctor.gpu_checks([_gpu(0, numa_node=-1)], True) if c.name == "gpu0_numa"]
    assert numa.status == "ok" and numa.value.startswith("no NUMA affinity reported")


def test_bandwidth_checks_judge_measurements():
    got = doctor.bandwidth_checks({"host_read_gbs": 10.0, "gpus": {}, "per_node": "one NUMA node: measured once"},
                                  gpu=False)
    assert [c.status for c in got] == ["ok", "skip", "skip"] and got[1].value == "one NUMA node: measured once"
    m = {"host_read_gbs": 100.0, "gpus": {0: dict(pinned_h2d_gbs=11.0, pageable_h2d_gbs=6.0, pinned_d2h_gbs=12.0,
                                                  hbm_copy_gbs=3500.0, pcie_gen=5, pinned_ok_gb=10, pinned_want_gb=64)}}
    got = {c.name: c.status for c in doctor.bandwidth_checks(m, gpu=True)}
    assert got == {"host_memory_read": "ok", "numa_bandwidth": "skip", "gpu0_h2d": "warn", "gpu0_hbm_copy": "ok",
                   "gpu0_pinning": "fail"}


def _copies(h2d):
    return dict(pinned_h2d_gbs=h2d, pageable_h2d_gbs=h2d / 2, pinned_d2h_gbs=h2d, pageable_d2h_gbs=h2d / 3)


def test_numa_node_checks_judge_a_two_socket_reading():
    """Node 1 reads memory at half node 0's rate, and GPU 0 (hanging off node 1) gets its copies from node 1's
    memory 40% slower than from node 0's: both warn, and the fix binds the server to node 0."""
    m = {"host_read_gbs": 20.0, "gpus": {0: dict(_copies(50.0), hbm_copy_gbs=4000.0, pcie_gen=5, numa_node=1)},
         "nodes": {0: {"cpus": 56, "host_read_gbs": 20.0, "gpus": {0: _copies(50.0)}},
                   1: {"cpus": 56, "host_read_gbs": 10.0, "gpus": {0: _copies(30.0)}}},
         "per_node": "measured from each of 2 NUMA nodes"}
    got = {c.name: c for c in doctor.bandwidth_checks(m, gpu=True)}
    assert got["node0_memory_read"].status == "ok" and got["node1_memory_read"].status == "warn"
    assert got["node1_memory_read"].fix.startswith("numactl --cpunodebind=0 --membind=0")
    h = got["gpu0_h2d_by_node"]
    assert h.status == "warn" and "node 0 50.0, node 1 30.0" in h.value and "--cpunodebind=0" in h.fix
    assert "hangs off node 1" in h.expected
    assert "pageable 16.7" in got["gpu0_h2d"].value  # pageable D2H measured too
    even = {**m, "nodes": {n: {**r, "host_read_gbs": 20.0, "gpus": {0: _copies(50.0)}} for n, r in m["nodes"].items()}}
    assert all(c.status == "ok" for c in doctor.bandwidth_checks(even, gpu=True) if c.name.startswith(("node", "gpu0_h2d_")))


def test_measure_per_node_binds_thread_and_buffers(monkeypatch):
    """A fake two-node topology over this machine's CPUs: each node is measured on its own CPUs with torch on
    one thread (so the buffers are first-touched there), and the affinity is restored after."""
    import torch

    from ferrylm.hw import bandwidth

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs to fake two nodes")
    seen = []
    real = bandwidth.host_read_gbs

    def observed(size_mib=256):
        seen.append((os.sched_getaffinity(0), torch.get_num_threads()))
        return real(size_mib)

    monkeypatch.setattr(bandwidth, "host_read_gbs", observed)
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    m = bandwidth.measure(numa_nodes={0: {"cpus": [allowed[0]]}, 1: {"cpus": [allowed[1]], "mem_total": 1}}, size_mib=16)
    assert seen[1:] == [({allowed[0]}, 1), ({allowed[1]}, 1)]
    assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads
    assert set(m["nodes"]) == {0, 1} and all(r["host_read_gbs"] > 0 for r in m["nodes"].values())
    assert m["per_node"] == "measured from each of 2 NUMA nodes"
    print({n: round(r["host_read_gbs"], 1) for n, r in m["nodes"].items()}, "GB/s per (fake) node")


def test_measure_once_on_one_node():
    from ferrylm.hw import bandwidth

    allowed = sorted(os.sched_getaffinity(0))
    one = bandwidth.measure(numa_nodes={0: {"cpus": allowed}}, size_mib=16)
    assert "nodes" not in one and one["per_node"] == "one NUMA node: measured once" and one["host_read_gbs"] > 0
    shut_out = bandwidth.measure(numa_nodes={0: {"cpus": allowed}, 1: {"cpus": [10**6]}}, size_mib=16)
    assert "nodes" not in shut_out and "one of 2 NUMA nodes only" in shut_out["per_node"]


def test_doctor_on_this_machine(tmp_path, capsys):
    from ferrylm.cli import main

    fixes = tmp_path / "fixes.sh"
    assert main(["doctor", "--json", "--model-path", str(tmp_path), "--write-fixes", str(fixes)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d) == {"checks", "summary"} and sum(d["summary"].values()) == len(d["checks"])
    for c in d["checks"]:
        assert set(c) == {"name", "status", "value", "expected", "why", "fix", "scope", "persist"}
        assert c["status"] in ("ok", "warn", "fail", "skip")
        assert c["scope"] in (("machine", "shell", "note") if c["fix"] else ("",))
    names = {c["name"]: c for c in d["checks"]}
    assert {"numa", "cpu_isa", "locale", "disk_model", "disk_logs"} <= set(names)
    if not probe.read_gpus():
        assert names["gpu"]["status"] == "skip"
    script = fixes.read_text()
    assert script.startswith("#!/bin/sh")
    for c in d["checks"]:
        if c["status"] in ("warn", "fail") and c["fix"]:
            assert c["fix"] in script
        elif c["fix"] and c["status"] == "ok":
            assert c["fix"] not in script
    with pytest.raises(SystemExit) as e:  # a plan that pins more than this machine has fails host_memory
        main(["doctor", "--plan-host-gb", "1000000"])
    assert e.value.code == 1 and "host_memory" in capsys.readouterr().out


def test_nvml_names_map_to_profiles():
    assert probe.profile_for("NVIDIA H100 PCIe").name == "H100-80G-PCIe"
    assert probe.profile_for("NVIDIA H100 80GB HBM3").name == "H100-80G-SXM"
    assert probe.profile_for("NVIDIA A800 80GB PCIe").name == "A800-80G-PCIe"
    assert probe.profile_for("NVIDIA H200").name == "H200"
    assert probe.profile_for("NVIDIA GeForce RTX 4090").name == "RTX-4090"
    assert probe.profile_for("Tesla V100-SXM2-32GB") is None
    # a chip is a whole word (or two joined), a stated memory size must agree
    assert probe.profile_for("NVIDIA RTX 6000 Ada Generation") is None
    assert probe.profile_for("NVIDIA GeForce RTX 3090") is None
    assert probe.profile_for("NVIDIA A100-PCIE-40GB").name == "A100-40G"
    assert probe.profile_for("NVIDIA A100-SXM4-80GB").name == "A100-80G-SXM"
    assert probe.profile_for("NVIDIA A10").name == "A10" and probe.profile_for("NVIDIA H20").name == "H20"
    assert probe.profile_for("Tesla T4").name == "T4" and probe.profile_for("NVIDIA L40S").name == "L40S"


def test_local_gpus_take_cudas_view(monkeypatch):
    """`--gpu local`: each GPU's memory as CUDA reports it (what the engine sizes from), matched to NVML's cards by
    PCI address, only the cards this process sees and in CUDA's order (NVML lists every card in PCI order); NVML's
    figures where no CUDA torch sees them."""
    nvml = [GpuReadings(0, "NVIDIA H100 80GB HBM3", 85_520_809_984, bus_id="00000000:19:00.0"),
            GpuReadings(1, "NVIDIA A800 80GB PCIe", 85_899_345_920, bus_id="00000000:3B:00.0")]
    monkeypatch.setattr(probe, "read_gpus", lambda root="/": nvml)
    monkeypatch.setattr(probe, "_cuda_totals", lambda: {})
    assert [(g.name, g.memory_bytes) for g in probe.local_gpus()] == [(n.name, n.memory_total) for n in nvml]
    monkeypatch.setattr(probe, "_cuda_totals", lambda: {(0, 0x3B, 0): 85_051_572_224})  # CUDA_VISIBLE_DEVICES=1
    (g,) = probe.local_gpus()
    assert g.name == "NVIDIA A800 80GB PCIe" and g.memory_bytes == 85_051_572_224 and g.hbm_gbs == 1935
    monkeypatch.setattr(probe, "_cuda_totals", lambda: {(0, 0x3B, 0): 1, (0, 0x19, 0): 2})  # CUDA's own order
    assert [g.memory_bytes for g in probe.local_gpus()] == [1, 2]
    assert probe._pci("00000000:3B:00.0") == (0, 0x3B, 0) and probe._pci(None) is None


def test_doctor_measure_on_this_machine(capsys):
    """`--measure` for real here: host memory read, and the per-node measurement (or why it ran once)."""
    from ferrylm.cli import main

    assert main(["doctor", "--measure", "--json"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert float(checks["host_memory_read"]["value"].split()[0]) > 0
    nodes = len(probe.read_host().numa_nodes)
    if nodes <= 1:
        assert checks["numa_bandwidth"]["status"] == "skip" and "measured once" in checks["numa_bandwidth"]["value"]
    else:
        assert any(n.startswith("node") and n.endswith("_memory_read") for n in checks)


@pytest.mark.parametrize("where", ["missing folder", "a folder", "a pipe", "no name"])
def test_write_fixes_to_a_bad_path_is_one_line(tmp_path, capsys, monkeypatch, where):
    """A path that cannot be written says so in one line and exits 2, before any check runs. A pipe or a device was
    renamed over (`--write-fixes /dev/full` as root left a regular file where the device was); an empty name was
    ignored and nothing written."""
    from ferrylm.cli import main
    from ferrylm.hw import cli

    monkeypatch.setattr(cli, "run_checks", lambda a: pytest.fail("the checks ran before the path was checked"))
    target = {"missing folder": tmp_path / "nonexistent" / "f.sh", "a folder": tmp_path, "a pipe": tmp_path / "fifo",
              "no name": ""}[where]
    if where == "a pipe":
        os.mkfifo(target)
    assert main(["doctor", "--write-fixes", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ferry: error: --write-fixes")
    assert {"missing folder": "does not exist", "a folder": "is a directory", "a pipe": "is not a regular file",
            "no name": "name a file"}[where] in err
    if where == "a pipe":
        assert stat.S_ISFIFO(os.lstat(target).st_mode)


def test_write_fixes_through_a_link_replaces_its_target(tmp_path):
    """A symbolic link names the script it points at: that file is replaced and the link stays (the rename put a
    regular file where the link was)."""
    from ferrylm.hw import cli

    real, link = tmp_path / "real.sh", tmp_path / "fixes.sh"
    real.write_text("old\n")
    link.symlink_to(real)
    cli.write_atomic(str(link), "#!/bin/sh\nnew\n")
    assert link.is_symlink() and real.read_text() == "#!/bin/sh\nnew\n"
    assert sorted(os.listdir(tmp_path)) == ["fixes.sh", "real.sh"]


def test_write_fixes_replaces_the_file_whole(tmp_path, monkeypatch):
    """Written to a temporary file beside it and renamed: a failed write leaves the old script and no debris."""
    from ferrylm.errors import FerryError
    from ferrylm.hw import cli

    f = tmp_path / "fixes.sh"
    f.write_text("old\n")
    cli.write_atomic(str(f), "#!/bin/sh\nnew\n")
    assert f.read_text() == "#!/bin/sh\nnew\n" and os.listdir(tmp_path) == ["fixes.sh"]
    umask = os.umask(0)
    os.umask(umask)
    assert f.stat().st_mode & 0o777 == 0o666 & ~umask
    monkeypatch.setattr(os, "replace", lambda a, b: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(FerryError, match="No space left"):
        cli.write_atomic(str(f), "newer\n")
    assert f.read_text() == "#!/bin/sh\nnew\n" and os.listdir(tmp_path) == ["fixes.sh"]


@pytest.mark.parametrize("gb", ["-5", "nan", "inf", "lots"])
def test_plan_host_gb_must_be_a_size(capsys, gb):
    from ferrylm.cli import main

    with pytest.raises(SystemExit) as e:
        main(["doctor", "--plan-host-gb", gb])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument --plan-host-gb: '{gb}' is not a size in GB" in err


def test_disk_check_says_a_missing_path(tmp_path):
    """A model path that does not exist warns (it said "ok" for / before), naming the parent whose disk is judged."""
    d = probe.disk_usage(str(tmp_path / "no" / "model"))
    assert d["path"] == str(tmp_path) and d["asked"] == str(tmp_path / "no" / "model") and not d["exists"]
    (c,) = doctor.disk_checks({"model": {**d, "bytes_free": 500 * 2**30, "inodes_free": 10**6, "inodes_total": 10**6}})
    assert c.status == "warn" and c.value.startswith(f"{tmp_path}/no/model does not exist; 500.0 GiB")
    assert c.value.endswith(f"on {tmp_path}, its nearest existing parent") and "does not exist" in c.fix
    (c,) = doctor.disk_checks({"model": {**d, "inodes_free": 5, "inodes_total": 10**6}})  # and its parent is full
    assert c.status == "fail" and "does not exist" in c.fix and "df -i" in c.fix
    assert probe.disk_usage(str(tmp_path))["exists"]


def test_log_level_is_what_ferry_logs_at(monkeypatch, capsys):
    """$FERRY_LOG_LEVEL sets the level `ferry` logs at (logging's names in any case, or a number; -v lowers it to
    INFO); a value that is no level warns on stderr and logs at WARNING, the command runs on (a stray value never stops
    a server, nor `ferry doctor`, which judges it); doctor judges the same functions, and its fix (unset it) brings
    back the default."""
    import logging

    from ferrylm import cli
    from ferrylm.hw import cli as doctor_cli

    env = cli.LOG_LEVEL_ENV
    assert cli.log_level(False, {}) == logging.WARNING and cli.log_level(True, {}) == logging.INFO
    assert cli.log_level(False, {env: "debug"}) == logging.DEBUG and cli.log_level(True, {env: "DEBUG"}) == logging.DEBUG
    assert cli.log_level(True, {env: "error"}) == logging.INFO and cli.log_level(False, {env: " "}) == logging.WARNING
    assert cli.log_level(False, {env: "warn"}) == logging.WARNING and cli.log_level(False, {env: "20"}) == 20
    assert cli.parse_log_level("loud") is None and cli.log_level(False, {env: "loud"}) == logging.WARNING
    seen = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: seen.append(kw["level"]))
    monkeypatch.setattr(doctor_cli, "cmd_doctor", lambda a: seen.append("doctor ran"))
    monkeypatch.setenv(env, "error")
    assert cli.main(["doctor"]) == 0 and cli.main(["-v", "doctor"]) == 0
    assert seen == [logging.ERROR, "doctor ran", logging.INFO, "doctor ran"]
    capsys.readouterr()
    monkeypatch.setenv(env, "loud")
    assert cli.main(["doctor"]) == 0 and seen[-2:] == [logging.WARNING, "doctor ran"]
    assert capsys.readouterr().err == (f"ferry: warning: {env}='loud' is not a level (DEBUG, INFO, WARNING, ERROR, "
                                       "CRITICAL or a number); logging at WARNING\n")

    debug = doctor.log_level_check("debug")
    assert debug.status == "warn" and debug.value.startswith("DEBUG (FERRY_LOG_LEVEL=debug")
    assert debug.fix.startswith(f"unset {env}") and doctor.log_level_check(None).status == "ok"
    assert doctor.log_level_check("error").value.startswith("ERROR") and doctor.log_level_check("loud").status == "warn"
    assert "not a level" in doctor.log_level_check("loud").value


def _script_parts(script: str) -> dict[str, list[str]]:
    """The script's commands (not comments) by part: "top" before the root guard, "1", "2", "3", "notes"."""
    parts, part = {}, "top"
    for line in script.splitlines():
        for mark, name in (("-- part 1", "1"), ("-- part 2", "2"), ("-- part 3", "3"), ("-- notes", "notes")):
            if mark in line:
                part = name
        if line.strip() and not line.lstrip().startswith("#"):
            parts.setdefault(part, []).append(line)
    return parts


def test_fixes_script_says_where_each_fix_acts(tmp_path):
    """Kernel settings run as root and last until reboot, their /etc form only with --persist; limits and
    environment sit in the part sourced by the shell that starts ferry; notes are never commands."""
    import subprocess

    h = probe.read_host(_tree(tmp_path, _host_files(bad=True)), env={"LC_ALL": "C", "LANG": "en_US.UTF-8"})
    h.memlock, h.nofile = (2**20, 2**20), (1024, 4096)
    checks = doctor.host_checks(h, need_host_bytes=100 * 2**30)
    checks += doctor.bandwidth_checks({"host_read_gbs": 20.0, "gpus": {}, "nodes": {
        0: {"cpus": 2, "host_read_gbs": 20.0}, 1: {"cpus": 2, "host_read_gbs": 5.0}}}, gpu=False)
    got = {c.name: c for c in checks}
    assert got["swappiness"].scope == "machine" and got["open_files_limit"].scope == "shell"
    assert got["locale"].fix == "export LC_ALL=C.UTF-8"  # LC_ALL decides here: exporting LANG would change nothing
    assert got["open_files_limit"].fix.startswith("ulimit -Sn 65536  # fails until the hard limit (4096) is raised")
    script = doctor.fixes_script(checks)
    f = tmp_path / "fixes.sh"
    f.write_text(script)
    assert subprocess.run(["sh", "-n", str(f)]).returncode == 0  # parsed only: this may run as root
    parts = _script_parts(script)
    assert parts["top"] == ['if [ "$(id -u)" -ne 0 ]; then',
                            '    echo "ferry doctor fixes: not root: parts 1 and 2 (this machine\'s settings) skipped" >&2',
                            "else"]
    assert "sysctl -w vm.swappiness=1" in parts["1"] and "sysctl -w kernel.numa_balancing=0" in parts["1"]
    assert "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled" in parts["1"]
    assert parts["1"][-1] == 'if [ "${1-}" = --persist ]; then'
    assert "echo 'vm.swappiness = 1' > /etc/sysctl.d/90-ferrylm-vm.swappiness.conf" in parts["2"]
    assert ("echo 'w /sys/kernel/mm/transparent_hugepage/enabled - - - - madvise' > /etc/tmpfiles.d/ferrylm-thp.conf"
            in parts["2"])
    assert any(ln.startswith("printf '%s\\n' '* soft nofile 65536' '* hard nofile 65536' > "
                             "/etc/security/limits.d/90-ferrylm-nofile.conf") for ln in parts["2"])
    assert parts["2"][-2:] == ["fi", "fi"]
    shell = {c.fix for c in checks if c.scope == "shell" and c.status in ("warn", "fail")}
    assert set(parts["3"]) == shell and {"export LC_ALL=C.UTF-8", "echo -500 > /proc/$$/oom_score_adj  # lowering it "
                                         "needs root (CAP_SYS_RESOURCE)"} <= shell
    assert "notes" not in parts and "# node1_memory_read: 5.0 GB/s (one thread on 2 CPUs) (expected >= 80% of node " \
        "0's 20.0)" in script and "# numactl --cpunodebind=0 --membind=0 ferry serve ..." in script
    assert "nothing to fix" in doctor.fixes_script([]) and "if [" not in doctor.fixes_script([])


def test_fixes_scripts_shell_part_reaches_the_shell_that_sources_it(tmp_path):
    """What part 3 says is so: sourced, a limit reaches the shell that starts ferry; run with sh, it does not."""
    import resource
    import subprocess

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    f = tmp_path / "fixes.sh"
    f.write_text(doctor.fixes_script([doctor.Check("open_files_limit", "warn", str(soft), fix=f"ulimit -Sn {soft - 1}",
                                                   scope="shell")]))
    assert "if [" not in f.read_text()  # no root part: safe to run here
    sourced = subprocess.run(["sh", "-c", f". {f}; ulimit -Sn"], capture_output=True, text=True)
    run = subprocess.run(["sh", "-c", f"sh {f}; ulimit -Sn"], capture_output=True, text=True)
    assert sourced.stdout.split() == [str(soft - 1)] and run.stdout.split() == [str(soft)]


def test_clock_checks_judge_reasons_and_settings():
    """Clocks with NVML's event reasons: the GPU's own slowdown fails, a thermal one warns, idle and a power cap at
    the default limit are said and pass; a power limit or applications clocks below the default warn with the
    command that restores the default."""
    def clocks(**kw):
        return {c.name: c for c in doctor.clock_checks(_gpu(0, sm_clock=345, sm_clock_max=1980, mem_clock=2619,
                                                              mem_clock_max=2619, **kw))}

    idle = clocks(throttle=["idle"], power_limit_w=700.0, power_limit_default_w=700.0, app_sm_clock=1980,
                  app_sm_clock_default=1980)
    assert [c.status for c in idle.values()] == ["ok", "ok", "ok"]
    assert idle["gpu0_clocks"].value == "SM 345 of 1980 MHz; memory 2619 of 2619 MHz; reasons: idle"
    assert "under load" in idle["gpu0_clocks"].why
    hot = clocks(throttle=["hw thermal", "sw thermal"])["gpu0_clocks"]
    assert hot.status == "fail" and hot.scope == "note" and "cooling" in hot.fix
    assert clocks(throttle=["power brake"])["gpu0_clocks"].status == "fail"
    assert clocks(throttle=["sw thermal"])["gpu0_clocks"].status == "warn"
    assert clocks(throttle=None)["gpu0_clocks"].value.endswith("reasons: not reported")
    capped = clocks(throttle=["power cap"], power_limit_w=400.0, power_limit_default_w=700.0)
    assert capped["gpu0_clocks"].status == "ok" and "lowered limit (see gpu0_power_limit)" in capped["gpu0_clocks"].why
    at_default = clocks(throttle=["power cap"], power_limit_w=700.0, power_limit_default_w=700.0)["gpu0_clocks"]
    assert at_default.status == "ok" and "normal under full load" in at_default.why
    pl = capped["gpu0_power_limit"]
    assert pl.status == "warn" and pl.fix == "nvidia-smi -i 0 -pl 700" and pl.scope == "machine"
    assert pl.persist.startswith("# nvidia-smi -pl lasts until reboot")
    assert clocks(power_limit_w=699.0, power_limit_default_w=700.0)["gpu0_power_limit"].status == "ok"  # rounding
    app = clocks(app_sm_clock=1410, app_sm_clock_default=1980)["gpu0_app_clocks"]
    assert app.status == "warn" and app.fix == "nvidia-smi -i 0 -rac"
    assert set(clocks()) == {"gpu0_clocks"}  # no power or applications-clock readings: no checks for them


class FakeNvml:
    """pynvml as `probe.read_gpus` calls it, for two GPUs (index 1 throttled, a lowered power limit); a call it
    does not define raises, as a function the driver lacks does."""

    def __init__(self, topology=50, p2p=None):
        self.topology, self.p2p = topology, p2p or {}

    def __getattr__(self, name):
        if name.startswith("nvml"):
            def unsupported(*a):
                raise RuntimeError(f"{name}: not supported")
            return unsupported
        raise AttributeError(name)

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("Mem", (), {"total": 80 * 2**30})

    def nvmlDeviceGetPciInfo(self, h):
        return type("Pci", (), {"busId": f"00000000:{0x19 + h:02X}:00.0".encode()})

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x1 if h == 0 else 0x4 | 0x40

    def nvmlDeviceGetClockInfo(self, h, kind):
        return {1: 1980 if h == 0 else 1100, 2: 2619}[kind]

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        return {1: 1980, 2: 2619}[kind]

    def nvmlDeviceGetPowerManagementLimit(self, h):
        return 700_000 if h == 0 else 350_000

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h):
        return 700_000

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.topology

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        return self.p2p.get((min(a, b), max(a, b), index), 0 if index == 0 else 5)  # P2P reads OK; NVLink not


def test_read_gpus_through_a_fake_nvml(monkeypatch):
    """The NVML reader on fake readings: clock event reasons named (idle kept), clocks and power limits in their
    units, a call the driver lacks read as unknown; the judgement follows."""
    monkeypatch.setattr(probe, "nvml", lambda: FakeNvml())
    g0, g1 = probe.read_gpus()
    assert (g0.name, g0.bus_id, g0.throttle, g1.throttle) == ("NVIDIA H100 80GB HBM3", "00000000:19:00.0", ["idle"],
                                                              ["power cap", "hw thermal"])
    assert (g1.sm_clock, g1.mem_clock, g1.power_limit_w, g1.power_limit_default_w) == (1100, 2619, 350.0, 700.0)
    assert g0.app_sm_clock is None and g0.temperature_c is None and g0.persistence is None  # unknown, not 0 or off
    got = {c.name: c.status for c in doctor.gpu_checks([g0, g1], True)}
    assert (got["gpu0_clocks"], got["gpu1_clocks"], got["gpu1_power_limit"]) == ("ok", "fail", "warn")


def _machine(n: int, link) -> list[GpuReadings]:
    """`n` fake GPUs whose pair (a, b) is linked by `link(a, b)`: a level name, or (level, False) for no P2P."""
    def pair(a, b):
        x = link(min(a, b), max(a, b))
        return x if isinstance(x, tuple) else (x, True)

    return [_gpu(i, p2p={j: pair(i, j)[0] for j in range(n) if j != i},
                 p2p_read={j: pair(i, j)[1] for j in range(n) if j != i}) for i in range(n)]


def _tp(gpus) -> dict[str, str]:
    return {c.name: c for c in doctor.topology_checks(gpus)}


def test_tp_groups_follow_the_topology():
    """Which GPUs make a TP group, on fake NVML topologies: a two-socket PCIe box (pairs under a switch), the same
    with its GPUs numbered across the sockets, NVLink-bridged pairs, an NVSwitch box, and three GPUs."""
    def two_socket(node, switch):
        return lambda a, b: "SINGLE" if switch(a) == switch(b) else "NODE" if node(a) == node(b) else "SYSTEM"

    pcie = _machine(8, two_socket(lambda i: i // 4, lambda i: i // 2))
    assert doctor.tp_groups(pcie, 2) == ([[0, 1], [2, 3], [4, 5], [6, 7]], doctor.LINKS.index("SINGLE"))
    assert doctor.tp_groups(pcie, 4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], doctor.LINKS.index("NODE"))
    c = _tp(pcie)["gpu_tp_groups"]
    assert c.status == "ok" and c.value == ("TP 2: [0,1] [2,3] [4,5] [6,7] over SINGLE; TP 4: [0,1,2,3] [4,5,6,7] "
                                            "over NODE; TP 8: [0,1,2,3,4,5,6,7] over SYSTEM")
    assert "TP up to 4 keeps each group on one socket" in c.why and "TP 4 x PP 2" in c.why
    assert "TP 4 group: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1,2,3 " in c.why
    assert _tp(pcie)["gpu_topology"].value == "SINGLE: 0-1, 2-3, 4-5, 6-7; NODE: 8 pairs; SYSTEM: 16 pairs"
    # numbered across the sockets: 0,1,4,5 on one, switch pairs 0+4, 1+5, ...: in-order groups would cross sockets
    mixed = _machine(8, two_socket(lambda i: (i // 2) % 2, lambda i: i % 4))
    assert doctor.tp_groups(mixed, 2)[0] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert doctor.tp_groups(mixed, 4) == ([[0, 1, 4, 5], [2, 3, 6, 7]], doctor.LINKS.index("NODE"))
    bridged = _machine(4, lambda a, b: "NVLINK" if a // 2 == b // 2 else "NODE")
    assert doctor.tp_groups(bridged, 2) == ([[0, 1], [2, 3]], 0)
    nvswitch = _machine(8, lambda a, b: "NVLINK")
    assert _tp(nvswitch)["gpu_tp_groups"].value.endswith("TP 8: [0,1,2,3,4,5,6,7] over NVLINK")
    assert "TP up to 8" in _tp(nvswitch)["gpu_tp_groups"].why and "PP" not in _tp(nvswitch)["gpu_tp_groups"].why
    three = _machine(3, lambda a, b: "SINGLE" if {a, b} == {1, 2} else "NODE")
    assert _tp(three)["gpu_tp_groups"].value == "TP 2: [1,2] over SINGLE (GPU 0 spare)"
    assert doctor.tp_groups(three, 4) is None


def test_topology_without_p2p():
    """P2P off between GPUs under one switch warns (all-reduces through host memory) and ranks the pair as far as
    the node; across sockets alone it is no news. No topology at all: the groups say skip."""
    off = _machine(4, lambda a, b: ("SINGLE", False) if (a, b) == (0, 1) else "SINGLE" if (a, b) == (2, 3) else "NODE")
    topo = _tp(off)["gpu_topology"]
    assert topo.status == "warn" and "no P2P between 0-1" in topo.why and topo.scope == "note"
    assert topo.value == "SINGLE: 2-3; SINGLE, no P2P: 0-1; NODE: 0-2, 0-3, 1-2, 1-3"
    assert doctor.tp_groups(off, 2) == ([[0, 1], [2, 3]], doctor.LINKS.index("NODE"))
    apart = _machine(2, lambda a, b: ("SYSTEM", False))
    assert _tp(apart)["gpu_topology"].status == "ok" and _tp(apart)["gpu_tp_groups"].status == "warn"
    unknown = _tp([_gpu(0), _gpu(1)])
    assert unknown["gpu_tp_groups"].status == "skip" and unknown["gpu_topology"].value == "unknown: 0-1"


def test_read_gpus_links_through_a_fake_nvml(monkeypatch):
    """NVML's NVLink P2P status makes a pair NVLINK over its PCIe level; a P2P read status other than OK is no P2P."""
    monkeypatch.setattr(probe, "nvml", lambda: FakeNvml(topology=10, p2p={(0, 1, 2): 0}))
    g0, g1 = probe.read_gpus()
    assert (g0.p2p, g1.p2p, g0.p2p_read) == ({1: "NVLINK"}, {0: "NVLINK"}, {1: True})
    monkeypatch.setattr(probe, "nvml", lambda: FakeNvml(topology=40, p2p={(0, 1, 0): 4}))
    g0, g1 = probe.read_gpus()
    assert (g0.p2p, g0.p2p_read, g1.p2p_read) == ({1: "NODE"}, {1: False}, {0: False})


def test_table_prints_values_verbatim(monkeypatch, capsys):
    """Brackets in a value ("[0,1]", "[bold]") are text, not rich markup; a shell fix says where it runs."""
    from ferrylm.cli import main
    from ferrylm.hw import cli

    checks = doctor.topology_checks(_machine(2, lambda a, b: "SYSTEM")) + [doctor.log_level_check("debug"),
                                                                          doctor.log_level_check("[bold]")]
    monkeypatch.setattr(cli, "run_checks", lambda a: checks)
    assert main(["doctor"]) == 0  # warnings, no failure
    out = capsys.readouterr().out
    assert "[0,1]" in out and "=[bold]" in out and "(in the shell" in out  # (columns wrap elsewhere)


def test_tp_groups_match_a_brute_force_search():
    """On a box where an NVLink bridge joins GPUs under different switches, the groups are still the closest any
    grouping makes (a cut of link-by-link clusters put 1+4 together here, a NODE link, where SINGLE ones do); and
    on 30 seeded random topologies of 4-8 GPUs (PCIe trees, NVLink pairs, P2P off), the farthest link and the sum
    of the groups' farthest links match an exhaustive search."""
    import itertools
    import random

    def partitions(items, k):
        if not items:
            yield []
            return
        for rest in itertools.combinations(items[1:], k - 1):
            for p in partitions([x for x in items[1:] if x not in rest], k):
                yield [[items[0], *rest], *p]

    def check(m, k):
        def far(g):
            return max(doctor.link_rank(m, a, b) for a, b in itertools.combinations(g, 2))

        groups, worst = doctor.tp_groups(m, k)
        best = min((max(map(far, p)), sum(map(far, p))) for p in partitions(sorted(g.index for g in m), k))
        assert (worst, sum(map(far, groups))) == best, (k, groups)
        return groups

    switch = {6: 0, 2: 0, 4: 1, 7: 1, 5: 2, 1: 2, 0: 3, 3: 3}  # node 1 holds switch 3 only
    bridged = _machine(8, lambda a, b: "NVLINK" if (a, b) == (4, 5) else "SINGLE" if switch[a] == switch[b]
                       else "NODE" if (switch[a] == 3) == (switch[b] == 3) else "SYSTEM")
    assert check(bridged, 2) == [[0, 3], [1, 5], [2, 6], [4, 7]]
    rng = random.Random(14)
    for _ in range(30):
        n = rng.choice([4, 6, 8])
        node = {i: rng.randint(0, 1) for i in range(n)}
        sw = {i: (node[i], rng.randint(0, 2)) for i in range(n)}
        nvlink = {(a, b) for a in range(n) for b in range(a + 1, n) if rng.random() < 0.2}
        off = {(a, b) for a in range(n) for b in range(a + 1, n) if rng.random() < 0.1}

        def link(a, b):
            lvl = ("NVLINK" if (a, b) in nvlink else "SINGLE" if sw[a] == sw[b] else "NODE" if node[a] == node[b]
                   else "SYSTEM")
            return (lvl, False) if (a, b) in off and lvl != "NVLINK" else lvl

        m = _machine(n, link)
        for k in (2, 4) if n % 4 == 0 else (2,):
            check(m, k)


def test_limit_fixes_follow_the_hard_limits():
    """A soft limit is raised up to what the hard one allows without root, and the lasting form writes a hard line
    only where the hard limit is too low (never lowering a higher one)."""
    h = HostReadings(memlock=(2**20, 200 * 2**30), nofile=(1024, 1048576))
    got = {c.name: c for c in doctor.host_checks(h, need_host_bytes=100 * 2**30)}
    assert got["open_files_limit"].fix == "ulimit -Sn 65536"
    assert got["open_files_limit"].persist.startswith("printf '%s\\n' '* soft nofile 65536' > ")
    assert got["memlock_limit"].fix == f"ulimit -Sl {200 * 2**20}"  # KiB: the hard limit, which covers the plan
    assert "'* hard" not in got["memlock_limit"].persist
    h = HostReadings(memlock=(2**20, 2**30), nofile=(1024, 4096))
    got = {c.name: c for c in doctor.host_checks(h, need_host_bytes=100 * 2**30)}
    assert got["memlock_limit"].fix.startswith("ulimit -Sl unlimited  # fails until the hard limit (1.0 GiB)")
    assert "'* soft memlock unlimited' '* hard memlock unlimited'" in got["memlock_limit"].persist
    assert "'* hard nofile 65536'" in got["open_files_limit"].persist
