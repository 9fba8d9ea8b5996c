"""Expert-shaped CPU kernels for the hybrid (CPU experts) path: one gated-MLP expert, gate_up -> silu * up ->
down, per weight format and token count, as GB/s of weight bytes read, against this machine's measured
memory read bandwidth (a plain multi-threaded sum over a buffer larger than the caches), alone and (with
`--h2d`, on a CUDA host) beside a running pinned host -> GPU copy.

Each expert is a `layers/cpu_experts.HostExpert` (the host expert kernel the hybrid path calls). Formats:
bf16 (oneDNN `F.linear`), int8 per channel (`_weight_int8pack_mm`), int4 group 32 / 128
(`_weight_int4pack_mm_for_cpu`), the kernels `layers/qmatmul.py` picks. Each format cycles over `--experts`
distinct experts so the reads come from DRAM, not the last-level cache.

    python benchmarks/bench_cpu_experts.py [--threads 16] [--shapes mixtral qwen3-30b] [--tokens 1 4 16]
        [--formats bf16 int8 int4-g32 int4-g128] [--experts 4] [--h2d] [--out FILE]

The last line printed is JSON (rows: shape, format, tokens, ms (per expert call), gb_s, of_read_bw, h2d).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import threading
import time

import torch

from ferrylm.layers.cpu_experts import HostExpert

SHAPES = {  # (hidden, expert intermediate)
    "mixtral": (4096, 14336),
    "qwen3-30b": (2048, 768),
    "qwen3-235b": (4096, 1536),
}


def read_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """GB/s of a plain multi-threaded read (sum of a float32 buffer of `gib` GiB)."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best / 1e9


def make_expert(fmt: str, hidden: int, inter: int, seed: int):
    """-> (the expert as `layers/cpu_experts.HostExpert`, bytes of weights it reads per call)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(2 * inter, hidden, generator=g) * 0.02  # [2I, H]
    w2 = torch.randn(hidden, inter, generator=g) * 0.02  # [H, I]
    name, _, gs = fmt.partition("-g")
    expert = HostExpert.quantize(w13, w2, name, group_size=int(gs or 32))
    return expert, expert.nbytes


class H2DCopy:
    """A background thread copying a pinned host buffer to the GPU in a loop (what the offload engine does)."""

    def __init__(self, mib: int = 512):
        self.src = torch.empty(mib << 20, dtype=torch.uint8).pin_memory()
        self.dst = torch.empty_like(self.src, device="cuda")
        self.stream = torch.cuda.Stream()
        self.stop = threading.Event()
        self.copied = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                self.dst.copy_(self.src, non_blocking=True)
                self.stream.synchronize()
                self.copied += self.src.nbytes

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.gb_s = self.copied / (time.perf_counter() - self.t0) / 1e9


def bench(run_experts, x, reps: int) -> float:
    for r in run_experts:
        r(x)
    t = time.perf_counter()
    for i in range(reps):
        run_experts[i % len(run_experts)](x)
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shapes", nargs="+", default=["mixtral", "qwen3-30b"], choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--formats", nargs="+", default=["bf16", "int8", "int4-g32", "int4-g128"])
    ap.add_argument("--experts", type=int, default=4, help="distinct experts cycled per format (defeats the cache)")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--h2d", action="store_true", help="also measure beside a running pinned H2D copy (CUDA)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    h2d = a.h2d and torch.cuda.is_available()
    bw = read_bandwidth()
    print(f"plain read: {bw:.1f} GB/s with {torch.get_num_threads()} threads", flush=True)
    bw_h2d = None
    if h2d:
        with H2DCopy() as cp:
            bw_h2d = read_bandwidth()
        print(f"plain read beside an H2D copy: {bw_h2d:.1f} GB/s (copy ran at {cp.gb_s:.1f} GB/s)", flush=True)
    rows = []
    torch.set_grad_enabled(False)
    for shape in a.shapes:
        hidden, inter = SHAPES[shape]
        for fmt in a.formats:
            experts = [make_expert(fmt, hidden, inter, seed) for seed in range(a.experts)]
            runs, nbytes = [e[0] for e in experts], experts[0][1]
            for t in a.tokens:
                x = torch.randn(t, hidden).bfloat16()
                for beside in ([False, True] if h2d else [False]):
                    if beside:
                        with H2DCopy() as cp:
                            sec = bench(runs, x, a.reps)
                    else:
                        sec = bench(runs, x, a.reps)
                    gb_s = nbytes / sec / 1e9
                    row = {"shape": shape, "format": fmt, "tokens": t, "ms": sec * 1e3, "gb_s": gb_s,
                           "of_read_bw": gb_s / ((bw_h2d if beside else bw) or bw), "h2d": beside}
                    if beside:
                        row["h2d_copy_gb_s"] = cp.gb_s
                    rows.append(row)
                    print(" | ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                          flush=True)
            del experts, runs
    result = {"bench": "cpu_experts", "host": platform.node(), "threads": torch.get_num_threads(),
              "read_bw_gb_s": bw, "read_bw_beside_h2d_gb_s": bw_h2d, "rows": rows}
    out = a.out or os.path.join(os.path.dirname(__file__), "results",
                                f"cpu-experts-{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
