"""Host expert time per packed format (`offload/host_experts.HostExperts.expert(e)(x)`): the formats no qmatmul
CPU kernel reads (nf4, fp8 and group-wise int8 through `layers/cpu_experts.RowBlocks`) beside the ones it does
(int4, per-channel int8), Mixtral-8x7B expert shape, one token, experts cycled so reads come from DRAM.

    PYTHONPATH=. python benchmarks/bench_host_rowblocks.py [--formats nf4 fp8 int8-g64 int4 int8] [--experts 2]

Each RowBlocks format runs both ways in one run, alternating: on the split pool (`cpu_experts.row_blocks_gemm`,
the default) and plain (the blocks one after another on torch's threads). Prints one JSON object: per format and
path the median ms an expert and GB/s of its packed bytes."""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from ferrylm.layers import cpu_experts
from ferrylm.layers.fused_moe import ExpertWeights
from ferrylm.offload.host_experts import HostExperts
from ferrylm.weights import quant as Q

MAKE = {"nf4": lambda t: Q.quantize_nf4(t, 64), "fp8": Q.quantize_fp8, "int8-g64": lambda t: Q.quantize_int8(t, 64),
        "int4": lambda t: Q.quantize_int4(t, 32, "sym"), "int8": Q.quantize_int8}


def bank(fmt: str, E: int, H: int, I: int):
    g = torch.Generator().manual_seed(0)
    q = MAKE[fmt]
    b13 = ExpertWeights.stack([[q(torch.randn(I, H, generator=g) * .02), q(torch.randn(I, H, generator=g) * .02)]
                               for _ in range(E)], torch.bfloat16)
    b2 = ExpertWeights.stack([[q(torch.randn(H, I, generator=g) * .02)] for _ in range(E)], torch.bfloat16)
    return b13, b2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=list(MAKE))
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    out = {"bench": "host-rowblocks", "threads": torch.get_num_threads(), "hidden": a.hidden, "inter": a.inter,
           "formats": {}}
    for fmt in a.formats:
        b13, b2 = bank(fmt, a.experts, a.hidden, a.inter)
        he = HostExperts(b13, b2, F.silu)
        experts = [he.expert(e) for e in range(a.experts)]
        x = torch.randn(1, a.hidden, dtype=torch.bfloat16)
        nbytes = sum(t.numel() * t.element_size() for side in (b13, b2) for t in side.parts.values()) / a.experts
        paths = ("split", "plain") if type(experts[0].gate_up).__name__ == "RowBlocks" else ("split",)
        times: dict[str, list[float]] = {p: [] for p in paths}
        for r in range(a.reps + 1):
            for p in paths:
                cpu_experts.row_blocks_gemm = p
                t = time.perf_counter()
                for ex in experts:
                    ex(x)
                if r:
                    times[p].append((time.perf_counter() - t) / a.experts)
        cpu_experts.row_blocks_gemm = "split"
        for p in paths:
            s = sorted(times[p])[len(times[p]) // 2]
            key = fmt if p == "split" else f"{fmt} plain"
            out["formats"][key] = {"ms": round(s * 1e3, 2), "gb_s": round(nbytes / s / 1e9, 2),
                                   "expert_mb": round(nbytes / 1e6, 1), "kernel": type(experts[0].gate_up).__name__}
            print(key, out["formats"][key], flush=True)
        del he, experts, b13, b2
    print(json.dumps(out))


if __name__ == "__main__":
    main()
