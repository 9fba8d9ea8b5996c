"""The offload engine: placement under a device budget, the pinned host tier, streamed dense layers, the
device expert cache (copied misses, or misses read in place by the fused kernel at decode), hybrid host
experts, routing profiles and the cost model. docs/architecture.md has one line per module.

Where issue 8 stands (2026-12-01): every part runs and is tested (CPU in CI, CUDA in tests/test_cuda.py);
figures in docs/benchmarks.md. TODO, in order (fp8 expert banks stay packed since
session 24, per channel or as a block-wise FP8 checkpoint's row groups, and decode on the decode kernel's fp8 tiles
since session 26: Qwen3-30B 48L fp8 batch 1 25.5 -> 42.8 tok/s on an H100; a table point is one column copy, fp8
batch-1 step 8.94 -> 7.36 ms), promotions weighed against the in-place bytes they save (fp8 batch 1: 3.3 ms of a
7.4-8.9 ms step are promotion copies, 1.5 a miss; the "frequent" tally beat "dueling" there, 50.1 vs 45.0 tok/s,
and lost by far on bf16), a packed kernel that is faster than bf16 in time (it is
latency-bound: profile, split K for decode), copying predicted misses first at one token (hit rate 0.41 vs
Belady's 0.74 on Qwen3-30B; the next-layer router predictor, tried on traces, moved more bytes than the dueling
policy: not kept), graphs for streamed dense layers, the
DeepSeek benchmark case (batch 256 ran in session 14: 377 tok/s, 0.82 of its floor), and promotion copies that
overlap the step (`CachedExperts.promote_after_layer`: equal to resident on the H200, 7.55 against 7.74 ms a
Qwen3 step in session 15, within noise: left off). Session 11: packed Linears of streamed and resident layers are computed
packed on CUDA (`layers/packed_linear.py`), so the issue's Qwen2-72B NF4 case runs under 16 GiB at 95% of its PCIe
floor; Yuan2.0-M32 NF4 under 8 GiB runs at 28-47% of its floor (the NF4 in-place kernel; docs/benchmarks.md). (The GGUF double decode at start-up is gone:
`GGUFSource.quantized_info`.)

Hybrid decode (issue 10): the host computes a share of each missed expert inside the decode graphs
(`host_node.py`, `host_decode.py`): every miss is split along its intermediate (the kernel reads the first
columns in place, the host computes the rest; dense and packed banks, c a multiple of lcm(128, w2's group)),
or with `hybrid_split` off whole experts per step (`expert_cache.host_share`). Mixtral-16L bf16 under 16 GiB,
batch 1: 9.82 tok/s at the calibrated share, 11.45 under Zipf routing (in place only 5.78 / 7.48, llama.cpp 8.67;
session 14, docs/benchmarks.md; the aim of 14.3 is missed: the host's bf16 GEMM reads ~42 GB/s beside the
device's ~47 in place, which bounds this case near 11 tok/s; past it needs a host GEMV at DRAM speed, native
code). Session 15: the host GEMM path of a split bank is chosen on the column windows it runs (split-x4 won whole
experts, plain won windows: 8.05 against 5.88 tok/s at share 0.45); Mixtral 32L int4 batch 1 hybrid 23.0 tok/s
against 19.1 copy-only and 22.3 host-only; NF4 host experts are decoded by torch ops (149 ms an expert on the
16-core host), so the cost model kept NF4 hybrid off. Then native host kernels (`layers/host_native.py`, AVX-512:
NF4 13x and bf16 1.3x torch's paths on the 2-core box), a "native" choice of the calibration.
Session 16 on the H200 host: the split calibration took `plain` on windows, share 0.51, 10.24 tok/s (bf16 16L); the
native NF4 kernel is 21-28x torch's decode but stops scaling at 8 of the 16 cores (the calibration now tries N/2
threads); native bf16 does not beat oneDNN there. The calibrated share assumes uniform routing: it is now
re-balanced once on the misses the first mapped steps saw (`placed_weights.REBALANCE_WINDOW`; Mixtral 32L int4,
whose slots catch 97.6%, went from 0.33 to 0), and share 0 skips the per-layer hand-off (copy-only 31.1 -> 41.4
tok/s). Session 17: after the re-balance the share is tuned on measured step times (`share_tuner.py`, a hill
climb; bf16 16L batch 1 10.01 tok/s), int4 32L auto within 4% of copy-only at batch 1 and ahead at 16. Session 19:
hybrid decode beats the better side at every batch of 1-64 (bf16 16L: 1.45x at batch 1, 1.56x at 64) and a 2k
prefill equals copy-only (the calibration times 256 tokens; `cost_model.SPLIT_MARGIN`); Zipf batch 1 13.3-13.5
tok/s. Sessions 20-21: Qwen3-30B and Yuan2.0-M32 hybrid (M32 bf16 1.12-1.25x the better side at batch 1, 1.43x
at 16; Qwen3 re-balanced to share 0 = copy-only's rate within noise); a recorded profile gains nothing over the
tally under Zipf; on 14 threads the host's plain read beside copies is ~86 GB/s where every one-token GEMV reads
44-53 (the Python pool's chunks wait at the GIL): the native GEMVs now run a matrix on a C thread pool
(`layers/host_native`, `cpu_experts.native_c_threads`), not yet measured there. Session 22 (no device): a dense
SiLU expert runs whole in one native call at 1-16 tokens (`cpu_experts.native_fused_expert`: torch's ops between
the GEMVs had left OpenMP spinners on the pool's cores), 1.15-1.71x oneDNN on the 2-core box, and the calibration
takes it up to 16 tokens there. Session 23 (no device could be started): on a Xeon the AVX512-BF16 expert lost to
oneDNN from 2 tokens (compute-bound); bf16 calls of 2-64 tokens now run on AMX tiles where the CPU has them (2-core
Xeon: 1.23-1.32x oneDNN at 2-16 tokens, at the read rate), the calibration races the 2..64-token path apart from the
one-token one (`cpu_experts.gemm_at`), and the batch-1 split's host columns run in one native call. Left: bf16 batch 1
at 14.3 (8.4-10.2 measured) and batch 16 at 51 (36.8: its host windows of 2-4 tokens are where AMX should show), both
to measure on the H200 with these paths (docs/benchmarks.md, pending item 1), NF4 hybrid (its host kernel was
thread-bound; its expert still runs torch ops between GEMVs).
A dropped offloaded CUDA engine is not always freed at once
(seen in tests/test_cuda; the holder is not found yet).
Session 4 (s4-hybrid): the host worker computes a padded graph step's live rows only
(`ForwardContext.live_rows`), kernel builds lock per expert, counters two threads write go through
`OffloadStats.add`, int4 host experts keep one copy at share 1 (`HostExperts.lay`), the device's wait for the
host is timed in graphs too. Not built: KTransformers' expert deferral (docs/benchmarks.md says why).
"""
