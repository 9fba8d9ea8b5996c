"""`make_plan()`: one model, one machine, one workload -> what fits where, and how fast it can go.

Memory: the engine's tensor groups of its own module on `meta` (`memory.py`), split over TP ranks and PP
stages, then the engine's start-up decision itself (`offload/memory.py`: device budget, activation reserve,
placement and KV bytes), fed with the GPU profile's memory instead of `torch.cuda.mem_get_info`. Verdict:
fits resident (offload unnecessary), needs offload (the placement and its PCIe bytes per decode token), or
cannot run (and what to change). Speed: `estimate.py`. Knows nothing about printing (`report.py`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from ferrylm.config import CacheConfig, ModelConfig, OffloadConfig, SchedulerConfig
from ferrylm.errors import ConfigError, UnsupportedArchitectureError
from ferrylm.offload.memory import activation_reserve, device_budget, size_memory
from ferrylm.offload.placement import GPU, HOST, TensorGroup
from ferrylm.plan import catalog, estimate, hardware
from ferrylm.plan.memory import (DTYPE_BYTES, WeightFormat, analytical_groups, analytical_kv_bytes_per_token,
                                 kv_bytes_per_block, kv_pool, meta_model, param_count, state_bytes_per_seq,
                                 summarize, weight_groups)

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
    dtype: str = "bfloat16"
    quant: str | None = None
    """int8 | fp8 | nf4: Linear weights of a ferry store converted with --quant."""
    kv_cache_dtype: str = "auto"
    """auto = the model dtype; fp8 | int8: the engine's quantized cache (`--kv-cache-dtype`)."""
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_gb: float | None = None
    """Per GPU (GiB); None: what the engine leaves after the weights."""
    gpu_memory_budget_gb: float | None = None
    """Per GPU, GB the engine may allocate (weights, KV, buffers): the engine's `gpu_memory_budget`."""
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
    """weights (on the device, incl. stream buffers and expert slots), weights_all (this rank's share), kv,
    kv_tokens, kv_bytes_per_token, state, activations (reserve), cuda_context, peak, capacity, budget (bytes)."""
    verdict: str
    """fits | offload | cannot"""
    placement: dict
    """gpu_bytes, host_bytes, host_groups, streamed_layers, expert_slots, pcie_bytes_per_decode_token."""
    speed: dict
    notes: list[str] = field(default_factory=list)
    """Verdict, warnings and advice, most important first."""
    counted_from: str = "model"
    """model (the engine's module on meta) | config (analytical count)."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["options"] = asdict(self.options)
        return d


def _stage_groups(groups: list[TensorGroup], layers: int, tp: int, pp: int) -> list[TensorGroup]:
    """The heaviest GPU's share: PP stage 0 (embeddings) or the last (LM head, final norm), every group
    split over TP ranks (norms and routers replicated)."""
    from ferrylm.parallel.pipeline import stage_layers  # the engine's split

    stages = []
    for s in range(pp):
        lo, hi = stage_layers(layers, pp, s).start, stage_layers(layers, pp, s).stop
        stages.append([g for g in groups if (g.layer is not None and lo <= g.layer < hi) or (
            g.layer is None and ((g.kind == "embed" and s == 0) or (g.kind != "embed" and s == pp - 1)))])
    worst = max(stages, key=lambda gs: sum(g.nbytes for g in gs))
    if tp == 1:
        return worst
    return [g if g.kind in ("norm", "router") else replace(g, nbytes=-(-g.nbytes // tp)) for g in worst]


def make_plan(opts: PlanOptions, advise: bool = True) -> Plan:
    """`advise`: also try the alternatives the notes suggest (a plan of its own each, without advice)."""
    if opts.tp < 1 or opts.pp < 1:
        raise ConfigError("--tp and --pp must be at least 1")
    if opts.dtype not in DTYPE_BYTES:
        raise ConfigError(f"--dtype {opts.dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
    quant_kv = opts.kv_cache_dtype in ("fp8", "int8")  # 1-byte codes + a 4-byte scale per token and head
    kv_dtype = opts.dtype if opts.kv_cache_dtype == "auto" or quant_kv else opts.kv_cache_dtype
    if kv_dtype not in DTYPE_BYTES:
        raise ConfigError(f"--kv-cache-dtype {kv_dtype!r}: the engine keeps KV in {', '.join(DTYPE_BYTES)}, "
                          f"fp8 or int8")
    name, cfg = catalog.resolve_model(opts.model)
    mc = ModelConfig.from_hf(cfg)
    n_gpu, gpu = hardware.parse_gpu(opts.gpu)
    if opts.tp * opts.pp > n_gpu:
        raise ConfigError(f"--tp {opts.tp} x --pp {opts.pp} needs {opts.tp * opts.pp} GPUs; --gpu {opts.gpu!r} has {n_gpu}")
    host = hardware.parse_host(opts.host)
    fmt = WeightFormat(opts.dtype, opts.quant)
    graphs_family = False
    try:
        model = meta_model(mc, opts.dtype)
    except UnsupportedArchitectureError:  # no model class: count from config.json
        groups, count = analytical_groups(cfg, fmt) if _analytical(cfg) else _no_count(mc)
        state_per_seq, counted = 0, "config"
        kv_per_token = analytical_kv_bytes_per_token(cfg, 1 if quant_kv else DTYPE_BYTES[kv_dtype])
    else:
        groups, count, state_per_seq, counted = weight_groups(model, fmt), param_count(model), \
            state_bytes_per_seq(model), "model"
        kv_per_token = kv_bytes_per_block(mc, opts.block_size, kv_dtype,
                                          opts.kv_cache_dtype if quant_kv else "auto") // opts.block_size
        graphs_family = model.graph_safe()
    max_len = opts.max_model_len or mc.max_position_embeddings
    conc = opts.concurrency or opts.max_num_seqs
    seq_tokens = min(max_len, opts.prompt_len + opts.output_len)
    ranks = opts.tp * opts.pp

    # -- memory of the heaviest GPU, decided as the engine decides ----------------------------------
    mine = _stage_groups(groups, mc.num_hidden_layers, opts.tp, opts.pp)
    # as the engine caches: each rank its KV heads (one, replicated, when fewer than TP ranks), its stage's layers
    from ferrylm.layers.parallel_linear import kv_heads_per_rank
    from ferrylm.parallel.pipeline import stage_layers

    hk = max(1, mc.num_key_value_heads)
    stage_len = max(len(stage_layers(mc.num_hidden_layers, opts.pp, s)) for s in range(opts.pp))
    per_block = -(-kv_per_token * opts.block_size * kv_heads_per_rank(hk, opts.tp) * stage_len
                  // (hk * mc.num_hidden_layers))
    cc = CacheConfig(block_size=opts.block_size, kv_cache_memory_gb=opts.kv_cache_memory_gb)
    sc = SchedulerConfig(max_num_seqs=opts.max_num_seqs, max_num_batched_tokens=opts.max_num_batched_tokens,
                         max_model_len=max_len)
    oc = OffloadConfig(gpu_memory_budget=None if opts.gpu_memory_budget_gb is None
                       else int(opts.gpu_memory_budget_gb * 1e9),
                       gpu_memory_utilization=opts.gpu_memory_utilization, place=tuple(opts.place))
    capacity = gpu.memory_bytes
    budget = device_budget(oc, capacity, capacity - CUDA_CONTEXT_BYTES)
    reserve = activation_reserve(mc, sc, DTYPE_BYTES[opts.dtype])
    state = state_per_seq * opts.max_num_seqs  # per-sequence state (Yuan's filter) is whole on every rank
    notes: list[str] = []
    try:
        placement, kv_budget = size_memory(mine, per_block, max_len, cc, sc, oc, budget, reserve, on_cpu=False)
    except ConfigError as e:
        placement, kv_budget, refused = None, 0, str(e)
    kv, kv_tokens = kv_pool(kv_budget, per_block, opts.block_size)
    host_bytes = placement.bytes_on(HOST) * ranks if placement else 0
    if placement is None:
        verdict = "cannot"
        notes.append(f"cannot run: {refused}")
    elif host_bytes > HOST_PIN_SHARE * host.memory_bytes:
        verdict = "cannot"
        notes.append(f"cannot run: {_gb(host_bytes)} of weights would live in host memory, over "
                     f"{HOST_PIN_SHARE:.0%} of the host's {_gb(host.memory_bytes)}")
    else:
        verdict = "fits" if placement.fully_resident else "offload"
    device_weights = placement.device_bytes() if placement else 0
    per_gpu = dict(weights=device_weights, weights_all=sum(g.nbytes for g in mine), kv=kv,
                   kv_bytes_per_token=kv_per_token, kv_tokens=kv_tokens, state=state, activations=reserve,
                   cuda_context=CUDA_CONTEXT_BYTES, peak=device_weights + kv + state + reserve + CUDA_CONTEXT_BYTES,
                   capacity=capacity, budget=budget)

    # -- speed ---------------------------------------------------------------------------------------
    E, k = count.num_experts, count.top_k
    tflops = gpu.tflops.get({"bfloat16": "bf16", "float16": "fp16", "float32": "bf16"}[opts.dtype], 0) or 1.0
    if opts.dtype == "float32":
        tflops /= 8  # no fp32 tensor cores: TF32 at best
    layers = math.ceil(mc.num_hidden_layers / opts.pp)
    act_b, link = DTYPE_BYTES[opts.dtype], gpu.nvlink_gbs or gpu.h2d_gbs
    graphs = graphs_family and not opts.enforce_eager and verdict == "fits" and ranks == 1  # none when parallel
    ctx = opts.prompt_len + opts.output_len / 2
    on_gpu = [g for g in mine if placement and placement.tier[g.name] == GPU]
    dense_res = sum(g.nbytes for g in on_gpu if g.kind not in ("experts", "embed"))
    experts_res = sum(g.nbytes for g in on_gpu if g.kind == "experts")

    def decode(batch: int) -> dict:
        d = _distinct_experts(E, k, batch)
        cost = estimate.StepCost(
            hbm_bytes=dense_res + (d / E if E else 0) * experts_res + batch * ctx * kv_per_token / ranks,
            pcie_bytes=placement.pcie_bytes_per_token(d) if placement else 0,
            flops=2 * count.active * batch / ranks, layers=layers, graphs=graphs,
            comm_s=2 * layers * estimate.allreduce_s(opts.tp, batch * mc.hidden_size * act_b, link))
        t = estimate.step_time(cost, gpu.hbm_gbs, gpu.h2d_gbs, tflops)
        seconds = t.seconds * opts.pp  # a token passes every stage
        return dict(batch=batch, tok_s=batch / seconds, step_ms=seconds * 1e3, binding=t.binding,
                    pcie_bytes_per_step=cost.pcie_bytes, parts_ms={p: v * 1e3 for p, v in t.parts.items()})

    chunk = max(1, min(opts.max_num_batched_tokens, opts.prompt_len))
    streamed = sum(g.nbytes for g in mine if placement and placement.tier[g.name] == HOST and g.kind != "embed")
    pre = estimate.step_time(estimate.StepCost(
        hbm_bytes=dense_res + experts_res, pcie_bytes=streamed,
        flops=(2 * count.active * chunk + 2 * mc.num_hidden_layers * chunk * chunk * mc.num_attention_heads
               * mc.head_dim) / ranks, layers=layers,
        comm_s=2 * layers * estimate.allreduce_s(opts.tp, chunk * mc.hidden_size * act_b, link)),
        gpu.hbm_gbs, gpu.h2d_gbs, tflops)
    d1 = decode(1)
    dn = decode(max(1, min(conc, kv_tokens // max(seq_tokens, 1))))
    speed = dict(decode_batch1=d1, decode_concurrent=dn, prefill_tok_s=chunk / (pre.seconds * opts.pp),
                 prefill_binding=pre.binding,
                 ttft_s=math.ceil(opts.prompt_len / chunk) * pre.seconds * opts.pp + d1["step_ms"] / 1e3,
                 cuda_graphs=graphs,
                 assumptions=dict(hbm_eff=estimate.HBM_EFF, mfu=estimate.MFU, h2d_gbs=gpu.h2d_gbs,
                                  launch_us_per_layer=1e6 * (estimate.LAUNCH_GRAPH_S if graphs else estimate.LAUNCH_S)))

    # -- placement summary and advice -----------------------------------------------------------------
    pl = dict(gpu_bytes=placement.bytes_on(GPU) if placement else 0, host_bytes=host_bytes // ranks,
              host_groups=sorted({g.kind for g in mine if placement and placement.tier[g.name] == HOST}),
              streamed_layers=placement.streamed_layers() if placement else [],
              stream_buffer_bytes=placement.stream_buffer_bytes if placement else 0,
              expert_slots=max(placement.expert_slots.values(), default=0) if placement else 0,
              pcie_bytes_per_decode_token=d1["pcie_bytes_per_step"])
    if verdict == "fits":
        notes.append("offload unnecessary: every weight stays on the GPU")
    elif verdict == "offload":
        notes.append(f"needs offload: {_gb(pl['host_bytes'])} of weights in host memory ({', '.join(pl['host_groups'])}); "
                     f"{_gb(d1['pcie_bytes_per_step'])} cross PCIe per decode token at batch 1")
        if not advise:
            pass
        elif opts.gpu_memory_budget_gb is not None or opts.place:
            free = make_plan(replace(opts, gpu_memory_budget_gb=None, place=()), advise=False)
            if free.verdict == "fits":
                notes.append(f"warning: the budget / --place forces offload of a model that fits: decode "
                             f"{d1['tok_s']:.1f} instead of {free.speed['decode_batch1']['tok_s']:.1f} tok/s, for nothing")
        else:  # the engine's default budget is at most 90% of free memory; an explicit budget may go higher
            need = per_gpu["weights_all"] + reserve + (-(-max_len // opts.block_size) + 2) * per_block
            gib = math.ceil(need / 2**30)
            more = (make_plan(replace(opts, gpu_memory_budget_gb=gib * 2**30 / 1e9), advise=False)
                    if gib * 2**30 <= capacity - CUDA_CONTEXT_BYTES else None)
            if more is not None and more.verdict == "fits":
                notes.append(f"with --gpu-memory-budget {gib}GiB it fits resident (the default budget is at most 90% "
                             f"of free memory): decode {more.speed['decode_batch1']['tok_s']:.1f} instead of "
                             f"{d1['tok_s']:.1f} tok/s at batch 1")
    if verdict == "cannot":
        notes += _advice(groups, opts, gpu, budget or capacity, reserve, max_len * kv_per_token // ranks)
    if verdict != "cannot" and kv_tokens < conc * seq_tokens:
        notes.append(f"KV holds {kv_tokens:,} tokens: {kv_tokens // max(seq_tokens, 1)} sequences of {seq_tokens} at "
                     f"once, fewer than the concurrency {conc} (the rest wait or are preempted)")
    if opts.quant:
        notes.append(f"--quant {opts.quant}: weights are dequantized per step (no fused quantized kernels yet): it "
                     "saves memory, not time; expert banks are counted dense")
        if opts.quant == "fp8" and not gpu.fp8:
            notes.append(f"{gpu.name} has no FP8 tensor cores: fp8 weights can only be stored, not computed")
    if ranks > 1:
        notes.append("the engine runs one GPU today: the TP/PP figures are what each rank would hold")
    if n_gpu > ranks:
        notes.append(f"{n_gpu} GPUs but TP x PP = {ranks}: the others are idle (or run replicas)")
    if counted == "config":
        notes.append(f"{mc.architecture} has no model class in ferrylm yet: counted from config.json "
                     "(memory.analytical_groups); the engine cannot run it")
    return Plan(opts, name, mc.architecture, n_gpu, gpu.name, host.name, count.total, count.active,
                summarize(groups), per_gpu, verdict, pl, speed, notes, counted)


def _analytical(cfg: dict) -> bool:
    return cfg.get("model_type") in ("deepseek_v3", "deepseek_v2")


def _no_count(mc: ModelConfig):
    raise ConfigError(f"cannot plan {mc.architecture}: no model class and no analytical count")


def _distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts a layer routes `batch` tokens to, under uniform top-k routing."""
    return 0.0 if num_experts == 0 else num_experts * (1 - (1 - top_k / num_experts) ** batch)


def _advice(groups, opts, gpu, budget, reserve, min_kv) -> list[str]:
    total = sum(g.nbytes for g in groups)
    out = [f"to hold it resident: about {math.ceil(total / max(budget - reserve - min_kv, 1))} x {gpu.name} with TP "
           f"(weights {_gb(total)})"]
    if not opts.quant:
        q = WeightFormat(opts.dtype, "nf4")
        nf4 = sum(g.nbytes if g.kind in ("embed", "lm_head", "norm", "router", "experts")
                  else q.param_bytes("x.weight", (g.nbytes // DTYPE_BYTES[opts.dtype] // 1024, 1024)) for g in groups)
        dense = sum(g.nbytes for g in groups if g.kind == "experts")
        out.append(f"or quantize: with --quant nf4 (a ferry store) the weights take about {_gb(nf4)}"
                   + (f" ({_gb(dense)} of experts are counted dense)" if dense else ""))
    if opts.max_model_len is None or opts.max_model_len > 8192:
        out.append("or lower --max-model-len: one full-length sequence's KV must fit beside the weights")
    return out


def _gb(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"
