"""`ferry plan`'s predicted expert hit rate (`plan/hit_rate.py`): uniform routing gives the slots' share C / E, a
skewed profile or stated skew raises it, the speed estimate follows it monotonically, the LRU model agrees with
the engine's own LRU replay, and bad profile files or specs are clear errors."""

from __future__ import annotations

import json
import os
import shutil
import random

import pytest

from ferrylm.errors import ConfigError
from ferrylm.offload import expert_profile
from ferrylm.offload.expert_cache import simulate
from ferrylm.plan import catalog, hit_rate
from ferrylm.plan.planner import PlanOptions, make_plan

HOST = "2xXeon-8480C,1TB"
QWEN3 = dict(catalog.CATALOG["Qwen3-30B-A3B"], num_hidden_layers=8)  # 128 experts, top 8, 9.4 MB each
MIXTRAL = dict(catalog.CATALOG["Mixtral-8x7B"], num_hidden_layers=8)  # 8 experts, top 2, 352 MB each


def _config(tmp_path, cfg) -> str:
    path = tmp_path / f"{cfg['model_type']}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _profile(tmp_path, cfg, counts_of_layer, name="profile.json", **override) -> str:
    """A profile file as `ferry profile` writes it (`expert_profile.write`)."""
    E = cfg.get("num_experts") or cfg["num_local_experts"]
    prof = {"format": expert_profile.FORMAT, "architecture": cfg["architectures"][0], "num_experts": E,
            "layers": {str(l): counts_of_layer(l, E) for l in range(cfg["num_hidden_layers"])}, **override}
    path = tmp_path / name
    expert_profile.write(prof, str(path))
    return str(path)


def _zipf_counts(s: float, seed: int = 0):
    def counts(layer: int, E: int) -> list[int]:
        ranks = list(range(1, E + 1))
        random.Random(seed + layer).shuffle(ranks)  # the hot experts sit anywhere in the layer
        return [int(1e6 * r ** -s) for r in ranks]
    return counts


def _plan(tmp_path, cfg=QWEN3, budget_gb=4, batch=16, **kw):
    return make_plan(PlanOptions(_config(tmp_path, cfg), gpu="1xH200", host=HOST, max_model_len=4096,
                                 max_num_seqs=batch, concurrency=batch, prompt_len=64, output_len=64,
                                 gpu_memory_budget_gb=budget_gb, **kw), advise=False)


def test_uniform_profile_gives_the_uniform_figure(tmp_path):
    """A profile whose counts are all equal predicts what no profile predicts: every cached layer holds C of
    its E experts (the placement's resident ones and its extra slots), so C / E of a step's experts hit. Given to
    the engine (`--expert-profile`) it pins R of them, as the engine does: at batch 1 the slot policy replayed on
    its draws (`hit_rate.sampled_promotions`) then moves no resident, so that step is at least as fast."""
    base = _plan(tmp_path)
    flat = _plan(tmp_path, expert_profile=_profile(tmp_path, QWEN3, lambda l, E: [1000] * E))
    a = base.speed["assumptions"]
    assert base.verdict == "offload" and "uniform routing" in a["expert_hit_rate_from"]
    assert "expert profile" in flat.speed["assumptions"]["expert_hit_rate_from"]
    # C / E from the engine's placement: each cached layer's resident experts and its extra slots
    E, slots = QWEN3["num_experts"], base.placement["expert_slots"]
    resident = base.placement["resident_experts"]
    want = sum((r + slots) / E for r in resident.values()) / len(resident)
    print(f"uniform hit {a['expert_hit_rate']:.4f} = mean (R + {slots}) / {E} = {want:.4f} over {len(resident)} "
          f"layers; flat profile {flat.speed['assumptions']['expert_hit_rate']:.4f}")
    assert a["expert_hit_rate"] == pytest.approx(want) and 0 < want < 0.5
    for key in ("decode_batch1", "decode_concurrent"):
        assert flat.speed[key]["expert_hit_rate"] == pytest.approx(base.speed[key]["expert_hit_rate"], abs=1e-9)
    assert flat.speed["decode_concurrent"]["tok_s"] == pytest.approx(base.speed["decode_concurrent"]["tok_s"], rel=1e-9)
    assert flat.speed["decode_batch1"]["tok_s"] >= base.speed["decode_batch1"]["tok_s"]
    # and uniform routing's figure does not depend on the batch or the path
    assert base.speed["decode_batch1"]["expert_hit_rate"] == pytest.approx(
        base.speed["decode_concurrent"]["expert_hit_rate"])
    for mapped in (True, False):
        assert hit_rate.hit_rate(None, 128, 8, 10, 12, False, 7, mapped) == pytest.approx(12 / 128)


