"""Reading experts in place from mapped host memory (the fused kernel through a `WeightTable`) against
copying them first (copy engine, then the resident kernel), on real expert shapes.

For each shape and batch: the experts the batch routes to live in pinned host memory; `mapped` times
`expert_rows` reading them over PCIe inside the kernel, `copy+compute` times copying the same experts
into device slots and running the resident kernel, `resident` the kernel on device weights (HBM). GB/s
is the routed experts' bytes over the time; the PCIe roofline is the copy engine's rate measured here.

    PYTHONPATH=. python benchmarks/bench_mapped.py            # one JSON line at the end
    PYTHONPATH=. python benchmarks/bench_mapped.py --sweep    # the decode kernel's configurations (< 4 min)
    PYTHONPATH=. python benchmarks/bench_mapped.py --mixed    # layers with a few misses among hits (< 2 min)

`--mixed` times one MoE layer as the mapped offload cache runs it at decode: T tokens route to k experts each,
m of the layer's routed experts read in place from mapped host memory and the rest from device slots, through
one table (qwen3-30b: E 128, H 2048, I 768, k 8; mixtral too with `--shapes`), per expert format (bf16, fp8 per
channel and in groups of 128 as block-wise FP8 checkpoints load, int8; `--mixed-formats`). Per m: the plain kernel
and the decode kernel over a few tile configurations and K splits, each timed as device time of CUDA-graph replays
(as the engine runs decode); each row says ms, the floor (max of the hits' HBM time and the misses' bytes at the
copy engine's rate) and ms over it: what a layer with a miss costs beyond its bytes (the planner's
`INPLACE_LAYER_S`, 0.15 ms fitted on the H200's engine profile).

`--sweep` times two routed Mixtral experts (a bank of 2, H 4096, I 14336) at 1 token (and the best
configurations again at 8) for bf16, int8 per channel and NF4 g64, read in place from mapped host memory
and from HBM: the plain kernel without and with the alignment hint, and the decode kernel
(`layers/fused_moe_decode.py`) over its tile configurations (`sweep_configs`) times K splits. Each row
says ms, GB/s of packed bytes, bf16-equivalent GB/s and the relative error against the plain kernel on
the same weights; a configuration that fails is printed and skipped. A time budget (`--budget-s`) stops
the sweep early rather than run long; the last line is the results JSON with the best configuration per
(format, memory, tokens).
"""

from __future__ import annotations

import dataclasses
import json
import time
import traceback

import torch

from ferrylm.layers import fused_moe as fm
from ferrylm.layers import fused_moe_decode as fmd
from ferrylm.layers.fused_moe import ExpertWeights, WeightTable, expert_rows
from ferrylm.offload.host_tier import HostTier
from gpu_timing import graphed_us  # benchmarks/gpu_timing.py (scripts run as python benchmarks/x.py)
from results import write_results  # benchmarks/results.py

SHAPES = {"mixtral": (8, 4096, 14336, 2), "qwen3-30b": (128, 2048, 768, 8)}  # E, H, I, k


CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"  # cpu: `--sweep --tiny` under TRITON_INTERPRET=1, a smoke run of the script


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def timed(fn, reps: int = 10) -> float:
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps


