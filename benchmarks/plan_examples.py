"""docs/plan.md's examples table: `ferry plan` on catalog models and GPU profiles (predictions, no GPU needed).

    PYTHONPATH=. python benchmarks/plan_examples.py     # markdown rows, as docs/plan.md shows them
"""

from __future__ import annotations

from ferrylm.plan import catalog
from ferrylm.plan.planner import PlanOptions, make_plan

HOST = "2xXeon-8480C,1TB"
ROWS = [("Qwen2-72B", "1xH200", {}), ("Qwen2-72B", "1xH200", {"gpu_memory_budget": "149e9"}),
        ("Mixtral-8x7B", "1xA800-80G-PCIe", {}), ("Mixtral-8x7B", "1xA800-80G-PCIe", {"experts": "gpu"}),
        ("Mixtral-8x7B", "1xA800-80G-PCIe", {"quant": "nf4"}), ("Qwen3-30B-A3B", "1xRTX-4090", {}),
        ("Qwen3-30B-A3B", "1xRTX-4090", {"routing": "zipf:0.8"}), ("Qwen3-30B-A3B", "1xRTX-4090", {"expert_hit_rate": 0.5}),
        ("Qwen3-30B-A3B", "1xRTX-4090", {"experts": "gpu"}), ("Yuan2-M32", "1xA800-80G-PCIe", {}),
        ("Yuan2-102B", "8xA800-80G-PCIe", {"tp": 8}), ("Qwen3-235B-A22B", "1xH200", {}),
        ("Qwen3-235B-A22B", "1xH200", {"routing": "zipf:0.8"}), ("Qwen3-235B-A22B", "1xH200", {"expert_quant": "nf4"})]
FLAGS = {"gpu_memory_budget": "--gpu-memory-budget", "experts": "--experts", "quant": "--quant", "routing": "--routing",
        "expert_hit_rate": "--expert-hit-rate", "tp": "--tp", "expert_quant": "--expert-quant"}


def main() -> None:
    for model, gpu, kw in ROWS:
        name = next((n for n in catalog.CATALOG if n.lower() == model.lower() or n.lower().replace(".0", "") == model.lower()), model)
        p = make_plan(PlanOptions(name, gpu=gpu, host=HOST, max_model_len=4096, max_num_seqs=8, **kw), advise=False)
        s, g = p.speed, p.per_gpu
        d1, d8 = s["decode_batch1"], s["decode_concurrent"]
        w = sum(p.weights_bytes.values()) / 2**30
        host = p.placement.get("host_bytes", 0) / 2**30
        lo, hi = g["kv_tokens_range"]
        exp = f", {d1['experts_path']}" if d1.get("experts_path") not in (None, "resident") else ""
        hit = f"{d1['expert_hit_rate']:.2f} / {d8['expert_hit_rate']:.2f}" if d1.get("expert_hit_rate") is not None else "-"
        opts = ", ".join(f"{FLAGS[k]} {v}" for k, v in kw.items())
        print(f"| {model} | {gpu}{', ' + opts if opts else ''} | {p.verdict} | {w:.1f} | {host:.1f} | {g['kv_tokens']:,} ({lo:,}-{hi:,}) "
              f"| {d1['tok_s']:.1f} ({d1['binding']}{exp}) | {d8['tok_s']:.1f} | {s['prefill_tok_s']:.0f} | {s['ttft_s']:.2f} | {hit} |")


if __name__ == "__main__":
    main()
