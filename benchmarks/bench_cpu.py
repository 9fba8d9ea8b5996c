"""The embedded default on the CPU: ferrylm's paths against transformers bf16 and llama.cpp, all in one
run, plus a profile of one decode step.

Model: the embedded SmolLM2-135M-Instruct Q4_1 GGUF. ferrylm paths:
  - `quant`: the default (weights stay packed, CPU int4/bf16 kernels, fp32 residual stream)
  - `quant-bf16`: `--dtype bfloat16` (the same kernels, bf16 everywhere)
  - `fp32-dequant`: `--dequantize` (weights dequantized to fp32 at load: the path before the kernels)
Cases: `decode`: batch-1 greedy decode of `--decode-tokens` after a chat prompt (prefill timed apart and
taken out); `pp500`: prompt processing of a 500-token prompt (no prefix cache). llama.cpp runs the same GGUF
on the same token ids and thread count in a worker process (benchmarks/llamacpp_worker.py) started with
the python of its own venv (`--llamacpp-python`, e.g. /work/venv-llamacpp/bin/python with
llama-cpp-python==0.3.36; never ferrylm's venv). Every repeat measures each engine once, in turn (the
machine is shared: neighbours drift), and the rows report medians over the repeats. The decode-step profile
splits a step's wall time into matmul kernels, attention ops, other torch ops and the rest (Python and
dispatch), from torch.profiler self times.
Writes benchmarks/results/cpu-<date>.json; the last line printed is JSON.

    python benchmarks/bench_cpu.py [--threads 2] [--decode-tokens 64] [--repeats 5] [--skip-hf]
        [--llamacpp-python /work/venv-llamacpp/bin/python]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from ferrylm import LLM, SamplingParams
from ferrylm.default_model import default_model_path
from prompts import QUESTIONS  # benchmarks/prompts.py (scripts run from the repo root)

PATHS = {"quant": {}, "quant-bf16": {"dtype": "bfloat16"}, "fp32-dequant": {"dequantize": True}}
MATMUL = ("aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "aten::mm", "aten::addmm", "aten::bmm")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::index_select", "aten::index_copy_")


def long_prompt(tok, n: int) -> list[int]:
    ids: list[int] = []
    i = 0
    while len(ids) < n:
        ids += tok.encode(QUESTIONS[i % len(QUESTIONS)] + " ", add_special_tokens=False)
        i += 1
    return ids[:n]


def ferry_decode(llm: LLM, prompt: list[int], n: int) -> float:
    """Decode tokens/s: time(1 + n tokens) - time(1 token) removes the prefill."""
    def run(k):
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))
        return time.perf_counter() - t
    return n / (run(1 + n) - run(1))


def ferry_pp(llm: LLM, prompt: list[int]) -> float:
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return len(prompt) / (time.perf_counter() - t)


def profile_decode(llm: LLM, prompt: list[int], steps: int = 16) -> dict:
    from torch.profiler import ProfilerActivity, profile

    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))  # warm
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    prefill = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1 + steps, ignore_eos=True))
        wall = time.perf_counter() - t0 - prefill
    split = {"matmul": 0.0, "attention": 0.0, "other_ops": 0.0}
    total_ops = 0.0
    top = []
    for ev in prof.key_averages():
        us = ev.self_cpu_time_total
        if ev.key in MATMUL:
            split["matmul"] += us
        elif ev.key in ATTENTION:
            split["attention"] += us
        else:
            split["other_ops"] += us
        total_ops += us
        top.append((us, ev.key, ev.count))
    # ops of the prefill step are in the totals too: scale every share to the decode steps' share of time
    scale = wall / max(wall + prefill, 1e-9)
    ms = {k: v * scale / 1e3 / steps for k, v in split.items()}
    ms["python_and_dispatch"] = max(wall * 1e3 / steps - sum(ms.values()), 0.0)
    ms["step_wall"] = wall * 1e3 / steps
    top.sort(reverse=True)
    ms["top_ops"] = [{"op": k, "ms_per_step": u * scale / 1e3 / steps, "calls_per_step": c / (steps + 1)}
                     for u, k, c in top[:8]]
    return ms


def hf_decode(model, prompt: list[int], n: int) -> float:
    ids = torch.tensor([prompt])

    def run(k):
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - t
    return n / (run(1 + n) - run(1))


def hf_pp(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    t = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids)
    return len(prompt) / (time.perf_counter() - t)


class LlamaCpp:
    """benchmarks/llamacpp_worker.py in a process of its own venv's python; one measurement per `measure`."""

    def __init__(self, python: str, threads: int):
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_worker.py")
        self.proc = subprocess.Popen([python, worker, default_model_path(), "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.version = json.loads(self.proc.stdout.readline())["version"]

    def measure(self, prompt: list[int], long: list[int], n: int) -> tuple[float, float]:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "long": long, "decode_tokens": n}) + "\n")
        self.proc.stdin.flush()
        r = json.loads(self.proc.stdout.readline())
        return r["decode_tok_s"], r["pp_tok_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--pp-tokens", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--llamacpp-python", default=None,
                    help="python of a venv with llama-cpp-python (llama.cpp baseline; skipped without it)")
    ap.add_argument("--paths", nargs="*", default=list(PATHS))
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/cpu-<date>.json)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()

    llms = {p: LLM(max_num_seqs=1, enable_prefix_caching=False, max_model_len=1024, **PATHS[p]) for p in a.paths}
    tok = next(iter(llms.values())).tokenizer
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}]), add_special_tokens=False)
    long = long_prompt(tok, a.pp_tokens)

    hf = None
    if not a.skip_hf:
        from transformers import AutoModelForCausalLM

        path = default_model_path()
        kw = {}
        try:  # transformers >= 5 can keep GGUF blocks packed with hub kernels; the baseline is the dense bf16 model
            from transformers import GgufConfig

            kw["quantization_config"] = GgufConfig(gguf_file=os.path.basename(path), dequantize=True)
        except ImportError:
            pass
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=torch.bfloat16, **kw).eval()
    for llm in llms.values():  # warm-up
        ferry_decode(llm, chat, 4)
    if hf is not None:
        hf_decode(hf, chat, 4)
    lc = LlamaCpp(a.llamacpp_python, threads) if a.llamacpp_python else None
    if lc is not None:
        lc.measure(chat, long, 4)  # warm-up

    rates: dict[str, list[float]] = {}
    for _ in range(a.repeats):  # alternate the engines: neighbours on a shared machine drift
        for p, llm in llms.items():
            rates.setdefault(f"decode:{p}", []).append(ferry_decode(llm, chat, a.decode_tokens))
            rates.setdefault(f"pp{a.pp_tokens}:{p}", []).append(ferry_pp(llm, long))
        if hf is not None:
            rates.setdefault("decode:hf", []).append(hf_decode(hf, chat, a.decode_tokens))
            rates.setdefault(f"pp{a.pp_tokens}:hf", []).append(hf_pp(hf, long))
        if lc is not None:
            dec, pp = lc.measure(chat, long, a.decode_tokens)
            rates.setdefault("decode:llamacpp", []).append(dec)
            rates.setdefault(f"pp{a.pp_tokens}:llamacpp", []).append(pp)
    if lc is not None:
        lc.close()
    med = {k: statistics.median(v) for k, v in rates.items()}

    rows = []
    for case in ("decode", f"pp{a.pp_tokens}"):
        for p in llms:
            row = {"case": f"{case}:{p}", "ferry_tok_s": med[f"{case}:{p}"],
                   "hf_bf16_tok_s": med.get(f"{case}:hf"), "llamacpp_tok_s": med.get(f"{case}:llamacpp")}
            if row["hf_bf16_tok_s"]:
                row["vs_hf_bf16"] = row["ferry_tok_s"] / row["hf_bf16_tok_s"]
            if row["llamacpp_tok_s"]:
                row["vs_llamacpp"] = row["ferry_tok_s"] / row["llamacpp_tok_s"]
            rows.append(row)
            print(" | ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    profiles = {p: profile_decode(llm, chat) for p, llm in llms.items()}
    for p, prof in profiles.items():
        print(f"decode step {p}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in prof.items() if isinstance(v, float)))
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        commit = None
    result = {"bench": "cpu", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "commit": commit, "command": " ".join(["python", *sys.argv]),
              "model": "smollm2-135m-q4_1-gguf", "threads": threads, "load_avg_1m": load,
              "llamacpp_version": lc.version if lc is not None else None,
              "decode_tokens": a.decode_tokens, "pp_tokens": a.pp_tokens, "repeats": a.repeats,
              "rows": rows, "samples_tok_s": rates, "decode_profile_ms": profiles}
    out = a.out or os.path.join(os.path.dirname(__file__), "results",
                                f"cpu-{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
