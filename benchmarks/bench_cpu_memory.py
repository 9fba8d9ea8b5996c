"""Resident memory of the embedded default on the CPU: each path loaded in a fresh process, RSS after
`import ferrylm` and after load + one generated token, and the bytes the weights' kernels hold.

`--checkout DIR` measures another checkout of ferrylm (e.g. an older commit unpacked with
`git archive <commit> | tar -x -C DIR`), so a before/after pair comes from one run on one machine.

    python benchmarks/bench_cpu_memory.py [--checkout DIR ...] [--paths quant quant-bf16 fp32-dequant]

The last line printed is JSON (rows: checkout, path, rss_import_mib, rss_loaded_mib, peak_rss_mib, weights_mib:
the bytes held by the kernels and dense parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PATHS = {"quant": {}, "quant-bf16": {"dtype": "bfloat16"}, "fp32-dequant": {"dequantize": True}}

CHILD = r"""
import json, sys
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
rss = lambda: status("VmRSS")
import torch
from ferrylm import LLM, SamplingParams
before = rss()
llm = LLM(max_num_seqs=1, max_model_len=512, enable_prefix_caching=False, **json.loads(sys.argv[1]))
llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=1))
model = llm.engine.runner.model
held = 0
for m in model.modules():
    for k in getattr(m, "kernels", []):
        held += k.nbytes
    for p in m.parameters(recurse=False):
        held += p.numel() * p.element_size()
print(json.dumps({"rss_import_mib": before, "rss_loaded_mib": rss(), "peak_rss_mib": status("VmHWM"),
                  "weights_mib": held / 2**20}))
"""


def measure(checkout: str, path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=checkout)
    # run from the checkout: `python -c` puts the working directory first on sys.path
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(PATHS[path])], env=env, cwd=checkout,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--checkout", nargs="*", default=[], help="other ferrylm checkouts to measure first")
    ap.add_argument("--paths", nargs="*", default=list(PATHS))
    a = ap.parse_args()
    rows = []
    for checkout in [*a.checkout, here]:
        for path in a.paths:
            row = {"checkout": checkout, "path": path, **measure(checkout, path)}
            rows.append(row)
            print(" | ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    print(json.dumps({"bench": "cpu_memory", "rows": rows}))


if __name__ == "__main__":
    main()
