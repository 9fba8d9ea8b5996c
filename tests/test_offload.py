"""The offload engine on the CPU: placement under a budget, rules, the expert cache and its policies, the
fused-MoE alignment, and offloaded runs (streamed layers, cached experts) equal to resident runs bit for
bit. On the CPU the "device" tier is host memory too, so the copy path runs in CI.
"""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from ferrylm import LLM, SamplingParams
from ferrylm.config import ModelConfig
from ferrylm.errors import ConfigError
from ferrylm.kv.cache import KVCache
from ferrylm.layers.fused_moe import align
from ferrylm.layers.moe import Experts, TorchExperts, expert_mlp, expert_row_cap
from ferrylm.models.registry import model_class
from ferrylm.offload.expert_cache import CachedExperts, belady_hits, simulate
from ferrylm.offload.placed_weights import OffloadStats
from ferrylm.offload.placement import GPU, HOST, PlaceRule, group_tensors, minimum_device_bytes, place

from helpers import capture_logits
from test_models_hf import build

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 64, 11, 150, 33], [9, 8, 7, 6, 5, 4, 3, 2, 1]]


def meta_model(path: str):
    with open(os.path.join(path, "config.json")) as f:
        cfg = ModelConfig.from_hf(json.load(f))
    cls = model_class(cfg)
    with torch.device("meta"):
        return cls(cfg)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {f: build(tmp_path_factory, f)[0] for f in ("llama3", "smollm2-tied", "mixtral", "qwen2_moe", "qwen3_moe")}


def test_groups_cover_every_parameter_once(ckpts):
    for family, path in ckpts.items():
        model = meta_model(path)
        groups = group_tensors(model)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        assert sum(g.nbytes for g in groups) == total, family
        assert len({g.name for g in groups}) == len(groups), family
        kinds = {g.kind for g in groups}
        assert {"attention", "norm", "lm_head"} <= kinds, family
        if "moe" in family or family == "mixtral":
            assert {"experts", "router"} <= kinds, family


def test_placement_obeys_budget(ckpts):
    for family, path in ckpts.items():
        groups = group_tensors(meta_model(path))
        total = sum(g.nbytes for g in groups)
        with pytest.raises(ConfigError, match="too small.*at least"):
            place(groups, 1024, ())
        prev = -1
        for frac in (0.3, 0.45, 0.6, 0.75, 0.9, 1.0, 1.5):
            budget = int(total * frac)
            try:
                pl = place(groups, budget, ())
            except ConfigError:
                continue
            assert pl.device_bytes() <= budget, (family, frac)
            resident = pl.bytes_on(GPU)
            assert resident >= prev, (family, frac)  # more budget never means less resident
            prev = resident
            # every norm and router sits on the device whatever the budget
            assert all(pl.tier[g.name] == GPU for g in groups if g.kind in ("norm", "router"))
        assert place(groups, int(total * 1.5), ()).fully_resident, family


def test_rules():
    assert PlaceRule.parse("layers.0-7=gpu").layers == (0, 7)
    r = PlaceRule.parse("layers.3.experts.0-3=cpu")
    assert (r.layers, r.kind, r.experts, r.tier) == ((3, 3), "experts", (0, 3), HOST)
    for bad in ("experts", "experts=disk", "layers.x=gpu", "attention.0-3=gpu", "layers.5-2=gpu", "mlpp=cpu"):
        with pytest.raises(ConfigError):
            PlaceRule.parse(bad)


def test_rules_apply_and_must_match(ckpts):
    groups = group_tensors(meta_model(ckpts["mixtral"]))
    pl = place(groups, None, ("experts=cpu", "layers.1.experts.0=gpu"))
    experts = [g for g in groups if g.kind == "experts"]
    assert [g.name for g in experts if pl.tier[g.name] == GPU] == ["layers.1.experts.0"]
    assert all(pl.tier[g.name] == GPU for g in groups if g.kind != "experts")
    with pytest.raises(ConfigError, match=r"matches no tensor group.*; layers 0-1, experts 0-3\)"):  # what there is
        place(groups, None, ("layers.9=gpu",))
    with pytest.raises(ConfigError, match="matches no tensor group"):
        place(group_tensors(meta_model(ckpts["llama3"])), None, ("experts=cpu",))


def test_lm_head_stays_on_the_device(ckpts):
    # the head is a matmul each step, nothing runs it from host memory: a budget that leaves no room for it
    # is too small (named with its minimum), and a rule that puts it there is refused
    for family in ("mixtral", "smollm2-tied"):
        groups = group_tensors(meta_model(ckpts[family]))
        head = sum(g.nbytes for g in groups if g.kind == "lm_head")
        least = minimum_device_bytes(groups)
        assert head > 0 and least >= head
        pl = place(groups, least)
        assert all(pl.tier[g.name] == GPU for g in groups if g.kind == "lm_head")
        with pytest.raises(ConfigError, match="too small for this model"):
            place(groups, least - 1)
        with pytest.raises(ConfigError, match="LM head in host memory"):
            place(groups, None, ("lm_head=cpu",))
        assert place(groups, None, ("lm_head=cpu", "lm_head=gpu")).fully_resident  # later rules win


def run(path, **kw):
    llm = LLM(path, dtype="float32", max_num_seqs=4, **kw)
    with capture_logits(llm.engine) as got:
        res = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    logits = {}
    for sid, row in got:
        logits.setdefault(sid, []).append(row)
    return llm, [r.outputs[0].token_ids for r in res], [torch.stack(v) for _, v in sorted(logits.items())]


