"""Small host values to the device without stalling the stream: `torch.tensor(values).to("cuda")` copies from
pageable memory, and torch's blocking copy then synchronizes the whole stream (every kernel and copy queued
before it), so the host cannot run ahead of the device. A pinned copy with `non_blocking` does not wait; torch's
caching host allocator keeps the pinned block until the copy has landed. (A copy-path prefill of 8 NF4
Mixtral layers on the H100 held the host 54 ms of its 120 ms in 128 such syncs, one a grouped GEMM's offsets:
session 27's trace.) Knows nothing about models or the engine; `engine/staging.py` does a step's inputs."""

from __future__ import annotations

import torch


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list (long unless `dtype` says) or host tensor (its own dtype unless `dtype` says) as a tensor
    on `device`, through pinned memory on CUDA: no stream sync."""
    if isinstance(values, torch.Tensor):
        t = values if dtype is None or values.dtype == dtype else values.to(dtype)
    else:
        t = torch.tensor(values, dtype=dtype or torch.long)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
