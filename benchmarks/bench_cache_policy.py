"""Slot policies of the mapped expert caches on routing traces (CPU, seconds): hit rate and experts crossing
PCIe per token for what the mapped path can do (counts that arrive late, a promotion costing one expert's
bytes on top of the in-place reads of the misses: `offload/slot_policy.py`) against the copy path (LRU,
every miss copied into a slot) and the oracles.

    python benchmarks/bench_cache_policy.py [--steps 300] [--out results.json]

Traces, one per layer: synthetic (uniform; Zipf 1.1 / 1.2 / 1.5 popularity over a random ranking of the
experts; "sticky": a sequence keeps each of its experts from one token to the next with probability 0.9,
a new request every 64 tokens) and recorded with the engine's trace recorder (`CachedExperts.start_trace`)
from random-weight Qwen3-MoE (128 experts, top-8) and Mixtral (8, top-2) models decoding on the CPU,
prefill steps included; the Qwen3 recording also carries, per layer and step, the experts the layer's
router picks from the previous layer's MoE input (the next-layer predictor).

Rows (lag: steps until a step's counts are read; land: steps until a promotion is resident after it is
decided, 0 when the next step waits for its copy):
- copy path: LRU, each miss copied then computed (one host sync per layer); Belady: the optimal eviction
  on the same trace, every miss cached (the oracle bench_offload reports); Belady+bypass: optimal when a
  miss may be read without being cached (the mapped path's own oracle).
- tally (lag 2, land 2): the engine before this change under async scheduling (counts read at the next
  step's launch, promotions pointed at once the host sees them landed).
- frequent / recent / dueling (lag 1, land 0): counts read when the step's tokens reach the host,
  promotions landed stream-ordered; fixed knobs or `DuelingPolicy` (the engine's default now).
- dueling, synchronous engine (lag 0): the same without async scheduling.
- profile: the hottest experts of the whole trace pinned, no promotions (an optimistic `--expert-profile`);
  with all but two slots pinned and dueling on the rest (what the engine does with a profile).
- predictor: the next layer's router on this layer's input picks experts, copied before the layer runs
  (needs a host sync per layer); LRU victims; misses read in place.
Ends with one JSON line (benchmarks/results.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import write_results  # noqa: E402

from ferrylm.offload.expert_cache import belady_hits, simulate  # noqa: E402
from ferrylm.offload.slot_policy import FREQUENT, RECENT, replay_mapped  # noqa: E402


def synthetic(kind: str, E: int, k: int, steps: int, layers: int, seed: int, skew: float = 1.0,
              keep: float = 0.9, request: int = 64) -> list[list[list[int]]]:
    """Per layer, per step, the experts one token needs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        p = torch.ones(E)
        if kind != "uniform":
            p[torch.randperm(E, generator=g)] = 1.0 / torch.arange(1, E + 1).float() ** skew
        tr, prev = [], None
        for t in range(steps):
            if kind == "sticky" and prev is not None and t % request:
                kept = [e for e in prev if torch.rand(1, generator=g).item() < keep]
                q = p.clone()
                q[kept] = 0
                cur = kept + (torch.multinomial(q, k - len(kept), generator=g).tolist() if len(kept) < k else [])
            else:
                cur = torch.multinomial(p, k, generator=g).tolist()
            tr.append(sorted(cur))
            prev = cur
        out.append(tr)
    return out


QWEN_TINY = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 2048,
             "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 32, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "num_experts": 128, "num_experts_per_tok": 8,
             "norm_topk_prob": True, "num_hidden_layers": 4, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
             "max_position_embeddings": 4096, "tie_word_embeddings": False}
MIXTRAL_TINY = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 2048,
                "hidden_size": 128, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4, "rms_norm_eps": 1e-5,
                "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": False}


def recorded(cfg: dict, requests: int, tokens: int, temperature: float, seed: int):
    """(traces, predicted) from a random-weight model decoding one request at a time on the CPU: the engine's
    per-layer trace of needed experts, and per layer and step the experts its router picks from the
    previous MoE layer's input (None for the first)."""
    from ferrylm import LLM, SamplingParams
    from ferrylm.layers.moe import Experts
    from ferrylm.weights.random_source import RandomSource

    llm = LLM(RandomSource(cfg, dtype=torch.float32, seed=seed), device="cpu", dtype="float32",
              place=("experts=cpu",), experts="gpu", max_model_len=1024)
    model = llm.engine.runner.model
    blocks = [m for m in model.modules() if hasattr(m, "gate") and isinstance(getattr(m, "experts", None), Experts)]
    k = cfg["num_experts_per_tok"]
    predicted: list[list[list[int]] | None] = [None] + [[] for _ in blocks[1:]]

    def hook(i):
        def pre(module, args):
            if i + 1 < len(blocks):  # the next layer's router on this layer's input: [T, E] -> top-k
                ids = blocks[i + 1].gate(args[0]).topk(k, dim=-1).indices
                predicted[i + 1].append(sorted(set(ids.flatten().tolist())))
        return pre

    handles = [b.register_forward_pre_hook(hook(i)) for i, b in enumerate(blocks)]
    caches = [c for _, c in sorted(llm.engine.runner.placed.caches.items())]
    for c in caches:
        c.start_trace()
    g = torch.Generator().manual_seed(seed)
    for r in range(requests):
        prompt = torch.randint(10, cfg["vocab_size"] - 10, (16,), generator=g).tolist()
        llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=temperature, seed=seed + r))
    for h in handles:
        h.remove()
    return [c.trace for c in caches], predicted


