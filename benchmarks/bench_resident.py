"""Resident GPU fast path (issue 11): whole-engine decode and prefill on real shapes with random weights, each
against a roofline computed in the same run, as gpt-fast reports them.

Rooflines: decode = read bandwidth (a bf16 sum over 4 GiB, measured here) / (weight bytes a step reads +
KV bytes the batch's contexts read); prefill = bf16 matmul rate (8192^3, measured here) / FLOPs per token
(2 x the matmul parameters + causal attention). Every prompt is fresh (a repeated prompt would hit the
prefix cache). Decode tok/s = batch x steps / (time(prefill + steps) - time(prefill + 1)).

Cases (`--cases`, in this order by default):
  llama8b-b1, llama8b-b64      Llama-3-8B shape decode at batch 1 / 64, 512-token prompts
  llama8b-prefill2k            one 2048-token prompt, time to its first token
  mixtral8l-b1                 Mixtral shape, 8 layers, all resident, batch 1 (active-weight roofline)
  llama8b-16k-b16              batch 16 at a 16k context (KV reads dominate)
  yuanm32-b1                   Yuan2.0-M32 shape (24 layers, 32 experts top-2, LF filter state), batch 1, graphed
                               and eager (`enforce_eager`, the baseline: transformers has no Yuan), active-weight
                               roofline
  --hf                         adds transformers' eager decode at batch 1 for the Llama and Mixtral cases
  --plain-ops                  the small per-layer ops as torch's kernel chains (`layers/fused_ops.py`, the KV write
                               and align kernels off)
  --vs-plain-ops               then the same cases with --plain-ops (a subprocess): the fused ops' gain, same run

    PYTHONPATH=. python benchmarks/bench_resident.py [--cases ...] [--hf] [--out FILE]

Rows: {"model", "case", "ferry_tok_s", "hf_tok_s", "roofline_tok_s", "pct_roofline", "gb_s" | "tflops"}
(yuanm32-b1 adds "eager_tok_s", "eager_pct_roofline" and "graphed").
Ends with one JSON line, also written to `--out` (default benchmarks/results/resident-<date>.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import time

import torch

from results import write_results  # benchmarks/results.py (scripts run as python benchmarks/x.py)

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 32768,
             "tie_word_embeddings": False}
MIXTRAL_8L = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
              "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
              "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 8, "rms_norm_eps": 1e-5,
              "rope_theta": 1e6, "max_position_embeddings": 32768, "tie_word_embeddings": False}


def read_gb_s() -> float:
    a = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda")  # 4 GiB
    a.fill_(1)
    a.sum()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a.sum()
    torch.cuda.synchronize()
    return 10 * a.numel() * 2 / (time.perf_counter() - t) / 1e9


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    return 20 * 2 * 8192 ** 3 / (time.perf_counter() - t) / 1e12


def shape_bytes(cfg: dict) -> dict:
    """Bytes (bf16) a decode step reads per token of weights, and KV bytes per cached token."""
    H, I, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd = H // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"]
    attn = H * (cfg["num_attention_heads"] * hd + 2 * kv * hd) + cfg["num_attention_heads"] * hd * H
    mlp = 3 * H * I * cfg.get("num_experts_per_tok", 1)  # active experts only
    matmul = L * (attn + mlp) + V * H  # the lm_head; the embedding reads one row a token
    return {"weights": 2 * matmul, "matmul_params": matmul, "kv_per_token": 2 * L * 2 * kv * hd,
            "attn_flops_per_ctx": 4 * L * cfg["num_attention_heads"] * hd}


def prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for _ in range(n)]


def timed_generate(llm, ps, n: int) -> float:
    from ferrylm import SamplingParams

    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(ps, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    torch.cuda.synchronize()
    return time.perf_counter() - t


def decode_rate(llm, batch: int, prompt_len: int, steps: int, vocab: int, seed: int) -> float:
    # warm-up as long as the timed run: every (batch, context) graph bucket it reaches is captured before
    timed_generate(llm, prompts(batch, prompt_len, seed + 100, vocab), steps + 1)
    t1 = timed_generate(llm, prompts(batch, prompt_len, seed, vocab), 1)
    tn = timed_generate(llm, prompts(batch, prompt_len, seed + 1, vocab), steps + 1)
    return batch * steps / (tn - t1)


def hf_decode(cfg: dict, steps: int = 32) -> float | None:
    """transformers eager batch-1 decode of the same shape, in its own process (its memory goes with it)."""
    import transformers

    cls = {"llama": "LlamaConfig", "mixtral": "MixtralConfig"}[cfg["model_type"]]
    code = f"""
