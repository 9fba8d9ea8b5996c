"""The offload engine: placement under a device budget, the pinned host tier, streamed dense layers, the
device expert cache (copied misses, or misses read in place by the fused kernel at decode), hybrid host
experts, routing profiles and the cost model. docs/architecture.md has one line per module.

Where issue 8 stands (2026-12-01): every part runs and is tested (CPU in CI, CUDA in tests/test_cuda.py);
figures in docs/benchmarks.md. TODO, in order: fp8 expert banks kept packed
(`models/base.py` ENGINE_PACKED_FORMATS; int8 joined in session 7), a packed kernel that is faster than bf16 in time (it is
latency-bound: profile, split K for decode), copying predicted misses first at one token (hit rate 0.41 vs
Belady's 0.74 on Qwen3-30B), next-layer prefetch, graphs for streamed dense layers, and the
DeepSeek and batch-256 benchmark cases. Session 11: packed Linears of streamed and resident layers are computed
packed on CUDA (`layers/packed_linear.py`), so the issue's Qwen2-72B NF4 case runs under 16 GiB at 95% of its PCIe
floor; Yuan2.0-M32 NF4 under 8 GiB runs at 28-47% of its floor (the NF4 in-place kernel; docs/benchmarks.md). (The GGUF double decode at start-up is gone:
`GGUFSource.quantized_info`.)

Hybrid decode (issue 10): the host computes a share of each missed expert inside the decode graphs
(`host_node.py`, `host_decode.py`): every miss is split along its intermediate (the kernel reads the first
columns in place, the host computes the rest; dense and packed banks, c a multiple of lcm(128, w2's group)),
or with `hybrid_split` off whole experts per step (`expert_cache.host_share`). Mixtral-16L bf16 under 16 GiB,
batch 1: 9.43 tok/s (in place only 5.10, llama.cpp 8.67; docs/benchmarks.md). Next: measure the copy-engine
GPU side (copy + host read 86.5 GB/s together against 78 for in place + host), the packed column split on the
H200 (`bench_offload.py --cases hybrid32-nf4`), the calibrated share from contended rates, and the host GEMM's
read rate (57 GB/s of the 93 a plain read streams; session 6, 2 cores: in the bank's own layout nothing beats the
menu, oneDNN's packed layout reads 1.1-1.8x faster but needs a second copy of the host share, see
docs/benchmarks.md: decide it from pending item 2's 16-core figures). A dropped offloaded CUDA engine is not always freed at once
(seen in tests/test_cuda; the holder is not found yet).
Session 4 (s4-hybrid): the host worker computes a padded graph step's live rows only
(`ForwardContext.live_rows`), kernel builds lock per expert, counters two threads write go through
`OffloadStats.add`, int4 host experts keep one copy at share 1 (`HostExperts.lay`), the device's wait for the
host is timed in graphs too. Not built: KTransformers' expert deferral (docs/benchmarks.md says why).
"""
