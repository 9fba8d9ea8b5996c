"""Routing tally of the mapped expert caches: which experts decode steps use, and which ones earn a slot.

Mapped decode steps (`offload/expert_cache.py`) read misses in place and never stop to look at the
routing, so the slots cannot follow misses as they happen. Instead every mapped step adds its assignments
(and those that found their expert in a slot) to one [2, L, E] device counter; after the step it is copied
into a ring of pinned host buffers and zeroed, and each landed copy is read late, without a sync: when
the step's sampled tokens have reached the host (`after_results`: one step late under async scheduling,
at once without it), else at the next step's launch (a full ring skips a step's counts). The decision is
`offload/slot_policy.py`'s (by default `DuelingPolicy`: frequency with hysteresis or recency, per layer,
whichever moved fewer bytes in shadow); a promotion copies an expert into the slot of a resident one
(never a pinned one), and with `land_now` the next step waits for that copy, stream-ordered, and reads the
expert from its slot instead of reading it in place too. `land_now=False` points the table at a slot
only once the host sees its copy landed (the copy then overlaps the next step, which reads the expert in
place meanwhile).

Hit and miss counts are the device's: an assignment hit when its expert's table entry pointed at a slot
as the kernel ran.
"""

from __future__ import annotations

import torch

from ferrylm.offload.slot_policy import DuelingPolicy, PromotionPolicy


class RoutingTally:
    depth = 4
    land_now = True
    """Promotions land stream-ordered: the next step waits for their copies (see the module docstring)."""
    land_on_copy_stream = False
    """Promotions land on the copy stream: it points the table at the slot after the copy, the step's kernels read
    in place until then and nothing waits (`CachedExperts.promote(on_copy_stream=True)`; above `land_now`). Off until
    measured: on the H100 a Qwen3-30B-A3B bf16 batch-1 step ran its promotion copies (2.4 ms) and its kernels
    (5.4 ms) one after the other, never at once (session 27). TODO(issue 8): `benchmarks/profile_offload.py
    --variants dueling:now dueling:stream` on bf16 and fp8."""

    policy_name = "dueling"
    """`DuelingPolicy`, or "frequent": `PromotionPolicy`'s frequency with hysteresis alone (the plain one)."""

    def __init__(self, caches: dict, device: torch.device, stats, policy: str | None = None):
        self.layers = sorted(caches)
        self.caches = [caches[l] for l in self.layers]
        L, E = len(self.layers), self.caches[0].host_w13.shape[0]
        self.stats, self.device = stats, device
        self.counts = torch.zeros(2, L, E, dtype=torch.float32, device=device)  # assignments, hits
        self.ring = torch.zeros(self.depth, 2, L, E, dtype=torch.float32).pin_memory()
        self.pending: list[tuple[int, torch.cuda.Event]] = []  # (ring row, its copy's event), oldest first
        self.next_row = 0
        self.mapped_steps = 0
        """Mapped steps accounted so far (their counts have reached the host)."""
        self.mapped_misses = 0
        """Experts those steps needed and found in no slot, summed over layers."""
        self.resident = torch.zeros(L, E, dtype=torch.bool)
        self.pinned = torch.zeros(L, E, dtype=torch.bool)
        for i, c in enumerate(self.caches):
            c.map(self.resident[i], self.counts[0, i], self.counts[1, i])
            for e in c.pinned:
                self.pinned[i, e] = True
        self.set_policy(policy or self.policy_name)

    def set_policy(self, name: str) -> None:
        """A fresh decision policy by name (between steps; benchmarks switch it on one engine)."""
        L, E = self.resident.shape
        if name == "dueling":
            self.policy = DuelingPolicy(L, E, self.resident, self.pinned, self._empty())
        elif name == "frequent":
            self.policy = PromotionPolicy(L, E)
        else:
            raise ValueError(f"unknown slot policy {name!r} (dueling | frequent)")

    def _empty(self) -> list[int]:
        return [c.owner.count(None) if c.pool is None else 0 for c in self.caches]  # nothing promotes into a pool

    def after_step(self) -> None:
        """Right after a step is queued: land what has landed, read what has arrived, queue this step's counts."""
        for c in self.caches:
            if c.landing:
                c.land()
        self.after_results()
        if any(c.copied_step for c in self.caches):  # a copy-road step: no counts, no decay, no promotions on it
            for c in self.caches:
                c.copied_step = False
            return
        if len(self.pending) < self.depth:
            row = self.next_row
            self.next_row = (row + 1) % self.depth
            self.ring[row].copy_(self.counts, non_blocking=True)
            self.counts.zero_()
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.pending.append((row, ev))

    def after_results(self) -> None:
        """Read the counts that have arrived (in step order) and promote on them."""
        read = False
        while self.pending and self.pending[0][1].query():
            row, _ = self.pending.pop(0)
            counts, hits = self.ring[row].clone()
            self._account(counts, hits)
            self.policy.observe(counts)
            read = True
        if read:
            self._promote()

    def _account(self, counts: torch.Tensor, hits: torch.Tensor) -> None:
        needed, hit = counts > 0, hits > 0  # [L, E]: experts a step used; those it found in a slot
        n_hit = int(hit.sum())
        misses = int(needed.sum()) - n_hit
        self.stats.expert_hits += n_hit
        self.stats.expert_misses += misses
        self.mapped_steps += 1
        self.mapped_misses += misses
        classes = [c.cpu_class for c in self.caches]
        on_host = 0
        if any(cls is not None for cls in classes):  # [L, E]: the host's class of each layer (none: all False)
            host = torch.stack([cls if cls is not None else torch.zeros_like(needed[0]) for cls in classes])
            on_host = int((needed & ~hit & host).sum())
        self.stats.h2d_bytes += (misses - on_host) * self.caches[0].expert_bytes  # read in place over PCIe
        hd = self.caches[0].host_decode
        if hd is not None and hd.copies:  # the host worker copied them into scratch slots
            self.stats.copied_experts += misses - on_host
        else:
            self.stats.mapped_experts += misses - on_host
        for i, c in enumerate(self.caches):
            if c.trace is not None and needed[i].any():
                c.trace.append(needed[i].nonzero().flatten().tolist())
                c.trace_hits += int(hit[i].sum())

    def _promote(self) -> None:
        busy = [{e for e, _ in c.landing} for c in self.caches]
        for i, e, victim in self.policy.choose(self.resident, self.pinned, busy, self._empty()):
            self.caches[i].promote(e, victim, land=self.land_now, on_copy_stream=self.land_on_copy_stream)
