"""Diagnostic (session 18): is the single 0.5 logit step of a hybrid engine after a long decode
(`diag_tuner_drift.py`) a routing flip? Eager runs record every router call's top-k ids and the margin between
the k-th and (k+1)-th probability; the reference (all experts on the GPU) and the hybrid run (share 0.5, after a
120-token batch-1 decode) are compared call by call, in bf16 and in fp32."""
import sys

sys.path.insert(0, "tests")
import torch  # noqa: E402
from test_cuda import sampled_rows, worst_while_equal  # noqa: E402
from test_models_hf import build  # noqa: E402

from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.models import qwen_moe  # noqa: E402

CALLS: list = []
_route = qwen_moe.route


def recording_route(logits, top_k, normalize):
    w, ids = _route(logits, top_k, normalize)
    p = torch.softmax(logits.float(), -1).topk(top_k + 1, -1).values
    CALLS.append((ids.cpu(), (p[:, top_k - 1] - p[:, top_k]).cpu()))
    return w, ids


qwen_moe.route = recording_route


class F:
    def mktemp(self, n):
        import tempfile
        from pathlib import Path
        return Path(tempfile.mkdtemp(prefix=n))


path, _ = build(F(), "qwen3_moe")
prompts = [[5, 9, 31, 7, 100, 3], [17, 4, 4, 250]]
for dtype in ("bfloat16", "float32"):
    base = dict(device="cuda", dtype=dtype, place=("experts=cpu",), gpu_memory_budget="2GiB", enforce_eager=True)
    CALLS.clear()
    ref_out, ref = sampled_rows(LLM(path, experts="gpu", **base), prompts, 16)
    ref_calls = list(CALLS)
    llm = LLM(path, experts="auto", cpu_share=0.5, **base)
    sampled_rows(llm, prompts, 16)
    llm.generate([[11, 12, 13]], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    CALLS.clear()
    out, got = sampled_rows(llm, prompts, 16)
    w, d = worst_while_equal(ref_out, ref, out, got)
    per_step = [[round(x, 3) for x in (r - g).abs().amax(-1).tolist()] for r, g in zip(ref, got)]
    flips = []
    for i, ((ia, ma), (ib, mb)) in enumerate(zip(ref_calls, CALLS)):
        if ia.shape == ib.shape and not torch.equal(ia.sort(-1).values, ib.sort(-1).values):
            rows = (ia.sort(-1).values != ib.sort(-1).values).any(-1).nonzero().flatten().tolist()
            flips.append((i, rows, [round(ma[r].item(), 5) for r in rows]))
    print(f"{dtype}: worst {w:.3e} (diverged {d}); per-step {per_step}")
    print(f"{dtype}: {len(ref_calls)} / {len(CALLS)} router calls; calls whose top-k sets differ "
          f"(call, rows, reference margin p_k - p_k+1): {flips}; smallest margin "
          f"{min(m.min().item() for _, m in ref_calls):.2e}; {llm.engine.runner.placed.stats}", flush=True)
    llm.close()
    torch.cuda.empty_cache()