def h2d_rate(tier: HostTier) -> float:
    src = tier.empty((1 << 30,), torch.uint8)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    return (1 << 30) / timed(lambda: dst.copy_(src, non_blocking=True), 5) / 1e9


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--packed-only", action="store_true", help="only the packed banks (int8, nf4)")
    ap.add_argument("--sweep", action="store_true", help="only the decode kernel's configuration sweep")
    ap.add_argument("--budget-s", type=float, default=165.0, help="--sweep starts no new case after this")
    ap.add_argument("--formats", default="int8,nf4,bf16", help="--sweep formats (bf16 is the reference)")
    ap.add_argument("--tiny", action="store_true", help="--sweep on tiny experts (a smoke run, CPU interpreter too)")
    ap.add_argument("--sweep-one", default=None, help=argparse.SUPPRESS)  # one format, in a child process
    ap.add_argument("--rows-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--pcie", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--where", default="", help="--sweep only the tile configurations with these fields, e.g. "
                    "'nf4_select=True,block_k=256'")
    ap.add_argument("--mixed", action="store_true", help="layers with m of their experts in place (see above)")
    ap.add_argument("--shapes", default="qwen3-30b", help="--mixed shapes (qwen3-30b, mixtral)")
    ap.add_argument("--mixed-formats", default="bf16,fp8,fp8-g128,int8", help="--mixed formats (nf4 too)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.sweep_one:
        rows = sweep_one(a.sweep_one, a.pcie, a.budget_s, a.tiny, a.rows_out, a.where)
        with open(a.rows_out, "w") as f:
            json.dump(rows, f)
        return
    tier = HostTier(pin=True)
    pcie = h2d_rate(tier) if CUDA else None
    if a.mixed:
        rows = mixed(tier, pcie, a.shapes.split(","), a.mixed_formats.split(","), a.budget_s, a.tiny)
        write_results("mapped_mixed", rows, out=a.out, h2d_gb_s=pcie, gpu=torch.cuda.get_device_name() if CUDA else None)
        return
    if a.sweep:
        tier.close()
        rows, best = sweep(pcie, a.formats.split(","), a.budget_s, a.tiny, a.where)
        write_results("mapped_sweep", rows, out=a.out, h2d_gb_s=pcie, gpu=torch.cuda.get_device_name() if CUDA else None,
                      shape_e_h_i_k=(2, 128, 128, 2) if a.tiny else (2, 4096, 14336, 2), best=best)
        return
    rows = []
    for name, (E, H, I, k) in ({} if a.packed_only else SHAPES).items():
        w13 = tier.empty((E, 2 * I, H), torch.bfloat16)
        w2 = tier.empty((E, H, I), torch.bfloat16)
        d13 = (torch.randn(w13.shape, device="cuda") * 0.02).bfloat16()
        d2 = (torch.randn(w2.shape, device="cuda") * 0.02).bfloat16()
        for e in range(E):  # per expert: a copy must not span two registered pieces
            w13[e].copy_(d13[e])
            w2[e].copy_(d2[e])
        t13 = WeightTable(torch.tensor(WeightTable.addresses(w13), device="cuda"), w13)
        t2 = WeightTable(torch.tensor(WeightTable.addresses(w2), device="cuda"), w2)
        per_expert = (w13[0].numel() + w2[0].numel()) * 2
        for T in (1, 4, 16, 64):
            x = torch.randn(T, H, device="cuda").bfloat16()
            ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
            w = torch.rand(T, k, device="cuda")
            used = ids.unique().tolist()
            nbytes = len(used) * per_expert
            s13 = torch.empty((len(used), 2 * I, H), dtype=torch.bfloat16, device="cuda")
            s2 = torch.empty((len(used), H, I), dtype=torch.bfloat16, device="cuda")
            remap = torch.full((E,), 0, dtype=torch.long, device="cuda")
            remap[torch.tensor(used, device="cuda")] = torch.arange(len(used), device="cuda")
            local = remap[ids]

            def copy_compute():
                for j, e in enumerate(used):
                    s13[j].copy_(w13[e], non_blocking=True)
                    s2[j].copy_(w2[e], non_blocking=True)
                return expert_rows(x, s13, s2, local, w)

            assert torch.equal(expert_rows(x, t13, t2, ids, w), expert_rows(x, d13, d2, ids, w))
            t_map = timed(lambda: expert_rows(x, t13, t2, ids, w))
            t_copy = timed(copy_compute)
            t_res = timed(lambda: expert_rows(x, d13, d2, ids, w))
            row = {"shape": name, "tokens": T, "experts_read": len(used), "mb_read": nbytes / 1e6,
                   "mapped_ms": t_map * 1e3, "copy_compute_ms": t_copy * 1e3, "resident_ms": t_res * 1e3,
                   "mapped_gb_s": nbytes / t_map / 1e9, "copy_gb_s": nbytes / t_copy / 1e9,
                   "pcie_roofline_ms": nbytes / pcie / 1e6}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del d13, d2, w13, w2
    rows += packed(tier, pcie)
    write_results("mapped_experts", rows, out=a.out, h2d_gb_s=pcie, gpu=torch.cuda.get_device_name())


def random_packed(tier: HostTier, fmt: str, E: int, N: int, K: int, group: int):
    """Random codes and scales of a packed bank (or, bf16, dense weights), in mapped host memory (host) and
    on the device."""
    if fmt == "bf16":
        dev = (torch.randn(E, N, K, device=DEV) * 0.02).to(torch.bfloat16 if CUDA else torch.float32)
        host = tier.empty(dev.shape, dev.dtype)
        for e in range(E):
            host[e].copy_(dev[e])
        return dev, WeightTable(torch.tensor(WeightTable.addresses(host), device=DEV), host)
    kq = K // 2 if fmt == "nf4" else K
    G = K // group
    q = torch.randint(-127 if fmt == "int8" else 0, 128 if fmt == "int8" else 256, (E, N, kq), device=DEV,
                      dtype=torch.int8 if fmt == "int8" else torch.uint8)
    if fmt == "fp8":  # e4m3 codes without the two NaNs (0x7f, 0xff)
        q = torch.where(q & 0x7F == 0x7F, q ^ 1, q)
    sc = torch.rand(E, N, G, device=DEV) * 1e-3
    dev = ExpertWeights(fmt, (E, N, K), group, q, sc)
    host = {k: tier.empty(v.shape, v.dtype) for k, v in dev.parts.items()}
    for k, v in dev.parts.items():
        for e in range(E):
            host[k][e].copy_(v[e])
    like = ExpertWeights(fmt, (E, N, K), group, host["q"], host["scale"])
    table = WeightTable({k: torch.tensor(WeightTable.addresses(v), device=DEV) for k, v in host.items()}, like)
    return dev, table


SPLITS = [(0, 0), (1, 1), (2, 4), (2, 8), (4, 16), (8, 16)]
"""(split_k13, split_k2) pairs the sweep times per tile configuration (0: the auto rule); splits are runtime
arguments, so they compile nothing."""


def timed_adaptive(fn, seconds: float = 0.04) -> float:
    """Mean seconds a call over enough calls to fill `seconds` (at least 3, at most 50), after a warm-up."""
    one = timed(fn, 1)
    return timed(fn, max(3, min(50, int(seconds / max(one, 1e-6)))))


def wanted(cfg, where: str) -> bool:
    """Whether DecodeConfig `cfg` has every `field=value` of the comma list `where` (empty: all)."""
    return all(str(getattr(cfg, f)) == v for f, v in (kv.split("=") for kv in where.split(",") if kv))


def sweep(pcie: float | None, formats: list[str], budget_s: float, tiny: bool, where: str = "") -> tuple[list, dict]:
    """Each format's sweep in its own process (a configuration that breaks the CUDA context costs only the
    rest of its format), the time budget shared out among the formats left; -> (rows, best per case)."""
    import os
    import subprocess
    import sys
    import tempfile

    start = time.perf_counter()
    rows: list[dict] = []
    for i, fmt in enumerate(formats):
        share = (budget_s - (time.perf_counter() - start)) / (len(formats) - i)
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "rows.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--sweep-one", fmt, "--budget-s", str(max(share, 1.0)),
                   "--rows-out", out, "--where", where, *(["--pcie", str(pcie)] if pcie else []),
                   *(["--tiny"] if tiny else [])]
            try:
                rc = subprocess.run(cmd, timeout=max(share, 1.0) + 90).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            got = json.load(open(out)) if os.path.exists(out) else []
        if rc != 0 or not got:
            print(f"sweep of {fmt} ended with {rc} after {len(got)} rows", flush=True)
            got.append({"format": fmt, "error": f"the sweep process ended with {rc}"})
        rows += got
    best: dict = {}
    for r in rows:
        if not r.get("ok"):
            continue
        key = f"{r['format']}/{r['memory']}/T{r['tokens']}"
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = {k: r[k] for k in ("kernel", "config", "ms", "packed_gb_s", "bf16_equivalent_gb_s")}
    for key, b in best.items():
        base = {r["kernel"]: r["ms"] for r in rows if r.get("ms") and f"{r['format']}/{r['memory']}/T{r['tokens']}" == key
                and r["kernel"] in ("plain", "plain-unhinted")}
        b["plain_ms"], b["plain_unhinted_ms"] = base.get("plain"), base.get("plain-unhinted")
        print(f"best {key}: {b['kernel']} {b['ms']:.3f} ms ({b['packed_gb_s']:.1f} GB/s packed, "
              f"{b['bf16_equivalent_gb_s']:.1f} bf16-equivalent); plain {b['plain_ms']} ms, "
              f"unhinted {b['plain_unhinted_ms']} ms; {b['config']}", flush=True)
    print(f"sweep took {time.perf_counter() - start:.0f} s", flush=True)
    return rows, best


