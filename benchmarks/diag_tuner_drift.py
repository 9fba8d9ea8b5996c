"""Diagnostic (session 17): where the 0.49 logit difference of a hybrid engine that decoded a long sequence comes
from: fresh engine at share 0.5; after 120 tokens at 0.5 (no share change); after share changes."""
import sys

sys.path.insert(0, "tests")
import torch  # noqa: E402
from test_cuda import sampled_rows, worst_while_equal  # noqa: E402
from test_models_hf import build  # noqa: E402

from ferrylm import LLM, SamplingParams  # noqa: E402


class F:
    def mktemp(self, n):
        import tempfile
        from pathlib import Path
        return Path(tempfile.mkdtemp(prefix=n))


path, _ = build(F(), "qwen3_moe")
place = ("experts=cpu",)
prompts = [[5, 9, 31, 7, 100, 3], [17, 4, 4, 250]]
base = dict(device="cuda", dtype="bfloat16", place=place, gpu_memory_budget="2GiB")
ref_out, ref = sampled_rows(LLM(path, experts="gpu", **base), prompts, 16)
for variant in ("wait_builds", "reset_graphs", "long_batch2", "eager", "nothing"):
    kw = dict(base, enforce_eager=variant == "eager")
    llm = LLM(path, experts="auto", cpu_share=0.5, **kw)
    pl = llm.engine.runner.placed
    sampled_rows(llm, prompts, 16)  # the batch-2 graph captured first, as in the test
    long = [[11, 12, 13], [14, 15]] if variant == "long_batch2" else [[11, 12, 13]]
    llm.generate(long, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    if variant == "wait_builds":
        print("waited", pl.wait_host_builds())
    if variant == "reset_graphs":
        llm.engine.runner.graphs.reset()
    out, got = sampled_rows(llm, prompts, 16)
    w, d = worst_while_equal(ref_out, ref, out, got)
    rows = [(r - g).abs().amax(-1).tolist() for r, g in zip(ref, got)]
    print(f"{variant}: worst {w:.3e} diverged {d}; per-step worst {[[round(x, 2) for x in r] for r in rows]}; "
          f"{pl.stats}", flush=True)
    llm.close()
    torch.cuda.empty_cache()
