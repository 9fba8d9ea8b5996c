"""Speed estimate: decode and prefill tokens/s and time to first token from a roofline of each step (HBM
bytes, PCIe bytes, FLOPs) plus the serial parts (experts read in place over PCIe, host overhead, launches),
with which resource binds.

A decode step of B sequences takes max(t_hbm, t_copy, t_compute) + t_mapped + t_host + t_launch + t_comm:
    t_hbm     = resident weights the step touches / (HBM GB/s * HBM_EFF) + KV read / (HBM GB/s * KV_HBM_EFF)
                + experts read from HBM / (HBM GB/s * moe_hbm_eff(tokens per expert))
    t_copy    = bytes the copy engine moves (streamed layers, copy-path expert misses) / pinned H2D GB/s
                (copies overlap compute)
    t_compute = 2 * active params * B / (TFLOP/s * MFU) (the embedding none, the LM head per sampled row),
                the routed experts' share at `moe_mfu` (rows an expert)
    t_mapped  = decode steps of up to `CachedExperts.mapped_tokens` tokens with experts in host memory: one
                fused launch reads the hits from HBM and the misses in place from mapped host memory at
                pinned H2D GB/s * INPLACE_EFF, side by side, while (hybrid decode, the engine's default) the
                host's cores compute a share of the misses at HOST_EXPERT_EFF(_NATIVE) of the host's read rate (packed
                experts: HOST_PACKED_EFF of their format), the share balanced as the engine balances it
                (`offload/cost_model.cpu_share` on these figures): max(hits, GPU misses, host misses)
                (hits at least every expert's resident time: a miss never speeds the kernel up),
                serial with the other kernels (and then not in t_hbm); plus the routing tally's promotion
                copies (`PROMOTIONS_PER_MISS`; batch 1 without a decode trace: `hit_rate.sampled_promotions`),
                which the next step waits for (they land at once) and which
                share the link with the in-place reads; a layer with an in-place miss adds INPLACE_LAYER_S, a
                promotion PROMOTION_S (latencies small experts do not hide)
    t_host    = copy-path MoE layers (larger steps, or a mapped path off): CACHED_EXPERT_S per expert touched;
                the misses split between copies and the host's cores as the engine splits them
                (`offload/cost_model.split_misses`), the host's part a term of the roofline's max
    t_launch  = layers * LAUNCH_S (eager) or LAUNCH_GRAPH_S (CUDA graphs), plus LAYER_EXTRA_S of the family
    t_comm    = 2 all-reduces per layer under TP (ALLREDUCE_S + ring bytes over NVLink or PCIe)
Packed experts (int4 / int8 / NF4 / fp8) are read at `PACKED_TIME` of a dense expert's time, resident and in place.
A prefill chunk of T tokens: max(2 * active params * T / (TFLOP/s * MFU), streamed bytes / H2D) + t_launch, the
MoE layers with experts in host memory layer by layer after it (`StepCost.copy_layers`).
The constants marked "measured" come from one H200 session (docs/benchmarks.md); the others are assumptions
until `ferry plan --check` / `benchmarks/bench_plan.py` measure them. Knows nothing about files or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

HBM_EFF = 0.7
"""Share of peak (data-sheet) HBM bandwidth a decode step's GEMVs reach: 0.8 of the read rate a copy kernel
measures, which on the H200 is 4.2 of its 4.8 TB/s (`bench_attention.py`'s read roofline, 4196 GB/s). Was 0.8 of
the data sheet; the first `bench_plan` run (docs/benchmarks.md "`ferry plan` predicted vs measured") measured
the 16-layer Llama-3-8B shape at 290 tok/s at batch 1 against 427 predicted, a lower bound (a graph capture in
the timing) that 0.8 of the data sheet cannot meet with any per-layer cost."""
KV_HBM_EFF = 0.6
"""Share of peak HBM bandwidth the paged decode kernel reads the KV cache at. Fitted to session 7's H200 run of the
Llama-3-8B shape at batch 16 and a 16k context (`bench_resident.py`, 840 tok/s: 34 GB of KV a step besides 16 GB
of weights); the kernel alone measured 0.43-0.69 at batch 1-16 and 1k-16k contexts, 0.85-0.9 at batch 64
(`bench_attention.py`, docs/benchmarks.md). Was HBM_EFF (0.7), which predicted that row 24% fast."""
MOE_HBM_EFF = 0.66
"""Share of peak HBM bandwidth the fused MoE kernel reaches reading resident experts at one token per expert.
Measured (session 7, H200, `bench_resident.py`, one-launch ops on): the 8-layer resident Mixtral decodes 451 tok/s
at batch 1, 2.22 ms a token, of which the attention, norms, LM head (0.28 ms at HBM_EFF) and launches (0.16 ms)
leave 5.64 GB of experts in 1.78 ms: 3.2 of 4.8 TB/s. Was 0.44, fitted to session 5's 321 tok/s before the
one-launch ops (the small kernels between the expert launches were then counted here)."""

MFU = 0.65
"""Share of peak (data-sheet) tensor FLOP/s a prefill's dense GEMMs reach. Measured: the Llama-3-8B shape's 2k-token
prefill at 41.2k tok/s on the H200 (session 7, `bench_resident.py`, one-launch ops on). The FLOPs counted are the
layers' and attention's for every token and the LM head's for the sampled row only (the embedding is a lookup):
with them 0.65 predicts that row at -2.5% and session 8's 16-layer shape (`bench_plan.py`, 62.3k tok/s, not
fitted) at +2.6%. Counting every parameter for every token (until session 8) put the two at -14% and -15%."""
MOE_MFU_HALF_ROWS = 512
"""Rows per expert at which the fused MoE kernel's grouped GEMMs reach half of peak tensor FLOP/s in a prefill
(`moe_mfu`). Fitted (H200, `bench_plan.py --cases moe`, the resident 8-layer Mixtral shape, one prompt a chunk, 8
experts top-2): 512-token prompts (128 rows an expert) 31.5k tok/s in sessions 9 and 10 (0.2 of peak: two
64-row tiles an expert re-read each weight tile, so at that size the kernel is bound by weight reads), and
2048-token prompts (512 rows) 74,953 tok/s in session 12 (0.5). One constant (0.2) had put the second at -56%."""


DEQUANT_GBS = 1919.0
"""Bytes a second (GB/s: packed bytes read plus dense bf16 written) of the packed experts' decode pass for two codes a
byte (int4, NF4: `fused_moe._decode_experts_4bit`, `DECODE_4BIT_TILE`), at most HBM_EFF of the HBM rate
(`dequant_gbs`): an absolute rate like `PACKED_DECODE_GBS`, since the in-tile decode, not HBM, binds (the tile decode
took 19.8 ms on the H100 and 19.5 on the H200, whose HBM is 1.4x faster). Measured, not fitted to a plan check: the
resident 8-layer NF4 Mixtral's 512-token prefill (`benchmarks/profile_prefill.py`, 64 experts: 6.3 GB read, 22.5 GB
written), `_decode_experts_4bit` 15.0 ms on the H200 (session 33; not yet measured on the H100)."""

DEQUANT_TILE_GBS = 1455.0
"""The same for one byte a code (int8, fp8, q8_0), which the fused kernel's tile decode decodes (`_decode_experts`):
session 31's H100 profile of that prefill, 19.8 ms for the same 64 experts (before session 33 every format's rate; until
session 32, HBM_EFF of the HBM rate: 2345 GB/s on the H100)."""

DEQUANT_GROUP_S = 0.12e-3
"""Measured (fitted): seconds the device waits on the host per decode group of a packed prefill
(`fused_moe.dequant_rows`: a group's decode launches, grouped GEMMs and the copies between; `decode_group_experts`
experts a group, or one a round on the copy road's one-large-a-round path), serial with its kernels. Session 33 (H200,
`profile_prefill.py`, the resident 8-layer NF4 Mixtral's 512-token prefill): the device idled 8.0 ms of 39.4 (6.9 of
42.7 with the tile decode) over the 64 groups the plan counts, 0.11-0.125 ms each (the engine ran 75: `expert_row_cap`
splits an expert past twice its uniform share of rows into pieces, each a group, which the plan does not count). With
it and `DEQUANT_GBS` the plan's two checks of that model in the same session (`bench_plan.py --cases moe-nf4`: 12.5k
and 12.6k tok/s measured with the tile decode; the 4-bit kernel left the prefill's wall time as it was, 12.5k against
12.8k in `profile_prefill.py`: the host binds) replay at +4.5% / +3.8% (were +12.8% / +12.1%); session 31's H100
check, before `dequant_rows`' one copy a call, at +16.2% (was +58.4%). The offloaded NF4 prefill's rounds take it inside their work (`StepCost.copy_layers`)."""


def dequant_gbs(hbm_gbs: float, scheme: str | None = "nf4") -> float:
    """GB/s of the packed experts' decode pass on a GPU of this HBM rate: `DEQUANT_GBS` for two codes a byte (int4,
    NF4), `DEQUANT_TILE_GBS` else; at most HBM_EFF of the HBM rate."""
    return min(DEQUANT_GBS if scheme in ("nf4", "int4") else DEQUANT_TILE_GBS, hbm_gbs * HBM_EFF)


MOE_MFU_MIN = 0.2
"""`moe_mfu` below 128 rows an expert: the rate of the 512-token fit. Fewer rows are bound by weight reads, which
the HBM term prices (decode: one or a few rows an expert); a share falling with the rows would price those reads
a second time as FLOPs."""


def moe_mfu(tokens_per_expert: float) -> float:
    """Share of peak tensor FLOP/s the grouped expert GEMMs reach at `tokens_per_expert` rows an expert:
    m / (m + MOE_MFU_HALF_ROWS), between MOE_MFU_MIN and the dense GEMMs' MFU."""
    return min(MFU, max(MOE_MFU_MIN, tokens_per_expert / (tokens_per_expert + MOE_MFU_HALF_ROWS)))


