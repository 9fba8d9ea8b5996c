"""Offload engine benchmark on a GPU: random-weight models of real shapes (`RandomSource`, no disk), run
resident and under a GPU memory budget, against the physical floors measured in the same run.

    python benchmarks/bench_offload.py --cases resident,offload16 [--out results.json]

Cases:
- resident: Mixtral-8x7B shape with 8 layers, bf16, all on the GPU: fused MoE (graphed) vs the torch
  per-expert backend vs transformers eager, batch 1 and 32 decode, against the active-weight HBM roofline.
- offload16: Mixtral-8x7B shape with 16 layers bf16 (~47 GB) under a 16 GiB budget: batch 1 / 64 decode
  and a 2k-token prefill, against the PCIe floor (bytes the engine moved per step / measured pinned H2D).
- deepseek-v2-lite (27 layers, ~31 GB) under 8 GiB, deepseek-v3-5L (V3 shape, 3 dense + 2 MoE layers, ~53 GB)
  under 16 GiB: MLA models through the same offload path (`case_offload`), batch 1 / 32.
- hybrid32-nf4: Mixtral 32 layers, NF4 experts, 16 GiB, batch 1 / 16 on one engine: hybrid (calibrated share,
  each miss split along its intermediate) vs copy-only (share 0, `cpu_mode=gpu`) vs cpu-only (share 1).
Prompts are fresh random ids (no prefix-cache hits). Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import time

import torch

MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
           "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
           "max_position_embeddings": 32768, "tie_word_embeddings": False}


QWEN3_30B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
             "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
             "norm_topk_prob": True, "num_hidden_layers": 48, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
             "max_position_embeddings": 40960, "tie_word_embeddings": False}
QWEN2_72B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
             "hidden_size": 8192, "intermediate_size": 29568, "num_attention_heads": 64, "num_key_value_heads": 8,
             "num_hidden_layers": 80, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 32768,
             "tie_word_embeddings": False}

YARN_40 = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
DEEPSEEK_V2_LITE = {  # 15.7B parameters, MLA, 64 experts top-6 + 2 shared
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "topk_method": "greedy", "n_group": 1,
    "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "max_position_embeddings": 163840, "tie_word_embeddings": False,
    "rope_scaling": {**YARN_40, "mscale": 0.707, "mscale_all_dim": 0.707}}
DEEPSEEK_V3 = {  # 671B parameters (61 layers), 256 experts top-8 in 8 groups + 1 shared, 3 dense layers
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 8, "topk_group": 4,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "max_position_embeddings": 163840, "tie_word_embeddings": False,
    "rope_scaling": {**YARN_40, "mscale": 1.0, "mscale_all_dim": 1.0}}


def zipf_routing(skew: float, seed: int = 0):
    """Replace the routers' choice with draws from a Zipf(skew) popularity (a fixed random ranking of the
    experts per MoE block), weights 1/k: the offload cache sees a skewed, repeatable workload. Mixtral and
    Qwen-MoE blocks (a shared expert, where there is one, still adds)."""
    from ferrylm.models import mixtral, qwen_moe

    g = torch.Generator().manual_seed(seed)
    perms: dict[int, torch.Tensor] = {}

    def forward(self, x):
        E, k = self.experts.num_experts, self.top_k
        if id(self) not in perms:
            perms[id(self)] = torch.randperm(E, generator=g).to(x.device)
        probs = (1.0 / torch.arange(1, E + 1, device=x.device, dtype=torch.float32) ** skew).expand(x.shape[0], E)
        ids = perms[id(self)][torch.multinomial(probs, k)]
        out = self.experts(x, ids, torch.full(ids.shape, 1.0 / k, device=x.device))
        if getattr(self, "has_shared", False):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    mixtral.SparseMoeBlock.forward = forward
    qwen_moe.QwenMoeBlock.forward = forward


def oracle(runner) -> tuple[float | None, float | None]:
    """(hit rate the caches had, Belady's hit rate on the same per-layer traces and capacities)."""
    from ferrylm.offload.expert_cache import belady_hits

    hits = opt = total = 0
    for cache in runner.placed.caches.values():
        tr = cache.trace or []
        h, n = belady_hits(tr, cache.kept, cache.trace_initial)  # (a shared pool's slots are not kept)
        opt, total = opt + h, total + n
        hits += cache.trace_hits
    return (hits / total, opt / total) if total else (None, None)


def needed_per_layer(runner) -> float | None:
    """Experts a layer's step needed, on average over the caches' traces (what a measured hit rate turns into
    misses: `ferry plan` takes it from tokens routed independently, docs/plan.md)."""
    steps = [len(step) for c in runner.placed.caches.values() for step in (c.trace or [])]
    return sum(steps) / len(steps) if steps else None


def h2d_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * src.numel() / (time.perf_counter() - t)


def hbm_bandwidth() -> float:
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    return 10 * 2 * a.numel() / (s.elapsed_time(e) / 1e3)  # read + write


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 32000, (length,), generator=g).tolist() for _ in range(n)]


def decode_rate(llm, batch: int, steps: int, seed: int, prompt_len: int = 32, stats=None):
    """Aggregate decode tokens/s of `batch` fresh prompts over their decode steps alone (`decode_window`), after a
    warm-up run (graphs, kernels); with `stats` also the weight bytes moved per decode step in the same steps."""
    from ferrylm import SamplingParams

    llm.generate(prompts(batch, prompt_len, seed + 100), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    seconds, tokens, moved = decode_window(llm, batch, steps, seed, prompt_len, stats)
    rate = tokens / seconds if seconds else 0.0
    return (rate, moved / (tokens / batch) if tokens else 0.0) if stats else rate


def decode_window(llm, batch: int, steps: int, seed: int, prompt_len: int, stats) -> tuple[float, int, float]:
    """(seconds, tokens, host-to-device bytes) of one run's decode steps: from the step after which every sequence
    has its first token to the last. Time and bytes come from the same steps (until session 12 the rate came from
    the difference of two runs and the bytes from a third, other prompts: the tally rows of the Yuan2.0-M32 case
    then read faster than their own PCIe floor), and no prefill's misses are counted (a prefill copies most
    experts, which swamped the decode steps' bytes on that case, session 11). The caches' traces restart there
    too, so the hit rates count the same steps (until session 13 they counted the warm-up and prompt steps). Under
    async scheduling the step after that one is already launched at the start, its bytes counted before it: its
    tokens are not the window's either (until session 40 they were: one step of `steps` too many)."""
    from ferrylm import SamplingParams

    eng = llm.engine
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
           for p in prompts(batch, prompt_len, seed)]
    got: dict[str, int] = {}
    t0 = b0 = n0 = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] = len(o.outputs[0].token_ids)
        if t0 is None and len(got) == batch and all(got.get(i, 0) >= 1 for i in ids):
            eng.wait_idle()  # the launched step's counts read and the copies they queue landed before the clock starts
            placed = getattr(eng.runner, "placed", None)
            if placed is not None:  # the hit rates (`oracle`) from these steps too: restart the traces
                for c in placed.caches.values():
                    c.start_trace()
            t0, b0, n0 = time.perf_counter(), stats.h2d_bytes if stats else 0, sum(got.values()) + eng.rows_in_flight
    torch.cuda.synchronize()
    if t0 is None:
        return 0.0, 0, 0.0
    return time.perf_counter() - t0, sum(got.values()) - n0, (stats.h2d_bytes - b0) if stats else 0.0


