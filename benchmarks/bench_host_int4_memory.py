"""Host memory of int4 host experts: the copied kernels (`Int4PackCPU` re-lays each expert's codes into a
second copy) against experts laid in place in the bank (`HostExperts.lay`, one copy), on a random-weight
int4min bank. Each mode runs in its own process (RSS never shrinks reliably after a free); per mode: RSS
growth from building every expert's kernels (psutil), the codes' bytes, the lay's time, `rows` time at 1 and
8 tokens, and a digest of the rows (every expert used), which must match between the modes (bit-identical).

    python benchmarks/bench_host_int4_memory.py [--experts 8 --hidden 2048 --inter 4096 --threads N]

Ends with one JSON line (benchmarks/results.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time


def run_mode(a) -> dict:
    import gc

    import psutil
    import torch
    import torch.nn.functional as F

    from ferrylm.layers.fused_moe import ExpertWeights
    from ferrylm.offload.host_experts import HostExperts

    if a.threads:
        torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    E, H, I, gs = a.experts, a.hidden, a.inter, 32

    def side(n, k):  # random codes and scales straight away: no fp32 weights to quantize (RSS noise)
        q = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, generator=g)
        scale = (torch.rand(E, n, k // gs, generator=g) * 0.01).half()
        return ExpertWeights("int4min", (E, n, k), gs, q, scale, -8 * scale)

    w13, w2 = side(2 * I, H), side(H, I)
    codes = w13.parts["q"].nbytes + w2.parts["q"].nbytes
    he = HostExperts(w13, w2, F.silu)
    gc.collect()
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    t = time.perf_counter()
    if a.mode == "laid":
        he.lay(range(E))
    lay_s = time.perf_counter() - t
    he.prepare()
    gc.collect()
    grown = proc.memory_info().rss - rss0
    digest, times = hashlib.sha256(), {}
    for T in (1, 8):
        x = torch.randn(T, H, generator=g).bfloat16()
        ids = torch.stack([torch.arange(2) + (2 * t) % E for t in range(T)])  # [T, 2]
        w = torch.rand(T, 2, generator=g)
        out = torch.empty(T * 2, H, dtype=torch.bfloat16)
        he.rows(x, ids, w, out)  # warm
        n = 5
        t = time.perf_counter()
        for _ in range(n):
            he.rows(x, ids, w, out)
        times[str(T)] = (time.perf_counter() - t) / n
        digest.update(out.view(torch.int16).numpy().tobytes())
    return {"mode": a.mode, "codes_bytes": codes, "rss_growth_bytes": grown, "lay_s": lay_s,
            "rows_s": times, "digest": digest.hexdigest(), "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=4096)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--mode", choices=["copy", "laid"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.mode:
        print(json.dumps(run_mode(a)))
        return
    rows = []
    for mode in ("copy", "laid"):
        args = [sys.executable, __file__, "--mode", mode, "--experts", str(a.experts), "--hidden", str(a.hidden),
                "--inter", str(a.inter)] + (["--threads", str(a.threads)] if a.threads else [])
        r = subprocess.run(args, capture_output=True, text=True, check=True)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        m = rows[-1]
        print(f"{mode}: kernels grew RSS by {m['rss_growth_bytes'] / 2**20:.1f} MiB over {m['codes_bytes'] / 2**20:.1f} "
              f"MiB of codes; lay {m['lay_s']:.2f} s; rows {m['rows_s']['1'] * 1e3:.2f} ms at 1 token, "
              f"{m['rows_s']['8'] * 1e3:.2f} ms at 8", file=sys.stderr)
    same = rows[0]["digest"] == rows[1]["digest"]
    print(f"outputs bit-identical: {same}", file=sys.stderr)
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    from results import write_results

    write_results("host_int4_memory", rows, out=a.out, bit_identical=same,
                  saved_bytes=rows[0]["rss_growth_bytes"] - rows[1]["rss_growth_bytes"])


if __name__ == "__main__":
    main()
