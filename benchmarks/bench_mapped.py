"""Reading experts in place from mapped host memory (the fused kernel through a `WeightTable`) against
copying them first (copy engine, then the resident kernel), on real expert shapes.

For each shape and batch: the experts the batch routes to live in pinned host memory; `mapped` times
`expert_rows` reading them over PCIe inside the kernel, `copy+compute` times copying the same experts
into device slots and running the resident kernel, `resident` the kernel on device weights (HBM). GB/s
is the routed experts' bytes over the time; the PCIe roofline is the copy engine's rate measured here.

    PYTHONPATH=. python benchmarks/bench_mapped.py            # one JSON line at the end
"""

from __future__ import annotations

import json
import time

import torch

from ferrylm.layers.fused_moe import ExpertWeights, WeightTable, expert_rows
from ferrylm.offload.host_tier import HostTier

SHAPES = {"mixtral": (8, 4096, 14336, 2), "qwen3-30b": (128, 2048, 768, 8)}  # E, H, I, k


def timed(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def h2d_rate(tier: HostTier) -> float:
    src = tier.empty((1 << 30,), torch.uint8)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    return (1 << 30) / timed(lambda: dst.copy_(src, non_blocking=True), 5) / 1e9


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--packed-only", action="store_true", help="only the packed banks (int8, nf4)")
    a = ap.parse_args()
    tier = HostTier(pin=True)
    pcie = h2d_rate(tier)
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
    print(json.dumps({"bench": "mapped_experts", "h2d_gb_s": pcie, "gpu": torch.cuda.get_device_name(),
                      "rows": rows}))


def random_packed(tier: HostTier, fmt: str, E: int, N: int, K: int, group: int):
    """Random codes and scales of a packed bank, in mapped host memory (host) and on the device."""
    kq = K // 2 if fmt == "nf4" else K
    G = K // group
    q = torch.randint(-127 if fmt == "int8" else 0, 128 if fmt == "int8" else 256, (E, N, kq), device="cuda",
                      dtype=torch.int8 if fmt == "int8" else torch.uint8)
    sc = torch.rand(E, N, G, device="cuda") * 1e-3
    dev = ExpertWeights(fmt, (E, N, K), group, q, sc)
    host = {k: tier.empty(v.shape, v.dtype) for k, v in dev.parts.items()}
    for k, v in dev.parts.items():
        for e in range(E):
            host[k][e].copy_(v[e])
    like = ExpertWeights(fmt, (E, N, K), group, host["q"], host["scale"])
    table = WeightTable({k: torch.tensor(WeightTable.addresses(v), device="cuda") for k, v in host.items()}, like)
    return dev, table


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
