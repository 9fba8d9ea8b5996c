"""Quantization quality notes for a plan that picks a weight format: what the format cost where it was
measured (ours: perplexity per `ferry convert` store format) and published deltas for catalog models, each
with its source. Figures only; knows nothing about memory or speed.

Ours (`MEASURED`) are `benchmarks/results/ppl-2026-12-01.json` (docs/benchmarks.md, "Perplexity per store
format"): SmolLM2-135M, every store re-quantized from the embedded Q4_1 GGUF, one 923-token English text,
perplexity by transformers (bf16) on the store's dequantized weights; the delta is against the bf16 store.
`tests/test_plan.py` checks these figures against that file. Published ones (`PUBLISHED`) are for calibrated
schemes (GPTQ, AWQ); ferrylm's int4 / NF4 are round-to-nearest, which usually loses more.
"""

from __future__ import annotations

PPL_RESULTS = "benchmarks/results/ppl-2026-12-01.json"

MEASURED = [  # format row of PPL_RESULTS -> (scheme, group size, perplexity); base row "bf16"
    {"format": "bf16", "scheme": None, "group_size": None, "ppl": 24.54458914137575},
    {"format": "int8", "scheme": "int8", "group_size": None, "ppl": 24.604386213186235},
    {"format": "q8_0", "scheme": "q8_0", "group_size": 32, "ppl": 24.694861422574693},
    {"format": "int4-g32", "scheme": "int4", "group_size": 32, "ppl": 24.54458914137575},
    {"format": "int4-g128", "scheme": "int4", "group_size": 128, "ppl": 27.85809649197558},
    {"format": "nf4-g64", "scheme": "nf4", "group_size": 64, "ppl": 29.896119266776708},
]
MEASURED_CAVEAT = ("SmolLM2-135M re-quantized from its Q4_1 GGUF, one 923-token text: int4 g32 re-uses Q4_1's "
                   "own grid (lossless there), int4 g128 quantizes only down_proj; read them as an order, not a "
                   "prediction for another model")

_QWEN = "https://qwen.readthedocs.io/en/latest/getting_started/quantization_benchmark.html"
_YUAN = "https://github.com/IEIT-Yuan/Yuan2.0-M32/blob/main/docs/README_GPTQ_EN.md"
PUBLISHED = [  # model (catalog name), scheme, method, metric, bf16 score, quantized score, source
    {"model": "Yuan2-M32", "scheme": "int4", "method": "GPTQ int4 g128 (AutoGPTQ)", "metric": "HumanEval",
     "base": 73.17, "quant": 66.46, "source": _YUAN},
    {"model": "Yuan2-M32", "scheme": "int8", "method": "GPTQ int8 g128 (AutoGPTQ)", "metric": "HumanEval",
     "base": 73.17, "quant": 72.56, "source": _YUAN},
    {"model": "Qwen2-72B", "scheme": "int4", "method": "GPTQ-Int4 (Qwen2-72B-Instruct)", "metric": "MMLU",
     "base": 82.3, "quant": 80.8, "source": _QWEN},
    {"model": "Qwen2-72B", "scheme": "int4", "method": "AWQ (Qwen2-72B-Instruct)", "metric": "MMLU",
     "base": 82.3, "quant": 80.5, "source": _QWEN},
    {"model": "Qwen2-72B", "scheme": "int8", "method": "GPTQ-Int8 (Qwen2-72B-Instruct)", "metric": "MMLU",
     "base": 82.3, "quant": 81.3, "source": _QWEN},
]
_FAMILY = {"nf4": "int4", "int4": "int4", "int8": "int8", "q8_0": "int8", "fp8": "int8"}
"""Published 4-bit / 8-bit figures stand in for our scheme of the same width (nf4 -> int4; fp8 -> int8)."""


def notes(model_name: str, scheme: str, group_size: int = 64) -> list[dict]:
    """Quality notes for `scheme` (a `--quant` / `--expert-quant` choice): ours measured for that scheme
    (every group size we have), then published deltas for `model_name` at the same width."""
    base = next(r["ppl"] for r in MEASURED if r["format"] == "bf16")
    out = []
    for r in MEASURED:
        if r["scheme"] == scheme:
            out.append({"kind": "measured", "format": r["format"], "metric": "perplexity", "base": base,
                        "quant": r["ppl"], "delta": r["ppl"] / base - 1, "same_group": r["group_size"] in (None, group_size),
                        "source": PPL_RESULTS, "caveat": MEASURED_CAVEAT})
    for r in PUBLISHED:
        if r["model"] == model_name and r["scheme"] == _FAMILY.get(scheme):
            out.append({"kind": "published", "format": r["method"], "metric": r["metric"], "base": r["base"],
                        "quant": r["quant"], "delta": r["quant"] - r["base"], "source": r["source"]})
    return out


def describe(q: dict) -> str:
    if q["kind"] == "measured":
        return f"{q['format']}: perplexity {q['quant']:.2f} vs {q['base']:.2f} bf16 ({q['delta']:+.1%}; ours)"
    return (f"{q['format']}: {q['metric']} {q['quant']:.2f} vs {q['base']:.2f} bf16 ({q['delta']:+.2f} points; "
            f"published, {q['source']})")
