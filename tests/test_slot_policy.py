"""The mapped caches' slot policy (`offload/slot_policy.py`) on traces: synthetic ones and one recorded by the
engine's trace recorder from a random-weight MoE decoding on the CPU. The replay keeps its slot books
straight, never beats the oracle, and the dueling policy follows whichever knob set suits the routing."""

import random

import pytest
import torch

from ferrylm.offload.expert_cache import belady_hits, simulate
from ferrylm.offload.slot_policy import FREQUENT, RECENT, DuelingPolicy, PromotionPolicy, replay_mapped

E, K = 32, 4


def zipf(steps, seed, skew=1.2):
    rng = random.Random(seed)
    w = [1 / (r + 1) ** skew for r in range(E)]
    perm = rng.sample(range(E), E)
    out = []
    for _ in range(steps):
        need: set[int] = set()
        while len(need) < K:
            need.add(perm[rng.choices(range(E), w)[0]])
        out.append(sorted(need))
    return out


def sticky(steps, seed, keep=0.9):
    rng = random.Random(seed)
    cur = rng.sample(range(E), K)
    out = []
    for _ in range(steps):
        cur = [e if rng.random() < keep else None for e in cur]
        free = [e for e in range(E) if e not in cur]
        cur = [e if e is not None else free.pop(rng.randrange(len(free))) for e in cur]
        out.append(sorted(cur))
    return out


def uniform(steps, seed):
    rng = random.Random(seed)
    return [sorted(rng.sample(range(E), K)) for _ in range(steps)]


def test_choose_follows_the_margin_and_the_books():
    pol = PromotionPolicy(1, 6, decay=1.0, margin=2.0, floor=1.0, per_layer=2)
    resident = torch.tensor([[True, True, False, False, False, False]])
    pinned = torch.tensor([[True, False, False, False, False, False]])
    pol.observe(torch.tensor([[0.0, 1.0, 2.0, 4.0, 0.0, 0.0]]))
    # 4 > 2 x 1 + 1 beats the one evictable resident (1; 0 is pinned); 2 has nothing left to replace
    assert pol.choose(resident, pinned, [set()], [0]) == [(0, 3, 1)]
    assert pol.choose(resident, pinned, [{3}], [0]) == []  # in flight: not chosen twice
    # an empty slot takes the hottest; then 2 does not beat 2 x 1 + 1
    assert pol.choose(resident, pinned, [set()], [1]) == [(0, 3, None)]
    pol.observe(torch.tensor([[0.0, 0.0, 4.0, 0.0, 0.0, 0.0]]))  # now 6 > 3: two pairs, the coldest victim first
    assert pol.choose(resident, pinned, [set()], [1]) == [(0, 2, None), (0, 3, 1)]



def choose_plainly(pol, resident, pinned, busy, empty):
    """`PromotionPolicy.choose` spelt out element by element over every row (the reference its list-based
    loop must equal)."""
    out = []
    for i in range(pol.score.shape[0]):
        score, n = pol.score[i].tolist(), min(pol.per_layer, pol.score.shape[1])
        missing = sorted((e for e in range(len(score)) if not resident[i, e]), key=lambda e: -score[e])[:n]
        evictable = sorted((e for e in range(len(score)) if resident[i, e] and not pinned[i, e]),
                           key=lambda e: score[e])
        flying, free, j = len(busy[i]), empty[i], 0
        for e in missing:
            if flying >= n or score[e] <= 0 or e in busy[i]:
                break
            if free:
                out.append((i, e, None))
                free -= 1
            elif j < len(evictable) and score[e] > pol.margin * score[evictable[j]] + pol.floor:
                out.append((i, e, evictable[j]))
                j += 1
            else:
                break
            flying += 1
    return out


def test_choose_equals_the_plain_reference():
    g = torch.Generator().manual_seed(0)
    for knobs in (FREQUENT, RECENT):
        for _ in range(30):
            L = 6
            pol = PromotionPolicy(L, E, **knobs)
            # distinct scores (ties order differently in topk and sorted), some rows all zero
            pol.score = torch.randperm(L * E, generator=g).float().reshape(L, E) * (torch.rand(L, 1, generator=g) > 0.3)
            resident = torch.rand(L, E, generator=g) < 0.25
            pinned = resident & (torch.rand(L, E, generator=g) < 0.3)
            busy = [set(torch.randint(0, E, (int(torch.randint(0, 3, (1,), generator=g)),), generator=g).tolist())
                    for _ in range(L)]
            empty = torch.randint(0, 2, (L,), generator=g).tolist()
            assert pol.choose(resident, pinned, busy, empty) == choose_plainly(pol, resident, pinned, busy, empty)

@pytest.mark.parametrize("lag,land", [(2, 2), (1, 0), (0, 0)])
def test_replay_keeps_books_and_stays_under_the_oracle(lag, land):
    traces = [zipf(300, 1), sticky(300, 2), uniform(300, 3)]
    C = 6
    init = [list(range(C))] * 3
    for kn in (FREQUENT, RECENT, {"dueling": True}):
        r = replay_mapped(traces, E, [C] * 3, init, pinned=[{0}, set(), set()], lag=lag, land_lag=land, **kn)
        assert r.accesses == 300 * 3 * K
        assert r.in_place == r.accesses - r.hits
        best = sum(belady_hits(tr, C, init[0], bypass=True)[0] for tr in traces)
        assert r.hits <= best  # hits of delayed fills never beat the optimal demand cache with free fills
    # the replay checks its own books each step (capacity, pinned experts resident)
    rep = replay_mapped([zipf(200, 5)], E, [4], [[0, 1, 2, 3]], pinned=[{0, 1}], lag=1, land_lag=0,
                        **{**RECENT, "per_layer": 8})
    assert rep.promotions > 0


