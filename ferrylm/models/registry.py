"""Architecture name (HF `architectures[0]`) -> model class. One place to add a family."""

from __future__ import annotations

import importlib

from ferrylm.config import ModelConfig
from ferrylm.errors import UnsupportedArchitectureError

_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "QwenMoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "QwenMoeForCausalLM"),
    "YuanForCausalLM": ("yuan", "YuanForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(cfg: ModelConfig):
    try:
        module, cls = _REGISTRY[cfg.architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {cfg.architecture!r}; supported: {', '.join(supported_architectures())}"
        ) from None
    return getattr(importlib.import_module(f"ferrylm.models.{module}"), cls)
