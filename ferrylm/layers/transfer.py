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
    on `device`, through pinned memory on CUDA: no stream sync. A tensor already on `device` comes back as it is (or
    converted). A host tensor that is already pinned is copied from as it is: the caller must not change it until
    the copy has run (a fresh tensor, as every caller passes, never is)."""
    if isinstance(values, torch.Tensor):
        t = values if dtype is None or values.dtype == dtype else values.to(dtype)
        if t.device == device or t.device.type != "cpu":
            return t.to(device)
    else:
        t = torch.tensor(values, dtype=dtype or torch.long)
    if device.type != "cuda":
        return t
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