def test_skewed_profile_raises_the_hit_rate_and_the_speed(tmp_path):
    base = _plan(tmp_path)
    skew = _plan(tmp_path, expert_profile=_profile(tmp_path, QWEN3, _zipf_counts(1.2)))
    for key in ("decode_batch1", "decode_concurrent"):
        b, s = base.speed[key], skew.speed[key]
        print(f"{key}: uniform hit {b['expert_hit_rate']:.3f} {b['tok_s']:.1f} tok/s; zipf 1.2 profile "
              f"{s['expert_hit_rate']:.3f} {s['tok_s']:.1f} tok/s")
        assert s["expert_hit_rate"] > b["expert_hit_rate"] + (0.3 if key == "decode_batch1" else 0.05)
        assert s["tok_s"] > b["tok_s"]
    assert skew.speed["prefill_tok_s"] >= base.speed["prefill_tok_s"]
    assert any("expert profile" in n and "hit rate" in n for n in skew.notes)
    # the same routing as a stated skew (nothing pinned): on the mapped path the tally holds the hottest C either
    # way; pinning the hottest only helps where LRU churns (Mixtral's copy path at batch 16)
    prof = _profile(tmp_path, MIXTRAL, _zipf_counts(1.0), name="mixtral-profile.json")
    pinned = _plan(tmp_path, MIXTRAL, 12, expert_profile=prof)
    unpinned = _plan(tmp_path, MIXTRAL, 12, routing=prof)
    assert pinned.speed["decode_batch1"]["experts_path"] == "mapped"
    assert pinned.speed["decode_concurrent"]["experts_path"] == "copy"
    assert pinned.speed["decode_batch1"]["expert_hit_rate"] == pytest.approx(
        unpinned.speed["decode_batch1"]["expert_hit_rate"])
    assert pinned.speed["decode_concurrent"]["expert_hit_rate"] > unpinned.speed["decode_concurrent"]["expert_hit_rate"]
    assert "nothing pinned" in unpinned.speed["assumptions"]["expert_hit_rate_from"]


@pytest.mark.parametrize("cfg,budget", [(QWEN3, 4), (MIXTRAL, 12)])
@pytest.mark.parametrize("experts", ["auto", "gpu"])
def test_the_estimate_responds_monotonically(cfg, budget, experts, tmp_path):
    """More skew: a hit rate at least as high; a higher hit rate (stated or given): decode and prefill at least
    as fast, on the mapped and the copy path, with and without hybrid decode."""
    first = last = None
    for s in (0.0, 0.3, 0.6, 1.0, 1.5, 2.5):
        p = _plan(tmp_path, cfg, budget, routing=f"zipf:{s}", experts=experts)
        row = [p.speed[k]["expert_hit_rate"] for k in ("decode_batch1", "decode_concurrent")] + \
              [p.speed[k]["tok_s"] for k in ("decode_batch1", "decode_concurrent")] + [p.speed["prefill_tok_s"]]
        print(f"zipf:{s}: hit {row[0]:.3f} / {row[1]:.3f}, decode {row[2]:.2f} / {row[3]:.2f}, prefill {row[4]:.0f}")
        if last is not None:
            assert all(b >= a * (1 - 1e-9) for a, b in zip(last, row)), (last, row)
        first, last = first or row, row
    assert last[0] > first[0] + 0.4 and last[2] > first[2]  # zipf 2.5: a few experts take nearly all the routing
    speeds = [_plan(tmp_path, cfg, budget, expert_hit_rate=h, experts=experts) for h in (0, 0.2, 0.4, 0.6, 0.8, 1)]
    for key in ("decode_batch1", "decode_concurrent"):
        tok = [p.speed[key]["tok_s"] for p in speeds]
        assert all(b >= a * (1 - 1e-9) for a, b in zip(tok, tok[1:])), (key, tok)
        assert tok[-1] > tok[0]


