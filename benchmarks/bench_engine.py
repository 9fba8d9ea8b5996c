"""Engine throughput against `transformers.generate`, same model, same dtype, same process, same prompts.

Model: the embedded SmolLM2-135M-Instruct GGUF (transformers dequantizes the same file). Cases:
  - batch 1: decode tokens/s of one chat prompt (fixed output length)
  - batch B (8, 32), equal output lengths: every request generates `--max-tokens` tokens
  - batch B, mixed output lengths: per-request max_tokens drawn uniformly from [16, --max-tokens]; a padded
    `generate` batch runs until its longest member finishes.
  - queue of 4B requests with mixed lengths through B slots: `transformers` runs them as consecutive padded
    batches of B, ferrylm (max_num_seqs=B) refills a slot as soon as a request finishes.
Throughput counts only the tokens each request asked for. The last line printed is JSON.

    python benchmarks/bench_engine.py [--device cpu|cuda] [--dtype float32] [--max-tokens 128] [--batches 8 32]
        [--random smollm2|llama-1b]   # a random-weight checkpoint of that shape instead of the GGUF (GPU box)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import time

import torch

from ferrylm import LLM, SamplingParams
from ferrylm.default_model import default_model_path
from prompts import QUESTIONS  # benchmarks/prompts.py (scripts run from the repo root)

SHAPES = {  # random-weight stand-ins (speed does not depend on the values; ignore_eos fixes the lengths)
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
}


def random_checkpoint(shape: str, dtype: torch.dtype) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = f"/tmp/ferry-bench-{shape}"
    if not os.path.exists(os.path.join(path, "config.json")):
        cfg = LlamaConfig(max_position_embeddings=4096, rope_theta=100000.0, **SHAPES[shape])
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).to(dtype).save_pretrained(path)
    return path


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def ferry_run(llm: LLM, prompts: list[list[int]], max_tokens: list[int], device: str) -> tuple[float, int]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    sync(device)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(device)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def hf_queue(model, prompts, max_tokens, pad_id: int, device: str, slots: int) -> tuple[float, int]:
    dt = n = 0
    for i in range(0, len(prompts), slots):
        d, k = hf_run(model, prompts[i:i + slots], max_tokens[i:i + slots], pad_id, device)
        dt, n = dt + d, n + k
    return dt, n


def hf_run(model, prompts: list[list[int]], max_tokens: list[int], pad_id: int, device: str) -> tuple[float, int]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    n = max(max_tokens)
    sync(device)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=pad_id)
    sync(device)
    dt = time.perf_counter() - t
    assert out.shape[1] == width + n
    return dt, sum(max_tokens)  # a padded batch only delivers what each request asked for


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--random", choices=sorted(SHAPES), default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", nargs="*", default=None, help="run only cases whose name starts with one of these")
    ap.add_argument("--enforce-eager", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[a.dtype]

    model_path = random_checkpoint(a.random, dtype) if a.random else None
    llm = LLM(model_path, device=a.device, dtype=a.dtype, max_num_seqs=max(a.batches + [1]),
              max_num_batched_tokens=4096, max_model_len=2048, enforce_eager=a.enforce_eager)
    if a.random:  # no tokenizer: random prompts of chat-like lengths
        g = torch.Generator().manual_seed(0)
        chats = [torch.randint(100, 40000, (20 + 3 * i,), generator=g).tolist() for i in range(len(QUESTIONS))]
        pad = 0
    else:
        tok = llm.tokenizer
        chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
                 for q in QUESTIONS]
        pad = min(tok.eos_token_ids) if tok.eos_token_ids else 0
    prompts = [chats[i % len(chats)] for i in range(4 * max(a.batches))]

    hf = None
    if not a.skip_hf:
        from transformers import AutoModelForCausalLM

        if a.random:
            hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        else:
            path = default_model_path()
            hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                      dtype=dtype)
        hf = hf.to(a.device).eval()

    # warm-up both (allocator, kernels, rope tables)
    ferry_run(llm, prompts[:2], [8, 8], a.device)
    if hf is not None:
        hf_run(hf, prompts[:2], [8, 8], pad, a.device)

    rows = []

    def case(name: str, ps: list[list[int]], mts: list[int], slots: int | None = None) -> None:
        if a.cases and not any(name.startswith(c) for c in a.cases):
            return
        # alternate the two engines and keep the median of `--repeats` runs: clocks and neighbours drift
        f_rates, h_rates = [], []
        sched = llm.engine.scheduler.config
        llm.engine.scheduler.config = dataclasses.replace(sched, max_num_seqs=slots or len(ps))
        for _ in range(a.repeats):
            f_dt, f_n = ferry_run(llm, ps, mts, a.device)
            f_rates.append(f_n / f_dt)
            if hf is not None:
                h_dt, h_n = hf_queue(hf, ps, mts, pad, a.device, slots or len(ps))
                h_rates.append(h_n / h_dt)
        llm.engine.scheduler.config = sched
        row = {"case": name, "ferry_tok_s": statistics.median(f_rates)}
        if hf is not None:
            row |= {"hf_tok_s": statistics.median(h_rates), "ratio": row["ferry_tok_s"] / statistics.median(h_rates)}
        rows.append(row)
        print(" | ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    case("batch1", prompts[:1], [a.max_tokens])
    for b in a.batches:
        case(f"batch{b}-equal", prompts[:b], [a.max_tokens] * b)
        mixed = [random.randint(min(16, a.max_tokens), a.max_tokens) for _ in range(4 * b)]
        case(f"batch{b}-mixed", prompts[:b], mixed[:b])
        case(f"queue{4 * b}-slots{b}-mixed", prompts[:4 * b], mixed, slots=b)

    print(json.dumps({"bench": "engine", "model": a.random or "smollm2-gguf", "device": a.device, "dtype": a.dtype, "threads": torch.get_num_threads(),
                      "max_tokens": a.max_tokens, "repeats": a.repeats, "eager": a.enforce_eager, "rows": rows}))


if __name__ == "__main__":
    main()
