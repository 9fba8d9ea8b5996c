"""`ferry bench` against GuideLLM on the same server and the same load: do the two tools agree?

For each case (synchronous: one request at a time; poisson: --requests open-loop arrivals at --rate;
concurrent: --requests through --concurrency streams, where throughput is the server's, not the arrivals')
and each round, runs GuideLLM and `ferry bench` one after the other (the order alternates per round, so a
drift of a shared machine hits both), with chat requests of --prompt-tokens tokens of content and
--output-tokens tokens out (ignore_eos in both). Compares TTFT (mean, median), inter-token time (GuideLLM's
ITL = (latency - TTFT) / (tokens - 1), weighted by tokens; ferry's TPOT, the same per request), request
latency (mean), and output tokens/s and requests/s (completed tokens or requests / the benchmark's
duration: GuideLLM's `duration`, ferry's first send to last end), and the CPU seconds each tool itself used.
Prints a table of ferry / GuideLLM per
figure (median over rounds) and ends with one JSON line.

GuideLLM needs torch and is not a ferrylm dependency: install it where it does not touch the project's
environment, e.g. `pip install --target /tmp/gl --no-deps guidellm` plus its dependencies other than torch
and transformers, and pass --guidellm-path /tmp/gl. It also needs an HF tokenizer directory
(--tokenizer); by default the embedded model's GGUF tokenizer is exported to a temporary one.

    python benchmarks/bench_vs_guidellm.py --url http://127.0.0.1:8000 --guidellm-path /tmp/gl \
        [--rounds 2] [--rate 0.25] [--requests 16] [--sync-requests 10] [--prompt-tokens 128] [--output-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile


def export_tokenizer(folder: str) -> str:
    from ferrylm.default_model import default_model_path
    from ferrylm.weights.convert import export_gguf_tokenizer

    for name, data in export_gguf_tokenizer(default_model_path()).items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    return folder


def run_guidellm(a, case: str, out: str) -> dict:
    profile = {"sync": "kind=synchronous", "poisson": f"kind=poisson,rate={a.rate}",
               "concurrent": f"kind=concurrent,streams={a.concurrency}"}[case]
    # a count, not a duration, bounds the poisson case too: GuideLLM's max_duration drops the requests still in
    # flight at the end while ferry drains them, which on a loaded server makes the two throughputs differ
    limit = f"kind=max_requests,count={a.sync_requests if case == 'sync' else a.requests}"
    cmd = [sys.executable, "-m", "guidellm", "run", "--backend", f"kind=openai_http,target={a.url}",
           "--profile", profile, "--constraint", limit,
           "--data", f"kind=synthetic_text,prompt_tokens={a.prompt_tokens},output_tokens={a.output_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={a.tokenizer}", "--output", f"kind=json,path={out}",
           "--disable-console"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [a.guidellm_path, os.environ.get("PYTHONPATH")]))}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with open(out) as f:
        b = json.load(f)["benchmarks"][0]
    m = b["metrics"]
    ok = lambda k: m[k]["successful"]  # noqa: E731
    return {"requests": ok("request_latency")["count"], "ttft_mean": ok("time_to_first_token_ms")["mean"] / 1000,
            "ttft_p50": ok("time_to_first_token_ms")["median"] / 1000, "itl_mean": ok("inter_token_latency_ms")["mean"] / 1000,
            "e2e_mean": ok("request_latency")["mean"], "prompt_tokens_mean": ok("prompt_token_count")["mean"],
            "output_tok_s": ok("output_token_count")["total_sum"] / b["duration"],
            "req_s": ok("request_latency")["count"] / b["duration"]}


def run_ferry(a, case: str, out: str) -> dict:
    level = {"sync": ["latency", "-n", str(a.sync_requests)],
             "poisson": ["load", "--rate", str(a.rate), "-n", str(a.requests), "--max-concurrency", "256"],
             # all arrivals at once under a cap of C: each end lets the next one in, as C closed-loop streams do
             "concurrent": ["load", "--rate", "inf", "-n", str(a.requests), "--max-concurrency", str(a.concurrency)],
             }[case]
    cmd = [sys.executable, "-m", "ferrylm.cli", "bench", *level, "--url", a.url, "--api", "chat",
           "--prompt-tokens", str(a.prompt_tokens), "--max-tokens", str(a.output_tokens), "--warmup", "0",
           "--seed", str(a.seed), "--out", out, "--no-progress"]
    p = subprocess.run(cmd, check=True, capture_output=True, text=True)
    r = json.loads(p.stdout.strip().splitlines()[-1])["results"]
    return {"requests": r["requests"]["ok"], "ttft_mean": r["ttft"]["mean"], "ttft_p50": r["ttft"]["p50"],
            "itl_mean": r["tpot"]["mean"], "e2e_mean": r["e2e"]["mean"],
            "prompt_tokens_mean": r["prompt_tokens"] / max(r["requests"]["ok"], 1),
            "output_tok_s": r["output_tok_s"], "req_s": r["request_throughput"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--guidellm-path", default=None, help="folder holding the guidellm package, if not installed")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer dir for GuideLLM (default: the embedded model's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", nargs="+", default=["sync", "poisson", "concurrent"],
                    choices=["sync", "poisson", "concurrent"])
    ap.add_argument("--concurrency", type=int, default=4, help="streams of the concurrent case")
    ap.add_argument("--rate", type=float, default=0.25)
    ap.add_argument("--requests", type=int, default=20, help="requests of the poisson case")
    ap.add_argument("--sync-requests", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="vs-guidellm-")
    a.tokenizer = a.tokenizer or export_tokenizer(tmp)
    runs: dict = {c: {"guidellm": [], "ferry": []} for c in a.cases}
    for k in range(a.rounds):
        for case in a.cases:
            order = ("guidellm", "ferry") if k % 2 == 0 else ("ferry", "guidellm")
            for tool in order:
                out = os.path.join(tmp, f"{case}-{tool}-{k}")
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                res = run_guidellm(a, case, out + ".json") if tool == "guidellm" else run_ferry(a, case, out)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                # the tool's own CPU time: on a small CPU box it competes with the server it measures
                res["tool_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
                runs[case][tool].append(res)
                print(f"round {k} {case:8s} {tool:8s} " + " ".join(f"{n}={v:.4g}" for n, v in res.items()),
                      file=sys.stderr)
    figures = ("ttft_mean", "ttft_p50", "itl_mean", "e2e_mean", "output_tok_s", "req_s", "prompt_tokens_mean",
               "tool_cpu_s")
    result = {}
    print(f"\n{'case':8s} {'figure':18s} {'GuideLLM':>10s} {'ferry':>10s} {'ferry/GuideLLM':>15s}")
    for case in a.cases:
        result[case] = {}
        for f in figures:
            g = statistics.median(r[f] for r in runs[case]["guidellm"])
            m = statistics.median(r[f] for r in runs[case]["ferry"])
            result[case][f] = {"guidellm": g, "ferry": m, "ratio": m / g if g else None}
            print(f"{case:8s} {f:18s} {g:10.4g} {m:10.4g} {m / g if g else float('nan'):15.3f}")
    print(json.dumps({"bench": "vs_guidellm", "rounds": a.rounds, "rate": a.rate, "requests": a.requests, "concurrency": a.concurrency,
                      "sync_requests": a.sync_requests, "prompt_tokens": a.prompt_tokens,
                      "output_tokens": a.output_tokens, "cases": result, "runs": runs}))


if __name__ == "__main__":
    main()
