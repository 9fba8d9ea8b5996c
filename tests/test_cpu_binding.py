"""`--threads` / `--numa-node`: the cpulist parser, thread count, binding to the one node this machine has
(with its warning), and a node that does not exist as a clear error from the library and the CLI."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from ferrylm.errors import ConfigError
from ferrylm.hw.cpu_binding import bind_cpu, numa_nodes, parse_cpulist


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("5") == [5]


def test_threads_and_node_binding(caplog):
    before = torch.get_num_threads()
    try:
        bind_cpu(threads=1)
        assert torch.get_num_threads() == 1
        nodes = numa_nodes()
        if not nodes:
            pytest.skip("the kernel reports no NUMA nodes")
        node = min(nodes)
        with caplog.at_level(logging.WARNING):
            bind_cpu(numa_node=node)
        assert os.sched_getaffinity(0) == set(nodes[node])
        assert torch.get_num_threads() == len(nodes[node])
        if len(nodes) == 1:
            assert "one NUMA node" in caplog.text
    finally:
        torch.set_num_threads(before)


def test_more_threads_than_cores_is_warned(caplog):
    """`--threads` past the CPUs the process runs on (the threads take turns) is said at start; as many is not."""
    before, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))
    try:
        with caplog.at_level(logging.WARNING):
            bind_cpu(threads=cores)
            assert "more threads" not in caplog.text
            bind_cpu(threads=cores + 1)
        assert f"--threads {cores + 1}: more threads than the {cores} CPU(s)" in caplog.text
    finally:
        torch.set_num_threads(before)


def test_bad_values_are_clear_errors():
    with pytest.raises(ConfigError, match="no such NUMA node"):
        bind_cpu(numa_node=999)
    with pytest.raises(ConfigError, match="threads must be >= 1"):
        bind_cpu(threads=0)
    r = subprocess.run([sys.executable, "-m", "ferrylm.cli", "generate", "hi", "--numa-node", "999"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no such NUMA node" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "ferrylm.cli", "generate", "hi", "--cpu-numa-node", "999"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--cpu-numa-node 999: no such NUMA node" in r.stderr and "Traceback" not in r.stderr


def _fake_nodes(tmp_path, monkeypatch, nodes: dict[int, str]):
    from ferrylm.hw import cpu_binding

    for n, cpus in nodes.items():
        (tmp_path / f"node{n}").mkdir()
        (tmp_path / f"node{n}" / "cpulist").write_text(cpus + "\n")
    monkeypatch.setattr(cpu_binding, "_NODES", str(tmp_path))


def test_expert_worker_bound_to_a_node(tmp_path, monkeypatch):
    """`--cpu-numa-node` on a (fake) two-node topology: the expert worker thread and the torch threads it
    starts run on the node's CPUs only, the engine's own thread keeps its binding. CPU 1 of this machine
    plays node 1."""
    from ferrylm.hw.cpu_binding import node_cpus, worker_pool

    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1")
    _fake_nodes(tmp_path, monkeypatch, {0: "0", 1: "1"})
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        cpus = node_cpus(1)
        assert cpus == [1]
        pool = worker_pool(cpus)
        got = pool.submit(lambda: (os.sched_getaffinity(0), torch.get_num_threads())).result()
        # a torch op on the worker (intra-op threads started from it) keeps the binding
        assert pool.submit(lambda: (torch.ones(1 << 20).sum(), os.sched_getaffinity(0))[1]).result() == {1}
        pool.shutdown()
        assert got == ({1}, 1)
        assert os.sched_getaffinity(0) == before
    finally:
        torch.set_num_threads(threads)


def test_one_node_is_a_noop_and_a_missing_node_an_error(tmp_path, monkeypatch, caplog):
    from ferrylm.hw.cpu_binding import node_cpus

    _fake_nodes(tmp_path, monkeypatch, {0: "0-1"})
    with caplog.at_level(logging.WARNING):
        assert node_cpus(0) is None
    assert "one NUMA node" in caplog.text
    with pytest.raises(ConfigError, match="--cpu-numa-node 3: no such NUMA node"):
        node_cpus(3)


def test_host_tier_binds_its_memory():
    """The host tier's tensors are mbind-ed to the node before first touch (read back with get_mempolicy);
    node 0 exists on every Linux machine, so the real system call runs."""
    from ferrylm.hw.cpu_binding import memory_policy
    from ferrylm.offload.host_tier import HostTier

    if not numa_nodes():
        pytest.skip("the kernel reports no NUMA nodes")
    t = HostTier(pin=False, numa_node=0).empty((64, 4096), torch.float32)
    assert memory_policy(t) == (2, 1)  # MPOL_BIND to node 0
    assert memory_policy(HostTier(pin=False).empty((64, 4096), torch.float32)) != (2, 1)
    t.fill_(1.0)
    assert t.sum() == t.numel()
