"""llama.cpp's side of benchmarks/bench_cpu.py, run with the python of a separate venv that has
llama-cpp-python (never ferrylm's venv, never CI): loads a GGUF once, then for each line read on stdin
(`{"prompt": [ids], "long": [ids], "decode_tokens": n}`) prints one JSON line with batch-1 greedy decode
tok/s (time of 1 + n tokens minus time of 1, so the prefill is taken out, as bench_cpu times ferrylm) and
prompt-processing tok/s of `long` (time to the first token). Standalone: it imports nothing of ferrylm.

    /work/venv-llamacpp/bin/python benchmarks/llamacpp_worker.py MODEL.gguf --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from llama_cpp import Llama, __version__


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--n-ctx", type=int, default=1024)
    a = ap.parse_args()
    m = Llama(a.model, n_ctx=a.n_ctx, n_threads=a.threads, n_threads_batch=a.threads, n_batch=512, verbose=False)

    def gen(tokens: list[int], k: int) -> float:
        m.reset()  # no KV reuse between runs: every run processes its whole prompt
        t = time.perf_counter()
        for i, _ in enumerate(m.generate(tokens, temp=0.0)):  # greedy; generate never stops on EOS itself
            if i + 1 >= k:
                break
        return time.perf_counter() - t

    print(json.dumps({"ready": True, "version": __version__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        n = req["decode_tokens"]
        dec = n / (gen(req["prompt"], 1 + n) - gen(req["prompt"], 1))
        pp = len(req["long"]) / gen(req["long"], 1)
        print(json.dumps({"decode_tok_s": dec, "pp_tok_s": pp}), flush=True)


if __name__ == "__main__":
    main()
