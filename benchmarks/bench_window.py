"""Sliding-window decode: what skipping the blocks before the window buys at long context.

A random-weight Mistral-shaped model (`RandomSource`, no disk) decodes after a long prompt, with full
attention and with a sliding window, eager and (on CUDA) with decode graphs (which read and mask every
block). Baseline: the same model without a window, measured in the same run.

    python benchmarks/bench_window.py [--device cuda] [--context 16384] [--window 2048] [--layers 8]

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def config(layers: int, window: int | None, context: int) -> dict:
    return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000,
            "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": layers, "num_attention_heads": 32,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": context + 256,
            "sliding_window": window, "tie_word_embeddings": False}


def decode_rate(llm, context: int, batch: int, steps: int, device: str) -> float:
    """Decode tokens/s per step after a `context`-token prompt: (prefill + steps) - (prefill + 1)."""
    from ferrylm import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 32000, (context,), generator=g).tolist() for _ in range(batch)]

    def timed(n):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    timed(2)  # warm-up (the prompts are then prefix-cache hits for every timed run alike)
    t1, tn = timed(1), timed(steps + 1)
    return batch * steps / (tn - t1)


def main() -> None:
    from ferrylm import LLM
    from ferrylm.weights.random_source import RandomSource

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args()
    dtype = "bfloat16" if a.device == "cuda" else "float32"
    runs = [("full", None, True), ("window", a.window, True)]
    if a.device == "cuda":
        runs += [("full", None, False), ("window", a.window, False)]
    rows = []
    for name, window, eager in runs:
        llm = LLM(RandomSource(config(a.layers, window, a.context), dtype=getattr(torch, dtype)), device=a.device,
                  dtype=dtype, max_num_seqs=a.batch, max_model_len=a.context + 256, enforce_eager=eager,
                  max_num_batched_tokens=max(2048, a.batch))
        r = decode_rate(llm, a.context, a.batch, a.steps, a.device)
        rows.append({"attention": name, "window": window, "eager": eager, "decode_tok_s": r})
        print(f"{name:6s} window={window} eager={eager}: {r:8.1f} decode tok/s (batch {a.batch}, context {a.context})",
              flush=True)
        del llm
        if a.device == "cuda":
            torch.cuda.empty_cache()
    base = {r["eager"]: r["decode_tok_s"] for r in rows if r["window"] is None}
    for r in rows:
        r["speedup_vs_full"] = r["decode_tok_s"] / base[r["eager"]]
    print(json.dumps({"device": a.device, "context": a.context, "window": a.window, "layers": a.layers,
                      "batch": a.batch, "rows": rows}))


if __name__ == "__main__":
    main()
