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
for place in (("experts=cpu",), ("experts=cpu", "layers.0.experts.0-1=gpu")):
    kw = dict(device="cuda", dtype="bfloat16", place=place, gpu_memory_budget="2GiB")
    prompts = [[5, 9, 31, 7, 100, 3], [17, 4, 4, 250]]
    ref_out, ref = sampled_rows(LLM(path, experts="gpu", **kw), prompts, 16)
    llm = LLM(path, experts="auto", cpu_share=0.5, **kw)
    pl = llm.engine.runner.placed
    def cmp(what):
        out, got = sampled_rows(llm, prompts, 16)
        w, d = worst_while_equal(ref_out, ref, out, got)
        print(f"{place} {what}: worst {w:.3e} diverged {d}; share {pl.cpu_share} split_cols "
              f"{[c.split_cols for c in pl.caches.values()]} stats {pl.stats}", flush=True)
    cmp("fresh")
    cmp("fresh again")
    llm.generate([[11, 12, 13]], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    cmp("after 120 tokens at 0.5")
    for s in (0.6, 0.5):
        pl.set_cpu_share(s)
        llm.engine.runner.graphs.reset()
    cmp("after 0.6 -> 0.5")
    llm.close()
    torch.cuda.empty_cache()
