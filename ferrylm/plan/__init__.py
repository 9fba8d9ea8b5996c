"""Planning before launch (`ferry plan`): what fits on which hardware, where each tensor group goes and how
fast it can run; see docs/plan.md.

catalog (built-in configs) -> memory (the engine's tensor groups of its module on meta, KV, state) ->
planner (`make_plan`: the engine's own start-up decision, `offload/memory.py`, on a GPU profile; speed
from `estimate`) -> report; check runs the engine to compare predictions with measurements.

TODO (what is left of issue #14):
- measure: run `benchmarks/bench_plan.py` on the H200 (dense, MoE resident, and offloaded with
  `--gpu-memory-budget`) and put predicted vs measured in docs/benchmarks.md; the efficiency constants in
  `estimate.py` are unmeasured assumptions until then (the offloaded step model ignores the expert cache's
  overlap of hits with misses and its real hit rate: PCIe bytes assume uniform routing);
- quantized experts once the engine has them; multi-GPU is per-rank arithmetic only;
- the engine re-sizes KV on CUDA after a measured warm-up; the plan predicts the planned (reserve-based) figure;
- quantization quality notes (measured deltas per model/scheme) are not built in;
- `ferry doctor --measure` per NUMA node.
"""