LAUNCH_S = 150e-6
"""Per layer, eager PyTorch: ~10 kernels plus Python."""
LAUNCH_GRAPH_S = 20e-6
"""Per layer inside a CUDA graph, beyond the bytes: paged attention at short context and the ~13 small kernels
between the GEMMs (`layers/fused_ops.py`), bound by their latency. Fitted to session 7's H200 run of the
Llama-3-8B shape (`bench_resident.py`): batch 1 at 208 tok/s is 4.81 ms a step where the bytes at HBM_EFF take
4.49 ms, 10 us a layer; batch 64 at 8533 tok/s wants less than nothing (GEMMs at 64 rows read below HBM_EFF,
which this model does not separate): 20 us puts both within 15% (195 and 9780 predicted). Was 30 us before the
one-launch ops (~94 us a layer above the reads with torch's chains of ~40 kernels a layer)."""
LAYER_EXTRA_S = {"yuan-moe": 60e-6}
"""Per graphed decode layer, by `model_type` ("-moe" for its MoE models), beyond everything above: measured, not yet
explained. Yuan2.0-M32 graphed at batch 1 decodes 232 tok/s on the H200 (session 14, `bench_resident.py --cases
yuanm32-b1`, tree of 231d131), 4.31 ms a token where the model above says 2.38 ms of reads and 0.48 ms of launches:
60 us a layer (its LF filter, attention router and 32 small experts). Session 7 measured 186 tok/s (108 us a layer)
before its layers lost ~18 launches (residual adds, the router, the filter's shifts)."""
ALLREDUCE_S = 20e-6
"""Fixed cost of one tensor-parallel all-reduce (two per layer), on top of its bytes over the link."""
INPLACE_EFF = 0.85
"""Measured: the fused MoE kernel reading dense experts in place from mapped host memory reaches 45-47 GB/s
against the copy engine's 54.6 (H200, `benchmarks/bench_mapped.py`, 2026-12-01)."""
INPLACE_LAYER_S = 0.15e-3
"""Device time a mapped layer with at least one in-place miss spends beyond its bytes at INPLACE_EFF, which a small
expert does not hide. Not the kernel's own ramp: one Qwen3-30B-A3B layer at one token with 1 / 2 of its 8 experts in
place takes 0.209 / 0.391 ms CUDA-graphed, 0.03-0.04 ms over its bytes at the copy engine's rate (H100, session 26,
`bench_mapped.py --mixed`); in the engine the promotions' copies share the link with those reads. Fitted (H200,
session 14's profile of the Qwen3-30B-A3B shape, 16 layers under 4 GiB, batch 1, `profile_offload.py --profile`):
the fused kernel took 3.69 ms a step for 107 MB read in place (2.28 ms at 47 GB/s) and ~0.16 ms of hits, in ~8.4
layers with a miss: 0.15 ms each (9.4 MB experts read at ~29 GB/s); whole Mixtral experts (352 MB) read at 47 GB/s,
where this is 2% of a miss."""
PROMOTION_S = 0.14e-3
"""Device time of one promotion copy beyond its bytes at the pinned H2D rate (its copies per weight, their events).
Fitted to the same profile: 7.9 promotions a step of 9.4 MB took 2.47 ms of copies (74 MB: 1.35 ms at 55 GB/s)."""
PROMOTIONS_PER_MISS = 0.55
"""Expert copies the routing tally's promotions make per in-place miss of a mapped decode step, each landing
before the next step (`RoutingTally.land_now`). Measured (H200, Qwen3-30B-A3B shape 16 layers under 4 GiB, batch
1): 5.7 copies a step at 10.65 in-place misses (`bench_plan.py`, session 10), 8.4 at 13.4 (`profile_offload.py`);
capped by `PROMOTIONS_PER_LAYER` (batch 16: 5.0 a step at 1036 misses)."""
PROMOTIONS_PER_LAYER = 0.35
"""Most promotion copies a mapped decode step makes per cached layer (see `PROMOTIONS_PER_MISS`)."""
PACKED_TIME = {"nf4": (2.5, 0.30), "int4": (5.4, 0.33), "int8": (1.4, 0.50), "fp8": (0.8, 0.51)}
"""Packed expert format -> (resident, in place) time to read one expert at decode, relative to the same expert
dense in bf16. Measured on the H200, two Mixtral experts at one token (`bench_mapped.py --sweep`): NF4 g64 on the
split-K decode kernel (`fused_moe_decode.by_format_config`, session 12) 0.45 ms resident and 4.17 in place
against bf16's 0.18 / 13.8 (session 11's first NF4 kernel: (5.4, 0.92)); int8 per channel on the plain kernel
0.26 / 6.92 (session 11); fp8 on the decode kernel's fp8 tiles (session 26, H100, one Qwen3-30B-A3B layer at one
token, CUDA-graphed, `bench_mapped.py --mixed`): 8 experts 0.041 ms from HBM and 0.764 in place against bf16's 0.051
/ 1.494 (GPUs without FP8 conversion keep the plain kernel's table decode: `FP8_TABLE_TIME`). int4 in place: the
engine's calibration (`calibration.inplace_read_gbs`: the fused kernel reading one expert in place at one token) read a
Mixtral int4/32 expert's 99.1 MB at 43.3 GB/s on the H200 (session 16, `offload-2026-12-03-s16-hybrid32-int4-c-off.json`):
2.29 ms against bf16's 6.9 above (was 0.92, assumed from session 11's first NF4 kernel, which put the host's balanced
share of int4 misses at twice the engine's); int4 resident is not measured (the plain kernel, assumed as NF4 was on
it). Still latency-bound
resident (NF4 458 GB/s of packed bytes against ~4.2 TB/s), so 4-bit experts buy memory and PCIe bytes, not HBM
time."""
FP8_TABLE_TIME = (5.3, 0.53)
"""fp8 experts' (resident, in place) read time relative to bf16 on GPUs that do not convert e4m3 in hardware
(compute capability below 8.9: A100/A800, A10, T4), where they stay on the plain kernel and decode through a
256-entry table: measured on the H100 with that kernel, one Qwen3-30B-A3B layer at one token, 8 experts 0.269 ms
from HBM and 0.802 in place against bf16's 0.051 / 1.501 (session 26, `bench_mapped.py --mixed`)."""


