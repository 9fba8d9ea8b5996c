"""The same engine on a CUDA GPU (skipped without one): logits against transformers, batching invariance,
Yuan against its golden data, and bf16 close to fp32."""

import os

import pytest
import torch

from ferrylm import LLM, SamplingParams

from helpers import capture_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


def free_engines() -> None:
    """Each engine sizes its KV cache from the memory free at its start: give back what dropped engines
    held (their reference cycles wait for the collector) before the next one starts."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _free_device_memory():
    yield
    free_engines()


DATA = os.path.join(os.path.dirname(__file__), "data")


def sampled_rows(llm, prompts, steps):
    """Greedy run; `steps` is one max_tokens for all prompts or one per prompt. Returns the outputs and,
    per prompt, the stacked logits rows it sampled from."""
    steps = steps if isinstance(steps, list) else [steps] * len(prompts)
    with capture_logits(llm.engine) as got:
        outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in steps])
    rows: dict[int, list] = {}
    for sid, r in got:
        rows.setdefault(sid, []).append(r.float().cpu())
    return outs, [torch.stack(rows[s]) for s in sorted(rows)]


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def worst_while_equal(ref_out, ref, out, got, flip_row: bool = True) -> tuple[float, int]:
    """Max |logit diff| over the rows both runs computed from the same context: per sequence, the rows up to
    and including the first step whose sampled tokens differ (bf16 rounding may flip a near-tie; after it the
    contexts differ and so do the logits, by any amount). Also returns how many sequences diverged. Without
    `flip_row` the step whose tokens differ is left out too: a router near-tie flipped by bf16 rounding inside it
    (another expert chosen in some layer) moves its logits by far more than rounding (0.5-0.6 seen) and may be
    what flipped the token."""
    worst, diverged = 0.0, 0
    for r_o, r, o, g in zip(ref_out, ref, out, got):
        a, b = r_o.outputs[0].token_ids, o.outputs[0].token_ids
        n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        diverged += n is not None
        m = len(r) if n is None else n + int(flip_row)
        if m:  # (without the flip row, a sequence whose first token differs compares no row)
            worst = max(worst, (r[:m] - g[:m]).abs().max().item())
    return worst, diverged


@pytest.mark.parametrize("family", ["llama3", "qwen2", "mixtral", "qwen2_moe"])
def test_family_on_cuda_matches_transformers(family, tmp_path_factory):
    from test_models_hf import build

    path, ref = build(tmp_path_factory, family)
    prompt = [5, 17, 42, 99, 3, 200, 7, 64, 11, 150, 33]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    ref_logits = torch.cat(out.logits)
    llm = LLM(path, device="cuda", dtype="float32")
    res, (ours,) = sampled_rows(llm, [prompt], 16)
    diff = (ours - ref_logits).abs().max().item()
    print(f"cuda {family}: max |logit diff| vs transformers (CPU fp32) = {diff:.3e}")
    assert diff < 1e-3
    assert res[0].outputs[0].token_ids == out.sequences[0, len(prompt):].tolist()


def test_cuda_batching_invariance(tiny_llama):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (37, 5, 60, 1, 23, 48)]
    alone = LLM(tiny_llama, device="cuda", dtype="float32", max_num_seqs=1, enable_prefix_caching=False)
    ref = [sampled_rows(alone, [p], 12)[1][0] for p in prompts]
    batched = LLM(tiny_llama, device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, block_size=4,
                  num_kv_blocks=20)
    _, got = sampled_rows(batched, prompts, 12)
    assert batched.engine.scheduler.num_preemptions > 0
    worst = max((r - o).abs().max().item() for r, o in zip(ref, got))
    print(f"cuda batched vs alone: {worst:.3e}")
    assert worst < 1e-3


@pytest.mark.parametrize("name", ["yuan2-tiny", "yuan2-m32-tiny"])
def test_yuan_on_cuda_matches_golden(name):
    from safetensors.torch import load_file

    g = load_file(os.path.join(DATA, name, "golden.safetensors"))
    overrides = {"rope_dtype": "bfloat16"} if "m32" in name else {}
    llm = LLM(os.path.join(DATA, name), device="cuda", dtype="float32", model_overrides=overrides)
    outs, (ours,) = sampled_rows(llm, [g["input_ids"][0].tolist()], len(g["greedy_ids"]))
    diff = (ours - g["decode_logits"]).abs().max().item()
    print(f"cuda {name}: max |logit diff| vs golden = {diff:.3e}")
    assert diff < 1e-3
    assert outs[0].outputs[0].token_ids == g["greedy_ids"].tolist()


def test_bf16_close_to_fp32(tiny_llama):
    p = [[1, 2, 3, 4, 5, 6, 7, 8]]
    _, (f32,) = sampled_rows(LLM(tiny_llama, device="cuda", dtype="float32"), p, 1)
    _, (b16,) = sampled_rows(LLM(tiny_llama, device="cuda", dtype="bfloat16"), p, 1)
    cos = torch.nn.functional.cosine_similarity(f32, b16, dim=-1).min().item()
    print(f"bf16 vs fp32 first-step logits cosine = {cos:.5f}")
    assert cos > 0.99


def test_cuda_graph_decode_equals_eager(tiny_llama):
    """The graph path (padded batch and context buckets) against the eager reference."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 40, 17, 70, 9)]
    steps = [150, 10, 30, 50, 5]

    eager = LLM(tiny_llama, device="cuda", dtype="float32", enforce_eager=True)
    graph = LLM(tiny_llama, device="cuda", dtype="float32", max_num_seqs=8)
    assert graph.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    a_out, a = sampled_rows(eager, prompts, steps)
    b_out, b = sampled_rows(graph, prompts, steps)
    keys = sorted(graph.engine.runner.graphs.graphs)
    assert len({k[0] for k in keys}) >= 3 and len({k[1] for k in keys}) >= 2  # batch and context buckets
    worst = max((x - y).abs().max().item() for x, y in zip(a, b))
    print(f"cuda graph vs eager: max |logit diff| = {worst:.3e}, graphs {keys}")
    assert worst < 1e-4
    assert token_ids(a_out) == token_ids(b_out)


