"""The pinned host tier: host memory for weights that live off the device, page-locked for async copies.

torch's pinned allocator rounds every request up to a power of two (a 2.8 GB expert bank would take
4 GB), so the tier allocates plain host tensors and registers them with `cudaHostRegister` in pieces of
at most `piece_bytes` (large registrations fail on some kernels and drivers). When registration fails the
tensor stays pageable and copies from it are synchronous: a warning says so once. Without CUDA (the CPU
engine, CI) tensors are plain host memory and the copy path still runs.

Registrations are mapped (`cudaHostRegisterMapped`): under unified addressing the host address is also a
device address, so a kernel can read a registered tensor in place over PCIe (`is_mapped`; the expert
cache's decode path does).

With `numa_node` (`--cpu-numa-node`, where the machine has several nodes) every tensor's pages are bound
to that node (mbind) before anything touches or pins them, so the host experts read local memory.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_PORTABLE, _MAPPED = 1, 2  # cudaHostRegisterPortable, cudaHostRegisterMapped


class HostTier:
    def __init__(self, pin: bool, piece_bytes: int = 1 << 30, numa_node: int | None = None,
                 device: torch.device | None = None):
        self.pin = pin and torch.cuda.is_available()
        self.device = device  # the GPU whose kernels and copies read the registered memory
        self.numa_node = numa_node
        """Bind every tensor's pages to this NUMA node before they are touched or pinned (None: no binding)."""
        self._numa_warned = False
        self.piece_bytes = piece_bytes
        self.registered: list[int] = []
        self.pinned_bytes = self.pageable_bytes = 0
        self._warned = False
        self._held: list[torch.Tensor] = []  # registered memory must outlive its registration
        self._mapped: set[int] = set()  # data_ptr of tensors registered whole

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if not self.pin or nbytes == 0:
            self.pageable_bytes += nbytes
            t = torch.empty(shape, dtype=dtype)
            self._bind(t)
            return t
        # whole pages of our own: a registration must not overlap another tensor's page
        span = (nbytes + 4095) // 4096 * 4096
        shape = tuple(shape)
        raw = torch.empty(span + 4096, dtype=torch.uint8)
        self._bind(raw)  # before registration faults the pages in
        off = -raw.data_ptr() % 4096
        t = raw[off:off + nbytes].view(dtype).view(shape)
        self._held.append(raw)
        cudart = torch.cuda.cudart()
        # a copy must not span two registrations: pieces hold whole rows of dim 0 (one expert of a bank)
        # and start on a page; otherwise the tensor is registered whole
        row = nbytes // shape[0] if len(shape) > 1 and shape[0] else span
        ptr, nbytes = t.data_ptr(), span
        piece = max(1, self.piece_bytes // row) * row if row % 4096 == 0 else nbytes
        done = 0
        while done < nbytes:
            n = min(piece, nbytes - done)
            err = cudart.cudaHostRegister(ptr + done, n, _PORTABLE | _MAPPED)
            if int(err) != 0:
                torch.cuda.synchronize()  # clear the sticky-free error state of the failed call
                if not self._warned:
                    log.warning("pinning host memory failed (cudaHostRegister error %s after %.2f GiB pinned): "
                                "remaining host weights are pageable and their copies synchronous",
                                int(err), self.pinned_bytes / 2**30)
                    self._warned = True
                self.pin = False
                self.pageable_bytes += nbytes - done
                break
            self.registered.append(ptr + done)
            self.pinned_bytes += n
            done += n
        if done >= nbytes:
            self._mapped.add(t.data_ptr())
        return t

    def _bind(self, t: torch.Tensor) -> None:
        from ferrylm.hw.cpu_binding import bind_memory

        if self.numa_node is not None and not bind_memory(t, self.numa_node) and not self._numa_warned:
            log.warning("could not bind host weights to NUMA node %d (mbind failed): they stay where the "
                        "kernel puts them", self.numa_node)
            self._numa_warned = True

    def is_mapped(self, t: torch.Tensor) -> bool:
        """Whether all of `t` (a tensor this tier handed out) is registered, so a kernel may read it in place."""
        return t.data_ptr() in self._mapped

    def close(self) -> None:
        if self.registered:
            torch.cuda.synchronize(self.device)  # no kernel or copy may still read a page it unregisters
            cudart = torch.cuda.cudart()
            for ptr in self.registered:
                cudart.cudaHostUnregister(ptr)
            self.registered.clear()
        self._mapped.clear()
        self._held.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
