"""Async scheduling on an offloaded engine, A/B. Until session 40 `EngineConfig.async_scheduling` auto left it off
for offloaded models, so the device idled while the host read a step's results and prepared the next: sessions 37
and 39 profiled the 8-layer NF4 Mixtral's batch-1 step under 5 GiB at 6.4-8.8 ms with the device idle 2.0-4.6 ms
of it, in ~2.3 ms gaps behind `cudaEventSynchronize`. This A/B (session 40: batch 1 gains, batch 16 breaks about
even) turned it on. Per `--experts` setting two engines side by side (async off, async on), decode windows
alternating between them on the same prompts (24 steps at batch 1, 12 batched), each window's rate against its
own PCIe floor.

    cd benchmarks && PYTHONPATH=.. python ab_async_offload.py --layers 8 --expert-quant nf4 --budget-gib 5 \
        --experts gpu auto --batches 1 16 --rounds 3 --out FILE.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from ab_copy_road import window
from bench_offload import MIXTRAL, TALLY_WARMUP_TOKENS, h2d_bandwidth, prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", nargs="+", default=["gpu", "auto"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--expert-quant", default="nf4", help="nf4, int4, fp8-g128 or none (bf16)")
    ap.add_argument("--budget-gib", type=float, default=5)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from ferrylm import LLM, SamplingParams
    from ferrylm.weights.random_source import RandomSource

    quant = None if a.expert_quant == "none" else a.expert_quant
    h2d = h2d_bandwidth()
    result = {"gpu": torch.cuda.get_device_name(), "commit": a.commit, "h2d_gb_s": h2d / 1e9, "layers": a.layers,
              "expert_quant": quant, "budget_gib": a.budget_gib, "runs": []}

    def save() -> None:
        if a.out:
            with open(a.out + ".tmp", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(a.out + ".tmp", a.out)

    for experts in a.experts:
        t = time.perf_counter()
        cfg = {**MIXTRAL, "num_hidden_layers": a.layers}
        engines = {}
        for mode in ("sync", "async"):
            engines[mode] = llm = LLM(RandomSource(cfg, expert_quant=quant), device="cuda", dtype="bfloat16",
                                      max_num_seqs=max(16, *a.batches), max_model_len=4096,
                                      max_num_batched_tokens=2048, gpu_memory_budget=f"{a.budget_gib}GiB",
                                      experts=experts, async_scheduling="on" if mode == "async" else "off")
            assert llm.engine.async_scheduling == (mode == "async")
            llm.generate(prompts(1, 32, 999), SamplingParams(temperature=0, max_tokens=TALLY_WARMUP_TOKENS,
                                                             ignore_eos=True))
        print(f"{experts}: loaded and warmed in {time.perf_counter() - t:.1f} s", flush=True)
        for batch in a.batches:
            for r in range(a.rounds):
                for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
                    row = {"experts": experts, "batch": batch, "round": r, "mode": mode,
                           **window(engines[mode], batch, a.steps if batch == 1 else 12, 6000 + 10 * r + batch)}
                    row["floor_tok_s"] = (batch * h2d / (row["h2d_gib_per_step"] * 2**30)
                                          if row["h2d_gib_per_step"] else None)
                    result["runs"].append(row)
                    print(json.dumps(row), flush=True)
                save()
        for llm in engines.values():
            llm.close()
        del engines, llm
        gc.collect()
        torch.cuda.empty_cache()
    for experts in a.experts:
        for batch in a.batches:
            for mode in ("sync", "async"):
                xs = [r["tok_s"] for r in result["runs"] if (r["experts"], r["batch"], r["mode"]) == (experts, batch, mode)]
                if xs:
                    print(f"{experts} batch {batch} {mode}: mean {sum(xs) / len(xs):.2f} tok/s {[round(x, 1) for x in xs]}")


if __name__ == "__main__":
    main()
