"""Frozen configuration dataclasses: the model's shape and the engine's knobs.

Defaults live here and only here; the CLI maps its flags 1:1 onto these fields. `ModelConfig` is read
from an HF `config.json` dict (GGUF metadata is translated into that dict by `weights/gguf.py`), so every
family sees one vocabulary of names. This module knows nothing about tensors or devices.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from ferrylm.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one checkpoint, in HF `config.json` vocabulary."""

    architecture: str
    """HF class name, e.g. `LlamaForCausalLM`; selects the model family in `models/registry.py`."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    """Features of each cached K row. For MLA (DeepSeek-V2/V3) the cache holds one row per token, the
    compressed latent + rope key: `num_key_value_heads` 1, `head_dim` kv_lora_rank + qk_rope_head_dim."""
    v_cache_dim: int | None = None
    """Features of each cached V row; None: `head_dim`; 0: no V cache (MLA reads values from the latent)."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """HF `rope_scaling` dict (`rope_type` llama3/linear/dynamic...), or None."""
    rope_freqs: tuple[float, ...] = ()
    """Per-frequency divisors of the RoPE angles (a GGUF's `rope_freqs` tensor, Llama-3.1 style)."""
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on q/k/v projections (Qwen2; Llama/Qwen3 `attention_bias`)."""
    o_proj_bias: bool = False
    """Bias on the attention output projection (Llama/Qwen3/OLMoE `attention_bias`; never Qwen2/Mistral)."""
    mlp_bias: bool = False
    """Bias on gate/up/down of the dense MLP (Llama `mlp_bias`)."""
    qk_norm: bool = False
    """RMSNorm on each head of q and k before RoPE (Qwen3)."""
    hidden_act: str = "silu"
    sliding_window: int | None = None
    """Keys a query sees (itself included) in sliding-window layers (Mistral, Mixtral, Qwen with
    `use_sliding_window`); None: every layer attends to the whole context."""
    layer_types: tuple[str, ...] = ()
    """Per layer `full_attention` | `sliding_attention` (HF `layer_types`, or derived from Qwen's
    `max_window_layers`); empty: every layer slides when `sliding_window` is set."""
    # Mixture of experts (0 experts = dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    """The checkpoint's own dtype, as config.json says it."""
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    """The whole source dict, for family-specific fields (e.g. Yuan's `use_lf_gate`)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def context_limit(self) -> int:
        """Positions the model serves: `max_position_embeddings`, stretched by dynamic/linear/yarn RoPE."""
        from ferrylm.layers.rotary import context_limit

        return context_limit(self.rope_scaling, self.max_position_embeddings)

    def window_of(self, layer_idx: int) -> int | None:
        """The sliding window of one layer, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer_idx] != "sliding_attention":
            return None
        return self.sliding_window

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from an HF config.json dict; unknown keys stay in `raw`."""
        archs = cfg.get("architectures") or [_ARCH_OF_MODEL_TYPE.get(cfg.get("model_type") or "")]
        if not archs[0]:  # transformers' Auto classes map model_type the same way when architectures is absent
            raise ConfigError("config.json has neither 'architectures' nor a known 'model_type' "
                              f"({cfg.get('model_type')!r}); cannot tell the model family")
        text = cfg.get("text_config")
        if isinstance(text, dict):  # multimodal wrappers keep the LM config nested
            cfg = {**cfg, **text}
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ConfigError(f"config.json lacks required field {e.args[0]!r}") from None
        # Yuan-M32 projects attention to `attention_projection_size`, not to hidden
        head_dim = cfg.get("head_dim") or int(cfg.get("attention_projection_size") or hidden) // heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers v5 spelling
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        if isinstance(rope_scaling, dict) and "original_max_position_embeddings" not in rope_scaling \
                and cfg.get("original_max_position_embeddings"):  # Phi-3 keeps it beside rope_scaling
            rope_scaling = {**rope_scaling, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
        model_type = cfg.get("model_type", "")
        moe = cfg.get("moe_config") if cfg.get("use_moe") else None  # Yuan-M32 nests its MoE settings
        if isinstance(moe, dict):
            cfg = {**cfg, "num_experts": moe.get("moe_num_experts"), "num_experts_per_tok": moe.get("moe_top_k"),
                   "moe_intermediate_size": moe.get("ffn_hidden_size"), "norm_topk_prob": moe.get("norm_topk_prob", True)}
        num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
        kv_heads, v_cache_dim = int(cfg.get("num_key_value_heads") or heads), None
        if model_type in ("deepseek_v2", "deepseek_v3"):  # MLA caches one latent + rope-key row per token
            try:
                head_dim = int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
            except KeyError as e:
                raise ConfigError(f"config.json lacks required MLA field {e.args[0]!r}") from None
            kv_heads, v_cache_dim = 1, 0
        window, layer_types = _sliding_window(cfg, model_type, layers)
        if model_type == "qwen2":  # q/k/v bias is built in; Qwen2-MoE names it qkv_bias
            qkv_bias = True
        elif model_type == "qwen2_moe":
            qkv_bias = bool(cfg.get("qkv_bias", True))
        else:
            qkv_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=archs[0],
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            v_cache_dim=v_cache_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            rope_freqs=tuple(float(f) for f in cfg.get("rope_freqs") or ()),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", 1.0)),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
            # save_pretrained drops values equal to the class default, and Yuan's default is tied
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "yuan")),
            attention_bias=qkv_bias,
            o_proj_bias=qkv_bias and model_type not in ("qwen2", "qwen2_moe", "mistral", "mixtral"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            hidden_act=cfg.get("hidden_act", "silu"),
            sliding_window=window,
            layer_types=layer_types,
            num_experts=num_experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", model_type not in ("qwen2_moe", "olmoe", "deepseek_v2"))),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            raw=dict(cfg),
        )


# the causal-LM class transformers' Auto classes pick for a config without `architectures`
_ARCH_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "yuan": "YuanForCausalLM", "olmoe": "OlmoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
}


def _sliding_window(cfg: dict, model_type: str, layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(window, per-layer types) as transformers resolves them. Qwen configs carry a `sliding_window`
    that counts only with `use_sliding_window`; Mistral/Mixtral's counts whenever it is set."""
    window = cfg.get("sliding_window")
    if model_type.startswith("qwen") and not cfg.get("use_sliding_window"):
        window = None
    if not window:  # None or 0 (Qwen2-MoE writes 0 for "off")
        return None, ()
    types = cfg.get("layer_types")
    if types is None and model_type.startswith("qwen"):
        mwl = int(cfg.get("max_window_layers", 28))
        if model_type == "qwen2_moe":  # every other layer below max_window_layers (transformers' rule)
            types = ["sliding_attention" if (i + 1) % 2 and i < mwl else "full_attention" for i in range(layers)]
        elif model_type != "qwen3_moe":  # qwen2, qwen3: the layers from max_window_layers on
            types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(layers)]
    types = tuple(types or ())
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad:
        raise ConfigError(f"unsupported layer_types value(s) {bad}; supported: full_attention, sliding_attention")
    if types and len(types) != layers:
        raise ConfigError(f"layer_types has {len(types)} entries for {layers} layers")
    return int(window), types


