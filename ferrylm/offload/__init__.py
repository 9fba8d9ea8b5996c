"""The offload engine: placement under a device budget, the pinned host tier, streamed dense layers, the
device expert cache (copied misses, or misses read in place by the fused kernel at decode), hybrid host
experts, routing profiles and the cost model. docs/architecture.md has one line per module.

Where issue 8 stands (2026-12-01): every part runs and is tested (CPU in CI, CUDA in tests/test_cuda.py);
figures in docs/benchmarks.md. TODO, in order: the packed int8/fp8 expert bank mismatch on the GPU
(`models/base.py` ENGINE_PACKED_FORMATS), a packed kernel that is faster than bf16 in time (it is
latency-bound: profile, split K for decode), copying predicted misses first at one token (hit rate 0.41 vs
Belady's 0.74 on Qwen3-30B), next-layer prefetch, graphs for streamed dense layers, and the Yuan-M32 NF4,
Qwen2-72B NF4, DeepSeek and batch-256 benchmark cases. (The GGUF double decode at start-up is gone:
`GGUFSource.quantized_info`.)

Hybrid decode (issue 10, session 3): the host computes a share of the missed experts inside the decode graphs
(`host_node.py`, `host_decode.py`) while the kernel reads the rest in place; correct, but no faster than
either side alone on the H200 host (docs/benchmarks.md). Next: run `benchmarks/bench_hybrid_overlap.py` to
see whether the sides take turns or contend; torch threads = cores - 2 (the spinning main thread and the
driver's host-function thread need cores); if in-place reads starve beside CPU reads, let the worker copy
the GPU's share with the copy engine on its own stream (it may call CUDA: it is not the host function)
into slots and point the table at them before it releases the stream. Also: padded graph rows are sent to
the host worker too (a B=5 step padded to 8 computes 3 rows for nothing): mask them; one lock per expert in
`HostExperts` kernel builds (a background build can stall the worker); stats `+=` from two threads.
"""
