"""The hybrid decode path's host side: while a (graphed) decode step's fused kernel reads some missed experts
in place over PCIe, one worker thread computes the layer's other missed experts, its CPU-class ones, on
the host's cores where their weights lie. Both sides read host memory at once, so the layer waits for
the slower of the two instead of the sum.

Per layer the stream copies the layer id, the token count, the live row count (a CUDA graph's step is
padded to its batch bucket: `ForwardContext.live_rows`, a device tensor written before each replay, so the
worker computes the real rows only and zeroes the padded ones), the hidden rows, the CPU's assignments (ids,
-1 where the GPU computes) and the routing weights into pinned buffers, then hands off to the worker
(`offload/host_node.py`: a host node, captured into graphs), runs its own kernel, and waits; the worker
writes its weighted rows (`offload/host_experts.HostExperts.rows`, zero where the GPU computes) and
releases the stream, which copies them back and adds them to its rows. One set of buffers serves every
layer: layer l+1's copies are ordered after layer l's rows went back. A worker error is kept and raised
by `check()` after the step (the stream is always released, with zero rows).

`gpu_side`: how the GPU gets the misses the host does not take. "inplace": the fused kernel reads them
over PCIe through the address table, between the hand-off and the wait. "copy": the worker (an ordinary
thread, so it may call CUDA) copies them with the copy engine into `scratch` slots on its own stream,
writes `remap` (expert -> scratch slot, or the skip id), then computes its own experts and releases the
stream once the copies have landed; the stream computes the slot hits between hand-off and wait and the
scratch experts after it. Copy-engine DMA and CPU reads share host memory better than in-place reads,
which are latency-bound (measure: `benchmarks/bench_hybrid_overlap.py`). Scratch holds the experts of one
layer's step (k x tokens, large experts only: decode at one token); layer l+1's copies are ordered after
layer l's scratch kernel, since the worker only starts on l+1 when the stream has passed it.

The time the stream waits for the worker (`stats.cpu_wait_s`, graphed steps too) is measured on the device:
a pair of timing events per layer around the wait (event record nodes inside graphs), read by `check()`
once the worker has served that layer and the stream has passed it. Under async scheduling a pair may be
re-recorded by the next step before it is read; the figure is then that step's.
It knows nothing about slots, tables or routing tallies.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque

import torch

from ferrylm.layers.fused_moe import ExpertWeights
from ferrylm.offload.host_experts import HostExperts
from ferrylm.offload.host_node import HostHandoff


def _empty(side, n: int, device) -> object:
    """n uninitialised device slots shaped like a host bank side (dense, or packed `ExpertWeights`)."""
    if isinstance(side, ExpertWeights):
        return side.empty_like(n, device)
    return torch.empty((n, *side.shape[1:]), dtype=side.dtype, device=device)


def _copy_into(dst, j: int, src, e: int) -> None:
    if isinstance(dst, ExpertWeights):
        dst.copy_expert_(j, src, e, non_blocking=True)
    else:
        dst[j].copy_(src[e], non_blocking=True)


class HostDecode:
    gpu_side = "inplace"
    """inplace | copy (see the module docstring); copy applies to one-token decode (large experts)."""

    def __init__(self, experts: dict[int, HostExperts], max_tokens: int, k: int, hidden: int,
                 dtype: torch.dtype, stats, device: torch.device | None = None):
        self.experts, self.stats = experts, stats
        self.copies = self.gpu_side == "copy" and max_tokens == 1 and device is not None
        self.device = device
        if self.copies:
            first = next(iter(experts.values()))
            E, S = first.w13.shape[0], min(k * max_tokens, first.w13.shape[0])
            # the worker thread selects it: an index, not "cuda" (the engine thread's current device then)
            self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
            self.scratch13, self.scratch2 = _empty(first.w13, S, device), _empty(first.w2, S, device)
            self.copy_ids = torch.empty(max_tokens, k, dtype=torch.long).pin_memory()
            self.remap_pin = torch.full((E,), S, dtype=torch.long).pin_memory()
            self.remap = torch.full((E,), S, dtype=torch.long, device=device)  # expert -> scratch slot | S (skip)
            self.copy_stream = torch.cuda.Stream(device)
        self.hand = HostHandoff()
        self.meta = torch.zeros(4, dtype=torch.long).pin_memory()  # layer, tokens, live tokens, first host column
        self.x = torch.empty(max_tokens, hidden, dtype=dtype).pin_memory()
        self.ids = torch.empty(max_tokens, k, dtype=torch.long).pin_memory()
        self.w = torch.empty(max_tokens, k, dtype=torch.float32).pin_memory()
        self.out = torch.empty(max_tokens * k, hidden, dtype=dtype).pin_memory()
        self.max_tokens, self.k = max_tokens, k
        self.error: BaseException | None = None
        self.served: deque[int] = deque()  # layers the worker served whose wait is not read yet
        self.waits: dict[int, tuple] = {}  # layer -> (event before the wait, event after it)
        if device is not None and device.type == "cuda":
            for layer in experts:
                self.waits[layer] = tuple(torch.cuda.Event(enable_timing=True, external=True) for _ in range(2))
        # the thread holds only a weak reference between hand-offs: a dropped engine frees its host bank,
        # and the finalizer wakes the thread to end
        self.thread = threading.Thread(target=_worker, args=(weakref.ref(self), self.hand),
                                       name="ferry-cpu-experts-decode", daemon=True)
        self._finalizer = weakref.finalize(self, _stop, self.hand)
        self.thread.start()

    @staticmethod
    def meta_of(layer: int, T: int, live: torch.Tensor | None, device, cols: int = 0) -> torch.Tensor:
        """[4] long on `device`: layer, T, live rows (`live` [1], read when the stream runs; None: T), the
        first host column. Fill kernels and a device copy: graph-capturable, so a replay hands over the
        replayed step's count."""
        meta = torch.full((4,), T, dtype=torch.long, device=device)
        meta[:1].fill_(layer)
        meta[3:].fill_(cols)
        if live is not None:
            meta[2:3].copy_(live)
        return meta

    def send(self, layer: int, x: torch.Tensor, cpu_ids: torch.Tensor, weights: torch.Tensor,
             copy_ids: torch.Tensor | None = None, cols: int = 0, live: torch.Tensor | None = None) -> None:
        """Enqueue the layer's hand-off: x [T, H], cpu_ids [T, k] (-1: the GPU's), weights [T, k]; with
        `copies`, copy_ids [T, k]: the experts the worker copies into scratch (-1: none); `cols` > 0: the
        host computes only the intermediate columns [cols, I) of its experts (`HostExperts.rows`); `live` [1]
        long: the real rows of a padded step (the first ones; None: all T)."""
        T = x.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"host decode buffers hold {self.max_tokens} tokens, step has {T}")
        self.meta.copy_(self.meta_of(layer, T, live, x.device, cols), non_blocking=True)
        self.x[:T].copy_(x, non_blocking=True)
        self.ids[:T].copy_(cpu_ids, non_blocking=True)
        self.w[:T].copy_(weights.float(), non_blocking=True)
        if self.copies:
            self.copy_ids[:T].copy_(copy_ids, non_blocking=True)
        self.hand.post(torch.cuda.current_stream(x.device))

    def receive(self, rows: int, device: torch.device, layer: int) -> torch.Tensor:
        """Enqueue the wait for the worker on `layer` (timed); -> its rows [rows, H] on the device."""
        stream = torch.cuda.current_stream(device)
        pair = self.waits.get(layer)
        if pair is not None:
            pair[0].record(stream)
        self.hand.wait(stream)
        if pair is not None:
            pair[1].record(stream)
        return self.out[:rows].to(device, non_blocking=True)

    def round_trip_s(self, layer: int, cases: list[tuple], reps: int = 15) -> list[float]:
        """Device-visible seconds of one hand-off of a one-token step on `layer` (send, the worker's serve, the
        rows back) for each case (expert, cols) or (expert, cols, setup): the host computing `expert` on its
        columns [cols, I) (`HostExperts.rows`; None: nothing) after `setup()` where given (a host GEMM path),
        the device idle between, the worker copying nothing (`copies`).
        The cases run interleaved, one of each per round, so a burst of other work on the host lands on all of
        them alike; each figure is the median of `reps` rounds after one warm-up round (which builds the
        experts' host kernels). What the cost model's `handoff_s` and `call_s` are measured by; the stats it
        touches are reset after."""
        dev = self.device
        x = torch.zeros(1, self.x.shape[1], dtype=self.x.dtype, device=dev)
        none = torch.full((1, self.k), -1, dtype=torch.long, device=dev)
        w = torch.ones(1, self.k, device=dev)
        stream = torch.cuda.current_stream(dev)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times: list[list[float]] = [[] for _ in cases]
        for _ in range(reps + 1):
            for case, got in zip(cases, times):
                expert, cols, *setup = case
                if setup and setup[0] is not None:
                    setup[0]()
                ids = none.clone()
                if expert is not None:
                    ids[0, 0] = expert
                begin.record(stream)
                self.send(layer, x, ids, w, none if self.copies else None, cols=cols)
                self.receive(self.k, dev, layer)
                end.record(stream)
                end.synchronize()
                got.append(begin.elapsed_time(end) / 1e3)
        self.check()
        self.stats.reset()
        return [sorted(t[1:])[reps // 2] for t in times]

    def _read_waits(self) -> None:
        """Add the waits of the layers served since the last call whose after-event has completed."""
        later = []
        while self.served:
            layer = self.served.popleft()
            pair = self.waits.get(layer)
            if pair is None:
                continue
            if not pair[1].query():
                later.append(layer)
                continue
            try:
                self.stats.add(cpu_wait_s=pair[0].elapsed_time(pair[1]) / 1e3)
            except (RuntimeError, ValueError):  # never recorded (torch raises ValueError): nothing to add
                pass
        self.served.extendleft(reversed(later))

    def _copy_in(self, layer: int, T: int) -> None:
        """Issue the copies of the layer's scratch experts and of `remap` on the copy stream."""
        ids = self.copy_ids[:T].flatten()
        need = torch.unique(ids[ids >= 0]).tolist()
        S = self.scratch13.shape[0]
        if len(need) > S:
            raise RuntimeError(f"layer {layer}: {len(need)} experts to copy, scratch holds {S}")
        bank = self.experts[layer]
        self.remap_pin.fill_(S)
        with torch.cuda.stream(self.copy_stream):
            for j, e in enumerate(need):
                _copy_into(self.scratch13, j, bank.w13, e)
                _copy_into(self.scratch2, j, bank.w2, e)
                bank.arrived(self.scratch13, j, e)  # a host-laid int4 expert: back to the store's layout
                bank.arrived(self.scratch2, j, e)
                self.remap_pin[e] = j
            self.remap.copy_(self.remap_pin, non_blocking=True)

    def _serve(self) -> None:
        """One hand-off: the layer's host rows (and, with `copies`, its scratch copies)."""
        t = time.perf_counter()
        try:
            layer, T, n, cols = self.meta.tolist()
            self.served.append(layer)  # before `done`: a step that passed its wait finds its layers here
            n = max(0, min(n, T))  # padded rows [n, T) get zeros: the device drops them
            if self.copies:  # first: the copy engine runs while the cores compute
                self._copy_in(layer, n)
            self.out[n * self.k:T * self.k].zero_()
            self.stats.add(cpu_experts=self.experts[layer].rows(self.x[:n], self.ids[:n], self.w[:n], self.out, cols))
            if self.copies:
                self.copy_stream.synchronize()
        except BaseException as e:  # the stream must still be released; the step fails in check()
            self.error = self.error or e
            self.out.zero_()
            if self.copies:
                try:  # on the copy stream, waited for: the scratch kernel after the wait reads no stale remap
                    with torch.cuda.stream(self.copy_stream):
                        self.remap.fill_(self.scratch13.shape[0])
                    self.copy_stream.synchronize()
                except BaseException:  # the device is failing; the step fails in check() all the same
                    pass
        finally:
            self.stats.add(cpu_busy_s=time.perf_counter() - t)

    def check(self) -> None:
        """After a step: count the device's waits read so far; raise what the worker hit."""
        self._read_waits()
        if self.error is not None:
            e, self.error = self.error, None
            raise RuntimeError(f"host expert worker failed: {e!r}") from e

    @property
    def closed(self) -> bool:
        return self.hand.closed

    def close(self) -> None:
        """After the queued work: the worker answers one last hand-off and ends (a stream still holding
        hand-offs would wait for good, so the device is drained first)."""
        if not self.closed:
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self._finalizer()
            self.thread.join(timeout=5)


def _stop(hand: HostHandoff) -> None:
    hand.closed = True
    hand.start.post()


def _worker(ref, hand: HostHandoff) -> None:
    first = ref()
    if first is not None and first.copies:
        torch.cuda.set_device(first.device)
    del first
    while True:
        hand.take()
        me = None if hand.closed else ref()
        if me is None:  # closed, or the engine is gone
            hand.done()
            return
        try:
            with torch.inference_mode():  # per thread; the hand-off buffers may be inference tensors
                me._serve()
        except BaseException as e:  # the worker must live on: a stream waiting on it would hang for good
            me.error = me.error or e
        finally:
            del me
            hand.done()