import torch, time, transformers
cfg = transformers.{cls}(**{ {k: v for k, v in cfg.items() if k not in ('architectures', 'model_type')} !r})
torch.set_default_dtype(torch.bfloat16)
with torch.device('cuda'):
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
ids = torch.randint(10, 30000, (1, 32), device='cuda')
def run(n):
    torch.cuda.synchronize(); t = time.perf_counter()
    m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    torch.cuda.synchronize(); return time.perf_counter() - t
with torch.no_grad():
    run(4)
    print('HF', {steps} / (run({steps} + 1) - run(1)))
"""
    out = subprocess.run(["python", "-c", code], capture_output=True, text=True, timeout=400)
    got = [float(x.split()[1]) for x in out.stdout.splitlines() if x.startswith("HF ")]
    if not got:
        print(f"transformers {transformers.__version__} baseline failed:", out.stderr[-1500:], flush=True)
    return got[0] if got else None


def yuan_bytes(cfg: dict) -> dict:
    """`shape_bytes` for Yuan: the active parameters (router and the top-k experts of every layer; the tied
    lm_head reads the whole table), K/V per token, and each step's filter state read and written."""
    from ferrylm.plan import yuan_sizes

    active = yuan_sizes.param_counts(cfg).active
    return {"weights": 2 * active + 2 * yuan_sizes.lf_state_bytes(cfg), "kv_per_token": yuan_sizes.kv_bytes_per_token(cfg)}


def engine(cfg: dict, max_num_seqs: int, max_model_len: int, **kw):
    from ferrylm import LLM
    from ferrylm.weights.random_source import RandomSource

    return LLM(RandomSource(cfg), device="cuda", dtype="bfloat16", max_num_seqs=max_num_seqs,
               max_model_len=max_model_len, **kw)


