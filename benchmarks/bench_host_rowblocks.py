"""Host expert time per format and host path (`offload/host_experts.HostExperts.expert(e)(x)`): the formats no qmatmul
CPU kernel reads (nf4, fp8 and group-wise int8 through `layers/cpu_experts.RowBlocks`) beside the ones it does
(int4, per-channel int8), Mixtral-8x7B expert shape, one token, experts cycled so reads come from DRAM.
Each format runs every host path it has in one run, alternating: bf16 by `cpu_experts.dense_gemm` (plain, split,
split-x4, native), the RowBlocks formats by `row_blocks_gemm` (plain, split over the pool, native for NF4); "native"
only where `layers/host_native` builds. Prints one JSON object: per format and path the median ms an expert and
GB/s of its bytes as held.

`--threads 1 2 4 8 16` repeats every path at each torch thread count (the split pools sized to match): how each
path scales with cores. `--tokens 1 4 16` times each token count. "native/unfused" is "native" with
`cpu_experts.native_fused_expert` off: a SiLU expert's two GEMVs with torch's ops between, where "native" runs it in
one native call (bf16, fp8, NF4).

    PYTHONPATH=. python benchmarks/bench_host_rowblocks.py [--formats bf16 nf4 fp8 fp8-g128 int8-g64 int4 int8] [--experts 2]
        [--threads N ...] [--tokens T ...]"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from ferrylm.layers import cpu_experts
from ferrylm.layers.fused_moe import ExpertWeights
from ferrylm.offload.host_experts import HostExperts
from ferrylm.weights import quant as Q

MAKE = {"bf16": None, "nf4": lambda t: Q.quantize_nf4(t, 64), "fp8": Q.quantize_fp8,
        "fp8-g128": lambda t: Q.quantize_fp8(t, 128),  # block-wise FP8 checkpoints as they load
        "int8-g64": lambda t: Q.quantize_int8(t, 64),
        "int4": lambda t: Q.quantize_int4(t, 32, "sym"), "int8": Q.quantize_int8}


def bank(fmt: str, E: int, H: int, I: int):
    g = torch.Generator().manual_seed(0)
    if fmt == "bf16":
        return ((torch.randn(E, 2 * I, H, generator=g) * .02).to(torch.bfloat16),
                (torch.randn(E, H, I, generator=g) * .02).to(torch.bfloat16))
    q = MAKE[fmt]
    b13 = ExpertWeights.stack([[q(torch.randn(I, H, generator=g) * .02), q(torch.randn(I, H, generator=g) * .02)]
                               for _ in range(E)], torch.bfloat16)
    b2 = ExpertWeights.stack([[q(torch.randn(H, I, generator=g) * .02)] for _ in range(E)], torch.bfloat16)
    return b13, b2


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=list(MAKE))
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1])
    a = ap.parse_args()
    out = {"bench": "host-rowblocks", "threads": a.threads, "cpu": cpu_model(),
           "affinity_cpus": len(os.sched_getaffinity(0)), "hidden": a.hidden, "inter": a.inter,
           "formats": {}}
    for fmt in a.formats:
        b13, b2 = bank(fmt, a.experts, a.hidden, a.inter)
        he = HostExperts(b13, b2, F.silu)
        experts = [he.expert(e) for e in range(a.experts)]
        nbytes = he.expert_bytes
        kind = type(experts[0].gate_up).__name__
        knob = {"RowBlocks": ("row_blocks_gemm", cpu_experts.ROW_BLOCKS_GEMMS),
                "DenseGemm": ("dense_gemm", cpu_experts.DENSE_GEMMS)}.get(kind)
        paths = list(cpu_experts.usable(knob[1])) if knob else ["default"]
        paths += ["native/unfused"] if "native" in paths else []
        before = getattr(cpu_experts, knob[0]) if knob else None
        fused_before = cpu_experts.native_fused_expert
        for threads in a.threads:
            torch.set_num_threads(threads)
            for T in a.tokens:
                x = torch.randn(T, a.hidden, dtype=torch.bfloat16)
                times: dict[str, list[float]] = {p: [] for p in paths}
                for r in range(a.reps + 1):
                    for p in paths:
                        if knob:
                            setattr(cpu_experts, knob[0], p.split("/")[0])
                        cpu_experts.native_fused_expert = p != "native/unfused"
                        t = time.perf_counter()
                        for ex in experts:
                            ex(x)
                        if r:
                            times[p].append((time.perf_counter() - t) / a.experts)
                if knob:
                    setattr(cpu_experts, knob[0], before)
                cpu_experts.native_fused_expert = fused_before
                for p in paths:
                    s = sorted(times[p])[len(times[p]) // 2]
                    key = (f"{fmt} {p}" + (f" t={threads}" if len(a.threads) > 1 else "")
                           + (f" T={T}" if len(a.tokens) > 1 else ""))
                    out["formats"][key] = {"ms": round(s * 1e3, 3), "gb_s": round(nbytes / s / 1e9, 2),
                                           "expert_mb": round(nbytes / 1e6, 1), "kernel": kind}
                    print(key, out["formats"][key], flush=True)
        del he, experts, b13, b2
    print(json.dumps(out))


if __name__ == "__main__":
    main()
