"""`make_plan()`: one model, one machine, one workload -> what fits where, and how fast it can go.

Memory: weights by tensor group (`memory.py`, from the engine's own module on `meta`), split over TP
ranks and PP stages; the KV pool sized as the engine sizes it (`memory.kv_pool_blocks`,
`KVCache.bytes_per_block`); per-sequence state; a reserve for activations. Verdict: fits resident
(offload unnecessary), needs offload (the placement and its PCIe bytes per decode token), or cannot run
(and what to change). Speed: `estimate.py`. Knows nothing about printing (`report.py`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ferrylm.config import ModelConfig
from ferrylm.errors import ConfigError
from ferrylm.plan import catalog, estimate, hardware
from ferrylm.plan.memory import (DTYPE_BYTES, TensorGroup, WeightFormat, analytical_groups,
                                 analytical_kv_bytes_per_token, kv_bytes_per_block, kv_pool_blocks, kv_pool_bytes,
                                 meta_model, state_bytes_per_seq, summarize, tensor_groups)
from ferrylm.plan.placement import distinct_experts, place

CUDA_CONTEXT_BYTES = 600 * 2**20
"""CUDA context + cuBLAS workspace of one process, outside PyTorch's allocator."""
HOST_PIN_SHARE = 0.8
"""Share of host memory the plan lets pinned weights take (the OS, page cache and the process need the rest)."""


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
    """auto = the model dtype."""
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_gb: float | None = None
    """Per GPU; None: KV_SHARE of the free memory, as the engine does."""
    weight_budget_gb: float | None = None
    """Per GPU bytes the weights may take; None: whatever leaves room for the workload's KV."""
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
    """weights, kv, state, activations, cuda_context, peak, capacity (bytes), kv_tokens, kv_bytes_per_token."""
    verdict: str
    """fits | offload | cannot"""
    placement: dict
    """gpu_bytes, host_bytes, host kinds, expert share resident, pcie bytes per decode token."""
    speed: dict
    notes: list[str] = field(default_factory=list)
    """Warnings and advice, most important first."""
    counted_from: str = "model"
    """model (the engine's module on meta) | config (analytical count)."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["options"] = asdict(self.options)
        return d


def _groups(cfg: dict, mc: ModelConfig, fmt: WeightFormat) -> tuple[list[TensorGroup], int, str]:
    """(groups, state bytes per sequence, 'model' | 'config')."""
    try:
        model = meta_model(mc, fmt.dtype)
    except ConfigError:
        raise
    except Exception:
        try:
            return analytical_groups(cfg, fmt), 0, "config"
        except ValueError:
            raise ConfigError(f"cannot plan {mc.architecture}: no model class and no analytical count") from None
    return tensor_groups(model, fmt), state_bytes_per_seq(model), "model"


def _stage_groups(groups: list[TensorGroup], layers: int, tp: int, pp: int) -> list[TensorGroup]:
    """The heaviest GPU's share: PP stage 0 or the last (embeddings / LM head), every group split over TP
    (norms replicated)."""
    per = math.ceil(layers / pp)
    stages = []
    for s in range(pp):
        lo, hi = s * per, min(layers, (s + 1) * per)
        mine = [g for g in groups if (g.layer is not None and lo <= g.layer < hi)
                or (g.layer is None and ((g.kind == "embed" and s == 0) or (g.kind != "embed" and s == pp - 1)))]
        stages.append(mine)
    worst = max(stages, key=lambda gs: sum(g.nbytes for g in gs))
    if tp == 1:
        return worst
    return [TensorGroup(g.name, g.kind, g.layer, g.expert, g.params, g.numel,
                        g.nbytes if g.kind == "norm" else -(-g.nbytes // tp)) for g in worst]


def make_plan(opts: PlanOptions) -> Plan:
    if opts.tp < 1 or opts.pp < 1:
        raise ConfigError("--tp and --pp must be at least 1")
    if opts.dtype not in DTYPE_BYTES:
        raise ConfigError(f"--dtype {opts.dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
    name, cfg = catalog.resolve_model(opts.model)
    mc = ModelConfig.from_hf(cfg)
    n_gpu, gpu = hardware.parse_gpu(opts.gpu)
    if opts.tp * opts.pp > n_gpu:
        raise ConfigError(f"--tp {opts.tp} x --pp {opts.pp} needs {opts.tp * opts.pp} GPUs; --gpu {opts.gpu!r} has {n_gpu}")
    host = hardware.parse_host(opts.host)
    fmt = WeightFormat(opts.dtype, opts.quant)
    groups, state_per_seq, counted = _groups(cfg, mc, fmt)
    kv_dtype = opts.dtype if opts.kv_cache_dtype == "auto" else opts.kv_cache_dtype
    if kv_dtype not in DTYPE_BYTES:
        raise ConfigError(f"--kv-cache-dtype {kv_dtype!r}: the engine keeps KV in {', '.join(DTYPE_BYTES)}")
    if counted == "model":
        kv_per_token = kv_bytes_per_block(mc, opts.block_size, kv_dtype) // opts.block_size
    else:
        kv_per_token = analytical_kv_bytes_per_token(cfg, DTYPE_BYTES[kv_dtype])
    max_len = opts.max_model_len or mc.max_position_embeddings
    conc = opts.concurrency or opts.max_num_seqs
    seq_tokens = min(max_len, opts.prompt_len + opts.output_len)
    notes: list[str] = []

    # -- memory of the heaviest GPU ----------------------------------------------------------------
    mine = _stage_groups(groups, mc.num_hidden_layers, opts.tp, opts.pp)
    weights = sum(g.nbytes for g in mine)
    kv_per_token_gpu = -(-kv_per_token // (opts.tp * opts.pp))
    state = state_per_seq * opts.max_num_seqs // opts.tp
    act = _activation_bytes(mc, opts, DTYPE_BYTES[opts.dtype])
    capacity = gpu.memory_bytes
    usable = capacity - CUDA_CONTEXT_BYTES - act - state
    workload_kv = conc * seq_tokens * kv_per_token_gpu
    min_kv = max_len * kv_per_token_gpu  # one sequence at full length
    budget = usable - max(workload_kv, min_kv) if opts.weight_budget_gb is None else int(opts.weight_budget_gb * 1e9)
    placement = place(mine, max(budget, 0))
    fits_whole = weights + min_kv <= usable
    if placement.resident:
        verdict = "fits"
    elif placement.host_bytes * opts.tp * opts.pp <= HOST_PIN_SHARE * host.memory_bytes and budget > 0:
        verdict = "offload"
    else:
        verdict = "cannot"
    free_after = capacity - CUDA_CONTEXT_BYTES - placement.gpu_bytes - state
    if counted == "model" and opts.tp * opts.pp == 1:  # exactly the engine's pool: whole blocks + scratch
        num_blocks = kv_pool_blocks(kv_bytes_per_block(mc, opts.block_size, kv_dtype),
                                    memory_gb=opts.kv_cache_memory_gb, free_bytes=max(0, free_after))
        kv, kv_tokens = kv_pool_bytes(mc, num_blocks, opts.block_size, kv_dtype), num_blocks * opts.block_size
    else:
        per_block = kv_per_token_gpu * opts.block_size
        num_blocks = kv_pool_blocks(per_block, memory_gb=opts.kv_cache_memory_gb, free_bytes=max(0, free_after))
        kv, kv_tokens = (num_blocks + 1) * per_block, num_blocks * opts.block_size
    per_gpu = dict(weights=placement.gpu_bytes, weights_all=weights, kv=kv, kv_bytes_per_token=kv_per_token,
                   kv_tokens=kv_tokens, state=state, activations=act, cuda_context=CUDA_CONTEXT_BYTES,
                   peak=placement.gpu_bytes + kv + state + act + CUDA_CONTEXT_BYTES, capacity=capacity,
                   staging=_staging_bytes(placement))

    # -- speed -------------------------------------------------------------------------------------
    E, k = mc.num_experts, mc.num_experts_per_tok or int(cfg.get("num_experts_per_tok") or 0)
    if counted == "config":
        E = int(cfg.get("n_routed_experts") or 0)
    total = sum(g.numel for g in groups)
    expert_numel = sum(g.numel for g in groups if g.kind == "experts")
    active = total - expert_numel + (expert_numel * k // E if E else 0)
    graphs = not opts.enforce_eager and placement.resident and counted == "model" and _graphs(mc)
    ctx = opts.prompt_len + opts.output_len / 2
    tflops = gpu.tflops.get({"bfloat16": "bf16", "float16": "fp16", "float32": "bf16"}[opts.dtype], 0) or 1.0
    if opts.dtype == "float32":
        tflops /= 8  # no tensor-core fp32: TF32 at best
    layers_per_gpu = math.ceil(mc.num_hidden_layers / opts.pp)
    act_b, link = DTYPE_BYTES[opts.dtype], gpu.nvlink_gbs or gpu.h2d_gbs

    def decode(batch: int) -> dict:
        d = distinct_experts(E, k, batch)
        resident_dense = sum(g.nbytes for g in placement.gpu if g.kind not in ("experts", "embed"))
        resident_experts = sum(g.nbytes for g in placement.gpu if g.kind == "experts")
        share = d / E if E else 0.0
        cost = estimate.StepCost(
            hbm_bytes=resident_dense + share * resident_experts + batch * ctx * kv_per_token_gpu,
            pcie_bytes=placement.pcie_bytes_per_step(d) if E else placement.pcie_bytes_per_step(0),
            flops=2 * active * batch / (opts.tp * opts.pp), layers=layers_per_gpu, graphs=graphs,
            comm_s=2 * layers_per_gpu * estimate.allreduce_s(opts.tp, batch * mc.hidden_size * act_b, link))
        t = estimate.step_time(cost, gpu.hbm_gbs, gpu.h2d_gbs, tflops)
        seconds = t.seconds * opts.pp  # a token passes every stage
        return dict(batch=batch, tok_s=batch / seconds, step_ms=seconds * 1e3, binding=t.binding,
                    pcie_bytes_per_step=cost.pcie_bytes, parts_ms={p: v * 1e3 for p, v in t.parts.items()})

    chunk = max(1, min(opts.max_num_batched_tokens, opts.prompt_len))
    pre_cost = estimate.StepCost(
        hbm_bytes=sum(g.nbytes for g in placement.gpu if g.kind != "embed"),
        pcie_bytes=sum(g.nbytes for g in placement.host if g.kind != "embed"),
        flops=2 * active * chunk / (opts.tp * opts.pp) + 2 * mc.num_hidden_layers * chunk * chunk
        * mc.num_attention_heads * mc.head_dim / (opts.tp * opts.pp), layers=layers_per_gpu,
        comm_s=2 * layers_per_gpu * estimate.allreduce_s(opts.tp, chunk * mc.hidden_size * act_b, link))
    pre = estimate.step_time(pre_cost, gpu.hbm_gbs, gpu.h2d_gbs, tflops)
    prefill_rate = chunk / (pre.seconds * opts.pp)
    d1, dn = decode(1), decode(max(1, min(conc, kv_tokens // max(seq_tokens, 1)) or 1))
    ttft = math.ceil(opts.prompt_len / chunk) * pre.seconds * opts.pp + d1["step_ms"] / 1e3
    speed = dict(decode_batch1=d1, decode_concurrent=dn, prefill_tok_s=prefill_rate, prefill_binding=pre.binding,
                 ttft_s=ttft, cuda_graphs=graphs,
                 assumptions=dict(hbm_eff=estimate.HBM_EFF, mfu=estimate.MFU, launch_us_per_layer=1e6 * (
                     estimate.LAUNCH_GRAPH_S if graphs else estimate.LAUNCH_S), h2d_gbs=gpu.h2d_gbs))

    # -- verdict and advice --------------------------------------------------------------------------
    pl = dict(gpu_bytes=placement.gpu_bytes, host_bytes=placement.host_bytes,
              host_groups=sorted({g.kind for g in placement.host}),
              expert_share_resident=placement.expert_resident_share(),
              pcie_bytes_per_decode_token=d1["pcie_bytes_per_step"])
    if verdict == "fits":
        notes.append("offload unnecessary: every weight stays on the GPU")
    elif verdict == "offload":
        notes.append(f"needs offload: {_gb(placement.host_bytes)} of weights in pinned host memory "
                     f"({', '.join(pl['host_groups'])}); {_gb(d1['pcie_bytes_per_step'])} cross PCIe per decode token")
        if fits_whole and opts.weight_budget_gb is not None:
            notes.append(f"warning: --weight-budget-gb forces offload of a model that fits "
                         f"({_gb(weights)} + KV for one {max_len}-token sequence): it costs decode speed for nothing")
    else:
        notes += _cannot_advice(groups, opts, gpu, host, usable, min_kv, placement, budget)
    if verdict != "cannot" and kv_tokens < conc * seq_tokens:
        notes.append(f"KV holds {kv_tokens} tokens: {kv_tokens // max(seq_tokens, 1)} sequences of {seq_tokens} "
                     f"at once, fewer than --concurrency {conc} (the rest wait or are preempted)")
    if verdict != "cannot" and kv_tokens < max_len:
        notes.append(f"KV holds {kv_tokens} tokens, less than --max-model-len {max_len}: the engine refuses to start")
    if opts.quant:
        notes.append(f"--quant {opts.quant}: weights are dequantized per step (no fused quantized kernels yet): "
                     "it saves memory, not time; experts stay dense in GPU memory")
        if opts.quant == "fp8" and not gpu.fp8:
            notes.append(f"{gpu.name} has no FP8 tensor cores: fp8 weights can only be stored, never computed")
    if opts.tp * opts.pp > 1:
        notes.append("the engine runs one GPU today: the TP/PP figures are what each rank would hold")
    if n_gpu > opts.tp * opts.pp:
        notes.append(f"{n_gpu} GPUs but TP x PP = {opts.tp * opts.pp}: the others are idle (or run replicas)")
    if counted == "config":
        notes.append(f"{mc.architecture} has no model class in ferrylm yet: counted from config.json "
                     "(memory.analytical_groups), and the engine cannot run it")
    return Plan(opts, name, mc.architecture, n_gpu, gpu.name, host.name, total, active, summarize(groups),
                per_gpu, verdict, pl, speed, notes, counted)


def _graphs(mc: ModelConfig) -> bool:
    """Whether the engine captures CUDA graphs for this family (the model class says)."""
    from ferrylm.models.registry import model_class

    return bool(getattr(model_class(mc), "cuda_graphs", False))


def _activation_bytes(mc: ModelConfig, opts: PlanOptions, b: int) -> int:
    """A step's live activations: a few [T, H] / [T, I] buffers, the q/k/v of a chunk, fp32 logits."""
    T = opts.max_num_batched_tokens
    inter = max(mc.intermediate_size, mc.moe_intermediate_size * max(mc.num_experts_per_tok, 1))
    qkv = (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim
    return T * (4 * mc.hidden_size + 2 * inter + qkv) * b + opts.max_num_seqs * mc.vocab_size * 4


def _staging_bytes(placement) -> int:
    """Two device buffers of the largest streamed group (double buffering while a layer computes)."""
    streamed = [g.nbytes for g in placement.host if g.kind not in ("experts", "embed")]
    return 2 * max(streamed, default=0)


def _cannot_advice(groups, opts, gpu, host, usable, min_kv, placement, budget) -> list[str]:
    total = sum(g.nbytes for g in groups)
    out = []
    if budget <= 0:
        out.append(f"cannot run: KV for one {opts.max_model_len or 'full-length'} sequence alone needs "
                   f"{_gb(min_kv)} of {_gb(usable)} usable per GPU; lower --max-model-len")
    else:
        out.append(f"cannot run: {_gb(placement.host_bytes * opts.tp * opts.pp)} would have to live in host memory, "
                   f"over {HOST_PIN_SHARE:.0%} of the host's {_gb(host.memory_bytes)}")
    need = math.ceil(total / max(usable - min_kv, 1))
    out.append(f"to hold it resident: {need} x {gpu.name} with TP (weights {_gb(total)})")
    if not opts.quant:
        nf4 = sum(WeightFormat(opts.dtype, "nf4").param_bytes("x.weight", (g.numel // 1024, 1024), g.kind == "experts")
                  if g.kind not in ("embed", "lm_head", "norm", "router") else g.nbytes for g in groups)
        dense_experts = sum(g.nbytes for g in groups if g.kind == "experts")
        out.append(f"or quantize: with --quant nf4 (a ferry store) the weights take about {_gb(nf4)}"
                   + (f" ({_gb(dense_experts)} of experts stay dense: the engine dequantizes experts at load)"
                      if dense_experts else ""))
    return out


def _gb(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"
