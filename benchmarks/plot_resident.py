"""The resident engine against its rooflines, as a picture: one bar per `bench_resident.py` case (% of the roofline
measured in the same run), the same engine with the one-launch ops off beside it where the run has it, and issue
11's aim as a tick.

    python benchmarks/plot_resident.py benchmarks/results/resident-2026-12-02.json --out docs/img/resident.png

Reads the JSON `bench_resident.py` writes, or a file of several runs (`{"runs": [...]}`); a case in more than one
run is drawn from the last. Knows nothing about how the figures were measured.
"""

from __future__ import annotations

import argparse
import json

AIMS = {"llama8b-b1": 70, "llama8b-b64": 50, "llama8b-prefill2k": 75, "mixtral8l-b1": 50, "llama8b-16k-b16": 50}
"""Issue 11's aims, % of the roofline."""
LABELS = {"llama8b-b1": "Llama-3-8B decode, batch 1", "llama8b-b64": "Llama-3-8B decode, batch 64",
          "llama8b-prefill2k": "Llama-3-8B 2k prefill", "mixtral8l-b1": "Mixtral 8 layers decode, batch 1",
          "llama8b-16k-b16": "Llama-3-8B decode, batch 16 at 16k", "yuanm32-b1": "Yuan2.0-M32 decode, batch 1"}


def rows_of(paths: list[str]) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        for run in doc.get("runs", [doc]):
            for row in run["rows"]:
                rows[row["case"]] = row
    return rows


def plot(rows: dict[str, dict], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in LABELS if c in rows] + [c for c in rows if c not in LABELS]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(cases) + 1.2))
    ys = range(len(cases))[::-1]
    for y, c in zip(ys, cases):
        r = rows[c]
        pct = r["pct_roofline"]
        ax.barh(y + 0.18, pct, height=0.34, color="tab:blue", label="ferrylm" if y == ys[0] else None)
        ax.text(pct + 0.8, y + 0.18, f"{pct:.0f}%  ({r['ferry_tok_s']:,.0f} tok/s)", va="center", fontsize=8)
        plain = r.get("plain_ops_tok_s")
        if plain:
            p = pct * plain / r["ferry_tok_s"]
            ax.barh(y - 0.18, p, height=0.34, color="tab:gray", label="one-launch ops off" if y == ys[0] else None)
            ax.text(p + 0.8, y - 0.18, f"{p:.0f}%", va="center", fontsize=8, color="dimgray")
        elif r.get("eager_pct_roofline") is not None:
            p = r["eager_pct_roofline"]
            ax.barh(y - 0.18, p, height=0.34, color="tab:orange", label="eager (no graphs)")
            ax.text(p + 0.8, y - 0.18, f"{p:.0f}%", va="center", fontsize=8, color="tab:orange")
        if c in AIMS:
            ax.plot([AIMS[c]] * 2, [y - 0.42, y + 0.42], color="tab:red", lw=2,
                    label="aim" if c == next(x for x in cases if x in AIMS) else None)
    ax.set_yticks(list(ys), [LABELS.get(c, c) for c in cases], fontsize=9)
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of the roofline measured in the same run (read rate; matmul rate for prefill)", fontsize=9)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="bench_resident.py JSON files")
    ap.add_argument("--out", default="resident.png")
    ap.add_argument("--title", default="Resident on one H200, bf16 (benchmarks/bench_resident.py)")
    a = ap.parse_args()
    plot(rows_of(a.results), a.out, a.title)


if __name__ == "__main__":
    main()
