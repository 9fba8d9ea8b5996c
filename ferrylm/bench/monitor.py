"""`Monitor`: samples a server during a soak: resident memory of its process tree (psutil, when the server
runs on this machine), GPU memory (NVML via nvidia-ml-py, when installed and a GPU is present), the
Prometheus gauges of GET /metrics, and GET /health.

The process tree counts, not just the pid: vLLM runs its engine in a child process. /metrics is read by
suffix, so vLLM (`vllm:`), ferrylm (`ferry:`) and llama.cpp (`llamacpp:`, when started with --metrics)
names all land on the same keys; `process_resident_memory_bytes` is the server's own RSS where its registry
exports it (vLLM does). A sample never raises: what cannot be read is None.
"""

from __future__ import annotations

import time
from urllib.parse import urlparse

import httpx
import psutil

_LOCAL = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
_GAUGES = {  # sample key -> metric name suffixes, first found wins
    "running": ("num_requests_running", "requests_processing"),
    "waiting": ("num_requests_waiting", "requests_deferred"),
    "kv_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc", "kv_cache_usage_ratio"),
    "server_rss": ("process_resident_memory_bytes",),
}


def find_pid(url: str) -> int | None:
    """The process listening on a local URL's port, if this user may see it."""
    u = urlparse(url)
    if u.hostname not in _LOCAL:
        return None
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except (psutil.AccessDenied, PermissionError, OSError):
        pass
    return None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> metric name -> sum over its label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        # `name{labels} value [timestamp]`; label values may hold spaces, so split at the closing brace
        if "}" in line:
            head, rest = line.rsplit("}", 1)
            name = head.split("{", 1)[0].strip()
        else:
            name, _, rest = line.partition(" ")
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


class _Nvml:
    def __init__(self):
        self.nv = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - no library, no driver, no GPU: GPU memory is simply not sampled
            self.nv = None

    def sample(self, pids: set[int]) -> tuple[float | None, float | None]:
        """(memory used on all GPUs, memory used by these pids) in bytes."""
        if self.nv is None:
            return None, None
        try:
            used = sum(self.nv.nvmlDeviceGetMemoryInfo(h).used for h in self.handles)
            mine = None
            if pids:
                procs = [p for h in self.handles for p in self.nv.nvmlDeviceGetComputeRunningProcesses(h)]
                mine = sum(p.usedGpuMemory or 0 for p in procs if p.pid in pids)
            return float(used), (float(mine) if mine is not None else None)
        except Exception:  # noqa: BLE001
            return None, None


class Monitor:
    def __init__(self, http: httpx.AsyncClient, pid: int | None):
        self.http, self.pid = http, pid
        self.nvml = _Nvml()

    @property
    def gpu_available(self) -> bool:
        return self.nvml.nv is not None

    def _tree(self) -> tuple[float | None, set[int]]:
        if self.pid is None:
            return None, set()
        try:
            p = psutil.Process(self.pid)
            procs = [p] + p.children(recursive=True)
            rss, pids = 0, set()
            for q in procs:
                try:
                    rss += q.memory_info().rss
                    pids.add(q.pid)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            return float(rss), pids
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None, set()

    async def sample(self, t: float) -> dict:
        rss, pids = self._tree()
        gpu_used, gpu_proc = self.nvml.sample(pids)
        s = {"t": t, "time": time.time(), "rss": rss, "process_alive": bool(pids) if self.pid else None,
             "gpu_used": gpu_used, "gpu_proc": gpu_proc, "health": None}
        try:
            s["health"] = (await self.http.get("/health", timeout=10)).status_code
        except httpx.HTTPError:
            pass
        try:
            r = await self.http.get("/metrics", timeout=10)
            m = parse_metrics(r.text) if r.status_code == 200 else {}
        except httpx.HTTPError:
            m = {}
        for key, suffixes in _GAUGES.items():
            s[key] = next((v for suf in suffixes for name, v in m.items() if name.endswith(suf)), None)
        return s