def test_piecewise_graphs_equal_eager(tiny_llama):
    """Prefill and mixed steps through the piecewise graphs (pre/post per layer captured per token bucket,
    attention eager) against the eager reference, with chunked prefill and new arrivals mid-decode."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (50, 3, 33, 90, 12, 61)]
    steps = [20, 40, 8, 30, 25, 12]

    kw = dict(device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64)
    a_out, a = sampled_rows(LLM(tiny_llama, enforce_eager=True, **kw), prompts, steps)
    free_engines()  # the graphed engine sizes its KV from what the eager one leaves
    graphed = LLM(tiny_llama, **kw)
    b_out, b = sampled_rows(graphed, prompts, steps)
    buckets = sorted(graphed.engine.runner.piecewise.graphs)
    assert len(buckets) >= 2, buckets
    worst = max((x - y).abs().max().item() for x, y in zip(a, b))
    print(f"cuda piecewise graphs vs eager: max |logit diff| = {worst:.3e}, token buckets {buckets}")
    assert worst < 1e-4
    assert token_ids(a_out) == token_ids(b_out)


@pytest.mark.parametrize("E,H,I,k", [(8, 256, 512, 2), (16, 128, 96, 4), (4, 512, 1024, 1)])
def test_fused_moe_matches_torch_reference(E, H, I, k):
    from ferrylm.layers.fused_moe import fused_experts
    from ferrylm.layers.moe import Experts, TorchExperts

    torch.manual_seed(E + H)
    bank = Experts(E, H, I)
    bank.w13.data = torch.randn(E, 2 * I, H, device="cuda") * 0.05
    bank.w2.data = torch.randn(E, H, I, device="cuda") * 0.05
    for T in (1, 3, 64, 700):
        ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
        w = torch.rand(T, k, device="cuda").softmax(-1)
        x = torch.randn(T, H, device="cuda")
        bank64 = Experts(E, H, I)
        bank64.w13.data, bank64.w2.data = bank.w13.data.double(), bank.w2.data.double()
        ref = TorchExperts().forward(bank64, x.double(), ids, w.double())
        out = fused_experts(x.bfloat16(), bank.w13.data.bfloat16(), bank.w2.data.bfloat16(), ids, w)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        print(f"fused MoE E={E} H={H} I={I} k={k} T={T}: rel err vs fp64 = {rel:.2e}")
        assert rel < 2e-2


def test_fused_moe_in_a_cuda_graph():
    from ferrylm.layers.fused_moe import fused_experts

    torch.manual_seed(0)
    E, H, I, T, k = 8, 256, 384, 4, 2
    w13 = (torch.randn(E, 2 * I, H, device="cuda") * 0.05).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda") * 0.05).bfloat16()
    x = torch.randn(T, H, device="cuda").bfloat16()
    ids = torch.randint(0, E, (T, k), device="cuda")
    w = torch.rand(T, k, device="cuda")
    fused_experts(x, w13, w2, ids, w)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fused_experts(x, w13, w2, ids, w)
    for _ in range(3):
        ids.copy_(torch.randint(0, E, (T, k), device="cuda"))
        x.copy_(torch.randn(T, H, device="cuda"))
        g.replay()
        assert torch.equal(out, fused_experts(x, w13, w2, ids, w))


def test_offloaded_on_cuda_equals_resident(tiny_llama, tmp_path_factory):
    """Streamed layers and cached experts (copies on their own stream) against the resident run."""
    from test_models_hf import build

    p = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 3, 7, 200, 11]]
    _, ref = sampled_rows(LLM(tiny_llama, device="cuda", dtype="float32", enforce_eager=True), p, 20)
    llm = LLM(tiny_llama, device="cuda", dtype="float32", place=("layers.0-1=cpu",))
    _, got = sampled_rows(llm, p, 20)
    assert llm.engine.runner.placed.streamer is not None and llm.engine.runner.graphs is None
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    path, _ = build(tmp_path_factory, "mixtral")
    kw = dict(device="cuda", dtype="bfloat16", moe_backend="torch", enforce_eager=True)
    _, ref = sampled_rows(LLM(path, **kw), p, 20)
    llm = LLM(path, place=("experts=cpu", "layers.1=cpu"), **kw)
    _, got = sampled_rows(llm, p, 20)
    stats = llm.engine.runner.placed.stats
    print(f"cuda offloaded mixtral: {stats}")
    assert stats.expert_misses > 0
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert stats.device_step_s > 0 and not stats._stalls  # every timed wait read back, the steps timed


def test_offloaded_async_equals_sync_on_cuda(tmp_path_factory):
    """Async scheduling, on by default for offloaded engines too, against the synchronous loop on the roads an
    offloaded MoE decodes through (bf16: the fused kernel, mapped caches with their routing tally and
    promotions): misses read in place, graphed and eager; every miss on the host's cores (hybrid decode at
    share 1, graphed); a streamed layer with misses copied (no graphs). On the device roads an expert's math is
    the same wherever it lies (a slot or host memory read in place: the mapped test's bits), so the tokens and
    logits are bitwise the sync run's. On the host road the tally promotes an expert one step later under async
    (its counts are read a step late), and a promoted expert runs on the device: there the logits agree within
    bf16 rounding while the tokens agree (the host's and the device's bf16 sums differ)."""
    from test_models_hf import build

    path, _ = build(tmp_path_factory, "qwen3_moe")
    g = torch.Generator().manual_seed(15)
    p = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (8, 5, 30)]
    roads = {"in place": dict(experts="gpu"), "in place eager": dict(experts="gpu", enforce_eager=True),
             "host": dict(experts="auto", cpu_share=1.0),
             "streamed": dict(experts="gpu", place=("experts=cpu", "layers.1=cpu"))}
    for road, extra in roads.items():
        kw = dict(device="cuda", dtype="bfloat16", place=("experts=cpu", "layers.0.experts.0-1=gpu"),
                  gpu_memory_budget="2GiB")
        kw.update(extra)
        on = LLM(path, **kw)
        placed = on.engine.runner.placed
        assert on.engine.async_scheduling
        assert (on.engine.runner.graphs is not None) == (road in ("in place", "host"))
        assert (placed.host_decode is not None) == (road == "host")
        assert (placed.streamer is not None) == (road == "streamed")
        b_out, b = sampled_rows(on, p, [16, 9, 20])
        st = placed.stats
        del on, placed
        free_engines()
        off = LLM(path, async_scheduling="off", **kw)
        a_out, a = sampled_rows(off, p, [16, 9, 20])
        del off
        free_engines()
        worst, diverged = worst_while_equal(a_out, a, b_out, b)
        print(f"offloaded async vs sync ({road}): max |logit diff| {worst:.3e}, {diverged} diverged; {st}")
        if road == "host":
            assert st.cpu_experts > 0 and worst < 5e-2
            assert [o.outputs[0].token_ids[:4] for o in b_out] == [o.outputs[0].token_ids[:4] for o in a_out]
        else:
            assert st.expert_misses > 0
            assert token_ids(a_out) == token_ids(b_out) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_weight_wait_is_timed_on_the_device():
    """`OffloadStats.wait`: a compute stream told to wait for a copy still in flight counts one weight wait and,
    once its events completed (`collect`), about the copy's time in `weight_wait_s` (the stream sat idle for
    it); a copy that has landed costs neither."""
    from ferrylm.offload.placed_weights import OffloadStats

    st, side, cur = OffloadStats(), torch.cuda.Stream(), torch.cuda.current_stream()
    st.IDLE_GAP_S = 0.0  # the step's span ends at its own end
    host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    ready = torch.cuda.Event()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.begin_step(cur)
    with torch.cuda.stream(side):
        t0.record(side)
        dev.copy_(host, non_blocking=True)
        t1.record(side)
        ready.record(side)
    st.wait(cur, ready)
    dev.add_(1)  # queued behind the wait
    st.end_step(cur)
    torch.cuda.synchronize()
    st.collect()
    copy_s = t0.elapsed_time(t1) / 1e3
    print(f"copy {copy_s * 1e3:.2f} ms, waited {st.weight_wait_s * 1e3:.2f} ms, step {st.device_step_s * 1e3:.2f} ms")
    assert st.weight_waits == 1 and not st._stalls and not st._spans
    assert 0.5 * copy_s < st.weight_wait_s <= copy_s * 1.05 + 1e-4
    assert st.weight_wait_s <= st.device_step_s and 0.5 < st.weight_wait_share <= 1
    st.wait(cur, ready)  # landed: neither counted nor timed
    assert st.weight_waits == 1 and not st._stalls


def test_resident_moe_fused_and_graphed(tmp_path_factory):
    from test_models_hf import build

    path, _ = build(tmp_path_factory, "mixtral")
    prompts = [[5, 17, 42, 99, 3, 200, 7, 64, 11, 150, 33], [1, 2, 3]]
    ref_out, ref = sampled_rows(LLM(path, device="cuda", dtype="bfloat16", moe_backend="torch", enforce_eager=True),
                                prompts, 16)
    eager_out, eager = sampled_rows(LLM(path, device="cuda", dtype="bfloat16", enforce_eager=True), prompts, 16)
    graphed = LLM(path, device="cuda", dtype="bfloat16")
    assert graphed.engine.runner.graphs is not None
    g_out, g = sampled_rows(graphed, prompts, 16)
    worst = max((a - b).abs().max().item() for a, b in zip(ref, eager))
    print(f"fused vs torch experts (bf16): max |logit diff| = {worst:.3e}")
    assert worst < 0.1
    assert all(torch.allclose(a, b, atol=1e-2) for a, b in zip(eager, g))
    assert token_ids(eager_out) == token_ids(g_out)


@pytest.mark.parametrize("rounds", ["each", "misses", "all", "each-mapped"])
def test_cached_experts_fused_rounds_equal_resident_fused(rounds, tmp_path_factory, monkeypatch):
    """Cached experts through the fused kernel in rounds (every expert counted large: `each`, the evictable hits
    one a round, each slot taking the next copy, then the misses one a round as they land; `misses`, the hits in
    one round; `all`, one round of all in flight, then waves; with the first two, each layer stages the next layer's
    experts in slots of the first layer's cache before its routing) give exactly the resident fused result."""
    from test_models_hf import build

    from ferrylm.offload.expert_cache import CachedExperts

    mapped = rounds.endswith("-mapped")  # the donor's slots then leave and rejoin its address table
    rounds = rounds.removesuffix("-mapped")
    monkeypatch.setattr(CachedExperts, "one_large_a_round", rounds != "all")
    monkeypatch.setattr(CachedExperts, "free_hits_first", rounds == "each")
    monkeypatch.setattr(CachedExperts, "large_expert_bytes", 0)
    monkeypatch.setattr(CachedExperts, "stage_min_tokens", 0)  # these prompts are short (the engine's gate: 256)
    monkeypatch.setattr(CachedExperts, "staging_slots", 2)

    path, _ = build(tmp_path_factory, "qwen3_moe", num_hidden_layers=4)  # staging: a donor and two layers beside it
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 3, 17, 9)]
    # a KV pool of its own size: two engines at the default share of an 80 GB card do not fit (session 37's H100)
    kw = dict(device="cuda", dtype="bfloat16", enforce_eager=True, kv_cache_memory_gb=1)
    ref_out, ref = sampled_rows(LLM(path, **kw), prompts, 12)
    # experts="gpu": every miss is copied, none computed by the host's cores, so the bits must match;
    # mapped_experts off: the rounds path at every step (on, `-mapped`: decode steps read misses in place, the
    # resident kernel's bits too, and the prefill's staging takes and gives back a mapped donor's slots)
    llm = LLM(path, place=("experts=cpu", "layers.0.experts.0=gpu"), experts="gpu", mapped_experts=mapped, **kw)
    assert all(c.fused for c in llm.engine.runner.placed.caches.values())
    out, got = sampled_rows(llm, prompts, 12)
    stats = llm.engine.runner.placed.stats
    print(f"fused rounds: {stats}")
    assert stats.cpu_experts == 0 and stats.expert_misses > 0
    if rounds != "all":  # the prefills' layers stage the next layer's experts in the first layer's slots
        assert stats.staged_experts > 0
    assert token_ids(out) == token_ids(ref_out)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))

    # The hybrid split (some misses computed on the host in fp32 math over bf16 weights) agrees within bf16
    # rounding, not bitwise: the host's matmul sums in another order.
    if rounds != "all" or mapped:
        return  # the host's half does not depend on the round order
    hybrid = LLM(path, place=("experts=cpu", "layers.0.experts.0=gpu"), experts="cpu", mapped_experts=False, **kw)
    _, mixed = sampled_rows(hybrid, prompts, 12)
    worst = max((a - b).abs().max().item() for a, b in zip(ref, mixed))
    print(f"hybrid host experts vs resident fused: max |logit diff| = {worst:.3e}, {hybrid.engine.runner.placed.stats}")
    assert hybrid.engine.runner.placed.stats.cpu_experts > 0
    assert worst < 0.5  # measured 0.23 on this tiny random model (logits ~ +-5)


def test_weight_table_reads_mapped_host_memory_in_place():
    """The fused kernel through a table of addresses (some device slots, some pinned host rows read over
    PCIe) gives the bits of the resident bank, eagerly and inside a CUDA graph."""
    from ferrylm.layers.fused_moe import WeightTable, expert_rows
    from ferrylm.offload.host_tier import HostTier

    torch.manual_seed(3)
    E, H, I, k = 8, 256, 384, 2
    w13 = (torch.randn(E, 2 * I, H, device="cuda") * 0.05).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda") * 0.05).bfloat16()
    tier = HostTier(pin=True)
    h13, h2 = tier.empty(w13.shape, w13.dtype), tier.empty(w2.shape, w2.dtype)
    h13.copy_(w13.cpu())
    h2.copy_(w2.cpu())
    assert tier.is_mapped(h13) and tier.is_mapped(h2)
    slots = [1, 5]  # experts 1 and 5 on the device, the rest read from the host
    p13 = [w13[e].data_ptr() if e in slots else a for e, a in enumerate(WeightTable.addresses(h13))]
    p2 = [w2[e].data_ptr() if e in slots else a for e, a in enumerate(WeightTable.addresses(h2))]
    t13 = WeightTable(torch.tensor(p13, device="cuda"), w13)
    t2 = WeightTable(torch.tensor(p2, device="cuda"), w2)
    for T in (1, 5, 64):
        x = torch.randn(T, H, device="cuda").bfloat16()
        ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
        w = torch.rand(T, k, device="cuda")
        assert torch.equal(expert_rows(x, t13, t2, ids, w), expert_rows(x, w13, w2, ids, w))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = expert_rows(x, t13, t2, ids, w)
    ids.copy_(torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(64)]))
    g.replay()
    assert torch.equal(out, expert_rows(x, w13, w2, ids, w))
    tier.close()


@pytest.mark.parametrize("after_layer", [False, True], ids=["copies-after-step", "copies-after-layer"])
def test_mapped_experts_equal_resident_fused_and_graphed(after_layer, tmp_path_factory, monkeypatch):
    """Offloaded experts read in place at decode (graphed) and copied at prefill give the resident fused
    bits; the slots follow the routing (promotions land behind the table), their copies started after the
    whole step or, with `CachedExperts.promote_after_layer`, once their layer of it has run."""
    from test_models_hf import build

    from ferrylm.offload.expert_cache import CachedExperts

    monkeypatch.setattr(CachedExperts, "promote_after_layer", after_layer)

    path, _ = build(tmp_path_factory, "qwen3_moe")
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (70, 3, 17, 9)]  # 70: a copied step
    refs = {}
    for eager, extra in ((True, ()), (False, ()), (False, ("embed=cpu",))):  # a host table: embedded before replay
        kw = dict(device="cuda", dtype="bfloat16", enforce_eager=eager)
        if eager not in refs:
            refs[eager] = sampled_rows(LLM(path, **kw), prompts, 24)
        ref_out, ref = refs[eager]
        budget = {"gpu_memory_budget": "2GiB"} if extra else {}
        # no prefix cache: the second pass below runs the same prompts and must recompute them as the reference did
        llm = LLM(path, place=("experts=cpu", "layers.0.experts.0-1=gpu", *extra), experts="gpu", **budget, **kw,
                  enable_prefix_caching=False)
        placed = llm.engine.runner.placed
        assert placed.tally is not None and all(c.mapped for c in placed.caches.values())
        assert (llm.engine.runner.graphs is not None) == (not eager)
        out, got = sampled_rows(llm, prompts, 24)
        moved = sum(len(c.landing) for c in placed.caches.values())
        print(f"mapped experts eager={eager} {extra}: {placed.stats}, promotions in flight {moved}")
        assert placed.stats.expert_misses > 0
        assert token_ids(out) == token_ids(ref_out)
        worst = max((a - b).abs().max().item() for a, b in zip(ref, got))
        print(f"mapped vs resident (eager={eager}): max |logit diff| = {worst:.3e}")
        # eager: the same kernel, bit for bit; graphed: the resident run also graphs its prefill (piecewise)
        assert worst == 0.0 if eager else worst < 1e-2
        slot_books(placed)
        if eager:  # the plain slot policy, promotions pointed at once seen landed (copies overlap): same bits
            placed.tally.set_policy("frequent")
            placed.tally.land_now = False
            out, got = sampled_rows(llm, prompts, 24)
            assert max((a - b).abs().max().item() for a, b in zip(ref, got)) == 0.0
            slot_books(placed)
        # promotions pointed at by the copy stream (`land_on_copy_stream`): nothing waits, the kernels read an
        # expert in place until its copy lands, graphed steps too: the same bits
        placed.tally.set_policy("dueling")
        placed.tally.land_on_copy_stream = True
        out, got = sampled_rows(llm, prompts, 24)
        worst = max((a - b).abs().max().item() for a, b in zip(ref, got))
        print(f"promotions landed on the copy stream (eager={eager}): max |logit diff| = {worst:.3e}, {placed.stats}")
        assert token_ids(out) == token_ids(ref_out) and (worst == 0.0 if eager else worst < 1e-2)
        slot_books(placed)