def test_lru_model_agrees_with_the_engines_lru_replay():
    """Che's approximation (the copy path) against `expert_cache.simulate`, the engine's own LRU rules, on
    traces drawn from the same routing (each token takes expert e with probability p_e), pinned or not."""
    rng = random.Random(0)
    E, k = 64, 4
    for s, capacity, resident, batch in ((0.0, 16, 12, 4), (0.8, 16, 12, 4), (1.2, 10, 8, 16), (1.5, 24, 20, 1)):
        ranks = list(range(1, E + 1))
        rng.shuffle(ranks)  # hot experts anywhere: the replay fills slots in ascending expert order
        shares = hit_rate._scaled([r ** -s for r in ranks], k)
        trace = []
        for _ in range(3000):
            need = {e for _ in range(batch) for e in range(E) if rng.random() < shares[e]}
            trace.append(sorted(need))
        for pinned in (False, True):
            hottest = sorted(range(E), key=lambda e: -shares[e])
            fixed = set(hottest[:resident]) if pinned else set()  # as the engine pins a profile's
            rest = [[e for e in need if e not in fixed] for need in trace]
            hits, total = simulate(rest, capacity - len(fixed), "lru")
            pinned_hits = sum(len(need) - len(r) for need, r in zip(trace, rest))
            replay = (hits + pinned_hits) / (total + pinned_hits)
            model = hit_rate.hit_rate(tuple(shares), E, k, resident, capacity, pinned, batch, mapped=False)
            print(f"zipf {s} C={capacity} R={resident} B={batch} pinned={pinned}: replay {replay:.3f}, model {model:.3f}")
            assert abs(model - replay) < 0.03
    # the tally's steady state (mapped): the hottest C, above LRU's figure under skew
    shares = tuple(hit_rate._scaled([r ** -1.0 for r in range(1, E + 1)], k))
    assert hit_rate.hit_rate(shares, E, k, 8, 10, False, 1, True) > hit_rate.hit_rate(shares, E, k, 8, 10, False, 1, False)


def test_bad_profiles_and_routing_specs_are_clear_errors(tmp_path, capsys):
    cfg = _config(tmp_path, QWEN3)
    good = _profile(tmp_path, QWEN3, _zipf_counts(1.0))
    (tmp_path / "broken.json").write_text("{\"format\": ")
    (tmp_path / "list.json").write_text("[1, 2]")
    cases = {
        str(tmp_path / "missing.json"): "cannot read it",
        str(tmp_path / "broken.json"): "not JSON",
        str(tmp_path / "list.json"): "not a ferrylm-expert-profile/1 file",
        _profile(tmp_path, QWEN3, lambda l, E: [1] * E, name="other.json", num_experts=64): "recorded for another model",
        _profile(tmp_path, QWEN3, lambda l, E: [1] * (E - 1), name="short.json"): "recorded for another model",
        _profile(tmp_path, QWEN3, lambda l, E: [1] * E, name="arch.json", architecture="MixtralForCausalLM"):
            "recorded for another model",
        _profile(tmp_path, QWEN3, lambda l, E: [0] * E, name="zero.json"): "no routed assignments",
        _profile(tmp_path, QWEN3, lambda l, E: [-1] * E, name="negative.json"): "negative counts",
    }
    for path, match in cases.items():
        with pytest.raises(ConfigError, match=match) as e:
            _plan(tmp_path, expert_profile=path)
        assert path in str(e.value) and "--expert-profile" in str(e.value)
        with pytest.raises(ConfigError, match=match):
            _plan(tmp_path, routing=path)
    for spec, match in (("zipf:", "exponent"), ("zipf:-1", "exponent"), ("zipf:abc", "exponent"),
                        ("pareto:2", "choose uniform, zipf:S")):
        with pytest.raises(ConfigError, match=match):
            _plan(tmp_path, routing=spec)
    with pytest.raises(ConfigError, match="no experts to route"):
        make_plan(PlanOptions("Llama-3-8B", host=HOST, routing="zipf:1"))
    with pytest.raises(ConfigError, match="not both"):
        _plan(tmp_path, expert_profile=good, routing="zipf:1")
    from ferrylm.cli import main

    assert main(["plan", cfg, "--host", HOST, "--expert-profile", str(tmp_path / "broken.json")]) == 2
    err = capsys.readouterr().err
    assert "not JSON" in err and "Traceback" not in err
    assert main(["plan", cfg, "--host", HOST, "--gpu-memory-budget-gb", "4", "--max-model-len", "4096", "--routing", "zipf:1.2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "zipf:1.2" in d["speed"]["assumptions"]["expert_hit_rate_from"] and d["options"]["routing"] == "zipf:1.2"


def test_a_saved_profile_is_used_as_the_engine_uses_it(tmp_path, monkeypatch):
    """With no profile named, the engine pins from the profile `--profile-experts` saved for that model
    (`offload/expert_profile.saved`): the plan predicts with the same one."""
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path / "cache"))
    base = _plan(tmp_path)
    model = _config(tmp_path, QWEN3)
    path = expert_profile.saved_path(model)
    os.makedirs(os.path.dirname(path))
    shutil.copy(_profile(tmp_path, QWEN3, _zipf_counts(1.2)), path)
    got = _plan(tmp_path)
    assert expert_profile.saved(model) == path and path in got.speed["assumptions"]["expert_hit_rate_from"]
    assert got.speed["decode_batch1"]["expert_hit_rate"] > base.speed["decode_batch1"]["expert_hit_rate"] + 0.3
    stated = _plan(tmp_path, routing="uniform")  # a stated routing wins over the saved profile
    assert stated.speed["decode_batch1"]["expert_hit_rate"] == pytest.approx(base.speed["decode_batch1"]["expert_hit_rate"])


