"""The device expert cache: a bank whose experts live in (pinned) host memory computes through a few
device slots per layer. Its resident experts are the slots' first contents; misses are copied in on
demand, on the copy stream, while the experts already there compute.

One layer's step: plan (route; counts to the host: the one sync per layer; the cost model sends some
misses to the host's cores when `cpu_mode` allows: `offload/cost_model.py`), fetch (every copied miss is
issued first, into slots that hold no expert this step needs; host experts start on the CPU pool),
compute the hits while the misses are in flight, then each miss as its copy lands, then join the host
results; when a step needs more experts than there are free slots, the
slots of experts already computed are reused (waves). Outputs are added in ascending expert order
(`layers.moe.combine`), so the result is bit-identical to the resident reference path.

Decode steps on CUDA (`mapped`, up to `mapped_tokens` tokens) take another road: the fused kernel reads
each expert through a table of addresses (`layers.fused_moe.WeightTable`) that points at a device slot or
at the expert's pinned, mapped host rows, so a miss is read in place over PCIe inside the kernel. Nothing
is read back to the host, and decode steps are CUDA-graphed. The slots then follow the routing
(`offload/routing_tally.py`, decided by `offload/slot_policy.py`): after a step the experts the policy
promotes are copied in on the copy stream, behind the table (an evicted expert is pointed back at the host
before its slot is overwritten; a promoted one at its slot once its copy has landed, stream-ordered).

Layers that keep no expert on the device (a budget too small for slots a layer: `placement.SHARED_EXPERT_SLOTS`)
copy their misses through one pool of slots they share (`SlotPool`), each in turn: a step's contents are its own.

Eviction policies behind one interface (`EvictionPolicy`): LRU and LFU; experts pinned from a profile are
never evicted. `belady_hits` replays a trace with the optimal offline policy (the oracle hit rate).
"""

from __future__ import annotations

import bisect
from collections import deque

import torch

from ferrylm.engine.staging import download
from ferrylm.layers.context import recording
from ferrylm.layers.fused_moe import ExpertWeights
from ferrylm.layers.moe import ExpertBackend, combine, dispatch, expert_mlp, row_cap
from ferrylm.layers.transfer import to_device
from ferrylm.offload.cost_model import split_misses


def _parts(side) -> dict[str, torch.Tensor]:
    """A bank side's tensors by part: a dense [E, N, K] tensor is its own "q"; packed sides have codes,
    scales (and mins)."""
    return side.parts if isinstance(side, ExpertWeights) else {"q": side}


def _layout(side) -> tuple:
    """What an expert slot of `side` must match to hold its experts: every part's shape and type, a packed side's
    format and group."""
    return (getattr(side, "fmt", None), getattr(side, "group", None),
            [(t.shape[1:], t.dtype) for t in _parts(side).values()])


def _nbytes(*sides) -> int:
    """Bytes of every part of these bank sides (slots or host banks)."""
    return sum(t.numel() * t.element_size() for side in sides for t in _parts(side).values())


def _slots(side, n: int, device) -> object:
    if isinstance(side, ExpertWeights):
        return side.empty_like(n, device)
    return torch.empty((n, *side.shape[1:]), dtype=side.dtype, device=device)


