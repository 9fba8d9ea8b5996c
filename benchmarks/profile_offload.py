"""Profile decode steps of an offloaded MoE (where does a batch-1 step's time go?).

    PYTHONPATH=. python3 benchmarks/profile_offload.py [--layers 16] [--budget-gib 4] [--experts auto gpu cpu]
        [--profile]

One engine per `--experts` setting on the same random-weight Qwen3-30B-A3B shape and budget (the default is
`bench_plan.py`'s moe-offload case: 16 layers under 4 GiB, whose batch-1 hybrid decode the plan predicts 3.4x too
fast at the hit rate it sees, docs/benchmarks.md session 8). Per setting: the decode step time and per layer,
the expert hit rate, misses per layer, experts the host ran and the time the stream waited for it (`OffloadStats`),
and ms per missed expert beyond the step's resident reads. `--profile` adds the top host-side ops of a few steps
(torch profiler). The last line is JSON.
"""

import argparse
import gc
import json
import time

import torch

from bench_offload import QWEN3_30B, prompts  # noqa: E402


def run(experts: str, a) -> dict:
    from ferrylm import LLM, SamplingParams
    from ferrylm.weights.random_source import RandomSource

    llm = LLM(RandomSource({**QWEN3_30B, "num_hidden_layers": a.layers}), device="cuda", dtype="bfloat16",
              max_num_seqs=1, max_model_len=1024, gpu_memory_budget=f"{a.budget_gib}GiB", experts=experts)
    placed = llm.engine.runner.placed
    sp = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    llm.generate(prompts(1, 32, 1), sp)  # warm: graphs, the worker's kernels
    torch.cuda.synchronize()
    llm.generate(prompts(1, 32, 2), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))  # prefill only
    placed.stats.reset()
    t = time.perf_counter()
    llm.generate(prompts(1, 32, 3), sp)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    st = placed.stats
    steps = max(st.steps, 1)
    misses = st.expert_misses / steps / a.layers
    out = dict(experts=experts, step_ms=wall / a.tokens * 1e3, per_layer_ms=wall / a.tokens * 1e3 / a.layers,
               hit_rate=st.hit_rate, misses_per_layer=misses, cpu_experts_per_step=st.cpu_experts / steps,
               cpu_wait_ms_per_step=st.cpu_wait_s / steps * 1e3, cpu_busy_ms_per_step=st.cpu_busy_s / steps * 1e3,
               mapped_per_step=st.mapped_experts / steps, cpu_share=st.cpu_share,
               calibration=placed.calibration)
    print(json.dumps({k: v for k, v in out.items() if k != "calibration"}), flush=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts(1, 32, 4), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-gib", type=float, default=4)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per setting")
    ap.add_argument("--experts", nargs="+", default=["auto", "gpu", "cpu"], choices=["auto", "gpu", "cpu"])
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    rows = [run(e, a) for e in a.experts]
    base = min(rows, key=lambda r: r["step_ms"])
    for r in rows:  # the extra time per missed expert against the fastest setting
        if r["misses_per_layer"]:
            r["ms_per_miss_over_best"] = (r["step_ms"] - base["step_ms"]) / (r["misses_per_layer"] * a.layers)
    print(json.dumps({"bench": "profile-offload", "layers": a.layers, "budget_gib": a.budget_gib, "rows": rows}))


if __name__ == "__main__":
    main()