@pytest.mark.parametrize("family,opts", [
    ("llama3", dict(place=("layers.0-1=cpu",))),  # every layer streamed
    ("smollm2-tied", dict(place=("layers.1=cpu",))),
    ("mixtral", dict(place=("experts=cpu",))),  # 2 device slots per layer for 4 experts: waves
    ("mixtral", dict(place=("layers.0=cpu", "experts=cpu", "layers.1.experts.0-1=gpu"))),
    ("qwen2_moe", dict(place=("layers.0.experts=cpu", "layers.1=cpu"), expert_cache_policy="lfu")),
    ("qwen3_moe", "budget"),
])
def test_offloaded_equals_resident(ckpts, family, opts):
    path = ckpts[family]
    _, ref_tokens, ref_logits = run(path)
    if opts == "budget":  # the budget alone decides: the least it runs in and half the rest
        groups = group_tensors(meta_model(path))
        total, least = sum(g.nbytes for g in groups), minimum_device_bytes(groups)
        c = meta_model(path).config
        kv = 64 * KVCache.bytes_per_block(c.num_hidden_layers, 16, c.num_key_value_heads, c.head_dim, torch.float32)
        opts = dict(gpu_memory_budget=least + (total - least) // 2 + kv, num_kv_blocks=64)
    llm, tokens, logits = run(path, **opts)
    runner = llm.engine.runner
    assert not runner.placement.fully_resident
    stats = runner.placed.stats
    print(f"{family} {opts}: moved {stats.h2d_bytes} bytes, expert hit rate {stats.hit_rate}")
    assert stats.h2d_bytes > 0
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        assert torch.equal(a, b), (a - b).abs().max().item()


def test_yuan_m32_offloaded_equals_resident():
    path = os.path.join(os.path.dirname(__file__), "data", "yuan2-m32-tiny")
    _, ref_tokens, ref_logits = run(path, num_kv_blocks=64)
    llm, tokens, logits = run(path, num_kv_blocks=64, place=("experts=cpu", "layers.0=cpu"))
    assert llm.engine.runner.placed.caches and llm.engine.runner.placed.streamer is not None
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        assert torch.equal(a, b)


def test_cached_experts_equal_reference_at_every_capacity(monkeypatch):
    """The offload cache's plain path against `TorchExperts`, bit for bit, at every capacity, with an expert's rows
    capped as on CUDA (`moe.ROW_CAP_DEVICES`: the CPU engine keeps its GEMMs whole) and a skewed step past the cap."""
    from ferrylm.layers import moe

    monkeypatch.setattr(moe, "ROW_CAP_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    E, H, I = 6, 32, 48
    bank = Experts(E, H, I)
    for e in range(E):
        bank.load(e, "gate_up", torch.randn(2 * I, H) * 0.1)
        bank.load(e, "down", torch.randn(H, I) * 0.1)
    steps = [torch.randint(0, E, (T, 2)) for T in (1, 3, 40, 2, 64)]
    steps.append(torch.full((64, 2), 1))  # every token on experts 1 and 3: 64 rows each, past the cap, in pieces
    assert expert_row_cap(64 * 2, E) < 64
    for capacity in (2, 3, 5, 6):
        cache = CachedExperts(bank, bank.w13.data, bank.w2.data, capacity, list(range(capacity - 2)), {0},
                              "lru", torch.device("cpu"), None, OffloadStats(), 0)
        for ids in steps:
            ids = torch.stack([ids[:, 0], (ids[:, 0] + 1 + ids[:, 1] % (E - 1)) % E], 1)  # distinct per token
            x = torch.randn(ids.shape[0], H)
            w = torch.rand(ids.shape).softmax(-1)
            assert torch.equal(cache.forward(bank, x, ids, w), TorchExperts().forward(bank, x, ids, w))
            assert len(cache.slot_of) <= capacity and 0 in cache.slot_of  # pinned stays
            assert all(cache.owner[s] == e for e, s in cache.slot_of.items())
    # the pieces against one GEMM over all 64 rows: the same values within float rounding
    x, ids, w = torch.randn(64, H), torch.tensor([[1, 3]] * 64), torch.rand(64, 2).softmax(-1)
    whole = sum(expert_mlp(x, *bank.expert_weights(e), bank.act) * w[:, j:j + 1] for j, e in enumerate((1, 3)))
    assert torch.allclose(TorchExperts().forward(bank, x, ids, w), whole, atol=1e-5, rtol=1e-5)


def test_policies_on_traces():
    trace = [[0], [1], [0], [2], [1]]
    assert simulate(trace, 2, "lru") == (1, 5)
    assert simulate(trace, 2, "lfu") == (1, 5)
    assert belady_hits(trace, 2) == (2, 5)
    rng = random.Random(0)
    weights = [1 / (r + 1) ** 1.2 for r in range(16)]  # Zipf-skewed routing, top-2 of 16
    zipf = [sorted(set(rng.choices(range(16), weights, k=2))) for _ in range(400)]
    opt = belady_hits(zipf, 6)[0]
    for policy in ("lru", "lfu"):
        hits, total = simulate(zipf, 6, policy)
        assert 0 < hits <= opt
        print(f"zipf trace, 6 of 16 slots: {policy} {hits / total:.3f}, belady {opt / total:.3f}")
    assert simulate(zipf, 6, "lfu")[0] > simulate(zipf, 6, "lru")[0]  # skew rewards frequency


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouped_gemm_prefill_rows_match_the_per_expert_reference(monkeypatch):
    """`fused_moe.grouped_rows` (torch's grouped GEMM over the assignments sorted by expert; CUTLASS on sm_90, a
    plain fallback here) against the per-expert torch reference in fp32 on the same bf16 weights: every
    assignment's weighted row in `expert_rows`'s layout, experts with no rows included; and `expert_rows` takes
    it where `GROUPED_MM_MIN_ROWS` and `GROUPED_MM_MIN_INTER` say."""
    from ferrylm.layers import fused_moe
    from ferrylm.layers.moe import expert_mlp

    g = torch.Generator().manual_seed(3)
    E, H, I, T, k = 6, 64, 48, 37, 2
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).bfloat16()
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])  # expert E-1 gets no row
    w = torch.rand(T, k, generator=g)
    assert fused_moe.grouped_mm_usable(x, w13, w2) and not fused_moe.grouped_mm_usable(x.float(), w13, w2)
    got = fused_moe.grouped_rows(x, w13, w2, ids, w)
    ref = torch.stack([expert_mlp(x[t:t + 1].float(), w13[e].float(), w2[e].float(), torch.nn.functional.silu)[0]
                       * w[t, j] for t in range(T) for j, e in enumerate(ids[t].tolist())])
    err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
    print(f"grouped GEMM rows vs per-expert fp32 reference: max error {err:.2e} of the largest row value")
    assert got.shape == (T * k, H) and got.dtype == torch.bfloat16 and err < 2e-2
    monkeypatch.setattr(fused_moe, "GROUPED_MM_MIN_ROWS", 1)
    monkeypatch.setattr(fused_moe, "GROUPED_MM_MIN_INTER", I)
    assert torch.equal(fused_moe.expert_rows(x, w13, w2, ids, w), got)