def slot_books(placed):
    """Every cache's slots, table and tally rows agree; pinned experts stay; the device counted hits."""
    torch.cuda.synchronize()
    assert 0 < placed.stats.expert_hits + placed.stats.expert_misses
    for i, c in enumerate(placed.tally.caches):
        c.land(wait=True)
        assert {e for e in c.owner if e is not None} == set(c.slot_of) and len(c.slot_of) <= c.capacity
        assert all(c.owner[s] == e for e, s in c.slot_of.items()) and c.pinned <= set(c.slot_of)
        assert set(placed.tally.resident[i].nonzero().flatten().tolist()) == set(c.slot_of)
        assert torch.equal(c.in_slot.cpu(), placed.tally.resident[i])


@pytest.mark.parametrize("scheme,group", [("int4", 32), ("int8", 64), ("fp8", 64)])
def test_packed_experts_resident_and_offloaded(scheme, group, tmp_path_factory, monkeypatch):
    """A quantized store's experts stay packed on CUDA (the fused kernel decodes tiles): close to the
    dequantized torch reference over the same contexts; offloaded (read in place / copied packed) equal to
    resident bit for bit (H200, session 7: int4 1.94e-2, int8 1.95e-2)."""
    from test_models_hf import build

    from ferrylm.models import base
    from ferrylm.weights.convert import ConvertOptions, convert

    assert scheme in base.ENGINE_PACKED_FORMATS

    path, _ = build(tmp_path_factory, "qwen3_moe")
    store = str(tmp_path_factory.mktemp(f"packed-{scheme}") / "s")
    convert(path, store, ConvertOptions(quant=scheme, group_size=group))
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (70, 3, 17)]
    kw = dict(device="cuda", dtype="bfloat16", enforce_eager=True)
    ref_out, ref = sampled_rows(LLM(store, moe_backend="torch", **kw), prompts, 12)
    resident = LLM(store, **kw)
    banks = [m for m in resident.engine.runner.model.modules() if hasattr(m, "packed")]
    assert banks and all(b.packed is not None for b in banks)
    res_out, res = sampled_rows(resident, prompts, 12)
    worst, diverged = worst_while_equal(ref_out, ref, res_out, res)
    every = max((a - b).abs().max().item() for a, b in zip(ref, res))
    print(f"packed {scheme} experts (fused kernel) vs dequantized torch reference: max |logit diff| = {worst:.3e} "
          f"over the same contexts ({diverged} sequences flipped a token; {every:.3e} over every row)")
    assert worst < 0.1
    off = LLM(store, place=("experts=cpu", "layers.0.experts.0=gpu"), experts="gpu", **kw)
    placed = off.engine.runner.placed
    assert placed.tally is not None and all(c.packed for c in placed.caches.values())
    off_out, got = sampled_rows(off, prompts, 12)
    print(f"packed {scheme} offloaded: {placed.stats}")
    assert placed.stats.expert_misses > 0
    assert token_ids(off_out) == token_ids(res_out)
    assert all(torch.equal(a, b) for a, b in zip(res, got))


def test_fp8_checkpoint_packed_on_cuda(tmp_path_factory):
    """A block-wise FP8 checkpoint (DeepSeek-V3's format, tests/test_fp8_checkpoint.py) on CUDA: experts kept packed
    as group-wise fp8 (the fused kernel) and Linears packed (`packed_linear`), close to the same weights
    dequantized (the plain path: `dequantize=True`) over the same contexts; offloaded equal to resident bit for bit."""
    from test_fp8_checkpoint import fp8_pair

    fp8, _, _ = fp8_pair(tmp_path_factory, "deepseek_v3")
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (70, 3, 17)]
    kw = dict(device="cuda", dtype="bfloat16", enforce_eager=True)
    ref_out, ref = sampled_rows(LLM(fp8, dequantize=True, **kw), prompts, 12)
    resident = LLM(fp8, **kw)
    banks = [m for m in resident.engine.runner.model.modules() if getattr(m, "packed", None) is not None]
    assert banks and all(b.packed[0].fmt == "fp8" and b.packed[0].group == 16 for b in banks)
    res_out, res = sampled_rows(resident, prompts, 12)
    worst, diverged = worst_while_equal(ref_out, ref, res_out, res)
    print(f"FP8 checkpoint packed (fused kernel, packed Linears) vs dequantized: max |logit diff| = {worst:.3e} "
          f"over the same contexts ({diverged} sequences flipped a token)")
    assert worst < 0.1
    off = LLM(fp8, place=("experts=cpu", "layers.1.experts.0=gpu"), experts="gpu", **kw)
    off_out, got = sampled_rows(off, prompts, 12)
    assert off.engine.runner.placed.stats.expert_misses > 0
    assert token_ids(off_out) == token_ids(res_out)
    assert all(torch.equal(a, b) for a, b in zip(res, got))


def test_packed_dense_layers_streamed_equal_resident(tmp_path_factory):
    """A quantized store's streamed layers cross PCIe packed and are dequantized on the device: the same
    bits as the resident packed run."""
    from test_models_hf import build

    from ferrylm.weights.convert import ConvertOptions, convert

    path, _ = build(tmp_path_factory, "llama3")
    store = str(tmp_path_factory.mktemp("packed-dense") / "s")
    convert(path, store, ConvertOptions(quant="int8"))
    p = [[5, 17, 42, 99, 3, 200, 7], [1, 2, 3]]
    kw = dict(device="cuda", dtype="bfloat16", enforce_eager=True)
    out, ref = sampled_rows(LLM(store, **kw), p, 10)
    llm = LLM(store, place=("layers.1=cpu",), **kw)
    placed = llm.engine.runner.placed
    assert placed.streamer is not None
    got_out, got = sampled_rows(llm, p, 10)
    print(f"packed streamed layers: {placed.stats}")
    assert placed.stats.h2d_bytes > 0
    assert token_ids(got_out) == token_ids(out)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.parametrize("quant", ["nf4", "int4", "int8"])
def test_packed_linears_triton_equal_the_dequantize_path(quant, tmp_path_factory, monkeypatch):
    """Packed Linears on CUDA (`layers/packed_linear.py`: the in-tile Triton GEMM at decode, graphed, and dense
    chunks for cuBLAS in a prefill past `DENSE_FROM_T` tokens) against the plain `Dequantize` path of the same
    store: the first logits row (the prefill) and the greedy decode, compared over the same contexts."""
    from test_models_hf import build

    from ferrylm.layers import packed_linear
    from ferrylm.weights.convert import ConvertOptions, convert

    path, _ = build(tmp_path_factory, "llama3")
    store = str(tmp_path_factory.mktemp(f"packed-linear-{quant}") / "s")
    convert(path, store, ConvertOptions(quant=quant))
    p = [[(7 * i + 3) % 200 for i in range(57)], [1, 2, 3]]
    kw = dict(device="cuda", dtype="bfloat16", gpu_memory_budget="8GiB")  # resident, a bounded KV pool
    llm = LLM(store, **kw)
    try:
        kinds = [type(k).__name__ for m in llm.engine.runner.model.modules() for k in getattr(m, "kernels", [])]
        print(f"{quant}: kernels {sorted(set(kinds))} ({kinds.count('PackedTriton')} of {len(kinds)} Triton)")
        assert kinds.count("PackedTriton") >= len(kinds) // 2  # (a width its groups do not tile stays plain)
        out, got = sampled_rows(llm, p, 8)
    finally:
        llm.close()
    monkeypatch.setattr(packed_linear, "ENABLED", False)
    plain = LLM(store, **kw)
    try:
        assert not any(type(k).__name__ == "PackedTriton" for m in plain.engine.runner.model.modules()
                       for k in getattr(m, "kernels", []))
        ref_out, ref = sampled_rows(plain, p, 8)
    finally:
        plain.close()
    for a, b, o, r in zip(got, ref, token_ids(out), token_ids(ref_out)):
        same = next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), len(o)) + 1  # rows of the same contexts
        diff = (a[:same] - b[:same]).abs().max().item()
        print(f"{quant}: packed Triton vs dequantize, max |logit diff| {diff:.3e} over {same} rows; tokens {o} / {r}")
        assert diff < 0.1 * b.abs().max().item()
        assert same >= 3


def test_triton_attention_equals_torch_attention(tiny_llama):
    """The Triton paged kernels (decode graphed, prefill chunks with cached prefixes in one launch) against
    the torch path run eagerly: fp32 to 1e-4 (exact-fp32 dots), bf16 within its rounding."""
    from test_attention_kernels import _greedy_rows

    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (50, 3, 33, 90, 12, 61)]
    steps = [40, 20, 8, 30, 25, 12]
    kw = dict(device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, block_size=8)
    ref = LLM(tiny_llama, attention_backend="torch", enforce_eager=True, **kw)
    fast = LLM(tiny_llama, **kw)  # auto: triton on CUDA, decode graphs on
    assert fast.engine.runner.attention_backend == "triton" and fast.engine.runner.graphs is not None
    a_out, a = sampled_rows(ref, prompts, steps)
    b_out, b = sampled_rows(fast, prompts, steps)
    assert fast.engine.runner.graphs.graphs, "no decode graph was captured around the Triton kernel"
    worst = max((x - y).abs().max().item() for x, y in zip(a, b))
    print(f"cuda triton (graphed decode) vs torch eager attention, fp32: max |logit diff| = {worst:.3e}")
    assert worst < 1e-4
    assert token_ids(a_out) == token_ids(b_out)
    # bf16: compared while the greedy picks agree (bf16 rounding may flip a near tie later)
    base = dict(device="cuda", dtype="bfloat16", block_size=8, max_num_batched_tokens=32, max_num_seqs=4)
    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 7, 90)]
    ids_t, rows_t = _greedy_rows(LLM(tiny_llama, attention_backend="torch", **base), ps, 12)
    ids_k, rows_k = _greedy_rows(LLM(tiny_llama, attention_backend="triton", **base), ps, 12)
    worst = top = 0.0
    for ia, ib, ra, rb in zip(ids_t, ids_k, rows_t, rows_k):
        k = min(next((j for j, (x, y) in enumerate(zip(ia, ib)) if x != y), len(ia)) + 1, len(ia))
        worst, top = max(worst, (ra[:k] - rb[:k]).abs().max().item()), max(top, ra[:k].abs().max().item())
    print(f"cuda triton vs torch attention, bf16: max |logit diff| = {worst:.3e} (max |logit| {top:.2f})")
    assert worst < 0.05 * top


@pytest.mark.parametrize("kv,bound", [("fp8", 0.15), ("int8", 0.03)])
def test_quantized_kv_drift_on_cuda(tiny_llama, kv, bound):
    """fp8 / int8 KV read directly by the Triton kernels (graphed decode) against the bf16 cache."""
    from test_attention_kernels import kv_drift

    worst, top, n = kv_drift(tiny_llama, kv, "cuda", "bfloat16")
    print(f"cuda {kv} KV vs bf16 KV (triton): max |logit diff| = {worst:.3e} (max |logit| {top:.2f}, {n} steps)")
    assert 0 < worst < bound * top


