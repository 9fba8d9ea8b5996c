"""Profile decode steps of an offloaded MoE (where does a batch-1 step's time go?).

    PYTHONPATH=. python3 benchmarks/profile_offload.py [--shape qwen3|mixtral] [--expert-quant nf4] [--layers 16]
        [--budget-gib 4] [--experts auto gpu cpu] [--profile]

One engine per `--experts` setting on the same random-weight Qwen3-30B-A3B shape and budget (the default is
`bench_plan.py`'s moe-offload case: 16 layers under 4 GiB, whose batch-1 hybrid decode the plan predicts 3.4x too
fast at the hit rate it sees, docs/benchmarks.md session 8). Per setting: the decode step time and per layer,
the expert hit rate, misses per layer, experts the host ran and the time the stream waited for it (`OffloadStats`),
and ms per missed expert over the fastest setting; decode steps alone (a run of n + 1 tokens less a run of 1). `--profile` adds the top host-side and device ops
per decode step (torch profiler; a run of 9 tokens less a run of 1, so the prefill drops out). `--prefill-tokens N`
times a fresh N-token prefill too (with `--profile`: its copies' device time and GB/s against its kernels; session 25:
the NF4 Mixtral's copy-path prefill runs ~2x the plan's layer-by-layer model). The last line is JSON.
"""

import argparse
import dataclasses
import gc
import json
import os
import tempfile
import time

import torch

from bench_offload import MIXTRAL, QWEN3_30B, prompts  # noqa: E402

SHAPES = {"qwen3": QWEN3_30B, "mixtral": MIXTRAL,
          # the 4-layer Mixtral `ferry plan --check` runs as a user (`device_steps.sh` write_mix4): 69 MB experts
          "mix4": {**MIXTRAL, "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
                   "max_position_embeddings": 4096}}


