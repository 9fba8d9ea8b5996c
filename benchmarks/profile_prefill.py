"""Where a fresh prefill's device time goes, resident or under a budget (the plan's prefill parts against the device).

    PYTHONPATH=. python3 benchmarks/profile_prefill.py [--shape mixtral] [--layers 8] [--expert-quant nf4]
        [--budget-gib 5] [--tokens 512]

Times fresh prompts of `--tokens` tokens (prefill and one sampled token; the prefix cache must not serve them: a new
seed each), then profiles one and prints the top device ops by self device time, summed by kernel name, and the
timeline (`profile_offload.timeline`: copies, kernels, both, idle). With no `--budget-gib` the model is resident.
Written for the plan's resident NF4 prefill, predicted 58% too fast on the H100 (session 31: 11,275 tok/s measured,
17,856 predicted from compute 15.2 ms, expert decode 12.3 ms and launches 1.2 ms for 512 tokens over 8 layers); its
first run there: `_decode_experts` 19.8 ms, the grouped GEMMs 14.8, the device idle 25.2 ms of a 62.7 ms span in 1179
gaps (host-bound: `dequant_rows` launched per expert). Also prints the top host ops by self host time.
The last line is JSON.
"""

import argparse
import json
import time

import torch

from bench_offload import MIXTRAL, QWEN3_30B, prompts  # noqa: E402
from profile_offload import timeline  # noqa: E402

SHAPES = {"qwen3": QWEN3_30B, "mixtral": MIXTRAL}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mixtral")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--expert-quant", default=None)
    ap.add_argument("--budget-gib", type=float, default=None, help="none: resident")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    ap.add_argument("--tile4", default=None, metavar="BN,BK",
                    help="`fused_moe.DECODE_4BIT_TILE` for this run (default: the engine's)")
    a = ap.parse_args()
    if a.tile4:
        from ferrylm.layers import fused_moe

        fused_moe.DECODE_4BIT_TILE = tuple(int(v) for v in a.tile4.split(","))
    from torch.profiler import ProfilerActivity, profile

    from ferrylm import LLM, SamplingParams
    from ferrylm.weights.random_source import RandomSource

    budget = None if a.budget_gib is None else f"{a.budget_gib}GiB"
    llm = LLM(RandomSource({**SHAPES[a.shape], "num_hidden_layers": a.layers}, expert_quant=a.expert_quant),
              device=a.device, dtype="bfloat16", max_num_seqs=1, max_model_len=a.tokens + 64,
              max_num_batched_tokens=max(2048, a.tokens), gpu_memory_budget=budget)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    seconds = []
    for seed in (20, 21, 22, 23):  # the first warms kernels up
        sync()
        t = time.perf_counter()
        llm.generate(prompts(1, a.tokens, seed), params)
        sync()
        seconds.append(time.perf_counter() - t)
    best = min(seconds[1:])
    print(f"{a.shape} {a.layers}L experts {a.expert_quant or 'bf16'} budget {budget or 'none (resident)'}: "
          f"{a.tokens}-token prefill {best * 1e3:.1f} ms ({a.tokens / best:.0f} tok/s; runs "
          f"{', '.join(f'{s * 1e3:.1f}' for s in seconds[1:])} ms)", flush=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with profile(activities=acts) as prof:
        llm.generate(prompts(1, a.tokens, 24), params)
        sync()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in ops)
    print(f"device time {total / 1e3:.1f} ms (profiled)\n{'op':70s} {'self device ms':>14s} {'calls':>7s}")
    top = []
    for e in ops[:a.top]:
        print(f"{e.key[:70]:70s} {e.self_device_time_total / 1e3:14.3f} {e.count:7d}")
        top.append(dict(op=e.key, device_ms=e.self_device_time_total / 1e3, calls=e.count))
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    print(f"host time {sum(e.self_cpu_time_total for e in host) / 1e3:.1f} ms (profiled, self)\n"
          f"{'op':70s} {'self host ms':>14s} {'calls':>7s}")
    for e in host[:a.top]:
        print(f"{e.key[:70]:70s} {e.self_cpu_time_total / 1e3:14.3f} {e.count:7d}")
    line = timeline(prof)
    print(f"timeline: {json.dumps({k: v for k, v in line.items() if k != 'longest_gaps'})}", flush=True)
    llm.close()
    print(json.dumps({"bench": "profile-prefill", "shape": a.shape, "layers": a.layers, "expert_quant": a.expert_quant,
                      "budget_gib": a.budget_gib, "tokens": a.tokens, "seconds": seconds, "tok_s": a.tokens / best,
                      "device_ms": total / 1e3, "top": top,
                      "host_top": [dict(op=e.key, host_ms=e.self_cpu_time_total / 1e3, calls=e.count) for e in host[:a.top]], "timeline": line}))


if __name__ == "__main__":
    main()