PACKED_DECODE_GBS = {"nf4": 450.0}
"""Packed bytes a second at which the decode kernel (`layers/fused_moe_decode`, its by-format tiles) reads resident
experts of this format at one token an expert, whatever the GPU's HBM rate: its in-tile decode binds, not HBM, so a
time relative to bf16 (`PACKED_TIME`'s first figure, which scales with the HBM rate) predicted the H100 24% to 74%
slow. Measured: two NF4 g64 Mixtral experts (99.1 MB each) at one token 0.448 ms on the H200 (442 GB/s, session 12,
`bench_mapped.py --sweep`); the resident 8-layer NF4 Mixtral on the H100 (session 30, `bench_plan.py --cases
moe-nf4`): batch 1 at 246 tok/s, 4.06 ms a step, of which the attention, LM head and launches take ~0.56 ms at the
model's other rates: 16 experts in 3.5 ms (452 GB/s); batch 16 (4 tokens an expert) 1434 tok/s, 64 experts in
~10.6 ms (600 GB/s: `PACKED_DECODE_GROWTH`). Formats not listed keep `PACKED_TIME`."""
PACKED_DECODE_GROWTH = 0.2
"""`PACKED_DECODE_GBS` grows as tokens an expert to this power up to `PACKED_DECODE_GROWTH_ROWS` (more rows a decoded
tile: session 30's 600 against 452 GB/s at 4 against 1), and at most HBM_EFF of the HBM rate."""
PACKED_DECODE_GROWTH_ROWS = 4.0
PACKED_DECODE_TFLOPS = {"nf4": 20.0}
"""FLOP/s (in TFLOP/s) of the decode kernel's tiles on an expert's rows, which bind past ~8 rows an expert: one NF4
Mixtral layer (8 experts, uniform routing) took 1.65 / 1.69 / 2.62 / 3.57 / 4.50 ms at 4 / 8 / 16 / 24 / 32 rows an
expert on the H100 (session 30, `bench_moe_prefill.py --packed nf4 --decode-kernel`): 17-25 TFLOP/s from 16 rows on
(16-row blocks: 24 rows pay for 32), the bytes' rate below."""


