"""Planning before launch (`ferry plan`): what fits on which hardware, where each tensor group goes and how
fast it can run; see docs/plan.md.

catalog (built-in configs) -> memory (tensor groups of the engine's module on meta, KV, state) ->
placement (GPU / host from a budget) -> estimate (roofline step time) -> planner (`make_plan`) -> report;
check runs the engine to compare predictions with measurements.

TODO (what is left of issue #14):
- build on `ferrylm/offload/placement.py` once the lead lands it: `plan/placement.py` then goes, and
  `memory.tensor_groups` should be the engine's grouping (same `TensorGroup` fields and kinds already);
- have `engine/model_runner._allocate_kv` call `memory.kv_pool_blocks` (today the planner mirrors its rule);
- measure: run `benchmarks/bench_plan.py` on the H200 (dense, MoE resident; offloaded once the offload engine
  exists) and put predicted vs measured in docs/benchmarks.md; the efficiency constants in `estimate.py`
  are unmeasured assumptions until then;
- `--kv-cache-dtype fp8` and quantized experts once the engine has them; multi-GPU is per-rank arithmetic only;
- PCIe bytes assume uniform routing (no expert-cache hit rate from real traces); prefill of offloaded models
  assumes every host group streams once per chunk;
- quantization quality notes (measured deltas per model/scheme) are not built in;
- `ferry doctor --measure` per NUMA node.
"""