def _traced(tmp_path, cfg, reuse: float, name: str, steps: int = 160, seed: int = 0) -> str:
    """A profile with a `decode_trace`: every layer's one-token steps keep each of the last step's experts with
    probability `reuse`, else draw another (uniform); the counts are what the trace routed."""
    E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    rng = random.Random(seed)
    trace, counts = {}, {}
    for l in range(cfg["num_hidden_layers"]):
        cur, steps_l, c = rng.sample(range(E), k), [], [0] * E
        for _ in range(steps):
            keep = [e for e in cur if rng.random() < reuse]
            rest = [e for e in range(E) if e not in keep]
            cur = keep + rng.sample(rest, k - len(keep))
            steps_l.append(sorted(cur))
            for e in cur:
                c[e] += 1
        trace[str(l)], counts[l] = steps_l, c
    return _profile(tmp_path, cfg, lambda l, E: counts[l], name=name, decode_trace=trace)


def test_a_decode_trace_replays_the_slot_policy(tmp_path):
    """Popularity alone takes tokens as independent; a profile's decode trace says how much a sequence reuses
    its experts from token to token, and the plan replays the engine's slot policy on it: routing that repeats
    hits far more than its flat popularity says (and runs faster), independent tokens about what popularity
    says, and the promotions a step follow the replay."""
    base = _plan(tmp_path)
    sticky = _plan(tmp_path, routing=_traced(tmp_path, QWEN3, 0.97, "sticky.json"))
    fresh = _plan(tmp_path, routing=_traced(tmp_path, QWEN3, 0.0, "fresh.json"))
    b1 = {n: p.speed["decode_batch1"] for n, p in (("uniform", base), ("sticky", sticky), ("fresh", fresh))}
    for n, s in b1.items():
        print(f"{n}: batch-1 hit {s['expert_hit_rate']:.3f}, {s['tok_s']:.1f} tok/s, promotions "
              f"{s['parts_ms'].get('promotions', 0):.3f} ms")
    assert "decode trace of 160 steps" in sticky.speed["assumptions"]["expert_hit_rate_from"]
    assert b1["sticky"]["expert_hit_rate"] > 0.8 > b1["uniform"]["expert_hit_rate"] + 0.5
    assert b1["sticky"]["tok_s"] > 2 * b1["uniform"]["tok_s"]
    assert abs(b1["fresh"]["expert_hit_rate"] - b1["uniform"]["expert_hit_rate"]) < 0.05
    # batch 16: the trace is one sequence at a time; larger batches are priced by the profile's popularity, as
    # the same counts without a trace price them
    sticky_path = tmp_path / "sticky.json"
    counts_only = json.loads(sticky_path.read_text())
    del counts_only["decode_trace"]
    (tmp_path / "sticky-counts.json").write_text(json.dumps(counts_only))
    plain = _plan(tmp_path, routing=str(tmp_path / "sticky-counts.json"))
    assert sticky.speed["decode_concurrent"]["expert_hit_rate"] == pytest.approx(
        plain.speed["decode_concurrent"]["expert_hit_rate"])
    assert plain.speed["decode_batch1"]["expert_hit_rate"] < b1["sticky"]["expert_hit_rate"]
    # the replay is the engine's policy: its hit rate at batch 1 is replay_mapped's over the cached layers
    from ferrylm.plan import hit_rate as hr

    route = hr.routing(str(tmp_path / "sticky.json"), None, QWEN3["architectures"][0], 128, 8, list(range(8)))
    res, slots = sticky.placement["resident_experts"], sticky.placement["expert_slots"]
    got = hr.replayed(route, {l: (r, r + slots) for l, r in res.items()}, 128)
    mean = sum(h for h, _ in got.values()) / len(got)
    assert mean == pytest.approx(b1["sticky"]["expert_hit_rate"])
    # a broken trace is a clear error naming it
    bad = _profile(tmp_path, QWEN3, lambda l, E: [1] * E, name="bad-trace.json",
                   decode_trace={str(l): [[0, 999]] for l in range(8)})
    with pytest.raises(ConfigError, match="decode_trace names an expert outside"):
        _plan(tmp_path, routing=bad)
    short = _profile(tmp_path, QWEN3, lambda l, E: [1] * E, name="short-trace.json", decode_trace={"0": [[1]]})
    with pytest.raises(ConfigError, match="does not cover every MoE layer"):
        _plan(tmp_path, expert_profile=short)
    empty = _profile(tmp_path, QWEN3, lambda l, E: [1] * E, name="empty-trace.json",
                     decode_trace={str(l): [] for l in range(8)})
    with pytest.raises(ConfigError, match="empty-trace.json: its decode_trace holds no steps"):
        _plan(tmp_path, routing=empty)