def test_bypass_oracle_bounds_the_copy_oracle():
    for tr in (zipf(300, 7), sticky(300, 8), uniform(300, 9)):
        for C in (3, 6, 12):
            copy, byp = belady_hits(tr, C)[0], belady_hits(tr, C, bypass=True)[0]
            assert simulate(tr, C, "lru")[0] <= copy <= byp


def test_dueling_follows_the_better_knob_set():
    """Frequency with hysteresis wins on skewed routing, recency on routing that repeats; the dueling policy
    moves about as few experts as the better one on each, and far fewer than the worse one."""
    C, L = 6, 2
    init = [list(range(C))] * L
    for name, make in (("zipf", zipf), ("sticky", sticky), ("uniform", uniform)):
        traces = [make(400, 10 + i) for i in range(L)]
        moved = {p: replay_mapped(traces, E, [C] * L, init, **kn).crossings
                 for p, kn in (("frequent", FREQUENT), ("recent", RECENT), ("dueling", {"dueling": True}))}
        print(f"{name}: experts over PCIe {moved}")
        best, worst = min(moved["frequent"], moved["recent"]), max(moved["frequent"], moved["recent"])
        assert moved["dueling"] <= best * 1.08 and moved["dueling"] < worst * 0.9, (name, moved)


def test_dueling_shadow_books():
    resident = torch.zeros(2, E, dtype=torch.bool)
    resident[:, :4] = True
    pinned = torch.zeros(2, E, dtype=torch.bool)
    pinned[0, 0] = True
    pol = DuelingPolicy(2, E, resident, pinned, [2, 0])
    for need in sticky(100, 4):
        counts = torch.zeros(2, E)
        counts[:, need] = 1.0
        pol.observe(counts)
        for res in pol.resident:
            assert int(res[0].sum()) <= 6 and int(res[1].sum()) <= 4  # 4 residents + 2 empty slots, 4 + 0
            assert bool(res[0, 0])  # pinned stays in every shadow
    assert pol.leader.tolist() == [1, 1]  # repeating routing: recency leads


TINY_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512,
            "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 16, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_experts": E, "num_experts_per_tok": K,
            "norm_topk_prob": True, "num_hidden_layers": 2, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "max_position_embeddings": 1024, "tie_word_embeddings": False}


def test_policy_on_a_recorded_trace():
    """A trace the engine recorded (copy path on the CPU, `start_trace`) from a random-weight Qwen3-MoE, prefill
    steps included: the replay of the mapped path on it keeps within the oracle, and dueling moves no more
    experts than frequency alone, give or take its switching (within 5%)."""
    from ferrylm import LLM, SamplingParams
    from ferrylm.weights.random_source import RandomSource

    llm = LLM(RandomSource(TINY_MOE, dtype=torch.float32), device="cpu", dtype="float32", place=("experts=cpu",),
              experts="gpu", max_model_len=256)
    caches = [c for _, c in sorted(llm.engine.runner.placed.caches.items())]
    for c in caches:
        c.start_trace()
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        prompt = torch.randint(0, 500, (8,), generator=g).tolist()
        llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0))
    traces = [c.trace for c in caches]
    assert len({len(t) for t in traces}) == 1 and len(traces[0]) == 3 * 32
    C = 6
    init = [list(range(C))] * len(traces)
    oracle = sum(belady_hits(tr, C, init[0], bypass=True)[0] for tr in traces)
    rows = {}
    for name, kn in (("frequent", FREQUENT), ("dueling", {"dueling": True})):
        r = replay_mapped(traces, E, [C] * len(traces), init, **kn)
        assert r.hits <= oracle
        rows[name] = r
        print(f"recorded trace, {C} of {E} slots: {name} hit {r.hit_rate:.3f}, {r.crossings} experts over PCIe "
              f"(oracle hit {oracle / r.accesses:.3f})")
    assert rows["dueling"].crossings <= rows["frequent"].crossings * 1.05  # on par; it wins where routing repeats


def test_tally_policy_names():
    """`RoutingTally.set_policy`: dueling, frequent; anything else is refused by name."""
    from types import SimpleNamespace

    from ferrylm.offload.routing_tally import RoutingTally

    tally = SimpleNamespace(resident=torch.zeros(2, E, dtype=torch.bool), pinned=torch.zeros(2, E, dtype=torch.bool),
                            _empty=lambda: [2, 2])
    RoutingTally.set_policy(tally, "dueling")
    assert isinstance(tally.policy, DuelingPolicy)
    RoutingTally.set_policy(tally, "frequent")
    assert isinstance(tally.policy, PromotionPolicy)
    for bad in ("dueling-w2", "lru"):
        with pytest.raises(ValueError, match="slot policy"):
            RoutingTally.set_policy(tally, bad)