def sweep_one(fmt: str, pcie: float | None, budget_s: float, tiny: bool, rows_out: str, where: str = "") -> list[dict]:
    """One format: two routed experts (a bank of 2, Mixtral's shape unless `tiny`) at 1 token over every
    tile configuration x `SPLITS`, then at 8 tokens the three fastest mapped ones and the default; mapped
    host memory first, then HBM; the plain kernel (unhinted, hinted) as the baseline in the same run. The
    rows so far are saved to `rows_out` after each case (a crash of the process loses none)."""
    start = time.perf_counter()
    E, H, I, k = (2, 128, 128, 2) if tiny else (2, 4096, 14336, 2)
    tier = HostTier(pin=True)
    rows: list[dict] = []
    group = 64 if fmt == "nf4" else None
    d13, t13 = random_packed(tier, fmt, E, 2 * I, H, group or H)
    d2, t2 = random_packed(tier, fmt, E, H, I, group or I)
    nbytes = sum(b.numel() * b.element_size() if isinstance(b, torch.Tensor) else b.nbytes for b in (d13, d2))
    bf16_bytes = E * 3 * H * I * 2
    skipped = 0
    for T in (1, 8):
        x = torch.randn(T, H, device=DEV).to(torch.bfloat16 if CUDA else torch.float32)
        ids = torch.arange(k, device=DEV).repeat(T, 1)  # every token routes to both experts
        w = torch.rand(T, k, device=DEV)
        want = expert_rows(x, d13, d2, ids, w, decode=False).float()
        cases = [("plain-unhinted", False), ("plain", False)]
        if T == 1:
            cases += [("decode", dataclasses.replace(c, split_k13=s13, split_k2=s2))
                      for c in fmd.sweep_configs("dense" if fmt == "bf16" else fmt) if wanted(c, where)
                      for s13, s2 in SPLITS]
        else:  # the three fastest mapped configurations at one token, and the default
            ranked = sorted((r for r in rows if r["tokens"] == 1 and r["memory"] == "mapped" and r["kernel"] == "decode"
                             and r.get("ok")), key=lambda r: r["ms"])
            picks = [fmd.DecodeConfig(**r["config"]) for r in ranked[:3]] + [fmd.DecodeConfig()]
            cases += [("decode", c) for c in dict.fromkeys(picks)]
        for memory, (b13, b2) in (("mapped", (t13, t2)), ("hbm", (d13, d2))):
            for kernel, cfg in cases:
                if memory == "hbm" and kernel == "plain-unhinted":  # the hint is for tables only
                    continue
                # at 8 tokens the deadline still lets the baselines and the default run
                if time.perf_counter() - start > budget_s and (T == 1 or kernel == "decode" and cfg != fmd.DecodeConfig()):
                    skipped += 1
                    continue
                row = {"format": fmt, "memory": memory, "tokens": T, "kernel": kernel,
                       "config": dataclasses.asdict(cfg) if cfg else None, "mb_read": nbytes / 1e6}
                fm.ALIGN_HINTS = kernel != "plain-unhinted"
                try:
                    got = expert_rows(x, b13, b2, ids, w, decode=cfg)
                    err = ((got.float() - want).norm() / want.norm()).item()
                    t = timed_adaptive(lambda: expert_rows(x, b13, b2, ids, w, decode=cfg))
                    row.update(ms=t * 1e3, packed_gb_s=nbytes / t / 1e9, bf16_equivalent_gb_s=bf16_bytes / t / 1e9,
                               rel_err_vs_plain=err, ok=err < 3e-2,
                               pcie_roofline_ms=nbytes / pcie / 1e6 if memory == "mapped" and pcie else None)
                except Exception as e:  # a configuration that fails is reported, not fatal
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    traceback.print_exc()
                    if "CUDA" in str(e) and "error" in str(e).lower():  # the context is gone: nothing else can run
                        rows.append(row)
                        return rows
                finally:
                    fm.ALIGN_HINTS = True
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(rows_out, "w") as f:
                    json.dump(rows, f)
    if skipped:
        print(f"{fmt}: {skipped} cases skipped for the time budget", flush=True)
        rows.append({"format": fmt, "skipped_for_time": skipped})
    tier.close()
    return rows