def _copy(dst, s: int, src, e: int, non_blocking: bool = False) -> None:
    """Slot s of `dst` <- expert e of `src`, every part."""
    src_parts = _parts(src)
    for k, t in _parts(dst).items():
        t[s].copy_(src_parts[k][e], non_blocking=non_blocking)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor on the host (`engine/staging.download`: pinned, behind a blocking event, so the wait
    sleeps rather than spins: CUDA spins a core while it waits by default, and host experts need every core)."""
    return download([t]).wait()[0]


def tally_step(counts: torch.Tensor, hits: torch.Tensor, in_slot: torch.Tensor, topk_ids: torch.Tensor,
               real: torch.Tensor) -> None:
    """A mapped step's routing into the tally's device rows: `counts` [E] += assignments per expert, `hits` [E]
    += those whose expert the kernel reads from a slot; `real` [T * k] weighs out a padded graph step's padding
    rows (they route too). Nothing under `recording_off` (a graph's warm-up run, which the replay repeats: the
    step counted twice). No host sync, graph-capturable."""
    if not recording():
        return
    flat = topk_ids.flatten()
    counts.scatter_add_(0, flat, real.to(counts.dtype))
    hits.scatter_add_(0, flat, (in_slot[flat] & (real > 0)).to(hits.dtype))


def host_share(topk_ids: torch.Tensor, in_slot: torch.Tensor, prefer: torch.Tensor,
               share: torch.Tensor) -> torch.Tensor:
    """Hybrid decode's split of one layer's step, on the device (no host sync, graph-capturable): of the n
    distinct experts the step routes to that are not in a slot, the host takes round(share * n), the first of
    them in `prefer` order ([E], a permutation of the expert ids); the GPU reads the rest in place. A split
    per step, not a fixed class of host experts: at one token a Mixtral layer has 0-2 misses, and a fixed
    class sends both to one side as often as it splits them. -> [T, k] bool: the assignments the host computes."""
    from ferrylm.layers.context import live_assignments

    E = in_slot.numel()
    counts = torch.zeros(E, dtype=torch.long, device=in_slot.device)  # a padded graph step: its real rows only
    used = counts.scatter_add_(0, topk_ids.flatten(), live_assignments(topk_ids).long()) > 0
    miss = (used & ~in_slot)[prefer]  # [E] in preference order
    rank = miss.cumsum(0)  # 1-based rank of each miss
    pick = miss & (rank <= torch.floor(share * rank[-1] + 0.5))
    return torch.empty_like(pick).scatter_(0, prefer, pick)[topk_ids]


class EvictionPolicy:
    """Orders eviction candidates, first to go first."""

    def __init__(self):
        self.clock = 0
        self.last: dict[int, int] = {}
        self.count: dict[int, int] = {}

    def touch(self, experts: list[int]) -> None:
        self.clock += 1
        for e in experts:
            self.last[e] = self.clock
            self.count[e] = self.count.get(e, 0) + 1

    def victims(self, experts: list[int]) -> list[int]:
        raise NotImplementedError


class LRU(EvictionPolicy):
    def victims(self, experts):
        return sorted(experts, key=lambda e: self.last.get(e, -1))


class LFU(EvictionPolicy):
    def victims(self, experts):
        return sorted(experts, key=lambda e: (self.count.get(e, 0), self.last.get(e, -1)))


POLICIES = {"lru": LRU, "lfu": LFU}


def _replay(trace: list[list[int]], capacity: int, initial, victim, on_step=None) -> tuple[int, int]:
    """(hits, accesses) of a cache run on a trace of per-step needed experts (one layer), by the cache's
    rules: a step's misses fill empty slots first, then replace `victim(t, candidates, e)`, where candidates
    hold no expert that step needs (None: e is not cached). `on_step(need)` runs as each step begins."""
    cached, hits, total = list(initial)[:capacity], 0, 0
    for t, need in enumerate(trace):
        if on_step:
            on_step(need)
        total += len(need)
        hits += sum(e in cached for e in need)
        for e in need:
            if e in cached:
                continue
            if len(cached) < capacity:
                cached.append(e)
                continue
            cand = [c for c in cached if c not in need]
            v = victim(t, cand, e) if cand else None
            if v is not None:
                cached[cached.index(v)] = e
    return hits, total


def round_counts(counts: list[int], slot: list[int], capacity: int) -> list[int]:
    """The assignments of each id of a round's slot-mapped routing (`slot[e]`: expert e's slot, `capacity` for
    experts outside the round), from the layer's per-expert counts: what `torch.bincount(ids, minlength=capacity
    + 1)` of the mapped ids gives, without reading the device."""
    per = [0] * (capacity + 1)
    for e, n in enumerate(counts):
        per[slot[e]] += n
    return per


def simulate(trace: list[list[int]], capacity: int, policy: str, initial: list[int] = ()) -> tuple[int, int]:
    """(hits, accesses) of an eviction policy on a trace (all experts a step needs are touched together)."""
    pol = POLICIES[policy]()
    return _replay(trace, capacity, initial, lambda t, cand, e: pol.victims(cand)[0], on_step=pol.touch)


def belady_hits(trace: list[list[int]], capacity: int, initial: list[int] = (), bypass: bool = False) -> tuple[int, int]:
    """(hits, accesses) of Belady's optimal policy: evict the cached expert needed furthest in the future.
    Every miss is cached (the copy path); with `bypass` a miss needed later than every candidate is read
    without being cached (the mapped path can read a miss in place and keep its slots)."""
    uses: dict[int, list[int]] = {}
    for t, need in enumerate(trace):
        for e in need:
            uses.setdefault(e, []).append(t)

    def next_use(t, c):
        u = uses.get(c, [])
        i = bisect.bisect_right(u, t)
        return u[i] if i < len(u) else len(trace) + 1

    def victim(t, cand, e):
        v = max(cand, key=lambda c: next_use(t, c))
        return None if bypass and next_use(t, e) >= next_use(t, v) else v

    return _replay(trace, capacity, initial, victim)


LENT = -1
"""A cache slot's owner while `StagingSlots` holds it."""


class StagingSlots:
    """Up to n slots of one cached layer, the donor (the first: it has run when the others stage), that the model's
    cached layers share on a copy-road step: once a layer has queued its last miss, it copies experts the next layer
    lacks into them, before that layer's routing is known; the copy engine then streams from one layer's misses into
    the next's instead of idling through the next layer's attention, routing and first hit. The next layer computes
    a staged expert it routes to in a round of its own from the donor's slot (same bits) and frees it for the next
    stage; the step's last cached layer gives the slots back to the donor with its experts copied back. No memory
    beyond the caches': a large step costs up to n more copies (`staging_slots`)."""

    def __init__(self, donor: CachedExperts, n: int):
        self.donor, self.n = donor, n
        self.taken: list[int] = []  # donor slots held this step
        self.owner: dict[int, tuple[int, int] | None] = {}  # donor slot -> (layer, expert) staged there
        self.evicted: dict[int, int] = {}  # donor slot -> the donor's expert it held when taken
        self.linked: set[CachedExperts] = set()  # the caches that stage or are staged for (`CachedExperts.link`)
        self.restored: list[int] = []  # donor slots whose expert `release` copied back, not yet waited for

    w13 = property(lambda self: self.donor.w13)
    w2 = property(lambda self: self.donor.w2)
    ready = property(lambda self: self.donor.ready)
    free = property(lambda self: self.donor.free)
    capacity = property(lambda self: self.donor.capacity)

    def can_stage(self) -> bool:
        return len(self.taken) < self.n or None in self.owner.values()

    def slot(self) -> int | None:
        """A held slot with nothing staged, else one more taken from the donor (an empty one first, then the
        donor policy's victim; never a pinned or landing expert's), else None."""
        for s in self.taken:
            if self.owner[s] is None:
                return s
        d = self.donor
        if len(self.taken) >= self.n:
            return None
        empty = [s for s in range(d.capacity) if d.owner[s] is None]
        held = [e for e in d.owner if e is not None and e != LENT and e in d.slot_of and e not in d.pinned]
        cands = empty + [d.slot_of[e] for e in d.policy.victims(held)]
        if not cands:
            return None
        s, old = cands[0], d.owner[cands[0]]
        if old is not None:  # the donor's expert leaves its slot: its table (mapped) reads it from the host now
            del d.slot_of[old]
            if d.mapped:
                d._point(old, None)
            self.evicted[s] = old
        d.owner[s] = LENT
        if d.stream is not None:  # every read of the slot queued so far finishes before a stage overwrites it
            d.free[s].record(torch.cuda.current_stream(d.device))
        self.taken.append(s)
        self.owner[s] = None
        return s

    def release(self) -> None:
        """The held slots back to the donor (after the reads queued so far), each with the expert it held copied
        back: the donor's cache is as if nothing was staged, so decode steps after a large one lose no hits (slots
        taken from the caches for good had cost 8-layer NF4 batch-1 decode 10.7 against 9.3 ms a step). A mapped
        donor's copies land as promotions do (`CachedExperts.land`); the others' before the donor's next forward."""
        d = self.donor
        for s in self.taken:
            d.owner[s] = None
            if d.stream is not None:
                d.free[s].record(torch.cuda.current_stream(d.device))
                # every later copy waits for the staged rounds' reads (a promotion may wait only for its layer's
                # `layer_done`, recorded before them)
                d.stream.wait_event(d.free[s])
        back = [self.evicted[s] for s in self.taken if s in self.evicted]
        self.taken, self.owner, self.evicted = [], {}, {}
        for e in back:
            if d.mapped:
                d.promote(e, None)
            else:  # waited for at the donor's next forward (`wait_restored`), not by this step's last kernels
                s = d.owner.index(None)
                d._fetch(e, s)
                if d.stream is not None:
                    self.restored.append(s)

    def wait_restored(self) -> None:
        """The donor's stream waits for the copies `release` queued into its slots (a non-mapped donor's rounds
        read its hits without waiting)."""
        for s in self.restored:
            self.donor.stats.wait(torch.cuda.current_stream(self.donor.device), self.donor.ready[s])
        self.restored = []


class SlotPool:
    """Device slots that the cached layers without an expert of their own (`Placement.pool_layers`) share: such a
    layer's copy-road misses are copied into them and computed as in its own slots. Layers run one after another, so
    each takes the pool over in turn (`claim`); its copies wait for the previous user's reads of a slot (the slots'
    `free` events are the pool's), and what it leaves is stale for the next layer. Nothing promotes into the pool
    (decode steps read such a layer's misses in place, or split them with the host), and a mapped layer's table never
    points at it. One pool's memory, whatever the number of layers (`CachedExperts.slot_bytes` counts it once)."""

    def __init__(self, like_w13, like_w2, n: int, device: torch.device):
        self.w13, self.w2 = _slots(like_w13, n, device), _slots(like_w2, n, device)
        cuda = device.type == "cuda"
        self.ready = [torch.cuda.Event() for _ in range(n)] if cuda else []
        self.free = [torch.cuda.Event() for _ in range(n)] if cuda else []
        self.n = n
        self.user: CachedExperts | None = None
        """The layer whose experts the slots hold: its next step may hit them, another layer's may not."""

    def fits(self, host_w13, host_w2) -> bool:
        """Whether a layer's experts fit the pool's slots (`_layout`)."""
        return _layout(self.w13) == _layout(host_w13) and _layout(self.w2) == _layout(host_w2)

    def claim(self, cache: CachedExperts) -> None:
        """`cache` takes the slots over for its step: if another layer used them last, none holds its experts (and
        that layer holds none any more: only the pool's user sees experts in it)."""
        if self.user is not cache:
            if self.user is not None:
                self.leave(self.user)
            self.user = cache

    def leave(self, cache: CachedExperts) -> None:
        """`cache` holds nothing in the pool any more. After a mapped layer's copy-road step: its table then points at
        its host rows (a decode step reads its misses in place, never from the pool, which the next layer overwrites)."""
        cache.owner = [None] * self.n
        cache.slot_of = {}
        if self.user is cache:
            self.user = None

    @property
    def nbytes(self) -> int:
        return _nbytes(self.w13, self.w2)


class CachedExperts(ExpertBackend):
    single_round_tokens = 64
    """Up to this many tokens the fused path waits for the misses and runs hits and misses in one launch."""
    mapped_tokens = 64
    """Up to this many tokens a mapped cache reads its misses in place (each expert's rows then fit one
    row block of the kernel, so its weights cross PCIe once); larger steps copy them into slots. Large
    experts read in place only at one token: in place runs at ~45 GB/s against the copy engine's ~54
    (H200, `benchmarks/bench_mapped.py`), and beside a 352 MB Mixtral expert the copy path's per-layer
    sync is small."""
    large_expert_bytes = 64 << 20
    one_large_a_round = True
    """True: the rounds path computes large experts (`large_expert_bytes`) one a round as they land, each freeing its
    slot for the next copy, so the copy engine streams a layer's misses back to back under their compute (same
    bits: each assignment comes from one round). Measured on the H100 (session 28, 8-layer NF4 Mixtral under 5 GiB,
    512-token fresh prefills, alternating runs): 5967 / 5730 tok/s against 5196 / 5370 with one round of all in
    flight (+7-15%); in session 27, before `layers/transfer.py` removed the rounds' stream syncs, it had lost."""
    free_hits_first = True
    """With `one_large_a_round`, when misses wait for a slot: the hits whose slots may be evicted run one a round
    first, each slot taking the next copy at once, then the pinned hits in one round; False: all hits in one round,
    the first copy waiting for all of them (session 28's timeline of that prefill: copies 50.8 ms and kernels
    33.4 ms of 107, never at once). TODO(issue 8): `profile_offload.py --rounds` each | misses | all."""
    staging_slots = 2
    """With `one_large_a_round` on CUDA: slots of the first cached layer the others share (`StagingSlots`) to stage the
    next layer's experts on a copy-road step whose tokens leave almost no expert unrouted (`_stages`); 0: off. Measured
    on the H100 in session 28, alternating runs, 2 slots: shared slots taken from the layers' caches for good ran the 2k
    prefill of the 32-layer NF4 Mixtral under 16 GiB at 6728 / 6786 tok/s against 5076 / 5481 without (0.76 of the copy
    floor), the 8-layer NF4 512-token prefill at 8684 against 7302 (0.92), the 16-layer bf16 2k prefill at 3564 against
    3344 (1.00), but cost 8-layer NF4 batch-1 decode under 5 GiB 10.7 against 9.3 ms a step (hit rate 0.88 against 0.92;
    32 layers: equal); the donor's slots held during the step only (its experts not yet copied back) ran one 32-layer
    prefill at 4838 against 5869 and decode 11.0 against 9.6 ms. Lending each layer's own freed slots to the next cost
    as many extra copies as it staged (the lender's experts, needed again next step, were dropped): 5920-5970 against
    6396. The CPU engine stages with `staging_on_cpu` (copies at once: the bookkeeping in CI, `tests/test_offload.py`).
    The donor with its experts copied back at the step's end (`StagingSlots.release`; session 29,
    `benchmarks/device_s34.sh`, alternating): 32-layer 2k prefill 6400 / 5710 against 6031 / 6131 tok/s, 8-layer 512
    6300 against 6276, 8-layer batch-1 decode 10.45 / 10.34 against 9.59 / 9.32 ms (hit 0.896 against 0.918): no prefill
    gain and a decode loss, so it stayed off then. The 32-layer NF4 prefill's other side is its compute: the same model
    resident prefills 2k tokens at 7206 / 7487 tok/s on that box, and the offloaded run's 5866 is 0.80 of that. Session
    31 (H100, three pairs, two alternating; `device_s37.sh`): the 32-layer 2k prefill 5844 against 4816 tok/s on average
    (+18-23% in every pair), batch 64 211 against 206 (within its 174-237 spread), 8-layer batch-1 decode 12.54 against
    10.34 ms a step (hit 0.902 against 0.941; each timed request's 32-token prompt stages). Since session 32 only steps
    of `stage_min_tokens` tokens or more stage, so steps under it (short prompts, decode batches below it) run as with
    staging off (`tests/test_offload.py`: the same copies and slots). Session 33 (H200, `benchmarks/device_s40.sh`,
    alternating, with the gate): the 32-layer 2k prefill 6485 / 6066 against 5138 / 4968 tok/s (+24%), batch 64 218 /
    217 against 221 / 215, the 8-layer batch-1 decode 13.1 / 11.3 against 10.2 / 11.0 ms a step with the same hit rate
    (0.930) and no step staging (the first pair's gap is the first run's warm-up: 3% in the second): on since then."""
    stage_min_tokens = 256
    """Steps with fewer tokens never stage (`_stages`): a short prompt stages a few experts for a prefill the copies
    barely dominate, and the donor's restores after it cost the decode steps that follow their hits (session 31).
    Under expert parallelism a rank counts the token-expert assignments it holds (its backend's rows), not the
    step's tokens."""
    staging_on_cpu = False
    """The CPU engine stages only when set: its copies run at once, so staging overlaps nothing there and costs the
    donor's restores (CI sets it, to check the bookkeeping on the CPU engine)."""
    promote_after_layer = False
    """A promotion's copy starts once its layer of the last queued step has run (`layer_done`: an event recorded
    after every forward of this layer, inside decode graphs too, read when the engine builds it), not after
    the whole step, so it overlaps the step's later layers (Qwen3-30B-A3B batch 1 on the H200: 2.5 ms of a
    9.6 ms step were promotion copies run between steps, session 14). Measured in session 15: equal to the
    resident run, 7.55 against 7.74 ms a step (-2.5%, within run-to-run noise; the copies then share the link
    with the later layers' in-place reads): left off."""

    def __init__(self, bank, host_w13: torch.Tensor, host_w2: torch.Tensor, capacity: int, initial: list[int],
                 pinned: set[int], policy: str, device: torch.device, copy_stream, stats, layer: int,
                 use_fused: bool = True, pool: SlotPool | None = None):
        """host_w13: [E, 2I, H], host_w2: [E, H, I] in host memory (dense, or packed `ExpertWeights`);
        `capacity` device slots, filled with `initial` (the resident experts); `pinned` experts are never
        evicted. With `pool` (capacity 0, nothing resident) the layer's slots are the shared pool's."""
        self.host_w13, self.host_w2 = host_w13, host_w2
        self.device, self.stream, self.stats, self.layer = device, copy_stream, stats, layer
        self.use_fused, self.act_name, self.act = use_fused, bank.act_name, bank.act
        self.cpu_mode, self.costs, self.cpu_pool = "gpu", None, None
        """Hybrid: `cpu_mode` auto | cpu lets misses run on the host (`costs`, a worker `cpu_pool`)."""
        self._host_experts = None
        self.pool = pool
        C = capacity if pool is None else pool.n
        self.dtype = bank.w13.dtype
        self.packed = isinstance(host_w13, ExpertWeights)
        self.owner: list[int | None] = [None] * C
        self.slot_of: dict[int, int] = {}
        self.pinned = set(pinned)
        self.policy: EvictionPolicy = POLICIES[policy]()
        cuda = device.type == "cuda"
        if pool is not None:
            assert not initial and not pinned, "a layer on the shared pool keeps no expert of its own"
            self.w13, self.w2, self.ready, self.free = pool.w13, pool.w2, pool.ready, pool.free
        else:
            self.w13, self.w2 = _slots(host_w13, C, device), _slots(host_w2, C, device)
            self.ready = [torch.cuda.Event() for _ in range(C)] if cuda else []
            self.free = [torch.cuda.Event() for _ in range(C)] if cuda else []
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in self.host_parts())
        # external: recorded inside graph captures as a record node, so waits outside see each replay's record
        self.layer_done = torch.cuda.Event(external=True) if cuda and self.promote_after_layer else None
        self.trace: list[list[int]] | None = None
        """Per-step needed experts while tracing (`start_trace`; benchmarks compute the oracle from it)."""
        self.trace_hits, self.trace_initial = 0, []
        for s, e in enumerate(list(initial)[:C]):
            _copy(self.w13, s, host_w13, e)
            _copy(self.w2, s, host_w2, e)
            self.owner[s], self.slot_of[e] = e, s
        self.reads_host = True
        self.mapped = False
        self.landing: list[tuple[int, int]] = []
        """Promotions in flight (expert, slot): the slot is reserved, the table still points at the host."""
        self.copied_step = False
        """A mapped cache's last step took the copy road (more than `mapped_tokens` tokens): the tally skips it."""
        self.resident: torch.Tensor | None = None  # [E] bool row of the tally: experts the table points at a slot
        self.counts: torch.Tensor | None = None  # [E] fp32 device row of the tally: assignments this step
        self.hits: torch.Tensor | None = None  # [E] fp32 device row of the tally: assignments that hit a slot
        self.host_decode = None
        """Hybrid decode (`offload/host_decode.py`): CPU-class experts the table points at the host are
        computed by the host's cores while the kernel reads the others in place."""
        self.cpu_class: torch.Tensor | None = None  # [E] bool, host: experts the CPU takes first while not in a slot
        self.next: CachedExperts | None = None
        self.staging: StagingSlots | None = None
        """The next cached layer and the slots this layer stages its experts in (`staging_slots`; `link`)."""
        self.borrowed: list[tuple[int, int]] = []
        """Experts staged for this layer's next step: (expert, staging slot)."""
        self.last_counts: list[int] = []  # the last step's assignments per expert (`_plan`)
        self.in_slot: torch.Tensor | None = None  # [E] bool, device: the table points at a slot, stream-ordered
        self.split_cols: int | None = None  # hybrid decode split along the intermediate: the GPU's columns
        self.prefer: torch.Tensor | None = None  # [E] long, device: hybrid decode's host preference order
        self.share: torch.Tensor | None = None  # [] fp32, device: hybrid decode's host share

    def map(self, resident_row: torch.Tensor, counts_row: torch.Tensor, hits_row: torch.Tensor) -> None:
        """Turn on the in-place decode path (host banks registered mapped, fused kernel, CUDA); the rows are
        the tally's: residents (host), assignments and assignments that hit a slot (device)."""
        from ferrylm.layers.fused_moe import WeightTable

        def addresses(side):  # part -> per-expert (or per-slot) addresses
            return {k: WeightTable.addresses(t) for k, t in _parts(side).items()}

        self.host_addr = (addresses(self.host_w13), addresses(self.host_w2))
        self.slot_addr = (addresses(self.w13), addresses(self.w2))
        # every part's table is a row of one [P, E] tensor (P parts over both sides), so that pointing an expert
        # elsewhere is one copy of a column, whatever the format's parts (fp8: codes and scales, 2 a side)
        keys = [(i, k) for i in (0, 1) for k in self.host_addr[i]]
        self.host_cols = torch.tensor([self.host_addr[i][k] for i, k in keys], dtype=torch.long, device=self.device)
        self.slot_cols = torch.tensor([self.slot_addr[i][k] for i, k in keys], dtype=torch.long, device=self.device)
        self.ptr_rows = self.host_cols.clone()
        for e, s in self.slot_of.items():
            self.ptr_rows[:, e] = self.slot_cols[:, s]
        tables = [WeightTable({k: self.ptr_rows[j] for j, (i, k) in enumerate(keys) if i == side_i}, side)
                  for side_i, side in enumerate((self.host_w13, self.host_w2))]
        self.t13, self.t2 = tables
        self.resident, self.counts, self.hits = resident_row, counts_row, hits_row
        for e in self.slot_of:
            self.resident[e] = True
        self.in_slot = self.resident.to(self.device)  # [E] bool, device: the table points at a slot
        self.mapped, self.reads_host = True, False
        if self.expert_bytes > self.large_expert_bytes:
            self.mapped_tokens = 1

    def use_host(self, host_decode, cpu_class: torch.Tensor, share: float, split: bool = False) -> None:
        """Hybrid decode: each step the host's cores take `share` of the layer's missed experts
        (`host_share`), those of `cpu_class` ([E] bool) first; with `split` (every bank format, dense or
        packed), every missed expert is split along its intermediate instead: the GPU computes the first
        c = (1 - share) * I of its columns, the host the rest, c rounded to the nearest multiple of
        `HostExperts.split_unit` (lcm of 128 and w2's group along I: 128 for dense, per-channel int8/fp8 and
        groups of 32, 64 or 128; 256 for groups of 256) and clamped to [0, I]. A split column count is baked
        into graphs captured after."""
        # at share 0 an in-place bank reads every miss itself: no hand-off a layer (0.25 ms each, measured on the
        # H200 host: 8 ms a step over 32 layers); a copying worker (`HostDecode.copies`) still hands its misses over
        detach = share <= 0 and not host_decode.copies
        self.host_decode, self.cpu_class = None if detach else host_decode, cpu_class.clone()
        he = self.host_experts
        I, unit = self.host_w2.shape[2], he.split_unit
        self.split_cols = (min(I, max(0, round((1 - share) * I / unit) * unit)) if split and he.splittable
                           and not detach else None)
        prefer = torch.cat([cpu_class.nonzero().flatten(), (~cpu_class).nonzero().flatten()]).to(self.device)
        if self.prefer is None:
            self.prefer, self.share = prefer, torch.tensor(float(share), device=self.device)
        else:  # in place: captured graphs read these tensors
            self.prefer.copy_(prefer)
            self.share.fill_(float(share))

    def _point(self, e: int, s: int | None) -> None:
        """Table entries of expert e (every part, both sides) -> slot s, or its host rows (None): one column copy;
        stream-ordered, no host sync. The tally's host row follows at once."""
        assert s is None or self.pool is None, "a table never points at the shared pool"
        self._point_device(e, s)
        self.resident[e] = s is not None

    def _repoint(self) -> None:
        """The whole table (and `in_slot`, the tally's row) from `slot_of`, in a few launches: after a copy-road
        step, whose fetches moved experts in and out of slots without pointing the table (session 27: a 512-token
        Qwen3-30B-A3B prefill through 16 mapped layers launched ~2000 column copies and fills for its 515 fetches,
        its host the bottleneck)."""
        E = self.ptr_rows.shape[1]
        where = [self.slot_of.get(e, -1) for e in range(E)]  # [E] the slot of each expert, -1: its host rows
        held = to_device(where, self.device)
        in_slot = held >= 0
        # [P, E]: each expert's column from its slot's, else from its host rows'
        if self.slot_cols.shape[1]:
            self.ptr_rows.copy_(torch.where(in_slot, self.slot_cols[:, held.clamp(min=0)], self.host_cols))
        else:  # no slots (`placement.min_expert_slots`): every column its host rows'
            self.ptr_rows.copy_(self.host_cols)
        self.in_slot.copy_(in_slot)
        self.resident.copy_(torch.tensor([w >= 0 for w in where]))

    def _point_device(self, e: int, s: int | None) -> None:
        """`_point`'s device side alone (the table's column, `in_slot`), on the current stream."""
        self.ptr_rows[:, e].copy_(self.host_cols[:, e] if s is None else self.slot_cols[:, s], non_blocking=True)
        if self.in_slot is not None:
            self.in_slot[e:e + 1].fill_(s is not None)

    def promote(self, e: int, victim: int | None, land: bool = False, on_copy_stream: bool = False) -> None:
        """Copy expert e into victim's slot (an empty one for None) behind the table (mapped decode path);
        with `land` the current stream waits for the copy and the table points at the slot at once. With
        `on_copy_stream` nothing waits: the copy stream points the table at the slot once its copy has landed, so
        the kernels before that read e in place and those after it from the slot (either holds e's weights, part
        by part), and the host books the slot once it sees the copy landed (`land`; the copy road waits for it).
        Not with hybrid decode (it lands as `land` says)."""
        assert self.pool is None, "nothing promotes into the shared pool"
        cur = torch.cuda.current_stream(self.device)
        # hybrid decode reads `in_slot` twice a layer (the host's share, then the device's): it must not flip between
        on_copy_stream = on_copy_stream and self.host_decode is None
        if victim is None:
            s = self.owner.index(None)
        else:
            s = self.slot_of.pop(victim)
            self._point(victim, None)  # kernels after this read the victim in place
        self.free[s].record(cur)
        self.owner[s] = e
        # the slot's last reader is this layer of the last queued step (the victim is read in place from the
        # next step on): its copy waits for that layer alone with `layer_done`, else for the whole step
        self.stream.wait_event(self.layer_done if self.layer_done is not None else self.free[s])
        with torch.cuda.stream(self.stream):
            _copy(self.w13, s, self.host_w13, e, non_blocking=True)
            _copy(self.w2, s, self.host_w2, e, non_blocking=True)
            self._arrived(s, e)
            if on_copy_stream:  # the device's table and flags only: the host books e in `land` (until then the
                # slot policy must not see e resident, nor evict it), after `ready`, which orders this write too
                self._point_device(e, s)
            self.ready[s].record(self.stream)
        if on_copy_stream:
            self.landing.append((e, s))
        elif land:  # stream-ordered: the next kernel reads e from its slot, never in place as well
            self.stats.wait(cur, self.ready[s])
            self.slot_of[e] = s
            self._point(e, s)
        else:
            self.landing.append((e, s))
        self.stats.h2d_bytes += self.expert_bytes
        self.stats.copied_experts += 1

    def land(self, wait: bool = False) -> None:
        """Point the table at promotions whose copies have landed (all of them, waiting, with `wait`)."""
        if not self.landing:
            return
        cur = torch.cuda.current_stream(self.device)
        still = []
        for e, s in self.landing:
            if wait:
                self.stats.wait(cur, self.ready[s])
            elif not self.ready[s].query():
                still.append((e, s))
                continue
            self.slot_of[e] = s
            self._point(e, s)
        self.landing = still

    def _forward_mapped(self, x, topk_ids, topk_weights):
        from ferrylm.layers.context import live_assignments, live_rows
        from ferrylm.layers.fused_moe import expert_rows, sum_rows

        tally_step(self.counts, self.hits, self.in_slot, topk_ids, live_assignments(topk_ids))
        T, k = topk_ids.shape
        if self.host_decode is None:
            return sum_rows(expert_rows(x, self.t13, self.t2, topk_ids, topk_weights), k)
        hd, E = self.host_decode, self.in_slot.numel()
        live = live_rows()  # a padded graph step: the host computes the real rows only
        if self.split_cols is not None and not hd.copies:  # every miss split: the GPU's columns, then the host's
            c = self.split_cols
            miss = ~self.in_slot[topk_ids]  # [T, k]
            hd.send(self.layer, x, torch.where(miss, topk_ids, -1), topk_weights, cols=c, live=live)
            try:
                rows = expert_rows(x, self.t13, self.t2, torch.where(miss, E, topk_ids), topk_weights, skip=True)
                if c:
                    rows = rows + expert_rows(x, self.t13, self.t2, torch.where(miss, topk_ids, E), topk_weights,
                                              skip=True, inter=c)
            finally:
                host = hd.receive(T * k, x.device, self.layer)
            return sum_rows(rows + host, k)
        on = host_share(topk_ids, self.in_slot, self.prefer, self.share)  # [T, k]: assignments the host computes
        # every post is paired with its wait, whatever raises between them: an unpaired post would leave the
        # worker's `done` one ahead and every later layer would read the previous layer's rows
        if not hd.copies:
            hd.send(self.layer, x, torch.where(on, topk_ids, -1), topk_weights, live=live)
            try:
                rows = expert_rows(x, self.t13, self.t2, torch.where(on, E, topk_ids), topk_weights, skip=True)
            finally:
                host = hd.receive(T * k, x.device, self.layer)
            return sum_rows(rows + host, k)
        away = ~self.in_slot[topk_ids]  # [T, k]: the host's, or copied into scratch by its worker
        hd.send(self.layer, x, torch.where(on, topk_ids, -1), topk_weights, torch.where(away & ~on, topk_ids, -1),
                live=live)
        try:
            rows = expert_rows(x, self.t13, self.t2, torch.where(away, E, topk_ids), topk_weights, skip=True)
        finally:
            host = hd.receive(T * k, x.device, self.layer)
        rows = rows + expert_rows(x, hd.scratch13, hd.scratch2, hd.remap[topk_ids], topk_weights, skip=True)
        return sum_rows(rows + host, k)

    @property
    def fused(self) -> bool:
        from ferrylm.layers.fused_moe import FusedExperts

        return self.use_fused and FusedExperts.supports_tensors(self.w13, self.act_name, self.dtype)

    @property
    def host_experts(self):
        """The host bank's experts computed where they lie, in its own format (`offload/host_experts.py`)."""
        if self._host_experts is None:
            from ferrylm.offload.host_experts import HostExperts

            self._host_experts = HostExperts(self.host_w13, self.host_w2, self.act)
        return self._host_experts

    def _arrived(self, s: int, e: int, into=None) -> None:
        """Expert e just copied into slot s (enqueued) of this cache's slots (or `into`'s, the staging slots): if the
        host keeps it in its own int4 layout (`HostExperts.lay`), re-lay the slot's copy into the store's, on the
        same stream."""
        he, into = self._host_experts, into or self
        if he is not None and e in he.laid:
            he.arrived(into.w13, s, e)
            he.arrived(into.w2, s, e)

    def host_parts(self) -> list[torch.Tensor]:
        return [*_parts(self.host_w13).values(), *_parts(self.host_w2).values()]

    @property
    def slot_bytes(self) -> int:
        """Device bytes of this layer's own slots (a pool layer's: none; `SlotPool.nbytes`)."""
        return 0 if self.pool is not None else _nbytes(self.w13, self.w2)

    def _plan(self, counts: list[int], staged: set[int] = frozenset()):
        """Hits, the copied misses' queue, the slots free to take a miss now (policy order), host misses. `staged`
        experts (copied into staging slots already) are misses neither queued nor given to the host."""
        needed = [e for e, n in enumerate(counts) if n]
        need = set(needed)
        hits = [e for e in needed if e in self.slot_of]
        if self.trace is not None:
            self.trace.append(needed)
            self.trace_hits += len(hits)
        misses = [e for e in needed if e not in self.slot_of and e not in staged]
        on_cpu: list[int] = []
        if misses and self.cpu_mode != "gpu":
            misses, on_cpu = split_misses({e: counts[e] for e in misses}, self.costs, self.cpu_mode)
            he = self.host_experts
            cold = [] if self.cpu_mode == "cpu" else [e for e in on_cpu if not he.built(e)]
            if cold:  # auto: a packed miss the host should take whose whole-expert kernel is not built is copied
                # this step and its kernel built in the background (building it in the step costs more than its
                # copy: a split hybrid decode prepares column kernels only; session 15, Mixtral 32L int4 at batch
                # 16 ran 64.6 tok/s against 197.8 copy-only, its host experts built inside the steps)
                he.build_later(cold)
                unbuilt = [e for e in misses + on_cpu if not he.built(e)]
                misses, on_cpu = split_misses({e: counts[e] for e in misses + on_cpu if e not in unbuilt},
                                              self.costs, self.cpu_mode)
                misses = sorted(misses + unbuilt)
        pending = deque(misses)
        self.stats.expert_hits += len(hits)
        self.stats.expert_misses += len(pending) + len(on_cpu) + sum(counts[e] > 0 for e in staged)
        self.stats.add(cpu_experts=len(on_cpu))  # the host workers count too
        if misses or on_cpu:
            self.stats.cpu_share = len(on_cpu) / (len(misses) + len(on_cpu))
        self.policy.touch(needed)
        self.last_counts = counts
        cands = [s for s in range(self.capacity) if self.owner[s] not in need and self.owner[s] not in self.pinned]
        empty = [s for s in cands if self.owner[s] is None]
        avail = deque(empty + [self.slot_of[e] for e in self.policy.victims(
            [self.owner[s] for s in cands if self.owner[s] is not None])])
        return hits, pending, avail, on_cpu

    def _on_host(self, fn):
        """Start `fn()` (the step's host experts) on the CPU pool; returns its future."""
        import time

        def timed():  # inference mode is per thread: the step's tensors are inference tensors
            t = time.perf_counter()
            with torch.inference_mode():
                out = fn()
            self.stats.add(cpu_busy_s=time.perf_counter() - t)  # on the pool's thread
            return out

        if self.cpu_pool is None:  # the CPU engine: the "device" is these cores too, nothing to overlap
            from concurrent.futures import Future

            done = Future()
            done.set_result(timed())
            return done
        return self.cpu_pool.submit(timed)

    def _join(self, future):
        import time

        if future is None:
            return None
        t = time.perf_counter()
        done = future.result()
        self.stats.add(cpu_wait_s=time.perf_counter() - t)
        return done

    def _forward_fused(self, bank, x, topk_ids, topk_weights):
        """The fused kernel over the device slots, in rounds: the hits first (the misses' copies already
        flying), then each batch of landed misses. Rows add up to exactly the resident fused result."""
        from ferrylm.layers.fused_moe import expert_rows, sum_rows

        E = bank.num_experts
        T, k = topk_ids.shape
        if self.landing:  # promotions still flying own their slots but are not in slot_of yet: the plan below
            self.land(wait=True)  # would hand those slots to this step's misses (stream-ordered, no host wait)
        ids_host = _to_host(topk_ids)  # the layer's one host sync
        counts = torch.bincount(ids_host.flatten(), minlength=E).tolist()
        ring, staged = self.staging, self._staged(counts)
        hits, pending, avail, on_cpu = self._plan(counts, {e for e, _ in staged})
        one = self.one_large_a_round and self.expert_bytes >= self.large_expert_bytes
        inflight: list[tuple[int, int]] = []
        futures = None
        if on_cpu:  # one job: the host experts' weighted rows in the kernel's layout, the rest 0
            x_host, w_host = x.cpu(), topk_weights.cpu()
            mine = torch.zeros(E, dtype=torch.bool)
            mine[on_cpu] = True
            ids_cpu = torch.where(mine[ids_host], ids_host, -1)  # [T, k]
            rows_host = torch.empty(T * k, x.shape[1], dtype=x.dtype, pin_memory=x.is_cuda)  # crosses back async

            def host_rows():
                self.host_experts.rows(x_host, ids_cpu, w_host, rows_host)
                return rows_host

            futures = self._on_host(host_rows)

        def issue():
            while pending and avail:
                e, s = pending.popleft(), avail.popleft()
                self._fetch(e, s)
                inflight.append((e, s))
            if not pending and self._stages(T, k, E):  # this layer's last copy is queued
                self._stage_next()

        out = None
        cur = torch.cuda.current_stream(self.device)

        def run(experts: list[int], src=self, at: dict[int, int] | None = None):
            """One round: `experts` from `src`'s slots (the staging slots; `at`: expert -> slot; default this
            cache's)."""
            nonlocal out
            at, Cs = at or self.slot_of, src.capacity
            slot = [Cs] * E
            for e in experts:
                slot[e] = at[e]
            ids = to_device(slot, x.device)[topk_ids]
            rows = expert_rows(x, src.w13, src.w2, ids, topk_weights, skip=True, experts=E,
                               counts=round_counts(counts, slot, Cs))  # known here: nothing read back
            out = rows if out is None else out.add_(rows)  # in place: a round holds one [A, H] sum, not three
            for e in experts:
                src.free[at[e]].record(cur)

        issue()
        if hits and not pending and inflight and not staged and topk_ids.shape[0] <= self.single_round_tokens:
            # few tokens: the hits' compute is too short to hide anything; one round costs half the launches
            for e, s in inflight:
                self.stats.wait(cur, self.ready[s])
            run(hits + [e for e, _ in inflight])
            return sum_rows(self._add_host_rows(out, futures, T * k, x), k)
        # large experts one a round: its slot frees for the next copy while the copies already queued land, so the
        # copy engine streams the layer's misses back to back under their compute; small ones (copies shorter than
        # a round's launches) a round of all in flight
        if hits and one and self.free_hits_first and pending:
            first = [e for e in hits if e not in self.pinned]
            while first and pending:  # each computed hit's slot takes the next copy while the other hits compute
                e = first.pop(0)
                run([e])
                avail.append(self.slot_of[e])
                issue()
            hits = first + [e for e in hits if e in self.pinned]
        for e, s in staged:  # copied while the layer before computed its last misses: landed first
            self.stats.wait(cur, ring.ready[s])
            run([e], ring, {e: s})
        if self.borrowed:
            self._give_back()
            issue()  # the freed staging slots may take the next layer's experts now
        if hits:
            run(hits)
            if pending:
                avail.extend(self.slot_of[e] for e in hits if e not in self.pinned)
                issue()
        while inflight:
            batch, inflight[:] = (inflight[:1], inflight[1:]) if one else (list(inflight), [])
            for e, s in batch:
                self.stats.wait(cur, self.ready[s])
            run([e for e, _ in batch])
            if pending:
                avail.extend(s for _, s in batch)
                issue()
        if pending:
            raise RuntimeError(f"expert cache of layer {self.layer}: no evictable slot for experts {list(pending)}")
        return sum_rows(self._add_host_rows(out, futures, T * k, x), k)

    def link(self, nxt: CachedExperts, staging: StagingSlots) -> None:
        """On copy-road steps this layer stages experts of `nxt`, the next cached layer, in `staging` when their
        parts have the same shapes and types (the donor stages for none: its slots are taken after it ran)."""
        def like(c):
            return [_layout(c.w13), _layout(c.w2)]

        if like(self) == like(nxt) == like(staging.donor) and type(self.host_w13) is type(nxt.host_w13):
            self.next, self.staging = nxt, staging
            nxt.staging = staging
            staging.linked.update((self, nxt))

    def _staged(self, counts: list[int]) -> list[tuple[int, int]]:
        """(expert, staging slot) of the experts the layer before copied for this step that it routes to."""
        return [(e, s) for e, s in self.borrowed if counts[e] and self.staging.owner.get(s) == (self.layer, e)]

    def _stages(self, T: int, k: int, E: int) -> bool:
        """Whether this step stages the next layer's experts: linked (large experts: `link`), not the donor, a next layer that copies its
        misses (not `experts=cpu`), a slot to stage in, at least `stage_min_tokens` tokens, and so many that an
        expert is left unrouted with probability under 2% (uniform routing: (1 - k/E)^T; Mixtral from 14 tokens)."""
        return bool(self.next is not None and self is not self.staging.donor and self.next.cpu_mode != "cpu"
                    and T >= self.stage_min_tokens and self.staging.can_stage() and (1 - k / E) ** T < 0.02)

    def _stage_next(self) -> None:
        """Staging slots <- experts the next layer lacks, the most routed in its last step first (at these token
        counts all are routed); queued on the copy stream behind this layer's misses."""
        nxt, ring = self.next, self.staging
        E = nxt.host_w13.shape[0]
        last = nxt.last_counts or [0] * E
        while True:
            have = set(nxt.slot_of) | {e for e, _ in nxt.borrowed}
            want = [e for e in range(E) if e not in have]
            s = ring.slot() if want else None
            if s is None:
                return
            e = min(want, key=lambda e: (-last[e], e))
            ring.owner[s] = (nxt.layer, e)
            if self.stream is None:  # the CPU engine: the "device" tier is host memory, copied at once
                _copy(ring.w13, s, nxt.host_w13, e)
                _copy(ring.w2, s, nxt.host_w2, e)
                nxt._arrived(s, e, into=ring)
            else:
                self.stream.wait_event(ring.free[s])  # its last round has read it
                with torch.cuda.stream(self.stream):
                    _copy(ring.w13, s, nxt.host_w13, e, non_blocking=True)
                    _copy(ring.w2, s, nxt.host_w2, e, non_blocking=True)
                    nxt._arrived(s, e, into=ring)
                    ring.ready[s].record(self.stream)
            nxt.borrowed.append((e, s))
            self.stats.add(staged_experts=1, h2d_bytes=nxt.expert_bytes, copied_experts=1)

    def _give_back(self) -> None:
        """This layer's staging slots free again (a staged expert this step did not route to was copied for
        nothing: `staged_unused`); reads queued before now finish first (`free`)."""
        if not self.borrowed:
            return
        ring = self.staging
        for e, s in self.borrowed:
            if ring.owner.get(s) == (self.layer, e):
                ring.owner[s] = None
                if self.stream is not None:
                    ring.free[s].record(torch.cuda.current_stream(self.device))
        routed = sum(self.last_counts[e] > 0 for e, _ in self.borrowed) if self.last_counts else 0
        self.stats.add(staged_unused=len(self.borrowed) - routed)
        self.borrowed = []

    def _add_host_rows(self, out, future, A: int, x):
        if future is None:
            return out
        rows = self._join(future).to(x.device, non_blocking=True)  # [A, H]
        return rows if out is None else out.add_(rows)

    def start_trace(self) -> None:
        self.trace, self.trace_hits = [], 0
        self.trace_initial = [e for e in self.owner if e is not None]

    @property
    def capacity(self) -> int:
        return len(self.owner)

    @property
    def kept(self) -> int:
        """Experts this layer keeps on the device from step to step: its slots (a pool layer: none)."""
        return 0 if self.pool is not None else self.capacity

    @property
    def copy_slots(self) -> int:
        """Slots a copied miss can take: those not held by a pinned expert (0: every miss runs on the host)."""
        return self.capacity - len(self.pinned)

    def _fetch(self, e: int, s: int) -> None:
        old = self.owner[s]
        if old is not None:
            del self.slot_of[old]
            if self.mapped:  # (a copy-road step: its rounds read slots, not the table, which `_repoint` sets after)
                self.free[s].record(torch.cuda.current_stream(self.device))
        self.owner[s], self.slot_of[e] = e, s
        self.stats.copied_experts += 1
        if self.stream is None:
            _copy(self.w13, s, self.host_w13, e)
            _copy(self.w2, s, self.host_w2, e)
            self._arrived(s, e)
        else:
            self.stream.wait_event(self.free[s])  # the slot's previous expert has finished computing
            with torch.cuda.stream(self.stream):
                _copy(self.w13, s, self.host_w13, e, non_blocking=True)
                _copy(self.w2, s, self.host_w2, e, non_blocking=True)
                self._arrived(s, e)
                self.ready[s].record(self.stream)
        self.stats.h2d_bytes += self.expert_bytes

    def _compute(self, bank, x, e: int, rows: torch.Tensor, s: int, wait: bool, src=None,
                 cap: int | None = None) -> torch.Tensor:
        """Expert e over `rows` of x from slot s of this cache (or of `src`, the staging slots), at most `cap` rows
        at once (`moe.expert_row_cap`, as the resident backends split)."""
        src = src or self
        if wait and self.stream is not None:
            cur = torch.cuda.current_stream(self.device)
            self.stats.wait(cur, src.ready[s])
        if self.packed:  # the plain path: slot s decoded (fused_moe's reference dequantizers)
            w13, w2 = (side.expert(s).dequantize(x.dtype)[0] for side in (src.w13, src.w2))
        else:
            w13, w2 = src.w13[s], src.w2[s]
        y = expert_mlp(x[rows], w13, w2, bank.act, cap)
        if self.stream is not None:
            src.free[s].record(torch.cuda.current_stream(self.device))
        return y

    def warm_experts(self) -> list[int]:
        # the experts on the device: a warm-up's hits round as full as it can be (a pool layer keeps none)
        return [] if self.pool is not None else list(self.slot_of)

    def forward(self, bank, x, topk_ids, topk_weights):
        out = self._forward(bank, x, topk_ids, topk_weights)
        if self.layer_done is not None:  # every road: a promotion's copy waits for this record
            self.layer_done.record(torch.cuda.current_stream(self.device))
        return out

    def _forward(self, bank, x, topk_ids, topk_weights):
        if self.pool is not None:
            self.pool.claim(self)
        ring = self.staging
        if ring is not None and ring.donor is self:
            if ring.taken:  # held since a pass that stopped midway
                for c in ring.linked:
                    c.borrowed = []
                ring.release()
            ring.wait_restored()  # the copies back into this layer's slots land before its rounds read them
        try:
            return self._forward_road(bank, x, topk_ids, topk_weights)
        finally:
            self._give_back()  # staged experts this step's road did not compute
            if ring is not None and self.next is None:  # the step's last cached layer
                ring.release()


    def _forward_road(self, bank, x, topk_ids, topk_weights):
        if self.mapped:
            if topk_ids.shape[0] <= self.mapped_tokens:
                return self._forward_mapped(x, topk_ids, topk_weights)
            # the copy road: its steps feed no counts to the tally and it fetches what it needs; the slot policy
            # must not promote back, on stale scores, what its waves evicted (session 13: Mixtral NF4 at batch 16
            # moved 14.2 GB a step here against a copy-only cache's 9.9 at a like hit rate). Not yet re-measured.
            self.copied_step = True
            self.land(wait=True)  # the rounds below treat slots as landed
            out = self._forward_fused(bank, x, topk_ids, topk_weights)
            if self.pool is not None:  # decode steps read this layer's experts in place, never from the pool
                self.pool.leave(self)
            self._repoint()  # every copy of the step has been waited for by now
            return out
        if self.fused:
            return self._forward_fused(bank, x, topk_ids, topk_weights)
        counts, rows, order = dispatch(topk_ids, bank.num_experts)  # the layer's one host sync
        w_sorted = topk_weights.flatten()[order].to(x.dtype)
        starts, acc = [], 0
        for n in counts:
            starts.append(acc)
            acc += n
        ring, staged, (T, k), E = self.staging, self._staged(counts), topk_ids.shape, bank.num_experts
        cap = row_cap(x, T * k, E)
        hits, pending, avail, on_cpu = self._plan(counts, {e for e, _ in staged})
        inflight: deque[tuple[int, int]] = deque()
        future = None
        if on_cpu:  # per expert, unweighted: `combine` weighs and adds them in expert order like every backend
            x_host, rows_host = x.cpu(), rows.cpu()
            host = self.host_experts
            future = self._on_host(lambda: host.outputs(x_host, {e: rows_host[starts[e]:starts[e] + counts[e]]
                                                                 for e in on_cpu}))

        def issue():
            while pending and avail:
                e, s = pending.popleft(), avail.popleft()
                self._fetch(e, s)
                inflight.append((e, s))
            if not pending and self._stages(T, k, E):
                self._stage_next()

        def rows_of(e):
            return rows[starts[e]:starts[e] + counts[e]]

        issue()
        outputs = {}
        for e, s in staged:  # copied by the layer before, into the staging slots
            outputs[e] = self._compute(bank, x, e, rows_of(e), s, wait=True, src=ring, cap=cap)
        if self.borrowed:
            self._give_back()
            issue()  # the freed staging slots may take the next layer's experts now
        for e in hits:
            s = self.slot_of[e]
            outputs[e] = self._compute(bank, x, e, rows_of(e), s, wait=False, cap=cap)
            if pending and e not in self.pinned:  # waves: a computed expert's slot takes the next miss
                avail.append(s)
                issue()
        while inflight:
            e, s = inflight.popleft()
            outputs[e] = self._compute(bank, x, e, rows_of(e), s, wait=True, cap=cap)
            if pending:
                avail.append(s)
                issue()
        if pending:
            raise RuntimeError(f"expert cache of layer {self.layer}: no evictable slot for experts {list(pending)}")
        for e, y in (self._join(future) or {}).items():
            outputs[e] = to_device(y, x.device)
        return combine(x, counts, rows, w_sorted, outputs)
