"""Parameter storage on first write: models are built on the `meta` device and each parameter gets its
memory when the loader first writes it, where the allocator says (the offload placement puts it on the
device or in pinned host memory). So a model is never materialised twice, and a weight that arrives
quantized never gets a dense copy. Without an allocator, storage is plain CPU memory.

A meta parameter cannot take real storage in place, so it is replaced by a new `Parameter` in every
module that holds it (a tied LM head and embedding stay one tensor).
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from torch import nn


class Allocator(Protocol):
    def placed_device(self, module: nn.Module, attr: str) -> torch.device:
        """Where `module.<attr>` is placed."""

    def allocate(self, module: nn.Module, attr: str) -> torch.Tensor:
        """An empty tensor of the parameter's shape and dtype, where it is placed."""

    def allocate_like(self, module: nn.Module, attr: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor of another shape and dtype (a packed part of the parameter), where it is placed."""


_allocator: Allocator | None = None
_holders: dict[int, list[tuple[nn.Module, str]]] = {}


@contextlib.contextmanager
def materializing(model: nn.Module, allocator: Allocator | None = None):
    """While loading `model`: meta parameters written through `writable` get storage from `allocator`."""
    global _allocator, _holders
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for attr, p in mod._parameters.items():
            if p is not None and p.is_meta:
                holders.setdefault(id(p), []).append((mod, attr))
    prev = _allocator, _holders
    _allocator, _holders = allocator, holders
    try:
        yield
    finally:
        _allocator, _holders = prev


def writable(module: nn.Module, attr: str) -> torch.Tensor:
    """`module.<attr>`'s storage, allocated now if it is still on meta."""
    p = getattr(module, attr)
    if not p.is_meta:
        return p.data
    return replace(module, attr, _allocator.allocate(module, attr) if _allocator
                   else torch.empty(p.shape, dtype=p.dtype))


def replace(module: nn.Module, attr: str, t: torch.Tensor) -> torch.Tensor:
    """Give `module.<attr>` the storage `t` (a new Parameter in every module holding the old one)."""
    p = getattr(module, attr)
    if not p.is_meta:
        p.data = t
        return t
    new = nn.Parameter(t, requires_grad=False)
    for mod, a in _holders.get(id(p), [(module, attr)]):
        mod._parameters[a] = new
    return new.data


def device_for(module: nn.Module, attr: str) -> torch.device:
    """Where `module.<attr>` lives or will live (a packed weight is placed there instead)."""
    p = getattr(module, attr)
    if not p.is_meta:
        return p.device
    if _allocator is None:
        return torch.device("cpu")
    return _allocator.placed_device(module, attr)


def placed_empty(module: nn.Module, attr: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """Storage for a packed part of `module.<attr>` (its codes or scales), where the parameter is placed."""
    if _allocator is None:
        return torch.empty(shape, dtype=dtype)
    return _allocator.allocate_like(module, attr, shape, dtype)


def compute_device() -> torch.device:
    """The device the loading engine computes on (the allocator's; CPU without one)."""
    return getattr(_allocator, "device", None) or torch.device("cpu")
