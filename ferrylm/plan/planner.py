"""`make_plan()`: one model, one machine, one workload -> what fits where, and how fast it can go.

Memory: the engine's tensor groups of its own module on `meta` (`memory.py`), split over TP ranks and PP
stages, then the engine's start-up decision itself (`offload/memory.py`: device budget, activation reserve,
placement and KV bytes), fed with the GPU profile's memory instead of `torch.cuda.mem_get_info`. Verdict:
fits resident (offload unnecessary), needs offload (the placement and its PCIe bytes per decode token), or
cannot run (and what to change). Speed: `estimate.py`. Knows nothing about printing (`report.py`).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace

from ferrylm.config import CacheConfig, ModelConfig, OffloadConfig, SchedulerConfig, parse_bytes
from ferrylm.errors import ConfigError, UnsupportedArchitectureError
from ferrylm.offload.memory import (activation_reserve, cublas_workspace_bytes, device_budget, fixed_kv_bytes,
                                   graph_step_floor, graph_token_limit, graph_tokens, kv_after_warmup, size_memory,
                                   step_bound, warmup_activations)
from ferrylm.offload.placement import GPU, HOST, MIN_EXPERT_SLOTS, TensorGroup
from ferrylm.plan import catalog, estimate, hardware, hit_rate, quality
from ferrylm.plan.memory import (DTYPE_BYTES, LOAD_WORKSPACE_BYTES, QUANT_SCHEMES, WeightFormat, analytical_groups,
                                 analytical_kv_bytes_per_token, kv_bytes_per_block, kv_pool, meta_model, param_count,
                                 rope_table_bytes, state_bytes_per_seq, step_activation_bytes, summarize,
                                 tp_dense_params, weight_groups)
from ferrylm.weights.source import fp8_block

CUDA_CONTEXT_BYTES = 600 * 2**20
"""CUDA context + cuBLAS workspace of one process: what `mem_get_info` shows used before the first tensor."""
HOST_PIN_SHARE = 0.8
"""Share of host memory the plan lets host-resident weights take (the OS and the process need the rest)."""


@dataclass(frozen=True)
class PlanOptions:
    """A plan's inputs, spelled as the engine takes them."""

    model: str
    """Catalog name, config.json, model directory, .gguf or ferry store."""
    gpu: str = "1xH200"
    host: str = "local"
    dtype: str = "auto"
    """bfloat16 | float16 | float32 | auto: as the engine on a GPU (`model_runner.resolve_dtype`), the checkpoint's
    float16, else bfloat16; the plan holds the dtype it resolved."""
    quant: str | None = None
    """int8 | fp8 | nf4 | int4 | q8_0: a ferry store converted with --quant (Linear weights packed; experts
    packed where the engine keeps them packed: int4, nf4)."""
    expert_quant: str | None = None
    """The experts' scheme when it differs from --quant (e.g. nf4 experts, the rest bf16); None: --quant's."""
    group_size: int | None = None
    """NF4 / int4 group size the store was converted with (`ferry convert --group-size`); None: a ferry store's own
    (its ferry.json), else 64."""
    expert_hit_rate: float | None = None
    """Share of routed experts found on the device, e.g. measured by a run; None: predicted from the routing
    (`plan/hit_rate.py`: `expert_profile`, `routing`, else uniform)."""
    expert_profile: str | None = None
    """The engine's `--expert-profile` FILE (written by `ferry profile`): each layer's hottest experts start
    resident and pinned, and its recorded routing predicts the hit rate."""
    routing: str | None = None
    """The routing that predicts the hit rate when the engine gets no profile: uniform, zipf:S (expert shares
    falling as rank^-S) or a recorded profile FILE (nothing pinned); None: uniform."""
    kv_cache_dtype: str = "auto"
    """auto = the model dtype; fp8 | int8: the engine's quantized cache (`--kv-cache-dtype`)."""
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_gb: float | None = None
    """Per GPU (GiB); None: what the engine leaves after the weights."""
    num_kv_blocks: int | None = None
    """KV blocks in the pool per GPU, as the engine's `--num-kv-blocks` (it wins over `kv_cache_memory_gb`); None: sized
    from the budget."""
    stream_buffers: int = 2
    """Device buffers streamed (host-resident) dense layers rotate through, as the engine's `--stream-buffers`."""
    dequantize: bool = False
    """Plan the engine's `--dequantize`: a GGUF's blocks, a quantized store's and a block-wise FP8 checkpoint's weights
    decoded to the dtype at load (held dense)."""
    gpu_memory_budget: int | str | None = None
    """Per GPU, what the engine may allocate (weights, KV, buffers), spelled as the engine's `--gpu-memory-budget`
    takes it: bytes, or a size such as 16GiB, 512MiB or 2e9 (`config.parse_bytes`: G and GB count 2^30)."""
    gpu_memory_budget_gb: float | None = None
    """Deprecated spelling of `gpu_memory_budget` in GB (10^9 bytes), kept for old command lines and scripts."""
    gpu_memory_utilization: float | None = None
    """Share of the GPU's memory to use when no budget is given (engine default 0.9)."""
    place: tuple[str, ...] = ()
    """The engine's placement rules, e.g. experts=cpu, layers.0-7=gpu."""
    tp: int = 1
    pp: int = 1
    prompt_len: int = 512
    output_len: int = 256
    concurrency: int | None = None
    """Sequences decoding together; None: max_num_seqs."""
    enforce_eager: bool = False
    measure_bandwidth: bool = False
    """Measure this machine's pinned host-to-device rate (CUDA) and host memory read rate and plan with them
    instead of the profiles'."""
    experts: str = "auto"
    """Where expert misses run, as the engine's `--experts`: auto (hybrid: the host computes a balanced share
    beside the GPU), gpu (GPU only), cpu (every miss on the host)."""
    cpu_share: float | None = None
    """Hybrid decode: share of the misses the host computes (the engine's `--cpu-share`); None: balanced."""
    mapped_experts: bool = True
    """Decode steps read missed experts in place over PCIe (the engine's default); off (`--no-mapped-experts`):
    every miss is copied into a slot, and no hybrid decode."""


@dataclass
class Plan:
    options: PlanOptions
    model_name: str
    architecture: str
    gpus: int
    gpu: str
    host: str
    params_total: int
    params_active: int
    weights_bytes: dict
    """kind -> bytes over the whole model."""
    per_gpu: dict
    """weights (on the device, incl. stream buffers and expert slots), weights_all (this rank's share); kv and
    kv_tokens as the CUDA engine ends with them (after its measured warm-up, predicted: step_activations, the
    warm-up step's peak, and warmup_activations, what the pool leaves for it), kv_tokens_range (the measured
    step between its floor and the reserve), kv_planned / kv_tokens_planned (the reserve-based start-up figure,
    which the CPU engine keeps); kv_bytes_per_token (this rank's, as kv and kv_tokens: its KV heads, its stage's
    layers), kv_bytes_per_token_model (the whole model's), state, activations (the reserve), cuda_context, peak,
    capacity, budget (bytes); stage: the PP stage shown when --place rules chose it (the one they put the most in
    host memory), None: the heaviest."""
    verdict: str
    """fits | offload | cannot"""
    placement: dict
    """gpu_bytes, host_bytes, host_groups, streamed_layers, expert_slots, resident_experts (cached MoE layer ->
    experts resident), pcie_bytes_per_decode_token."""
    speed: dict | None
    """decode_batch1, decode_concurrent, prefill_tok_s, ttft_s, ... and the assumptions; None when the verdict is
    cannot (nothing runs, so no speed is predicted)."""
    notes: list[str] = field(default_factory=list)
    """Verdict, warnings and advice, most important first."""
    counted_from: str = "model"
    """model (the engine's module on meta) | config (analytical count)."""
    quality: list[dict] = field(default_factory=list)
    """Quantization quality notes for the chosen --quant / --expert-quant (`plan/quality.py`), with sources."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["options"] = asdict(self.options)
        return d


def _stages(groups: list[TensorGroup], layers: int, pp: int) -> list[list[TensorGroup]]:
    """Each PP stage's groups, as the engine splits the layers: stage 0 holds the embeddings, the last the LM head and
    the final norm."""
    from ferrylm.parallel.pipeline import stage_layers  # the engine's split

    stages = []
    for s in range(pp):
        lo, hi = stage_layers(layers, pp, s).start, stage_layers(layers, pp, s).stop
        stages.append([g for g in groups if (g.layer is not None and lo <= g.layer < hi) or (
            g.layer is None and ((g.kind == "embed" and s == 0) or (g.kind != "embed" and s == pp - 1)))])
    return stages


def _held(gs: list[TensorGroup]) -> list[int]:
    """The layers a PP stage's groups hold, in order."""
    return sorted({g.layer for g in gs if g.layer is not None})


def _rules_for(rules: tuple[str, ...], gs: list[TensorGroup], layers: int) -> tuple[str, ...]:
    """The --place rules the PP stage holding `gs` applies: the engine's own rule (`ModelRunner._place`) drops one
    that names only layers of other stages; one of no layer at all is every stage's."""
    from ferrylm.offload.placement import PlaceRule

    held = _held(gs)

    def another(text: str) -> bool:
        r = PlaceRule.parse(text)
        lo, hi = r.layers or (None, None)
        return r.layers is not None and not any(lo <= i <= hi for i in held) and lo < layers

    return tuple(r for r in rules if not another(r))


def _planned_stage(groups: list[TensorGroup], layers: int, pp: int, rules: tuple[str, ...]) -> int | None:
    """The PP stage the plan shows when --place rules put bytes in host memory: the one whose own rules put the most
    there (the slowest stage, which every token waits for), the heaviest of those; None: the heaviest."""
    from ferrylm.offload.placement import PlaceRule

    def forced_host(gs: list[TensorGroup]) -> int:
        tier: dict[str, str] = {}
        for r in map(PlaceRule.parse, _rules_for(rules, gs, layers)):
            tier.update({g.name: r.tier for g in gs if r.matches(g)})
        return sum(g.nbytes for g in gs if tier.get(g.name) == HOST)

    stages = _stages(groups, layers, pp)
    forced = [forced_host(gs) for gs in stages]
    if not any(forced):
        return None
    return max(range(pp), key=lambda s: (forced[s], sum(g.nbytes for g in stages[s])))