MIXED_CONFIGS = [("plain", False), ("decode", fmd.DecodeConfig()), ("decode-n32", fmd.DecodeConfig(block_n=32)),
                 ("decode-s4", fmd.DecodeConfig(split_k13=4, split_k2=4)),
                 ("decode-s8", fmd.DecodeConfig(split_k13=8, split_k2=8)),
                 ("decode-n32-s8", fmd.DecodeConfig(block_n=32, split_k13=8, split_k2=8)),
                 ("fma-m1", fmd.DecodeConfig(block_m=1, dot=False, block_n=32, block_k=128))]
"""(name, `expert_rows` decode argument) pairs `--mixed` times."""


def graphed_ms(fn) -> tuple[float, str]:
    """Device milliseconds a call of `fn` takes, replayed from a CUDA graph (`gpu_timing.graphed_us`: the engine
    graphs its decode steps, and eager timing would measure the host's launches); eager timing where the capture
    fails. -> (ms, how)."""
    if not CUDA:
        return timed(fn, 3) * 1e3, "eager"
    try:
        return graphed_us(fn, 10) / 1e3, "graph"
    except Exception as e:  # noqa: BLE001 - a call that cannot be captured is timed eagerly
        print(f"graph capture failed ({type(e).__name__}: {str(e)[:120]}): timed eagerly", flush=True)
        sync()
        return timed_adaptive(fn) * 1e3, "eager"