def _positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: int | None = None
    """Blocks in the pool; None sizes it from `kv_cache_memory_gb` (or the budget, or the context on CPU)."""
    kv_cache_memory_gb: float | None = None
    """KV memory to allocate when `num_kv_blocks` is None; None sizes it from the budget (a measured warm-up
    on CUDA) or, on the CPU, to every sequence at full length capped at 2 GiB."""
    enable_prefix_caching: bool = True
    """Reuse full blocks whose token prefix was already computed (hash of the block chain)."""
    kv_cache_dtype: str = "auto"
    """auto (the model's dtype) | fp8 (e4m3) | int8: quantized K/V with one fp32 scale per token and head,
    half the bytes of bf16; attention reads the codes directly (see kv/cache.py)."""

    def __post_init__(self) -> None:
        _positive(block_size=self.block_size)
        if self.kv_cache_dtype not in ("auto", "fp8", "int8"):
            raise ConfigError(f"kv_cache_dtype {self.kv_cache_dtype!r}: choose auto, fp8 or int8")
        if self.num_kv_blocks is not None:
            _positive(num_kv_blocks=self.num_kv_blocks)
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ConfigError(f"kv cache memory must be > 0 GB, got {self.kv_cache_memory_gb}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64
    """Sequences running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decodes count 1 each; prefill chunks fill the rest)."""
    max_model_len: int | None = None
    """Longest prompt + output; None means the model's `max_position_embeddings`."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so decodes are never starved."""

    def __post_init__(self) -> None:
        _positive(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive(max_model_len=self.max_model_len)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                              f"({self.max_num_seqs}): every running sequence needs a token each step")


def parse_bytes(text: str | int | float) -> int:
    """'16GiB', '512MiB', '16G', '1.5e9' or a number of bytes -> bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*", text)
    if not m:
        raise ConfigError(f"cannot read {text!r} as a size; write e.g. 16GiB, 512MiB or 2e9")
    base = 1024 if m[3] or m[2] else 1000
    return int(float(m[1]) * base ** " kmgt".index(m[2].lower() or " "))


@dataclass(frozen=True)
class OffloadConfig:
    """Where weights live when the device cannot hold the model (see `offload/placement.py`)."""

    gpu_memory_budget: int | None = None
    """Bytes ferrylm may allocate on the device (weights, KV cache, buffers); None: the whole model if it
    fits in `gpu_memory_utilization` of the device, else placed under that share."""
    gpu_memory_utilization: float | None = None
    """Share of the device's total memory to use (vLLM's spelling); ignored when a budget is given, and on the CPU
    engine (no device memory: the model stays whole in host memory)."""
    place: tuple[str, ...] = ()
    """Placement rules `SELECTOR=gpu|cpu`, applied in order (grammar in `offload/placement.py`)."""
    expert_cache_policy: str = "lru"
    """How cached expert slots are evicted: lru | lfu."""
    expert_profile: str | None = None
    """JSON file of per-layer expert popularity; its hottest experts start resident and stay pinned (not pinned
    where a budget without slots a layer has the layer copy through them). None: the profile `profile_experts`
    saved for this model, if there is one."""
    profile_experts: int = 0
    """At start, after loading: run this many warm-up prompts (`ferry profile`'s mix, 64 tokens each),
    record the experts' routing and save it as this model's profile (`$FERRYLM_CACHE_DIR/expert-profiles/`),
    which placement uses from the next start on; 0: off."""
    stream_buffers: int = 2
    """Device buffers that streamed (non-resident) dense layers rotate through."""
    experts: str = "auto"
    """Where expert misses run: auto (the measured cost model splits copies and host compute; copy-only on
    the CPU engine), gpu (copy every miss to the device: 2 slots a layer, or under a budget without room for them
    one pool of slots the layers with no expert on the device share), cpu (compute every miss on the host's cores:
    no slots). Under auto a budget with no room even for one shared slot places none: a layer left without a free
    slot computes its copy-road misses on the host."""
    cpu_threads: int | None = None
    """Threads for host experts (torch intra-op threads); None keeps torch's default."""
    cpu_numa_node: int | None = None
    """NUMA node for host experts: the worker thread that computes them (and torch's threads inside it) runs
    on its CPUs and the host tier's weights are allocated from its memory; None: `numa_node`'s binding, if any."""
    mapped_experts: bool = True
    """Decode steps read missed experts in place from pinned host memory over PCIe (no copy first, no
    host sync, CUDA-graphed) and the slots follow the routing; off: every miss is copied into a slot."""
    cpu_share: float | None = None
    """Hybrid decode: the host's share of each step's missed experts (with `hybrid_split`, of each missed
    expert's intermediate columns; else of the misses, whole); the kernel reads the rest in place at the same
    time. None: balanced from the calibration (1 with `experts=cpu`, 0 with `experts=gpu`)."""
    hybrid_split: bool = True
    """Hybrid decode (dense or packed expert banks) splits each missed expert along its intermediate: the GPU reads
    the first (1 - cpu_share) of its columns in place while the host computes the rest, so both sides
    work on every miss; off: whole experts go to one side or the other (per step, `cpu_share` of them)."""

    def __post_init__(self) -> None:
        if self.gpu_memory_budget is not None and self.gpu_memory_budget <= 0:
            raise ConfigError(f"gpu memory budget must be > 0 bytes, got {self.gpu_memory_budget}")
        u = self.gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {u}")
        if self.expert_cache_policy not in ("lru", "lfu"):
            raise ConfigError(f"expert cache policy {self.expert_cache_policy!r}: choose lru or lfu")
        if self.experts not in ("auto", "gpu", "cpu"):
            raise ConfigError(f"experts {self.experts!r}: choose auto, gpu or cpu")
        if self.profile_experts < 0:
            raise ConfigError(f"profile_experts must be >= 0 prompts, got {self.profile_experts}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.cpu_numa_node is not None and self.cpu_numa_node < 0:
            raise ConfigError(f"cpu_numa_node must be >= 0, got {self.cpu_numa_node}")
        if self.cpu_share is not None and not 0 <= self.cpu_share <= 1:
            raise ConfigError(f"cpu_share must be in [0, 1], got {self.cpu_share}")
        if self.stream_buffers < 2:
            raise ConfigError(f"stream_buffers must be >= 2 (double buffering), got {self.stream_buffers}")


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine spreads over processes (docs/parallel.md)."""

    tensor_parallel_size: int = 1
    """Ranks each layer is sharded over (Megatron-style: heads, MLP and expert intermediate, vocabulary)."""
    pipeline_parallel_size: int = 1
    """Stages the layers are split into (contiguous layer ranges, one process group per stage)."""
    expert_parallel: bool = False
    """Shard whole experts over the tensor-parallel ranks instead of each expert's intermediate features."""
    parallel_timeout: float = 60.0
    """Seconds a collective may wait for a rank before the step fails naming it (a hung or dead worker)."""
    tp_groups: str = "auto"
    """Which devices form a tensor-parallel group: auto (from the topology: GPUs under one NUMA node or PCIe
    switch together) or in-order (ranks 0..N-1 on devices 0..N-1)."""

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        _positive(tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size)
        if not self.parallel_timeout > 0:
            raise ConfigError(f"parallel_timeout must be > 0 seconds, got {self.parallel_timeout}")
        if self.tp_groups not in ("auto", "in-order"):
            raise ConfigError(f"tp_groups {self.tp_groups!r}: choose auto or in-order")


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLMEngine` needs: where the model is and how to run it."""

    model: str | None = None
    """HF directory, .gguf file or ferry store; None means the embedded SmolLM2 GGUF."""
    device: str = "cpu"
    dtype: str = "auto"
    """float32 | bfloat16 | float16 | auto (float32 on CPU, the checkpoint's dtype on GPU)."""
    seed: int = 0
    """Seed of the generator that unseeded random sampling shares (a request with its own `seed` uses that)."""
    tokenizer: str | None = None
    """Tokenizer directory if not beside the model."""
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    offload: OffloadConfig = OffloadConfig()
    parallel: ParallelConfig = ParallelConfig()
    moe_backend: str = "auto"
    """auto: the fused Triton kernel for resident expert banks on CUDA (bf16/fp16); torch: the per-expert
    reference loop everywhere."""
    attention_backend: str = "auto"
    """auto: the Triton paged kernels on CUDA (decode reads the KV blocks in place, one launch for every
    prefill chunk), the torch path elsewhere; torch: the plain reference path everywhere; triton: the
    kernels, an error where they cannot run."""
    enforce_eager: bool = False
    """Never use CUDA graphs (they serve pure decode steps of dense models on CUDA)."""
    async_scheduling: str = "auto"
    """auto | on | off: schedule and launch step N+1 while the device runs step N, reading step N's tokens one
    step late (a stop costs one dropped token, never shown). auto: on for one CUDA process, the model resident
    or offloaded; off on the CPU (nothing to overlap) and under tensor / pipeline parallelism (never supported
    there). Structured outputs and penalties fall back to synchronous steps while such a
    request runs (engine/llm_engine.py)."""
    dequantize: bool = False
    """Dequantize packed weights (GGUF Q4_0/Q4_1/Q8_0 blocks, a quantized store) to dense `dtype` at load:
    the plain reference path (more memory, slower). Off: they stay packed and quantized kernels run on them."""
    threads: int | None = None
    """CPU threads for torch's kernels (None: torch's default, or the NUMA node's CPUs with `numa_node`)."""
    numa_node: int | None = None
    """Run on this NUMA node's CPUs and allocate from its memory (None: no binding)."""
    model_overrides: dict = field(default_factory=dict)
    """Family-specific options (e.g. Yuan's `rope_dtype`)."""

    def __post_init__(self) -> None:
        if self.moe_backend not in ("auto", "torch"):
            raise ConfigError(f"moe_backend {self.moe_backend!r}: choose auto or torch")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"attention_backend {self.attention_backend!r}: choose auto, torch or triton")
        if isinstance(self.async_scheduling, bool):  # LLM(async_scheduling=True) reads as on
            object.__setattr__(self, "async_scheduling", "on" if self.async_scheduling else "off")
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ConfigError(f"async_scheduling {self.async_scheduling!r}: choose auto, on or off")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if self.numa_node is not None and self.numa_node < 0:
            raise ConfigError(f"numa_node must be >= 0, got {self.numa_node}")

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)


SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "offload": OffloadConfig,
            "parallel": ParallelConfig}


def engine_config(**options) -> EngineConfig:
    """An `EngineConfig` from flat options: each name is a field of `EngineConfig` or of one of its
    sections (`CacheConfig`, `SchedulerConfig`, `OffloadConfig`); field names are unique across them,
    so `LLM(...)` and the CLI spell every knob once, here."""
    owner = {f.name: sec for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    top = {f.name for f in dataclasses.fields(EngineConfig)} - set(SECTIONS)
    flat, per = {}, {sec: {} for sec in SECTIONS}
    for k, v in options.items():
        if k in top:
            flat[k] = v
        elif k in owner:
            per[owner[k]][k] = v
        else:
            raise ConfigError(f"unknown engine option {k!r}")
    if isinstance(per["offload"].get("gpu_memory_budget"), str):
        per["offload"]["gpu_memory_budget"] = parse_bytes(per["offload"]["gpu_memory_budget"])
    if "place" in per["offload"]:
        per["offload"]["place"] = tuple(per["offload"]["place"] or ())
    return EngineConfig(**flat, **{sec: cls(**per[sec]) for sec, cls in SECTIONS.items()})


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a config dataclass (the CLI's help text), read from the source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body, docs = tree.body[0].body, {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
