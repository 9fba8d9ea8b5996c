"""Calibration for the hybrid cost model: measured on the machine that runs, cached per machine and shape.

Measures the seconds to copy one expert to the device (pinned host -> device, or a host memcpy for the
CPU engine) and the host's seconds to run one expert on 1, 4, 16 and 64 tokens (the same `expert_mlp`
the CPU path runs). The result is cached in `$FERRYLM_CACHE_DIR` (default `~/.cache/ferrylm`)
under a key of the machine (CPU model, cores, threads, GPU, torch version) and the expert's shape and
dtype; a different machine or shape measures again. A corrupt cache file is ignored with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time

import torch

from ferrylm.layers.moe import expert_mlp
from ferrylm.offload.cost_model import Costs

log = logging.getLogger(__name__)
TOKENS = (1, 4, 16, 64)


def cache_dir() -> str:
    return os.environ.get("FERRYLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ferrylm")


def machine_key(device: torch.device) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "gpu": gpu,
            "torch": torch.__version__}


def _timeit(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def measure(host_w13: torch.Tensor, host_w2: torch.Tensor, act, device: torch.device) -> dict:
    w13, w2 = host_w13[0], host_w2[0]
    nbytes = w13.numel() * w13.element_size() + w2.numel() * w2.element_size()
    if device.type == "cuda":
        dst13, dst2 = torch.empty_like(w13, device=device), torch.empty_like(w2, device=device)

        def copy():
            dst13.copy_(w13, non_blocking=True)
            dst2.copy_(w2, non_blocking=True)
            torch.cuda.synchronize(device)
    else:
        dst13, dst2 = torch.empty_like(w13), torch.empty_like(w2)

        def copy():
            dst13.copy_(w13)
            dst2.copy_(w2)
    copy_s = _timeit(copy)
    cpu = {}
    for n in TOKENS:
        x = torch.randn(n, w13.shape[1], dtype=w13.dtype)
        cpu[str(n)] = _timeit(lambda: expert_mlp(x, w13, w2, act))
    return {"copy_s": copy_s, "expert_bytes": nbytes, "cpu_s": cpu}


def costs_from(m: dict) -> Costs:
    pts = sorted((int(n), s) for n, s in m["cpu_s"].items())

    def cpu_s(n: int) -> float:  # piecewise linear in tokens, extrapolated from the last two points
        for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
            if n <= n1:
                return s0 + (s1 - s0) * max(n - n0, 0) / (n1 - n0)
        (n0, s0), (n1, s1) = pts[-2], pts[-1]
        return s1 + (s1 - s0) * (n - n1) / (n1 - n0)

    return Costs(m["copy_s"], cpu_s)


def calibrate(host_w13: torch.Tensor, host_w2: torch.Tensor, act, device: torch.device) -> tuple[Costs, dict]:
    """Costs for this machine and expert shape, from the cache file when it matches, else measured."""
    key = {**machine_key(device), "shape": [list(host_w13.shape[1:]), list(host_w2.shape[1:])],
           "dtype": str(host_w13.dtype)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), f"calibration-{digest}.json")
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("key") == key:
            return costs_from(data["measured"]), data["measured"]
        log.warning("calibration cache %s was made on another machine or shape: measuring again", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("calibration cache %s is unreadable (%s): measuring again", path, e)
    measured = measure(host_w13, host_w2, act, device)
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir(), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "measured": measured}, f, indent=1)
        os.replace(tmp, path)  # temp-then-rename: never a half-written cache
    except OSError as e:
        log.warning("cannot write the calibration cache %s (%s)", path, e)
    log.info("calibrated: expert copy %.2f ms, CPU expert %s ms", measured["copy_s"] * 1e3,
             {n: round(s * 1e3, 2) for n, s in measured["cpu_s"].items()})
    return costs_from(measured), measured
