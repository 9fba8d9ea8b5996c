"""Where a resident batch-1 decode step's GPU time goes (issue 11: Llama-3-8B batch 1 runs at 55% of the read
roofline). Times a graphed step, then profiles eager decode steps of the same engine shape with
`torch.profiler` (CUDA activity: the kernels a graph replays are the eager step's kernels) and groups the
kernels: matmuls (cuBLAS / cutlass GEMV and GEMM), attention (the Triton paged kernels), the rest.
The matmul group's achieved GB/s is its weight bytes over its kernel time: the number that says whether the
GEMVs or the kernels between them lose the time.

    PYTHONPATH=. python benchmarks/profile_resident.py [--layers 32] [--batch 1] [--steps 16] [--plain-ops]
The last line is JSON (also written to --out when given).
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from bench_resident import LLAMA3_8B, prompts, read_gb_s, shape_bytes  # noqa: E402


def step_ms(llm, batch: int, steps: int, vocab: int) -> float:
    from ferrylm import SamplingParams

    def run(n, seed):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts(batch, 512, seed, vocab), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(steps + 1, 1)  # warm-up: graph buckets captured, kernels compiled
    return 1e3 * (run(steps + 1, 2) - run(1, 3)) / steps


def group(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemv", "gemm", "sm90_xmma", "cutlass", "cublas", "splitk", "nvjet")):
        return "matmul"
    if any(s in n for s in ("attn", "attention", "paged", "decode_kernel", "flash")):
        return "attention"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plain-ops", action="store_true", help="layers/fused_ops.py off (torch's kernel chains)")
    a = ap.parse_args()
    if a.plain_ops:
        from ferrylm.kv import cache
        from ferrylm.layers import fused_ops

        fused_ops.ENABLED = cache.WRITE_KERNEL = False  # every one-launch form (the align kernel follows ENABLED)
    from ferrylm import LLM, SamplingParams
    from ferrylm.weights.random_source import RandomSource

    cfg = {**LLAMA3_8B, "num_hidden_layers": a.layers}
    bw = read_gb_s()
    out: dict = {"layers": a.layers, "batch": a.batch, "read_gb_s": bw, "fused_ops": not a.plain_ops}
    b = shape_bytes(cfg)
    out["roofline_ms"] = b["weights"] / bw / 1e6
    for eager in (False, True):
        llm = LLM(RandomSource(cfg), device="cuda", dtype="bfloat16", max_num_seqs=max(4, a.batch),
                  max_model_len=1024, enforce_eager=eager)
        out["eager_step_ms" if eager else "graphed_step_ms"] = step_ms(llm, a.batch, a.steps, cfg["vocab_size"])
        if eager:
            sp = SamplingParams(temperature=0, max_tokens=a.steps + 1, ignore_eos=True)
            ps = prompts(a.batch, 512, 9, cfg["vocab_size"])
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                llm.generate(ps, sp)
                torch.cuda.synchronize()
            kernels: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
            for ev in prof.key_averages():
                t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                if t and ev.key and not ev.key.startswith(("aten::", "cuda", "Memcpy", "Memset")) and ev.count:
                    kernels[ev.key][0] += ev.count
                    kernels[ev.key][1] += t
            steps = a.steps + 1  # the prefill's kernels are in the totals too: they are a few percent at 512 tokens
            groups: dict[str, float] = collections.defaultdict(float)
            for k, (n, t) in kernels.items():
                groups[group(k)] += t / steps / 1e3
            top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:15]
            out["per_step_ms_by_group"] = dict(groups)
            out["matmul_gb_s"] = b["weights"] / (groups["matmul"] * 1e-3) / 1e9 if groups["matmul"] else None
            out["top_kernels"] = [{"kernel": k[:90], "per_step": n / steps, "us_per_step": t / steps}
                                  for k, (n, t) in top]
            for r in out["top_kernels"]:
                print(f"{r['us_per_step']:9.1f} us/step  x{r['per_step']:6.1f}  {r['kernel']}")
        del llm
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    print(json.dumps(out))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
