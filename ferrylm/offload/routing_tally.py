"""Routing tally of the mapped expert caches: which experts decode steps use, and which ones earn a slot.

Mapped decode steps (`offload/expert_cache.py`) read misses in place and never stop to look at the
routing, so the slots cannot follow misses as they happen. Instead every mapped step adds its assignments
to one [L, E] device counter; after the step it is copied into a ring of pinned host buffers and zeroed,
and each landed copy is read a step or two late (no sync: one that has not landed waits for the next
step; a full ring skips a step's counts). A decayed score per expert
decides promotions: a layer copies its hottest missing expert into the slot of its coldest resident one
(never a pinned one) when the candidate's score beats `margin` x the victim's + `floor`, at most one copy
in flight per layer. The hysteresis keeps uniform routing from churning the slots (each promotion costs
one expert's bytes over PCIe) while skewed routing pulls its hot experts in within a few steps.

Hit and miss counts come from the same read: an assignment's expert was resident or not when the tally
was read, which can differ from the moment it was computed by the one step of lag.
"""

from __future__ import annotations

import torch


class RoutingTally:
    decay = 0.9
    margin = 2.0
    floor = 1.0
    depth = 4
    per_layer = 2
    """Promotions a layer may have in flight."""

    def __init__(self, caches: dict, device: torch.device, stats):
        self.layers = sorted(caches)
        self.caches = [caches[l] for l in self.layers]
        L, E = len(self.layers), self.caches[0].host_w13.shape[0]
        self.stats, self.device = stats, device
        self.counts = torch.zeros(L, E, dtype=torch.float32, device=device)
        self.ring = torch.zeros(self.depth, L, E, dtype=torch.float32).pin_memory()
        self.pending: list[tuple[int, torch.cuda.Event]] = []  # (ring row, its copy's event), oldest first
        self.next_row = 0
        self.score = torch.zeros(L, E)
        self.resident = torch.zeros(L, E, dtype=torch.bool)
        self.pinned = torch.zeros(L, E, dtype=torch.bool)
        for i, c in enumerate(self.caches):
            c.map(self.resident[i], self.counts[i])
            for e in c.pinned:
                self.pinned[i, e] = True

    def after_step(self) -> None:
        for c in self.caches:
            if c.landing:
                c.land()
        read = False
        while self.pending and self.pending[0][1].query():
            row, _ = self.pending.pop(0)
            counts = self.ring[row].clone()
            self._account(counts)
            self.score.mul_(self.decay).add_(counts)
            read = True
        if read:
            self._promote()
        if len(self.pending) < self.depth:
            row = self.next_row
            self.next_row = (row + 1) % self.depth
            self.ring[row].copy_(self.counts, non_blocking=True)
            self.counts.zero_()
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.pending.append((row, ev))

    def _account(self, counts: torch.Tensor) -> None:
        needed = counts > 0  # [L, E]
        hits = int((needed & self.resident).sum())
        misses = int(needed.sum()) - hits
        self.stats.expert_hits += hits
        self.stats.expert_misses += misses
        on_host = sum(int((needed[i] & ~self.resident[i] & c.cpu_class).sum())
                      for i, c in enumerate(self.caches) if c.cpu_class is not None)
        self.stats.h2d_bytes += (misses - on_host) * self.caches[0].expert_bytes  # read in place over PCIe
        hd = self.caches[0].host_decode
        if hd is not None and hd.copies:  # the host worker copied them into scratch slots
            self.stats.copied_experts += misses - on_host
        else:
            self.stats.mapped_experts += misses - on_host
        for i, c in enumerate(self.caches):
            if c.trace is not None and needed[i].any():
                c.trace.append(needed[i].nonzero().flatten().tolist())
                c.trace_hits += int((needed[i] & self.resident[i]).sum())

    def _promote(self) -> None:
        """Per layer: its hottest missing experts against its coldest evictable residents, pair by pair
        while the candidate wins; an empty slot takes any expert used at all. At most `per_layer` copies
        in flight per layer."""
        inf = float("inf")
        n = self.per_layer
        best, cand = self.score.masked_fill(self.resident, -inf).topk(n, dim=1)  # [L, n], hottest first
        worst, victim = self.score.masked_fill(~self.resident | self.pinned, inf).topk(n, dim=1, largest=False)
        for i in (best[:, 0] > 0).nonzero().flatten().tolist():
            c = self.caches[i]
            busy = {e for e, _ in c.landing}
            j = 0
            for r in range(n):
                e, b = int(cand[i, r]), float(best[i, r])
                if len(c.landing) >= n or b <= 0 or e in busy:
                    break
                if None in c.owner:
                    c.promote(e, None)
                elif j < n and b > self.margin * float(worst[i, j]) + self.floor:  # inf when none is evictable
                    c.promote(e, int(victim[i, j]))
                    j += 1
                else:
                    break
