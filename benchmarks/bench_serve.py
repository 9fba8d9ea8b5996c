"""`ferry serve` under N concurrent streaming clients, against offline `LLM.generate` in the same run.

Starts a server on 127.0.0.1 (or uses --url), then for each concurrency C runs C closed-loop clients that
stream `/v1/completions` (greedy, ignore_eos, fixed max_tokens, token-id prompts) until C * --rounds
prompts are done, and reports TTFT / ITL / E2E percentiles and output tokens/s. The baseline is offline
`LLM.generate` on the prompts of the largest concurrency, with max_num_seqs equal to that concurrency, in
this process while the server sits idle; --repeat alternates baseline and server runs to average out a
shared machine. The figure to read is server tokens/s at the largest C over offline tokens/s (aim: >= 0.85).
The last line printed is JSON.

    python benchmarks/bench_serve.py [--num-prompts 64] [--max-tokens 64] [--concurrency 1 4 16] [--repeat 1]
                                     [--threads N] [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from ferrylm import LLM, SamplingParams
from prompts import QUESTIONS  # benchmarks/prompts.py



def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w+", prefix="bench-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "ferrylm.server.cli", "--port", str(port),
           "--max-num-seqs", str(max(args.concurrency)), "--max-model-len", str(args.max_model_len),
           "--disable-access-log", "--device", args.device, "--dtype", args.dtype]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}: see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log.name
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    sys.exit(f"server not healthy after 300 s: see {log.name}")


async def one_request(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, tokens = [], 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                times.append(time.perf_counter())
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft": times[0] - t0, "e2e": times[-1] - t0, "itl": [b - a for a, b in zip(times, times[1:])],
            "tokens": tokens}


async def run_clients(url: str, prompts: list[list[int]], concurrency: int,
                      max_tokens: int) -> tuple[list[dict], float]:
    todo = list(enumerate(prompts))
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 4)

    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        async def worker():
            while todo:
                _, p = todo.pop(0)
                results.append(await one_request(client, p, max_tokens))

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t


def summarize(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in results]
    e2e = [r["e2e"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "output_tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
            **{f"ttft_p{q}": pct(ttft, q) for q in (50, 90, 99)}, **{f"itl_p{q}": pct(itl, q) for q in (50, 90, 99)},
            **{f"e2e_p{q}": pct(e2e, q) for q in (50, 90, 99)}}


def offline_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": len(prompts), "output_tokens": tokens, "seconds": wall, "tok_s": tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=4,
                    help="prompts per client at each concurrency (capped at --num-prompts)")
    ap.add_argument("--repeat", type=int, default=1, help="alternate offline / largest-C server runs this many times")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads on both sides (0: torch's default); 1 on a small shared machine")
    ap.add_argument("--url", default=None, help="use a running server instead of starting one")
    a = ap.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    cmax = max(a.concurrency)

    llm = LLM(device=a.device, dtype=a.dtype, max_num_seqs=cmax, max_model_len=a.max_model_len)
    tok = llm.tokenizer
    questions = [f"{QUESTIONS[i % len(QUESTIONS)]} ({i})" for i in range(a.num_prompts)]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in questions]
    proc, url, log = (None, a.url, None) if a.url else start_server(a)
    try:
        # warm both sides up (first-call costs) on prompts outside the measured set
        llm.generate([prompts[0][:-3]] * 2, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        asyncio.run(run_clients(url, [prompts[0][:-3]] * 2, 2, 4))

        n_for = {c: min(a.num_prompts, c * a.rounds) for c in a.concurrency}
        base_prompts = prompts[:n_for[cmax]]
        offline, server_max = [], []
        results = {}
        for c in sorted(a.concurrency):
            if c == cmax:
                for _ in range(a.repeat):
                    offline.append(offline_run(llm, base_prompts, a.max_tokens))
                    server_max.append(summarize(*asyncio.run(run_clients(url, base_prompts, c, a.max_tokens))))
                results[c] = server_max[-1] if a.repeat == 1 else {
                    **server_max[-1], "tok_s": statistics.median(r["tok_s"] for r in server_max)}
            else:
                results[c] = summarize(*asyncio.run(run_clients(url, prompts[:n_for[c]], c, a.max_tokens)))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(60)
            if rc != 0:
                print(f"server exited with {rc}: see {log}", file=sys.stderr)
            else:
                os.unlink(log)

    off = statistics.median(r["tok_s"] for r in offline)
    ms = 1000.0
    print(f"\nferry serve vs offline LLM.generate: {a.max_tokens} output tokens per request, greedy, ignore_eos, "
          f"device {a.device}, threads {a.threads or 'default'}")
    print(f"{'clients':>7} {'reqs':>5} {'tok/s':>8}   {'TTFT p50/p90/p99 ms':<22} {'ITL p50/p90/p99 ms':<22} "
          f"{'E2E p50/p90/p99 s':<20}")
    for c in sorted(results):
        r = results[c]
        ttft = "/".join(f"{r[f'ttft_p{q}'] * ms:.0f}" for q in (50, 90, 99))
        itl = "/".join(f"{r[f'itl_p{q}'] * ms:.0f}" for q in (50, 90, 99))
        e2e = "/".join(f"{r[f'e2e_p{q}']:.2f}" for q in (50, 90, 99))
        print(f"{c:>7} {r['requests']:>5} {r['tok_s']:>8.1f}   {ttft:<22} {itl:<22} {e2e:<20}")
    ratio = results[cmax]["tok_s"] / off
    print(f"offline LLM.generate, {len(base_prompts)} prompts, max_num_seqs {cmax}: {off:.1f} tok/s "
          f"(runs: {', '.join('%.1f' % r['tok_s'] for r in offline)})")
    print(f"server at {cmax} clients / offline: {ratio:.2f} (aim >= 0.85)"
          + (f"  (server runs: {', '.join('%.1f' % r['tok_s'] for r in server_max)})" if a.repeat > 1 else ""))
    print(json.dumps({"bench": "serve", "max_tokens": a.max_tokens, "device": a.device, "threads": a.threads,
                      "offline_tok_s": round(off, 2), "offline_runs_tok_s": [round(r["tok_s"], 2) for r in offline],
                      "server_runs_tok_s": [round(r["tok_s"], 2) for r in server_max],
                      "server_over_offline": round(ratio, 3),
                      "concurrency": {str(c): {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                                      for c, r in sorted(results.items())}}))


if __name__ == "__main__":
    main()
