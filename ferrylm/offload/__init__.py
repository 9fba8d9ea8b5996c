"""The offload engine: placement under a device budget, the pinned host tier, streamed dense layers, the
device expert cache (copied misses, or misses read in place by the fused kernel at decode), hybrid host
experts, routing profiles and the cost model. docs/architecture.md has one line per module.

Where issues 8 and 10 stand (2026-12-06): every part runs and is tested (CPU in CI, CUDA in tests/test_cuda.py);
each aim's latest figure is in docs/benchmarks.md, "Where the aims stand". Met: batch 64 and prefill at >= 80% of
the PCIe floor (bf16 16L), Zipf hit rates >= 80% of Belady, Qwen2-72B NF4 at 0.90-0.96 of its floor, the resident
fused MoE 23x transformers, hybrid decode ahead of the better side at batch 1-64 and 2k prefill, int4 32L 3.9x
llama.cpp; since session 33 the 32L NF4 2k prefill at 0.78-0.87 of the PCIe floor (mean 0.83 over six H200 runs),
with the next layer's experts staged in spare slots (`expert_cache.CachedExperts.staging_slots`, on CUDA, gated by
`stage_min_tokens` so steps below it, decode batches too, never stage; 4968-5138 tok/s off) and
`fused_moe.DECODE_4BIT_TILE` (1.3x the tile decode; the copy-bound prefill does not move with it). Missed, in order
of value (TODO):
- batch-1 decode near the floor: copy-only is the floor plus per-step costs (Qwen3-30B bf16 0.44 of it, fp8 0.26:
  promotions and kernels never overlap, the engine loop's host time); hybrid bf16 16L 10.9 / 9.8 tok/s on the H200
  (session 33, with the native AMX / C-pool kernels; H100 10.6) against 14.3: the host's GEMV beside the copies;
- hybrid batch 16: 45.1 / 46.3 on the H200 (session 33; H100 46.7) against 51;
- the resident NF4 decode kernel: 32L Mixtral 15.9-16.0 ms a step, ~8x its HBM roofline (latency-bound in-tile
  decode: split K further, wider loads), which the resident share of an offloaded NF4 model pays too;
- 32L NF4 batch 64: 0.61-0.73 of the PCIe floor (sessions 30-33; 0.32 before NF4 banks took the decode kernel
  past 32 tokens): two cache slots a layer queue ~4.6 misses of 99 MB behind their own compute;
- hybrid decode's calibrated split on NF4 experts at batch 1 (8L under 5 GiB, H200): 13.2 ms a step against 9.0
  copy-only, and the re-balance kept it on (shares 0.28-0.34); the share tuner now times hybrid off second
  (`share_tuner.py`), unmeasured (`benchmarks/device_s44.sh`).
"""