def _stage_groups(groups: list[TensorGroup], layers: int, tp: int, pp: int,
                  stage: int | None = None) -> list[TensorGroup]:
    """A GPU's share: PP stage `stage` (None: the heaviest, stage 0 or the last), every group split over TP ranks
    (norms and routers replicated)."""
    stages = _stages(groups, layers, pp)
    worst = stages[stage] if stage is not None else max(stages, key=lambda gs: sum(g.nbytes for g in gs))
    if tp == 1:
        return worst
    return [g if g.kind in ("norm", "router") else replace(g, nbytes=-(-g.nbytes // tp)) for g in worst]


def make_plan(opts: PlanOptions, advise: bool = True) -> Plan:
    """`advise`: also try the alternatives the notes suggest (a plan of its own each, without advice)."""
    _check_counts(opts)
    if opts.group_size is not None and (opts.group_size < 2 or opts.group_size % 2):  # 0 too: not "not given"
        raise ConfigError(f"--group-size {opts.group_size}: an even number of columns, e.g. 32, 64 or 128")
    budget_bytes(opts)  # a bad or doubled budget is refused before anything is counted
    if opts.dtype not in DTYPE_BYTES and opts.dtype != "auto":
        raise ConfigError(f"--dtype {opts.dtype!r}: choose one of {', '.join(DTYPE_BYTES)} or auto")
    name, cfg = catalog.resolve_model(opts.model)
    mc = _model_config(name, cfg)
    if opts.dtype == "auto":  # as the engine resolves it on a GPU (`model_runner.resolve_dtype`)
        opts = replace(opts, dtype="float16" if mc.torch_dtype == "float16" else "bfloat16")
    stored = catalog.store_quantization(opts.model)
    opts, store_notes = _store_quant(opts, stored)
    if opts.dequantize and (opts.quant or opts.expert_quant):  # the engine decodes what the store holds packed
        store_notes.append(f"--dequantize: the engine decodes the {opts.quant or opts.expert_quant} weights to "
                           f"{opts.dtype} at load: counted dense")
        opts = replace(opts, quant=None, expert_quant=None)
    quant_chosen = (opts.quant or opts.expert_quant) and not (stored and (stored.get("scheme") or "none") != "none")
    for flag, q in (("--quant", opts.quant), ("--expert-quant", opts.expert_quant)):
        if q is not None and q not in QUANT_SCHEMES:
            raise ConfigError(f"{flag} {q!r}: choose one of {', '.join(QUANT_SCHEMES)}")
    if opts.expert_hit_rate is not None and not 0 <= opts.expert_hit_rate <= 1:
        raise ConfigError(f"--expert-hit-rate {opts.expert_hit_rate}: a share between 0 and 1")
    if opts.kv_cache_dtype not in ("auto", "fp8", "int8"):  # as `CacheConfig` takes it: the model's dtype or codes
        raise ConfigError(f"--kv-cache-dtype {opts.kv_cache_dtype!r}: the engine takes auto (the model's dtype), fp8 "
                          "or int8")
    quant_kv = opts.kv_cache_dtype in ("fp8", "int8")  # 1-byte codes + a 4-byte scale per token and head
    kv_dtype = opts.dtype
    if opts.expert_quant and not mc.num_experts:  # as --routing: it quantized nothing, yet its quality cost was noted
        raise ConfigError(f"--expert-quant {opts.expert_quant}: this model has no experts (--quant quantizes its "
                          "Linear weights)")
    if opts.max_model_len is not None and opts.max_model_len > mc.context_limit:  # `LLMEngine._max_model_len`
        raise ConfigError(f"--max-model-len {opts.max_model_len}: the engine refuses it: over the model's "
                          f"{mc.context_limit} positions")
    n_gpu, gpu = hardware.parse_gpu(opts.gpu)
    refused_layout = layout_error(mc, opts.tp, opts.pp, opts.dtype)
    if refused_layout:
        # a TP degree past the attention heads never splits them: the list stops there
        most = min(max(n_gpu, opts.tp), max(1, mc.num_attention_heads))
        takes = [t for t in range(1, most + 1) if not layout_error(mc, t, 1, opts.dtype)]
        raise ConfigError(f"--tp {opts.tp} --pp {opts.pp}: the engine refuses it: {refused_layout}"
                          + (f" (its --tp up to {most}: {', '.join(map(str, takes))})"
                             if opts.tp > 1 else ""))
    if opts.measure_bandwidth:
        gpu = hardware.with_measured_h2d(gpu)
    if opts.tp * opts.pp > n_gpu:
        raise ConfigError(f"--tp {opts.tp} x --pp {opts.pp} needs {opts.tp * opts.pp} GPUs; --gpu {opts.gpu!r} has {n_gpu}")
    host = hardware.parse_host(opts.host)
    if opts.measure_bandwidth:
        host = hardware.with_measured_read(host)
    if opts.experts not in ("auto", "gpu", "cpu"):
        raise ConfigError(f"--experts {opts.experts!r}: choose auto, gpu or cpu")
    if opts.cpu_share is not None and not 0 <= opts.cpu_share <= 1:
        raise ConfigError(f"--cpu-share {opts.cpu_share}: a share between 0 and 1")
    block = None if opts.dequantize else fp8_block(name, cfg)  # a block-wise FP8 checkpoint: counted as it loads,
    # unless planned as a store (or held dense: --dequantize)
    fmt = (WeightFormat(opts.dtype, "fp8", expert_quant=opts.expert_quant, fp8_block=block[1])
           if block and not opts.quant else WeightFormat(opts.dtype, opts.quant, opts.group_size, opts.expert_quant))
    tp_dense = opts.tp > 1 and fmt.experts_scheme is not None and bool(mc.num_experts)
    if tp_dense:  # tensor-parallel ranks read their expert slices dense (a Linear's slice stays packed where it tiles:
        fmt = replace(fmt, experts_packed=False)  # `QuantizedTensor.narrow`; expert banks pack in one rank only)
    if opts.tp > 1 and fmt.quant and not block:  # and a row-parallel slice that would cut a group dense
        fmt = replace(fmt, dense_params=tp_dense_params(mc, fmt, opts.tp, opts.dtype))
    unpacked = fmt.experts_scheme is not None and opts.dtype not in ("bfloat16", "float16")
    if unpacked:  # the engine packs expert banks for a half-precision dtype only (`ModelRunner`: the fused kernel's)
        fmt = replace(fmt, experts_packed=False)
    graphs_family = piecewise = False
    gguf_notes: list[str] = []
    fused_moe = opts.dtype in ("bfloat16", "float16")  # `FusedExperts.supports_tensors` on a CUDA device
    try:
        model = meta_model(mc, opts.dtype)
    except UnsupportedArchitectureError:  # no model class: count from config.json
        model = None
        groups, count = analytical_groups(cfg, fmt) if _analytical(cfg) else _no_count(mc)
        dense_groups = analytical_groups(cfg, WeightFormat(opts.dtype))[0] if fmt != WeightFormat(opts.dtype) else groups
        state_per_seq, counted = 0, "config"
        kv_per_token = analytical_kv_bytes_per_token(cfg, 1 if quant_kv else DTYPE_BYTES[kv_dtype])
    else:
        dense_groups = weight_groups(model)
        if fmt.quant is None and fmt.expert_quant is None and not opts.dequantize:  # a GGUF's packed blocks, as the
            # CUDA engine keeps them
            kept = _gguf_packed(opts.model, model)
            if kept:
                gguf_notes.append(f"the GGUF's {kept} Q4_0 / Q4_1 / Q8_0 matrices stay packed as the engine keeps them on "
                             f"CUDA (`CausalLM.note_packed_linears`): {_gb(sum(g.nbytes for g in weight_groups(model)))}"
                             f" instead of {_gb(sum(g.nbytes for g in dense_groups))} in {opts.dtype} (the engine's "
                             "--dequantize holds them dense)")
        groups, count, state_per_seq, counted = weight_groups(model, fmt), param_count(model), \
            state_bytes_per_seq(model), "model"
        kv_per_token = kv_bytes_per_block(mc, opts.block_size, kv_dtype,
                                          opts.kv_cache_dtype if quant_kv else "auto") // opts.block_size
        from ferrylm.layers.moe import Experts

        banks = [m for m in model.modules() if isinstance(m, Experts)]
        fused_moe = fused_moe and all(b.act_name == "silu" for b in banks)
        # on CUDA resident banks run the fused kernel (graph-safe), cached ones read misses in place
        graphs_family = model.cuda_graphs and (not banks or fused_moe)
        piecewise = model.piecewise
    max_len = opts.max_model_len or mc.context_limit  # the engine's default: the positions the model serves
    conc = opts.concurrency or opts.max_num_seqs
    early = store_notes + gguf_notes  # notes on the model's weights and the workload, placed after the verdict's
    # the workload as the engine can run it: it refuses a prompt of the context's length or longer (`LLMEngine`: no
    # room to generate) and stops a sequence at the context
    prompt_len = min(opts.prompt_len, max_len - 1)
    where = f"the context of {max_len} tokens (" + ("--max-model-len)" if opts.max_model_len else "the model's)")
    if prompt_len < opts.prompt_len:
        early.append(f"warning: --prompt-len {opts.prompt_len} does not fit {where}: the engine refuses such prompts; "
                      f"predicted for {prompt_len}-token prompts")
    elif opts.prompt_len + opts.output_len > max_len:
        early.append(f"warning: --prompt-len {opts.prompt_len} + --output-len {opts.output_len} exceeds {where}: a "
                     f"sequence stops at {max_len} ({max_len - prompt_len} generated)")
    seq_tokens = min(max_len, prompt_len + opts.output_len)
    if conc > opts.max_num_seqs:
        early.append(f"warning: --concurrency {conc} is over --max-num-seqs {opts.max_num_seqs}: the engine decodes at "
                     f"most {opts.max_num_seqs} together (the rest wait); predicted at {opts.max_num_seqs}")
        conc = opts.max_num_seqs
    ranks = opts.tp * opts.pp

    # -- memory of the heaviest GPU, decided as the engine decides ----------------------------------
    _check_place(opts.place, groups)
    stage = _planned_stage(groups, mc.num_hidden_layers, opts.pp, opts.place) if opts.pp > 1 and opts.place else None
    mine = _stage_groups(groups, mc.num_hidden_layers, opts.tp, opts.pp, stage)
    stages = _stages(groups, mc.num_hidden_layers, opts.pp)
    shown = stage if stage is not None else max(range(opts.pp), key=lambda s: sum(g.nbytes for g in stages[s]))
    place = _stage_rules(opts.place, stages, shown, mc.num_hidden_layers, early)
    # as the engine caches: each rank its KV heads (one, replicated, when fewer than TP ranks), its stage's layers
    from ferrylm.layers.parallel_linear import kv_heads_per_rank
    from ferrylm.parallel.pipeline import stage_layers

    hk = max(1, mc.num_key_value_heads)
    stage_len = max(len(stage_layers(mc.num_hidden_layers, opts.pp, s)) for s in range(opts.pp))
    per_block = -(-kv_per_token * opts.block_size * kv_heads_per_rank(hk, opts.tp) * stage_len
                  // (hk * mc.num_hidden_layers))
    cc = CacheConfig(block_size=opts.block_size, kv_cache_memory_gb=opts.kv_cache_memory_gb,
                     num_kv_blocks=opts.num_kv_blocks)
    try:  # the engine's own checks, said with plan's flags
        sc = SchedulerConfig(max_num_seqs=opts.max_num_seqs, max_num_batched_tokens=opts.max_num_batched_tokens,
                             max_model_len=max_len)
    except ConfigError as e:
        raise ConfigError(f"--max-num-batched-tokens {opts.max_num_batched_tokens} --max-num-seqs "
                          f"{opts.max_num_seqs}: the engine refuses it: {e}") from None
    try:
        oc = OffloadConfig(gpu_memory_budget=budget_bytes(opts), gpu_memory_utilization=opts.gpu_memory_utilization,
                           place=place, stream_buffers=opts.stream_buffers, experts=opts.experts)
    except ConfigError as e:
        raise ConfigError(f"--gpu-memory-utilization {opts.gpu_memory_utilization}: the engine refuses it: {e}") \
            from None
    capacity = gpu.memory_bytes
    budget = device_budget(oc, capacity, capacity - CUDA_CONTEXT_BYTES)
    # `ModelRunner._graph_tokens`: what graph pools hold beside the step (TP / PP ranks run eager)
    graphs_planned = not opts.enforce_eager and ranks == 1
    # the graphs' side stream's cuBLAS workspace: 32 MiB from Hopper on (the profiles with fp8), 8 MiB before
    ws = cublas_workspace_bytes(9 if gpu.fp8 else 8)
    packed = bool(mc.num_experts) and fmt.expert_bytes(mc.moe_intermediate_size or 1, mc.hidden_size) is not None
    limit = graph_token_limit(mc, packed)  # packed expert banks: captured steps stop where their prefill path begins
    xfmt = fmt.experts_scheme if packed else None  # a captured step's floor (`graph_step_floor`): the decode kernel's
    reserve = activation_reserve(mc, sc, DTYPE_BYTES[opts.dtype], graph_tokens(sc, graphs_planned, False, limit), ws,
                                 xfmt)
    resident_tokens = graph_tokens(sc, graphs_planned, piecewise, limit)  # the captured steps were it resident
    resident_reserve = activation_reserve(mc, sc, DTYPE_BYTES[opts.dtype], resident_tokens, ws, xfmt)
    # per-sequence state (Yuan's filter) is whole on every rank; one more row is the graphs' scratch row
    state = state_per_seq * (opts.max_num_seqs + 1) if state_per_seq else 0
    notes: list[str] = []
    try:
        placement, kv_budget = size_memory(mine, per_block, max_len, cc, sc, oc, budget, reserve, on_cpu=False,
                                           resident_reserve=resident_reserve)
    except ConfigError as e:
        placement, kv_budget, refused = None, 0, str(e)
    kv_planned, kv_tokens_planned = kv_pool(kv_budget, per_block, opts.block_size)
    device_weights = placement.device_bytes() if placement else 0
    # on CUDA the engine then measures one step and re-sizes the pool (`offload/memory.py` kv_after_warmup)
    elt = DTYPE_BYTES[opts.dtype]
    experts_on_host = placement is not None and any(g.kind == "experts" and placement.tier[g.name] == HOST for g in mine)
    moe_layers = {g.layer for g in mine if g.kind == "experts"}
    host_layers = {g.layer for g in mine if g.kind == "experts" and placement and placement.tier[g.name] == HOST}
    held_whole = placement is not None and bool(moe_layers - host_layers)  # a MoE layer with every expert on the GPU
    step, floor = step_activation_bytes(mc, opts.max_num_batched_tokens, opts.max_num_seqs, max_len, elt, packed,
                                        experts_on_host, placement.largest_cache() if placement else None, held_whole,
                                        xfmt)
    pool_tokens = graph_tokens(sc, graphs_planned, piecewise and placement is not None and placement.fully_resident,
                               limit)
    pool_floor = graph_step_floor(mc, pool_tokens, elt, xfmt)
    # what the engine holds once loaded: the placed weights, the RoPE tables and a cuBLAS workspace
    held = device_weights + rope_table_bytes(model, mc, max_len) + LOAD_WORKSPACE_BYTES if placement else 0

    def after_warmup(step_peak: int) -> int:
        return kv_after_warmup(budget, held, warmup_activations(step_peak, sc, mc.vocab_size, pool_tokens, ws, pool_floor),
                               fixed_kv_bytes(cc, per_block), per_block, max_len, opts.block_size)[0]

    kv_range = (0, 0)
    if placement is not None:
        try:
            kv_bytes = after_warmup(step)
        except ConfigError as e:
            placement, kv_bytes, refused = None, 0, f"{e} (the warm-up's activations as predicted)"
        else:  # the measured step lies between the floor and the engine's upper estimate (its reserve's step)
            lo = max(step, step_bound(mc, sc, elt))
            try:
                kv_range = (kv_pool(after_warmup(lo), per_block, opts.block_size)[1],
                            kv_pool(after_warmup(floor), per_block, opts.block_size)[1])
            except ConfigError as e:
                kv_range = (0, kv_pool(after_warmup(floor), per_block, opts.block_size)[1])
                notes.append(f"warning: if the warm-up measures activations near the reserve the engine refuses to "
                             f"start: {e}")
    else:
        kv_bytes = 0
    kv, kv_tokens = kv_pool(kv_bytes, per_block, opts.block_size)
    host_bytes = placement.bytes_on(HOST) * ranks if placement else 0
    if placement is not None and stage is not None:  # stages whose rules differ: each one's own placement, summed
        host_bytes = 0
        for i, gs in enumerate(stages):
            rules = _rules_for(opts.place, gs, mc.num_hidden_layers)
            try:
                theirs = placement if i == stage else size_memory(
                    _stage_groups(groups, mc.num_hidden_layers, opts.tp, opts.pp, i), per_block, max_len, cc, sc,
                    replace(oc, place=rules), budget, reserve, on_cpu=False, resident_reserve=resident_reserve)[0]
            except ConfigError:  # a stage that cannot be placed: its bytes counted as the shown stage's
                theirs = placement
            host_bytes += theirs.bytes_on(HOST) * opts.tp
    if placement is None:
        verdict = "cannot"
        notes.append(f"cannot run: {refused}")
    elif host_bytes > HOST_PIN_SHARE * host.memory_bytes:
        verdict = "cannot"
        notes.append(f"cannot run: {_gb(host_bytes)} of weights would live in host memory, over "
                     f"{HOST_PIN_SHARE:.0%} of the host's {_gb(host.memory_bytes)}")
        if advise:  # a host with the memory (what --host accepts: its CPU, that memory), planned
            need = math.ceil(host_bytes / HOST_PIN_SHARE / 1e9)
            bigger = f"{opts.host.partition(',')[0].strip()},{need}GB"
            try:
                roomy = make_plan(replace(opts, host=bigger), advise=False)
            except ConfigError:
                roomy = None
            notes.append(f"or more host memory: --host {bigger} holds these weights in host memory"
                         + (f" (planned so: {roomy.verdict}, decode {roomy.speed['decode_batch1']['tok_s']:.1f} tok/s "
                            "at batch 1)" if roomy is not None and roomy.verdict != "cannot" else ""))
    else:
        verdict = "fits" if placement.fully_resident else "offload"
    device_weights = placement.device_bytes() if placement else 0
    # a plan that cannot run holds nothing
    per_gpu = dict(weights=device_weights, held=held if placement else 0, weights_all=sum(g.nbytes for g in mine), kv=kv,
                   kv_planned=kv_planned, kv_tokens_planned=kv_tokens_planned, kv_tokens_range=kv_range,
                   step_activations=step,
                   warmup_activations=warmup_activations(step, sc, mc.vocab_size, pool_tokens, ws, pool_floor),
                   kv_bytes_per_token=per_block // opts.block_size if per_block % opts.block_size == 0
                   else per_block / opts.block_size, kv_bytes_per_token_model=kv_per_token,
                   kv_tokens=kv_tokens, state=state, activations=reserve,
                   cuda_context=CUDA_CONTEXT_BYTES,
                   peak=held + kv + state + step + 2 * opts.max_num_seqs * mc.vocab_size * 4 + CUDA_CONTEXT_BYTES
                   + (ws if pool_tokens else 0), graph_workspace=ws if pool_tokens else 0,
                   capacity=capacity, budget=budget, stage=stage)
    if verdict != "cannot" and per_gpu["peak"] > capacity:  # a budget over the card: nothing in the engine caps it
        verdict = "cannot"
        notes.append(f"cannot run: {_budget_flag(opts)} is more than the {gpu.name} has ({_gb(capacity)}, "
                     f"{_gb(CUDA_CONTEXT_BYTES)} of it the CUDA context's): the engine sizes its KV cache to the budget "
                     f"({_gb(kv)}) and would fail allocating it (peak {_gb(per_gpu['peak'])}); give at most "
                     f"{(capacity - CUDA_CONTEXT_BYTES) // 2**30}GiB, or leave the budget to the engine"
                     if budget_bytes(opts) is not None else
                     f"cannot run: the predicted peak ({_gb(per_gpu['peak'])}) is over the {gpu.name}'s "
                     f"{_gb(capacity)}")

    # -- speed ---------------------------------------------------------------------------------------
    E, k = count.num_experts, count.top_k
    rate = {"bfloat16": "bf16", "float16": "fp16", "float32": "bf16"}[opts.dtype]
    tflops = gpu.tflops.get(rate) or gpu.tflops.get("fp16") or gpu.tflops.get("bf16")
    if not tflops:
        raise ConfigError(f"the {gpu.name} profile has no bf16 or fp16 tensor rate to time compute with")
    if rate not in gpu.tflops and opts.dtype == "bfloat16":  # e.g. the T4: the engine runs bf16 there all the same
        early.append(f"warning: the {gpu.name} has no bf16 tensor cores: compute is timed at its fp16 peak "
                     f"({tflops:g} TFLOP/s), an upper bound: its bf16 GEMMs run slower, at no rate measured here; "
                     "--dtype float16 runs at that peak")
    if opts.dtype == "float32":
        tflops /= 8  # no fp32 tensor cores: TF32 at best (a Turing card's fp32 peak is its fp16 tensor peak / 8)
    if "guess" in gpu.source:  # "guess", "NVML + guess" (`local_gpus`), "..., pinned H2D measured"
        early.append(f"warning: the {gpu.name} has no built-in profile: its HBM rate ({gpu.hbm_gbs:g} GB/s) and TFLOP/s "
                     "are guesses, so are the speeds; --gpu NAME picks a profile (ferry plan --list)")
    layers = math.ceil(mc.num_hidden_layers / opts.pp)
    act_b, link = DTYPE_BYTES[opts.dtype], gpu.nvlink_gbs or gpu.h2d_gbs
    ctx = prompt_len + (seq_tokens - prompt_len) / 2
    dense_of = {g.name: g.nbytes for g in _stage_groups(dense_groups, mc.num_hidden_layers, opts.tp, opts.pp, stage)}
    tier = placement.tier if placement else {g.name: GPU for g in mine}

    def hbm_cost(g: TensorGroup) -> int:
        # a packed Linear weight on CUDA (layers/packed_linear.py): counted as reading the codes, writing the dense
        # weight and reading it again (the plain `Dequantize` pass it replaced; its in-tile decode is latency-bound
        # like the packed experts', `estimate.PACKED_TIME`: TODO fit from benchmarks/bench_packed_linear.py)
        dense = dense_of[g.name]
        return g.nbytes + 2 * dense if g.nbytes < dense and g.kind != "experts" else g.nbytes

    dense_gpu = sum(hbm_cost(g) for g in mine if tier[g.name] == GPU and g.kind not in ("experts", "embed"))
    dense_host = [g for g in mine if tier[g.name] == HOST and g.kind not in ("experts", "embed")]
    streamed_bytes = sum(g.nbytes for g in dense_host)
    moe = _moe_layers(mine, tier, dense_of, fmt.experts_scheme, gpu.fp8)
    profile = opts.expert_profile
    if profile is None and opts.routing is None and E:  # the engine's own choice: a `--profile-experts` profile
        from ferrylm.offload.expert_profile import saved

        profile = saved(opts.model)
    # (a placement without slots a layer: the engine pins none, a layer copies through its residents)
    route = hit_rate.routing(opts.routing, profile, mc.architecture, E, k,
                             sorted({g.layer for g in groups if g.kind == "experts"}),
                             pin=placement is None or placement.slot_mode != "pool")
    slots = placement.expert_slots if placement else {}

    hits: dict[tuple, float] = {}

    # mapped batch-1 steps on a traced profile: layer -> (hit rate, promotions a step) by the engine's slot policy
    # (larger batches: the popularity model; the trace is one sequence at a time)
    cached_layers = {l: (m["resident"], m["resident"] + slots.get(l, 0)) for l, m in moe.items() if m["host"]}
    replay = (hit_rate.replayed(route, cached_layers, E) if route.traces is not None and cached_layers
              and opts.expert_hit_rate is None else None)

    def hit_of(l: int, tokens: int, mapped: bool) -> float:
        m = moe[l]
        if m["host"] == 0:
            return 1.0
        if opts.expert_hit_rate is not None:
            return opts.expert_hit_rate
        if mapped and tokens == 1 and replay is not None:
            return replay[l][0]
        key = (l, tokens, mapped)
        if key not in hits:
            hits[key] = hit_rate.hit_rate(route.of(l), m["experts"], k, m["resident"], m["resident"] + slots.get(l, 0),
                                          route.pinned, tokens, mapped)
        return hits[key]

    def distinct(l: int, tokens: int) -> float:
        return hit_rate.distinct(route.of(l), E, k, tokens)

    def tokens_per_expert(tokens: int) -> float:
        if not moe:
            return 1.0
        return tokens * k / (sum(distinct(l, tokens) for l in moe) / len(moe))

    cached = [l for l, m in moe.items() if m["host"]]
    from ferrylm.layers.fused_moe import decode_group_experts, prefill_path
    from ferrylm.offload.expert_cache import CachedExperts

    mapped_tokens = min((1 if moe[l]["nbytes"] > CachedExperts.large_expert_bytes else CachedExperts.mapped_tokens
                         for l in cached), default=None) if fused_moe and opts.mapped_experts else None
    # without a trace, a batch-1 step's promotions: the same slot policy on independent tokens drawn from the routing
    # (a stated hit rate keeps the count per miss: the policy's draws would not hold it)
    sampled_promos = (hit_rate.sampled_promotions(route, cached_layers, E, k) if replay is None and cached_layers
                      and mapped_tokens and opts.expert_hit_rate is None else None)
    graph_base = graphs_family and not opts.enforce_eager and ranks == 1 and placement is not None
    # hybrid decode (offload/placed_weights.py `_start_host_decode`): cached experts on the mapped path, experts !=
    # gpu, in any format the host has a rate for (dense, or packed: `estimate.host_expert_eff`); unless a share is
    # given the engine balances the host's expert rate against the in-place read rate by `cost_model.cpu_share`, which
    # the plan calls too, on its own figures for the engine's calibrated ones
    from ferrylm.offload.cost_model import Costs, cpu_share, split_misses

    packed_any = any(m["packed"] for m in moe.values())
    scheme = fmt.experts_scheme if packed_any else None  # the host bank's format (None: dense)
    host_gbs = estimate.host_expert_eff(scheme, host.avx512) * host.read_rate_gbs
    # the host's matmul rate (assumed, one node's cores as its read rate is one node's): what bounds its experts at
    # many rows an expert, `--experts cpu`'s prefill
    host_tflops = estimate.host_tflops(host.cores_per_socket, host.amx, host.avx512)
    costs = None
    if cached and host_gbs > 0:
        nb = sum(moe[l]["nbytes"] for l in cached) / len(cached)
        params = sum(moe[l]["dense"] for l in cached) / len(cached) / DTYPE_BYTES[opts.dtype]
        equiv = sum(moe[l]["inplace_equiv"] for l in cached) / len(cached)
        call = estimate.HOST_EXPERT_CALL_S
        # what the engine's calibration measures (`offload/calibration.costs_from`; the hand-off and a call's cost
        # timed through the real hand-off): one expert's copy, its host time at n tokens (the call's cost in it), its
        # bytes read in place (packed ones at their `PACKED_TIME`, in bytes a second of the packed expert)
        costs = Costs(copy_s=nb / (gpu.h2d_gbs * 1e9),
                      cpu_s=lambda n: estimate.host_expert_s(nb, scheme, host_gbs, n, params, host_tflops) + call,
                      expert_bytes=int(nb), inplace_gbs=estimate.INPLACE_EFF * gpu.h2d_gbs * nb / equiv,
                      handoff_s=estimate.HANDOFF_S, call_s=call)
    from ferrylm.offload.placed_weights import REBALANCE_MIN_CHANGE

    share = start = seen = m0 = m1 = 0.0
    if cached and mapped_tokens is not None and opts.experts != "gpu" and costs is not None:
        # a batch-1 step's misses a layer, as the plan predicts them
        m1 = sum(distinct(l, 1) * (1 - hit_of(l, 1, True)) for l in cached) / len(cached)
        if opts.cpu_share is not None or opts.experts == "cpu":
            share = opts.cpu_share if opts.cpu_share is not None else 1.0
        else:
            # the engine's start (`PlacedWeights._balanced_share`): uniform routing, k * (1 - slots / E) misses a
            # layer, every miss split along its intermediate (`hybrid_split`, every bank format); at 0 it stays off
            m0 = sum(k * (1 - min(cached_layers[l][1], moe[l]["experts"]) / moe[l]["experts"])
                     for l in cached) / len(cached)
            start = cpu_share(costs, misses=m0, split=True)
            # then, once (`_maybe_rebalance`), the misses its first mapped steps see: the plan's, applied when the
            # share moves by REBALANCE_MIN_CHANGE or to 0 (the share tuner's climb on step times is not modelled)
            seen = cpu_share(costs, misses=m1, split=True) if start > 0 else 0.0
            share = seen if start > 0 and (abs(seen - start) >= REBALANCE_MIN_CHANGE or seen <= 0) else start
    # the copy road (steps over `mapped_tokens`) sends misses to the host as the engine's `split_misses` does (a
    # packed bank's kernels built in the background once seen: `HostExperts.build_later`, ready in the steady state
    # timed here). A dense bank's split was counted as copies until session 37 (it had gained 6% over copies alone,
    # Mixtral 16L batch 1); then a 4-layer Mixtral's batch 8 under 2 GiB on an H100 decoded 480 tok/s where copies
    # alone at the hit rate measured allow at most 434 and the plan said 250
    road_split = costs is not None and opts.experts != "gpu"
    # `--experts cpu`: the copy road's misses all run on the host, prefill's too (nothing is copied in); so do a
    # layer's that has no slot (`--experts auto` under a budget with no room for them: `memory.size_memory`)
    host_prefill = road_split and opts.experts == "cpu"
    # layers with no expert on the device copy through the slots they share (`Placement.shared_slots`) when the
    # budget has room for them, else (auto) compute those misses on the host
    pooled = set(placement.pool_layers()) if placement else set()
    shared = placement.shared_slots if placement else 0
    slotless = sorted(l for l, (_, capacity) in cached_layers.items()
                      if capacity == 0 and l not in pooled) if costs is not None else []
    host_road = set(cached) if host_prefill else set(slotless)

    def host_takes(misses: float, tokens: float) -> float:
        """Expected misses of a copy-road layer the engine computes on the host: `split_misses` on the whole
        numbers of misses either side of `misses`, `tokens` each, weighed by the fraction."""
        t, lo = max(1, round(tokens)), int(misses)

        def on_host(n: int) -> int:
            return len(split_misses(dict.fromkeys(range(n), t), costs, opts.experts)[1]) if n else 0

        return (1 - (misses - lo)) * on_host(lo) + (misses - lo) * on_host(lo + 1)

    # the routed experts' parameters one token touches: their GEMMs run in the fused kernel (at `estimate.moe_mfu`)
    expert_active = count.experts * count.top_k // count.num_experts if count.num_experts and fused_moe else 0
    # the embedding is a lookup (no FLOPs); the LM head's matmul runs on the rows that sample: every decode row, a
    # prefill chunk's last row only (the count holds the vocabulary matrix once when tied, twice when not)
    vocab = mc.vocab_size * mc.hidden_size
    body = max(0, count.active - expert_active - vocab * (1 if mc.tie_word_embeddings else 2))

    def decode_groups(n: float, one: bool, m: dict) -> float:
        """`dequant_rows`' decode groups for n experts: one a round for large experts computed one a round, else
        `decode_group_experts` a group."""
        return n if one or n <= 0 else math.ceil(n / decode_group_experts(m["dense"]))

    def experts_cost(batch: int, prefill: bool = False) -> dict:
        """HBM (time-equivalent) bytes of hits, copied and in-place miss bytes, host seconds of one step."""
        mapped = not prefill and mapped_tokens is not None and batch <= mapped_tokens
        out = dict(hbm=0.0, all=0.0, copy=0.0, inplace=0.0, inplace_equiv=0.0, host=0.0, host_experts_s=0.0, promote=0.0,
                   promotions=0.0, road_host=0.0, road_misses=0.0,
                   layers=[], copy_layers=[],
                   mapped=mapped and bool(cached),
                   hit=sum(hit_of(l, batch, mapped) for l in cached) / len(cached) if cached else None)
        tpe = tokens_per_expert(batch)
        # a packed bank's eager steps of PACKED_DENSE_MIN_ROWS rows an expert on average decode each expert they use
        # into dense weights first (`fused_moe.prefill_path`, on the model's expert count): prefill chunks, and decode
        # batches past the graphs' bound (`graph_token_limit`: below it, never), mapped steps (tables) never
        dequant = not mapped and fused_moe and prefill_path(batch * k, E, 1, True) == "dequant"
        out["dequant"] = out["dequant_groups"] = 0.0
        for l, m in moe.items():
            d, h = distinct(l, batch), hit_of(l, batch, mapped)
            dq = m["nbytes"] + m["dense"] if m["packed"] and dequant else 0.0
            if dq:  # its dense GEMMs then read the dense weights
                m = {**m, "hbm_equiv": m["dense"]}
            elif m["packed"]:  # the kernel's in-tile decode, at its rate for this many rows an expert
                m = {**m, "hbm_equiv": estimate.packed_hbm_equiv(m["nbytes"], m["dense"], fmt.experts_scheme, gpu.fp8,
                                                                 gpu.hbm_gbs, tpe)}
            hits, misses = d * h, d * (1 - h)
            # hits are read from HBM; so are copied misses once in their slots (in-place misses are not)
            out["hbm"] += (hits if mapped and m["host"] else d) * m["hbm_equiv"]
            out["all"] += d * m["hbm_equiv"]
            if not m["host"]:
                out["dequant"] += d * dq
                out["dequant_groups"] += decode_groups(d, False, m) if dq else 0.0
                out["layers"].append((d * m["hbm_equiv"], 0.0, 1.0))
                continue
            if mapped:
                gpu_misses = misses * (1 - share)
                # hybrid (share > 0): every miss split, the hits' launch then the misses' columns in place, one
                # after the other (`CachedExperts._forward_mapped`): the hit rate says how much of the layer's
                # HBM time the first launch takes
                out["layers"].append((d * m["hbm_equiv"], gpu_misses * m["inplace_equiv"], h ** d if gpu_misses else 1.0,
                                      h if share > 0 else None))
                out["inplace"] += gpu_misses * m["nbytes"]
                out["inplace_equiv"] += gpu_misses * m["inplace_equiv"]
                if slots.get(l, 0):  # the tally promotes misses into the layer's slots, landing before the next step
                    n = (replay[l][1] if replay is not None and batch == 1 else
                         sampled_promos[l] if sampled_promos is not None and batch == 1 else
                         min(estimate.PROMOTIONS_PER_MISS * misses, estimate.PROMOTIONS_PER_LAYER))
                    out["promotions"] += n
                    out["promote"] += n * m["nbytes"]
                # the host runs its share of every miss (split along the intermediate: one call each) or, at
                # share 1, every miss whole
                out["host_experts_s"] += (misses * share * estimate.host_expert_s(
                    m["nbytes"], scheme, host_gbs, batch * k / d, m["dense"] / DTYPE_BYTES[opts.dtype], host_tflops)
                    + estimate.HANDOFF_S
                    + misses * estimate.HOST_EXPERT_CALL_S) if share else 0.0
            else:  # the copy road: the misses split between copies and the host (`road_split`); all on the host
                # with --experts cpu, prefill's too (`host_prefill`)
                # TODO(issue 8): a prefill's split is not priced: the engine's auto sends a layer's copy-road misses
                # to the host where `split_misses` finds it faster beside the copies (an AMX host behind a slow link:
                # RTX 4090 + Xeon 8480C), in parallel with that layer's copies; pricing it needs the host's time per
                # layer in `StepCost.copy_layers` (max of the two queues), not step-wide in `host_experts_s`
                on_host = (misses if l in host_road else
                           host_takes(misses, batch * k / d) if road_split and not prefill else 0.0)
                out["copy"] += (misses - on_host) * m["nbytes"]
                out["hbm"] -= on_host * m["hbm_equiv"]  # computed where they lie, not from a slot
                out["host_experts_s"] += on_host * costs.cpu_s(batch * k / d) if on_host else 0.0
                out["road_host"] += on_host
                out["road_misses"] += misses
                if not prefill:  # the host's misses are computed where they lie, never decoded on the GPU
                    out["dequant"] += (d - on_host) * dq
                    out["dequant_groups"] += decode_groups(d - on_host, False, m) if dq else 0.0
                if prefill:  # layer by layer (`StepCost.copy_layers`): its copies, then its hits' and misses' work;
                    # the slots no hit holds take copies while the hits compute
                    free = max(0.0, m["resident"] + slots.get(l, 0) + (shared if l in pooled else 0) - hits)
                    one = CachedExperts.one_large_a_round and m["nbytes"] >= CachedExperts.large_expert_bytes
                    gm = misses - on_host  # the misses copied in and computed on the GPU
                    out["copy_layers"].append((gm * m["nbytes"], hits * m["hbm_equiv"], gm * m["hbm_equiv"],
                                               h, (1 - h) * gm / misses if misses else 0.0,
                                               min(gm, free) * m["nbytes"],
                                               (hits, gm) if one else None, (hits * dq, gm * dq),
                                               (decode_groups(hits, one, m), decode_groups(gm, one, m))
                                               if dq else (0.0, 0.0)))
                # prefill copies its misses in rounds, one fused launch a round: no per-expert host cost
                # (measured: <= 0.05 ms an expert, `estimate.CACHED_EXPERT_S`)
                out["host"] += 0.0 if prefill else estimate.CACHED_EXPERT_S * d
        return out

    def decode(batch: int) -> dict:
        x = experts_cost(batch)
        # steps past the captured bound (`graph_token_limit`: packed banks) run eagerly
        graphs = graph_base and (limit is None or batch <= limit) and (
            verdict == "fits" or (not dense_host and (not cached or x["mapped"])))
        cost = estimate.StepCost(
            hbm_bytes=dense_gpu + streamed_bytes, kv_bytes=batch * ctx * per_block / opts.block_size,  # this rank's KV
            expert_hbm_bytes=x["hbm"],
            expert_all_bytes=x["all"],
            tokens_per_expert=tokens_per_expert(batch),
            pcie_bytes=streamed_bytes + x["copy"], inplace_bytes=x["inplace_equiv"], promotion_bytes=x["promote"],
            promotions=x["promotions"],
            mapped_layers=tuple(x["layers"]) if x["mapped"] else (), host_s=x["host"], mapped=x["mapped"],
            host_experts_s=x["host_experts_s"], dequant_bytes=x["dequant"], dequant_groups=x["dequant_groups"],
            dequant_scheme=fmt.experts_scheme,
            flops=2 * (body + vocab) * batch / ranks, expert_flops=2 * expert_active * batch / ranks,
            layers=layers, graphs=graphs,
            layer_extra_s=estimate.LAYER_EXTRA_S.get(mc.model_type + ("-moe" if E else ""), 0.0) if graphs else 0.0,
            comm_s=2 * layers * estimate.allreduce_s(opts.tp, batch * mc.hidden_size * act_b, link))
        t = estimate.step_time(cost, gpu.hbm_gbs, gpu.h2d_gbs, tflops)
        seconds = t.seconds * opts.pp  # a token passes every stage
        return dict(batch=batch, tok_s=batch / seconds, step_ms=seconds * 1e3, binding=t.binding,
                    pcie_bytes_per_step=streamed_bytes + x["copy"] + x["inplace"] + x["promote"], cuda_graphs=graphs,
                    experts_path="resident" if not cached else "mapped" if x["mapped"] else "copy",
                    # the copy road's misses the host computes (`road_split`), a share of them
                    host_miss_share=x["road_host"] / x["road_misses"] if road_split and x["road_misses"] else None,
                    expert_hit_rate=x["hit"],
                    parts_ms={p: v * 1e3 for p, v in t.parts.items()})

    chunk = max(1, min(opts.max_num_batched_tokens, prompt_len))
    xp = experts_cost(chunk, prefill=True)
    # cached layers' experts run layer by layer (`StepCost.copy_layers`): out of the step-wide terms
    laid = xp["copy_layers"]
    # one MoE layer's routed-expert FLOPs on a rank (`expert_active` counts the whole model's MoE layers)
    layer_flops = 2 * expert_active * chunk / opts.tp / max(len({g.layer for g in groups if g.kind == "experts"}), 1)
    pre = estimate.step_time(estimate.StepCost(
        hbm_bytes=dense_gpu + streamed_bytes, expert_hbm_bytes=xp["hbm"] - sum(hb + mb for _, hb, mb, *_ in laid),
        tokens_per_expert=tokens_per_expert(chunk), pcie_bytes=streamed_bytes + xp["copy"] - sum(c for c, *_ in laid),
        host_s=xp["host"], host_experts_s=xp["host_experts_s"],
        copy_layers=tuple((c, hb, mb, hf * layer_flops, mf * layer_flops, f, *more) for c, hb, mb, hf, mf, f, *more in laid),
        dequant_bytes=xp["dequant"], dequant_groups=xp["dequant_groups"], dequant_scheme=fmt.experts_scheme,
        flops=(2 * body * chunk + 2 * vocab + 2 * mc.num_hidden_layers * chunk * chunk * mc.num_attention_heads
               * mc.head_dim) / ranks, expert_flops=2 * expert_active * chunk / ranks - len(laid) * layer_flops,
        layers=layers,
        comm_s=2 * layers * estimate.allreduce_s(opts.tp, chunk * mc.hidden_size * act_b, link)),
        gpu.hbm_gbs, gpu.h2d_gbs, tflops)
    d1 = decode(1)
    dn = decode(max(1, min(conc, kv_tokens // max(seq_tokens, 1))))
    hit_note = "given (--expert-hit-rate)" if opts.expert_hit_rate is not None else route.source
    mean_hit = d1["expert_hit_rate"] if cached else 1.0
    packed = fmt.experts_scheme if any(m["packed"] for m in moe.values()) else None
    speed = dict(decode_batch1=d1, decode_concurrent=dn, prefill_tok_s=chunk / (pre.seconds * opts.pp),
                 prefill_binding=pre.binding, prefill_parts_ms={p: v * 1e3 for p, v in pre.parts.items() if v},
                 ttft_s=math.ceil(prompt_len / chunk) * pre.seconds * opts.pp + d1["step_ms"] / 1e3,
                 prompt_len=prompt_len,
                 cuda_graphs=d1["cuda_graphs"],
                 assumptions=dict(hbm_eff=estimate.HBM_EFF, moe_hbm_eff=estimate.MOE_HBM_EFF if E else None,
                                  mfu=estimate.MFU, moe_mfu=estimate.moe_mfu(tokens_per_expert(chunk)) if expert_active else None, h2d_gbs=gpu.h2d_gbs,
                                  launch_us_per_layer=1e6 * (estimate.LAUNCH_GRAPH_S if d1["cuda_graphs"]
                                                             else estimate.LAUNCH_S),
                                  expert_hit_rate=mean_hit if cached else None,
                                  expert_hit_rate_from=hit_note if cached else None,
                                  inplace_eff=estimate.INPLACE_EFF if cached else None,
                                  mapped_tokens=mapped_tokens if cached else None,
                                  cpu_share=share if cached else None,
                                  host_expert_gbs=host_gbs if share else None,
                                  host_read_gbs=host.read_rate_gbs or None,
                                  packed_experts=packed,
                                  packed_time=estimate.packed_time(packed, gpu.fp8) if packed else None,
                                  dequant_gbs=estimate.dequant_gbs(gpu.hbm_gbs, packed) if packed else None))

    # -- placement summary and advice -----------------------------------------------------------------
    pl = dict(gpu_bytes=placement.bytes_on(GPU) if placement else 0,
              host_bytes=placement.bytes_on(HOST) if placement else 0,  # this rank's
              host_groups=sorted({g.kind for g in mine if placement and placement.tier[g.name] == HOST}),
              streamed_layers=placement.streamed_layers() if placement else [],
              stream_buffer_bytes=placement.stream_buffer_bytes if placement else 0,
              expert_slots=max(placement.expert_slots.values(), default=0) if placement else 0,
              shared_expert_slots=placement.shared_slots if placement else 0,  # (`Placement.pool_layers` share them)
              pool_layers=placement.pool_layers() if placement else [],
              resident_experts={l: moe[l]["resident"] for l in cached},
              pcie_bytes_per_decode_token=d1["pcie_bytes_per_step"] if verdict != "cannot" else 0)
    if verdict == "fits":
        notes.append("offload unnecessary: every weight stays on the GPU")
    elif verdict == "offload":
        notes.append(f"needs offload: {_gb(pl['host_bytes'])} of weights in host memory ({', '.join(pl['host_groups'])}); "
                     f"{_gb(d1['pcie_bytes_per_step'])} cross PCIe per decode token at batch 1")
        if not advise:
            pass
        elif budget_bytes(opts) is not None or place:
            free = make_plan(replace(opts, gpu_memory_budget=None, gpu_memory_budget_gb=None, place=()), advise=False)
            if free.verdict == "fits":
                notes.append(f"warning: the budget / --place forces offload of a model that fits: decode "
                             f"{d1['tok_s']:.1f} instead of {free.speed['decode_batch1']['tok_s']:.1f} tok/s, for nothing")
        else:  # the engine's default budget is at most 90% of free memory; an explicit budget may go higher
            # the placement leaves the reserve for activations; the warm-up then takes what it measured
            need = (per_gpu["weights_all"] + max(resident_reserve, warmup_activations(
                step, sc, mc.vocab_size, resident_tokens, ws, graph_step_floor(mc, resident_tokens, elt, xfmt)))
                    + held - device_weights
                    + (-(-max_len // opts.block_size) + 2) * per_block)
            gib = math.ceil(need / 2**30)
            more = (make_plan(replace(opts, gpu_memory_budget=f"{gib}GiB"), advise=False)
                    if gib * 2**30 <= capacity - CUDA_CONTEXT_BYTES else None)
            if more is not None and more.verdict == "fits":
                notes.append(f"with --gpu-memory-budget {gib}GiB it fits resident (the default budget is at most 90% "
                             f"of free memory): decode {more.speed['decode_batch1']['tok_s']:.1f} instead of "
                             f"{d1['tok_s']:.1f} tok/s at batch 1")
    if verdict == "cannot":
        notes += _advice(groups, opts, gpu, mc, budget, capacity - CUDA_CONTEXT_BYTES, reserve,
                         max_len * kv_per_token // ranks, advise)
    notes += early
    if verdict != "cannot" and kv_tokens < conc * seq_tokens:
        notes.append(f"KV holds {kv_tokens:,} tokens: {kv_tokens // max(seq_tokens, 1)} sequences of {seq_tokens} at "
                     f"once, fewer than the concurrency {conc} (the rest wait or are preempted)")
    if verdict == "offload" and cached:
        a = speed["assumptions"]
        path = (f"every miss runs on the host's cores (--experts cpu), nothing is copied in and no expert slot kept: "
                f"decode steps of up to {mapped_tokens} token(s) through hybrid decode, larger steps and prefill "
                f"through the copy path's rounds (their rows at an assumed {host_tflops:.0f} TFLOPS: {host.cores_per_socket} "
                f"cores x {estimate.HOST_GHZ:g} GHz x {estimate.HOST_MFU:.0%} of the ISA's peak; prefill "
                f"{speed['prefill_tok_s']:,.0f} tok/s)" if host_prefill and mapped_tokens else
                f"decode steps of up to {mapped_tokens} token(s) read expert misses in place over PCIe (mapped host "
                f"memory, {estimate.INPLACE_EFF:.0%} of the copy rate, "
                + ("CUDA-graphed when no layer is streamed" if ranks == 1 else "eager under TP / PP") + "); larger "
                "steps and prefill copy them into slots (eager)" if mapped_tokens else
                "expert misses are copied into slots (no fused kernel for this dtype / activation: eager)")
        conc_hit = dn["expert_hit_rate"]
        advice = ("" if opts.expert_hit_rate is not None or opts.expert_profile or opts.routing else
                  "; skewed routing raises it (the slots follow the routing), and at batch 1 so does a token reusing "
                  "the experts of the one before, which independent tokens leave out (the Qwen3-30B-A3B shape with "
                  "random weights, 16 layers under 4 GiB on an H100: 0.94 caught where they say 0.09, 134 against 35 "
                  "tok/s): pass "
                  "--expert-profile FILE (`ferry profile` records a decode trace the plan replays), --routing zipf:S "
                  "or a measured --expert-hit-rate")
        how = "" if opts.expert_hit_rate is not None else f"; {hit_rate.MODEL}" + (
            "; batch 1: the engine's slot policy replayed on the profile's decode trace" if route.traces else "")
        if any(capacity for _, capacity in cached_layers.values()):
            notes.append(f"experts: {path}; hit rate {a['expert_hit_rate']:.2f} at batch 1, {conc_hit:.2f} at batch "
                         f"{dn['batch']} ({hit_note}{how}){advice}")
        else:
            notes.append(f"experts: {path}; no cached layer holds an expert on the device (no hits)")
        rate = (f"{host_gbs:.0f} GB/s{f' of {scheme} codes' if scheme else ''}: "
                f"{estimate.host_expert_eff(scheme, host.avx512):.0%} of the host's "
                f"{'measured' if host.read_gbs else 'assumed'} {host.read_rate_gbs:.0f} GB/s read rate")
        if share:
            if opts.cpu_share is not None or opts.experts == "cpu":
                chosen = "given (--cpu-share)" if opts.cpu_share is not None else "every miss (--experts cpu)"
            elif share == start:
                chosen = "balanced as the engine balances it at start (`cost_model.cpu_share`, uniform routing): " + \
                    _share_why(costs, m0) + ("" if abs(seen - start) < 0.005 else
                                             f"; its re-balance on the {m1:.2f} misses a layer it should see says "
                                             f"{seen:.2f}, a move under {REBALANCE_MIN_CHANGE}: kept")
            else:
                chosen = (f"as the engine re-balances it (`cost_model.cpu_share`) on the misses it sees, from {start:.2f} "
                          f"at start (uniform routing, {m0:.2f} misses a layer): {_share_why(costs, m1)}")
            notes.append(f"hybrid decode: the host's cores compute {share:.0%} of the misses beside the kernel's "
                         f"in-place reads ({rate}), {chosen}; each host expert costs "
                         f"{estimate.HOST_EXPERT_CALL_S * 1e3:.1f} ms beyond its bytes, a layer's hand-off "
                         f"{estimate.HANDOFF_S * 1e3:.2f} ms")
            alone = make_plan(replace(opts, experts="gpu"), advise=False) if advise and opts.experts == "auto" else None
            if alone is not None and alone.speed and alone.speed["decode_batch1"]["tok_s"] > 1.05 * d1["tok_s"]:
                notes.append(f"warning: hybrid decode costs speed here (small experts: the host's per-expert cost "
                             f"outweighs their bytes): --experts gpu decodes {alone.speed['decode_batch1']['tok_s']:.1f} "
                             f"instead of {d1['tok_s']:.1f} tok/s at batch 1")
        elif cached and mapped_tokens and opts.experts == "auto" and costs is not None and opts.cpu_share is None:
            notes.append(f"hybrid decode off (share 0, as the engine chooses it by `cost_model.cpu_share`; host {rate}): "
                         + (f"at start (uniform routing) {_share_why(costs, m0)}" if start <= 0 else
                            f"it starts at {start:.2f} (uniform routing, {m0:.2f} misses a layer) and its re-balance on "
                            f"the misses it sees turns it off: {_share_why(costs, m1)}")
                         + "; --cpu-share S forces it")
        elif mapped_tokens and opts.experts != "gpu" and host_gbs == 0:
            notes.append("hybrid decode not predicted: " + (
                "this host's memory read rate is unknown (--host local without --measure-bandwidth)"
                if not host.read_rate_gbs else
                f"{scheme} experts need the native AVX-512 host kernel, which this host lacks"
                if scheme in estimate.NATIVE_HOST_FORMATS and not host.avx512 else
                f"no host rate is measured for {scheme} experts (`estimate.HOST_PACKED_EFF`)")
                + "; the engine will also compute a share of the misses on the host where its calibration finds one pays")
        if pooled:
            notes.append(f"{len(pooled)} of {len(cached)} cached MoE layers keep no expert on the GPU (the budget leaves "
                         f"no room for {MIN_EXPERT_SLOTS} slots a layer): they copy the misses of prefill and larger "
                         f"steps through {shared} slot(s) they share, one layer after another; decode steps read "
                         f"theirs in place (or split them with the host; with --no-mapped-experts they copy too)")
        if slotless and not host_prefill:
            notes.append(f"{len(slotless)} of {len(cached)} cached MoE layers keep no expert slot (the budget leaves "
                         f"no room for {MIN_EXPERT_SLOTS} a layer): the misses they would copy in (prefill, larger "
                         f"steps) run on the host's cores, as with --experts cpu")
        if road_split and dn["host_miss_share"] and not host_prefill:  # (--experts cpu: the experts note says it)
            notes.append(f"the copy road (steps over {mapped_tokens or 0} token(s), prefill apart) sends "
                         f"{dn['host_miss_share']:.0%} of batch {dn['batch']}'s misses to the host's cores, as the engine "
                         f"splits them (`cost_model.split_misses`: the host takes a miss where it finishes before the "
                         f"copy queue, {costs.copy_s * 1e3:.2f} ms an expert); the rest are copied")
    if opts.quant:
        notes.append(f"--quant {opts.quant}: Linear weights stay packed on the GPU and in host memory (streamed layers "
                     "cross PCIe packed) and are computed packed by a Triton kernel (`layers/packed_linear.py`): it "
                     "saves memory and PCIe bytes; its decode HBM time is counted as a dequantize pass until measured")
    if fmt.experts_scheme and E:
        if packed:
            res, inplace = estimate.packed_time(packed, gpu.fp8)
            notes.append(f"{packed} experts stay packed on the GPU and in host memory ({_gb(sum(g.nbytes for g in groups if g.kind == 'experts'))}"
                         f" instead of {_gb(sum(g.nbytes for g in dense_groups if g.kind == 'experts'))}); the packed "
                         f"kernel reads one in {res:.1f}x a bf16 expert's time resident and {inplace:.2f}x in place "
                         "(measured: NF4 on the H200, fp8 on the H100): fewer bytes buy more resident experts and faster in-place reads, "
                         "not faster resident ones")
        elif not tp_dense:  # under --tp the note below says why
            from ferrylm.models.base import ENGINE_PACKED_FORMATS

            notes.append(f"{fmt.experts_scheme} experts are dequantized at load (" + (
                f"the fused kernel reads packed experts with bf16 / fp16 activations, not --dtype {opts.dtype}"
                if unpacked else f"the engine keeps only {' / '.join(sorted(ENGINE_PACKED_FORMATS))} experts packed")
                + "): counted dense")
    if tp_dense:
        notes.append(f"--tp {opts.tp}: each rank keeps its slices of packed Linear weights packed (whole groups of "
                     f"columns; a slice that would cut a group is read dense) but reads its expert slices dense, so "
                     f"experts are counted in {opts.dtype}")
    if fmt.dense_params and model is not None:
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        cols = sorted({shapes[n][1] // opts.tp for n in fmt.dense_params if n in shapes})
        fits = [g for g in (128, 64, 32, 16) if g < fmt.group_size and all(c % g == 0 for c in cols)]
        kinds = sorted({n.rsplit(".", 2)[-2] for n in fmt.dense_params})
        notes.append(f"--tp {opts.tp}: {len(fmt.dense_params)} row-parallel weights ({', '.join(kinds)}) are read dense: "
                     f"a rank's {', '.join(map(str, cols))} columns cut the store's {fmt.group_size}-column groups"
                     + (f"; a store converted with --group-size {fits[0]} keeps them packed" if fits else ""))
    if fmt.fp8_block:
        notes.append(f"block-wise FP8 checkpoint (blocks of {block[0]} x {block[1]}): its FP8 weights stay packed as "
                     f"they load (e4m3 codes plus an fp32 scale per row and {block[1]} columns, 3% over the codes; "
                     "weights whose rows are no multiple of the block dequantized), decoded to "
                     f"{opts.dtype} in the kernels' tiles; activations stay {opts.dtype}")
    if fmt.quant == "fp8" and not gpu.fp8:
        notes.append(f"{gpu.name} has no FP8 tensor cores: fp8 weights are stored and moved packed and decoded to "
                     f"{opts.dtype} in the kernels' tiles (weight-only), as on GPUs that have them")
    qual = []
    for flag, scheme in (("--quant", opts.quant), ("--expert-quant", opts.expert_quant)):
        if scheme:
            qual += [dict(q, flag=flag, scheme=scheme) for q in quality.notes(name, scheme, fmt.group_size)]
    for q in qual:
        notes.append(f"quality of {q['flag']} {q['scheme']}: {quality.describe(q)}")
    if any(q["kind"] == "measured" for q in qual):
        notes.append(f"(ours: {quality.PPL_RESULTS}; {quality.MEASURED_CAVEAT}; published deltas are for calibrated "
                     "GPTQ / AWQ, ferrylm's int4 / nf4 are round-to-nearest)")
    if advise and verdict == "fits" and quant_chosen:  # a model that fits in its own dtype too
        full = make_plan(replace(opts, quant=None, expert_quant=None), advise=False)
        if full.verdict == "fits" and full.per_gpu["kv_tokens"] >= conc * seq_tokens and \
                full.speed["decode_batch1"]["tok_s"] > 1.05 * d1["tok_s"]:
            chosen = " ".join(f"{flag} {q}" for flag, q in (("--quant", opts.quant), ("--expert-quant", opts.expert_quant))
                              if q)
            notes.append(f"warning: {chosen} costs decode speed for nothing: in {opts.dtype} the model fits resident "
                         f"too, with KV for this workload ({full.per_gpu['kv_tokens']:,} tokens for {conc} x "
                         f"{seq_tokens}), and decodes {full.speed['decode_batch1']['tok_s']:.1f} instead of "
                         f"{d1['tok_s']:.1f} tok/s at batch 1")
    if advise and verdict != "cannot" and opts.enforce_eager and graphs_family and ranks == 1:
        graphed = make_plan(replace(opts, enforce_eager=False), advise=False)
        if graphed.speed and graphed.speed["decode_batch1"]["tok_s"] > 1.1 * d1["tok_s"]:
            notes.append(f"warning: --enforce-eager costs decode speed: {d1['tok_s']:.1f} instead of "
                         f"{graphed.speed['decode_batch1']['tok_s']:.1f} tok/s at batch 1 with CUDA graphs")
    if advise and verdict != "cannot" and not opts.mapped_experts and d1.get("experts_path") == "copy":
        inplace = make_plan(replace(opts, mapped_experts=True), advise=False).speed["decode_batch1"]
        if inplace.get("experts_path") == "mapped" and inplace["tok_s"] > 1.1 * d1["tok_s"]:
            notes.append(f"warning: --no-mapped-experts costs decode speed: {d1['tok_s']:.1f} instead of "
                         f"{inplace['tok_s']:.1f} tok/s at batch 1 reading expert misses in place")
    if advise and quant_kv and verdict != "cannot":
        full = make_plan(replace(opts, kv_cache_dtype="auto"), advise=False)
        if full.verdict == verdict and full.per_gpu["kv_tokens"] >= conc * seq_tokens:
            notes.append(f"warning: --kv-cache-dtype {opts.kv_cache_dtype} buys KV room this workload does not need "
                         f"({opts.kv_cache_dtype} holds {kv_tokens:,} tokens, the model's dtype {full.per_gpu['kv_tokens']:,}"
                         f" for {conc} x {seq_tokens}) and costs decode time: the fp8 KV decode kernel measured slower "
                         "than bf16 on the H200 (docs/benchmarks.md, paged attention)")
    if ranks > 1:
        notes.append("TP / PP: the figures are " + ("the heaviest rank's" if stage is None else
                     f"a rank's of PP stage {stage}, the one --place puts the most in host memory")
                     + "; parallel layouts run without CUDA graphs"
                     + ("; a token's time is that stage's times --pp, an upper bound where the other stages are "
                        "lighter" if opts.pp > 1 else ""))
    if n_gpu > ranks:
        # the GPUs at hand: the most of them first, TP first (decode fastest), then fewer
        search = (_fitting_layout(opts, gpu, mc, range(min(n_gpu, _most_gpus(mc)), ranks, -1), same_gpus=True)
                  if advise and verdict != "fits" else None)
        under = f", under {_budget_flag(opts)}" if budget_bytes(opts) is not None else ""
        if search:
            n, tp, pp, better = search.found
            notes.append(f"{n_gpu} GPUs but TP x PP = {ranks}: with {_flags(tp, pp)} it fits resident on "
                         f"{'all ' + str(n) if n == n_gpu else str(n) + ' of them'} "
                         f"(planned so{under}: decode {better.speed['decode_batch1']['tok_s']:.1f} tok/s at batch 1"
                         + (f" instead of {d1['tok_s']:.1f})" if verdict == "offload" else ")"))
        else:
            notes.append(f"{n_gpu} GPUs but TP x PP = {ranks}: the others are idle (or run replicas)"
                         + (f"; {search.why_none()}{under}" if search is not None else ""))
    if counted == "config":
        notes.append(f"{mc.architecture} has no model class in ferrylm yet: counted from config.json "
                     "(memory.analytical_groups); the engine cannot run it")
    if verdict == "cannot":  # a plan that cannot run predicts no speed (its steps were priced on no placement)
        speed = None
    return Plan(opts, name, mc.architecture, n_gpu, gpu.name, host.name, count.total, count.active,
                summarize(groups), per_gpu, verdict, pl, speed, notes, counted, qual)


def _store_quant(opts: PlanOptions, stored: dict | None) -> tuple[PlanOptions, list[str]]:
    """The options a model's own quantization implies (`stored`: a ferry store's ferry.json "quantization", None for
    anything else): a quantized store is planned as converted (the engine loads it so), whatever --quant says (a
    different --quant or --group-size is refused); --quant on an unquantized store plans that conversion, and says
    so. Returns (options, notes)."""
    group = 64 if opts.group_size is None else opts.group_size
    if stored is None:
        return replace(opts, group_size=group), []
    scheme, groups = stored.get("scheme") or "none", ("int4", "nf4")
    if scheme == "none":
        notes = []
        if stored.get("packed_from"):
            notes.append(f"the store keeps its source's packed blocks ({', '.join(sorted(stored['packed_from']))}, "
                         f"converted without --quant), counted here in {opts.dtype}: an upper bound")
        if opts.quant:
            notes.append(f"the store was converted without --quant (its ferry.json): planned as a store converted with "
                         f"--quant {opts.quant} would be (`ferry convert SRC DIR --quant {opts.quant}`), not as this one "
                         "loads")
        return replace(opts, group_size=group), notes
    for flag, given in (("--quant", opts.quant), ("--expert-quant", opts.expert_quant)):
        if given and given != scheme:
            raise ConfigError(f"{flag} {given}: the store {opts.model} was converted with --quant {scheme} (its "
                              f"ferry.json), which the engine loads as it is; drop {flag}, or plan another store")
    if scheme in groups and opts.group_size is not None and opts.group_size != stored.get("group_size", 64):
        raise ConfigError(f"--group-size {opts.group_size}: the store {opts.model} was converted with --group-size "
                          f"{stored.get('group_size', 64)} (its ferry.json); drop --group-size")
    group = stored.get("group_size", 64) if scheme in groups else group
    note = (f"planned with the store's own quantization (its ferry.json): --quant {scheme}"
            + (f", --group-size {group}" if scheme in groups else ""))
    if stored.get("double_quant"):
        note += "; its NF4 absmaxes are int8 (--double-quant), counted as fp32: a little over"
    from ferrylm.weights.convert import HIGH_PRECISION

    extra = [p for p in stored.get("keep_high_precision", ()) if p not in HIGH_PRECISION]
    if extra:
        note += f"; its own --keep-high-precision {' '.join(extra)} is not counted (those weights counted packed)"
    return replace(opts, quant=scheme, expert_quant=None, group_size=group), [note]


def budget_bytes(opts: PlanOptions) -> int | None:
    """The per-GPU budget in bytes, from the engine's spelling (`gpu_memory_budget`, read by the engine's own
    `config.parse_bytes`) or the deprecated `gpu_memory_budget_gb` (10^9 bytes); None: the engine's default."""
    if opts.gpu_memory_budget is not None and opts.gpu_memory_budget_gb is not None:
        raise ConfigError("give --gpu-memory-budget SIZE or the deprecated --gpu-memory-budget-gb GB, not both")
    if opts.gpu_memory_budget is not None:
        flag = f"--gpu-memory-budget {opts.gpu_memory_budget}"
        try:
            n = parse_bytes(opts.gpu_memory_budget)
        except ConfigError as e:
            raise ConfigError(f"{flag}: {e}") from None
        except (OverflowError, ValueError):  # inf or nan: 1e999, or a float through the API
            raise ConfigError(f"{flag}: a budget must be a finite size over 0") from None
    elif opts.gpu_memory_budget_gb is not None:
        flag = f"--gpu-memory-budget-gb {opts.gpu_memory_budget_gb:g}"
        if not math.isfinite(opts.gpu_memory_budget_gb * 1e9):  # int() of nan or inf raises
            raise ConfigError(f"{flag}: a budget must be a finite number of GB over 0")
        n = int(opts.gpu_memory_budget_gb * 1e9)
    else:
        return None
    if n <= 0:
        raise ConfigError(f"{flag}: a budget must be more than 0 bytes")
    return n


def _budget_flag(opts: PlanOptions) -> str:
    """The budget as it was given, in the spelling it was given in."""
    if opts.gpu_memory_budget is not None:
        return f"--gpu-memory-budget {opts.gpu_memory_budget}"
    return f"--gpu-memory-budget-gb {opts.gpu_memory_budget_gb:g}"


def _check_place(rules: tuple[str, ...], groups: list[TensorGroup]) -> None:
    """--place rules refused in one line where the engine refuses them: bad grammar, a rule that matches no group of
    the model, the LM head in host memory (`placement._forced`, run through `minimum_device_bytes`)."""
    from ferrylm.offload.placement import minimum_device_bytes

    try:
        minimum_device_bytes(groups, tuple(rules))
    except ConfigError as e:
        raise ConfigError(f"--place: the engine refuses it: {e}") from None


def _stage_rules(rules: tuple[str, ...], stages: list[list[TensorGroup]], stage: int, layers: int,
                 notes: list[str]) -> tuple[str, ...]:
    """The --place rules PP stage `stage` applies. Every stage drops a rule whose layers are all another stage's, as
    `ModelRunner._place` does (`notes` then says the plan does not show that stage), and refuses one that matches none
    of its groups (embed=cpu on a later stage), as each stage's start does."""
    from ferrylm.offload.placement import minimum_device_bytes

    if len(stages) == 1:
        return tuple(rules)
    mine = []
    for s, gs in enumerate(stages):
        held, kept = _held(gs), _rules_for(rules, gs, layers)
        try:
            minimum_device_bytes(gs, kept)
        except ConfigError as e:
            raise ConfigError(f"--place: the engine refuses it on the stage of layers {held[0]}-{held[-1]}: {e}") \
                from None
        if s == stage:
            mine = kept
            notes += [f"--place {r} is another pipeline stage's: that stage's placement is not shown (planned here: "
                      f"the stage of layers {held[0]}-{held[-1]})" for r in rules if r not in kept]
    return mine


def _gguf_packed(spec: str, model) -> int:
    """Marks on `model` (built on meta) the Linear weights a .gguf `spec` hands out packed (Q4_0 / Q4_1 / Q8_0
    matrices), as the CUDA engine sizes them for placement (`CausalLM.note_packed_linears`, from the file's tensor
    table alone); how many. 0 for anything else."""
    path = os.path.expanduser(spec)
    if not (os.path.isfile(path) and path.endswith(".gguf")) and not (
            os.path.isdir(path) and any(n.endswith(".gguf") for n in os.listdir(path))):
        return 0
    from ferrylm.weights.gguf import GGUFSource
    from ferrylm.weights.source import open_source

    with open_source(path) as src:
        return model.note_packed_linears(src) if isinstance(src, GGUFSource) else 0


def _model_config(name: str, cfg) -> ModelConfig:
    """`ModelConfig.from_hf` of a model's config, or one line naming what in it cannot be planned: a config that is no
    JSON object, a size that is no number, or a count a model cannot have (no layers, heads or vocabulary)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{name}: config.json holds a {type(cfg).__name__}, not a JSON object of the model's "
                          "settings")
    try:
        mc = ModelConfig.from_hf(cfg)
    except (TypeError, ValueError) as e:  # int("four"), a list where a number goes
        raise ConfigError(f"{name}: config.json has a value that is not a count: {e}") from None
    except ZeroDivisionError:  # head_dim = hidden_size // 0 heads
        raise ConfigError(f"{name}: config.json's num_attention_heads is {cfg.get('num_attention_heads')!r}; a model "
                          "has at least 1") from None
    for field_name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "vocab_size",
                       "head_dim", "max_position_embeddings"):
        v = getattr(mc, field_name)
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}: config.json's {field_name} is {v!r}; a model has at least 1")
    return mc


def _check_counts(opts: PlanOptions) -> None:
    """Counts, lengths and the KV size the engine (or the workload) needs positive (and finite): refused by name,
    before any arithmetic. A context holds at least a prompt token and one generated (the engine refuses a prompt as
    long as the context), and a request generates at least one token (`SamplingParams`: max_tokens >= 1)."""
    for flag, v, least in (("--tp", opts.tp, 1), ("--pp", opts.pp, 1), ("--block-size", opts.block_size, 1),
                           ("--max-num-seqs", opts.max_num_seqs, 1),
                           ("--max-num-batched-tokens", opts.max_num_batched_tokens, 1),
                           ("--max-model-len", opts.max_model_len, 2), ("--prompt-len", opts.prompt_len, 1),
                           ("--output-len", opts.output_len, 1), ("--concurrency", opts.concurrency, 1),
                           ("--num-kv-blocks", opts.num_kv_blocks, 1), ("--stream-buffers", opts.stream_buffers, 2)):
        if v is not None and v < least:
            raise ConfigError(f"{flag} {v}: must be at least {least}")
    kv = opts.kv_cache_memory_gb
    if kv is not None and not (kv > 0 and math.isfinite(kv * 2**30)):  # its bytes are int(GiB * 2^30)
        raise ConfigError(f"--kv-cache-memory-gb {kv:g}: a finite number of GiB over 0")


def _share_why(costs, misses: float) -> str:
    """Why `cost_model.cpu_share` gives a layer's `misses` the share it does (the engine logs the same at start,
    `PlacedWeights._balanced_share`), on the plan's figures."""
    from ferrylm.offload.cost_model import MIN_SHARE, cpu_share

    dev = misses * costs.expert_bytes / (costs.inplace_gbs * 1e9)
    fixed = costs.handoff_s + misses * costs.call_s
    host = costs.cpu_s(1) - costs.call_s
    share = cpu_share(costs, misses=misses, split=True)
    why = (f"~{misses:.2f} misses a layer take the device {dev * 1e3:.2f} ms in place, the host {host * 1e3:.2f} ms "
           f"an expert's bytes beyond a hand-off and a call per miss ({fixed * 1e3:.2f} ms)")
    if share:
        return f"{why}: share {share:.2f}"
    if dev <= fixed:
        return f"{why}: the fixed costs alone exceed the device's time"
    return f"{why}: balanced at {(dev - fixed) / (dev + misses * host):.2f}, under the engine's MIN_SHARE {MIN_SHARE}"


def _analytical(cfg: dict) -> bool:
    return cfg.get("model_type") in ("deepseek_v3", "deepseek_v2")


def _no_count(mc: ModelConfig):
    raise ConfigError(f"cannot plan {mc.architecture}: no model class and no analytical count")


def _moe_layers(mine: list[TensorGroup], tier: dict, dense_of: dict, scheme: str | None,
                native_fp8: bool = True) -> dict[int, dict]:
    """Per MoE layer: experts, how many resident / in host memory, one expert's bytes, whether packed, and the
    dense-equivalent bytes that time its reads resident (`hbm_equiv`) and in place (`inplace_equiv`) on a GPU
    with (`native_fp8`) or without FP8 conversion (`estimate.packed_time`)."""
    out: dict[int, dict] = {}
    for g in mine:
        if g.kind != "experts":
            continue
        m = out.setdefault(g.layer, dict(experts=0, resident=0, host=0, nbytes=g.nbytes))
        m["experts"] += 1
        m["resident" if tier[g.name] == GPU else "host"] += 1
        dense = dense_of[g.name]
        m["packed"] = g.nbytes < dense
        res, inplace = estimate.packed_time(scheme, native_fp8) if m["packed"] else (1.0, 1.0)
        m["hbm_equiv"], m["inplace_equiv"] = (dense * res, dense * inplace) if m["packed"] else (g.nbytes, g.nbytes)
        m["dense"] = dense
    return out


def layout_error(mc: ModelConfig, tp: int, pp: int, dtype: str = "bfloat16") -> str | None:
    """Why the engine refuses `tp` x `pp` for this model, None where it takes it (or has no model class: the plan
    says so apart). The engine's own checks: the start-up refusals of the layout, `parallel/launch.layout_check` (a model
    class without sharded layers, heads or KV heads that do not split, fewer layers than stages; not its checks of the
    process, e.g. torchrun's WORLD_SIZE, which a plan made anywhere must not read) and the sharded layers' splits
    as a rank builds them (`TPGroup.split`, on meta)."""
    if tp * pp == 1:
        return None
    from ferrylm.config import ParallelConfig
    from ferrylm.parallel.group import TPGroup, building
    from ferrylm.parallel.launch import layout_check  # `start_runner`'s checks of the layout, not of this process

    try:
        layout_check(mc, ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp))
        if tp > 1:
            with building(TPGroup(rank=0, size=tp)):
                meta_model(mc, dtype)
    except UnsupportedArchitectureError:
        return None
    except ConfigError as e:
        return str(e)
    return None


LAYOUT_TRIES = 10
"""Layouts (GPU count, TP, PP) the advice plans at most before it gives up naming one."""


def _most_gpus(mc: ModelConfig) -> int:
    """The most GPUs a layout of this model can use: a TP degree splits the attention heads, a PP degree the layers."""
    return max(1, mc.num_attention_heads) * max(1, mc.num_hidden_layers)


def _layouts(mc: ModelConfig, n: int, dtype: str):
    """(tp, pp) over `n` GPUs that the engine takes, TP first (decode faster), then TP x PP, then PP alone. Only
    degrees that can split the heads and the layers are asked (every divisor of the count was: `--gpu 1e23xH200` and
    advice for a 1e11-card count never returned)."""
    for tp in range(min(n, max(1, mc.num_attention_heads)), 0, -1):
        if n % tp == 0 and n // tp <= max(1, mc.num_hidden_layers) and not layout_error(mc, tp, n // tp, dtype):
            yield tp, n // tp


@dataclass
class _Search:
    """What `_fitting_layout` planned: the layout that fits (GPUs, TP, PP, its plan) or None, the GPU counts of the
    layouts planned, and the layouts a plan refused (flags: why)."""

    found: tuple | None = None
    counts: list[int] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.found is not None

    def why_none(self) -> str:
        """What was planned, when nothing fits: never "none fits" of layouts it could not plan."""
        lo, hi = (min(self.counts), max(self.counts)) if self.counts else (0, 0)
        out = (f"no layout of {lo}{'-' + str(hi) if hi > lo else ''} GPUs planned to fit" if self.counts
               else "no layout planned")
        if self.refused:
            out += f"; {len(self.refused)} refused when planned, e.g. {self.refused[0]}"
        return out


def _gpu_name(opts: PlanOptions, gpu) -> str:
    """The NAME of a --gpu COUNTxNAME of more of the GPUs `opts.gpu` names: local for this machine's (NVML's name for
    them is no profile's: COUNTxlocal plans them as read), else the profile's."""
    return "local" if hardware.is_local(opts.gpu) else gpu.name


def _fitting_layout(opts: PlanOptions, gpu, mc: ModelConfig, counts, same_gpus: bool = False, **change) -> _Search:
    """The first layout over `counts` GPUs of the profile `gpu` that the engine takes and that fits resident when
    planned (at the engine's default budget; `same_gpus`: on the --gpu given, of which it uses `counts`, under the
    budget given; `change`: other options, e.g. quant), within LAYOUT_TRIES layouts; and what it planned."""
    search = _Search()
    tries = 0
    for n in counts:
        for tp, pp in _layouts(mc, n, opts.dtype):
            if tries == LAYOUT_TRIES:
                return search
            tries += 1
            spec = opts.gpu if same_gpus else f"{n}x{_gpu_name(opts, gpu)}"
            # more GPUs than given: at the default budget and without --place rules (`_advice` says so: resident is
            # what they are planned for); the GPUs given: under theirs
            budget = {} if same_gpus else dict(gpu_memory_budget=None, gpu_memory_budget_gb=None, place=())
            try:
                p = make_plan(replace(opts, gpu=spec, tp=tp, pp=pp, **budget, **change), advise=False)
            except ConfigError as e:  # said, not counted as planned
                search.refused.append(f"{_flags(tp, pp, spec)}: {e}")
                continue
            if n not in search.counts:
                search.counts.append(n)
            if p.verdict == "fits":
                search.found = (n, tp, pp, p)
                return search
    return search


def _flags(tp: int, pp: int, gpu: str | None = None) -> str:
    """A layout as plan's (and the engine's) flags; with `gpu` (a --gpu spec), its --gpu too."""
    return " ".join(([f"--gpu {gpu}"] if gpu else []) + ([f"--tp {tp}"] if tp > 1 else [])
                    + ([f"--pp {pp}"] if pp > 1 else [])) or "--tp 1"


def _advice(groups, opts, gpu, mc, budget, card, reserve, min_kv, advise=True) -> list[str]:
    """What to change when the model cannot run: more GPUs, in a layout the engine takes that fits when planned
    (from the count of cards of whole memory, `card` bytes past the CUDA context, the weights need; with a smaller
    explicit `budget`, what that budget alone would need), quantizing (experts counted packed where the engine keeps
    them packed; its layout planned too), a shorter context. `advise` False: counts only, nothing planned."""
    total = sum(g.nbytes for g in groups)
    fixed = (f"--num-kv-blocks {opts.num_kv_blocks}" if opts.num_kv_blocks is not None else
             f"--kv-cache-memory-gb {opts.kv_cache_memory_gb:g}" if opts.kv_cache_memory_gb is not None else None)
    if fixed and advise:  # the KV size asked for, not the weights, may be what fails
        free = make_plan(replace(opts, kv_cache_memory_gb=None, num_kv_blocks=None), advise=False)
        if free.verdict != "cannot":
            return [f"{fixed} asks for more KV than the budget leaves beside "
                    f"the weights: without it the engine sizes the KV cache from the budget "
                    f"({_gb(free.per_gpu['kv'])}, {free.per_gpu['kv_tokens']:,} tokens; planned so: {free.verdict}, "
                    f"decode {free.speed['decode_batch1']['tok_s']:.1f} tok/s at batch 1)"]
    if card - reserve - min_kv <= 0:  # no count of GPUs holds it: one sequence's KV alone is over a card
        return [f"one sequence of the whole context ({opts.max_model_len or mc.context_limit} tokens) needs "
                f"{_gb(min_kv)} of KV cache a GPU, which with the activation reserve ({_gb(reserve)}) is over one "
                f"{gpu.name}'s {_gb(card)}: lower --max-model-len"
                + ("" if opts.kv_cache_dtype != "auto" else " (or --kv-cache-dtype fp8: half the bytes)")]
    room = card - reserve - min_kv
    n = math.ceil(total / room)
    spread = layout_error(mc, 2, 1, opts.dtype) and layout_error(mc, 1, 2, opts.dtype)  # one process only
    search = _fitting_layout(opts, gpu, mc, range(n, n + LAYOUT_TRIES)) if advise and not (spread and n > 1) else None
    default = (" at the engine's default budget" if budget_bytes(opts) is not None else "") + (
        " without --place" if opts.place else "")
    if search:
        _, tp, pp, p = search.found
        out = [f"to hold it resident: {_flags(tp, pp, p.options.gpu)} (planned so{default}: decode "
               f"{p.speed['decode_batch1']['tok_s']:.1f} tok/s at batch 1; weights {_gb(total)})"]
    elif spread and n > 1:
        out = [f"it cannot be held resident: the weights take {_gb(total)}, over one {gpu.name}, and the engine runs "
               f"this model in one process only: {spread}"]
    else:
        out = [f"to hold it resident: about {n} x {gpu.name} (weights {_gb(total)}; counted at each card's whole "
               "memory" + (f", {search.why_none()}" if search is not None else "") + ")"]
    if budget_bytes(opts) is not None and budget is not None:
        mine = budget - reserve - min_kv
        if mine <= 0:
            out[0] += (f"; {_budget_flag(opts)} does not hold even the activation reserve and one sequence's KV "
                       f"({_gb(reserve + min_kv)})")
        elif math.ceil(total / mine) > n:
            out[0] += f"; {_budget_flag(opts)} a GPU would need {math.ceil(total / mine)}"
    if not opts.quant:
        from ferrylm.models.base import ENGINE_PACKED_FORMATS

        q = WeightFormat(opts.dtype, "nf4")
        packed = "nf4" in ENGINE_PACKED_FORMATS
        nf4 = sum(g.nbytes if g.kind in ("embed", "lm_head", "norm", "router") or (g.kind == "experts" and not packed)
                  else q.param_bytes("x.weight", (g.nbytes // DTYPE_BYTES[opts.dtype] // 1024, 1024)) for g in groups)
        n4 = math.ceil(nf4 / room)
        held = (_fitting_layout(opts, gpu, mc, range(n4, n4 + LAYOUT_TRIES), quant="nf4")
                if advise and not (spread and n4 > 1) else None)
        out.append(f"or quantize: with --quant nf4 (a ferry store) the weights take about {_gb(nf4)}"
                   + (f", over one {gpu.name}, and the engine runs this model in one process only" if spread and n4 > 1
                      else "")
                   + (f", resident with {_flags(held.found[1], held.found[2], held.found[3].options.gpu)} (planned "
                      f"so{default}: decode {held.found[3].speed['decode_batch1']['tok_s']:.1f} tok/s at batch 1)"
                      if held else f" ({held.why_none()})" if held is not None else ""))
    if opts.max_model_len is None or opts.max_model_len > 8192:
        out.append("or lower --max-model-len: one full-length sequence's KV must fit beside the weights")
    return out


def _gb(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"
