"""Cost of structured outputs per generated token: the same batch with and without a JSON-schema grammar.

Model: the embedded SmolLM2-135M-Instruct (or --model). For each batch size B, B requests generate exactly
`--max-tokens` tokens twice: free (ignore_eos) and constrained by a JSON schema whose shortest valid output is
longer than that (an array of at least 400 short strings), so both runs compute the same number of tokens.
Reported per B: tokens/s of both, the slowdown, and the grammar's own time per token split into the mask
fill (llguidance, all constrained rows in one parallel call), applying the mask in the sampler, and feeding
the sampled token back (consume). The last line printed is JSON.

    python benchmarks/bench_structured.py [--device cpu|cuda] [--batches 1 8 32] [--max-tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ferrylm import LLM, SamplingParams
from ferrylm.layers import sampler as sampler_mod
from ferrylm.sampling_params import StructuredOutput

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 400}


class _Timer:
    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.seconds += time.perf_counter() - t0
        return timed


def run(llm: LLM, batch: int, max_tokens: int, structured: bool) -> dict:
    engine = llm.engine
    fill, apply, consume = _Timer(), _Timer(), _Timer()
    real_fill, real_apply, real_advance = engine.grammar.fill_bitmask, sampler_mod.apply_allowed_mask, \
        engine._advance_grammar
    engine.grammar.fill_bitmask = fill.wrap(real_fill)
    sampler_mod.apply_allowed_mask = apply.wrap(real_apply)
    engine._advance_grammar = consume.wrap(real_advance)
    so = StructuredOutput("json", SCHEMA) if structured else None
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=not structured,
                             structured=so) for i in range(batch)]
    prompts = [f"List {i + 3} words as a JSON array:" for i in range(batch)]
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        secs = time.perf_counter() - t0
    finally:
        engine.grammar.fill_bitmask, sampler_mod.apply_allowed_mask = real_fill, real_apply
        engine._advance_grammar = real_advance
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    if structured:
        assert all(c.finish_reason == "length" for o in outs for c in o.outputs), "grammar ended early"
    return {"tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs,
            "fill_us_per_token": fill.seconds / tokens * 1e6, "apply_us_per_token": apply.seconds / tokens * 1e6,
            "consume_us_per_token": consume.seconds / tokens * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    llm = LLM(a.model, device=a.device, max_num_seqs=max(a.batches), max_model_len=512)
    run(llm, 1, 4, structured=True)  # warm-up: builds llguidance's token trie (about a second, once)
    results = []
    for b in a.batches:
        free = run(llm, b, a.max_tokens, structured=False)
        cons = run(llm, b, a.max_tokens, structured=True)
        r = {"batch": b, "free_tokens_per_s": round(free["tokens_per_s"], 1),
             "structured_tokens_per_s": round(cons["tokens_per_s"], 1),
             "slowdown": round(free["tokens_per_s"] / cons["tokens_per_s"], 3),
             **{k: round(v, 1) for k, v in cons.items() if k.endswith("_per_token")}}
        print(r)
        results.append(r)
    print(json.dumps({"bench": "structured", "device": a.device, "max_tokens": a.max_tokens, "results": results}))


if __name__ == "__main__":
    main()
