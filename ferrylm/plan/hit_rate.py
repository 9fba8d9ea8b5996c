"""The expert hit rate a plan predicts: from the routing (uniform, a stated skew or a recorded expert profile),
the share of each step's experts the engine finds in a cached MoE layer's device slots.

The engine gives a cached layer C = R + S device slots (R resident experts from the placement, S extra slots:
`offload/placement.py`). Given an expert profile (`--expert-profile`, the engine's flag) the R hottest experts
of the profile start resident and are pinned (`offload/placed_weights.py`); without one nothing is pinned. The
other slots follow the routing:
- mapped decode steps (misses read in place): the routing tally (`offload/routing_tally.py`) promotes the
  hottest missing experts; its steady state is taken to be the hottest of the unpinned experts (its
  hysteresis, which keeps uniform routing from churning, makes this an upper estimate under weak skew);
- copy-path steps (larger batches, prefill): LRU eviction (the engine's default policy) over the unpinned
  slots, by Che's approximation: with per-step request probabilities q_e the characteristic time T solves
  sum_e (1 - (1 - q_e)^T) = free slots, and e is resident with probability 1 - (1 - q_e)^T.
A step of B tokens needs expert e with probability q_e = 1 - (1 - p_e)^B, p_e the share of tokens routed to e
(sum_e p_e = top_k; tokens independent). The hit rate is the engine's own figure (`PlacedWeights.stats`):
needed experts found resident over needed experts. Uniform routing gives C / E on both paths.

Popularity alone takes the tokens as independent; a sequence that reuses its experts from token to token finds
far more of them in its slots (a random-weight Qwen3-30B-A3B shape: 0.94 measured at batch 1 against 0.20 from
its popularity, docs/benchmarks.md). A profile with a `decode_trace` (`ferry profile`: one-token steps in order)
says how much: for mapped batch-1 decode steps `replayed` runs the engine's own slot policy on it
(`offload/slot_policy.replay_mapped`, the tally's dueling policy), which gives the promotions a step makes too.

Knows nothing about bytes, hardware or speed.
"""

from __future__ import annotations

import functools

import math
from dataclasses import dataclass

from ferrylm.errors import ConfigError


@dataclass(frozen=True)
class Routing:
    """Per MoE layer, the share of tokens routed to each expert; how the engine's slots treat them."""

    shares: dict[int, tuple[float, ...]] | None
    """layer -> p_e (sums to top_k); None: uniform."""
    pinned: bool
    """The engine is given this profile: each layer's R hottest experts are resident and pinned."""
    source: str
    """Where the routing came from, in words (printed beside the hit rate)."""
    traces: dict[int, list[list[int]]] | None = None
    """layer -> the experts of each one-token decode step in order (a profile's `decode_trace`), or None."""

    def of(self, layer: int) -> tuple[float, ...] | None:
        return None if self.shares is None else self.shares.get(layer)


UNIFORM = Routing(None, False, "uniform routing")
MODEL = "slots following the routing: the tally's hottest experts on the mapped path, LRU (Che) on the copy path"
"""How `hit_rate` fills the slots, in words (printed beside the figure)."""