def test_paged_decode_is_graph_safe():
    """No host sync (sync debug mode raises on one), and a captured call replays correctly after new
    lengths and block tables are written into its static buffers."""
    from test_attention_kernels import paged_step

    from ferrylm.layers.triton_attention import paged_decode

    q, _, _, ctx = paged_step([700, 129, 1, 300], [1, 1, 1, 1], 32, 8, 128, dtype=torch.bfloat16, seed=1)
    kc, vc = ctx.kv_cache.layer(0)
    tables, lens = ctx.block_tables.clone(), ctx.decode_seq_lens.clone()
    paged_decode(q, kc, vc, tables, lens, 128 ** -0.5, 1024)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged_decode(q, kc, vc, tables, lens, 128 ** -0.5, 1024)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode(q, kc, vc, tables, lens, 128 ** -0.5, 1024)
    perm = torch.randperm(4, device="cuda")
    tables.copy_(ctx.block_tables[perm])
    lens.copy_(ctx.decode_seq_lens[perm] - 1)
    graph.replay()
    want = paged_decode(q, kc, vc, ctx.block_tables[perm], ctx.decode_seq_lens[perm] - 1, 128 ** -0.5, 1024)
    diff = (out - want).abs().max().item()
    print(f"graph-replayed paged decode vs eager after new tables/lengths: {diff:.3e}")
    assert diff == 0.0


def test_host_handoff_inside_a_cuda_graph():
    """A host worker computes on rows the stream copied out, between a post and a wait node of a captured
    graph; the GPU's own kernels run between them. Replays with fresh inputs give the eager results."""
    import threading

    from ferrylm.offload.host_node import HostHandoff

    hand = HostHandoff()
    dev_in = torch.zeros(4, 8, device="cuda")
    pin_in = torch.empty(4, 8).pin_memory()
    pin_out = torch.empty(4, 8).pin_memory()
    stop = [False]

    def worker():
        while True:
            hand.take()
            if stop[0]:
                return
            pin_out.copy_(pin_in * 2 + 1)
            hand.done()

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    w = torch.randn(8, 8, device="cuda")

    def body():
        s = torch.cuda.current_stream()
        pin_in.copy_(dev_in, non_blocking=True)
        hand.post(s)
        gpu = dev_in @ w  # runs beside the worker
        hand.wait(s)
        return gpu + pin_out.to("cuda", non_blocking=True)

    dev_in.copy_(torch.randn(4, 8))
    eager = body()
    torch.testing.assert_close(eager, dev_in @ w + dev_in * 2 + 1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = body()
    for i in range(20):
        x = torch.randn(4, 8)
        dev_in.copy_(x)
        g.replay()
        torch.cuda.current_stream().synchronize()
        torch.testing.assert_close(out, dev_in @ w + (x * 2 + 1).cuda())
    stop[0] = True
    hand.start.post()
    t.join(timeout=5)


@pytest.mark.parametrize("share,gpu_side,split", [(0.5, "inplace", True), (0.5, "inplace", False),
                                                   (1.0, "inplace", True), (0.5, "copy", False)])
def test_hybrid_decode_host_experts_equal_mapped(share, gpu_side, split, tmp_path_factory, monkeypatch):
    """Hybrid decode: the host computes a share of the missed experts (inside the decode graphs, through
    host nodes) while the GPU reads the rest in place, or (copy) its worker copies them into scratch slots.
    Logits match the all-in-place run within bf16 rounding (the host's bf16 GEMM sums in another order);
    eager and graphed agree."""
    from test_models_hf import build

    from ferrylm.offload.expert_cache import CachedExperts
    from ferrylm.offload.host_decode import HostDecode

    monkeypatch.setattr(HostDecode, "gpu_side", gpu_side)
    extra = {}
    if gpu_side == "copy":  # the copy side serves one-token decode (large experts): make these experts "large"
        monkeypatch.setattr(CachedExperts, "large_expert_bytes", 0)
        extra = {"max_num_seqs": 1}
    path, _ = build(tmp_path_factory, "qwen3_moe")
    g = torch.Generator().manual_seed(14)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (70, 3, 17, 9)]
    place = ("experts=cpu", "layers.0.experts.0-1=gpu")
    for eager in (True, False):
        # a fixed budget: a share of free memory would leave the later engines less. (A dropped engine used to
        # stay allocated here: pytest keeps the test's log records, and the "no tokenizer" warning's exception
        # held the engine's frames; it logs the message now: test_dropped_offloaded_engine_frees_its_memory_at_once)
        kw = dict(device="cuda", dtype="bfloat16", enforce_eager=eager, place=place, gpu_memory_budget="2GiB",
                  **extra)
        ref_out, ref = sampled_rows(LLM(path, experts="gpu", **kw), prompts, 24)
        llm = LLM(path, experts="auto", cpu_share=share, hybrid_split=split, **kw)
        placed = llm.engine.runner.placed
        assert placed.host_decode is not None and (llm.engine.runner.graphs is not None) == (not eager)
        assert placed.host_decode.copies == (gpu_side == "copy")
        out, got = sampled_rows(llm, prompts, 24)
        assert all((c.split_cols is not None) == (split and gpu_side == "inplace") for c in placed.caches.values())
        print(f"hybrid decode share={share} split={split} eager={eager}: {placed.stats}")
        assert placed.stats.cpu_experts > 0 and placed.host_decode.error is None
        if share == 1.0:  # the device waits for every host expert: measured, graphed steps too (timing events)
            assert placed.stats.cpu_wait_s > 0, placed.stats
        worst = max((a - b).abs().max().item() for a, b in zip(ref, got))
        same = sum(a == b for o, r in zip(out, ref_out) for a, b in zip(o.outputs[0].token_ids, r.outputs[0].token_ids))
        print(f"hybrid decode vs in place: max |logit diff| = {worst:.3e}, {same}/{24 * len(prompts)} tokens equal")
        assert worst < 5e-2
        assert [o.outputs[0].token_ids[:4] for o in out] == [r.outputs[0].token_ids[:4] for r in ref_out]
        del llm, placed  # the graphed pair below sizes its KV from the memory these free
        free_engines()


def test_auto_hybrid_share_counts_the_measured_handoff(tmp_path_factory):
    """--experts auto with no --cpu-share: the engine measures a hand-off through the real worker (and an expert
    call's fixed cost), and the share it runs is the cost model's for those figures; at share 0 hybrid decode
    is off (no worker), else on; either way the logits equal the in-place run's."""
    from test_models_hf import build

    from ferrylm.offload.cost_model import cpu_share

    path, _ = build(tmp_path_factory, "qwen3_moe")
    kw = dict(device="cuda", dtype="bfloat16", place=("experts=cpu",), gpu_memory_budget="2GiB")
    prompts = [[5, 9, 31, 7, 100, 3], [17, 4, 4, 250]]
    ref_out, ref = sampled_rows(LLM(path, experts="gpu", **kw), prompts, 8)
    free_engines()
    llm = LLM(path, experts="auto", **kw)
    placed = llm.engine.runner.placed
    cal = placed.calibration
    print(f"auto hybrid share: {placed.cpu_share:.3f}; hand-off {cal['handoff_s'] * 1e3:.3f} ms, call "
          f"{cal['call_s'] * 1e3:.3f} ms, whole expert {cal['host_whole_s'] * 1e3:.3f} ms, "
          f"{cal['expected_misses']:.2f} misses a layer")
    assert 0 < cal["handoff_s"] < 0.05 and cal["call_s"] >= 0
    if placed.hybrid_split and cal["host_half_s"] is not None:  # split in halves: the GEMM chosen on them
        from ferrylm.layers import cpu_experts
        halves = cal["host_half_s_by_gemm"]
        assert cpu_experts.dense_gemm == cal["dense_gemm_split"] == min(halves, key=halves.get)
    c = placed.costs
    want = cpu_share(c, c.inplace_gbs or 0.85 * c.expert_bytes / c.copy_s / 1e9, misses=cal["expected_misses"],
                     split=placed.hybrid_split)
    assert placed.cpu_share == pytest.approx(want)
    assert (placed.host_decode is not None) == (want > 0)
    out, got = sampled_rows(llm, prompts, 8)
    worst = max((a - b).abs().max().item() for a, b in zip(ref, got))
    print(f"auto vs in place: max |logit diff| = {worst:.3e}")
    assert worst < 5e-2
    del llm, placed
    free_engines()


def test_hybrid_rebalance_turns_the_host_off_mid_run(tmp_path_factory):
    """The re-balance (`PlacedWeights.arm_rebalance`) on a graphed hybrid decode: with the host's fixed costs
    made huge, the misses its window sees give share 0, which the runner applies between steps (graphs
    re-captured): the banks then skip the hand-off, and a fresh prompt's logits are those of the all-in-place
    run (a fresh prompt: 88 bf16 steps of one sequence drift apart on their own, 0.49 seen on the H200)."""
    import dataclasses

    from test_models_hf import build

    from ferrylm import SamplingParams
    from ferrylm.offload.placed_weights import REBALANCE_WINDOW

    path, _ = build(tmp_path_factory, "qwen3_moe")
    kw = dict(device="cuda", dtype="bfloat16", place=("experts=cpu",), gpu_memory_budget="2GiB")
    prompts = [[5, 9, 31, 7, 100, 3], [17, 4, 4, 250]]
    ref_out, ref = sampled_rows(LLM(path, experts="gpu", **kw), prompts, 16)
    free_engines()
    llm = LLM(path, experts="auto", cpu_share=0.5, **kw)
    placed = llm.engine.runner.placed
    assert placed.host_decode is not None and all(c.host_decode is not None for c in placed.caches.values())
    placed.costs = dataclasses.replace(placed.costs, handoff_s=1.0)  # no share can pay for this
    placed.arm_rebalance()
    llm.generate([[11, 12, 13]], SamplingParams(temperature=0, max_tokens=REBALANCE_WINDOW[1] + 16, ignore_eos=True))
    cal = placed.calibration
    print(f"re-balance: {cal.get('measured_misses')} misses a layer, share {placed.cpu_share}")
    assert "measured_misses" in cal and placed.cpu_share == 0.0 and placed.pending_share is None
    assert all(c.host_decode is None for c in placed.caches.values())
    out, got = sampled_rows(llm, prompts, 16)
    worst, diverged = worst_while_equal(ref_out, ref, out, got)
    print(f"re-balanced vs in place: max |logit diff| = {worst:.3e} while the tokens agree ({diverged} diverged)")
    assert worst < 5e-2
    del llm, placed
    free_engines()


def test_hybrid_share_tuner_settles_on_a_graphed_engine(tmp_path_factory):
    """The share tuner (`offload/share_tuner.py`) on a graphed hybrid decode (bf16: the fused kernel reads
    misses in place): it times one sequence's decode steps, the runner applies each share it asks for between
    steps (graphs re-captured), it settles, records its figures and serves its choice. Fresh prompts' logits
    then match the all-on-GPU run within bf16 rounding on nearly every row: the host's and the device's bf16
    rounding differ, and one of this 4-expert model's near-tied routers can pick another expert for a step
    (`benchmarks/diag_hybrid_routing_flip.py`: one step at 0.5, the others ~1e-2; in fp32 the hybrid run after
    the same long decode equals the all-on-GPU run exactly, but fp32 has no fused kernel and so no hybrid
    decode to tune)."""
    from ferrylm.offload import share_tuner
    from test_models_hf import build

    path, _ = build(tmp_path_factory, "qwen3_moe")
    kw = dict(device="cuda", dtype="bfloat16", place=("experts=cpu",), gpu_memory_budget="2GiB")
    prompts = [[5, 9, 31, 7, 100, 3], [17, 4, 4, 250]]
    ref_out, ref = sampled_rows(LLM(path, experts="gpu", **kw), prompts, 16)
    free_engines()
    llm = LLM(path, experts="auto", cpu_share=0.5, **kw)
    placed = llm.engine.runner.placed
    assert llm.engine.runner.graphs is not None and placed.host_decode is not None  # graphed hybrid decode
    assert llm.engine.async_scheduling  # shares applied between steps with one in flight
    placed.tuner = share_tuner.ShareTuner(0.5, settle=1, samples=3)  # as the re-balance arms it
    llm.generate([[11, 12, 13]], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    cal = placed.calibration
    print(f"tuned share {cal.get('tuned_share')}: {cal.get('tuned_step_ms')}")
    assert placed.tuner is None and "tuned_share" in cal and len(cal["tuned_step_ms"]) >= 3
    assert placed.pending_share is None or placed.pending_share == cal["tuned_share"]
    out, got = sampled_rows(llm, prompts, 16)
    assert placed.cpu_share == cal["tuned_share"] and placed.stats.cpu_experts > 0
    rows = []  # per row computed from the same context by both runs: its max |logit diff|
    for r_o, r, o, g in zip(ref_out, ref, out, got):
        a, b = r_o.outputs[0].token_ids, o.outputs[0].token_ids
        n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a) - 1)
        rows += (r[:n + 1] - g[:n + 1]).abs().amax(dim=-1).tolist()
    near = sum(d < 5e-2 for d in rows) / len(rows)
    print(f"tuned vs all on GPU: {len(rows)} rows, worst {max(rows):.3e}, {near:.0%} within 5e-2")
    assert near >= 0.9 and max(rows) < 1.0
    del llm, placed
    free_engines()