def packed_hbm_equiv(nbytes: float, dense: float, scheme: str, native_fp8: bool, hbm_gbs: float,
                     tokens_per_expert: float) -> float:
    """Dense-equivalent bytes that time one resident packed expert of `nbytes` (`dense` in bf16) at
    `tokens_per_expert`: read at `moe_hbm_eff` of `hbm_gbs` (as `step_time` reads every expert's equivalent bytes)
    they take the longer of its packed bytes at `PACKED_DECODE_GBS` and its rows' FLOPs (2 x its bf16 parameters a
    row, `dense` bytes) at `PACKED_DECODE_TFLOPS`; a format without those rates, `PACKED_TIME`."""
    rate = PACKED_DECODE_GBS.get(scheme)
    if rate is None or not hbm_gbs:
        return dense * packed_time(scheme, native_fp8)[0]
    t = max(tokens_per_expert, 1.0)
    gbs = min(rate * min(t, PACKED_DECODE_GROWTH_ROWS) ** PACKED_DECODE_GROWTH, hbm_gbs * HBM_EFF)
    seconds = max(nbytes / (gbs * 1e9), t * dense / (PACKED_DECODE_TFLOPS[scheme] * 1e12))
    return seconds * hbm_gbs * 1e9 * moe_hbm_eff(t)


def packed_time(scheme: str, native_fp8: bool) -> tuple[float, float]:
    """`PACKED_TIME` of a packed expert format on a GPU with (`native_fp8`) or without FP8 conversion."""
    return FP8_TABLE_TIME if scheme == "fp8" and not native_fp8 else PACKED_TIME.get(scheme, (1.0, 1.0))


