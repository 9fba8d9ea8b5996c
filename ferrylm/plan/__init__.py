"""Planning before launch (`ferry plan`): what fits on which hardware, where each tensor group goes and how
fast it can run; see docs/plan.md.

catalog (built-in configs) -> memory (the engine's tensor groups of its module on meta, KV, state) ->
planner (`make_plan`: the engine's own start-up decision, `offload/memory.py`, on a GPU profile; speed
from `estimate`) -> report; check runs the engine to compare predictions with measurements.

Quantization quality notes: `quality`. Speed: the engine's mapped / copy expert paths and measured kernel
rates (`estimate`); the expert hit rate is uniform unless given (`--expert-hit-rate`).

TODO (what is left of issue #14):
- measure: run `benchmarks/bench_plan.py --gpu 1xH200` (dense, MoE resident, MoE offloaded, NF4 experts
  offloaded) and put its predicted-vs-measured table in docs/benchmarks.md; the MoE kernel rates in
  `estimate.py` were read off earlier runs of the same engine (calibration), and HBM_EFF / MFU / launch costs
  are still assumptions; int4 experts' kernel rates are assumed equal to NF4's;
- the hit rate: uniform routing is a floor for skewed real routing; predicting the routing tally's hit rate
  (or reading a recorded expert profile) is not built;
- the engine re-sizes KV on CUDA after a measured warm-up; the plan predicts the planned (reserve-based) figure;
- hybrid decode (host cores beside the in-place reads, the engine's default for dense cached experts) is
  modelled as two balanced rates that add; unmeasured until bench_plan runs (its "copy" GPU side, opt-in,
  is not modelled); the copy path's host split counts as copies (measured +6%);
- multi-GPU speed is per-rank arithmetic with assumed all-reduce costs; the engine loop's per-step host
  time (schedule, sample) is not modelled.
"""