@pytest.mark.parametrize("gemm", ["split", "split-x4", "native"])
def test_hybrid_decode_with_each_dense_gemm(gemm, tmp_path_factory, monkeypatch):
    """Graphed hybrid decode with the host's dense bf16 GEMM forced to `gemm` (the calibration's only choice;
    tiny chunks so the split pool runs from the decode worker): the calibration records it, the host
    computes every miss without error, and the logits match the all-on-GPU run within bf16 rounding."""
    from ferrylm.layers import cpu_experts, host_native

    if gemm == "native" and not host_native.available():
        pytest.skip(f"native host kernels: {host_native.why_unavailable()}")
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path_factory.mktemp("calibration")))
    monkeypatch.setattr(cpu_experts, "DENSE_GEMMS", (gemm,))
    monkeypatch.setattr(cpu_experts, "SPLIT_MIN_BYTES", 4096)
    path = _wide_mixtral(tmp_path_factory)  # gate_up [1024, 64]: 16 chunks of 64 rows
    g = torch.Generator().manual_seed(17)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 9)]
    kw = dict(device="cuda", dtype="bfloat16", place=("experts=cpu", "layers.0.experts.0-1=gpu"),
              gpu_memory_budget="2GiB")
    ref_out, ref = sampled_rows(LLM(path, experts="gpu", **kw), prompts, 16)
    llm = LLM(path, experts="auto", cpu_share=1.0, **kw)
    placed = llm.engine.runner.placed
    assert placed.calibration["dense_gemm"] == gemm == cpu_experts.dense_gemm
    out, got = sampled_rows(llm, prompts, 16)
    assert placed.stats.cpu_experts > 0 and placed.host_decode.error is None
    if gemm != "plain":
        assert cpu_experts._POOLS  # the split pool ran
    worst, diverged = worst_while_equal(ref_out, ref, out, got)
    print(f"hybrid decode, dense GEMM {gemm}: max |logit diff| vs GPU = {worst:.3e} (same contexts; "
          f"{diverged} sequences flipped a token); {placed.stats}")
    assert worst < 5e-2  # (a token flips only where the two runs' logits are this close: a near-tie)


def test_hybrid_decode_graphs_hand_the_host_live_rows_only(tmp_path_factory, monkeypatch):
    """A graphed decode step of 3 sequences runs in the bucket of 4: every hand-off carries the bucket's
    rows and the live count (the host kernels then get the live rows only: tests/test_hybrid.py), and the
    tokens equal the eager run's (no padding there)."""
    from test_models_hf import build

    from ferrylm.offload.host_decode import HostDecode

    seen = []
    serve = HostDecode._serve
    # meta: layer, tokens, live tokens, first host column
    monkeypatch.setattr(HostDecode, "_serve", lambda self: seen.append(self.meta.tolist()[1:3]) or serve(self))
    path, _ = build(tmp_path_factory, "qwen3_moe")
    g = torch.Generator().manual_seed(16)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 13)]
    kw = dict(device="cuda", dtype="bfloat16", place=("experts=cpu", "layers.0.experts.0-1=gpu"), experts="auto",
              cpu_share=1.0, max_num_seqs=4)
    eager, _ = sampled_rows(LLM(path, enforce_eager=True, **kw), prompts, 8)
    llm = LLM(path, **kw)
    seen.clear()  # from here: the workload's hand-offs
    graphed, _ = sampled_rows(llm, prompts, 8)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.placed.host_decode.error is None
    padded = [(T, n) for T, n in seen if T == 4]
    print(f"hand-offs (rows, live): {sorted(set(map(tuple, seen)))}")
    assert padded and all(n == 3 for _, n in padded)
    assert [t[:4] for t in token_ids(graphed)] == [t[:4] for t in token_ids(eager)]  # bf16: ties may flip later


def test_packed_store_host_experts_copy_path_and_decode(tmp_path_factory):
    """An int4 store's packed experts computed by the host in their own format (`offload/host_experts.py`):
    through the copy path's rounds (mapped off, every miss on the host) and through hybrid decode (mapped,
    half the experts on the host), close to the resident packed run (bf16 activations on the host, 4-bit
    weights decoded the same way); calibration timed the packed format and measured the in-place rate."""
    from test_models_hf import build

    from ferrylm.weights.convert import ConvertOptions, convert

    path, _ = build(tmp_path_factory, "qwen3_moe")
    store = str(tmp_path_factory.mktemp("packed-host") / "s")
    convert(path, store, ConvertOptions(quant="int4", group_size=32))
    g = torch.Generator().manual_seed(15)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 3, 17)]
    kw = dict(device="cuda", dtype="bfloat16", enforce_eager=True, place=("experts=cpu", "layers.0.experts.0=gpu"))
    res_out, res = sampled_rows(LLM(store, **{**kw, "place": ()}), prompts, 12)
    for opts in (dict(experts="cpu", mapped_experts=False), dict(experts="auto", cpu_share=0.5)):
        llm = LLM(store, **kw, **opts)
        placed = llm.engine.runner.placed
        assert all(c.packed for c in placed.caches.values())
        assert placed.calibration["format"].startswith("int4")
        if opts.get("mapped_experts", True):
            assert placed.calibration.get("inplace_gbs", 0) > 0 and placed.host_decode is not None
        out, got = sampled_rows(llm, prompts, 12)
        # H200 (session 8): bf16 flipped a late near-tie (2.48 after it; 1.6e-2 on the first two steps)
        worst, diverged = worst_while_equal(res_out, res, out, got)
        print(f"packed int4 host experts {opts}: max |logit diff| vs resident = {worst:.3e} over the same contexts "
              f"({diverged} sequences diverged); {placed.stats}; calibration {placed.calibration}")
        assert placed.stats.cpu_experts > 0 and worst < 0.1
        assert [o.outputs[0].token_ids[:3] for o in out] == [r.outputs[0].token_ids[:3] for r in res_out]


@pytest.mark.parametrize("quant", [None, "nf4"])
def test_host_experts_with_no_device_slots(quant, tmp_path_factory):
    """`--place experts=cpu --experts cpu` keeps no expert slot on the device (`placement.min_expert_slots`): the
    caches have capacity 0, every miss runs on the host, through the copy path's rounds (mapped off) and through
    hybrid decode at share 1 (mapped, graphed); close to the resident run, nothing copied in."""
    from test_models_hf import build

    from ferrylm.weights.convert import ConvertOptions, convert

    path, _ = build(tmp_path_factory, "mixtral")
    if quant:
        store = str(tmp_path_factory.mktemp(f"no-slots-{quant}") / "s")
        convert(path, store, ConvertOptions(quant=quant, group_size=64))
        path = store
    g = torch.Generator().manual_seed(19)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 3, 17)]
    kw = dict(device="cuda", dtype="bfloat16", gpu_memory_budget="2GiB")
    res_out, res = sampled_rows(LLM(path, **kw), prompts, 12)
    free_engines()
    for mapped in (False, True):
        llm = LLM(path, place=("experts=cpu",), experts="cpu", mapped_experts=mapped, **kw)
        runner = llm.engine.runner
        placed = runner.placed
        assert placed.caches and all(c.capacity == 0 for c in placed.caches.values())
        out, got = sampled_rows(llm, prompts, 12)
        worst, diverged = worst_while_equal(res_out, res, out, got)
        print(f"no slots, quant {quant}, mapped {mapped}: max |logit diff| vs resident = {worst:.3e} "
              f"({diverged} diverged); {placed.stats}")
        assert placed.stats.cpu_experts > 0 and placed.stats.copied_experts == 0
        assert placed.stats.mapped_experts == 0
        assert worst < 0.1
        assert [o.outputs[0].token_ids[:3] for o in out] == [r.outputs[0].token_ids[:3] for r in res_out]
        free_engines()


def test_auto_without_room_for_slots_runs_misses_on_the_host(tmp_path_factory):
    """`--experts auto` under a budget with no room even for one expert slot the layers share (found from `--experts
    gpu`'s refusal, which names both figures) places none (`memory.size_memory`): its layers run copy-road misses on
    the host (`cpu_mode` cpu) and hybrid decode reads the rest in place; close to the resident run, nothing copied
    in."""
    import re

    from ferrylm.errors import ConfigError

    path = _wide_mixtral(tmp_path_factory, inter=4096)  # 1.5 MiB bf16 experts: 2 slots x 2 layers = 6 MiB
    g = torch.Generator().manual_seed(23)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 3, 17)]
    kw = dict(device="cuda", dtype="bfloat16", place=("experts=cpu",), num_kv_blocks=64)  # KV fixed at any budget
    res_out, res = sampled_rows(LLM(path, device="cuda", dtype="bfloat16"), prompts, 12)
    free_engines()
    with pytest.raises(ConfigError) as e:
        LLM(path, experts="gpu", gpu_memory_budget="1MiB", **kw)

    def mib(pattern):
        n, unit = re.search(pattern, str(e.value)).groups()
        return float(n) * (1024 if unit == "GiB" else 1)

    need, slots = mib(r"needs at least ([\d.]+) (MiB|GiB)"), mib(r"share, ([\d.]+) (MiB|GiB) of it")
    print(f"--experts gpu needs {need} MiB, its slots {slots} MiB: {e.value}")
    budget = f"{need - slots / 2:.1f}MiB"
    with pytest.raises(ConfigError, match="too small"):
        LLM(path, experts="gpu", gpu_memory_budget=budget, **kw)
    llm = LLM(path, experts="auto", gpu_memory_budget=budget, **kw)
    placed = llm.engine.runner.placed
    assert placed.caches and all(c.capacity == 0 and c.cpu_mode == "cpu" for c in placed.caches.values())
    out, got = sampled_rows(llm, prompts, 12)
    # (session 38, H100: one sequence flipped at a step whose logits moved 0.59: a router near-tie, left out)
    worst, diverged = worst_while_equal(res_out, res, out, got, flip_row=False)
    print(f"auto without slots under {budget}: max |logit diff| vs resident = {worst:.3e} ({diverged} diverged); "
          f"{placed.stats}")
    assert placed.stats.cpu_experts > 0 and placed.stats.copied_experts == 0
    assert worst < 0.1
    assert [o.outputs[0].token_ids[:3] for o in out] == [r.outputs[0].token_ids[:3] for r in res_out]