HOST_EXPERT_EFF = 0.27
"""Measured: bf16 experts computed on the host's cores while the GPU reads other experts in place reach 0.27 of
the host's read rate as `hw/bandwidth.host_read_gbs` measures it (the rate the planner multiplies this by):
33.5 GB/s on the lent H200 host, 16 threads, Mixtral experts (`bench_hybrid_overlap.py`, session 4: the GPU
keeps 45.4 GB/s beside it), against 124 GB/s that function measured on the same host (first `bench_plan` run).
Was 0.37: 33.4 GB/s over another tool's read figure (90.7 GB/s, `bench_cpu_experts.py`), which the planner's own
124 GB/s then turned into 46 GB/s. Used since session 37 for hosts without AVX-512 only (torch's GEMM runs their
experts; `HOST_EXPERT_EFF_NATIVE` for the others)."""
HOST_EXPERT_EFF_NATIVE = 0.51
"""As `HOST_EXPERT_EFF` where bf16 experts run on `layers/host_native`'s kernels (an AVX-512 host; the plain path,
0.27, was measured before they existed): on the H100 host (session 37, `bench_plan.py --cases moe-offload-bf16`) the
engine's calibration timed a Mixtral expert (352 MB) at one token beside copies on 16 threads at 5.23 ms, 4.93 ms
beyond the call: 71.5 GB/s against the 140 GB/s `host_read_gbs` measured in the same run (the plain GEMM: 7.87 ms).
With 0.27 the plan put the batch-1 share at 0.42 where the engine's tuner settled at 0.66, and decode 30% under.
Measured on an AMX host (AVX512-BF16); assumed for AVX-512 hosts without BF16 (Ice Lake), where the native kernel
widens bf16 to fp32 and may read slower."""
HOST_PACKED_EFF = {"nf4": 0.52, "int4": 0.36}
"""Packed experts on the host's cores (the host computes them packed, `offload/host_experts.py`): the packed bytes a
second of one expert at one token beyond `HOST_EXPERT_CALL_S`, as a share of the host's read rate (as
`HOST_EXPERT_EFF` for dense ones). NF4, the native AVX-512 kernel (one call an expert, `host_native`): a Mixtral
expert's 99.1 MB of codes in 2.73 ms at one token on 14 threads of the H100 host (docs/benchmarks.md, Session 27,
`bench_host_rowblocks.py --formats nf4`), 2.43 ms beyond the call: 40.8 GB/s against the 78.9 GB/s read rate
`bench_plan` measured on that host the same session (the engine's calibration there: 2.87 ms beside copies on 16
threads). int4, torch's int4pack kernel: the engine's calibration of a Mixtral int4/32 expert beside copies, 2.55 ms
at one token on 15 threads of the H200 host (`offload-2026-12-03-s16-hybrid32-int4-c-off.json`), 2.25 ms beyond the
call: 44 GB/s against that host's 124 GB/s. Other packed formats (int8, fp8, int4min) have no measured host rate
here: no host share is predicted for them (the engine calibrates its own)."""
HOST_PACKED_TOKEN = {"nf4": 0.25, "int4": 0.21}
"""Each token an expert takes beyond the first adds this share of its one-token host time (packed experts decode
their codes per token: compute-bound where dense ones stay bound by their bytes). NF4: 4.75 ms at 4 tokens against
2.73 at one (Session 27, the same run): (4.75 / 2.73 - 1) / 3. int4: the same calibration's 13.2 ms at 16 tokens
against 3.14 at one (alone): (13.2 / 3.14 - 1) / 15."""
NATIVE_HOST_FORMATS = {"nf4"}
"""Packed formats the host computes only through `layers/host_native`'s AVX-512 kernels: without AVX-512 they run
torch's decode at ~0.7 GB/s of codes (Session 15: 149 ms an NF4 Mixtral expert), which never earns a share."""


def host_expert_eff(scheme: str | None, avx512: bool = True) -> float:
    """Share of the host's read rate at which it computes one expert of the bank's format (None: dense) at one
    token; 0 where no rate is known (no share is predicted)."""
    if scheme is None:
        return HOST_EXPERT_EFF_NATIVE if avx512 else HOST_EXPERT_EFF
    if scheme in NATIVE_HOST_FORMATS and not avx512:
        return 0.0
    return HOST_PACKED_EFF.get(scheme, 0.0)


def host_expert_s(nbytes: float, scheme: str | None, host_gbs: float, tokens: float = 1.0, params: float = 0.0,
                  host_tflops: float = 0.0) -> float:
    """Host seconds for one expert of `nbytes` (its format's bytes) at `tokens` tokens, beyond HOST_EXPERT_CALL_S:
    its bytes at `host_gbs` (`host_expert_eff` of the read rate), packed formats growing with the tokens
    (`HOST_PACKED_TOKEN`), or, where longer, its `params` weights' FLOPs at `host_tflops` (prefill rows on the host,
    `--experts cpu`)."""
    grow = HOST_PACKED_TOKEN.get(scheme, 0.0) if scheme else 0.0
    flops_s = 2 * params * tokens / (host_tflops * 1e12) if params and host_tflops else 0.0
    return max(nbytes / (host_gbs * 1e9) * (1 + grow * max(tokens - 1, 0.0)), flops_s)


HOST_GHZ = 2.0
"""Assumed all-core clock of a server CPU under a matmul (no data sheet gives a sustained one)."""
HOST_FLOPS_PER_CYCLE = {"amx": 1024, "avx512": 64, "avx2": 16}
"""Peak bf16 FLOPs a core does a cycle: AMX tiles (Sapphire Rapids on), AVX-512 FMA on fp32 (torch widens bf16),
AVX2 at half its fp32 rate (torch's bf16 GEMM without AVX512-BF16: on session 36's 2-core AVX2 EPYC, 4096x4096
weights at 16 / 128 / 512 rows, bf16 10.6 / 19.8 / 12.4 GFLOPS against fp32 37.5 / 46.6 / 67.0; this model says
19.2)."""
HOST_MFU = 0.3
"""Assumed share of that peak torch's CPU GEMMs (oneDNN) reach on an expert's rows, all cores (the AVX2 box above:
fp32 at 128-512 rows 24-35% of its 2 x ~3 GHz x 32 peak); not measured on an AMX or AVX-512 host (the lent machines'
hosts run expert prefill on a GPU): a plan with `--experts cpu` says the rate is assumed."""


