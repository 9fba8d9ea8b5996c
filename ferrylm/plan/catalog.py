"""The built-in catalog: HF `config.json` dicts of well-known models, shipped in the package so `ferry plan`
can size them without a download, and `resolve_model()`, which turns a plan's model argument (a catalog
name, a config.json, a model directory, a .gguf file or a ferry store) into (name, config dict).

The dicts hold only the keys the planner and `ModelConfig.from_hf` read, with the values of the published
config.json files. Knows nothing about memory or hardware.
"""

from __future__ import annotations

import json
import os
import re

from ferrylm.errors import ConfigError
from ferrylm.plan import yuan_sizes


def _llama(arch, mtype, V, H, I, L, heads, kv, ctx, theta, tie=False, **kw) -> dict:
    return dict(architectures=[arch], model_type=mtype, vocab_size=V, hidden_size=H, intermediate_size=I,
                num_hidden_layers=L, num_attention_heads=heads, num_key_value_heads=kv,
                max_position_embeddings=ctx, rope_theta=theta, tie_word_embeddings=tie, torch_dtype="bfloat16",
                hidden_act="silu", rms_norm_eps=1e-5, **kw)


CATALOG: dict[str, dict] = {
    "Llama-3-8B": _llama("LlamaForCausalLM", "llama", 128256, 4096, 14336, 32, 32, 8, 8192, 5e5),
    "Llama-3-70B": _llama("LlamaForCausalLM", "llama", 128256, 8192, 28672, 80, 64, 8, 8192, 5e5),
    "Qwen2-72B": _llama("Qwen2ForCausalLM", "qwen2", 152064, 8192, 29568, 80, 64, 8, 32768, 1e6),
    "Qwen2.5-72B": _llama("Qwen2ForCausalLM", "qwen2", 152064, 8192, 29568, 80, 64, 8, 32768, 1e6),
    "Mixtral-8x7B": _llama("MixtralForCausalLM", "mixtral", 32000, 4096, 14336, 32, 32, 8, 32768, 1e6,
                           num_local_experts=8, num_experts_per_tok=2),
    "Mixtral-8x22B": _llama("MixtralForCausalLM", "mixtral", 32768, 6144, 16384, 56, 48, 8, 65536, 1e6,
                            num_local_experts=8, num_experts_per_tok=2),
    "Qwen3-30B-A3B": _llama("Qwen3MoeForCausalLM", "qwen3_moe", 151936, 2048, 6144, 48, 32, 4, 40960, 1e6,
                            head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "Qwen3-235B-A22B": _llama("Qwen3MoeForCausalLM", "qwen3_moe", 151936, 4096, 12288, 94, 64, 4, 40960, 1e6,
                              head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "DeepSeek-V3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280,
                        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
                        n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
                        num_nextn_predict_layers=1, max_position_embeddings=163840, tie_word_embeddings=False,
                        torch_dtype="bfloat16", hidden_act="silu", rms_norm_eps=1e-6),
    **{k: dict(v, torch_dtype="bfloat16") for k, v in yuan_sizes.REAL_CONFIGS.items()},
}
_FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
CATALOG.update({  # the block-wise FP8 releases: the same configs with their quantization_config (counted as they load)
    "DeepSeek-V3-FP8": dict(CATALOG["DeepSeek-V3"], quantization_config=_FP8),
    "Qwen3-30B-A3B-FP8": dict(CATALOG["Qwen3-30B-A3B"], quantization_config=_FP8),
    "Qwen3-235B-A22B-FP8": dict(CATALOG["Qwen3-235B-A22B"], quantization_config=_FP8),
})
"""name -> config.json dict. Yuan's come from `yuan_sizes` (the vendor's launch scripts for 51B/102B). DeepSeek-V3's
own release is the FP8 one; "DeepSeek-V3" is the model in bf16 (e.g. after DeepSeek's fp8_cast_bf16 script)."""

PUBLISHED_PARAMS: dict[str, tuple[float, float]] = {
    "Llama-3-8B": (8.03e9, 8.03e9), "Llama-3-70B": (70.6e9, 70.6e9), "Qwen2-72B": (72.7e9, 72.7e9),
    "Qwen2.5-72B": (72.7e9, 72.7e9), "Mixtral-8x7B": (46.7e9, 12.9e9), "Mixtral-8x22B": (140.6e9, 39.1e9),
    "Qwen3-30B-A3B": (30.5e9, 3.3e9), "Qwen3-235B-A22B": (235e9, 22e9), "DeepSeek-V3": (671e9, 37e9),
    "Qwen3-30B-A3B-FP8": (30.5e9, 3.3e9), "Qwen3-235B-A22B-FP8": (235e9, 22e9), "DeepSeek-V3-FP8": (671e9, 37e9),
    "Yuan2-2B": (2.09e9, 2.09e9), "Yuan2-51B": (51.8e9, 51.8e9), "Yuan2-102B": (102.6e9, 102.6e9),
    "Yuan2-M32": (39.9e9, 3.7e9),
}
"""name -> (total, active) parameters as the model cards state them (DeepSeek-V3 without its 14B MTP module)."""


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(".0-", "-")


_TAGS = re.compile(r"-(instruct|chat|hf|base|it|v\d+(\.\d+)*|\d{4})$")
"""Trailing name tags that do not change a model's shape: tuning (-Instruct, -Chat, -it), packaging (-hf, -Base),
versions (-v0.1) and release dates (-0324, -2507). A quantization tag (-AWQ, -GPTQ-Int4) does change it."""


def lookup(name: str) -> tuple[str, dict] | None:
    """Case-insensitive catalog lookup without the organisation and the name tags of `_TAGS`: 'yuan2.0-m32',
    'Qwen/Qwen2-72B-Instruct', 'mistralai/Mixtral-8x7B-Instruct-v0.1' and 'meta-llama/Meta-Llama-3-70B-Instruct'
    also match."""
    want = _key(name.rsplit("/", 1)[-1])
    want = want[len("meta-"):] if want.startswith("meta-llama") else want
    fp8 = "-fp8" if want.endswith("-fp8") else ""  # a checkpoint format the catalog keeps: tags may sit before it
    want = want[:len(want) - len(fp8)]
    while True:
        for k, v in CATALOG.items():
            if _key(k) == want + fp8:
                return k, v
        shorter = _TAGS.sub("", want)
        if shorter == want:
            return None
        want = shorter


def _near(name: str) -> str:
    """' (closest: A, B)' naming catalog models like `name`, or ''."""
    import difflib

    keys = {_key(k): k for k in CATALOG}
    close = difflib.get_close_matches(_key(name.rsplit("/", 1)[-1]), keys, n=3, cutoff=0.6)
    return f" (closest: {', '.join(keys[c] for c in close)})" if close else ""


def has_weights(spec: str) -> bool:
    """Whether `spec` names weights the engine can load (a .gguf, a ferry store, a directory of safetensors or one
    .gguf), not a config alone (a catalog name, a config.json, a directory holding only config.json)."""
    path = os.path.expanduser(spec)
    if os.path.isfile(path):
        return path.endswith(".gguf")
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return "ferry.json" in names or any(n.endswith((".safetensors", ".gguf")) for n in names)


def store_quantization(spec: str) -> dict | None:
    """A ferry store's quantization as its ferry.json records it (`ferry convert`: scheme, group_size, double_quant,
    keep_high_precision), with `packed_from`: the sources whose packed blocks it kept as they were (a GGUF's, with
    --quant none). None when `spec` is no ferry store."""
    path = os.path.expanduser(spec)
    if not os.path.isfile(os.path.join(path, "ferry.json")):
        return None
    from ferrylm.weights.store import read_manifest

    manifest = read_manifest(path)
    return dict(manifest.get("quantization") or {},
                packed_from={t["packed_from"] for t in manifest["tensors"] if t.get("packed_from")})


def resolve_model(spec: str) -> tuple[str, dict]:
    """A catalog name, a config.json file (or a directory holding one and no weights: a plan needs the config
    alone), or anything `open_source` reads -> (display name, config dict)."""
    path = os.path.expanduser(spec)
    if os.path.isdir(path) and not has_weights(path) and os.path.isfile(os.path.join(path, "config.json")):
        path = os.path.join(path, "config.json")
    if os.path.isfile(path) and path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                return os.path.basename(os.path.dirname(os.path.abspath(path))) or path, json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: cannot read config ({e})") from None
    if os.path.exists(path):
        from ferrylm.weights.source import open_source

        with open_source(path) as src:
            return os.path.basename(os.path.normpath(path)), dict(src.config)
    found = lookup(spec)
    if found is None:
        raise ConfigError(f"{spec!r} is neither a path nor a catalog model{_near(spec)}; catalog: {', '.join(CATALOG)}")
    return found