@pytest.mark.parametrize("experts,slots", [("gpu", 2), ("auto", 2), ("gpu", 1)])
def test_bare_layers_copy_through_a_shared_pool(experts, slots, tmp_path_factory, monkeypatch):
    """A budget with room for 1 or 2 expert slots but not 2 a layer (from `--experts gpu`'s refusal one slot lower):
    the layers keep no expert of their own and copy their misses through one pool of slots they share
    (`expert_cache.SlotPool`): the copy road (mapped off; mapped, prompts over `mapped_tokens`) copies into the pool,
    one layer after another (every expert counted large: one a round, each slot freed for the next copy, across
    layers through the pool's shared events); graphed decode reads misses in place, its tables never pointing at the
    pool; close to the resident run."""
    import re

    from ferrylm.errors import ConfigError
    from ferrylm.offload.expert_cache import CachedExperts

    path = _wide_mixtral(tmp_path_factory, inter=4096)  # 1.5 MiB bf16 experts
    g = torch.Generator().manual_seed(29)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (100, 3, 70)]
    kw = dict(device="cuda", dtype="bfloat16", place=("experts=cpu",), num_kv_blocks=64)
    res_out, res = sampled_rows(LLM(path, device="cuda", dtype="bfloat16"), prompts, 12)
    free_engines()
    with pytest.raises(ConfigError) as e:
        LLM(path, experts="gpu", gpu_memory_budget="1MiB", **kw)
    need = float(re.search(r"needs at least ([\d.]+) MiB", str(e.value))[1])
    slot = float(re.search(r"share, ([\d.]+) MiB of it", str(e.value))[1])
    budget = f"{need + (slots - 1) * slot + 0.2:.1f}MiB"  # 1 or 2 shared slots, not 2 a layer (2 layers: 4)
    for mapped in (False, True):
        # copies only: every expert counted large (computed one a round, across layers through the pool's events);
        # mapped: as they are (a large expert reads in place at one token only: `CachedExperts.map`)
        monkeypatch.setattr(CachedExperts, "large_expert_bytes", 64 << 20 if mapped else 0)
        llm = LLM(path, experts=experts, gpu_memory_budget=budget, mapped_experts=mapped, **kw)
        runner = llm.engine.runner
        placed = runner.placed
        assert runner.placement.shared_slots == slots and placed.pool is not None
        assert placed.caches and all(c.pool is placed.pool and c.cpu_mode == experts
                                     for c in placed.caches.values())
        out, got = sampled_rows(llm, prompts, 12)
        worst, diverged = worst_while_equal(res_out, res, out, got)
        print(f"shared pool, experts {experts}, mapped {mapped}, budget {budget}: max |logit diff| vs resident = "
              f"{worst:.3e} ({diverged} diverged); {placed.stats}")
        assert placed.stats.copied_experts > 0
        if mapped:
            assert placed.stats.mapped_experts > 0 or placed.stats.cpu_experts > 0  # decode read them in place
            assert runner.graphs is not None
            for c in placed.caches.values():  # every expert read from its host rows at decode
                assert torch.equal(c.ptr_rows, c.host_cols) and not bool(c.in_slot.any())
        assert worst < 0.1
        assert [o.outputs[0].token_ids[:3] for o in out] == [r.outputs[0].token_ids[:3] for r in res_out]
        free_engines()


def _wide_mixtral(tmp_path_factory, inter: int = 512) -> str:
    """A tiny Mixtral (test_models_hf's shapes) with a wide expert intermediate, so hybrid decode's column
    split has columns to split (c a multiple of 128)."""
    import transformers

    from test_models_hf import COMMON

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**{**COMMON, "intermediate_size": inter, "num_local_experts": 8,
                                        "num_experts_per_tok": 2})
    from helpers import save_random

    return save_random(transformers.MixtralForCausalLM(cfg).eval(), tmp_path_factory.mktemp("mixtral-wide"), 0.05)


@pytest.mark.parametrize("quant,group", [("nf4", 64), ("int4", 32)])
def test_packed_hybrid_decode_split_equals_mapped(quant, group, tmp_path_factory):
    """Hybrid decode on a packed store (NF4 g64, int4 g32 experts kept packed), graphed: every miss split
    along its intermediate (the kernel reads the packed columns [0, c) in place, the host computes [c, I)
    from the packed bank's windows; c = 256 of 512 at share 0.5) against the mapped-only run (experts=gpu,
    the same packed bits read in place): logits within bf16 rounding of the host's GEMMs, the first tokens
    equal, the host ran, the split was real."""
    from ferrylm.weights.convert import ConvertOptions, convert

    path = _wide_mixtral(tmp_path_factory)
    store = str(tmp_path_factory.mktemp(f"packed-split-{quant}") / "s")
    convert(path, store, ConvertOptions(quant=quant, group_size=group))
    g = torch.Generator().manual_seed(17)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 3, 17, 9)]
    kw = dict(device="cuda", dtype="bfloat16", place=("experts=cpu", "layers.0.experts.0-1=gpu"),
              gpu_memory_budget="2GiB")
    ref_out, ref = sampled_rows(LLM(store, experts="gpu", **kw), prompts, 16)
    free_engines()
    llm = LLM(store, experts="auto", cpu_share=0.5, hybrid_split=True, **kw)
    placed = llm.engine.runner.placed
    assert llm.engine.runner.graphs is not None and placed.host_decode is not None
    assert all(c.packed and c.mapped and c.split_cols == 256 for c in placed.caches.values())
    out, got = sampled_rows(llm, prompts, 16)
    worst, diverged = worst_while_equal(ref_out, ref, out, got)  # H200: nf4 flipped a late token (1.34 after it)
    same = sum(a == b for o, r in zip(out, ref_out) for a, b in zip(o.outputs[0].token_ids, r.outputs[0].token_ids))
    print(f"packed {quant} hybrid decode, split {256}/512 vs mapped only: max |logit diff| {worst:.3e} over the "
          f"same contexts, {same}/{16 * len(prompts)} tokens equal ({diverged} sequences diverged); {placed.stats}")
    assert placed.stats.cpu_experts > 0 and placed.host_decode.error is None
    assert worst < 0.1
    assert [o.outputs[0].token_ids[:4] for o in out] == [r.outputs[0].token_ids[:4] for r in ref_out]


def test_async_scheduling_equals_sync_on_cuda(tiny_llama):
    """Async scheduling (step N+1 queued before step N's ids reach the host; its input ids read on the
    device) against synchronous steps, eager and graphed: identical tokens, logits equal (the batches are
    the same: a max_tokens stop schedules no extra step). Seeded sampling with stop ids (found one step
    late) gives the same tokens too. The graph inputs staged in one copy (`ModelRunner._graph_step`) equal
    `DecodeGraphs.run` (the plain reference), and downloads land in pinned memory."""
    from ferrylm.engine.staging import download, upload

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 40, 17, 70, 9, 120)]
    steps = [60, 10, 30, 50, 5, 20]
    for eager in (True, False):
        kw = dict(device="cuda", dtype="float32", max_num_seqs=8, enforce_eager=eager, num_kv_blocks=512)
        off, on = LLM(tiny_llama, async_scheduling="off", **kw), LLM(tiny_llama, async_scheduling="on", **kw)
        assert on.engine.async_scheduling and not off.engine.async_scheduling
        assert (on.engine.runner.graphs is None) == eager
        a_out, a = sampled_rows(off, prompts, steps)
        b_out, b = sampled_rows(on, prompts, steps)
        assert [r.shape for r in a] == [r.shape for r in b]
        worst = max((x - y).abs().max().item() for x, y in zip(a, b))
        print(f"async vs sync ({'eager' if eager else 'graphs'}): max |logit diff| = {worst:.3e}")
        assert worst < 1e-5
        assert token_ids(a_out) == token_ids(b_out)
        stops = [o.outputs[0].token_ids[len(o.outputs[0].token_ids) // 2] for o in a_out]
        params = [SamplingParams(temperature=0.9, top_k=40, seed=i, max_tokens=m, stop_token_ids=[t])
                  for i, (m, t) in enumerate(zip(steps, stops))]
        want, got = off.generate(prompts, params), on.generate(prompts, params)
        assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got] == \
            [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in want]
        e = on.engine
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks

    # the staged graph inputs against the reference path, on one real decode step
    llm = LLM(tiny_llama, device="cuda", dtype="float32", max_num_seqs=8, async_scheduling="off",
              num_kv_blocks=512)
    e = llm.engine
    for p in prompts:
        e.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        e.step()
    out = e.scheduler.schedule()
    assert e.runner.graphs.eligible(out)
    ref = e.runner.graphs.run(out).clone()
    got = e.runner._graph_step(out, None, 0.0).clone()
    print(f"staged graph inputs vs DecodeGraphs.run: max |logit diff| = {(ref - got).abs().max().item():.3e}")
    assert torch.equal(ref, got)

    dev = torch.device("cuda")
    a, b = upload([[1, 2, 3], [], [7]], dev)[0::2]
    assert a.device.type == "cuda" and a.tolist() == [1, 2, 3] and b.tolist() == [7]
    host = download([torch.arange(5, device=dev)]).wait()[0]
    assert host.is_pinned() and host.tolist() == list(range(5))


def test_async_step_launch_never_waits_for_the_device(tiny_llama):
    """Launching a decode step with async scheduling (schedule, inputs staged in one copy, graph replay,
    sampling, the download of the ids) makes no synchronising CUDA call (sync debug mode raises on one);
    only reading the ids back waits, on their event. The tokens equal a synchronous run's."""
    import time

    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=30, ignore_eos=True)] * 2
    prompts = [[1 + i, 2, 3, 4 + i] for i in range(4)]
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, num_kv_blocks=512)  # several engines at once
    want = LLM(tiny_llama, async_scheduling="off", **kw).generate(prompts, params)
    e = LLM(tiny_llama, async_scheduling="on", **kw).engine
    ids = [e.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = {}
    for _ in range(6):  # prefill, the decode graph captured, the sampler's plan built
        final.update({o.request_id: o for o in e.step() if o.finished})
    assert e._inflight is not None and e.runner.graphs.graphs
    for _ in range(3):
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = e._launch(e.scheduler.schedule(), time.perf_counter())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        prev, e._inflight = e._inflight, launched
        final.update({o.request_id: o for o in e._resolve(prev, time.perf_counter()) if o.finished})
    while e.has_unfinished_requests():
        final.update({o.request_id: o for o in e.step() if o.finished})
    e.step()
    assert [final[i].outputs[0].token_ids for i in ids] == token_ids(want)


def _graph_vs_eager(path, tag, dtype, tol, overrides=None, vocab=250):
    """Graphed decode against the eager engine on the same prompts (6 requests through 4 slots: sequences
    finish and join between decode steps, state slots reused): greedy tokens equal, logits max diff
    printed; the graph engine captured batch buckets 1..4 and more than one context bucket."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (5, 1, 13, 3, 30, 6)]
    steps = [40, 6, 24, 3, 15, 9]
    kw = dict(device="cuda", dtype=dtype, max_num_seqs=4, block_size=4, model_overrides=overrides or {})
    a_out, a = sampled_rows(LLM(path, enforce_eager=True, **kw), prompts, steps)
    graphed = LLM(path, **kw)
    assert graphed.engine.runner.graphs is not None, f"{tag}: not graphed"
    b_out, b = sampled_rows(graphed, prompts, steps)
    keys = sorted(graphed.engine.runner.graphs.graphs)
    worst = max((x - y).abs().max().item() for x, y in zip(a, b))
    scale = max(x.abs().max().item() for x in a)
    print(f"cuda {tag} graph vs eager ({dtype}): max |logit diff| = {worst:.3e} (logit scale {scale:.1f}), "
          f"graphs {keys}")
    assert {k[0] for k in keys} >= {1, 4} and len({k[1] for k in keys}) >= 2
    assert token_ids(a_out) == token_ids(b_out)
    assert worst <= tol * max(1.0, scale)
    return graphed


@pytest.fixture
def graphs_on():
    """Every family these tests graph ships with decode graphs on (DeepSeek's since session 9): say so."""
    from ferrylm.models.deepseek import DeepseekForCausalLM
    from ferrylm.models.yuan import YuanForCausalLM

    assert DeepseekForCausalLM.cuda_graphs and YuanForCausalLM.cuda_graphs


def test_yuan_dense_graph_decode_equals_eager(graphs_on):
    """Yuan2 dense (tiny, fp32): the filter state rows reach the graph as a device buffer, padded rows on
    the pool's scratch row. Then a graphed step launches without a synchronising CUDA call."""
    path = os.path.join(DATA, "yuan2-tiny")
    _graph_vs_eager(path, "yuan2 dense", "float32", 1e-4, vocab=380)
    e = LLM(path, device="cuda", dtype="float32", max_num_seqs=4, block_size=4, async_scheduling="off").engine
    for i in range(3):
        e.add_request([5 + i, 9, 11], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(5):  # the prefill, then decode steps on the captured (4, 4) graph
        e.step()
    out = e.scheduler.schedule()
    assert e.runner.graphs.eligible(out)
    torch.cuda.set_sync_debug_mode("error")
    try:
        e.runner.execute(out)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_yuan_m32_graph_decode_equals_eager(graphs_on):
    """Yuan2.0-M32 (tiny, bf16: the fused expert kernel, which graphs need; the attention router on the
    device)."""
    _graph_vs_eager(os.path.join(DATA, "yuan2-m32-tiny"), "yuan2 m32", "bfloat16", 2e-2, vocab=380)


@pytest.mark.parametrize("v_head_dim", [16, 12])
def test_deepseek_graph_decode_equals_eager(v_head_dim, tmp_path_factory, graphs_on):
    """DeepSeek-V3 (tiny, bf16: MLA with the latent cache row, sigmoid group routing, fused experts). On the
    H200 (sessions 7-8) the eager engine's warm-up failed at both v_head_dims: the Triton prefill kernel, at
    64-key tiles over the tiny 40-wide latent rows, read out of bounds (4-token pages; wrong rows at 16), and the
    next cuBLAS call reported it (`triton_attention._narrow_latent` now takes 32-key tiles there)."""
    from test_models import DEEPSEEK, build

    cfg_name, cls_name, extra = DEEPSEEK["deepseek_v3"]
    path, _ = build(tmp_path_factory, f"cuda-deepseek-graph-v{v_head_dim}", cfg_name, cls_name,
                    {**extra, "v_head_dim": v_head_dim})
    _graph_vs_eager(path, "deepseek_v3", "bfloat16", 2e-2)


def test_grouped_gemm_prefill_rows_equal_the_triton_kernel():
    """`fused_moe.grouped_rows` (torch's grouped GEMM, CUTLASS on sm_90) against the Triton kernel it would replace
    in prefill (`expert_rows(..., decode=False)`), at prefill sizes of a Mixtral-like and a Qwen3-like bank, eager
    and replayed from a CUDA graph (it syncs with nothing)."""
    from ferrylm.layers import fused_moe

    g = torch.Generator(device="cuda").manual_seed(5)
    for E, k, H, I, T in ((8, 2, 1024, 2048, 512), (128, 8, 512, 256, 300)):
        w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.03).bfloat16()
        w2 = (torch.randn(E, H, I, device="cuda", generator=g) * 0.03).bfloat16()
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        w, ids = torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1).topk(k, -1)
        if not fused_moe.grouped_mm_usable(x, w13, w2):
            pytest.skip("torch's grouped GEMM is not available on this GPU")
        ref = fused_moe.expert_rows(x, w13, w2, ids, w, decode=False).float()
        got = fused_moe.grouped_rows(x, w13, w2, ids, w)
        err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        graph, static = torch.cuda.CUDAGraph(), None
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fused_moe.grouped_rows(x, w13, w2, ids, w)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            static = fused_moe.grouped_rows(x, w13, w2, ids, w)
        graph.replay()
        torch.cuda.synchronize()
        print(f"grouped GEMM vs Triton kernel, E={E} k={k} H={H} I={I} T={T}: max error {err:.2e} of the largest row")
        assert err < 2e-2 and torch.equal(static, got)


@pytest.mark.parametrize("fmt", ["nf4", "int4"])
def test_packed_prefill_decoded_once_equals_the_triton_kernel(fmt):
    """`fused_moe.dequant_rows` (each packed expert decoded once, dense GEMMs) against the Triton kernel's in-tile
    decode (`expert_rows(..., decode=False)`) on the same packed bank at a prefill size, skipped ids included."""
    from ferrylm.layers import fused_moe
    from ferrylm.weights import quant

    make = {"nf4": lambda t: quant.quantize_nf4(t, 64), "int4": lambda t: quant.quantize_int4(t, 32, "min")}[fmt]
    g = torch.Generator(device="cuda").manual_seed(6)
    E, k, H, I, T = 8, 2, 1024, 1024, 400
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.03
    w2 = torch.randn(E, H, I, device="cuda", generator=g) * 0.03
    p13 = fused_moe.ExpertWeights.stack([[make(w13[e, :I]), make(w13[e, I:])] for e in range(E)], torch.bfloat16)
    p2 = fused_moe.ExpertWeights.stack([[make(w2[e])] for e in range(E)], torch.bfloat16)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w, ids = torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1).topk(k, -1)
    ids[::5, 1] = E
    ref = fused_moe.expert_rows(x, p13, p2, ids, w, skip=True, decode=False).float()
    got = fused_moe.dequant_rows(x, p13, p2, ids, w, skip=True)
    err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
    print(f"{fmt} bank decoded once per expert vs the Triton kernel's in-tile decode, T={T}: max error {err:.2e}")
    assert err < 2e-2