def predictor_replay(traces, predicted, capacity: int, k: int) -> tuple[int, int, int]:
    """(hits, accesses, crossings): before each layer runs, its predicted experts not in a slot are copied in
    (LRU victims outside the prediction); the misses left are read in place. Layers without a prediction
    follow LRU on miss."""
    hits = total = moved = 0
    for tr, pred in zip(traces, predicted):
        if pred is None:
            h, n = simulate(tr, capacity, "lru")
            hits, total, moved = hits + h, total + n, moved + n - h
            continue
        cached: list[int] = []  # least recently used first
        for need, p in zip(tr, pred):
            for e in p if len(p) <= k else ():  # one token: prefill steps copy their misses anyway
                if e in cached:
                    cached.remove(e)
                else:
                    free = [i for i, c in enumerate(cached) if c not in p]
                    if len(cached) >= capacity and not free:
                        continue
                    moved += 1
                    if len(cached) >= capacity:
                        cached.pop(free[0])
                cached.append(e)
            h = sum(e in cached for e in need)
            hits, total, moved = hits + h, total + len(need), moved + len(need) - h
            for e in need:  # recency of use
                if e in cached:
                    cached.remove(e)
                    cached.append(e)
    return hits, total, moved


def case(name: str, traces, E: int, k: int, capacity: int, predicted=None) -> list[dict]:
    L, S = len(traces), len(traces[0])
    init = [list(range(capacity))] * L  # the placement's first residents (ids 0..C-1)
    acc = sum(len(need) for tr in traces for need in tr)
    tokens = S  # one token a step for synthetic traces; recorded ones count prefill steps as steps too
    rows = []

    def row(policy, hits, moved, **extra):
        rows.append({"trace": name, "experts": E, "slots": capacity, "layers": L, "steps": S, "policy": policy,
                     "hit_rate": round(hits / acc, 4), "crossings_per_layer_step": round(moved / tokens / L, 3),
                     **extra})

    lru = sum(simulate(tr, capacity, "lru", init[0])[0] for tr in traces)
    row("copy path (LRU on miss)", lru, acc - lru, lag=0, land=0)
    opt = sum(belady_hits(tr, capacity, init[0])[0] for tr in traces)
    row("Belady (every miss cached)", opt, acc - opt, oracle=True)
    byp = sum(belady_hits(tr, capacity, init[0], bypass=True)[0] for tr in traces)
    row("Belady+bypass", byp, acc - byp, oracle=True)
    for policy, lag, land, kn in (("tally (before)", 2, 2, FREQUENT), ("frequent", 1, 0, FREQUENT),
                                  ("recent", 1, 0, RECENT), ("dueling", 1, 0, {"dueling": True}),
                                  ("dueling, sync engine", 0, 0, {"dueling": True})):
        r = replay_mapped(traces, E, [capacity] * L, init, lag=lag, land_lag=land, **kn)
        row(policy, r.hits, r.crossings, lag=lag, land=land, promotions_per_layer_step=round(r.promotions / S / L, 3))
    counts = [torch.bincount(torch.tensor([e for need in tr for e in need]), minlength=E) for tr in traces]
    hot = [c.topk(capacity).indices.tolist() for c in counts]
    r = replay_mapped(traces, E, [capacity] * L, hot, pinned=[set(h) for h in hot], lag=1, land_lag=0)
    row("profile (hottest pinned)", r.hits, r.crossings)
    if capacity > 2:  # the engine's profile pins the residents; the placement's extra slots (2) still follow
        pin = [set(h[:capacity - 2]) for h in hot]
        r = replay_mapped(traces, E, [capacity] * L, hot, pinned=pin, lag=1, land_lag=0, dueling=True)
        row("profile (C-2 pinned) + dueling", r.hits, r.crossings)
    if predicted is not None:
        h, n, moved = predictor_replay(traces, predicted, capacity, k)
        row("predictor (next-layer router)", h, moved, sync_per_layer=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t0 = time.perf_counter()
    E, k, S, L = 128, 8, a.steps, a.layers
    rows: list[dict] = []
    syn = {"uniform": dict(kind="uniform"), "zipf1.1": dict(kind="zipf", skew=1.1),
           "zipf1.2": dict(kind="zipf", skew=1.2), "zipf1.5": dict(kind="zipf", skew=1.5),
           "sticky0.9": dict(kind="sticky", keep=0.9)}
    for C in (6, 16):  # 6: Qwen3-30B-A3B bf16 under 8 GiB (`ferry plan`), 16: a roomier budget
        for name, kw in syn.items():
            rows += case(name, synthetic(E=E, k=k, steps=S, layers=L, seed=1, **kw), E, k, C)
    t_syn = time.perf_counter() - t0
    for temp in (0.0, 1.0):
        tr, pred = recorded(QWEN_TINY, 3, 48, temp, seed=3)
        for C in (6, 16):
            rows += case(f"qwen3-moe random, T={temp:g}", tr, 128, 8, C, pred)
        tr, _ = recorded(MIXTRAL_TINY, 3, 48, temp, seed=3)
        rows += case(f"mixtral random, T={temp:g}", tr, 8, 2, 3)
    head = f"{'trace':26s} {'slots':>5s} {'policy':32s} {'hit':>6s} {'x/layer-step':>12s}"
    print(head)
    for r in rows:
        print(f"{r['trace']:26s} {r['slots']:5d} {r['policy']:32s} {r['hit_rate']:6.3f} "
              f"{r['crossings_per_layer_step']:12.2f}")
    print(f"synthetic {t_syn:.1f} s, total {time.perf_counter() - t0:.1f} s")
    write_results("cache-policy", rows, out=a.out)


if __name__ == "__main__":
    main()