def prefill_rate(llm, length: int, seed: int) -> float:
    from ferrylm import SamplingParams

    llm.generate(prompts(1, length, seed + 50), SamplingParams(max_tokens=1))
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts(1, length, seed), SamplingParams(max_tokens=1))
    torch.cuda.synchronize()
    return length / (time.perf_counter() - t)


def weight_bytes_per_step(layers: int, cfg=MIXTRAL, experts: float | None = None) -> int:
    """bf16 weight bytes one decode step reads: each layer's attention and `experts` experts (default: one token's
    top-k), and the LM head."""
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = H // cfg["num_attention_heads"]
    attn = H * (cfg["num_attention_heads"] * hd + 2 * cfg["num_key_value_heads"] * hd) + H * H
    expert = 3 * H * I
    k = cfg["num_experts_per_tok"] if experts is None else experts
    return int(2 * (layers * (attn + k * expert) + V * H))


def weight_roofline(hbm: float, batch: int, layers: int, cfg=MIXTRAL) -> float:
    """Decode tokens/s if a step took only its weight reads at `hbm` (`hbm_bandwidth`'s read + write rate, which a
    read-only stream reaches): a batch of uniformly routed tokens touches E(1 - (1 - k/E)^batch) experts a layer."""
    E, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    distinct = E * (1 - (1 - k / E) ** batch)
    return batch * hbm / weight_bytes_per_step(layers, cfg, distinct)


def case_resident(rows: list, hbm: float) -> None:
    from ferrylm import LLM
    from ferrylm.weights.random_source import RandomSource

    cfg = {**MIXTRAL, "num_hidden_layers": 8}
    for backend in ("auto", "torch"):
        llm = LLM(RandomSource(cfg), device="cuda", dtype="bfloat16", max_num_seqs=64, max_model_len=1024,
                  kv_cache_memory_gb=4, moe_backend=backend, enforce_eager=backend == "torch")
        for batch in (1, 32):
            r, roof = decode_rate(llm, batch, 64, seed=batch), weight_roofline(hbm, batch, 8, cfg)
            rows.append({"model": "mixtral-8L", "budget_gib": None, "batch": batch, "routing": "model",
                         "backend": "fused+graphs" if backend == "auto" else "torch-eager",
                         "ferry_tok_s": r, "roofline_tok_s": roof, "of_roofline": r / roof})
            print(f"resident mixtral-8L {backend:5s} batch {batch:3d}: {r:8.1f} tok/s (weight roofline {roof:.0f}, "
                  f"{r / roof:.0%})", flush=True)
        llm.close()  # its memory and threads, before the next engine
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    code = f"""
import torch, time, transformers
cfg = transformers.MixtralConfig(**{{k: v for k, v in {cfg!r}.items() if k not in ('architectures', 'model_type')}})
torch.set_default_dtype(torch.bfloat16)
with torch.device('cuda'):
    m = transformers.MixtralForCausalLM(cfg).eval()
ids = torch.randint(10, 32000, (1, 32), device='cuda')
with torch.no_grad():
    m.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    torch.cuda.synchronize(); t = time.perf_counter()
    m.generate(ids, max_new_tokens=65, do_sample=False, min_new_tokens=65)
    torch.cuda.synchronize(); t65 = time.perf_counter() - t
    t = time.perf_counter(); m.generate(ids, max_new_tokens=1, do_sample=False); torch.cuda.synchronize()
    t1 = time.perf_counter() - t
print('HF', 64 / (t65 - t1))
"""
    out = subprocess.run(["python", "-c", code], capture_output=True, text=True, timeout=400)
    hf = next((float(x.split()[1]) for x in out.stdout.splitlines() if x.startswith("HF ")), None)
    if hf is None:
        print("transformers baseline failed:", out.stderr[-2000:])
    print(f"resident mixtral-8L transformers eager batch 1: {hf} tok/s", flush=True)
    rows.append({"model": "mixtral-8L", "budget_gib": None, "batch": 1, "routing": "model",
                 "backend": "transformers-eager", "hf_tok_s": hf})


def accelerate_rate(cfg: dict, budget_gib: int, tokens: int = 3) -> float | None:
    """transformers + accelerate `device_map` with the same `max_memory`, in its own process (decode tok/s)."""
    code = f"""
import time, torch, transformers, accelerate
c = {cfg!r}
cls = getattr(transformers, c['architectures'][0]); conf = getattr(transformers, cls.__name__.replace('ForCausalLM', 'Config'))
cfg = conf(**{{k: v for k, v in c.items() if k not in ('architectures', 'model_type')}})
torch.set_default_dtype(torch.bfloat16)
with accelerate.init_empty_weights():
    m = cls(cfg)
m = m.to_empty(device='cpu').eval()
pool = torch.randn(1 << 24).bfloat16() * 0.02
with torch.no_grad():
    for p in m.parameters():
        f = p.view(-1)
        for i in range(0, f.numel(), pool.numel()):
            n = min(pool.numel(), f.numel() - i); f[i:i + n].copy_(pool[:n])
dm = accelerate.infer_auto_device_map(m, max_memory={{0: '{budget_gib}GiB', 'cpu': '120GiB'}},
                                      no_split_module_classes=[type(m.model.layers[0]).__name__])
m = accelerate.dispatch_model(m, device_map=dm)
ids = torch.randint(10, 30000, (1, 32)).cuda()
with torch.no_grad():
    m.generate(ids, max_new_tokens=1, do_sample=False)
    torch.cuda.synchronize(); t = time.perf_counter()
    m.generate(ids, max_new_tokens=1, do_sample=False); torch.cuda.synchronize(); t1 = time.perf_counter() - t
    t = time.perf_counter()
    m.generate(ids, max_new_tokens={tokens + 1}, min_new_tokens={tokens + 1}, do_sample=False)
    torch.cuda.synchronize(); tn = time.perf_counter() - t
print('ACC', {tokens} / (tn - t1))
"""
    out = subprocess.run(["python3", "-c", code], capture_output=True, text=True, timeout=420)
    rate = next((float(x.split()[1]) for x in out.stdout.splitlines() if x.startswith("ACC ")), None)
    if rate is None:
        print("accelerate baseline failed:", out.stderr[-1500:])
    return rate


