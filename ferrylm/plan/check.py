"""`ferry plan --check`: run the engine briefly with the planned settings and put the plan's predictions
beside what it measures: weights and KV bytes, peak device memory, KV tokens, prefill and decode tok/s.

Peak device memory is `torch.cuda.max_memory_allocated` plus the plan's CUDA-context allowance (the
allocator cannot see the context). On the CPU only the byte counts are compared (the plan's speeds are for
its GPU profile). Aims (issue #14): weights +-1%, peak +-5%, decode +-20%.
"""

from __future__ import annotations

import random
import time

from ferrylm.plan.planner import Plan

AIMS = {"weights": 0.01, "kv": 0.01, "peak": 0.05, "kv_tokens": 0.01, "decode_batch1": 0.2, "decode_concurrent": 0.2,
        "prefill": 0.3}


def run_check(plan: Plan, model_path: str, device: str) -> list[dict]:
    import torch

    from ferrylm import LLM, SamplingParams

    o = plan.options
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    llm = LLM(model_path, device=device, dtype=o.dtype, max_num_seqs=o.max_num_seqs,
              max_num_batched_tokens=o.max_num_batched_tokens, max_model_len=o.max_model_len,
              block_size=o.block_size, kv_cache_memory_gb=o.kv_cache_memory_gb, enforce_eager=o.enforce_eager,
              gpu_memory_budget=None if o.gpu_memory_budget_gb is None else int(o.gpu_memory_budget_gb * 1e9),
              gpu_memory_utilization=o.gpu_memory_utilization, place=tuple(o.place))
    runner = llm.engine.runner
    weights = sum({id(p): p.numel() * p.element_size() for p in runner.model.parameters()}.values())
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    out_len = min(o.output_len, 64)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate([prompt(16)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    llm.generate([prompt(o.prompt_len)], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    prefill = o.prompt_len / (time.perf_counter() - t)
    if cuda:  # on the device: resident groups, stream buffers and expert slots, as the plan counts them
        weights = runner.placement.device_bytes()
    rows = [("weights", plan.per_gpu["weights"], weights), ("kv", plan.per_gpu["kv"], runner.kv_cache.nbytes),
            ("kv_tokens", plan.per_gpu["kv_tokens"], runner.kv_cache.num_blocks * runner.kv_cache.block_size)]
    if cuda:
        rates = {}
        for key, batch in (("decode_batch1", 1), ("decode_concurrent", plan.speed["decode_concurrent"]["batch"])):
            outs = llm.generate([prompt(o.prompt_len) for _ in range(batch)], params)
            first = max(r.metrics["first_token_time"] for r in outs)
            last = max(r.metrics["finished_time"] for r in outs)
            rates[key] = batch * (out_len - 1) / (last - first)
        peak = torch.cuda.max_memory_allocated() + plan.per_gpu["cuda_context"]
        rows += [("peak", plan.per_gpu["peak"], peak), ("prefill", plan.speed["prefill_tok_s"], prefill),
                 ("decode_batch1", plan.speed["decode_batch1"]["tok_s"], rates["decode_batch1"]),
                 ("decode_concurrent", plan.speed["decode_concurrent"]["tok_s"], rates["decode_concurrent"])]
    out = []
    for name, want, got in rows:
        err = (want - got) / got if got else float("inf")
        out.append(dict(metric=name, predicted=want, measured=got, rel_error=err, aim=AIMS[name],
                        within=abs(err) <= AIMS[name]))
    return out
