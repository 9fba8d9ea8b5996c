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


def test_bad_values_are_clear_errors():
    with pytest.raises(ConfigError, match="no such NUMA node"):
        bind_cpu(numa_node=999)
    with pytest.raises(ConfigError, match="threads must be >= 1"):
        bind_cpu(threads=0)
    r = subprocess.run([sys.executable, "-m", "ferrylm.cli", "generate", "hi", "--numa-node", "999"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no such NUMA node" in r.stderr and "Traceback" not in r.stderr