def case_offload(rows: list, h2d: float, name: str, cfg: dict, budget_gib: int, batches, prefill: int | None,
                 routing: str = "model", accelerate: bool = False, expert_quant: str | None = None,
                 linear_quant: str | None = None) -> None:
    from ferrylm import LLM
    from ferrylm.weights.random_source import RandomSource

    acc = accelerate_rate(cfg, budget_gib) if accelerate else None
    if accelerate:
        print(f"{name}: accelerate device_map (max_memory {budget_gib} GiB) batch 1: {acc} tok/s", flush=True)
    if routing.startswith("zipf"):
        zipf_routing(float(routing[4:] or 1.2))
    t = time.perf_counter()
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(RandomSource(cfg, expert_quant=expert_quant, linear_quant=linear_quant), device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
              max_model_len=4096,
              max_num_batched_tokens=2048, gpu_memory_budget=f"{budget_gib}GiB")
    runner = llm.engine.runner
    print(f"{name} loaded in {time.perf_counter() - t:.1f} s; peak GPU {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    print(runner.placement_text, flush=True)
    stats = runner.placed.stats
    warm = 0
    if runner.placed.tally is not None:  # the slots' steady state: a served model's tally has seen traffic
        from ferrylm import SamplingParams

        warm = TALLY_WARMUP_TOKENS
        llm.generate(prompts(1, 32, 999), SamplingParams(temperature=0, max_tokens=warm, ignore_eos=True))
    for batch in batches:
        steps = 24 if batch == 1 else 8
        built_s = runner.placed.wait_host_builds()  # background host-kernel builds done before timing
        if built_s > 0.05:
            print(f"{name}: waited {built_s:.1f} s for background host-kernel builds", flush=True)
        for c in runner.placed.caches.values():
            c.start_trace()
        r, per_step = decode_rate(llm, batch, steps, seed=1000 + batch, stats=stats)
        floor = batch / (per_step / h2d) if per_step else None
        hit, opt = oracle(runner)
        rows.append({"model": name, "budget_gib": budget_gib, "batch": batch, "routing": routing,
                     "path": "mapped" if runner.placed.tally is not None else "copy", "ferry_tok_s": r,
                     "accelerate_tok_s": acc if batch == 1 else None, "resident_tok_s": None,
                     "pcie_floor_tok_s": floor, "h2d_bytes_per_step": per_step, "hit_rate": hit,
                     "oracle_hit_rate": opt, "needed_per_layer": needed_per_layer(runner),
                     "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30, "tally_warmup_tokens": warm})
        print(f"{name} {routing} batch {batch:3d}: {r:8.2f} tok/s; PCIe floor {floor and round(floor, 2)} tok/s "
              f"({per_step / 2**30:.2f} GiB/step); hit rate {hit and round(hit, 3)} (Belady {opt and round(opt, 3)})",
              flush=True)
    tally = runner.placed.tally
    for knobs in TALLY_SWEEP if tally is not None and 1 in batches else ():  # promotion policies, batch 1
        tally.set_policy(knobs["policy"])
        tally.land_now = knobs["land_now"]
        for c in runner.placed.caches.values():
            c.start_trace()
        r, per_step = decode_rate(llm, 1, 24, seed=3000 + 10 * TALLY_SWEEP.index(knobs), stats=stats)
        hit, opt = oracle(runner)
        rows.append({"model": name, "budget_gib": budget_gib, "batch": 1, "routing": routing, "path": "mapped",
                     "tally": knobs, "ferry_tok_s": r, "h2d_bytes_per_step": per_step, "hit_rate": hit,
                     "oracle_hit_rate": opt, "pcie_floor_tok_s": 1 / (per_step / h2d) if per_step else None})
        print(f"{name} batch 1 tally {knobs}: {r:8.2f} tok/s; hit rate {hit and round(hit, 3)}", flush=True)
    if runner.placed.tally is not None:  # the same engine on the copy path: the baseline of this run
        for c in runner.placed.caches.values():
            c.land(wait=True)
            c.mapped = False
        runner.placed.tally, runner.graphs = None, None
        for batch in batches:
            for c in runner.placed.caches.values():
                c.start_trace()
            r, per_step = decode_rate(llm, batch, 24 if batch == 1 else 8, seed=2000 + batch, stats=stats)
            hit, opt = oracle(runner)
            rows.append({"model": name, "budget_gib": budget_gib, "batch": batch, "routing": routing,
                         "path": "copy (mapped off)", "ferry_tok_s": r, "h2d_bytes_per_step": per_step,
                         "hit_rate": hit, "oracle_hit_rate": opt, "needed_per_layer": needed_per_layer(runner)})
            print(f"{name} {routing} batch {batch:3d} copy path: {r:8.2f} tok/s; hit rate {hit and round(hit, 3)}",
                  flush=True)
    for c in runner.placed.caches.values():
        c.trace = None
    if prefill:
        b0 = stats.h2d_bytes
        r = prefill_rate(llm, prefill, seed=7)
        per = (stats.h2d_bytes - b0) / 2  # two prefills
        floor = prefill / (per / h2d) if per else None
        rows.append({"model": name, "budget_gib": budget_gib, "batch": f"prefill-{prefill}", "routing": routing,
                     "ferry_tok_s": r, "pcie_floor_tok_s": floor, "h2d_bytes_per_step": per,
                     "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30})
        print(f"{name} prefill {prefill}: {r:8.1f} tok/s; PCIe floor {floor and round(floor, 1)} tok/s", flush=True)
    llm.close()  # its memory and threads, before the next engine
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()


def case_hybrid(rows: list, h2d: float, routing: str = "model") -> None:
    """One 16-layer Mixtral load under 16 GiB; batch-1/16 decode with misses copied (gpu), computed on the
    host (cpu), or split by the cost model (auto), switched per run on the same engine."""
    from ferrylm import LLM
    from ferrylm.weights.random_source import RandomSource

    if routing.startswith("zipf"):
        zipf_routing(float(routing[4:] or 1.2))
    cfg = {**MIXTRAL, "num_hidden_layers": 16}
    llm = LLM(RandomSource(cfg), device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=4096,
              gpu_memory_budget="16GiB", experts="auto")
    runner = llm.engine.runner
    print("calibration:", runner.placed.calibration, flush=True)
    stats = runner.placed.stats
    for batch in (1, 16):
        row = {"model": "mixtral-16L", "budget_gib": 16, "batch": batch, "routing": routing}
        for mode in ("gpu", "cpu", "auto"):
            for c in runner.placed.caches.values():
                c.cpu_mode = mode
            stats.reset()
            r, per = decode_rate(llm, batch, 16 if batch == 1 else 6, seed=batch * 7, stats=stats)
            key = {"gpu": "copy_only_tok_s", "cpu": "cpu_only_tok_s", "auto": "hybrid_tok_s"}[mode]
            row[key] = r
            row[f"{mode}_split"] = {"copied_gib_per_step": per / 2**30, "cpu_experts": stats.cpu_experts,
                                    "cpu_busy_s": round(stats.cpu_busy_s, 3), "cpu_wait_s": round(stats.cpu_wait_s, 3)}
            print(f"hybrid {routing} batch {batch:2d} {mode:4s}: {r:7.2f} tok/s  {row[f'{mode}_split']}", flush=True)
        rows.append(row)
    llm.close()  # its memory and threads, before the next engine
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()


def case_pool(rows: list, h2d: float, layers: int = 8, budget_gib: float = 4.0,
              modes=("pool-auto", "pool-gpu", "no-pool-auto")) -> None:
    """A budget with no room for 2 expert slots a layer (bf16 Mixtral, 8 layers: 5.25 GiB of slots): the layers
    left with no expert on the device copy their misses through one pool of slots they share
    (`expert_cache.SlotPool`), with `--experts auto` and `gpu`, against auto with no pool (`memory.SHARED_EXPERT_SLOTS`
    0: those layers' copy-road misses run on the host's cores, as before session 38). Per engine: a fresh 2k prefill
    (its PCIe floor: the bytes it copied at the measured pinned rate), batch-1 and batch-16 decode."""
    from ferrylm import LLM
    from ferrylm.offload import memory
    from ferrylm.offload.placement import SHARED_EXPERT_SLOTS
    from ferrylm.weights.random_source import RandomSource

    cfg = {**MIXTRAL, "num_hidden_layers": layers}
    for name in modes:
        experts, pool = name.rsplit("-", 1)[1], not name.startswith("no-")
        memory.SHARED_EXPERT_SLOTS = SHARED_EXPERT_SLOTS if pool else 0
        try:
            llm = LLM(RandomSource(cfg), device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=4096,
                      gpu_memory_budget=f"{budget_gib}GiB", experts=experts)
        except Exception as e:  # e.g. gpu without a pool: refused
            rows.append({"model": f"mixtral-{layers}L", "budget_gib": budget_gib, "mode": name, "error": str(e)[:300]})
            print(f"pool {name}: {e}", flush=True)
            continue
        finally:
            memory.SHARED_EXPERT_SLOTS = SHARED_EXPERT_SLOTS
        placed = llm.engine.runner.placed
        caches = [placed.caches[l] for l in sorted(placed.caches)]
        row = {"model": f"mixtral-{layers}L", "budget_gib": budget_gib, "mode": name, "experts": experts,
               "pool_layers": [c.layer for c in caches if c.pool is not None],
               "capacities": [c.capacity for c in caches], "host_layers": [c.layer for c in caches if c.cpu_mode == "cpu"]}
        print(f"pool {name}: {row}", flush=True)
        stats = placed.stats
        for length in (2048,):
            prefill_rate(llm, 64, seed=5)  # warm-up: kernels, host experts
            stats.reset()
            r = prefill_rate(llm, length, seed=11 + length)
            moved = stats.h2d_bytes  # (prefill_rate's warm-up prompt counted too: both fresh, about equal)
            row[f"prefill_{length}_tok_s"] = r
            row[f"prefill_{length}_copied_gib"] = moved / 2 / 2**30
            row[f"prefill_{length}_pcie_floor_tok_s"] = length / (moved / 2 / h2d) if moved else None
            row[f"prefill_{length}_cpu_experts"] = stats.cpu_experts / 2
            print(f"pool {name} prefill {length}: {r:8.1f} tok/s; {row}", flush=True)
        for batch in (1, 16):
            stats.reset()
            r, per = decode_rate(llm, batch, 16 if batch == 1 else 6, seed=batch * 7, stats=stats)
            row[f"b{batch}_tok_s"] = r
            row[f"b{batch}_gib_per_step"] = per / 2**30
            print(f"pool {name} batch {batch}: {r:7.2f} tok/s {stats}", flush=True)
        rows.append(row)
        llm.close()
        del llm, placed, caches
        gc.collect()
        torch.cuda.empty_cache()


GEMM_SHARE = 0.45
"""The share at which `case_hybrid_decode` compares the host GEMM paths."""


def case_hybrid_decode(rows: list, h2d: float, routing: str = "model", shares=(0.0, 0.3, 0.45, 0.6, 1.0),
                       gpu_side: str = "inplace", quick: bool = False) -> None:
    """Hybrid decode (graphed): Mixtral 16L bf16 under 16 GiB, batch 1; the host computes a share of the
    missed experts while the kernel reads the rest in place. Share 0 (host idle; since session 16 an in-place
    bank then skips the hand-off) is the same-run in-place baseline; the calibrated share, re-balanced on the
    misses its first steps see, is what `experts=auto` serves. With gpu_side="copy" the host worker copies the
    GPU's misses with the copy engine instead (share 0: copy only). `quick`: the split rows only, no GEMM sweep
    (the served share against share 0 and 0.1 either side of it)."""
    from ferrylm import LLM
    from ferrylm.offload.host_decode import HostDecode
    from ferrylm.weights.random_source import RandomSource

    HostDecode.gpu_side = gpu_side

    if routing.startswith("zipf"):
        zipf_routing(float(routing[4:] or 1.2))
    cfg = {**MIXTRAL, "num_hidden_layers": 16}
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=4096, gpu_memory_budget="16GiB",
              experts="auto")
    llm = LLM(RandomSource(cfg), **kw)
    placed = llm.engine.runner.placed
    auto = placed.cpu_share
    calibration = placed.calibration  # the figures auto chose from (a forced engine below skips the balance)
    print(f"calibration: {calibration}; calibrated share {auto:.2f}", flush=True)
    if placed.host_decode is None:  # auto turned hybrid decode off: force it on to sweep the shares
        llm.close()
        llm = LLM(RandomSource(cfg), **kw, cpu_share=max(shares) or GEMM_SHARE)
        placed = llm.engine.runner.placed
    row = {"model": "mixtral-16L", "budget_gib": 16, "batch": 1, "routing": routing, "calibrated_share": auto,
           "gpu_side": gpu_side, "calibration": calibration, "by_share": {}}
    splits = (True,) if quick else (True, False) if gpu_side == "inplace" else (False,)
    for split in splits:  # each miss split along its intermediate (the default), or whole experts per side
        key = "by_share" if split == splits[0] else "by_share_whole_experts"
        row[key] = {}
        placed.hybrid_split = split
        todo = [*shares, auto]
        while todo:
            share = todo.pop(0)
            placed.set_cpu_share(share)
            if share is auto and split == splits[0]:  # auto as served: re-balanced on the misses its steps see
                row["rebalanced_share"] = share = rebalance(llm, placed)
                if quick:  # how far the served share is from the best one: 0.1 either side of it
                    todo += [x for x in (round(share - 0.1, 2), round(share + 0.1, 2)) if 0 < x < 1]
            if llm.engine.runner.graphs is not None:
                llm.engine.runner.graphs.reset()  # the column split is baked into captures
            placed.stats.reset()
            r, per = decode_rate(llm, 1, 24, seed=int(share * 100) + 3, stats=placed.stats)
            s = placed.stats
            row[key][f"{share:.2f}"] = {"tok_s": r, "pcie_gib_per_token": per / 2**30, "cpu_experts": s.cpu_experts,
                                        "cpu_busy_s": round(s.cpu_busy_s, 3), "hit_rate": s.hit_rate}
            print(f"hybrid decode {routing} split={split} share {share:.2f}: {r:6.2f} tok/s  in place "
                  f"{per / 2**30:.2f} GiB/token, {s}", flush=True)
    # the host GEMM path (`layers/cpu_experts.dense_gemm`) the calibration chose against the others, at one
    # share, both ways of splitting: the calibration times whole experts, a split step runs column windows
    from ferrylm.layers import cpu_experts
    chosen = row["dense_gemm"] = cpu_experts.dense_gemm
    row["by_gemm"] = {}
    for g in () if quick else cpu_experts.DENSE_GEMMS:
        cpu_experts.dense_gemm = g
        for split in splits:
            placed.hybrid_split = split
            placed.set_cpu_share(GEMM_SHARE)
            if llm.engine.runner.graphs is not None:
                llm.engine.runner.graphs.reset()
            placed.stats.reset()
            r, per = decode_rate(llm, 1, 24, seed=7, stats=placed.stats)
            row["by_gemm"][f"{g} split={split}"] = {"tok_s": r, "cpu_busy_s": round(placed.stats.cpu_busy_s, 3),
                                                    "cpu_experts": placed.stats.cpu_experts}
            print(f"hybrid decode {routing} gemm {g} split={split} share {GEMM_SHARE}: {r:6.2f} tok/s "
                  f"{row['by_gemm'][f'{g} split={split}']}", flush=True)
    cpu_experts.dense_gemm = chosen
    row["hybrid_tok_s"] = row["by_share"][f"{row.get('rebalanced_share', auto):.2f}"]["tok_s"]  # as served
    row["inplace_only_tok_s"] = row["by_share"]["0.00"]["tok_s"]
    row["cpu_only_tok_s"] = row["by_share"].get("1.00", {}).get("tok_s")
    rows.append(row)
    llm.close()  # its memory and threads, before the next engine
    del llm, placed
    gc.collect()
    torch.cuda.empty_cache()


def rebalance(llm, placed) -> float:
    """Arm the engine's re-balance (`PlacedWeights.arm_rebalance`) and decode batch-1 tokens through its window,
    then through the share tuner's climb (`offload/share_tuner.py`) where it started: the share auto serves
    with once its mapped steps have shown the misses a layer and their step times. Returns that share."""
    from ferrylm import SamplingParams
    from ferrylm.offload.placed_weights import REBALANCE_WINDOW

    placed.arm_rebalance()
    t = time.perf_counter()
    llm.generate(prompts(1, 16, 4242), SamplingParams(temperature=0, max_tokens=REBALANCE_WINDOW[1] + 16,
                                                      ignore_eos=True))
    cal = placed.calibration or {}
    print(f"re-balance: {cal.get('measured_misses', float('nan')):.2f} misses a layer seen "
          f"({cal.get('expected_misses', float('nan')):.2f} assumed): share {placed.cpu_share:.2f}", flush=True)
    for i in range(12):  # the tuner: ~20 steps a share, 5-10 shares
        if placed.tuner is None:
            break
        llm.generate(prompts(1, 16, 4343 + i), SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    cal = placed.calibration or {}
    if placed.pending_share is not None:  # applied now, so the caller's wait for host-kernel builds covers it
        placed.set_cpu_share(placed.pending_share)
    share = placed.cpu_share
    if "tuned_share" in cal:
        print(f"share tuner: {share:.2f} ({time.perf_counter() - t:.1f} s with the re-balance; median step ms by "
              f"share {cal['tuned_step_ms']})", flush=True)
    return share


def case_hybrid_packed(rows: list, h2d: float, layers: int = 32, expert_quant: str | None = "nf4", budget_gib: int = 16,
                       batches=(1, 16), linear_quant: str | None = None, prefill: int | None = None,
                       cfg: dict | None = None, model: str = "mixtral") -> None:
    """The issue's packed hybrid case: Mixtral-8x7B shape (or `cfg`, named `model`), `layers` layers, experts
    `expert_quant` (packed in pinned host memory, read packed), under `budget_gib`; one engine (`experts=auto`), per batch three
    settings switched on it: hybrid (the calibrated share, every miss split along its intermediate: the GPU
    reads columns [0, c) in place, the host computes [c, I); steps above `mapped_tokens` take the copy path
    with the cost model's split of whole experts), copy-only (share 0: in place / copied, host idle; copy
    path `cpu_mode=gpu`) and cpu-only (share 1, `cpu_mode=cpu`). Graphs re-captured per setting. `prefill`: also
    one prompt of that many tokens under each setting (a row with batch "prefill"). `expert_quant` None: bf16."""
    from ferrylm import LLM, SamplingParams
    from ferrylm.weights.random_source import RandomSource

    cfg = {**(cfg or MIXTRAL), "num_hidden_layers": layers}
    name = f"{model}-{layers}L-{expert_quant or 'bf16'}-experts"
    t = time.perf_counter()
    llm = LLM(RandomSource(cfg, expert_quant=expert_quant, linear_quant=linear_quant), device="cuda", dtype="bfloat16",
              max_num_seqs=max(batches), max_model_len=4096, gpu_memory_budget=f"{budget_gib}GiB", experts="auto")
    runner = llm.engine.runner
    placed = runner.placed
    auto = placed.cpu_share
    first = next(iter(placed.caches.values()))
    I = first.host_w2.shape[2]
    print(f"{name} loaded in {time.perf_counter() - t:.1f} s; calibration {placed.calibration}; calibrated share "
          f"{auto:.2f}; decode steps of <= {first.mapped_tokens} tokens read in place", flush=True)
    if placed.host_decode is None:  # the cost model's verdict, with the figures it came from
        rows.append({"model": name, "hybrid": "off", "calibrated_share": auto, "calibration": placed.calibration})
        llm.close()
        return
    settings = {"auto": ("hybrid_tok_s", auto, True), "gpu": ("copy_only_tok_s", 0.0, False),
                "cpu": ("cpu_only_tok_s", 1.0, True)}

    def use(mode: str) -> float:
        """Switch the engine to a setting: split, share, its host kernels built (seconds waited), `cpu_mode`,
        graphs re-captured (the column split is baked into captures), counters restarted."""
        _, share, split = settings[mode]
        placed.hybrid_split = split
        placed.set_cpu_share(share)
        built_s = placed.wait_host_builds()
        for c in placed.caches.values():
            c.cpu_mode = mode
        if runner.graphs is not None:
            runner.graphs.reset()
        placed.stats.reset()
        return built_s

    counted = ("cpu_experts", "cpu_busy_s", "cpu_wait_s", "expert_hits", "expert_misses")
    for batch in batches:
        row = {"model": name, "budget_gib": budget_gib, "batch": batch, "calibrated_share": auto, "inter": I,
               "mapped_tokens": first.mapped_tokens}
        if batch == batches[0]:  # auto as served: re-balanced on the misses its steps see
            placed.hybrid_split = True
            placed.set_cpu_share(auto)
            for c in placed.caches.values():
                c.cpu_mode = "auto"
            row["rebalanced_share"] = share = rebalance(llm, placed)
            settings["auto"] = (settings["auto"][0], share, True)
            # then the routing tally warmed (`TALLY_WARMUP_TOKENS`), so the first setting timed does not pay for
            # the cache's learning (Qwen3-30B, session 20: auto at share 0 ran 30.1 tok/s at hit rate 0.59 where
            # the copy-only row after it, the same share, ran 48.2 at 0.74)
            llm.generate(prompts(1, 16, 4545), SamplingParams(temperature=0, max_tokens=TALLY_WARMUP_TOKENS,
                                                              ignore_eos=True))
        # short prompts: with cpu_mode=cpu the prefill's misses run on the host too (compute-bound there).
        # Batch 1: three rounds of 24 steps, the settings in an order rotated each round, the three prompts in a
        # Latin square (every setting decodes every prompt once, never the prompt the setting before it just
        # decoded). A random model's greedy decode routes so unevenly from prompt to prompt that prompts of their
        # own decided the comparison: Qwen3-30B at the same share 0 (auto and copy-only run the same code there),
        # one 12-step sequence a setting, 30.1 tok/s at hit rate 0.59 against 48.2 at 0.74 (session 20); three
        # prompts of their own, 45.4 at 0.78 against 53.1 at 0.81; one prompt a round for all three settings (the
        # one after another met a cache warmed on that prompt's routing), 39.4 against 42.8 (session 21)
        reps, steps = (3, 24) if batch == 1 else (1, 4)
        acc = {m: {"secs": 0.0, "per": 0.0, "built_s": 0.0, **{k: 0 for k in counted}} for m in settings}
        modes = list(settings)
        for rep in range(reps):
            for i, mode in enumerate(modes[rep % 3:] + modes[:rep % 3]):
                a = acc[mode]
                a["built_s"] += use(mode)
                a["split_cols"] = first.split_cols
                seed = batch * 11 + 1000 * i  # the round's i-th run its i-th prompt: a setting rotates through them
                r1, per1 = decode_rate(llm, batch, steps, seed=seed, prompt_len=8, stats=placed.stats)
                a["secs"] += steps * batch / r1
                a["per"] += per1 / reps
                for k in counted:
                    a[k] += getattr(placed.stats, k)
                # (the hit rates count the setting's warm-up run and prompt steps with its timed steps)
                a.setdefault("rounds", []).append({"round": rep, "prompt": i, "tok_s": round(r1, 2),
                                                   "hit_rate": placed.stats.hit_rate})
        for mode, (key, share, _) in settings.items():
            a = acc[mode]
            looked = a["expert_hits"] + a["expert_misses"]
            row[key] = r = reps * steps * batch / a["secs"]
            row[f"{mode}_split"] = {"share": share, "split_cols": a["split_cols"],
                                    "h2d_gib_per_step": a["per"] / 2**30, "cpu_experts": a["cpu_experts"],
                                    "cpu_busy_s": round(a["cpu_busy_s"], 3), "cpu_wait_s": round(a["cpu_wait_s"], 3),
                                    "hit_rate": a["expert_hits"] / looked if looked else None,
                                    "host_build_wait_s": round(a["built_s"], 2), "rounds": a["rounds"]}
            print(f"{name} batch {batch:2d} {mode:4s} (share {share:.2f}): {r:7.2f} tok/s  {row[f'{mode}_split']}",
                  flush=True)
        row["split"] = acc["auto"]["split_cols"]
        rows.append(row)
    if prefill:  # a prompt's steps take the copy road: the cost model's split of whole experts (cpu_mode)
        row = {"model": name, "budget_gib": budget_gib, "batch": "prefill", "prompt_tokens": prefill}
        for i, (mode, (key, share, split)) in enumerate(settings.items()):
            use(mode)
            row[key] = r = prefill_rate(llm, prefill, seed=1000 + 7 * i)  # fresh prompts: no prefix-cache hit
            row[f"{mode}_split"] = {"cpu_experts": placed.stats.cpu_experts,
                                    "h2d_gib": placed.stats.h2d_bytes / 2**30}
            print(f"{name} prefill {prefill} {mode:4s}: {r:8.1f} tok/s  {row[f'{mode}_split']}", flush=True)
        rows.append(row)
    llm.close()  # its host workers stop before the interpreter does (left running, the process aborted at exit)
    del llm, runner, placed, first
    gc.collect()
    torch.cuda.empty_cache()


def case_hybrid_profile(rows: list, h2d: float, skew: float = 1.2) -> None:
    """Zipf routing with a recorded profile (the issue's "more under Zipf with a profile"): Mixtral 16L bf16 under
    16 GiB, batch 1. Engine 1 has no profile: it records one over a warm-up (`expert_profile.record`, what `ferry
    profile` does) and serves auto (re-balanced, tuned); engine 2 starts with that profile (`expert_profile=`, what
    `--expert-profile` does: each layer's hottest experts resident, never evicted) and serves auto and share 0
    (in place only). The same Zipf ranking in both (`zipf_routing` re-seeded)."""
    import tempfile

    from ferrylm import LLM, SamplingParams
    from ferrylm.offload import expert_profile
    from ferrylm.weights.random_source import RandomSource

    cfg = {**MIXTRAL, "num_hidden_layers": 16}
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=4096, gpu_memory_budget="16GiB",
              experts="auto")
    path = os.path.join(tempfile.mkdtemp(), "mixtral-16L-zipf.json")
    row = {"model": "mixtral-16L", "budget_gib": 16, "batch": 1, "routing": f"zipf{skew}"}

    def served(llm, key):  # auto as served, then (key "profile") share 0 on the same engine
        placed = llm.engine.runner.placed
        row[f"{key}_calibrated_share"] = placed.cpu_share
        for mode in ("auto", "inplace") if key == "profile" else ("auto",):
            share = rebalance(llm, placed) if mode == "auto" else 0.0
            placed.set_cpu_share(share)
            placed.wait_host_builds()
            if llm.engine.runner.graphs is not None:
                llm.engine.runner.graphs.reset()
            placed.stats.reset()
            r, per = decode_rate(llm, 1, 24, seed=17, stats=placed.stats)
            st = placed.stats
            row[f"{key}_{mode}"] = {"tok_s": r, "share": share, "pcie_gib_per_token": per / 2**30,
                                    "hit_rate": st.hit_rate, "cpu_experts": st.cpu_experts}
            print(f"zipf{skew} {key} {mode} (share {share:.2f}): {r:6.2f} tok/s  {row[f'{key}_{mode}']}", flush=True)

    zipf_routing(skew)
    llm = LLM(RandomSource(cfg), **kw)
    t = time.perf_counter()
    prof = expert_profile.record(llm, [[i + 1] for i in range(8)],
                                 SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    expert_profile.write(prof, path)
    counts = [sorted(v, reverse=True) for v in prof["layers"].values()]
    row["profile_top_share"] = sum(c[0] + c[1] for c in counts) / max(1, sum(sum(c) for c in counts))
    print(f"profile recorded in {time.perf_counter() - t:.1f} s: the top 2 of 8 take {row['profile_top_share']:.2f} "
          f"of the routing", flush=True)
    llm.engine.runner.placed.stats.reset()
    served(llm, "no_profile")
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    zipf_routing(skew)  # the same ranking for the second engine
    llm = LLM(RandomSource(cfg), **kw, expert_profile=path)
    row["profile_note"] = llm.engine.runner.placed.profile_note
    print(row["profile_note"], flush=True)
    served(llm, "profile")
    row["hybrid_tok_s"] = row["profile_auto"]["tok_s"]
    row["inplace_only_tok_s"] = row["profile_inplace"]["tok_s"]
    rows.append(row)
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


TALLY_WARMUP_TOKENS = 96
"""Batch-1 tokens decoded before the first timed run where the mapped path's routing tally promotes experts (until
session 11 the first run timed a cold tally: Yuan2.0-M32 NF4 at batch 1 ran 17 tok/s cold, 32-37 after the batch-32
run had taught it)."""
TALLY_SWEEP = [{"policy": "frequent", "land_now": False}, {"policy": "frequent", "land_now": True},
               {"policy": "dueling", "land_now": True}]
"""Slot policies (`offload/routing_tally.py`; frequent without land_now: the tally before
bench_cache_policy) tried at batch 1 on the same engine, after the default's rows."""

def _yuan_m32() -> dict:
    from ferrylm.plan.yuan_sizes import YUAN2_M32

    return YUAN2_M32


CASES = {
    "hybrid16-decode": lambda rows, h2d: case_hybrid_decode(rows, h2d),
    "hybrid16-decode-zipf": lambda rows, h2d: case_hybrid_decode(rows, h2d, "zipf1.2"),
    "hybrid16-decode-copy": lambda rows, h2d: case_hybrid_decode(rows, h2d, gpu_side="copy"),
    "hybrid16": lambda rows, h2d: case_hybrid(rows, h2d),
    "pool8": lambda rows, h2d: case_pool(rows, h2d),
    "pool16": lambda rows, h2d: case_pool(rows, h2d, layers=16, budget_gib=8.0, modes=("pool-auto", "no-pool-auto")),
    # the packed hybrid case: Mixtral 32 layers, NF4 experts, 16 GiB, batch 1 and 16 (split vs each side)
    "hybrid16-decode-quick": lambda rows, h2d: case_hybrid_decode(rows, h2d, shares=(0.0,), quick=True),
    "hybrid16-decode-zipf-quick": lambda rows, h2d: case_hybrid_decode(rows, h2d, "zipf1.2", shares=(0.0,), quick=True),
    "hybrid32-nf4": lambda rows, h2d: case_hybrid_packed(rows, h2d),
    "hybrid32-int4": lambda rows, h2d: case_hybrid_packed(rows, h2d, expert_quant="int4"),
    # the "never more than 5% slower than the better side": bf16 16L, batch 1-64 and a 2k prefill
    "hybrid16-sweep": lambda rows, h2d: case_hybrid_packed(rows, h2d, layers=16, expert_quant=None,
                                                           batches=(1, 4, 16, 64), prefill=2048),
    # the batch-16 aim alone (bf16 16L: 2-4 tokens an expert on the host, where the AMX kernel runs)
    "hybrid16-b16": lambda rows, h2d: case_hybrid_packed(rows, h2d, layers=16, expert_quant=None, batches=(16,)),
    "hybrid16-zipf": lambda rows, h2d: case_hybrid(rows, h2d, "zipf1.2"),
    "hybrid16-zipf-profile": lambda rows, h2d: case_hybrid_profile(rows, h2d),
    # the "the same on the Qwen3-30B-A3B and Yuan2.0-M32 shapes": bf16 experts, budget 8 GiB (Qwen3 61 GB;
    # M32 16 of its 24 layers, ~51 GB bf16), and M32's 24 layers with int4 experts
    "hybrid-qwen3-30b": lambda rows, h2d: case_hybrid_packed(rows, h2d, layers=48, expert_quant=None, budget_gib=8,
                                                             cfg=QWEN3_30B, model="qwen3-30b-a3b"),
    # against llama.cpp's Q4_K_M with experts on the CPU (benchmarks/device_llamacpp.sh)
    "hybrid-qwen3-30b-int4": lambda rows, h2d: case_hybrid_packed(rows, h2d, layers=48, expert_quant="int4",
                                                                  budget_gib=8, cfg=QWEN3_30B, model="qwen3-30b-a3b"),
    "hybrid-yuan-m32": lambda rows, h2d: case_hybrid_packed(rows, h2d, layers=16, expert_quant=None, budget_gib=8,
                                                            cfg=_yuan_m32(), model="yuan2-m32"),
    "hybrid-yuan-m32-int4": lambda rows, h2d: case_hybrid_packed(rows, h2d, layers=24, expert_quant="int4",
                                                                 budget_gib=8, cfg=_yuan_m32(), model="yuan2-m32"),
    "offload16": lambda rows, h2d: case_offload(rows, h2d, "mixtral-16L", {**MIXTRAL, "num_hidden_layers": 16}, 16,
                                                (1, 64), 2048, accelerate=True),
    "offload16-ferry": lambda rows, h2d: case_offload(rows, h2d, "mixtral-16L", {**MIXTRAL, "num_hidden_layers": 16},
                                                      16, (1, 64), 2048),
    "zipf16": lambda rows, h2d: case_offload(rows, h2d, "mixtral-16L", {**MIXTRAL, "num_hidden_layers": 16}, 16,
                                             (1, 64), None, routing="zipf1.2"),
    "qwen3-30b": lambda rows, h2d: case_offload(rows, h2d, "qwen3-30b-a3b", QWEN3_30B, 8, (1, 64), None),
    "qwen3-30b-zipf": lambda rows, h2d: case_offload(rows, h2d, "qwen3-30b-a3b", QWEN3_30B, 8, (1,), None,
                                                     routing="zipf1.2"),
    # experts NF4 (g64, packed in host memory and read packed), the rest bf16: the 32-layer NF4 case
    "mixtral-32L-nf4": lambda rows, h2d: case_offload(rows, h2d, "mixtral-32L-nf4-experts",
                                                      {**MIXTRAL, "num_hidden_layers": 32}, 16, (1, 16),
                                                      None, expert_quant="nf4"),
    # its batch 64 with a 2k prefill, and batch 1 under Zipf routing (the "same cases"; session 29: unrun)
    "mixtral-32L-nf4-b64": lambda rows, h2d: case_offload(rows, h2d, "mixtral-32L-nf4-experts",
                                                          {**MIXTRAL, "num_hidden_layers": 32}, 16, (64,), 2048,
                                                          expert_quant="nf4"),
    "mixtral-32L-nf4-zipf": lambda rows, h2d: case_offload(rows, h2d, "mixtral-32L-nf4-experts",
                                                           {**MIXTRAL, "num_hidden_layers": 32}, 16, (1,), None,
                                                           routing="zipf1.2", expert_quant="nf4"),
    "qwen3-30b-nf4": lambda rows, h2d: case_offload(rows, h2d, "qwen3-30b-a3b-nf4-experts", QWEN3_30B, 8, (1, 64),
                                                    None, expert_quant="nf4"),
    # Qwen3-30B-A3B-FP8's layout (experts as block-wise FP8 loads them: e4m3 + a scale per row and 128 columns), 8 GiB;
    # hybrid: the same with the host's native fp8 kernel beside the in-place reads (session 24)
    "qwen3-30b-fp8": lambda rows, h2d: case_offload(rows, h2d, "qwen3-30b-a3b-fp8-experts", QWEN3_30B, 8, (1, 64),
                                                    None, expert_quant="fp8-g128"),
    "hybrid-qwen3-30b-fp8": lambda rows, h2d: case_hybrid_packed(rows, h2d, layers=48, expert_quant="fp8-g128",
                                                                 budget_gib=8, cfg=QWEN3_30B, model="qwen3-30b-a3b"),
    "qwen2-72b-24L": lambda rows, h2d: case_offload(rows, h2d, "qwen2-72b-24L", {**QWEN2_72B, "num_hidden_layers": 24},
                                                    16, (1, 32), 2048),
    # the dense case: Qwen2-72B, all 80 layers, decoder Linears NF4 (~41 GB), 16 GiB: most layers streamed
    "qwen2-72b-nf4": lambda rows, h2d: case_offload(rows, h2d, "qwen2-72b-nf4", QWEN2_72B, 16, (1, 32), 2048,
                                                    linear_quant="nf4"),
    "deepseek-v2-lite": lambda rows, h2d: case_offload(rows, h2d, "deepseek-v2-lite", DEEPSEEK_V2_LITE, 8, (1, 32),
                                                       2048),
    # the Yuan2.0-M32 case: 24 layers, 32 experts top-2, attention router; experts NF4, 8 GiB
    "yuan-m32-nf4": lambda rows, h2d: case_offload(rows, h2d, "yuan2-m32-nf4-experts", _yuan_m32(), 8, (1, 32), None,
                                                   expert_quant="nf4"),
    # throughput: Mixtral 16L bf16 at batch 256 under 16 GiB (every expert of every layer crosses once a step)
    "offload16-b256": lambda rows, h2d: case_offload(rows, h2d, "mixtral-16L", {**MIXTRAL, "num_hidden_layers": 16}, 16,
                                                     (256,), None),
    # 3 dense + 2 MoE layers of V3 (~53 GB bf16): the expert banks that make V3 need offload
    "deepseek-v3-5L": lambda rows, h2d: case_offload(rows, h2d, "deepseek-v3-5L", {**DEEPSEEK_V3, "num_hidden_layers": 5},
                                                     16, (1, 32), None),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="resident,offload16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None, help="the tree's commit, where the checkout's HEAD is not it (the "
                    "device's copy of a working tree reports its base commit)")
    ap.add_argument("--one-call-an-expert", action="store_true", help="host experts one native call each "
                    "(`cpu_experts.native_batched_experts` off): the baseline of the batched call")
    a = ap.parse_args()
    if a.one_call_an_expert:
        from ferrylm.layers import cpu_experts
        cpu_experts.native_batched_experts = False
    h2d, hbm = h2d_bandwidth(), hbm_bandwidth()
    print(f"pinned H2D {h2d / 1e9:.1f} GB/s; HBM copy (read+write) {hbm / 1e12:.2f} TB/s", flush=True)
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    result = {"gpu": torch.cuda.get_device_name(), "commit": commit, "h2d_gb_s": h2d / 1e9,
              "host_experts_batched": not a.one_call_an_expert,
              "hbm_copy_tb_s": hbm / 1e12, "cases": []}
    rows = result["cases"]

    def save() -> None:  # temp then rename: a call cut short keeps the cases and batches done
        if a.out:
            with open(a.out + ".tmp", "w") as f:
                json.dump(result, f, indent=1, default=str)
            os.replace(a.out + ".tmp", a.out)

    def stopped(signum, frame):  # `timeout` sends SIGTERM: keep the rows a case appended so far (each batch's)
        result["stopped"] = f"signal {signum} during a case: its rows so far are kept"
        save()
        raise SystemExit(124)

    signal.signal(signal.SIGTERM, stopped)
    for c in a.cases.split(","):
        try:
            case_resident(rows, hbm) if c == "resident" else CASES[c](rows, h2d)
        except Exception as e:  # keep what the other cases measured
            import traceback

            traceback.print_exc()
            rows.append({"case": c, "error": repr(e)})
        gc.collect()
        torch.cuda.empty_cache()
        save()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