def test_prefill_path_follows_the_measured_thresholds():
    """`fused_moe.prefill_path` (what `expert_rows` takes in an eager prefill step, and what the planner's
    `prefill_bytes` counts): the grouped GEMM from `GROUPED_MM_MIN_ROWS` an expert on experts at least
    `GROUPED_MM_MIN_INTER` wide, a packed bank decoded once from `PACKED_DENSE_MIN_ROWS`, the kernel else; each
    path's bytes grow with the rows."""
    from ferrylm.layers import fused_moe as fm

    g, m, p = fm.GROUPED_MM_MIN_ROWS, fm.GROUPED_MM_MIN_INTER, fm.PACKED_DENSE_MIN_ROWS
    assert fm.prefill_path(g * 8, 8, m, False) == "grouped" and fm.prefill_path(g * 8 - 1, 8, m, False) == "kernel"
    assert fm.prefill_path(g * 128, 128, m - 1, False) == "kernel"  # Qwen3-30B-A3B's 768 columns
    assert fm.prefill_path(p * 8, 8, 768, True) == "dequant" and fm.prefill_path(p * 8 - 1, 8, 768, True) == "kernel"
    for packed, rows in ((False, (100, g * 8, 4 * g * 8)), (True, (100, p * 8, 4 * p * 8))):
        sizes = [fm.prefill_bytes(a, 8, 4096, 14336, 2, packed) for a in rows]
        assert sizes == sorted(sizes) and sizes[0] > 0, (packed, sizes)


def test_captured_steps_stop_where_a_packed_bank_leaves_the_kernel():
    """`fused_moe.graph_token_limit`: the most tokens a CUDA-graph-captured step holds over a packed bank is the
    last count whose eager step takes the kernel path too (past it `dequant_rows` reads counts on the host, which a
    capture cannot, and the captured step would fall back to the in-tile decode); dense banks are not bounded.
    `offload/memory.graph_tokens` (the graph pools the engine and the plan reserve) takes the bound."""
    from ferrylm.config import ModelConfig, SchedulerConfig
    from ferrylm.layers import fused_moe as fm
    from ferrylm.offload.memory import graph_token_limit, graph_tokens

    for E, k in ((8, 2), (128, 8), (32, 2), (64, 6)):
        n = fm.graph_token_limit(E, k, True)
        assert fm.prefill_path(n * k, E, 768, True) == "kernel" and fm.prefill_path((n + 1) * k, E, 768, True) == "dequant"
        assert fm.graph_token_limit(E, k, False) is None
    mixtral = ModelConfig.from_hf({"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                                   "vocab_size": 256, "num_local_experts": 8, "num_experts_per_tok": 2})
    assert graph_token_limit(mixtral, True) == 127 and graph_token_limit(mixtral, False) is None
    sc = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=4096)
    assert graph_tokens(sc, True, True, 127) == 127 and graph_tokens(sc, True, False, 127) == 127
    assert graph_tokens(sc, True, True, None) == 2048 and graph_tokens(sc, False, True, 127) == 0


def test_a_captured_nf4_step_reserves_the_decode_kernels_partials():
    """NF4 banks take the decode kernel at every batch below `dequant_rows` (`BY_FORMAT_MAX_TOKENS["nf4"]` None), whose
    fp32 split-K partials a captured step keeps in its graph pool: `graph_step_floor` counts them
    (`fused_moe_decode.decode_bytes`, by hand here for Mixtral's 64-token step: GEMM 1's [2, 128, 28672] fp32 beside
    the gated rows, then GEMM 2's [4, 128, 4096] beside rows and output), the engine's and the plan's pool takes at
    least that (`warmup_activations`), and a dense or int4 bank adds nothing."""
    from ferrylm.config import ModelConfig, SchedulerConfig
    from ferrylm.layers import fused_moe_decode as fmd
    from ferrylm.offload.memory import graph_step_floor, warmup_activations

    assert fmd.BY_FORMAT_MAX_TOKENS["nf4"] is None and fmd.taken_by_format("nf4", 127)
    assert fmd.taken_by_format("fp8", 32) and not fmd.taken_by_format("fp8", 33) and not fmd.taken_by_format("int4", 1)
    mixtral = ModelConfig.from_hf({"architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
                                   "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                                   "num_hidden_layers": 2, "vocab_size": 32000, "num_local_experts": 8,
                                   "num_experts_per_tok": 2})
    A, I, H = 128, 14336, 4096
    by_hand = max(4 * 2 * A * 2 * I + 2 * A * I, 2 * A * I + 4 * 4 * A * H + 2 * A * H)
    assert graph_step_floor(mixtral, 64, 2, "nf4") == by_hand
    assert graph_step_floor(mixtral, 64, 2, None) == graph_step_floor(mixtral, 64, 2, "int4") == 0
    assert graph_step_floor(mixtral, 0, 2, "nf4") == 0
    assert graph_step_floor(mixtral, 64, 2, "fp8") == graph_step_floor(mixtral, 32, 2, "fp8") > 0  # fp8: 32 tokens
    sc = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096)
    step = 500 << 20
    share = warmup_activations(step, sc, 32000, 64)
    assert share - (step + 2 * 64 * 32000 * 4) < by_hand  # the share alone would not hold the partials
    assert warmup_activations(step, sc, 32000, 64, 0, by_hand) == step + 2 * 64 * 32000 * 4 + by_hand
    assert warmup_activations(step, sc, 32000, 0, 0, by_hand) == step + 2 * 64 * 32000 * 4  # no graphs, no pool


