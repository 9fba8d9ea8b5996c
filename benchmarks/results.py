"""The tail every benchmark shares: one results JSON with when, what code, which machine and the rows, written
to `benchmarks/results/<name>-<date>.json` (or `--out`) and printed as the last line.

    from results import write_results   # benchmarks/results.py (scripts run as python benchmarks/x.py)
    write_results("plan", rows, out=a.out, gpu="1xH200")

Knows nothing about what a benchmark measures.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def commit() -> str | None:
    """The checkout's short commit id (None outside git), with `+dirty` when tracked files changed."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=here, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("+dirty" if dirty else "")) or None


def machine() -> dict:
    """Host name, CPU count, load and, where torch sees one, the GPU."""
    out = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        out["load_avg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    try:
        import torch

        out["torch"] = torch.__version__
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return out


def write_results(bench: str, rows: list, out: str | None = None, **fields) -> dict:
    """Write {bench, date, commit, command, machine, **fields, rows} to `out` (default
    benchmarks/results/<bench>-<date>.json), print it as one JSON line, and return it."""
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {"bench": bench, "date": now.isoformat(timespec="minutes"), "commit": commit(),
              "command": " ".join(["python", *sys.argv]), "machine": machine(), **fields, "rows": rows}
    path = out or os.path.join(RESULTS_DIR, f"{bench.replace('_', '-')}-{now.date().isoformat()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result, default=str))
    return result
