"""Host cost of one decode step, split by phase, with async scheduling off and on, and the code at a
baseline git ref (default `main`) measured in the same run.

A random-weight Llama (`weights/random_source.py`: no checkpoint on disk) at batch B decodes `--steps`
steps after its prompts are prefilled; the figure is wall microseconds per step, and the host time of each
phase of `LLMEngine.step()`:
  schedule    scheduler.schedule()
  prepare     building the step's input tensors (ModelRunner: describe + the one host -> device copy)
  forward     queueing the forward pass (on the CPU: running it; on CUDA: a graph replay or eager launches)
  sample      queueing the sampler and the copy of the sampled ids to the host
  wait        waiting for those ids (the device's time the host did not hide)
  postprocess appending tokens, stop checks, detokenizing, building outputs
With a tiny model (`--shape tiny`: 2 layers, hidden 64, vocab 512) the forward is negligible on CUDA and
the step time is the host overhead (on the CPU the eager forward is itself host work and dominates).
`host_us` sums every phase but forward and wait. The baseline ref runs on a `git archive` of that ref; it
has no phase timers, so its phases come from wrapping scheduler.schedule, runner.describe + tensors
(prepare), runner.execute (prepare + forward) and the sampler (sample + wait: on CUDA its `.tolist()` waits
for the device, so read the baseline's us/step there, its host_us on the CPU); the rest is postprocess.
Every implementation runs in its own subprocess, interleaved over `--rounds` rounds, and the best round
counts (a shared machine's noise only ever adds time).

    python benchmarks/bench_step_overhead.py --device cpu --shape tiny --batches 1 64
    python benchmarks/bench_step_overhead.py --device cuda --shape tiny --batches 1 64
    python benchmarks/bench_step_overhead.py --device cuda --shape llama-8b --batches 1 64 --rounds 2
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tarfile
import tempfile
import time

import torch

SHAPES = {  # random-weight stand-ins (speed does not depend on the values; ignore_eos fixes the lengths)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
}
PHASES = ("schedule", "prepare", "forward", "sample", "wait", "postprocess")


def model_source(shape: str, device: str):
    """Seeded random weights of the shape (`weights/random_source.py`): no checkpoint on disk, an 8B in seconds."""
    from ferrylm.weights.random_source import RandomSource

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "max_position_embeddings": 4096, "tie_word_embeddings": False, **SHAPES[shape]}
    return RandomSource(cfg, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32)


def _wrap(obj, name: str, phase: str, acc: dict) -> None:
    fn = getattr(obj, name)

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[phase] = acc.get(phase, 0.0) + time.perf_counter() - t

    setattr(obj, name, timed)


class _TimedSampler:
    def __init__(self, inner, acc: dict):
        self._inner, self._acc = inner, acc

    def __call__(self, *a):
        t = time.perf_counter()
        try:
            return self._inner(*a)
        finally:
            self._acc["sample+wait"] = self._acc.get("sample+wait", 0.0) + time.perf_counter() - t

    def __getattr__(self, name):
        return getattr(self._inner, name)


def measure(args, impl: str, batch: int) -> dict:
    from ferrylm import LLM, SamplingParams

    kw = dict(device=args.device, max_num_seqs=max(args.batches), seed=0,
              max_model_len=args.prompt_len + args.warmup + args.steps + 16,
              max_num_batched_tokens=max(2048, max(args.batches) * args.prompt_len // 4))
    if args.dtype:
        kw["dtype"] = args.dtype
    if impl != "baseline":
        kw["async_scheduling"] = "on" if impl == "async" else "off"
    llm = LLM(model_source(args.shape, args.device), **kw)
    engine = llm.engine
    V = engine.model_config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=args.warmup + args.steps + 4, ignore_eos=True)
    best = None
    for rep in range(args.repeats):
        prompts = [[(rep * 7919 + i * 131 + j * 17) % (V - 1) + 1 for j in range(args.prompt_len)] for i in range(batch)]
        for p in prompts:
            engine.add_request(p, sp)
        while any(s.num_computed_tokens == 0 or s.is_prefill for s in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step()
        for _ in range(args.warmup):
            engine.step()
        acc: dict = {}
        if impl == "baseline":  # no phase timers in the old code: wrap its parts
            real_sampler = engine.sampler
            _wrap(engine.scheduler, "schedule", "schedule", acc)
            _wrap(engine.runner, "describe", "prepare", acc)
            _wrap(engine.runner, "tensors", "prepare", acc)
            _wrap(engine.runner, "execute", "forward", acc)
            engine.sampler = _TimedSampler(real_sampler, acc)
        else:
            engine.timings = acc
        prof = cProfile.Profile() if args.profile else None
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        if prof:
            prof.enable()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()  # a step still in flight (async) counts too
        wall = time.perf_counter() - t
        if prof:
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
            print(f"--- profile {impl} batch {batch}\n{s.getvalue()}", file=sys.stderr)
        if impl == "baseline":
            for obj, name in ((engine.scheduler, "schedule"), (engine.runner, "describe"), (engine.runner, "tensors"),
                              (engine.runner, "execute")):
                del obj.__dict__[name]
            engine.sampler = real_sampler
            acc["forward"] -= acc.get("prepare", 0.0)  # execute wraps describe + tensors
        else:
            engine.timings = None
        while engine.has_unfinished_requests():
            engine.step()
        engine.step()  # a step still in flight
        phases = {k: v / args.steps * 1e6 for k, v in acc.items()}
        phases["postprocess"] = wall / args.steps * 1e6 - sum(v for k, v in phases.items() if k != "postprocess")
        row = dict(impl=impl, batch=batch, us_per_step=round(wall / args.steps * 1e6, 1),
                   tok_s=round(batch * args.steps / wall, 1),
                   host_us=round(sum(v for k, v in phases.items() if k not in ("forward", "wait")), 1),
                   phases_us={k: round(v, 1) for k, v in phases.items()})
        if best is None or row["us_per_step"] < best["us_per_step"]:
            best = row
    engine.close()
    return best


def run_worker(args, impl: str, src: str | None) -> list[dict]:
    """This script's measurement of one implementation, in a subprocess (on the code in `src` if given)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--device", args.device, "--shape",
           args.shape, "--steps", str(args.steps), "--warmup", str(args.warmup), "--prompt-len", str(args.prompt_len),
           "--repeats", str(args.repeats), "--threads", str(args.threads), "--profile", str(args.profile),
           "--batches", *map(str, args.batches)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def baseline_source(ref: str) -> str | None:
    """A `git archive` of the ferrylm package at `ref`, in a temporary directory (None, said, without git)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tempfile.mkdtemp(prefix="ferry-baseline-")
    tar = subprocess.run(["git", "-C", repo, "archive", ref, "ferrylm"], capture_output=True)
    if tar.returncode != 0:
        print(f"no baseline: git archive {ref} failed ({tar.stderr.decode().strip()[:200]}); pass --baseline-src",
              file=sys.stderr)
        return None
    tarfile.open(fileobj=io.BytesIO(tar.stdout)).extractall(tmp, filter="data")
    return tmp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=136, help="136 + 8 + 100 tokens stay in one graph block bucket")
    ap.add_argument("--repeats", type=int, default=3, help="best of N")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: a shared box's fairest)")
    ap.add_argument("--impl", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    ap.add_argument("--baseline-ref", default="main", help="git ref measured as the baseline ('' skips it)")
    ap.add_argument("--baseline-src", default=None, help="a directory holding the baseline's ferrylm package "
                    "(instead of --baseline-ref, where there is no git)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every implementation; best counts")
    ap.add_argument("--profile", type=int, default=0, help="print the top N cProfile entries per run to stderr")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import logging

    logging.getLogger("ferrylm").setLevel(logging.ERROR)
    if args.worker:
        print(json.dumps([measure(args, args.worker, b) for b in args.batches]))
        return
    impls = [(impl, None) for impl in args.impl]
    src = args.baseline_src or (baseline_source(args.baseline_ref) if args.baseline_ref else None)
    if src is not None:
        impls.insert(0, ("baseline", src))
    best: dict = {}
    for _ in range(args.rounds):
        for impl, src in impls:
            for r in run_worker(args, impl, src):
                key = (r["impl"], r["batch"])
                if key not in best or r["us_per_step"] < best[key]["us_per_step"]:
                    best[key] = r
    rows = [best[(impl, b)] for b in args.batches for impl, _ in impls]
    for r in rows:
        print(f"{r['impl']:>8} batch {r['batch']:>3}: {r['us_per_step']:8.1f} us/step {r['tok_s']:9.1f} tok/s  "
              f"host {r['host_us']:7.1f} us  " + " ".join(f"{k}={v:.0f}" for k, v in r["phases_us"].items()),
              file=sys.stderr)
    summary = {}
    for b in args.batches:
        by = {r["impl"]: r for r in rows if r["batch"] == b}
        for impl in ("sync", "async"):
            if "baseline" in by and impl in by:
                summary[f"b{b}_{impl}_step_speedup"] = round(by["baseline"]["us_per_step"] / by[impl]["us_per_step"], 2)
                summary[f"b{b}_{impl}_host_speedup"] = round(by["baseline"]["host_us"] / by[impl]["host_us"], 2)
    print(json.dumps({"bench": "step_overhead", "device": args.device, "shape": args.shape,
                      "torch_threads": args.threads, "steps": args.steps, "rounds": args.rounds,
                      "baseline_ref": args.baseline_ref, "rows": rows, "speedup": summary}))


if __name__ == "__main__":
    main()