@pytest.mark.parametrize("fmt", ["nf4", "int4", "int8", "fp8"])
def test_packed_prefill_decoded_once_per_expert_matches_the_reference(fmt, monkeypatch):
    """`fused_moe.dequant_rows` (a packed bank's experts each decoded once into dense weights, then dense GEMMs on
    their rows) against the per-expert fp32 reference on the same dequantized weights, skipped ids (E) giving
    zero rows, the same in groups of two experts; and `expert_rows` takes it where `PACKED_DENSE_MIN_ROWS` says."""
    from ferrylm.layers import fused_moe
    from ferrylm.layers.fused_moe import ExpertWeights
    from ferrylm.layers.moe import expert_mlp
    from ferrylm.weights import quant

    make = {"nf4": lambda t: quant.quantize_nf4(t, 64), "int4": lambda t: quant.quantize_int4(t, 32, "min"),
            "int8": lambda t: quant.quantize_int8(t), "fp8": quant.quantize_fp8}[fmt]
    g = torch.Generator().manual_seed(4)
    E, H, I, T, k = 5, 64, 64, 23, 2
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
    p13 = ExpertWeights.stack([[make(w13[e, :I]), make(w13[e, I:])] for e in range(E)], torch.bfloat16)
    p2 = ExpertWeights.stack([[make(w2[e])] for e in range(E)], torch.bfloat16)
    d13, d2 = p13.dequantize(torch.float32), p2.dequantize(torch.float32)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[::4, 0] = E  # skipped: another round computes them
    w = torch.rand(T, k, generator=g)
    got = fused_moe.dequant_rows(x, p13, p2, ids, w, skip=True)
    ref = torch.stack([torch.zeros(H) if e == E else
                       expert_mlp(x[t:t + 1].float(), d13[e], d2[e], torch.nn.functional.silu)[0] * w[t, j]
                       for t in range(T) for j, e in enumerate(ids[t].tolist())])
    err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
    print(f"{fmt} bank decoded once per expert vs the fp32 reference: max error {err:.2e} of the largest row")
    assert got.shape == (T * k, H) and err < 2e-2 and (got[::4 * k] == 0).all()
    monkeypatch.setattr(fused_moe, "DEQUANT_BUFFER_BYTES", 2 * 3 * I * H * 2)  # two experts a decode group
    grouped = fused_moe.dequant_rows(x, p13, p2, ids, w, skip=True)
    assert (grouped.float() - got.float()).abs().max().item() <= 1e-2 * ref.abs().max().item()
    monkeypatch.setattr(fused_moe, "PACKED_DENSE_MIN_ROWS", 1)
    assert torch.equal(fused_moe.expert_rows(x, p13, p2, ids, w, skip=True), got)
    # counts the caller knows (the offload cache's rounds): nothing read back, the same rows; wrong ones refused
    monkeypatch.setattr(fused_moe, "DEQUANT_BUFFER_BYTES", 1 << 30)
    counts = torch.bincount(ids.flatten(), minlength=E + 1).tolist()
    assert torch.equal(fused_moe.expert_rows(x, p13, p2, ids, w, skip=True, counts=counts), got)
    with pytest.raises(ValueError, match="counts must give"):
        fused_moe.dequant_rows(x, p13, p2, ids, w, skip=True, counts=counts[:-1] + [counts[-1] + 1])


def test_packed_prefill_holds_at_most_twice_the_uniform_share_an_expert(monkeypatch):
    """A skewed prompt (every token routed to the same two experts) through `fused_moe.dequant_rows`: each GEMM
    sees at most `moe.expert_row_cap` rows of one expert and a decode group at most that many per expert in it (the
    transient `prefill_bytes` counts, whatever the routing), and the rows still match the per-expert reference."""
    from ferrylm.layers import fused_moe
    from ferrylm.layers.fused_moe import ExpertWeights
    from ferrylm.layers.moe import expert_mlp
    from ferrylm.weights import quant

    g = torch.Generator().manual_seed(5)
    E, H, I, T, k = 5, 64, 64, 40, 2
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
    p13 = ExpertWeights.stack([[quant.quantize_nf4(w13[e, :I], 64), quant.quantize_nf4(w13[e, I:], 64)]
                               for e in range(E)], torch.bfloat16)
    p2 = ExpertWeights.stack([[quant.quantize_nf4(w2[e], 64)] for e in range(E)], torch.bfloat16)
    d13, d2 = p13.dequantize(torch.float32), p2.dequantize(torch.float32)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.tensor([[1, 3]] * T)
    ids[:3] = torch.tensor([[0, 4]] * 3)
    w = torch.rand(T, k, generator=g)
    cap = fused_moe.expert_row_cap(T * k, E)
    assert cap == 32  # experts 1 and 3 take 37 rows each: two pieces apiece
    seen = []
    real = fused_moe._group_mm
    monkeypatch.setattr(fused_moe, "_group_mm",
                        lambda rows, a, sizes, offs=None: seen.append(list(sizes)) or real(rows, a, sizes, offs))
    for per in (1, 2):
        seen.clear()
        monkeypatch.setattr(fused_moe, "DEQUANT_BUFFER_BYTES", per * 3 * I * H * 2)
        got = fused_moe.dequant_rows(x, p13, p2, ids, w)
        ref = torch.stack([expert_mlp(x[t:t + 1].float(), d13[e], d2[e], torch.nn.functional.silu)[0] * w[t, j]
                           for t in range(T) for j, e in enumerate(ids[t].tolist())])
        err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        print(f"skewed packed prefill, {per} expert(s) a group, pieces {seen[::2]}: max error {err:.2e}")
        assert err < 2e-2
        assert all(len(s) <= per and max(s) <= cap for s in seen) and sum(map(sum, seen)) == 2 * T * k
        assert max(map(sum, seen)) <= per * cap and sum(s.count(cap) for s in seen) == 2 * 2  # both GEMMs a piece
    # an offload round's bank holds fewer experts than the model: the cap is the model's (`experts`), as resident
    seen.clear()
    small = fused_moe.expert_row_cap(T * k, 2 * E)
    again = fused_moe.dequant_rows(x, p13, p2, ids, w, experts=2 * E)
    assert max(map(max, seen)) == small < cap and (again.float() - got.float()).abs().max() <= 1e-2 * ref.abs().max()


