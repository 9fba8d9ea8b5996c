"""`ferry plan` predictions against the engine, on the machine this runs on (the H200 for docs/benchmarks.md).

Each case builds a random-weight model of a real shape in memory (`RandomSource`, no disk), plans it for
`--gpu` (config.json written to a temp dir, so the planner reads it as a user's would) and runs the engine
with the planned settings (`ferrylm.plan.check`): weights and KV bytes, KV tokens, peak GPU memory, prefill
and decode tok/s at batch 1 and at the concurrency. Offloaded cases also re-plan with the expert hit rate
each decode run measured (`--expert-hit-rate`), which separates the routing assumption (uniform) from the
bandwidth model. Cases on CUDA:
- dense: Llama-3-8B shape, 16 layers (~9 GB bf16), resident, CUDA graphs;
- moe: Mixtral-8x7B shape, 8 layers (~23.5 GB), resident, fused MoE graphed;
- moe-offload: Qwen3-30B-A3B shape, 16 layers (~20 GB) under `--gpu-memory-budget 4 GiB` (128 experts of
  9.4 MB: misses read in place at decode up to 64 tokens);
- moe-offload-nf4: Mixtral-8x7B shape, 8 layers, NF4 experts (packed, ~6.3 GB) under 5 GiB (99 MB experts:
  read in place only at one token, copied at 16).
`--device cpu` (or no CUDA): a smoke run of the same script on tiny shapes (byte counts only; the offload
cases force experts to host memory with `--place experts=cpu`). Aims: weights +-1%, peak +-5%, decode +-20%.
Writes benchmarks/results/plan-check-<date>.json; the last line printed is JSON.

    python benchmarks/bench_plan.py --gpu 1xH200            # on the H200: ~3-5 minutes
    python benchmarks/bench_plan.py --device cpu            # smoke, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from dataclasses import replace

import torch

from results import write_results  # benchmarks/results.py

from ferrylm.plan.check import compare, engine_for, measure, predicted
from ferrylm.plan.planner import PlanOptions, make_plan

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
             "rope_theta": 5e5, "max_position_embeddings": 8192, "tie_word_embeddings": False}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
           "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
           "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 32768,
           "tie_word_embeddings": False}
QWEN3_30B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
             "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
             "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960,
             "tie_word_embeddings": False}
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_local_experts": 4}

# case -> (config, layers, GiB budget or None, experts stored as, decode tokens per run)
CASES = {
    "dense": (LLAMA3_8B, 16, None, None, 64),
    "moe": (MIXTRAL, 8, None, None, 64),
    "moe-offload": (QWEN3_30B, 16, 4, None, 32),
    "moe-offload-nf4": (MIXTRAL, 8, 5, "nf4", 32),
}


def case_config(case: str, tiny: bool) -> tuple[dict, float | None, str | None, int]:
    base, layers, budget_gib, experts, tokens = CASES[case]
    cfg = {**base, "num_hidden_layers": layers}
    if tiny:  # the same families at toy sizes: a smoke run of the script on the CPU
        cfg.update({k: v for k, v in TINY.items() if k in cfg}, num_hidden_layers=2, max_position_embeddings=4096)
    return cfg, budget_gib, experts, tokens


def run_case(case: str, a, device: str) -> tuple[list[dict], dict]:
    from ferrylm.weights.random_source import RandomSource

    cuda = device == "cuda"
    cfg, budget_gib, experts, tokens = case_config(case, tiny=not cuda)
    d = tempfile.mkdtemp(prefix=f"ferry-plan-{case}-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    opts = PlanOptions(os.path.join(d, "config.json"), gpu=a.gpu, host=a.host, max_model_len=2048,
                       max_num_seqs=a.concurrency, prompt_len=a.prompt_len, output_len=tokens,
                       concurrency=a.concurrency, measure_bandwidth=cuda and not a.profile_h2d, experts=a.experts,
                       expert_quant=experts if cuda else None)  # the CPU engine dequantizes packed experts
    if budget_gib is not None and cuda:
        opts = replace(opts, gpu_memory_budget_gb=budget_gib * 2**30 / 1e9)
    elif budget_gib is not None:
        opts = replace(opts, place=("experts=cpu",))
    if not cuda:
        opts = replace(opts, dtype="float32", kv_cache_memory_gb=0.01, prompt_len=32, output_len=4)
    plan = make_plan(opts)
    t = time.perf_counter()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    llm = engine_for(plan, RandomSource(cfg, dtype=getattr(torch, opts.dtype), expert_quant=experts), device)
    load_s = time.perf_counter() - t
    got = measure(plan, llm, cuda, max_decode_tokens=tokens)
    rows = compare(predicted(plan, cuda), got)
    info = dict(verdict=plan.verdict, load_s=load_s, h2d_gbs=plan.speed["assumptions"]["h2d_gbs"],
                experts_path={k: plan.speed[k].get("experts_path") for k in ("decode_batch1", "decode_concurrent")},
                binding={k: plan.speed[k]["binding"] for k in ("decode_batch1", "decode_concurrent")},
                hit_rate_assumed=plan.speed["assumptions"].get("expert_hit_rate"),
                hit_rate_measured={k: got.get(f"hit_rate_{k}") for k in ("decode_batch1", "decode_concurrent")},
                concurrency=plan.speed["decode_concurrent"]["batch"],
                cpu_share_planned=plan.speed["assumptions"].get("cpu_share"),
                cpu_share_engine=llm.engine.runner.placed.cpu_share if llm.engine.runner.placed.caches else None,
                host_read_gbs=plan.speed["assumptions"].get("host_read_gbs"))
    for key in ("decode_batch1", "decode_concurrent"):  # the bandwidth model alone: re-planned at the seen hit rate
        hit = got.get(f"hit_rate_{key}")
        if hit is not None:
            again = make_plan(replace(opts, expert_hit_rate=hit), advise=False)
            rows += compare({key: again.speed[key]["tok_s"]}, got, names=[key], suffix=" @measured hit")
    for r in rows:
        r["case"] = case
    del llm
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows, info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="1xH200", help="the GPU profile to plan for (the machine this runs on)")
    ap.add_argument("--host", default="local")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--profile-h2d", action="store_true",
                    help="plan with the profile's pinned H2D rate instead of measuring this machine's")
    ap.add_argument("--experts", default="auto", choices=("auto", "gpu", "cpu"),
                    help="where expert misses run (the engine's --experts; auto: hybrid decode)")
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/plan-check-<date>.json)")
    a = ap.parse_args()
    rows, cases = [], {}
    for case in a.cases:
        try:
            got, info = run_case(case, a, a.device)
        except Exception as e:  # keep what the other cases measured
            import traceback

            traceback.print_exc()
            rows.append({"case": case, "error": repr(e)})
            continue
        rows += got
        cases[case] = info
        print(f"\n{case} ({info['verdict']}, loaded in {info['load_s']:.0f} s, H2D {info['h2d_gbs']:.1f} GB/s, "
              f"hit rate assumed {info['hit_rate_assumed']}, measured {info['hit_rate_measured']}; host share "
              f"planned {info['cpu_share_planned']}, engine {info['cpu_share_engine']}):", flush=True)
        fmt = {"weights": 2**30, "kv": 2**30, "peak": 2**30}
        for r in got:
            div = fmt.get(r["metric"], 1)
            unit = " GiB" if div > 1 else ""
            print(f"  {r['metric']:32s} predicted {r['predicted'] / div:>12,.2f}{unit}  measured "
                  f"{r['measured'] / div:>12,.2f}{unit}  {r['rel_error']:+7.1%}  (aim +-{r['aim']:.0%}) "
                  f"{'ok' if r['within'] else 'MISSED'}", flush=True)
    write_results("plan-check", rows, out=a.out, gpu=a.gpu, device=a.device, cases=cases)


if __name__ == "__main__":
    main()