def mixed(tier: HostTier, pcie: float | None, shapes: list[str], formats: list[str], budget_s: float,
          tiny: bool) -> list[dict]:
    """`--mixed`: see the module docstring."""
    start, rows = time.perf_counter(), []
    for name in shapes:
        E, H, I, k = (8, 64, 32, 4) if tiny else SHAPES[name]
        for fmt in formats:
            group = {"nf4": 64, "fp8-g128": 128}.get(fmt)
            base = fmt.split("-")[0]
            d13, h13 = random_packed(tier, base, E, 2 * I, H, min(group or H, H))
            d2, h2 = random_packed(tier, base, E, H, I, min(group or I, I))
            per_expert = sum(b.numel() * b.element_size() if isinstance(b, torch.Tensor) else b.nbytes
                             for b in (d13, d2)) // E
            for T in (1, 4):
                x = torch.randn(T, H, device=DEV).to(torch.bfloat16 if CUDA else torch.float32)
                ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(T)])
                w = torch.rand(T, k, device=DEV)
                used = ids.unique().tolist()
                want = expert_rows(x, d13, d2, ids, w, decode=False).float()
                for m in sorted({0, 1, 2, 4, len(used)}):
                    if m > len(used):
                        continue
                    t13, t2 = mixed_table(d13, h13, used[:m]), mixed_table(d2, h2, used[:m])
                    hbm_s = (len(used) - m) * per_expert / 3.0e12  # the hits at ~3 TB/s (HBM3 copy rate, ~ both cards)
                    floor = max(hbm_s, m * per_expert / pcie / 1e9) if pcie else None
                    for kname, cfg in MIXED_CONFIGS:
                        if time.perf_counter() - start > budget_s:
                            break
                        row = {"shape": name, "format": fmt, "tokens": T, "experts": len(used), "in_place": m,
                               "kernel": kname, "mb_in_place": m * per_expert / 1e6}
                        try:
                            got = expert_rows(x, t13, t2, ids, w, decode=cfg)
                            ms, how = graphed_ms(lambda: expert_rows(x, t13, t2, ids, w, decode=cfg))
                            row.update(ms=ms, timed=how,
                                       rel_err_vs_plain=((got.float() - want).norm() / want.norm()).item(),
                                       floor_ms=floor * 1e3 if floor else None,
                                       over_floor_ms=ms - floor * 1e3 if floor else None)
                        except Exception as e:  # a configuration that cannot run is reported, not fatal
                            row["error"] = f"{type(e).__name__}: {e}"[:300]
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            del d13, d2, h13, h2
    by = {}
    for r in rows:
        if "ms" in r:
            by.setdefault((r["shape"], r["format"], r["tokens"], r["in_place"]), []).append(r)
    for (name, fmt, T, m), rs in by.items():
        best = min(rs, key=lambda r: r["ms"])
        plain = next((r["ms"] for r in rs if r["kernel"] == "plain"), float("nan"))
        print(f"{name} {fmt} T={T} in place {m}: plain {plain:.3f} ms, best {best['kernel']} {best['ms']:.3f} ms"
              + (f" (floor {best['floor_ms']:.3f}, over {best['over_floor_ms']:.3f})" if best.get("floor_ms") else ""),
              flush=True)
    return rows


