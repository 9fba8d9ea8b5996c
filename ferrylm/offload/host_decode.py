"""The hybrid decode path's host side: while a (graphed) decode step's fused kernel reads some missed experts
in place over PCIe, one worker thread computes the layer's other missed experts, its CPU-class ones, on
the host's cores where their weights lie. Both sides read host memory at once, so the layer waits for
the slower of the two instead of the sum.

Per layer the stream copies the layer id, the token count, the hidden rows, the CPU's assignments (ids,
-1 where the GPU computes) and the routing weights into pinned buffers, then hands off to the worker
(`offload/host_node.py`: a host node, captured into graphs), runs its own kernel, and waits; the worker
writes its weighted rows (`offload/host_experts.HostExperts.rows`, zero where the GPU computes) and
releases the stream, which copies them back and adds them to its rows. One set of buffers serves every
layer: layer l+1's copies are ordered after layer l's rows went back. A worker error is kept and raised
by `check()` after the step (the stream is always released, with zero rows).
It knows nothing about slots, tables or routing tallies.
"""

from __future__ import annotations

import threading
import time

import torch

from ferrylm.offload.host_experts import HostExperts
from ferrylm.offload.host_node import HostHandoff


class HostDecode:
    def __init__(self, experts: dict[int, HostExperts], max_tokens: int, k: int, hidden: int,
                 dtype: torch.dtype, stats):
        self.experts, self.stats = experts, stats
        self.hand = HostHandoff()
        self.meta = torch.zeros(2, dtype=torch.long).pin_memory()  # layer, tokens
        self.x = torch.empty(max_tokens, hidden, dtype=dtype).pin_memory()
        self.ids = torch.empty(max_tokens, k, dtype=torch.long).pin_memory()
        self.w = torch.empty(max_tokens, k, dtype=torch.float32).pin_memory()
        self.out = torch.empty(max_tokens * k, hidden, dtype=dtype).pin_memory()
        self.max_tokens = max_tokens
        self.error: BaseException | None = None
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="ferry-cpu-experts-decode", daemon=True)
        self.thread.start()

    def send(self, layer: int, x: torch.Tensor, cpu_ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Enqueue the layer's hand-off: x [T, H], cpu_ids [T, k] (-1: the GPU's), weights [T, k]."""
        T = x.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"host decode buffers hold {self.max_tokens} tokens, step has {T}")
        meta = torch.full((2,), T, dtype=torch.long, device=x.device)  # fill kernels: graph-capturable
        meta[:1].fill_(layer)
        self.meta.copy_(meta, non_blocking=True)
        self.x[:T].copy_(x, non_blocking=True)
        self.ids[:T].copy_(cpu_ids, non_blocking=True)
        self.w[:T].copy_(weights.float(), non_blocking=True)
        self.hand.post(torch.cuda.current_stream(x.device))

    def receive(self, rows: int, device: torch.device) -> torch.Tensor:
        """Enqueue the wait for the worker; -> its rows [rows, H] on the device (stream-ordered)."""
        self.hand.wait(torch.cuda.current_stream(device))
        return self.out[:rows].to(device, non_blocking=True)

    def _run(self) -> None:
        while True:
            self.hand.take()
            if self.closed:
                self.hand.done()
                return
            t = time.perf_counter()
            try:
                layer, T = self.meta.tolist()
                self.stats.cpu_experts += self.experts[layer].rows(self.x[:T], self.ids[:T], self.w[:T], self.out)
            except BaseException as e:  # the stream must still be released; the step fails in check()
                self.error = self.error or e
                self.out.zero_()
            finally:
                self.stats.cpu_busy_s += time.perf_counter() - t
                self.hand.done()

    def check(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise RuntimeError(f"host expert worker failed: {e!r}") from e

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.hand.start.post()
            self.thread.join(timeout=5)