def run(experts: str, a, variant: str = "dueling:now") -> dict:
    """variant: the mapped caches' slot policy (dueling | frequent | none: no promotions), when a
    promotion lands (now: the next step waits for its copy | late: once the host sees it landed | stream: the copy
    stream points the table at it, nothing waits) and, with a
    third part "layer", when its copy starts (`CachedExperts.promote_after_layer`: once its layer of the queued
    step has run, not after the whole step)."""
    from ferrylm import LLM, SamplingParams
    from ferrylm.offload.expert_cache import CachedExperts
    from ferrylm.weights.random_source import RandomSource

    policy, land, *start = variant.split(":")
    CachedExperts.promote_after_layer = start == ["layer"]  # read as the caches are built
    try:
        llm = LLM(RandomSource({**SHAPES[a.shape], "num_hidden_layers": a.layers}, expert_quant=a.expert_quant),
                  device="cuda", dtype="bfloat16",
                  max_num_seqs=1, max_model_len=max(1024, a.prefill_tokens + 8), gpu_memory_budget=f"{a.budget_gib}GiB", experts=experts)
    finally:
        CachedExperts.promote_after_layer = False
    placed = llm.engine.runner.placed
    if placed.tally is not None:
        placed.tally.land_now = land == "now"
        placed.tally.land_on_copy_stream = land == "stream"
        if policy == "none":
            placed.tally._promote = lambda: None
        else:
            placed.tally.set_policy("dueling" if policy == "frozen" else policy)

    def timed(n: int, seed: int) -> tuple[float, dict]:
        """(seconds, the stats' counters) of a fresh 32-token prompt and n tokens."""
        placed.stats.reset()
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts(1, 32, seed), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        torch.cuda.synchronize()
        return time.perf_counter() - t, dataclasses.asdict(placed.stats)

    timed(a.warm, 1)  # warm: graphs, the worker's kernels, the tally's steady state
    if policy == "frozen" and placed.tally is not None:  # the slots the warm-up chose, no promotion after it
        placed.tally._promote = lambda: None
    t1, s1 = timed(1, 2)  # the prefill and its first token
    tn, sn = timed(a.tokens + 1, 3)
    d = {k: sn[k] - s1[k] for k in sn if isinstance(sn[k], (int, float))}  # the decode steps alone
    step = (tn - t1) / a.tokens
    seen = d["expert_hits"] + d["expert_misses"]
    steps = a.tokens
    out = dict(experts=experts, variant=variant, step_ms=step * 1e3, per_layer_ms=step * 1e3 / a.layers,
               hit_rate=d["expert_hits"] / seen if seen else None, misses_per_layer=d["expert_misses"] / steps / a.layers,
               cpu_experts_per_step=d["cpu_experts"] / steps, cpu_wait_ms_per_step=d["cpu_wait_s"] / steps * 1e3,
               cpu_busy_ms_per_step=d["cpu_busy_s"] / steps * 1e3, mapped_per_step=d["mapped_experts"] / steps,
               # the share hybrid decode runs (not the stats' gauge: the last copy-road step's split, here the prompt's)
               copied_per_step=d["copied_experts"] / steps, cpu_share=placed.cpu_share or 0.0,
               staging=placed.staging.n if placed.staging else 0,  # 0 where it does not apply, whatever --staging says
               calibration=placed.calibration)
    print(json.dumps({k: v for k, v in out.items() if k != "calibration"}), flush=True)
    if a.profile and variant == a.variants[0]:
        from torch.profiler import ProfilerActivity, profile

        def ops(max_tokens: int, seed: int) -> dict:
            """name -> [self host us, calls, self device us] of one fresh request of `max_tokens` tokens."""
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts(1, 32, seed), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
                torch.cuda.synchronize()
            timelines.append(timeline(prof))
            return {e.key: [e.self_cpu_time_total, e.count, e.self_device_time_total] for e in prof.key_averages()}

        n = 8  # decode steps profiled: a run of n + 1 tokens less a run of 1 (its prefill and first token)
        timelines: list[dict] = []
        one, more = ops(1, 4), ops(n + 1, 5)
        if timelines[0] and timelines[1]:  # the decode steps' share: the longer run's less the shorter one's
            step = {k: (timelines[1][k] - timelines[0][k]) / n for k in ("span_ms", "copy_ms", "kernel_ms", "both_ms",
                                                                          "idle_ms")}
            print(f"decode step timeline (ms a step): {json.dumps({k: round(v, 3) for k, v in step.items()})}; longest "
                  f"idle gaps of the longer run: {json.dumps(timelines[1]['longest_gaps'][:5])}", flush=True)
        per = {k: [(v[i] - one.get(k, [0, 0, 0])[i]) / n for i in range(3)] for k, v in more.items()}
        print(f"per decode step (profiled, times inflated): host {sum(v[0] for v in per.values()) / 1e3:.2f} ms "
              f"self, device {sum(v[2] for v in per.values()) / 1e3:.2f} ms")
        for title, i in (("self host us", 0), ("self device us", 2)):
            print(f"{'op':60s} {title:>14s} {'calls':>8s}")
            for k, v in sorted(per.items(), key=lambda kv: -kv[1][i])[:20]:
                print(f"{k[:60]:60s} {v[i]:14.1f} {v[1]:8.1f}")
    if a.prefill_tokens and variant == a.variants[0]:
        out["prefill"] = prefill_profile(llm, placed, a)
        if a.rounds_ab:
            out["prefill_rounds_ab"] = rounds_ab(llm, placed, a)
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a0, a1 in sorted(spans):
        if out and a0 <= out[-1][1]:
            out[-1][1] = max(out[-1][1], a1)
        else:
            out.append([a0, a1])
    return [tuple(x) for x in out]


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def _overlap(x, y) -> float:
    """Total length where two sorted disjoint span lists overlap."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


COPY_MIN_US = 10
"""A pinned host-to-device copy at least this long (device time) is an expert's (or a streamed weight's): a
Qwen3-30B-A3B expert, the smallest, takes ~170 us at 55 GB/s; the step's index and offset tensors, which cross
through pinned memory too (`layers/transfer.py`), take a few."""


def _device_events(prof) -> list:
    from torch.autograd import DeviceType

    return [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]


def _is_weight_copy(e) -> bool:
    return "Pinned -> Device" in e.name and e.time_range.end - e.time_range.start >= COPY_MIN_US


def _expert_copies(prof) -> list[tuple[float, float]]:
    """(start, end) in us of the weight copies a profile holds (`COPY_MIN_US`)."""
    return [(e.time_range.start, e.time_range.end) for e in _device_events(prof) if _is_weight_copy(e)]


def timeline(prof) -> dict:
    """Where a profiled step's device time goes, from the trace's device events (ms): the span from the first to
    the last device event, the weight copies' busy time (`COPY_MIN_US`), every other device op's (kernels, small
    copies, memsets), both at once, neither (the device idle), and the longest idle gaps with the host op that was
    running as each began (what the device waited for)."""
    events = _device_events(prof)
    copies = _union([(e.time_range.start, e.time_range.end) for e in events if _is_weight_copy(e)])
    work = _union([(e.time_range.start, e.time_range.end) for e in events if not _is_weight_copy(e)])
    busy = _union(copies + work)
    if not busy:
        return {}
    from torch.autograd import DeviceType

    t0, t1 = busy[0][0], busy[-1][1]
    gaps = sorted(((b[0] - a[1], a[1]) for a, b in zip(busy, busy[1:])), reverse=True)
    host = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == DeviceType.CPU and e.time_range.end > e.time_range.start)

    def host_at(t):  # the innermost host op open at time t
        best = None
        for a0, a1, name in host:
            if a0 > t:
                break
            if a1 >= t and (best is None or a0 >= best[0]):
                best = (a0, name)
        return best[1] if best else None

    return dict(span_ms=(t1 - t0) / 1e3, copy_ms=_length(copies) / 1e3, kernel_ms=_length(work) / 1e3,
                both_ms=_overlap(copies, work) / 1e3, idle_ms=(t1 - t0 - _length(busy)) / 1e3,
                idle_gaps=len(gaps), idle_over_100us=sum(1 for g, _ in gaps if g > 100),
                longest_gaps=[dict(ms=round(g / 1e3, 3), at_ms=round((t - t0) / 1e3, 2), host=host_at(t))
                              for g, t in gaps[:8]])


ROUNDS = {"each": (True, True), "misses": (True, False), "all": (False, False)}
"""`--rounds` mode -> (`CachedExperts.one_large_a_round`, `free_hits_first`)."""


def set_rounds(mode: str) -> None:
    from ferrylm.offload.expert_cache import CachedExperts

    CachedExperts.one_large_a_round, CachedExperts.free_hits_first = ROUNDS[mode]


def rounds_ab(llm, placed, a) -> dict:
    """Fresh `--prefill-tokens` prompts on this one engine, the copy-path round modes of `--rounds-ab` taking turns
    (`--ab-reps` prompts each; the class attributes are read per forward): seconds of each prompt by mode, so the
    modes see the same engine, slots and host state, and drift falls on all of them alike."""
    from ferrylm import SamplingParams
    from ferrylm.offload.expert_cache import CachedExperts

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    saved = CachedExperts.one_large_a_round, CachedExperts.free_hits_first
    times: dict[str, list[float]] = {m: [] for m in a.rounds_ab}
    copied: dict[str, list[int]] = {m: [] for m in a.rounds_ab}
    try:
        for rep in range(a.ab_reps):
            for i, mode in enumerate(a.rounds_ab):
                set_rounds(mode)
                placed.stats.reset()
                torch.cuda.synchronize()
                t = time.perf_counter()
                llm.generate(prompts(1, a.prefill_tokens, 100 + rep * len(a.rounds_ab) + i), params)
                torch.cuda.synchronize()
                times[mode].append(time.perf_counter() - t)
                copied[mode].append(placed.stats.copied_experts)
    finally:
        CachedExperts.one_large_a_round, CachedExperts.free_hits_first = saved
    res = {m: {"seconds": [round(x, 5) for x in v], "median_tok_s": a.prefill_tokens / sorted(v)[len(v) // 2],
               "copied_experts": copied[m]} for m, v in times.items()}
    print("prefill rounds A/B: " + ", ".join(f"{m} {r['median_tok_s']:.0f} tok/s (median of {len(times[m])}: "
                                             f"{', '.join(f'{x * 1e3:.1f}' for x in times[m])} ms)"
                                             for m, r in res.items()), flush=True)
    return res


def prefill_profile(llm, placed, a) -> dict:
    """A fresh prompt of `--prefill-tokens` tokens (its prefill and first token), timed twice after one untimed:
    tok/s, experts copied and bytes moved; with `--profile` the device's copies against its kernels (the copies'
    own GB/s: do the copy-path rounds copy at the link's rate, and how much of the step do they fill?)."""
    from ferrylm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    if a.prefill_tokens + 1 > llm.engine.max_model_len:
        raise SystemExit(f"--prefill-tokens {a.prefill_tokens}: more than the engine's max_model_len")
    runs = []  # (seconds, experts copied, bytes moved) of each fresh prompt (the prefix cache must not serve them)
    for seed in (10, 11, 12):
        placed.stats.reset()
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts(1, a.prefill_tokens, seed), params)
        torch.cuda.synchronize()
        st = placed.stats
        runs.append((time.perf_counter() - t, st.copied_experts, st.h2d_bytes, st.staged_experts, st.staged_unused))
    sec, copied, moved, staged, unused = min(runs[1:])  # the faster of the two after the first, with its own counts
    res = dict(tokens=a.prefill_tokens, seconds=sorted(r[0] for r in runs[1:]), tok_s=a.prefill_tokens / sec,
               copied_experts=copied, h2d_gb=moved / 1e9, h2d_gbs_over_step=moved / sec / 1e9,
               staged_experts=staged, staged_unused=unused)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        placed.stats.reset()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts(1, a.prefill_tokens, 13), params)
            torch.cuda.synchronize()
        ev = prof.key_averages()
        copies = _expert_copies(prof)
        copy_us = sum(b - a for a, b in copies)
        res.update(copy_ms=copy_us / 1e3, copy_calls=len(copies),
                   copy_gbs=placed.stats.h2d_bytes / (copy_us * 1e-6) / 1e9 if copy_us else None)
        print(f"prefill of {a.prefill_tokens} tokens (profiled): copies {copy_us / 1e3:.1f} ms of device time in "
              f"{res['copy_calls']} calls, {res['copy_gbs'] or 0:.1f} GB/s of expert bytes over them", flush=True)
        print(f"{'op':60s} {'self device us':>14s} {'calls':>8s}")
        for e in sorted(ev, key=lambda e: -e.self_device_time_total)[:16]:
            print(f"{e.key[:60]:60s} {e.self_device_time_total:14.1f} {e.count:8d}")
        res["timeline"] = timeline(prof)
        print(f"prefill timeline: {json.dumps(res['timeline'])}", flush=True)
        if a.trace:
            import gzip

            with tempfile.TemporaryDirectory() as d:
                raw = os.path.join(d, "trace.json")
                prof.export_chrome_trace(raw)
                with open(raw, "rb") as f, gzip.open(a.trace, "wb") as g:
                    g.write(f.read())
    print(json.dumps({"prefill": res}), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-gib", type=float, default=4)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3", help="bench_offload's model shape")
    ap.add_argument("--expert-quant", default=None, help="experts packed in this format (nf4, int8, ...)")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per setting")
    ap.add_argument("--experts", nargs="+", default=["auto", "gpu", "cpu"], choices=["auto", "gpu", "cpu"])
    ap.add_argument("--profile", action="store_true", help="torch profiler tables of the first variant's steps")
    ap.add_argument("--warm", type=int, default=4, help="tokens decoded before timing (the tally's warm-up)")
    ap.add_argument("--prefill-tokens", type=int, default=0,
                    help="also time (and with --profile, profile) a fresh prefill of this many tokens: the copy path's "
                         "rounds, their copies' own GB/s")
    ap.add_argument("--rounds", choices=sorted(ROUNDS), default="each",
                    help="large experts' copy-path rounds (`CachedExperts.one_large_a_round`, `free_hits_first`): "
                         "each expert a round, the evictable hits first (the engine's default); misses: the hits in "
                         "one round, the misses one a round; all: one round of every copy in flight")
    ap.add_argument("--rounds-ab", nargs="+", default=None, choices=sorted(ROUNDS),
                    help="with --prefill-tokens: also time fresh prefills with these round modes taking turns "
                         "(`--ab-reps` each), on the engine of each --experts setting's first variant")
    ap.add_argument("--ab-reps", type=int, default=4)
    ap.add_argument("--staging", type=int, default=None,
                    help="staging slots the cached layers share to copy the next layer's experts ahead of its routing "
                         "on a copy-road step (`CachedExperts.staging_slots`; 0: off; default: the engine's)")
    ap.add_argument("--trace", default=None, metavar="FILE.json.gz",
                    help="with --profile and --prefill-tokens: the prefill's torch profiler trace (chrome format, gzip)")
    ap.add_argument("--variants", nargs="+", default=["dueling:now"],
                    help="slot policy:landing pairs, each run per --experts (policy dueling | frequent | none | "
                         "frozen: dueling through the warm-up, no promotion after it; landing now | late | stream; a third part "
                         "'layer': copies start after their layer, e.g. dueling:now:layer)")
    a = ap.parse_args()
    if a.rounds_ab and not a.prefill_tokens:
        ap.error("--rounds-ab times prefills: give --prefill-tokens N")
    from ferrylm.offload.expert_cache import CachedExperts

    set_rounds(a.rounds)
    if a.staging is not None:
        CachedExperts.staging_slots = a.staging
    rows = [run(e, a, v) for e in a.experts for v in a.variants]
    base = min(rows, key=lambda r: r["step_ms"])
    for r in rows:  # the extra time per missed expert against the fastest setting
        if r["misses_per_layer"]:
            r["ms_per_miss_over_best"] = (r["step_ms"] - base["step_ms"]) / (r["misses_per_layer"] * a.layers)
    print(json.dumps({"bench": "profile-offload", "shape": a.shape, "expert_quant": a.expert_quant, "layers": a.layers, "budget_gib": a.budget_gib, "rounds": a.rounds, "staging_slots": CachedExperts.staging_slots, "rows": rows}))


if __name__ == "__main__":
    main()
