"""`ferry plan` predictions against the engine, on the machine this runs on (the H200 for docs/benchmarks.md).

For each case a random-weight checkpoint is written once (transformers `save_pretrained`, no download), the
planner predicts for `--gpu` (default 1xH200) and `ferry plan --check`'s runner measures: weights and KV
bytes, KV tokens, peak GPU memory, prefill and decode tok/s at batch 1 and at the concurrency. Cases:
dense (Llama ~1.2B, CUDA graphs), MoE resident (Mixtral-shaped ~2.6B, 8 experts top-2) and the same MoE
offloaded (`--gpu-memory-budget` of half its weights + 2 GB: experts in pinned host memory, cached slots).
Prints a table per case; the last line is JSON.

    python benchmarks/bench_plan.py [--gpu 1xH200] [--cases dense moe] [--prompt-len 512] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

import torch

from ferrylm.plan.check import run_check
from ferrylm.plan.planner import PlanOptions, make_plan

CASES = {
    "dense": ("LlamaForCausalLM", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)),
    "moe": ("MixtralForCausalLM", dict(hidden_size=2048, intermediate_size=4096, num_hidden_layers=12,
                                       num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                                       num_local_experts=8, num_experts_per_tok=2)),
}


def checkpoint(case: str) -> str:
    import transformers

    arch, shape = CASES[case]
    path = f"/tmp/ferry-plan-{case}"
    if not os.path.exists(os.path.join(path, "config.json")):
        cfg_cls = transformers.LlamaConfig if arch == "LlamaForCausalLM" else transformers.MixtralConfig
        model_cls = getattr(transformers, arch)
        torch.manual_seed(0)
        model_cls(cfg_cls(max_position_embeddings=4096, **shape)).to(torch.bfloat16).save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="1xH200")
    ap.add_argument("--host", default="local")
    ap.add_argument("--cases", nargs="+", default=[*CASES, "moe-offload"])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    a = ap.parse_args()
    results = {}
    for case in a.cases:
        path = checkpoint(case.removesuffix("-offload"))
        opts = PlanOptions(path, gpu=a.gpu, host=a.host, max_model_len=2048, max_num_seqs=a.concurrency,
                           prompt_len=a.prompt_len, output_len=a.output_len, concurrency=a.concurrency)
        if case.endswith("-offload"):
            weights = sum(make_plan(opts).weights_bytes.values())
            opts = replace(opts, gpu_memory_budget_gb=(weights / 2 + 2e9) / 1e9)
        rows = run_check(make_plan(opts), path, "cuda" if torch.cuda.is_available() else "cpu")
        print(f"\n{case}:")
        for r in rows:
            print(f"  {r['metric']:18s} predicted {r['predicted']:>16,.1f}  measured {r['measured']:>16,.1f}  "
                  f"{r['rel_error']:+7.1%}  (aim +-{r['aim']:.0%}) {'ok' if r['within'] else 'MISSED'}")
        results[case] = {r["metric"]: {k: r[k] for k in ("predicted", "measured", "rel_error")} for r in rows}
    print(json.dumps({"bench": "plan", "gpu": a.gpu, "results": results}))


if __name__ == "__main__":
    main()
