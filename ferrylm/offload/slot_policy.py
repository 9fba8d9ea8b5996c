"""The slot policy of mapped expert caches, and its replay on recorded routing.

Mapped decode steps read misses in place and never stop for the routing, so a layer's slots follow it
from counts that arrive one or two steps late (`offload/routing_tally.py` does the device plumbing).
`PromotionPolicy` is the decision alone, on host tensors: a decayed score per expert; a layer copies its
hottest missing expert into the slot of its coldest evictable resident one when the candidate's score
beats `margin` x the victim's + `floor`, at most `per_layer` copies in flight. Each promotion costs one
expert's bytes over PCIe, on top of the in-place reads of the misses, so the hysteresis is what keeps
uniform routing from paying twice for every expert.

`replay_mapped` runs the same policy over a per-layer trace the way the engine does: counts observed
`lag` steps late, a promotion resident `land_lag` steps after its decision (0: the next step waits for
its copy, stream-ordered), its victim read in place from the next step on; it reports hits and the experts
that crossed PCIe (in-place reads + promotions). It knows nothing of devices or tensors of weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class PromotionPolicy:
    def __init__(self, layers: int, experts: int, decay: float = 0.9, margin: float = 2.0, floor: float = 1.0,
                 per_layer: int = 2):
        self.decay, self.margin, self.floor, self.per_layer = decay, margin, floor, per_layer
        self.score = torch.zeros(layers, experts)  # [L, E]

    def observe(self, counts: torch.Tensor) -> None:
        """One step's assignments per expert ([L, E]), in step order."""
        self.score.mul_(self.decay).add_(counts)

    def choose(self, resident: torch.Tensor, pinned: torch.Tensor, busy: list[set[int]],
               empty: list[int]) -> list[tuple[int, int, int | None]]:
        """(layer row, expert, victim or None for an empty slot) to promote now. resident, pinned: [L, E] bool;
        busy[i]: experts of row i in flight (neither resident nor evictable); empty[i]: its free slots.
        Per row: its hottest missing experts against its coldest evictable residents, pair by pair while the
        candidate wins; an empty slot takes any expert used at all."""
        inf, n = float("inf"), min(self.per_layer, self.score.shape[1])
        best, cand = self.score.masked_fill(resident, -inf).topk(n, dim=1)  # [L, n], hottest first
        rows = (best[:, 0] > 0).nonzero().flatten()
        if not len(rows):
            return []
        worst, victim = self.score[rows].masked_fill(~resident[rows] | pinned[rows], inf).topk(n, dim=1, largest=False)
        # the rows that could promote, as Python lists at once: the loop below reads no tensor element
        best, cand, worst, victim = best[rows].tolist(), cand[rows].tolist(), worst.tolist(), victim.tolist()
        out = []
        for row, i in enumerate(rows.tolist()):
            flying, free, j = len(busy[i]), empty[i], 0
            for r in range(n):
                e, b = cand[row][r], best[row][r]
                if flying >= n or b <= 0 or e in busy[i]:
                    break
                if free:
                    out.append((i, e, None))
                    free -= 1
                elif j < n and b > self.margin * worst[row][j] + self.floor:  # inf when none is evictable
                    out.append((i, e, victim[row][j]))
                    j += 1
                else:
                    break
                flying += 1
        return out


FREQUENT = dict(decay=0.9, margin=2.0, floor=1.0, per_layer=2)
"""Frequency with hysteresis: follows a skewed popularity and leaves uniform routing alone."""
RECENT = dict(decay=0.5, margin=1.0, floor=0.0, per_layer=8)
"""Recency: follows routing that repeats from token to token (a sequence reusing its experts)."""


class DuelingPolicy:
    """Several `PromotionPolicy` knob sets, each replayed in shadow on the counts as they arrive (its own
    residents and promotions; a step's counts are checked against the shadow as it stood `delay` decisions
    earlier, as the real step ran); each layer row follows the one whose shadow moved the fewest experts
    over PCIe lately (in-place misses + promotions, an average over ~1/(1 - `memory`) steps). Neither knob
    set wins everywhere: frequency with hysteresis is best on skewed routing and harmless on uniform,
    recency on routing that repeats, where hysteresis costs a miss per step of lag (set dueling, as in
    adaptive CPU cache insertion policies). A promotion counts as one in-place read: weighing it 2-3 reads (for its
    fixed costs: copies per part, the next step waiting) lost on the H100 to this plain duel on both fp8 and bf16
    Qwen3-30B-A3B experts (16-layer batch-1 steps 6.26 / 6.60 against 6.16 ms fp8, 8.39 against 7.63 ms bf16;
    session 27), so it was dropped."""

    memory = 0.95

    def __init__(self, layers: int, experts: int, resident: torch.Tensor, pinned: torch.Tensor, empty: list[int],
                 candidates: tuple[dict, ...] = (FREQUENT, RECENT), delay: int = 2):
        self.policies = [PromotionPolicy(layers, experts, **c) for c in candidates]
        self.resident = [resident.clone() for _ in candidates]  # [L, E] each: the shadows' residents now
        self.past = [[resident.clone()] * delay for _ in candidates]  # the same, as the last `delay` decisions left them
        self.empty = [list(empty) for _ in candidates]
        self.pinned = pinned.clone()
        self.cost = torch.zeros(len(candidates), layers)  # [P, L] decayed experts moved per step
        self.leader = torch.zeros(layers, dtype=torch.long)  # [L] the knob set each row follows

    def observe(self, counts: torch.Tensor) -> None:
        needed = counts > 0  # [L, E]
        L = needed.shape[0]
        for k, pol in enumerate(self.policies):
            res = self.resident[k]
            moved = (needed & ~self.past[k].pop(0)).sum(1).float()  # [L] in-place reads of this shadow
            pol.observe(counts)
            chosen = pol.choose(res, self.pinned, [set() for _ in range(L)], self.empty[k])
            if chosen:
                rows = torch.tensor([i for i, _, _ in chosen])
                moved += torch.bincount(rows, minlength=L).float()
                res[rows, torch.tensor([e for _, e, _ in chosen])] = True
                evicted = [(i, v) for i, _, v in chosen if v is not None]
                if evicted:
                    res[torch.tensor([i for i, _ in evicted]), torch.tensor([v for _, v in evicted])] = False
                for i, _, v in chosen:
                    if v is None:
                        self.empty[k][i] -= 1
            self.past[k].append(res.clone())
            self.cost[k].mul_(self.memory).add_(moved)
        self.leader = self.cost.argmin(0)

    def choose(self, resident, pinned, busy, empty) -> list[tuple[int, int, int | None]]:
        out = []
        for k, pol in enumerate(self.policies):
            rows = (self.leader == k).tolist()
            out += [c for c in pol.choose(resident, pinned, busy, empty) if rows[c[0]]]
        return out


