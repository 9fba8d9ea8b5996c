"""The engine's start-up memory decision as pure functions, so `ferry plan` calls the same code the model
runner calls: the device budget, the activation reserve, and (placement, KV bytes) from the model's
tensor groups. Knows configs and byte counts; never touches a device (the caller reads total/free memory).
On CUDA the model runner then re-sizes the KV pool from a measured warm-up step: `warmup_activations` and
`kv_after_warmup` are that rule, called by the runner with what it measured and by `ferry plan` with what it
predicts (`plan/memory.py` `step_activation_bytes`).
"""

from __future__ import annotations

from ferrylm.config import CacheConfig, ModelConfig, OffloadConfig, SchedulerConfig
from ferrylm.errors import ConfigError
from ferrylm.offload.placement import (SHARED_EXPERT_SLOTS, Placement, TensorGroup, min_expert_slots,
                                      minimum_device_bytes, place)


def device_budget(oc: OffloadConfig, total: int | None, free: int | None) -> int | None:
    """Device bytes the engine may allocate: the configured budget, else on CUDA the smaller of
    `gpu_memory_utilization` (0.9) of the total and 0.9 of what is free now; None on the CPU."""
    if oc.gpu_memory_budget is not None:
        return oc.gpu_memory_budget
    if total is None or free is None:
        return None
    return int(min((oc.gpu_memory_utilization or 0.9) * total, 0.9 * free))


def step_bound(cfg: ModelConfig, sc: SchedulerConfig, elt: int) -> int:
    """An upper estimate of what the warm-up measures (`ModelRunner._warmup_peak`): one step's activations at
    the token budget, the logits of `max_num_seqs` rows and library workspaces."""
    T = sc.max_num_batched_tokens
    inner = max(cfg.intermediate_size, cfg.moe_intermediate_size * max(cfg.num_experts_per_tok, 1))
    width = 6 * cfg.hidden_size + 3 * inner + 3 * cfg.num_attention_heads * cfg.head_dim
    return T * width * elt + sc.max_num_seqs * cfg.vocab_size * 4 + (256 << 20)


def graph_tokens(sc: SchedulerConfig, graphs: bool, piecewise: bool, limit: int | None = None) -> int:
    """Tokens of the largest step CUDA graphs capture: the token budget with piecewise prefill graphs (fully
    resident models), `max_num_seqs` with decode graphs only (offloaded ones), 0 eager; at most `limit`
    (`graph_token_limit`: packed expert banks)."""
    n = 0 if not graphs else sc.max_num_batched_tokens if piecewise else sc.max_num_seqs
    return n if limit is None else min(n, limit)


def graph_token_limit(cfg: ModelConfig, packed_experts: bool) -> int | None:
    """The most tokens a captured step of this model may hold (`layers/fused_moe.graph_token_limit`: a packed
    expert bank's prefill path cannot be captured); None: no bound. Steps past it run eagerly."""
    if not cfg.num_experts or not packed_experts:
        return None
    from ferrylm.layers.fused_moe import graph_token_limit as bank_limit

    return bank_limit(cfg.num_experts, cfg.num_experts_per_tok, True)


def graph_step_floor(cfg: ModelConfig, graph_tokens: int, elt: int, experts_format: str | None) -> int:
    """Device bytes a captured step of `graph_tokens` tokens holds at least in its graph pool, whatever share of the
    warm-up step `warmup_activations` gives it: an expert bank of `experts_format` that the decode kernel computes at
    that many tokens (`layers/fused_moe_decode.BY_FORMAT_MAX_TOKENS`: NF4 at any captured batch) keeps its fp32 split-K
    partials there (`decode_bytes`), which a prefill-sized warm-up step (on `dequant_rows`) does not hold in
    proportion: Mixtral's 64-token graph step ~33 MB against ~16 MB of a 2048-token step's 500 MB. 0 otherwise."""
    if not graph_tokens or not cfg.num_experts or experts_format is None:
        return 0
    from ferrylm.layers import fused_moe_decode as fmd

    fmt = kernel_format(experts_format)
    if fmt not in fmd.BY_FORMAT_MAX_TOKENS:
        return 0
    T = graph_tokens if fmd.taken_by_format(fmt, graph_tokens) else fmd.BY_FORMAT_MAX_TOKENS[fmt]
    return fmd.decode_bytes(T * cfg.num_experts_per_tok, cfg.num_experts, cfg.hidden_size,
                            cfg.moe_intermediate_size or cfg.intermediate_size, fmd.by_format_config(fmt, False, T), elt)


