"""Staging: a step's host <-> device traffic in one copy each way, never blocking the host.

Up: a step's integer inputs (ids, positions, slots, block tables, lengths, rows) are packed into one
pinned host tensor and cross in one non-blocking copy; the device tensors are views of its device copy.
Down: the sampled ids (and logprob tensors, when asked) are copied into pinned host memory behind a CUDA
event, so the host reads them when it needs them (one step later with async scheduling) instead of
blocking on `.tolist()` while the GPU still has work queued.

Pinned buffers come from torch's caching host allocator (`pin_memory()`, `torch.empty(pin_memory=True)`):
it records each non-blocking copy's stream and hands a block out again only once that copy has finished,
so a buffer is never overwritten while in flight, and no ring of buffers needs managing here.
On the CPU there is nothing to copy: the views are of one host tensor and a download is the tensors.
Knows nothing about sequences, scheduling or sampling.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import torch


def upload(parts: Sequence[Iterable[int]], device: torch.device) -> list[torch.Tensor]:
    """Each iterable of ints as a 1-D long tensor on `device`, all through one host -> device copy."""
    buf, sizes = array("q"), []
    for p in parts:
        n = len(buf)
        buf.extend(p)
        sizes.append(len(buf) - n)
    flat = torch.frombuffer(buf, dtype=torch.long) if buf else torch.empty(0, dtype=torch.long)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)  # [sum of lengths]
    return list(flat.split(sizes))


class Download:
    """Host copies of device tensors, in flight until `wait()`."""

    __slots__ = ("_tensors", "_event")

    def __init__(self, tensors: list[torch.Tensor], event: torch.cuda.Event | None):
        self._tensors, self._event = tensors, event

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> list[torch.Tensor]:
        """The host tensors, once the copy has landed (blocks on the event only, not on the whole device)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._tensors


def download(tensors: list[torch.Tensor]) -> Download:
    """Start copying device tensors to pinned host memory on the current stream; CPU tensors pass through."""
    if not tensors or tensors[0].device.type != "cuda":
        return Download(list(tensors), None)
    host = []
    for t in tensors:  # a pageable destination would make the copy wait for the device: pin it
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)
        host.append(h)
    event = torch.cuda.Event(blocking=True)  # its waiter sleeps: a spinning core would slow the host's work
    event.record()
    return Download(host, event)