@dataclass
class Replay:
    hits: int = 0
    accesses: int = 0
    in_place: int = 0
    """Misses read in place (each one expert's bytes over PCIe)."""
    promotions: int = 0
    """Experts copied into slots (each one expert's bytes over PCIe)."""
    steps: int = 0
    row_hits: list = field(default_factory=list)
    """Per layer row: hits, accesses, promotions (the totals above, split)."""
    row_accesses: list = field(default_factory=list)
    row_promotions: list = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def crossings(self) -> int:
        """Experts that crossed PCIe."""
        return self.in_place + self.promotions


def replay_mapped(traces: list[list[list[int]]], experts: int, capacity: list[int], initial: list[list[int]],
                  pinned: list[set[int]] = None, lag: int = 1, land_lag: int = 1, dueling: bool = False,
                  warmup: int = 0, **knobs) -> Replay:
    """The mapped path on a trace: traces[i][t] are the experts layer row i needs at step t (all rows the
    same length); capacity[i] slots, filled with initial[i]; `knobs` go to `PromotionPolicy` (with
    `dueling`, `candidates` go to `DuelingPolicy`). The first `warmup` steps run but are not counted (the
    slots settling from their initial fill, as an engine's first steps after start-up)."""
    L, S = len(traces), len(traces[0])
    pinned = pinned or [set() for _ in range(L)]
    resident = torch.zeros(L, experts, dtype=torch.bool)
    pin = torch.zeros(L, experts, dtype=torch.bool)
    empty = []
    for i in range(L):
        resident[i, list(initial[i])[:capacity[i]]] = True
        pin[i, list(pinned[i])] = True
        empty.append(capacity[i] - int(resident[i].sum()))
    if dueling:
        policy = DuelingPolicy(L, experts, resident, pin, empty, delay=lag + land_lag + 1, **knobs)
    else:
        policy = PromotionPolicy(L, experts, **knobs)
    counts = torch.zeros(S, L, experts)
    for i, tr in enumerate(traces):
        for t, need in enumerate(tr):
            counts[t, i, need] = 1.0
    landing: list[tuple[int, int, int]] = []  # (row, expert, step after which it is resident)
    out = Replay(steps=max(0, S - warmup), row_hits=[0] * L, row_accesses=[0] * L, row_promotions=[0] * L)
    for s in range(S):
        needed = counts[s] > 0  # [L, E]
        counted = s >= warmup
        if counted:
            row_hits, row_need = (needed & resident).sum(1).tolist(), needed.sum(1).tolist()
            for i in range(L):
                out.row_hits[i] += row_hits[i]
                out.row_accesses[i] += row_need[i]
            out.hits += sum(row_hits)
            out.accesses += sum(row_need)
            out.in_place += sum(row_need) - sum(row_hits)
        # after the step: land, read the counts that arrived, promote
        still = []
        for i, e, t in landing:
            if t <= s:
                resident[i, e] = True
            else:
                still.append((i, e, t))
        landing = still
        if s - lag >= 0:
            policy.observe(counts[s - lag])
        busy = [set() for _ in range(L)]
        for i, e, _ in landing:
            busy[i].add(e)
        for i, e, victim in policy.choose(resident, pin, busy, empty):
            if victim is None:
                empty[i] -= 1
            else:
                resident[i, victim] = False
            out.promotions += counted
            out.row_promotions[i] += counted
            if land_lag == 0:
                resident[i, e] = True
            else:
                landing.append((i, e, s + land_lag))
                busy[i].add(e)
        flying = torch.bincount(torch.tensor([i for i, _, _ in landing], dtype=torch.long), minlength=L)
        if (resident.sum(1) + flying > torch.tensor(capacity)).any() or (pin & ~resident).any():
            raise RuntimeError(f"slot books broken at step {s}")  # a policy that leaks or evicts a pinned one
    return out