def release() -> None:
    """After the caller's `del llm`: collect the dropped engine's cycles and give its memory back, so the next
    engine (which sizes its KV cache from the free memory) and the transformers subprocess find it free."""
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="llama8b-b1,llama8b-b64,llama8b-prefill2k,mixtral8l-b1,llama8b-16k-b16")
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plain-ops", action="store_true",
                    help="the small ops as torch's kernel chains (layers/fused_ops.py, the KV write and align kernels off)")
    ap.add_argument("--vs-plain-ops", action="store_true",
                    help="then the cases again with --plain-ops in a subprocess: rows gain plain_ops_tok_s, fused_vs_plain")
    a = ap.parse_args()
    if a.plain_ops:
        from ferrylm.kv import cache
        from ferrylm.layers import fused_ops

        fused_ops.ENABLED = cache.WRITE_KERNEL = False  # every one-launch form (the align kernel follows ENABLED)
    cases = a.cases.split(",")
    bw, mm = read_gb_s(), matmul_tflops()
    print(f"read {bw:.0f} GB/s, bf16 matmul {mm:.0f} TFLOP/s", flush=True)
    rows: list[dict] = []

    def decode_row(model, case, cfg, llm, batch, prompt_len, steps, hf=None, b=None, eager=None):
        b = b or shape_bytes(cfg)
        ctx = prompt_len + steps / 2  # mean context over the timed steps
        step_bytes = b["weights"] + batch * ctx * b["kv_per_token"]
        r = decode_rate(llm, batch, prompt_len, steps, cfg["vocab_size"], seed=batch * 13 + prompt_len)
        roof = batch * bw * 1e9 / step_bytes
        row = {"model": model, "case": case, "ferry_tok_s": r, "hf_tok_s": hf, "roofline_tok_s": roof,
               "pct_roofline": 100 * r / roof, "gb_s": r / batch * step_bytes / 1e9}
        if eager is not None:  # the same engine without graphs, measured in this run
            row.update(eager_tok_s=eager, eager_pct_roofline=100 * eager / roof,
                       graphed=llm.engine.runner.graphs is not None)
        rows.append(row)
        print(json.dumps(row), flush=True)

    llama = [c for c in cases if c.startswith("llama8b") and "16k" not in c]
    if llama:
        hf = hf_decode(LLAMA3_8B) if a.hf else None  # first: the engine below takes most of the memory
        llm = engine(LLAMA3_8B, 64, 4096)
        for c in llama:
            if c == "llama8b-b1":
                decode_row("llama-3-8b", c, LLAMA3_8B, llm, 1, 512, 128, hf)
            elif c == "llama8b-b64":
                decode_row("llama-3-8b", c, LLAMA3_8B, llm, 64, 512, 64)
            elif c == "llama8b-prefill2k":
                b = shape_bytes(LLAMA3_8B)
                T = 2048
                timed_generate(llm, prompts(1, T, 7, LLAMA3_8B["vocab_size"]), 1)  # warm-up, its own prompt
                dt = min(timed_generate(llm, prompts(1, T, 8 + i, LLAMA3_8B["vocab_size"]), 1) for i in range(3))
                flops = 2 * b["matmul_params"] * T + b["attn_flops_per_ctx"] * T * T / 2
                row = {"model": "llama-3-8b", "case": c, "ferry_tok_s": T / dt, "hf_tok_s": None,
                       "roofline_tok_s": T * mm * 1e12 / flops, "tflops": flops / dt / 1e12}
                row["pct_roofline"] = 100 * row["ferry_tok_s"] / row["roofline_tok_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
        llm.close()  # its memory and threads, now
        del llm
        release()
    if "mixtral8l-b1" in cases:
        hf = hf_decode(MIXTRAL_8L) if a.hf else None
        llm = engine(MIXTRAL_8L, 16, 2048)
        decode_row("mixtral-8L", "mixtral8l-b1", MIXTRAL_8L, llm, 1, 128, 128, hf)
        llm.close()  # its memory and threads, now
        del llm
        release()
    if "llama8b-16k-b16" in cases:
        llm = engine(LLAMA3_8B, 16, 16384 + 128)
        decode_row("llama-3-8b", "llama8b-16k-b16", LLAMA3_8B, llm, 16, 16384, 32)
        llm.close()  # its memory and threads, now
        del llm
        release()
    if "yuanm32-b1" in cases:
        from ferrylm.plan.yuan_sizes import YUAN2_M32

        llm = engine(YUAN2_M32, 4, 1024, enforce_eager=True)  # the baseline first: one 80 GB engine at a time
        eager = decode_rate(llm, 1, 128, 128, YUAN2_M32["vocab_size"], seed=13 + 128)
        print(f"yuan2-m32 eager batch-1 decode: {eager:.1f} tok/s", flush=True)
        llm.close()  # its memory and threads, now
        del llm  # gone before the next engine sizes its KV cache from the free memory
        release()
        llm = engine(YUAN2_M32, 4, 1024)
        decode_row("yuan2-m32", "yuanm32-b1", YUAN2_M32, llm, 1, 128, 128, b=yuan_bytes(YUAN2_M32), eager=eager)
        llm.close()  # its memory and threads, now
        del llm
        release()
    if a.vs_plain_ops:  # the same cases with the fused ops off, in a process of its own (after this one's engines)
        import os
        import sys
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            tmp = os.path.join(d, "plain.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--cases", a.cases, "--plain-ops", "--out", tmp],
                           check=True)
            with open(tmp) as f:
                plain = {r["case"]: r for r in json.load(f)["rows"]}
        for r in rows:
            p = plain.get(r["case"])
            if p:
                r.update(plain_ops_tok_s=p["ferry_tok_s"], fused_vs_plain=r["ferry_tok_s"] / p["ferry_tok_s"])
                print(f"{r['case']}: fused ops {r['ferry_tok_s']:.1f} tok/s vs plain {p['ferry_tok_s']:.1f} "
                      f"({r['fused_vs_plain']:.2f}x)", flush=True)
    write_results("resident", rows, out=a.out, read_gb_s=bw, matmul_tflops=mm, fused_ops=not a.plain_ops)


if __name__ == "__main__":
    main()
