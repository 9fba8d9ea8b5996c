"""Streamed dense layers: weights of layers that are not resident live in (pinned) host memory and are
copied into a ring of device buffers one layer ahead of the compute, on their own stream.

Each streamed layer's parameters are permanently views into buffer `rank % n` (rank: its position among
the streamed layers), so a module never learns that its weights move. After layer i is enqueued its
buffer's "free" event is recorded and the next streamed layer (cyclically: the last one prefetches the
first for the next step) starts copying into its own buffer once that buffer's previous user finished.
Before layer i runs, the compute stream waits for i's "ready" event. On the CPU engine the copies are
plain synchronous copies: the same bookkeeping runs in CI.
"""

from __future__ import annotations

import torch

ALIGN = 256


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class LayerStreamer:
    def __init__(self, layers: dict[int, list[tuple[object, torch.Tensor]]], num_buffers: int,
                 device: torch.device, copy_stream, stats):
        """layers: layer index -> [(point, host tensor)]: `point(view)` re-points whatever held the host tensor
        (a parameter's data, a packed weight's part) at its view in the layer's device buffer."""
        self.order = sorted(layers)
        self.rank = {layer: r for r, layer in enumerate(self.order)}
        self.host = layers
        self.device, self.stream, self.stats = device, copy_stream, stats
        n = min(num_buffers, len(self.order))
        size = max(sum((_nbytes(h) + ALIGN - 1) // ALIGN * ALIGN for _, h in ps) for ps in layers.values())
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(n)]
        self.bytes = n * size
        self.targets: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for layer in self.order:
            buf, off, pairs = self.buffers[self.rank[layer] % n], 0, []
            for point, h in layers[layer]:
                view = buf[off:off + _nbytes(h)].view(h.dtype).view(h.shape)
                point(view)
                pairs.append((view, h))
                off += (_nbytes(h) + ALIGN - 1) // ALIGN * ALIGN
            self.targets[layer] = pairs
        self.layer_bytes = {layer: sum(_nbytes(h) for _, h in ps) for layer, ps in layers.items()}
        cuda = device.type == "cuda"
        self.ready = {layer: torch.cuda.Event() for layer in self.order} if cuda else {}
        self.free = [torch.cuda.Event() for _ in self.buffers] if cuda else []
        self.issued: set[int] = set()

    def _issue(self, layer: int) -> None:
        b = self.rank[layer] % len(self.buffers)
        if self.stream is None:
            for dst, src in self.targets[layer]:
                dst.copy_(src)
        else:
            self.stream.wait_event(self.free[b])  # the buffer's previous layer has finished computing
            with torch.cuda.stream(self.stream):
                for dst, src in self.targets[layer]:
                    dst.copy_(src, non_blocking=True)
                self.ready[layer].record(self.stream)
        self.issued.add(layer)
        self.stats.h2d_bytes += self.layer_bytes[layer]

    def before_layer(self, layer: int) -> None:
        if layer not in self.rank:
            return
        if layer not in self.issued:  # first step, or the prefetch chain was broken
            self._issue(layer)
        self.issued.discard(layer)
        if self.stream is not None:
            self.stats.wait(torch.cuda.current_stream(self.device), self.ready[layer])

    def after_layer(self, layer: int) -> None:
        if layer not in self.rank:
            return
        if self.stream is not None:
            self.free[self.rank[layer] % len(self.buffers)].record(torch.cuda.current_stream(self.device))
        nxt = self.order[(self.rank[layer] + 1) % len(self.order)]
        if nxt not in self.issued and (len(self.order) > 1 or self.stream is not None):
            self._issue(nxt)