def test_packed_prefill_rounds_queue_without_a_stream_sync():
    """A packed bank's prefill path as the offload cache's rounds call it (`dequant_rows` with the counts given,
    skipped ids included) queues its work without a synchronizing call: torch's sync debug mode raises on a blocking
    copy, `.item()` or `.tolist()` (session 27's trace: 128 blocking copies of grouped-GEMM offsets held the host
    54 ms of a 120 ms NF4 prefill, the copies and kernels never overlapping). It does not see a non-blocking copy
    from pageable memory; `layers/transfer.to_device` keeps those off this path too."""
    from ferrylm.layers import fused_moe

    torch.manual_seed(7)
    g = torch.Generator(device="cuda").manual_seed(7)
    E, k, H, I, T = 4, 2, 512, 512, 300
    p13, p2 = _mixtral_bank("nf4", E, H, I)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w, ids = torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1).topk(k, -1)
    ids[::3, 1] = E
    counts = torch.bincount(ids.flatten(), minlength=E + 1).tolist()
    ref = fused_moe.dequant_rows(x, p13, p2, ids, w, skip=True, counts=counts)  # warm: kernels built, LUTs made
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = fused_moe.dequant_rows(x, p13, p2, ids, w, skip=True, counts=counts)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got, ref)


def _mixtral_bank(scheme: str, E: int, H: int, I: int):
    """A random bank of Mixtral-shaped experts, quantized on the device: (w13, w2) dense bf16 or `ExpertWeights`."""
    from ferrylm.layers.fused_moe import ExpertWeights
    from ferrylm.weights import quant

    w13 = torch.randn(E, 2 * I, H, device="cuda") * 0.02
    w2 = torch.randn(E, H, I, device="cuda") * 0.02
    if scheme == "bf16":
        return w13.bfloat16(), w2.bfloat16()
    q = {"int8": quant.quantize_int8, "fp8": quant.quantize_fp8, "nf4": lambda t: quant.quantize_nf4(t, 64),
         "int4": lambda t: quant.quantize_int4(t, 32, "sym")}[scheme]
    b13 = ExpertWeights.stack([[q(w13[e, :I]), q(w13[e, I:])] for e in range(E)], torch.bfloat16)
    return b13, ExpertWeights.stack([[q(w2[e])] for e in range(E)], torch.bfloat16)


def _host_table(tier, bank):
    """`bank` copied into mapped host memory, addressed through a `WeightTable`."""
    from ferrylm.layers.fused_moe import WeightTable

    parts = {"q": bank} if isinstance(bank, torch.Tensor) else bank.parts
    host = {}
    for name, t in parts.items():
        host[name] = tier.empty(t.shape, t.dtype)
        for e in range(t.shape[0]):  # a copy must not span two registered pieces
            host[name][e].copy_(t[e])
    assert all(tier.is_mapped(h) for h in host.values())
    return WeightTable({k: torch.tensor(WeightTable.addresses(v), device="cuda") for k, v in host.items()}, bank)


@pytest.mark.parametrize("scheme", ["fp8", "nf4"])
def test_slot_bank_round_equals_resident_at_qwen3_shapes(scheme):
    """An offload cache's copy-path round (`CachedExperts._forward_fused`: a bank of C slots, ids of experts not in
    this round set to C and skipped) takes the same decode tiles and sums in the same order as the resident bank of
    E experts, at Qwen3-30B-A3B's expert shapes and 2-32 tokens (the by-format tiles of fp8 and NF4): each row equal
    bit for bit. (Session 26: tiles whose K split followed the bank's padded row blocks could differ.)"""
    from ferrylm.layers import fused_moe_decode as fmd
    from ferrylm.layers.fused_moe import ExpertWeights, expert_rows

    if scheme == "fp8" and not fmd.native_fp8():
        pytest.skip("fp8 takes the decode kernel only where the GPU converts e4m3")
    torch.manual_seed(6)
    E, H, I, k, C = 128, 2048, 768, 8, 16
    b13, b2 = _mixtral_bank(scheme, E, H, I)
    for T in (2, 4, 8, 32):
        x = torch.randn(T, H, device="cuda").bfloat16()
        ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
        w = torch.rand(T, k, device="cuda")
        held = ids.flatten().unique()[:C]  # this round's experts in slots 0..n-1 (at 2 tokens all of them)
        n = held.numel()
        s13, s2 = (ExpertWeights(b.fmt, (n, *b.shape[1:]), b.group, *(b.parts[p][held] for p in ("q", "scale")))
                   for b in (b13, b2))
        slot = torch.full((E,), n, dtype=torch.long, device="cuda")
        slot[held] = torch.arange(n, device="cuda")
        assert fmd.decode_config(T, s13, s2) == fmd.decode_config(T, b13, b2) is not None
        got = expert_rows(x, s13, s2, slot[ids], w, skip=True, experts=E)
        want = expert_rows(x, b13, b2, ids, w)
        on = (slot[ids] < n).flatten()
        assert torch.equal(got[on], want[on]) and not got[~on].any(), (scheme, T)


