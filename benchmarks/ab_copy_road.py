"""Why a batched decode step of the 32-layer NF4 Mixtral (16 GiB) runs slower through mapped caches' copy road than
through the same caches with mapped off (session 39, H100: batch 16 at 58.7 tok/s against 72.6; session 14 on the
H200, batch 64: 195.5 against 215.7). Per `--experts` setting two engines side by side, one as served (batch-1 steps
read in place, larger ones take the copy road of mapped caches) and one with mapped off from the start; batch-16
decode windows alternate between them, the same prompts for both in a round, with each window's counters (experts
copied, computed on the host, the host kernels' background builds).

    cd benchmarks && PYTHONPATH=.. python ab_copy_road.py --experts auto gpu --rounds 3 --out FILE.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from bench_offload import MIXTRAL, TALLY_WARMUP_TOKENS, decode_window, h2d_bandwidth, prompts


def mapped_off(llm) -> None:
    """An engine's caches copy every step's misses from here on (`_forward_fused`), as `bench_offload.case_offload`'s
    "copy (mapped off)" rows: no tally, no graphs."""
    placed = llm.engine.runner.placed
    for c in placed.caches.values():
        c.land(wait=True)
        c.mapped = False
    placed.tally, llm.engine.runner.graphs = None, None


def window(llm, batch: int, steps: int, seed: int) -> dict:
    placed = llm.engine.runner.placed
    s = placed.stats
    before = {k: getattr(s, k) for k in ("h2d_bytes", "copied_experts", "cpu_experts", "expert_hits",
                                         "expert_misses", "mapped_experts", "weight_wait_s")}
    builds = placed.wait_host_builds()
    seconds, tokens, moved = decode_window(llm, batch, steps, seed, 32, s)
    d = {k: getattr(s, k) - v for k, v in before.items()}  # (the prompt's step included, but for h2d_bytes)
    return {"tok_s": tokens / seconds if seconds else 0.0, "h2d_gib_per_step": moved / max(tokens / batch, 1) / 2**30,
            "copied": d["copied_experts"], "cpu_experts": d["cpu_experts"], "hits": d["expert_hits"],
            "misses": d["expert_misses"], "mapped": d["mapped_experts"], "build_wait_s": round(builds, 2),
            # the device's waits for weight copies (`OffloadStats.wait`), ms a decode step
            "weight_wait_ms_per_step": d["weight_wait_s"] * 1e3 / max(tokens / batch, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", nargs="+", default=["auto", "gpu"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from ferrylm import LLM, SamplingParams
    from ferrylm.weights.random_source import RandomSource

    h2d = h2d_bandwidth()
    result = {"gpu": torch.cuda.get_device_name(), "commit": a.commit, "h2d_gb_s": h2d / 1e9, "batch": a.batch,
              "layers": a.layers, "runs": []}
    for experts in a.experts:  # two engines at once (2 x 16 GiB): one mapped as served, one mapped off
        t = time.perf_counter()
        cfg = {**MIXTRAL, "num_hidden_layers": a.layers}
        engines = {}
        for mode in ("mapped", "off"):
            engines[mode] = LLM(RandomSource(cfg, expert_quant="nf4"), device="cuda", dtype="bfloat16",
                                max_num_seqs=max(16, a.batch), max_model_len=4096, max_num_batched_tokens=2048,
                                gpu_memory_budget="16GiB", experts=experts)
            if mode == "off":
                mapped_off(engines[mode])
            engines[mode].generate(prompts(1, 32, 999), SamplingParams(temperature=0, max_tokens=TALLY_WARMUP_TOKENS,
                                                                       ignore_eos=True))
            engines[mode].generate(prompts(a.batch, 32, 998), SamplingParams(temperature=0, max_tokens=4,
                                                                             ignore_eos=True))
        print(f"{experts}: loaded and warmed in {time.perf_counter() - t:.1f} s", flush=True)
        for r in range(a.rounds):
            for mode in (("mapped", "off") if r % 2 == 0 else ("off", "mapped")):
                row = {"experts": experts, "round": r, "mode": mode, **window(engines[mode], a.batch, a.steps,
                                                                              5000 + 10 * r)}
                row["floor_tok_s"] = a.batch * h2d / (row["h2d_gib_per_step"] * 2**30) if row["h2d_gib_per_step"] else None
                result["runs"].append(row)
                print(json.dumps(row), flush=True)
        for llm in engines.values():
            llm.close()
        del engines, llm
        gc.collect()
        torch.cuda.empty_cache()
        if a.out:
            with open(a.out + ".tmp", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(a.out + ".tmp", a.out)
    for experts in a.experts:
        for mode in ("mapped", "off"):
            xs = [r["tok_s"] for r in result["runs"] if r["experts"] == experts and r["mode"] == mode]
            print(f"{experts} {mode}: mean {sum(xs) / len(xs):.2f} tok/s over {len(xs)} windows {[round(x, 1) for x in xs]}")


if __name__ == "__main__":
    main()
