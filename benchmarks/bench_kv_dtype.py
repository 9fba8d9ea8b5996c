"""Quantized KV cache accuracy: perplexity and per-token logprob drift of fp8 / int8 KV against the model-dtype
cache, on a real model (default: the embedded SmolLM2-135M GGUF) over the built-in corpus (English prose and
code, in a fixed order).

The text is scored through prompt logprobs, prefilled in chunks of `--chunk` tokens so every chunk after
the first attends to the earlier ones as they sit in the cache (codes for a quantized one); the chunk's own
keys are read back from the cache too. The baseline (`auto`: the model's dtype) is measured in the same run.

    python benchmarks/bench_kv_dtype.py [--model PATH] [--device cuda] [--dtype bfloat16] [--chunk 256]

Prints one row per KV dtype and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math

from ferrylm import LLM, SamplingParams
from ferrylm.bench.workload.corpus import CODE, EN


def token_logprobs(llm: LLM, text: str) -> list[float]:
    out = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    ids = out.prompt_token_ids
    return [d[ids[i]] for i, d in enumerate(out.prompt_logprobs) if d is not None]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--attention-backend", default="auto")
    a = p.parse_args()
    text = " ".join(EN) + "\n\n" + "\n".join(CODE)
    rows, base = [], None
    for kv in ("auto", "fp8", "int8"):
        llm = LLM(a.model, device=a.device, dtype=a.dtype, kv_cache_dtype=kv, max_num_batched_tokens=a.chunk,
                  max_num_seqs=1, enable_prefix_caching=False, attention_backend=a.attention_backend)
        lps = token_logprobs(llm, text)
        ppl = math.exp(-sum(lps) / len(lps))
        row = {"kv_cache_dtype": kv, "tokens": len(lps) + 1, "ppl": round(ppl, 4),
               "attention_backend": llm.engine.runner.attention_backend}
        if base is None:
            base = lps
        else:
            drift = [abs(x - y) for x, y in zip(lps, base)]
            row.update(ppl_delta_pct=round(100 * (ppl / rows[0]["ppl"] - 1), 3),
                       mean_abs_logprob_diff=round(sum(drift) / len(drift), 5), max_abs_logprob_diff=round(max(drift), 4))
        rows.append(row)
        print("  ".join(f"{k}={v}" for k, v in row.items()))
        del llm
    print(json.dumps({"bench": "kv_dtype", "model": a.model or "embedded SmolLM2-135M", "device": a.device,
                      "dtype": a.dtype, "chunk": a.chunk, "rows": rows}))


if __name__ == "__main__":
    main()