def host_tflops(cores: int, amx: bool, avx512: bool) -> float:
    """Assumed bf16 matmul rate of `cores` cores (`HOST_GHZ`, `HOST_FLOPS_PER_CYCLE`, `HOST_MFU`)."""
    isa = "amx" if amx else "avx512" if avx512 else "avx2"
    return cores * HOST_GHZ * 1e9 * HOST_FLOPS_PER_CYCLE[isa] * HOST_MFU / 1e12


HOST_EXPERT_CALL_S = 0.3e-3
"""Host time per expert the hybrid path's worker runs in a decode step, beyond its bytes: a Python loop of ~8
torch ops per expert (`HostExperts.rows`), each a fork/join of the thread team beside the GPU's reads.
Measured (fitted): the 16-layer Qwen3-30B-A3B shape under 4 GiB decodes 27.1 tok/s at batch 16 (first
`bench_plan` run): 590 ms a step, of which ~1100 host expert calls (69 misses a layer, each split with the GPU)
take 370 ms beyond 7.4 GB at 33.5 GB/s: 0.33 ms a call (cf. CACHED_EXPERT_S, the copy path's ~0.4 ms an
expert). Small experts (9.4 MB, 0.28 ms of bytes) are bound by it; Mixtral's (352 MB, 10 ms) are not."""
HANDOFF_S = 0.25e-3
"""Device-visible time of one layer's hybrid hand-off to the host with no work (host nodes, the worker's wake,
the rows back), paid by every cached layer of a hybrid decode step. Assumed from session 9's profile (the
16-layer Qwen3-30B-A3B shape under 4 GiB at batch 1: 0.44 ms a layer over copies alone, ~0.84 misses a layer at
share 0.28); the engine measures its own (`HostDecode.round_trip_s`, logged at start)."""
HOST_READ_EFF = 0.6
"""Assumed: share of one node's data-sheet memory bandwidth a host sustains reading (when not measured)."""
CACHED_EXPERT_S = 0.4e-3
"""Measured (fitted): host time per expert a copy-path MoE layer touches (one sync, dispatch and launches
per expert, eager): Qwen3-30B-A3B under 8 GiB decodes 6.27 tok/s at batch 1 on that path, ~3.2 ms a layer
beyond its copies with 8 experts touched; Mixtral (2 touched) < 0.8 ms (H200, docs/benchmarks.md). Decode
only: a prefill step copies its misses in rounds through the fused kernel, and the first `bench_plan` run
bounds its host cost at <= 0.05 ms an expert (the 16-layer Qwen3-30B-A3B shape under 4 GiB prefilled >= 1118
tok/s, 0.46 s for 512 tokens, of which its 19 GB of copies take 0.35 s at 55 GB/s, over 2048 experts touched);
the planner counts none there (it predicted 450 tok/s with 0.4 ms each)."""


def moe_hbm_eff(tokens_per_expert: float) -> float:
    """MOE_HBM_EFF at one token per expert, growing as t^(1/3) (0.65-0.70 at four: measured, H200); at most
    HBM_EFF."""
    return min(HBM_EFF, MOE_HBM_EFF * max(tokens_per_expert, 1.0) ** (1 / 3))


