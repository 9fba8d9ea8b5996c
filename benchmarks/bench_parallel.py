"""Parallel layouts on one host, measured in one run: offline throughput of the same workload under each
layout (the single-GPU engine is the baseline when the model fits one GPU), and the all-reduce bandwidth
of TP groups formed in order vs by topology (`--tp-groups auto`: one socket per group), which is the
reason to prefer TP within a socket and PP across sockets on PCIe boxes.

Workload: `--requests` prompts of `--prompt-len` random tokens, `--max-tokens` greedy tokens each,
submitted at once (ignore_eos). Layouts: `--layouts 1x1,2x1,4x1,2x2,4x2` (TP x PP; `e` suffix =
expert-parallel, e.g. 4x1e). A layout needing more GPUs than present is skipped.
The all-reduce probe: for each group size, a [T, H] bf16 tensor (T = `--ar-tokens`, H from the model)
all-reduced `--ar-iters` times by torch.distributed on the GPUs of each group at once, both orders.
Writes benchmarks/results/parallel-<date>.json; the last line printed is JSON.

    python benchmarks/bench_parallel.py --model /path/to/hf-model [--layouts 1x1,2x1,4x1,2x2] \
        [--requests 64 --prompt-len 512 --max-tokens 128] [--device cuda]
    python benchmarks/bench_parallel.py --model M --device cpu --layouts 1x1,2x1   # smoke run on the CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time


def layouts(spec: str) -> list[tuple[int, int, bool]]:
    out = []
    for part in spec.split(","):
        ep = part.endswith("e")
        tp, pp = part.rstrip("e").split("x")
        out.append((int(tp), int(pp), ep))
    return out


def throughput(model: str, device: str, tp: int, pp: int, ep: bool, a) -> dict:
    import torch

    from ferrylm import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    llm = LLM(model, device=device, tensor_parallel_size=tp, pipeline_parallel_size=pp, expert_parallel=ep,
              max_num_seqs=a.requests, max_model_len=a.prompt_len + a.max_tokens + 16)
    load_s = time.perf_counter() - t0
    vocab = llm.engine.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.requests)]
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    first = outs[0].outputs[0].token_ids[:16]
    llm.engine.close()
    return {"tp": tp, "pp": pp, "ep": ep, "load_s": round(load_s, 2), "wall_s": round(wall, 3),
            "output_tok_s": round(gen / wall, 1), "total_tok_s": round((gen + a.requests * a.prompt_len) / wall, 1),
            "first_tokens": first}


def _allreduce_worker(rank: int, world: int, port: int, groups: list[list[int]], numel: int, iters: int, q):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mine = None
    for grp in groups:  # every rank creates every group, in the same order
        pg = dist.new_group(grp)
        if rank in grp:
            mine = pg
    x = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
    for _ in range(5):
        dist.all_reduce(x, group=mine)
    torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x, group=mine)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / iters
    n = len(groups[0])
    q.put((rank, dt, 2 * (n - 1) / n * numel * 2 / dt / 1e9))  # bus bandwidth, GB/s
    dist.destroy_process_group()


def allreduce_probe(group_size: int, hidden: int, a) -> dict:
    import socket

    import torch
    import torch.multiprocessing as mp

    from ferrylm.parallel.topology import plan_groups, probe_gpus

    n = torch.cuda.device_count()
    gpus = probe_gpus()
    out = {}
    for name, order in (("in-order", list(range(n))), ("auto", plan_groups(gpus, group_size, n // group_size)[0])):
        groups = [order[i:i + group_size] for i in range(0, n, group_size)]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_allreduce_worker, args=(r, n, port, groups, a.ar_tokens * hidden, a.ar_iters, q))
                 for r in range(n)]
        for p in procs:
            p.start()
        res = [q.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        bw = [r[2] for r in res]
        out[name] = {"groups": groups, "min_busbw_gbs": round(min(bw), 2), "mean_busbw_gbs": round(sum(bw) / len(bw), 2),
                     "mean_ms": round(1e3 * sum(r[1] for r in res) / len(res), 3)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layouts", default="1x1,2x1,4x1,2x2,4x2")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ar-tokens", type=int, default=256)
    p.add_argument("--ar-iters", type=int, default=50)
    a = p.parse_args()

    import torch

    n = torch.cuda.device_count() if a.device.startswith("cuda") else os.cpu_count()
    results, base = [], None
    for tp, pp, ep in layouts(a.layouts):
        if tp * pp > n:
            print(f"skip {tp}x{pp}: needs {tp * pp} devices, {n} present")
            continue
        try:
            r = throughput(a.model, a.device, tp, pp, ep, a)
        except Exception as e:  # noqa: BLE001 - e.g. the model does not fit one GPU: say so, go on
            r = {"tp": tp, "pp": pp, "ep": ep, "error": f"{type(e).__name__}: {e}"}
        if "output_tok_s" in r:
            base = base or r
            r["speedup_vs_first"] = round(r["output_tok_s"] / base["output_tok_s"], 2)
            r["same_tokens_as_first"] = r["first_tokens"] == base["first_tokens"]
        print(json.dumps(r))
        results.append(r)
    probe = {}
    if a.device.startswith("cuda") and n >= 4:
        from ferrylm.config import ModelConfig
        from ferrylm.weights.source import open_source

        with open_source(a.model) as src:
            hidden = ModelConfig.from_hf(src.config).hidden_size
        for size in sorted({tp for tp, _, _ in layouts(a.layouts) if 1 < tp < n}):
            probe[str(size)] = allreduce_probe(size, hidden, a)
            print(json.dumps({"allreduce_group_size": size, **probe[str(size)]}))
    summary = {"bench": "parallel", "model": a.model, "device": a.device, "devices": n, "layouts": results,
               "allreduce": probe, "date": datetime.date.today().isoformat()}
    os.makedirs("benchmarks/results", exist_ok=True)
    with open(f"benchmarks/results/parallel-{summary['date']}.json", "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