def kernel_format(scheme: str | None) -> str | None:
    """The fused kernel's format name (`layers/fused_moe.FORMATS`) of a weight scheme as stores and plans spell it
    ("nf4", "fp8-g128", "int4/32": the part before any group suffix)."""
    return None if scheme is None else scheme.split("/")[0].split("-")[0]


def activation_reserve(cfg: ModelConfig, sc: SchedulerConfig, elt: int, graph_tokens: int = 0,
                       workspace: int = 0, experts_format: str | None = None) -> int:
    """Device bytes the placement keeps free for activations: `warmup_activations` of `step_bound`, the rule
    the CUDA engine re-sizes its KV pool with after measuring the step. One rule for both, so a setup the
    placement accepts at the minimum KV is one the warm-up keeps (unless the measured step exceeds the
    bound): a reserve of one step against a warm-up that counted graph pools as a second step refused it."""
    return warmup_activations(step_bound(cfg, sc, elt), sc, cfg.vocab_size, graph_tokens, workspace,
                              graph_step_floor(cfg, graph_tokens, elt, experts_format))


def fixed_kv_bytes(cc: CacheConfig, per_block: int) -> int | None:
    """KV bytes the cache config fixes (`num_kv_blocks` or `kv_cache_memory_gb`), None when it leaves them
    to the budget."""
    if cc.num_kv_blocks is not None:
        return cc.num_kv_blocks * per_block
    if cc.kv_cache_memory_gb is not None:
        return int(cc.kv_cache_memory_gb * 2**30)
    return None