def test_decode_groups_split_an_expert_past_the_cap():
    """`fused_moe._decode_groups`: the experts in the rows' sorted order, at most `per` a group, each once in a
    group and at most `cap` rows; the pieces in order give back each expert's count."""
    from ferrylm.layers.fused_moe import _decode_groups

    counts, per, cap = [5, 0, 12, 3, 1], 2, 4
    groups = _decode_groups(counts, per, cap)
    assert groups == [([0], [4]), ([0, 2], [1, 4]), ([2], [4]), ([2, 3], [4, 3]), ([4], [1])]
    for experts, sizes in groups:
        assert len(experts) <= per and len(set(experts)) == len(experts) and max(sizes) <= cap
    flat = [(e, r) for experts, sizes in groups for e, r in zip(experts, sizes)]
    assert [sum(r for e2, r in flat if e2 == e) for e in range(len(counts))] == counts
    assert _decode_groups([3, 2], 4, 8) == [([0, 1], [3, 2])]  # under the cap: one group as before


def test_warmup_routing_is_the_costliest():
    """Inside `context.costliest_routing` (the runner's warm-up step) a bank computes `moe.costliest_ids`: half
    the experts, every other one, at most `moe.expert_row_cap` rows each, distinct within a token; outside it the
    router's own ids."""
    from ferrylm.layers.context import costliest_routing
    from ferrylm.layers.moe import expert_row_cap
    from ferrylm.layers.moe import costliest_ids

    for T, k, E in ((7, 2, 8), (64, 8, 128), (5, 2, 2), (3, 4, 6)):
        ids = costliest_ids(torch.zeros(T, k, dtype=torch.long), E)
        counts = torch.bincount(ids.flatten(), minlength=E)
        assert ids.shape == (T, k) and all(len(set(r)) == k for r in ids.tolist()), (T, k, E)
        assert counts.max().item() <= expert_row_cap(T * k, E) and (counts > 0).sum().item() == min(T * k, max(k, (E + 1) // 2))
    assert costliest_ids(torch.zeros(7, 2, dtype=torch.long), 8).unique().tolist() == [0, 2, 4, 6]
    # an offload cache's experts first (`ExpertBackend.warm_experts`), then every other one
    for T, k, E in ((7, 1, 3), (10, 1, 7), (33, 2, 15)):  # odd counts: still at most the cap each
        counts = torch.bincount(costliest_ids(torch.zeros(T, k, dtype=torch.long), E).flatten())
        assert counts.max().item() <= expert_row_cap(T * k, E), (T, k, E)
    ids = costliest_ids(torch.zeros(16, 2, dtype=torch.long), 8, [5, 1, 5, 9])
    assert ids.unique().tolist() == [0, 1, 2, 5] and all(len(set(r)) == 2 for r in ids.tolist())
    assert torch.bincount(ids.flatten()).max().item() <= expert_row_cap(32, 8)
    torch.manual_seed(0)
    E, H, I, T, k = 8, 16, 24, 12, 2
    bank = Experts(E, H, I)
    for e in range(E):
        bank.load(e, "gate_up", torch.randn(2 * I, H) * 0.2)
        bank.load(e, "down", torch.randn(H, I) * 0.2)
    bank.routing_counts = torch.zeros(E, dtype=torch.long)
    x, ids, w = torch.randn(T, H), torch.zeros(T, k, dtype=torch.long), torch.rand(T, k)
    ids[:, 1] = 1
    plain = bank(x, ids, w)
    assert bank.routing_counts.tolist() == [T, T] + [0] * 6
    with costliest_routing():
        out = bank(x, ids, w)
    assert bank.routing_counts.tolist() == [T + 6, T, 6, 0, 6, 0, 6, 0] and not torch.equal(out, plain)
    cache = CachedExperts(bank, bank.w13.data, bank.w2.data, 4, [3, 7], set(), "lru", torch.device("cpu"), None,
                          OffloadStats(), 0)
    bank.backend = cache
    bank.routing_counts.zero_()
    assert cache.warm_experts() == [3, 7]  # its resident experts; the slots are empty
    with costliest_routing():
        bank(x, ids, w)
    assert bank.routing_counts.tolist() == [6, 0, 6, 6, 0, 0, 0, 6]


def test_fused_moe_alignment_matches_reference():
    """The Triton kernel's index plumbing, emulated with torch on the CPU: each padded row block holds
    one expert's assignments, padding points past the end, and the gather undoes the sort."""
    torch.manual_seed(1)
    E, H, I = 5, 16, 24
    bank = Experts(E, H, I)
    bank.load(0, "gate_up", torch.randn(2 * I, H))
    for e in range(E):
        bank.load(e, "gate_up", torch.randn(2 * I, H) * 0.2)
        bank.load(e, "down", torch.randn(H, I) * 0.2)
    for T, k, bm in ((1, 2, 16), (7, 2, 4), (33, 3, 8)):
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
        w = torch.rand(T, k)
        x = torch.randn(T, H)
        rows, block_expert, used, inv = align(ids, E, bm)
        A = T * k
        assert rows.numel() % bm == 0 and rows.numel() >= used.item()
        y = torch.zeros(rows.numel(), H)
        for b in range(rows.numel() // bm):
            if b * bm >= used.item():
                assert (rows[b * bm:] == A).all()
                break
            blk = rows[b * bm:(b + 1) * bm]
            valid = blk < A
            e = block_expert[b].item()
            assert (ids.flatten()[blk[valid]] == e).all()
            gate, up = (x[blk[valid] // k] @ bank.w13[e].t()).chunk(2, -1)
            y[b * bm + torch.nonzero(valid)[:, 0]] = (torch.nn.functional.silu(gate) * up) @ bank.w2[e].t() \
                * w.flatten()[blk[valid]][:, None]
        out = y[inv].view(T, k, H).sum(1)
        ref = TorchExperts().forward(bank, x, ids, w)
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()


def test_many_requests_leak_nothing(ckpts):
    llm = LLM(ckpts["mixtral"], dtype="float32", max_num_seqs=16, num_kv_blocks=128,
              place=("experts=cpu", "layers.1=cpu"))
    runner = llm.engine.runner
    held = len(runner.placed.host._held)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(1, 12))] for _ in range(1000)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
    assert len(runner.placed.host._held) == held
    assert llm.engine.block_manager.num_free_blocks == 128
    for cache in runner.placed.caches.values():
        assert len(cache.slot_of) <= cache.capacity
        assert all(cache.owner[s] == e for e, s in cache.slot_of.items())
    assert len(runner.placed.streamer.issued) <= 1  # at most the next step's first layer in flight


def test_budget_errors_and_cli(ckpts, tmp_path):
    with pytest.raises(ConfigError, match="matches no tensor group"):
        LLM(ckpts["llama3"], place=("experts=cpu",))
    with pytest.raises(ConfigError, match="too small"):
        LLM(ckpts["mixtral"], gpu_memory_budget=4096)
    cmd = [sys.executable, "-m", "ferrylm.cli", "generate", "--raw", "--max-tokens", "8", "The capital of France is"]
    plain = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    streamed = subprocess.run(cmd + ["--place", "layers.0-29=cpu"], capture_output=True, text=True, timeout=300)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == plain.stdout
    assert "streamed layers 0-29" in streamed.stderr  # the placement table is printed at start
    bad = subprocess.run(cmd + ["--place", "experts=cpu"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "matches no tensor group" in bad.stderr and "Traceback" not in bad.stderr


def test_knobs_that_change_nothing_say_so(ckpts, caplog):
    """On the CPU engine `--gpu-memory-utilization` has no device memory to share out (the model stays whole in
    host memory) and `--cpu-threads` past the cores makes the threads take turns: each says so at start."""
    import logging

    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        with caplog.at_level(logging.WARNING):
            llm = LLM(ckpts["mixtral"], gpu_memory_utilization=0.5)
            assert llm.engine.runner.placement.fully_resident
            assert "--gpu-memory-utilization 0.5: the CPU engine has no device memory" in caplog.text
            caplog.clear()
            LLM(ckpts["mixtral"], place=("experts=cpu",), experts="cpu", cpu_threads=cores)
            assert "--cpu-threads" not in caplog.text
            LLM(ckpts["mixtral"], place=("experts=cpu",), experts="cpu", cpu_threads=cores + 1)
            assert f"--cpu-threads {cores + 1}: more threads than the {cores} CPU(s)" in caplog.text
    finally:
        torch.set_num_threads(threads)


def test_server_reports_offload_traffic():
    """`ferry serve` with every layer streamed answers like the resident server and counts what moved."""
    import httpx
    from serving import Server, metric

    s = Server(["--place", "layers.0-29=cpu", "--max-num-seqs", "2"])
    try:
        s.wait_ready()
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4,
                "temperature": 0}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        text = httpx.get(s.url + "/metrics", timeout=30).text
        moved = metric(text, "ferry:offload_h2d_bytes_total", model_name="SmolLM2-135M-Instruct")
        tokens = metric(text, "ferry:generation_tokens_total", model_name="SmolLM2-135M-Instruct")
        assert moved > 0 and tokens >= 4
        print(f"served with every layer streamed: {moved / tokens / 2**20:.1f} MiB host->device per generated token")
    finally:
        assert s.stop() == 0


def _offloaded_with_threads(path):
    """An offloaded engine with everything a CUDA one holds that the CPU engine can: decode graphs (off CUDA
    the callables a capture records), a hybrid decode worker thread, a host expert pool thread, host-kernel
    build threads. -> (llm, weak references to its big objects and tensors, its threads)."""
    import weakref

    from ferrylm.hw.cpu_binding import worker_pool
    from ferrylm.offload.host_decode import HostDecode

    llm = LLM(path, dtype="float32", max_num_seqs=4, num_kv_blocks=64, place=("experts=cpu", "layers.1=cpu"))
    runner = llm.engine.runner
    placed = runner.placed
    runner.graphs = runner.decode_graphs()
    cache = next(iter(placed.caches.values()))
    c = runner.model_config
    from unittest import mock

    with mock.patch.object(torch.Tensor, "pin_memory", lambda self: self):  # no CUDA here: plain host buffers
        placed.host_decode = HostDecode({l: x.host_experts for l, x in placed.caches.items()}, max_tokens=4,
                                        k=c.num_experts_per_tok, hidden=c.hidden_size, dtype=torch.float32,
                                        stats=placed.stats)
    placed.cpu_pool = worker_pool(None)
    placed.cpu_pool.submit(lambda: None).result()  # its thread is running
    placed._prepare_host_experts(list(range(cache.host_w13.shape[0])))
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)
    assert runner.graphs.graphs, "a decode step ran through the graph path"
    refs = {"model": weakref.ref(runner.model), "runner": weakref.ref(runner), "placed": weakref.ref(placed),
            "kv pool": weakref.ref(runner.kv_cache.k),
            "expert slots": weakref.ref(cache.w13), "host bank": weakref.ref(cache.host_w13),
            "graphs": weakref.ref(runner.graphs), "stream buffer": weakref.ref(placed.streamer.buffers[0])}
    threads = [placed.host_decode.thread, *placed.cpu_pool._threads, *placed._prepare_threads]
    return llm, refs, threads


def test_dropped_engine_is_freed_at_once(ckpts):
    """Dropping an offloaded engine frees its tensors by reference counting alone (the collector off: no
    reference cycle holds them; the runner <-> decode graphs one used to) and its threads end."""
    import gc

    llm, refs, threads = _offloaded_with_threads(ckpts["qwen3_moe"])
    gc.collect()
    gc.disable()
    try:
        del llm
        alive = [name for name, r in refs.items() if r() is not None]
    finally:
        gc.enable()
    assert not alive, f"still held after the engine was dropped: {alive}"
    for t in threads:
        t.join(timeout=10)
    assert not [t.name for t in threads if t.is_alive()]


def test_llm_close_releases_while_held(ckpts):
    """`LLM.close()` (and `with LLM(...)`) gives everything back while the LLM object is still referenced:
    tensors, caches and the model dropped, threads ended; a second close is a no-op."""
    llm, refs, threads = _offloaded_with_threads(ckpts["qwen3_moe"])
    with llm:
        pass
    assert all(not t.is_alive() for t in threads), [t.name for t in threads if t.is_alive()]
    assert llm.engine.runner.closed and llm.engine.runner.placed.stats.steps > 0  # stats stay readable
    alive = [name for name, r in refs.items() if r() is not None and name not in ("runner", "placed")]
    assert not alive, f"still held after close(): {alive}"
    llm.close()


def test_round_counts_equal_the_mapped_ids_bincount():
    """The offload cache's fused rounds hand `dequant_rows` each slot's assignments (`expert_cache.round_counts`)
    instead of reading them back from the device: exactly the bincount of the round's slot-mapped ids."""
    from ferrylm.offload.expert_cache import round_counts

    g = torch.Generator().manual_seed(3)
    E, C, T, k = 16, 6, 40, 4
    for _ in range(20):
        topk = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        counts = torch.bincount(topk.flatten(), minlength=E).tolist()
        round_experts = torch.randperm(E, generator=g)[:C].tolist()
        slot = [C] * E
        for s, e in enumerate(round_experts[:int(torch.randint(0, C + 1, (1,), generator=g))]):
            slot[e] = s
        ids = torch.tensor(slot)[topk]
        assert round_counts(counts, slot, C) == torch.bincount(ids.flatten(), minlength=C + 1).tolist()


def test_repoint_rebuilds_the_table_from_the_slots():
    """`CachedExperts._repoint` (after a copy-road step, whose fetches leave the table alone): every expert's column
    of the address table from its slot's addresses when it holds one, else from its host rows', and the device's
    and the tally's in-slot rows alike."""
    from types import SimpleNamespace

    from ferrylm.offload.expert_cache import CachedExperts

    E, C, P = 6, 3, 2
    c = SimpleNamespace(ptr_rows=torch.zeros(P, E, dtype=torch.long), slot_cols=torch.arange(P * C).view(P, C) + 100,
                        host_cols=torch.arange(P * E).view(P, E) + 1000, slot_of={4: 0, 1: 2},
                        device=torch.device("cpu"), in_slot=torch.ones(E, dtype=torch.bool),
                        resident=torch.ones(E, dtype=torch.bool))
    CachedExperts._repoint(c)
    want = c.host_cols.clone()
    want[:, 4], want[:, 1] = c.slot_cols[:, 0], c.slot_cols[:, 2]
    assert torch.equal(c.ptr_rows, want)
    assert c.in_slot.tolist() == [False, True, False, False, True, False] and torch.equal(c.resident, c.in_slot)
    # no slots at all (`placement.min_expert_slots`: experts on the host): every column its host rows' (the H200
    # run of session 36 indexed the empty slot columns here)
    c = SimpleNamespace(ptr_rows=torch.zeros(P, E, dtype=torch.long), slot_cols=torch.zeros(P, 0, dtype=torch.long),
                        host_cols=torch.arange(P * E).view(P, E) + 1000, slot_of={}, device=torch.device("cpu"),
                        in_slot=torch.ones(E, dtype=torch.bool), resident=torch.ones(E, dtype=torch.bool))
    CachedExperts._repoint(c)
    assert torch.equal(c.ptr_rows, c.host_cols) and not c.in_slot.any() and not c.resident.any()


@pytest.mark.parametrize("slots", [1, 2])
def test_staged_experts_equal_resident(slots, tmp_path_factory, monkeypatch):
    """Copy-road staging (`expert_cache.StagingSlots`, every expert counted large): on a prefill each cached layer
    copies experts the next one lacks into slots of the first layer's cache before the next layer routes; the next
    layer computes them from there. The logits equal the resident run's bit for bit, the staged experts are all
    routed, and the first layer gets its slots back holding the experts it would hold without staging."""
    from ferrylm.offload.expert_cache import LENT

    monkeypatch.setattr(CachedExperts, "large_expert_bytes", 0)
    monkeypatch.setattr(CachedExperts, "stage_min_tokens", 0)  # the short test prompts stage
    path, _ = build(tmp_path_factory, "qwen3_moe", num_hidden_layers=4)
    _, ref_tokens, ref_logits = run(path)
    plain, _, _ = run(path, place=("experts=cpu",))  # the CPU engine stages only with staging_on_cpu
    assert plain.engine.runner.placed.staging is None and CachedExperts.staging_slots > 0
    monkeypatch.setattr(CachedExperts, "staging_on_cpu", True)
    monkeypatch.setattr(CachedExperts, "staging_slots", slots)
    llm, tokens, logits = run(path, place=("experts=cpu",))
    placed = llm.engine.runner.placed
    stats = placed.stats
    print(f"staging {slots}: {stats}")
    assert placed.staging is not None and placed.staging.n == slots
    assert stats.staged_experts > 0 and stats.staged_unused == 0
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        assert torch.equal(a, b), (a - b).abs().max().item()
    donor = placed.staging.donor
    assert not placed.staging.taken and LENT not in donor.owner
    assert donor.slot_of == plain.engine.runner.placed.caches[donor.layer].slot_of
    assert all(not c.borrowed for c in placed.caches.values())
    # staging adds at most its slots' copies a prefill over the plain run (the first layer's experts copied back)
    assert stats.copied_experts <= plain.engine.runner.placed.stats.copied_experts + 2 * slots


def test_bare_layers_share_a_slot_pool(tmp_path_factory, monkeypatch):
    """A budget with no room for 2 expert slots a layer: the layers left with no expert on the device share one
    pool of slots (`expert_cache.SlotPool`, `placement.SHARED_EXPERT_SLOTS`) and copy their misses through it in
    turn, while layers with resident experts copy through those (and stage for one another: pool layers neither stage
    nor lend). `--experts gpu` runs there; the logits equal the resident run's bit for bit; the pool is allocated and
    counted once, and the placement table names it."""
    monkeypatch.setattr(CachedExperts, "large_expert_bytes", 0)
    monkeypatch.setattr(CachedExperts, "stage_min_tokens", 0)
    monkeypatch.setattr(CachedExperts, "staging_on_cpu", True)
    path, _ = build(tmp_path_factory, "qwen3_moe", num_hidden_layers=6)
    _, ref_tokens, ref_logits = run(path)
    rules = ("experts=cpu", "layers.0-3.experts.0-1=gpu")  # layers 4-5 keep no expert of their own
    groups = group_tensors(meta_model(path))
    per_layer = minimum_device_bytes(groups, rules)
    pooled = minimum_device_bytes(groups, rules, min_expert_slots=0, shared_slots=2)
    assert pooled < per_layer
    c = meta_model(path).config
    kv = 64 * KVCache.bytes_per_block(c.num_hidden_layers, 16, c.num_key_value_heads, c.head_dim, torch.float32)
    llm, tokens, logits = run(path, experts="gpu", place=rules, num_kv_blocks=64,
                              gpu_memory_budget=(pooled + per_layer) // 2 + kv)
    runner = llm.engine.runner
    placed, pl = runner.placed, runner.placement
    assert pl.shared_slots == 2 and pl.pool_layers() == [4, 5] and not any(pl.expert_slots.values())
    assert [placed.caches[l].pool is not None for l in range(6)] == [False] * 4 + [True] * 2
    assert placed.caches[4].pool is placed.caches[5].pool is placed.pool and placed.pool.n == 2
    assert placed.pool.nbytes == pl.shared_slots * pl.shared_slot_bytes and placed.caches[4].slot_bytes == 0
    assert placed.staging is not None and placed.staging.donor.layer == 0
    assert {c.layer for c in placed.staging.linked} == {1, 2, 3}
    assert "2 slots shared by layer(s) 4-5" in runner.placement_text
    stats = placed.stats
    print(f"pool: {stats}")
    assert stats.copied_experts > 0 and stats.cpu_experts == 0 and stats.staged_experts > 0
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        assert torch.equal(a, b), (a - b).abs().max().item()
    # only the pool's last user sees experts in it (the last step's layer 5)
    assert placed.pool.user is placed.caches[5] and placed.caches[5].slot_of and not placed.caches[4].slot_of
    llm.close()  # the pool's slots go with the caches (and the staging slots with their donor)
    assert placed.pool is None and placed.staging is None and not placed.caches
    # no pool (`memory.SHARED_EXPERT_SLOTS` 0, the benchmarks' A/B): copies only is refused there, clearly
    from ferrylm.offload import memory

    monkeypatch.setattr(memory, "SHARED_EXPERT_SLOTS", 0)
    with pytest.raises(ConfigError, match="too small"):
        LLM(path, dtype="float32", max_num_seqs=4, experts="gpu", place=rules, num_kv_blocks=64,
            gpu_memory_budget=(pooled + per_layer) // 2 + kv)


def test_short_steps_never_stage(tmp_path_factory, monkeypatch):
    """Staging on, at its token gate (`CachedExperts.stage_min_tokens`): short prompts and decode steps stage nothing
    and run as with staging off (the same hits, misses and copies, every cache's slots alike, the same logits);
    a prompt of the gate's length stages."""
    monkeypatch.setattr(CachedExperts, "large_expert_bytes", 0)
    monkeypatch.setattr(CachedExperts, "stage_min_tokens", 64)
    path, _ = build(tmp_path_factory, "qwen3_moe", num_hidden_layers=4)
    plain, plain_tokens, plain_logits = run(path, place=("experts=cpu",))  # (the CPU engine's default: no staging)
    monkeypatch.setattr(CachedExperts, "staging_on_cpu", True)
    monkeypatch.setattr(CachedExperts, "staging_slots", 2)
    llm, tokens, logits = run(path, place=("experts=cpu",))
    placed, ref = llm.engine.runner.placed, plain.engine.runner.placed
    assert placed.staging is not None and ref.staging is None
    got = {f: getattr(placed.stats, f) for f in ("staged_experts", "expert_hits", "expert_misses", "copied_experts")}
    want = {f: getattr(ref.stats, f) for f in got}
    print(f"gated: {got}; staging off: {want}")
    assert got == {**want, "staged_experts": 0}
    assert all(placed.caches[l].slot_of == ref.caches[l].slot_of for l in ref.caches)
    assert tokens == plain_tokens and all(torch.equal(a, b) for a, b in zip(logits, plain_logits))
    long_prompt = torch.randint(0, 250, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert placed.stats.staged_experts > 0