@dataclass(frozen=True)
class StepCost:
    hbm_bytes: float
    """Weights (and the like) read from HBM at HBM_EFF."""
    pcie_bytes: float
    """Bytes the copy engine moves host -> device (overlapped with compute)."""
    flops: float
    """FLOPs of the dense GEMMs (at MFU)."""
    layers: int
    graphs: bool = False
    comm_s: float = 0.0
    """Tensor-parallel all-reduces of the step (not overlapped with compute)."""
    expert_hbm_bytes: float = 0.0
    """Dense-equivalent bytes of experts the fused MoE kernel reads from HBM (at `moe_hbm_eff`)."""
    tokens_per_expert: float = 1.0
    expert_all_bytes: float = 0.0
    """Mapped steps: dense-equivalent bytes of every expert the step uses, as if all were resident. Its HBM
    time is the floor of the experts' time: misses read in place never make the kernel faster than all-resident
    (without it a higher hit rate could predict a slower step, the hits' HBM share growing)."""
    host_experts_s: float = 0.0
    """Hybrid decode: seconds the host's cores spend on their share of the misses, beside the kernel (mapped;
    on the copy path, a term of the roofline's max)."""
    mapped: bool = False
    """Misses read in place: one fused launch reads hits from HBM and misses over PCIe side by side, so the
    experts take max(hits, in-place reads), serial with the step's other kernels."""
    inplace_bytes: float = 0.0
    """Dense-equivalent bytes the fused kernel reads in place over PCIe (serial with the step's kernels)."""
    mapped_layers: tuple = ()
    """Mapped steps, per MoE layer: (dense-equivalent bytes of every expert the layer uses, in-place bytes of its
    misses, probability that none of them misses[, hit rate: hybrid decode]). One launch a layer: a layer with a miss
    takes max(its experts from HBM, its in-place reads), one without takes its HBM time, and the layers run one after
    another. With the fourth element the host splits every miss (`CachedExperts._forward_mapped`): the hits' launch
    (the hit rate's share of the layer's HBM time) and then the misses' columns in place, one after the other. Session 12
    (Mixtral 32L NF4, batch 1, hit 0.91): a miss in ~1 of 5 layers, so a step is ~0.8 of the layers' HBM time plus
    the in-place reads (34.2 ms measured; max over the whole step said 25.3). Empty: max over the step."""
    promotion_bytes: float = 0.0
    """Bytes the mapped path's promotions copy a step (serial: the next step waits for them to land)."""
    promotions: float = 0.0
    """Promotion copies a step (each PROMOTION_S beyond its bytes)."""
    host_s: float = 0.0
    """Host overhead of copy-path MoE layers (serial)."""
    kv_bytes: float = 0.0
    """KV cache read by the step's attention (at KV_HBM_EFF)."""
    layer_extra_s: float = 0.0
    """A family's measured per-layer time beyond this model (`LAYER_EXTRA_S`), serial."""
    expert_flops: float = 0.0
    """FLOPs of the routed experts' grouped GEMMs (at `moe_mfu`)."""
    dequant_bytes: float = 0.0
    """HBM bytes of packed experts' decode pass into dense weights before their dense GEMMs (`fused_moe.dequant_rows`,
    eager steps of at least `PACKED_DENSE_MIN_ROWS` rows an expert on average): each expert's packed bytes read and its
    dense weights written, at `dequant_gbs`, serial with the GEMMs (which then read the dense weights). Session 30's H100 check
    of the resident 8-layer NF4 Mixtral (`bench_plan.py --cases moe-nf4`, 512-token chunks, 64 experts decoded a
    chunk): prefill 12.2k tok/s measured where the GEMMs alone predicted 20.0k."""
    dequant_groups: float = 0.0
    """Decode groups of those passes (`fused_moe.decode_group_experts`), each `DEQUANT_GROUP_S` of host time the
    device waits on."""
    dequant_scheme: str | None = "nf4"
    """The packed experts' scheme, which picks the decode pass's rate (`dequant_gbs`)."""
    copy_layers: tuple = ()
    """Copy-path prefill, per MoE layer with experts in host memory: (bytes its misses copy, HBM bytes of its hits,
    of its misses, FLOPs of its hits, of its misses, of the copies the bytes that fit its free slots), none of
    them in the step-wide terms. Such a layer cannot start its copies before its router has run (the engine reads
    each layer's routing on the host); only copies into slots no hit holds overlap the hits' work (the rest wait
    for the hits' slots), and a round of misses computes once its copies land, in slots the next round's copies
    then wait for: a layer takes max(its free slots' copies, its hits) + its other copies + its misses' work, and
    the layers run one after another. Session 24's H100 run
    (Mixtral 8L NF4 under 5 GiB, 512-token prompts) prefilled 3338 tok/s where copies overlapping everything
    said 7580. A seventh element (hits, misses) says the layer's large experts run one a round
    (`CachedExperts.one_large_a_round`, `free_hits_first`): the first copy waits for one hit's work (none with a free
    slot), the copies then stream back to back under the other hits' and the misses' work, the last miss computes
    after its copy: first hit + max(copies, the rest of the work) + last miss (session 28, the same 8L prefill: 7181
    / 7247 tok/s in that order against 5403 / 5419 in one round of all in flight). An eighth element (hits', misses'
    bytes) is their decode pass where they take one (`dequant_bytes`), serial with their work; a ninth (hits', misses'
    decode groups) its host time (`dequant_groups`), inside their work too (under the copies where those bind)."""


@dataclass(frozen=True)
class StepTime:
    seconds: float
    binding: str
    """hbm | pcie | host (host RAM: experts computed on the host's cores) | compute | launch | comm"""
    parts: dict

    def rate(self, tokens: int) -> float:
        return tokens / self.seconds if self.seconds > 0 else float("inf")