def size_memory(groups: list[TensorGroup], per_block: int, max_model_len: int, cc: CacheConfig,
                sc: SchedulerConfig, oc: OffloadConfig, budget: int | None, reserve: int,
                on_cpu: bool, resident_reserve: int | None = None) -> tuple[Placement, int]:
    """(placement, KV bytes): the whole model resident when it fits (keeping `resident_reserve` free,
    default `reserve`: a resident model's graphs may hold more), else placed under the budget keeping `reserve`.
    Layers with host experts keep `min_expert_slots` device slots; a budget too small for them places none, and the
    layers left with no expert on the device share a pool of `SHARED_EXPERT_SLOTS` slots; with `--experts auto` a
    budget too small for that too places no pool (such a layer then runs its copy-road misses on the host's cores)."""
    blocks_per_seq = (max_model_len + cc.block_size - 1) // cc.block_size
    fixed_kv = fixed_kv_bytes(cc, per_block)
    slots = min_expert_slots(oc.experts)
    if budget is None:  # CPU engine without a budget: everything "resident" in host memory
        need = sc.max_num_seqs * blocks_per_seq  # every sequence at full length, capped at 2 GiB
        kv = fixed_kv if fixed_kv is not None else min(need, max(2, int(2 * 2**30 // per_block))) * per_block
        return place(groups, None, oc.place, stream_buffers=oc.stream_buffers, min_expert_slots=slots), kv
    min_kv = (blocks_per_seq + 2) * per_block  # one sequence at full length, and the scratch block
    kv = fixed_kv if fixed_kv is not None else min_kv
    weights = sum(g.nbytes for g in groups)
    forced_host = any(r.split("=")[-1].strip().lower() == "cpu" for r in oc.place)
    whole = reserve if resident_reserve is None else resident_reserve
    if weights + whole + kv <= budget and not forced_host:
        placement = place(groups, None, oc.place, stream_buffers=oc.stream_buffers, min_expert_slots=slots)
        if fixed_kv is None:  # resident: the KV pool takes the rest, as much as every sequence can use
            kv = max(kv, min(budget - weights - whole, sc.max_num_seqs * blocks_per_seq * per_block
                             if on_cpu else budget))
        return placement, kv
    if fixed_kv is None:  # offloaded: weights are worth more than idle KV; a sixth of the budget
        kv = max(min_kv, min(budget // 6, sc.max_num_seqs * blocks_per_seq * per_block))
    room = budget - reserve - kv
    if weights <= room and not forced_host:  # all would fit, but then resident (prefill graphs): keep its reserve
        room = budget - whole - kv
    least = minimum_device_bytes(groups, oc.place, stream_buffers=oc.stream_buffers, min_expert_slots=slots)
    shared, pooled = 0, least
    if room < least and slots:  # no room for the slots a layer: the layers left bare share a pool of slots (one:
        # each copy waits for the compute before it, still far faster than the host's cores in prefill)
        for n in (SHARED_EXPERT_SLOTS, 1) if SHARED_EXPERT_SLOTS else ():  # (0: no pool, benchmarks' A/B)
            pooled = minimum_device_bytes(groups, oc.place, stream_buffers=oc.stream_buffers, min_expert_slots=0,
                                          shared_slots=n)
            if room >= pooled:
                slots, shared, least = 0, n, pooled
                break
        else:
            if oc.experts == "gpu":  # the least it could run in: one shared slot
                least = pooled
    if room < least and oc.experts == "auto":  # no room for the pool either: layers without a slot run their
        # copy-road misses on the host's cores (`PlacedWeights._start_hybrid`), as --experts cpu does
        least = minimum_device_bytes(groups, oc.place, stream_buffers=oc.stream_buffers, min_expert_slots=0)
        slots = shared = 0
    if room < least:
        raise ConfigError(
            f"GPU memory budget {gib(budget)} is too small for this model: it needs at least "
            f"{gib(least + budget - room)} ({gib(least)} of weights: norms, routers, the LM head, placement "
            f"rules, stream buffers and expert slots; {gib(kv)} of KV cache; {gib(budget - room - kv)} for "
            f"activations){_slot_hint(groups, oc, least)}")
    return place(groups, room, oc.place, stream_buffers=oc.stream_buffers, min_expert_slots=slots,
                 shared_slots=shared), kv


def gib(n: int) -> str:
    """Bytes for a memory message: GiB, or MiB below one."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _slot_hint(groups: list[TensorGroup], oc: OffloadConfig, least: int) -> str:
    """How much less `--experts auto` / `cpu` need, when expert slots are part of `least` (`--experts gpu`)."""
    if oc.experts != "gpu":
        return ""
    fewer = minimum_device_bytes(groups, oc.place, stream_buffers=oc.stream_buffers, min_expert_slots=0)
    if fewer >= least:
        return ""
    return (f"; copying experts in needs at least one device slot the MoE layers share, {gib(least - fewer)} of it: "
            f"--experts auto or cpu (misses without a slot run on the host's cores) need none")


def cublas_workspace_bytes(major: int) -> int:
    """cuBLAS's workspace for one (thread, stream) that runs a GEMM, on a GPU of compute capability `major`.x:
    torch's default `CUBLAS_WORKSPACE_CONFIG`, 32 MiB on Hopper and later, :4096:2:16:8 before. Allocated through
    torch's allocator on the stream's first GEMM and kept: the CUDA graphs' side stream (`engine/cuda_graph.py`
    side_stream) gets its own at the first capture, after the warm-up that sizes the KV pool."""
    return 4096 * 8 * 1024 if major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def warmup_activations(step_peak: int, sc: SchedulerConfig, vocab_size: int, graph_tokens: int,
                       workspace: int = 0, graph_floor: int = 0) -> int:
    """Device bytes the KV pool leaves for activations after the warm-up: one step's peak at the token budget
    (measured by the runner) plus the sampler's two [max_num_seqs, V] fp32 work tensors, and again the share of
    that a captured step of `graph_tokens` tokens holds in the graphs' private pools (`graph_tokens`: a whole
    step with piecewise prefill graphs, `max_num_seqs` rows of it with decode graphs only) plus, with graphs,
    `workspace`: their side stream's cuBLAS workspace (`cublas_workspace_bytes`); the graphs' share at least
    `graph_floor` (`graph_step_floor`)."""
    one = step_peak + 2 * sc.max_num_seqs * vocab_size * 4
    graphs = one * min(graph_tokens, sc.max_num_batched_tokens) // sc.max_num_batched_tokens
    graphs = max(graphs, graph_floor) if graph_tokens else 0
    return one + graphs + (workspace if graph_tokens else 0)


def kv_after_warmup(budget: int, used: int, activations: int, fixed_kv: int | None, per_block: int,
                    max_model_len: int, block_size: int) -> tuple[int, int]:
    """(KV bytes, bytes left): what is left of the budget once the weights take `used` device bytes and one
    step's activations `activations` (`warmup_activations`), or the fixed size the cache config asks for (the
    caller warns when it exceeds what is left). Raises `ConfigError` when less than one full-length sequence's
    KV is left."""
    left = budget - used - activations
    if fixed_kv is not None:
        return fixed_kv, left
    need = (max_model_len + block_size - 1) // block_size + 2
    if left < need * per_block:
        raise ConfigError(f"GPU memory budget {budget / 2**30:.2f} GiB is too small: after the weights "
                          f"({used / 2**30:.2f} GiB) and one step's measured activations "
                          f"({activations / 2**30:.2f} GiB) it leaves {max(left, 0) / 2**30:.2f} GiB, "
                          f"less than one sequence of {max_model_len} tokens needs in KV cache "
                          f"({need * per_block / 2**30:.2f} GiB); lower --max-model-len or "
                          f"--max-num-batched-tokens, or raise the budget")
    return left, left