@pytest.mark.parametrize("scheme", ["int8", "nf4", "int4", "fp8", "bf16"])
def test_decode_kernel_at_mixtral_shapes(scheme, monkeypatch):
    """The decode kernel (layers/fused_moe_decode.py) at Mixtral-8x7B expert shapes, 4 experts: close to the
    fp64 dequantize-then-matmul reference and to the plain kernel for 1, 2, 8 and 16 tokens; read in place from
    mapped host memory equal to resident bit for bit; replayed in a CUDA graph equal to eager; every swept
    configuration close to the reference."""
    from ferrylm.layers import fused_moe_decode as fmd
    from ferrylm.layers.fused_moe import expert_rows
    from ferrylm.offload.host_tier import HostTier

    monkeypatch.setattr(fmd, "DECODE_MAX_TOKENS", 16)  # the rule on, whatever the shipped default
    torch.manual_seed(5)
    E, H, I, k = 4, 4096, 14336, 2
    b13, b2 = _mixtral_bank(scheme, E, H, I)
    d13, d2 = ((b13, b2) if scheme == "bf16" else (b13.dequantize(torch.bfloat16), b2.dequantize(torch.bfloat16)))

    def reference(x, ids, w):  # [A, H] fp64, row t * k + j
        rows = []
        for t in range(ids.shape[0]):
            for j in range(k):
                e = int(ids[t, j])
                g, u = (x[t].double() @ d13[e].double().T).chunk(2)
                rows.append((torch.nn.functional.silu(g) * u) @ d2[e].double().T * float(w[t, j]))
        return torch.stack(rows)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    tier = HostTier(pin=True)
    t13, t2 = _host_table(tier, b13), _host_table(tier, b2)
    for T in (1, 2, 8, 16):
        x = torch.randn(T, H, device="cuda").bfloat16()
        ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
        w = torch.rand(T, k, device="cuda")
        assert fmd.decode_config(T, b13, b2) is not None
        got = expert_rows(x, b13, b2, ids, w)
        plain = expert_rows(x, b13, b2, ids, w, decode=False)
        ref = reference(x, ids, w)
        print(f"decode kernel {scheme} T={T}: rel err vs fp64 reference {rel(got, ref):.2e} "
              f"(plain kernel {rel(plain, ref):.2e}), vs plain {rel(got, plain):.2e}")
        assert rel(got, ref) < 1e-2 and rel(got, plain) < 1e-2
        assert torch.equal(expert_rows(x, t13, t2, ids, w), got)
    if scheme in ("int8", "nf4"):
        for cfg in fmd.sweep_configs(scheme):
            got = expert_rows(x[:2], t13, t2, ids[:2], w[:2], decode=cfg)
            assert rel(got, ref[:4]) < 1e-2, cfg
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = expert_rows(x, t13, t2, ids, w)
    for seed in range(2):
        ids.copy_(torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(16)]))
        x.copy_(torch.randn(16, H, device="cuda"))
        g.replay()
        assert torch.equal(out, expert_rows(x, b13, b2, ids, w))
    tier.close()


QWEN3_MOE_4L = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
                "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
                "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960,
                "tie_word_embeddings": False, "num_hidden_layers": 4}
"""Qwen3-30B-A3B's shape with 4 layers (~6 GB bf16): bench_plan's moe-offload case, smaller."""


@pytest.mark.parametrize("expert_quant", [None, "nf4"])
def test_offloaded_moe_peak_stays_within_the_budget(expert_quant):
    """Issue #8 part 7, the budget covers everything ferrylm allocates: a Qwen3-30B-A3B-shaped MoE offloaded under
    a tight budget (mapped experts, hybrid decode, decode graphs; the embeddings on the host), bf16 or NF4
    experts (whose prefill decodes them for dense GEMMs), through prefills of a full-length prompt (one step at
    the token budget, then chunked), the same length of one token repeated (every token routed to the same
    experts: the costliest routing, which the warm-up measures in its stead), a batch of 16 prompts (mixed
    prefill + decode steps), graphed decode at 16 and at 1: the device's peak allocation from the engine's
    start, its build included (`ModelRunner.load_peak`), stays within the budget, and no step takes more over
    the engine at rest than the activations it kept. The message names each phase's peak above the engine at
    rest. Then `close()` gives the memory back at once."""
    from ferrylm.weights.random_source import RandomSource

    budget = 2 * 2**30
    free_engines()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(RandomSource(QWEN3_MOE_4L, expert_quant=expert_quant), device="cuda", dtype="bfloat16",
              max_num_seqs=16, max_model_len=2048, gpu_memory_budget=budget)
    runner = llm.engine.runner
    assert not runner.placement.fully_resident and runner.graphs is not None
    print(f"hybrid decode: {runner.placed.host_decode is not None} (share {runner.placed.cpu_share})")
    build = max(runner.load_peak, torch.cuda.max_memory_allocated()) - base
    torch.cuda.synchronize()
    rest = torch.cuda.memory_allocated() - base
    g = torch.Generator().manual_seed(3)
    vocab = QWEN3_MOE_4L["vocab_size"]

    def prompt(n):
        return torch.randint(100, vocab, (n,), generator=g).tolist()

    phases = {}

    def phase(name, prompts, tokens):
        torch.cuda.reset_peak_memory_stats()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        torch.cuda.synchronize()
        phases[name] = torch.cuda.max_memory_allocated() - base

    phase("prefill 2040", [prompt(2040)], 1)  # a step at the token budget (2048) as the warm-up's
    phase("prefill 2040 again", [prompt(2040)], 2)
    phase("one token x 2040", [[123] * 2040], 1)
    phase("16 x 512, decode 16", [prompt(512) for _ in range(16)], 24)  # mixed steps, then graphed decode
    phase("16 x 512 again", [prompt(512) for _ in range(16)], 24)
    phase("1 x 512, decode 1", [prompt(512)], 24)
    worst = max(build, *phases.values())
    msg = (f"budget {budget / 2**30:.2f} GiB; build peak {build / 2**30:.3f} GiB, at rest {rest / 2**30:.3f} GiB "
           f"(weights {runner.weights_allocated / 2**30:.3f} + KV {runner.kv_cache.nbytes / 2**30:.3f}; warm-up step "
           f"{runner.step_peak / 2**20:.0f} MiB, activations kept {runner.activation_bytes / 2**20:.0f} MiB); "
           + ", ".join(f"{k} {(v - rest) / 2**20:+.0f} MiB over rest" for k, v in phases.items()))
    print(msg)
    assert worst <= budget and max(phases.values()) - rest <= runner.activation_bytes, msg
    llm.close()
    torch.cuda.synchronize()
    left = torch.cuda.memory_allocated() - base
    print(f"after close(): {left / 2**20:.1f} MiB still allocated (cuBLAS workspaces of streams used)")
    assert left <= 128 * 2**20  # cuBLAS keeps a 32 MiB workspace per stream that ran a GEMM, for the process


def test_dropped_offloaded_engine_frees_its_memory_at_once(tmp_path_factory):
    """An offloaded hybrid engine with decode graphs, dropped (`del`, the collector off: no reference cycle
    may hold it), gives its device memory back at once, and its worker threads end; likewise after
    `close()` while still referenced. So a second engine sizes its KV from memory that is really free."""
    import gc
    import threading

    from test_models_hf import build

    path, _ = build(tmp_path_factory, "qwen3_moe")
    kw = dict(device="cuda", dtype="bfloat16", place=("experts=cpu", "layers.0.experts.0-1=gpu"), experts="auto",
              cpu_share=0.5, max_num_seqs=4, kv_cache_memory_gb=0.5)  # a pool large enough to see go
    prompts = [[5, 6, 7] * 30, [9, 10] * 7, [11] * 3]
    free_engines()
    threads = set(threading.enumerate())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for how in ("del", "close"):
        llm = LLM(path, **kw)
        assert llm.engine.runner.graphs is not None and llm.engine.runner.placed.host_decode is not None
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        held = torch.cuda.memory_allocated() - base
        gc.collect()
        gc.disable()
        try:
            if how == "del":
                del llm
            else:
                llm.close()
            torch.cuda.synchronize()
            left = torch.cuda.memory_allocated() - base
        finally:
            gc.enable()
        print(f"{how}: the engine held {held / 2**20:.1f} MiB; {left / 2**20:.1f} MiB left allocated")
        assert held >= 2**29 and left <= 160 * 2**20, (how, held, left)  # cuBLAS workspaces (32 MiB a stream
        # that ran a GEMM: the default one, each engine's graph side stream) stay for the process
        for t in set(threading.enumerate()) - threads:
            if t.name.startswith("ferry"):
                t.join(timeout=10)
        assert not [t.name for t in set(threading.enumerate()) - threads if t.name.startswith("ferry")]
        if how == "close":
            del llm


@pytest.mark.parametrize("family", ["llama3", "qwen3_moe"])
def test_one_launch_ops_equal_the_plain_engine(family, tmp_path_factory, monkeypatch):
    """The engine with its one-launch forms (`layers/fused_ops.py`, `kv/cache.write_kv`, the align kernel)
    against the same engine with all of them off, graphed, bf16: logits over the same contexts within bf16
    rounding (bf16 near-ties may flip a token: H200, session 7, 2 of 3 sequences at 2.7e-2)."""
    from test_models_hf import build

    from ferrylm.kv import cache
    from ferrylm.layers import fused_ops

    path, _ = build(tmp_path_factory, family)
    g = torch.Generator().manual_seed(23)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (30, 3, 11)]
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=4)
    monkeypatch.setattr(fused_ops, "ENABLED", False)
    monkeypatch.setattr(cache, "WRITE_KERNEL", False)
    ref_out, ref = sampled_rows(LLM(path, **kw), prompts, 16)
    free_engines()
    monkeypatch.setattr(fused_ops, "ENABLED", True)
    monkeypatch.setattr(cache, "WRITE_KERNEL", True)
    out, got = sampled_rows(LLM(path, **kw), prompts, 16)
    worst, diverged = worst_while_equal(ref_out, ref, out, got)
    print(f"{family}: one-launch ops vs plain engine: max |logit diff| {worst:.3e} over the same contexts "
          f"({diverged} sequences flipped a token)")
    assert worst < 5e-2  # (a token flips only where the two runs' logits are this close: a near-tie)


def test_decode_trace_recorded_inside_graphs_equals_eager(tmp_path_factory):
    """`ferry profile`'s decode trace is written device-side (graph-safe, no sync): a graphed resident engine and
    an offloaded one with mapped (graphed) decode steps record the counts and trace an eager engine records,
    graphs captured before the recording included (they are captured again)."""
    from test_models_hf import build

    from ferrylm.offload import expert_profile
    from ferrylm.sampling_params import SamplingParams

    path, _ = build(tmp_path_factory, "qwen3_moe")
    prompts = [[5, 17, 42, 99, 3, 200, 7], [1, 2, 3, 4]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = {}
    for name, kw in (("eager", dict(enforce_eager=True)), ("graphed", {}),
                     ("mapped", dict(place=("experts=cpu", "layers.0.experts.0-1=gpu"), experts="gpu"))):
        llm = LLM(path, device="cuda", dtype="float32", **kw)
        llm.generate([prompts[1]], params)  # graphs captured before recording: record captures them again
        got[name] = expert_profile.record(llm, prompts, params, trace_steps=100)
        llm.close()
    trace = got["eager"]["decode_trace"]
    assert len(next(iter(trace.values()))) == 2 * 11
    for name in ("graphed", "mapped"):
        assert got[name]["decode_trace"] == trace, name
        assert got[name]["layers"] == got["eager"]["layers"], name


def test_decode_trace_recorded_inside_bf16_graphs(tmp_path_factory):
    """The same recording through bf16 decode graphs, resident and mapped (where session 25's H100 run caught the
    trace's row write copying a host scalar inside a capture; the fp32 test above did not reach it): every traced
    step holds top-k distinct experts, as many steps as decode steps ran, and the counts hold every assignment.
    (bf16 routing may flip against eager on near ties: counted, not compared.)"""
    from test_models_hf import build

    from ferrylm.offload import expert_profile
    from ferrylm.sampling_params import SamplingParams

    path, _ = build(tmp_path_factory, "qwen3_moe")
    prompts = [[5, 17, 42, 99, 3, 200, 7], [1, 2, 3, 4]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for kw in ({}, dict(place=("experts=cpu", "layers.0.experts.0-1=gpu"), experts="gpu")):
        llm = LLM(path, device="cuda", dtype="bfloat16", **kw)
        assert llm.engine.runner.graphs is not None
        llm.generate([prompts[1]], params)  # graphs captured before: record captures them again, tracing
        prof = expert_profile.record(llm, prompts, params, trace_steps=100)
        llm.close()
        trace = prof["decode_trace"]
        assert all(len(v) == 2 * 11 for v in trace.values()), kw
        assert all(len(step) == 2 and len(set(step)) == 2 for v in trace.values() for step in v), kw
        # the counted run: 2 prompts and 11 decode steps each, top 2 per token; the model has no tokenizer, so
        # `record` runs seeded random prompts of 32 tokens in place of these (its docstring)
        assert llm.engine.tokenizer is None
        assert all(sum(v) == 2 * (32 + 32 + 2 * 11) for v in prof["layers"].values()), (kw, prof["layers"])