def step_time(cost: StepCost, hbm_gbs: float, h2d_gbs: float, tflops: float) -> StepTime:
    eff = hbm_gbs * 1e9 * moe_hbm_eff(cost.tokens_per_expert)
    experts = max(cost.expert_hbm_bytes, cost.expert_all_bytes if cost.mapped else 0.0) / eff
    inplace = cost.inplace_bytes / (h2d_gbs * 1e9 * INPLACE_EFF) if cost.inplace_bytes else 0.0
    promote = (cost.promotion_bytes / (h2d_gbs * 1e9) + cost.promotions * PROMOTION_S) if cost.promotion_bytes else 0.0
    if cost.mapped and cost.mapped_layers:  # layer by layer (see StepCost.mapped_layers)
        rate = h2d_gbs * 1e9 * INPLACE_EFF
        experts = sum(full for full, *_ in cost.mapped_layers) / eff

        def layer(full: float, read: float, q: float, hit: float | None = None) -> float:
            if q >= 1:
                return full / eff
            if hit is not None:  # hybrid's split layers: the hits' launch, then the misses' columns in place
                return hit * full / eff + read / rate + (1 - q) * INPLACE_LAYER_S
            return q * full / eff + (1 - q) * max(full / eff, read / rate / (1 - q) + INPLACE_LAYER_S)

        layered = sum(layer(*m) for m in cost.mapped_layers)
        inplace = layered - experts  # what the in-place reads add to the experts' HBM time
    mfu = moe_mfu(cost.tokens_per_expert)
    h2d = h2d_gbs * 1e9

    dq_rate = dequant_gbs(hbm_gbs, cost.dequant_scheme) * 1e9

    def work(hbm: float, flops: float, dq: float = 0.0, groups: float = 0.0) -> float:  # experts read from HBM and
        # multiplied: the larger of the two, after their decode pass where they take one (`StepCost.dequant_bytes`)
        # and its groups' host time
        return max(hbm / eff, flops / (tflops * 1e12 * mfu)) + dq / dq_rate + groups * DEQUANT_GROUP_S

    laid_by = {"hbm": 0.0, "compute": 0.0, "pcie": 0.0}  # the laid layers' time by the resource that binds each part

    def credit(hbm: float, flops: float, t: float | None = None) -> None:  # t: a part of that work's time
        t_h, t_f = hbm / eff, flops / (tflops * 1e12 * mfu)
        laid_by["hbm" if t_h >= t_f else "compute"] += max(t_h, t_f) if t is None else t

    laid = 0.0
    for c, hb, mb, hf, mf, f, *more in cost.copy_layers:
        stream = more[0] if more else None
        hd, md = more[1] if len(more) > 1 else (0.0, 0.0)
        hg, mg = more[2] if len(more) > 2 else (0.0, 0.0)
        if stream:  # one expert a round (see StepCost.copy_layers)
            hits, misses = stream
            wh, wm = work(hb, hf, hd, hg), work(mb, mf, md, mg)
            first = wh / hits if hits >= 1 and f <= 0 else 0.0
            last = wm / max(misses, 1.0)
            rest = max(0.0, wh + wm - first - last)
            laid += first + max(c / h2d, rest) + last
            credit(hb + mb, hf + mf, first + last)  # (their decode passes inside: labelled as their work binds)
            if c / h2d >= rest:
                laid_by["pcie"] += c / h2d
            else:
                credit(hb + mb, hf + mf, rest)
            continue
        laid += max(f / h2d, work(hb, hf, hd, hg)) + (c - f) / h2d + work(mb, mf, md, mg)
        if f / h2d >= work(hb, hf, hd, hg):
            laid_by["pcie"] += f / h2d
        else:
            credit(hb, hf)
            laid_by["hbm"] += hd / dq_rate + hg * DEQUANT_GROUP_S
        laid_by["pcie"] += (c - f) / h2d
        credit(mb, mf)
        laid_by["hbm"] += md / dq_rate + mg * DEQUANT_GROUP_S
    parts = {"hbm": cost.hbm_bytes / (hbm_gbs * 1e9 * HBM_EFF) + cost.kv_bytes / (hbm_gbs * 1e9 * KV_HBM_EFF)
             + (0.0 if cost.mapped else experts),
             "pcie": cost.pcie_bytes / (h2d_gbs * 1e9) if cost.pcie_bytes else 0.0,
             "compute": cost.flops / (tflops * 1e12 * MFU)
             + (cost.expert_flops / (tflops * 1e12 * moe_mfu(cost.tokens_per_expert)) if cost.expert_flops else 0.0),
             "mapped_experts": (max(experts + inplace, cost.host_experts_s) if cost.mapped_layers else
                                max(experts, inplace, cost.host_experts_s)) if cost.mapped else 0.0,
             "host_experts": 0.0 if cost.mapped else cost.host_experts_s,
             "promotions": promote if cost.mapped else 0.0,
             "copy_layers": laid,
             "dequant": cost.dequant_bytes / dq_rate,
             "host": cost.host_s,
             "launch": cost.layers * ((LAUNCH_GRAPH_S if cost.graphs else LAUNCH_S) + cost.layer_extra_s)
             + cost.dequant_groups * DEQUANT_GROUP_S,
             "comm": cost.comm_s}
    roof = max(("hbm", "pcie", "compute", "host_experts"), key=parts.get)  # host experts beside the copies
    seconds = (parts[roof] + parts["mapped_experts"] + parts["promotions"] + parts["copy_layers"] + parts["dequant"]
               + parts["host"] + parts["launch"] + parts["comm"])
    by_resource = {"hbm": (parts["hbm"] if roof == "hbm" else 0.0) + (experts if cost.mapped and experts >= inplace else 0.0)
                   + laid_by["hbm"] + parts["dequant"],
                   "compute": (parts["compute"] if roof == "compute" else 0.0) + laid_by["compute"],
                   "pcie": (parts["pcie"] if roof == "pcie" else 0.0) + (inplace if cost.mapped and inplace > experts else 0.0)
                   + parts["promotions"] + laid_by["pcie"],
                   # the host binds a mapped step where it outlasts the kernel (`mapped_experts`: layer by layer, the
                   # in-place reads add to the hits' time)
                   "host": (cost.host_experts_s if cost.mapped and cost.host_experts_s > (
                       experts + inplace if cost.mapped_layers else max(experts, inplace)) else 0.0)
                   + (parts["host_experts"] if roof == "host_experts" else 0.0),
                   "launch": parts["launch"] + parts["host"], "comm": parts["comm"]}
    return StepTime(seconds, max(by_resource, key=by_resource.get), parts)


def allreduce_s(tp: int, nbytes: float, link_gbs: float) -> float:
    """One ring all-reduce of `nbytes` over `tp` ranks."""
    return 0.0 if tp == 1 else ALLREDUCE_S + 2 * (tp - 1) / tp * nbytes / (link_gbs * 1e9)