def routing(spec: str | None, profile: str | None, architecture: str, num_experts: int, top_k: int,
            moe_layers: list[int], pin: bool = True) -> Routing:
    """The plan's routing: `profile` (the engine's --expert-profile: pinned, unless `pin` is False: a placement
    without slots a layer, where the engine makes them resident but pins none) or `spec` (`--routing`: uniform,
    zipf:S, or a recorded profile FILE the engine is not given). Raises `ConfigError` naming what is wrong."""
    if profile is not None and spec is not None:
        raise ConfigError("give --expert-profile (the engine pins its hottest experts) or --routing, not both")
    if num_experts == 0:
        if profile is not None or spec not in (None, "uniform"):
            raise ConfigError(f"{'--expert-profile' if profile else '--routing'}: this model has no experts to route")
        return UNIFORM
    if profile is not None:
        shares = _profile_shares(profile, "--expert-profile", architecture, num_experts, top_k, moe_layers)
        traces = _profile_traces(profile, "--expert-profile", num_experts, moe_layers)
        how = ("pinned, as the engine pins them" if pin else
               "resident, not pinned: the layers keep no slots besides them, as the engine places them")
        return Routing(shares, pin, f"expert profile {profile} (recorded; its hottest experts {how}{_traced(traces)})",
                       traces)
    if spec is None or spec == "uniform":
        return UNIFORM
    if spec.startswith("zipf:"):
        try:
            s = float(spec[5:])
        except ValueError:
            s = -1.0
        if not 0 <= s <= 10 or math.isnan(s):
            raise ConfigError(f"--routing {spec!r}: zipf:S wants an exponent S between 0 and 10, e.g. zipf:1.2")
        one = tuple(_scaled([r ** -s for r in range(1, num_experts + 1)], top_k))
        return Routing({l: one for l in moe_layers}, False, f"stated skew {spec} (--routing; the slots follow it, "
                                                          "nothing pinned)")
    if spec.endswith(".json") or "/" in spec:
        shares = _profile_shares(spec, "--routing", architecture, num_experts, top_k, moe_layers)
        traces = _profile_traces(spec, "--routing", num_experts, moe_layers)
        return Routing(shares, False, f"routing of profile {spec} (--routing; the engine not given it: nothing "
                                      f"pinned{_traced(traces)})", traces)
    raise ConfigError(f"--routing {spec!r}: choose uniform, zipf:S (e.g. zipf:1.2) or a profile FILE.json "
                      "written by `ferry profile`")


def _profile_shares(path: str, flag: str, architecture: str, num_experts: int, top_k: int,
                    moe_layers: list[int]) -> dict[int, tuple[float, ...]]:
    from ferrylm.offload import expert_profile

    try:
        counts = expert_profile.parse(path, architecture, num_experts, moe_layers, _loaded(path))
    except ValueError as e:
        raise ConfigError(f"{flag} {path}: {e}") from None
    if not any(sum(v) for v in counts.values()):
        raise ConfigError(f"{flag} {path}: it holds no routed assignments (every count is 0)")
    # a layer with no counts says nothing about its routing: uniform there
    return {l: tuple(_scaled(v, top_k)) if sum(v) else tuple([top_k / num_experts] * num_experts)
            for l, v in counts.items()}


def _profile_traces(path: str, flag: str, num_experts: int, moe_layers: list[int]) -> dict | None:
    from ferrylm.offload import expert_profile

    try:
        return expert_profile.parse_trace(path, num_experts, moe_layers, _loaded(path))
    except ValueError as e:
        raise ConfigError(f"{flag} {path}: {e}") from None


def _loaded(path: str):
    """A profile's JSON, read once per version of the file (a plan reads it for the shares and the trace, and again
    in each sub-plan of its advice)."""
    import os

    try:
        st = os.stat(path)
    except OSError:
        return None  # `parse` names the error
    return _load_cached(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, mtime_ns: int, size: int):
    from ferrylm.offload import expert_profile

    return expert_profile.load(path)


def _traced(traces: dict | None) -> str:
    if not traces:
        return ""
    return (f"; batch-1 steps replayed on its decode trace of {len(next(iter(traces.values())))} steps by the "
            "engine's slot policy")


WARMUP_STEPS = 32
"""Steps of a replay left out of its figures (the slots settling from their initial fill); a quarter of a
shorter trace."""


