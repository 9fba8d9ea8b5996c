"""The offload engine: placement under a device budget, the pinned host tier, streamed dense layers, the
device expert cache (copied misses, or misses read in place by the fused kernel at decode), hybrid host
experts, routing profiles and the cost model. docs/architecture.md has one line per module.

Where issues 8 and 10 stand (2026-12-06): every part runs and is tested (CPU in CI, CUDA in tests/test_cuda.py);
each aim's latest figure is in docs/benchmarks.md, "Where the aims stand". Met: batch 64 and prefill at >= 80% of
the PCIe floor (bf16 16L), Zipf hit rates >= 80% of Belady, Qwen2-72B NF4 at 0.90-0.96 of its floor, the resident
fused MoE 23x transformers, hybrid decode ahead of the better side at batch 1-64 and 2k prefill, int4 32L 3.9x
llama.cpp. Missed, in order of value (TODO):
- batch-1 decode near the floor: copy-only is the floor plus per-step costs (Qwen3-30B bf16 0.44 of it, fp8 0.26:
  promotions and kernels never overlap, the engine loop's host time); hybrid bf16 16L 10.6 tok/s against 14.3 (the
  host's GEMV beside the copies; native AMX / C-pool kernels not yet measured on the H200 box);
- hybrid batch 16: 46.7 against 51 (H100);
- the resident NF4 decode kernel: 32L Mixtral 15.9-16.0 ms a step, ~8x its HBM roofline (latency-bound in-tile
  decode: split K further, wider loads), which the resident share of an offloaded NF4 model pays too;
- 32L NF4 batch 64: 0.61-0.68 of the PCIe floor (sessions 30-31, H100; 0.32 before NF4 banks took the decode kernel
  past 32 tokens): two cache slots a layer queue ~4.6 misses of 99 MB behind their own compute;
- 32L NF4 prefill: 0.80 of the binding floor (the resident model's own 2k prefill) but 0.63 of the PCIe floor;
  staging the next layer's experts in spare slots gains 21% (session 31, three pairs) at a batch-1 decode cost
  (`expert_cache.CachedExperts.staging_slots`: off; since session 32 steps under `stage_min_tokens` never stage,
  which should remove that cost: unmeasured, `benchmarks/device_s40.sh`); the packed prefill itself left the device idle 40% of a
  resident 512-token prefill (host launches per expert) and decoded at 1.1 TB/s: `fused_moe.dequant_rows`' one copy
  a call (on) and `DECODE_4BIT_TILE` (off until a GPU has run it), both unmeasured (docs/benchmarks.md, item 0).
"""
