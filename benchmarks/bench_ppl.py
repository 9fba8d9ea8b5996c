"""Perplexity of the embedded SmolLM2-135M per weight format, computed by ferrylm's engine (prompt
logprobs of one `LLM.generate`, the path a user runs: packed kernels where the store has packed weights)
against transformers bf16 on the same weights dequantized, in one run.

Formats, each a store written by `ferry convert` from the embedded Q4_1 GGUF:
  - `gguf-native`: the GGUF's own blocks kept losslessly (Q4_1 projections, Q8_0 embedding / tied head)
  - `bf16`: `--dequantize --dtype bfloat16` (the Q4_1 values, dense)
  - `q8_0`, `int8`, `int4-g32`, `int4-g128`, `nf4-g64`: `--quant ...` re-quantizing the dequantized values
    (embeddings, LM head and norms stay in high precision, as convert always keeps them)
The GGUF file itself is measured too (`gguf-file`: what `ferry generate` with no flags runs).
NB: the only SmolLM2 here is already 4-bit, so every re-quantization re-quantizes Q4_1 values.
Text: benchmarks/data/ppl_text.txt (a fixed 4 KB English text written for this repo), one window.
transformers' side: the model built from the GGUF (dequantized, bf16), then every tensor of the store
dequantized and copied in, so both engines see the same weights.

    python benchmarks/bench_ppl.py [--workdir /tmp/ferry-ppl] [--formats ...] [--out FILE]

The last line printed is JSON (rows: format, ferry_ppl, hf_bf16_ppl, rel_diff, store_mib, kernels).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil

import torch
from results import write_results  # benchmarks/results.py

from ferrylm import LLM, SamplingParams
from ferrylm.default_model import default_model_path
from ferrylm.weights.convert import ConvertOptions, convert
from ferrylm.weights.store import StoreSource

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ppl_text.txt")
FORMATS = {
    "gguf-native": ConvertOptions(),
    "bf16": ConvertOptions(dequantize=True, dtype="bfloat16"),
    "q8_0": ConvertOptions(quant="q8_0", dtype="bfloat16"),
    "int8": ConvertOptions(quant="int8", dtype="bfloat16"),
    "int4-g32": ConvertOptions(quant="int4", group_size=32, dtype="bfloat16"),
    "int4-g128": ConvertOptions(quant="int4", group_size=128, dtype="bfloat16"),
    "nf4-g64": ConvertOptions(quant="nf4", group_size=64, dtype="bfloat16"),
}


def ferry_ppl(path: str, ids: list[int]) -> tuple[float, list[str]]:
    """exp(-mean logprob of tokens 1..n-1 given their prefix), from the engine's prompt logprobs."""
    llm = LLM(path, max_num_seqs=1, max_model_len=len(ids) + 16, enable_prefix_caching=False)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    lps = [d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:])]
    kernels = sorted({k.name for m in llm.engine.runner.model.modules() for k in getattr(m, "kernels", [])})
    del llm
    return math.exp(-sum(lps) / len(lps)), kernels


@torch.inference_mode()
def hf_ppl(model, ids: list[int]) -> float:
    x = torch.tensor([ids])
    logits = model(input_ids=x).logits[0].float()  # [n, V]
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1], x[0, 1:]).item())


def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    kw = {}
    try:  # transformers >= 5: ask for the dense model explicitly
        from transformers import GgufConfig

        kw["quantization_config"] = GgufConfig(gguf_file=os.path.basename(path), dequantize=True)
    except ImportError:
        pass
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.bfloat16, **kw).eval()


@torch.inference_mode()
def load_store_into(model, store: str) -> int:
    """Copy every tensor of `store` (dequantized) into the transformers model; returns how many."""
    src = StoreSource(store)
    params = dict(model.named_parameters())
    n = 0
    for name in src.keys():
        if name in params:
            params[name].copy_(src.get(name).to(params[name].dtype))
            n += 1
    src.close()
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/ferry-ppl")
    ap.add_argument("--formats", nargs="*", default=list(FORMATS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gguf = default_model_path()
    with open(TEXT, encoding="utf-8") as f:
        text = f.read()
    probe = LLM(gguf, max_num_seqs=1, max_model_len=64)
    ids = probe.tokenizer.encode(text, add_special_tokens=False)
    del probe
    print(f"text: {TEXT}, {len(text)} characters, {len(ids)} tokens", flush=True)
    hf = hf_model()
    rows = []
    ppl, kernels = ferry_ppl(gguf, ids)
    rows.append({"format": "gguf-file", "ferry_ppl": ppl, "hf_bf16_ppl": hf_ppl(hf, ids), "store_mib": None,
                 "kernels": kernels})
    os.makedirs(a.workdir, exist_ok=True)
    for name in a.formats:
        dst = os.path.join(a.workdir, f"smollm2-{name}")
        opts = FORMATS[name]
        opts.force = True
        rep = convert(gguf, dst, opts)
        ppl, kernels = ferry_ppl(dst, ids)
        n = load_store_into(hf, dst)
        rows.append({"format": name, "ferry_ppl": ppl, "hf_bf16_ppl": hf_ppl(hf, ids), "store_mib": rep.bytes_files / 2**20,
                     "kernels": kernels, "tensors_into_hf": n})
        shutil.rmtree(dst)
    for r in rows:
        r["rel_diff"] = (r["ferry_ppl"] - r["hf_bf16_ppl"]) / r["hf_bf16_ppl"]
        print(" | ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    write_results("ppl", rows, out=a.out, text=os.path.relpath(TEXT), tokens=len(ids))


if __name__ == "__main__":
    main()