def mixed_table(dev, host: WeightTable, in_place: list[int]) -> WeightTable:
    """A table over bank `dev`'s experts whose experts `in_place` point at `host`'s rows (mapped memory)."""
    E = host.shape[0]
    dparts = {"q": dev} if isinstance(dev, torch.Tensor) else dev.parts
    ptrs = {}
    for key, hp in host.ptrs.items():
        d = dparts[key]
        dev_addr = torch.tensor(WeightTable.addresses(d), device=DEV)
        pick = torch.zeros(E, dtype=torch.bool, device=DEV)
        pick[list(in_place)] = True
        ptrs[key] = torch.where(pick, hp, dev_addr)
    return WeightTable(ptrs, host.like)


def packed(tier: HostTier, pcie: float) -> list:
    """Packed banks read in place: bytes that cross PCIe per routed expert drop 2x (int8) or ~3.6x (nf4)."""
    rows = []
    for name, (E, H, I, k) in SHAPES.items():
        for fmt, group in (("int8", H), ("nf4", 64)):
            d13, t13 = random_packed(tier, fmt, E, 2 * I, H, group if fmt == "nf4" else H)
            d2, t2 = random_packed(tier, fmt, E, H, I, group if fmt == "nf4" else I)
            per_expert = (d13.nbytes + d2.nbytes) // E
            dense_expert = 3 * H * I * 2
            for T in (1, 16):
                x = torch.randn(T, H, device="cuda").bfloat16()
                ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
                w = torch.rand(T, k, device="cuda")
                n = len(ids.unique().tolist())
                assert torch.equal(expert_rows(x, t13, t2, ids, w), expert_rows(x, d13, d2, ids, w))
                t_map = timed(lambda: expert_rows(x, t13, t2, ids, w))
                t_res = timed(lambda: expert_rows(x, d13, d2, ids, w))
                row = {"shape": name, "format": fmt, "tokens": T, "experts_read": n, "mb_read": n * per_expert / 1e6,
                       "bf16_mb": n * dense_expert / 1e6, "mapped_ms": t_map * 1e3, "resident_ms": t_res * 1e3,
                       "mapped_gb_s": n * per_expert / t_map / 1e9,
                       "bf16_equivalent_gb_s": n * dense_expert / t_map / 1e9,
                       "pcie_roofline_ms": n * per_expert / pcie / 1e6}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