def test_a_plan_reads_its_profile_once(tmp_path, monkeypatch):
    """The counts and the decode trace come from one read of the file, and the advice's sub-plans read it no more;
    a file rewritten since is read again."""
    path = _traced(tmp_path, QWEN3, 0.5, "once.json", steps=40)
    real, calls = expert_profile.load, []
    monkeypatch.setattr(expert_profile, "load", lambda p: calls.append(p) or real(p))
    plan = make_plan(PlanOptions(_config(tmp_path, QWEN3), gpu="1xH200", host=HOST, max_model_len=4096,
                                 max_num_seqs=16, concurrency=16, prompt_len=64, output_len=64,
                                 gpu_memory_budget_gb=4, routing=path), advise=True)
    assert "decode trace of 40 steps" in plan.speed["assumptions"]["expert_hit_rate_from"]
    assert calls == [path]
    _traced(tmp_path, QWEN3, 0.5, "once.json", steps=48)
    assert "decode trace of 48 steps" in _plan(tmp_path, routing=path).speed["assumptions"]["expert_hit_rate_from"]
    assert calls == [path, path]


def test_a_profile_pins_nothing_where_layers_keep_no_slots(tmp_path):
    """Under a budget with no room for 2 expert slots a layer (`Placement.slot_mode` pool) the engine makes a
    profile's hottest experts resident but pins none: a layer copies its misses through them. The plan does the
    same (its routing unpinned, said in its assumptions); with room for the slots it pins them."""
    prof = _profile(tmp_path, MIXTRAL, _zipf_counts(1.0), name="mixtral-profile.json")
    tight = _plan(tmp_path, MIXTRAL, 5, expert_profile=prof)
    roomy = _plan(tmp_path, MIXTRAL, 12, expert_profile=prof)
    print(tight.placement, tight.speed["assumptions"]["expert_hit_rate_from"])
    assert tight.placement["expert_slots"] == 0 and roomy.placement["expert_slots"] == 2
    assert "resident, not pinned: the layers keep no slots" in tight.speed["assumptions"]["expert_hit_rate_from"]
    assert "pinned, as the engine pins them" in roomy.speed["assumptions"]["expert_hit_rate_from"]