def replayed(route: Routing, layers: dict[int, tuple[int, int]], num_experts: int) -> dict[int, tuple[float, float]]:
    """Mapped batch-1 decode steps on the routing's decode trace: layer -> (hit rate, promotion copies a step),
    by the engine's own slot policy (`offload/slot_policy.replay_mapped`: the dueling policy, counts read one
    step late, promotions landing before the next step). Batch 1 only: the trace is one sequence at a time, and
    copies of it side by side would stand for sequences far more alike than independent ones (the planner
    prices larger batches by popularity). layers: cached layer -> (resident experts R, device slots C); pinned
    routing pins each layer's R hottest (by the profile's counts) as the engine does, else the first R start
    resident, unpinned."""
    from ferrylm.offload.slot_policy import replay_mapped

    rows = sorted(layers)
    steps = [route.traces[l] for l in rows]
    S = len(steps[0])
    initial, pinned = [], []
    for l in rows:
        R = layers[l][0]
        shares = route.of(l)
        first = (sorted(range(num_experts), key=lambda e: (-shares[e], e))[:R] if route.pinned and shares
                 else list(range(R)))
        initial.append(first)
        pinned.append(set(first) if route.pinned else set())
    r = replay_mapped(steps, num_experts, [layers[l][1] for l in rows], initial, pinned=pinned, lag=1, land_lag=0,
                      dueling=True, warmup=WARMUP_STEPS if S >= 4 * WARMUP_STEPS else S // 4)
    return {l: (r.row_hits[i] / r.row_accesses[i] if r.row_accesses[i] else 1.0, r.row_promotions[i] / max(1, r.steps))
            for i, l in enumerate(rows)}


def flat(shares: tuple[float, ...] | None) -> bool:
    """Whether a layer's routing shares are uniform (None: no shares, uniform routing)."""
    return shares is None or max(shares) - min(shares) <= 1e-9


SAMPLED_STEPS = 256
"""Decode steps of independent tokens `sampled_promotions` replays (a quarter of them warm-up)."""


def sampled_promotions(route: Routing, layers: dict[int, tuple[int, int]], num_experts: int,
                       top_k: int) -> dict[int, float]:
    """Promotion copies a mapped batch-1 step makes in each cached layer where no decode trace is given: the engine's
    slot policy (as `replayed`: the R hottest pinned under pinned routing, else the first R resident) on SAMPLED_STEPS
    independent tokens, each drawing `top_k` distinct experts with the layer's shares as their chances (uniform
    where it has none). One run per layer shape (resident R, device slots C) and routing: the policy keeps a row's
    state to itself. The draws are common to every routing of a shape (the same seed), so a plan moves smoothly with
    the skew. Replaced a fixed 0.55 copies an in-place miss fitted on a Qwen3 trace (session 37: the 8-layer bf16
    Mixtral under 12 GiB on an H100 made 0.74 copies a step at uniform routing, where that said 2.8 and this replay
    says ~0.5; its batch-1 decode had been predicted 23% slow). A stated `--expert-hit-rate` keeps the count per
    miss. Each layer with shares of its own (a profile without a decode trace) is a run of its own (~0.3 s at 128
    experts)."""
    out = {}
    for l, (R, C) in layers.items():
        shares = route.of(l)
        out[l] = _sampled_promotions(R, C, num_experts, top_k, None if flat(shares) else tuple(shares), route.pinned)
    return out


def sampled_tokens(shares: list[float] | tuple[float, ...], num_experts: int, top_k: int, n: int,
                   seed: int) -> list[list[int]]:
    """n independent tokens' experts: each draws systematically over a fresh random order of the experts (one uniform
    number, `top_k` points a unit apart on the shares laid end to end; shares sum to `top_k`, none above 1): exactly
    `top_k` distinct experts, each with its share as its chance."""
    import bisect
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        order = list(range(num_experts))
        rng.shuffle(order)
        ends, acc = [], 0.0
        for e in order:
            acc += shares[e]
            ends.append(acc)
        unit = ends[-1] / top_k  # 1, less rounding
        u = rng.random() * unit
        out.append(sorted({order[min(num_experts - 1, bisect.bisect_right(ends, u + j * unit))]
                           for j in range(top_k)}))
    return out


@functools.lru_cache(maxsize=None)
def _sampled_promotions(resident: int, capacity: int, num_experts: int, top_k: int,
                        shares: tuple[float, ...] | None, pinned: bool) -> float:
    """`sampled_promotions` of one layer shape and routing (cached: a plan and its advice's plans share them), on
    `sampled_tokens`: rows of SAMPLED_STEPS tokens, more of them where experts are few (a small layer's promotions
    are rare events: 2 rows of Mixtral's 8 experts moved 0.078 a step, 32 rows 0.071)."""
    from ferrylm.offload.slot_policy import replay_mapped

    E = num_experts
    rows = max(2, 128 // E)
    p = _scaled([1.0] * E if shares is None else list(shares), top_k)
    seed = resident * 1009 + capacity
    traces = [sampled_tokens(p, E, top_k, SAMPLED_STEPS, seed + r) for r in range(rows)]
    first = sorted(range(E), key=lambda e: (-p[e], e))[:resident] if pinned else list(range(resident))
    r = replay_mapped(traces, E, [capacity] * rows, [first] * rows, pinned=[set(first) if pinned else set()] * rows,
                      lag=1, land_lag=0, dueling=True, warmup=SAMPLED_STEPS // 4)
    return sum(r.row_promotions) / rows / max(1, r.steps)


def _scaled(weights: list[float], top_k: int) -> list[float]:
    """Weights -> per-token shares summing to top_k, none above 1 (a token picks an expert at most once): the
    excess of capped experts is spread over the others in proportion."""
    p = [float(w) for w in weights]
    capped: set[int] = set()
    while True:
        free = sum(p[e] for e in range(len(p)) if e not in capped)
        room = top_k - len(capped)
        p = [1.0 if e in capped else (p[e] * room / free if free else 0.0) for e in range(len(p))]
        over = {e for e, v in enumerate(p) if v > 1.0 + 1e-12}
        if not over:
            return p
        capped |= over


def needed(shares: tuple[float, ...] | None, num_experts: int, top_k: int, tokens: int) -> list[float]:
    """q_e: the probability a step of `tokens` tokens needs expert e."""
    p = shares if shares is not None else [top_k / num_experts] * num_experts
    return [1.0 - (1.0 - min(v, 1.0)) ** tokens for v in p]


def distinct(shares: tuple[float, ...] | None, num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts a layer routes a step of `tokens` tokens to."""
    return sum(needed(shares, num_experts, top_k, tokens)) if num_experts else 0.0


def hit_rate(shares: tuple[float, ...] | None, num_experts: int, top_k: int, resident: int, capacity: int,
             pinned: bool, tokens: int, mapped: bool) -> float:
    """Expected share of a step's needed experts found in the layer's `capacity` device slots (`resident` of
    them the placement's experts, pinned from the profile when `pinned`), slots following the routing by the
    tally (`mapped`) or by LRU (the copy path)."""
    q = needed(shares, num_experts, top_k, tokens)
    total = sum(q)
    if total == 0:
        return 1.0
    # hottest first, ties by index (as the engine picks a profile's hottest: key (-count, e))
    order = sorted(range(num_experts), key=lambda e: (-q[e], e))
    fixed = order[:resident] if pinned else []
    rest = order[len(fixed):]
    free = max(0, min(capacity, num_experts) - len(fixed))
    hits = sum(q[e] for e in fixed)
    if mapped:
        hits += sum(q[e] for e in rest[:free])
    else:
        hits += sum(q[e] * h for e, h in zip(rest, _lru_resident([q[e] for e in rest], free)))
    return min(1.0, hits / total)


def _lru_resident(q: list[float], slots: int) -> list[float]:
    """Che's approximation of LRU with `slots` slots under independent per-step requests q_e: the probability
    each item is resident when a step starts."""
    used = [v for v in q if v > 0]
    if slots <= 0:
        return [0.0] * len(q)
    if slots >= len(used):
        return [1.0 if v > 0 else 0.0 for v in q]
    always = sum(v >= 1 for v in q)
    if always >= slots:  # experts every step needs take the slots in turn
        return [slots / always if v >= 1 else 0.0 for v in q]

    def resident(T: float) -> list[float]:
        return [1.0 if v >= 1 else -math.expm1(T * math.log1p(-v)) if v > 0 else 0.0 for v in q]

    lo, hi = 0.0, 1.0
    while sum(resident(hi)) < slots:
        hi *= 2
    for _ in range(60):  # bisection on the characteristic time: sum of residency = slots
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(resident(mid)) < slots else (lo, mid)
    return resident(hi)
