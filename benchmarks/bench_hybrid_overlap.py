"""Do the host's cores and the GPU's in-place reads share host memory, or take turns? The question behind
hybrid decode (offload/host_decode.py): on the H200 host, Mixtral-16L batch 1 decoded at 4.99 tok/s with
every miss read in place and 5.76 with every miss on the CPU, but only 5.3-5.5 with the two splitting
the misses, where running at once should approach the sum of the two rates.

On one layer of Mixtral-shaped experts (bf16, pinned mapped host memory, 352 MB an expert) it times:
  - gpu alone:   the fused kernel reading `--gpu-experts` experts in place (one token routed to them);
  - copy alone:  the copy engine moving the same bytes into device memory;
  - cpu alone:   `HostExperts.rows` on `--cpu-experts` other experts, one token, at each `--threads`;
  - gpu + cpu and copy + cpu: both at once (the CPU in a thread, started together), each side's own
    time and rate, and the sum of the two rates against the alone rates;
  - handoff:     the cost of one post/wait pair of host nodes in a graph (16 per step for Mixtral-16L).
GB/s are bytes of expert weights over seconds. Ends with one JSON line (benchmarks/results/hybrid-overlap-<date>.json).

    PYTHONPATH=. python benchmarks/bench_hybrid_overlap.py [--threads 16 12 8] [--gpu-experts 4 --cpu-experts 3]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.nn.functional as F

from ferrylm.layers.fused_moe import WeightTable, expert_rows
from ferrylm.offload.host_experts import HostExperts
from ferrylm.offload.host_node import HostHandoff
from ferrylm.offload.host_tier import HostTier
from results import write_results  # benchmarks/results.py (scripts run as python benchmarks/x.py)

H, I = 4096, 14336


def best(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[16, 12, 8])
    ap.add_argument("--gpu-experts", type=int, default=4)
    ap.add_argument("--cpu-experts", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    E = a.gpu_experts + a.cpu_experts
    tier = HostTier(pin=True)
    w13 = tier.empty((E, 2 * I, H), torch.bfloat16)
    w2 = tier.empty((E, H, I), torch.bfloat16)
    for e in range(E):  # filled per expert from the device (fast): a copy must not span two pieces
        w13[e].copy_((torch.randn(2 * I, H, device="cuda") * 0.02).bfloat16())
        w2[e].copy_((torch.randn(H, I, device="cuda") * 0.02).bfloat16())
    per_expert = (w13[0].numel() + w2[0].numel()) * 2
    t13 = WeightTable(torch.tensor(WeightTable.addresses(w13), device="cuda"), w13)
    t2 = WeightTable(torch.tensor(WeightTable.addresses(w2), device="cuda"), w2)
    g = a.gpu_experts
    x = (torch.randn(1, H, device="cuda") * 0.1).bfloat16()
    ids = torch.arange(g, device="cuda")[None]  # one token routed to the GPU's experts
    wts = torch.full((1, g), 1.0 / g, device="cuda")
    gpu_bytes = g * per_expert

    def gpu():
        expert_rows(x, t13, t2, ids, wts)

    slot13 = torch.empty((g, 2 * I, H), dtype=torch.bfloat16, device="cuda")
    slot2 = torch.empty((g, H, I), dtype=torch.bfloat16, device="cuda")

    def copy():
        slot13.copy_(w13[:g], non_blocking=True)
        slot2.copy_(w2[:g], non_blocking=True)

    host = HostExperts(w13, w2, F.silu)
    xc = x.cpu()
    cpu_ids = torch.arange(g, E)[None]  # the CPU's experts
    cw = torch.full((1, E - g), 1.0 / (E - g))
    out = torch.empty(E, H, dtype=torch.bfloat16)
    cpu_bytes = (E - g) * per_expert

    def cpu():
        host.rows(xc, cpu_ids, cw, out)

    rows = {"gpu_alone_gbs": gpu_bytes / best(gpu) / 1e9, "copy_alone_gbs": gpu_bytes / best(copy) / 1e9}
    print(f"gpu in place alone {rows['gpu_alone_gbs']:.1f} GB/s; copy engine alone {rows['copy_alone_gbs']:.1f} GB/s",
          flush=True)
    for n in a.threads:
        torch.set_num_threads(n)
        cpu_alone = cpu_bytes / best(cpu, 3) / 1e9
        r = {"cpu_alone_gbs": cpu_alone}
        for name, fn in (("gpu", gpu), ("copy", copy)):
            spans = {}

            def cpu_side():
                t = time.perf_counter()
                cpu()
                spans["cpu"] = time.perf_counter() - t

            fn()
            cpu()
            torch.cuda.synchronize()
            th = threading.Thread(target=cpu_side)
            t = time.perf_counter()
            th.start()
            fn()
            torch.cuda.synchronize()
            spans[name] = time.perf_counter() - t
            th.join()
            both = max(spans.values())
            r[f"{name}+cpu"] = {f"{name}_gbs": gpu_bytes / spans[name] / 1e9, "cpu_gbs": cpu_bytes / spans["cpu"] / 1e9,
                                "together_gbs": (gpu_bytes + cpu_bytes) / both / 1e9,
                                "alone_sum_gbs": rows[f"{name}_alone_gbs"] + cpu_alone}
            print(f"threads {n}: cpu alone {cpu_alone:.1f} GB/s; {name}+cpu: {r[f'{name}+cpu']}", flush=True)
        rows[f"threads_{n}"] = r
    hand = HostHandoff()

    def worker():  # a daemon: answers every hand-off until the process ends
        while True:
            hand.take()
            hand.done()

    th = threading.Thread(target=worker, daemon=True)
    th.start()
    y = torch.zeros(16, device="cuda")

    def step():
        s = torch.cuda.current_stream()
        for _ in range(16):
            hand.post(s)
            y.add_(1)
            hand.wait(s)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    plain = torch.cuda.CUDAGraph()
    with torch.cuda.graph(plain):
        for _ in range(16):
            y.add_(1)
    with_nodes, without = best(graph.replay, 20), best(plain.replay, 20)
    rows["handoff_us"] = (with_nodes - without) / 16 * 1e6
    print(f"one post/wait handoff in a graph: {rows['handoff_us']:.1f} us", flush=True)
    write_results("hybrid_overlap", [rows], out=a.out, per_expert_bytes=per_expert)


if __name__ == "__main__":
    main()
