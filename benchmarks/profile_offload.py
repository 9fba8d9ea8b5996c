"""Profile decode steps of an offloaded MoE (where does a batch-1 step's time go?).

    PYTHONPATH=. python3 benchmarks/profile_offload.py [--model qwen3-30b] [--budget 8]
Prints the top host-side ops by CPU time and the step time; the last line is JSON.
"""

import argparse
import json
import time

import torch

from bench_offload import QWEN3_30B, prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--layers", type=int, default=16)
    a = ap.parse_args()
    from ferrylm import LLM, SamplingParams
    from ferrylm.weights.random_source import RandomSource

    llm = LLM(RandomSource({**QWEN3_30B, "num_hidden_layers": a.layers}), device="cuda", dtype="bfloat16",
              max_num_seqs=1, max_model_len=1024, gpu_memory_budget=f"{a.budget * a.layers // 48}GiB")
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate(prompts(1, 32, 1), sp)
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts(1, 32, 2), sp)
    torch.cuda.synchronize()
    step = (time.perf_counter() - t) / 16
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts(1, 32, 3), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    print(json.dumps({"layers": a.layers, "step_ms": step * 1e3, "per_layer_ms": step * 1e3 / a.layers}))


if __name__ == "__main__":
    main()
