"""The hybrid issue's summary: one row per (model, budget, batch, routing) from `bench_offload.py` result files, in
the issue's schema (`hybrid_tok_s`, `copy_only_tok_s`, `cpu_only_tok_s`, the split), each row naming the file
and tree it came from. A later file's row replaces an earlier one's for the same key: list the files oldest
first.

    python benchmarks/hybrid_summary.py benchmarks/results/offload-2026-12-04-s19-hybrid16-sweep.json ... \
        --out benchmarks/results/hybrid-2026-12-04.json
"""

from __future__ import annotations

import argparse
import json
import os


def rows_of(path: str) -> list[dict]:
    """The hybrid rows of one result file (rows without a hybrid figure, an "off" verdict, errors: left out)."""
    with open(path) as f:
        result = json.load(f)
    out = []
    for c in result.get("cases", []):
        if c.get("hybrid_tok_s") is None:
            continue
        copy = c.get("copy_only_tok_s", c.get("inplace_only_tok_s"))  # batch-1 decode cases: share 0 reads in place
        best = max((x for x in (copy, c.get("cpu_only_tok_s")) if x is not None), default=None)
        split = c.get("auto_split") or {}
        out.append({"model": c["model"], "budget_gib": c.get("budget_gib"), "batch": c.get("batch"),
                    "routing": "uniform" if c.get("routing", "model") == "model" else c["routing"],
                    "hybrid_tok_s": round(c["hybrid_tok_s"], 2),
                    "copy_only_tok_s": None if copy is None else round(copy, 2),
                    "cpu_only_tok_s": None if c.get("cpu_only_tok_s") is None else round(c["cpu_only_tok_s"], 2),
                    "vs_better_side": None if not best else round(c["hybrid_tok_s"] / best, 3),
                    "split": {"share": split.get("share", c.get("rebalanced_share", c.get("calibrated_share"))),
                              "split_cols": split.get("split_cols", c.get("split")), "inter": c.get("inter"),
                              **{k: split[k] for k in ("cpu_experts", "cpu_busy_s", "cpu_wait_s", "hit_rate",
                                                       "h2d_gib_per_step") if k in split}},
                    "source": os.path.basename(path), "commit": result.get("commit")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="bench_offload.py result files, oldest first")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows: dict[tuple, dict] = {}
    gpus = set()
    for p in a.files:
        with open(p) as f:
            gpus.add(json.load(f).get("gpu"))
        for r in rows_of(p):
            rows[(r["model"], r["budget_gib"], str(r["batch"]), r["routing"])] = r
    summary = {"gpu": " / ".join(sorted(g for g in gpus if g)),
               "commit": sorted({r["commit"] for r in rows.values()} - {None}), "cases": list(rows.values())}
    with open(a.out + ".tmp", "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(a.out + ".tmp", a.out)
    for r in rows.values():
        print(f"{r['model']:34s} {r['budget_gib']!s:>3s} GiB  batch {r['batch']!s:>7s}  {r['routing']:8s} "
              f"hybrid {r['hybrid_tok_s']:8.2f}  copy {r['copy_only_tok_s']!s:>8s}  cpu {r['cpu_only_tok_s']!s:>8s}  "
              f"x{r['vs_better_side']}  ({r['source']})")


if __name__ == "__main__":
    main()
