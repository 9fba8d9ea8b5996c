"""Planning before launch (`ferry plan`): what fits on which hardware, where each tensor group goes and how
fast it can run; see docs/plan.md.

catalog (built-in configs) -> memory (the engine's tensor groups of its module on meta, KV, state) ->
planner (`make_plan`: the engine's own start-up decision, `offload/memory.py`, on a GPU profile; speed
from `estimate`) -> report; check runs the engine to compare predictions with measurements.

Quantization quality notes: `quality`. Speed: the engine's mapped / copy expert paths and measured kernel
rates (`estimate`); the expert hit rate predicted from the routing (`hit_rate`: uniform, `--routing zipf:S`, a
recorded profile; `--expert-profile` pins as the engine pins) unless given (`--expert-hit-rate`). KV: the figure
the CUDA engine ends with after its measured warm-up (`offload/memory.py` kv_after_warmup, shared), its range,
and the planned figure.

TODO (what is left of issue #14):
- measure: run `PYTHONPATH=. python benchmarks/bench_plan.py --gpu 1xH200` (dense, MoE resident, MoE offloaded,
  NF4 experts offloaded) and put its predicted-vs-measured table in docs/benchmarks.md; the kernel rates in
  `estimate.py` (MOE_HBM_EFF, LAUNCH_GRAPH_S, KV_HBM_EFF, MFU, Yuan's LAYER_EXTRA_S) were read off session 7's
  `bench_resident.py` rows (calibration: tests/test_plan.py keeps them within 20%), HBM_EFF from a copy kernel;
  int4 and int8 experts' kernel rates are assumed equal to NF4's;
- the warm-up step's activations (`memory.step_activation_bytes`) are an unmeasured estimate: bench_plan prints
  the engine's measured `step_peak` beside it; fit it from that run (the KV range shows what it can move);
- the hit rate: the routing tally's steady state is modelled as the hottest experts (its hysteresis makes that
  an upper estimate under weak skew; Mixtral 16L measured 0.29 at batch 1 against 0.32 uniform), and tokens
  are taken as routed independently (real routing correlates from token to token); bench_plan's
  "@profile routing" rows check it on the runs' own routing;
- hybrid decode (host cores beside the in-place reads, the engine's default for dense cached experts) is
  modelled as two balanced rates that add; unmeasured until bench_plan runs (its "copy" GPU side, opt-in,
  is not modelled); the copy path's host split counts as copies (measured +6%);
- multi-GPU speed is per-rank arithmetic with assumed all-reduce costs, and the warm-up step is counted at the
  full widths under TP (an upper estimate); the engine loop's per-step host time (schedule, sample) is not
  modelled.
"""
