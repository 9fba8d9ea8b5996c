"""PNG plots of a bench run (matplotlib, Agg backend: no display needed).

latency_cdf.png: empirical CDFs of TTFT, ITL and E2E. timeline.png: output tokens/s, finished requests/s
and requests in flight over time (sweep steps marked). sweep.png: throughput, goodput and P99 TTFT against
the offered rate. soak.png: RSS, GPU memory (with fitted lines), error rate and P99 per window. Plots read
records and summaries; they compute nothing the summary does not also report.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ferrylm.bench.record import Record
from ferrylm.bench.report import concurrency_profile
from ferrylm.bench.stats import cdf


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def latency_cdf(records: list[Record], path: Path) -> Path:
    plt = _plt()
    ok = [r for r in records if r.ok]
    series = {"TTFT": [r.ttft for r in ok], "ITL (chunk gaps)": [g for r in ok for g in r.itl],
              "E2E": [r.e2e for r in ok]}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (name, xs) in zip(axes, series.items()):
        x, y = cdf(xs)
        if len(x):
            ax.step(x * 1000, y, where="post")
            for q in (0.5, 0.99):
                ax.axhline(q, color="grey", lw=0.5, ls=":")
        ax.set_title(f"{name} (n={len(x)})")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests / gaps <= x")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def timeline(records: list[Record], path: Path, bin_s: float | None = None, marks: list[float] = ()) -> Path:
    plt = _plt()
    ok = [r for r in records if r.ok]
    end = max((r.end for r in records if r.end is not None), default=1.0)
    bin_s = bin_s or max(end / 60, 0.5)
    bins = np.arange(0, end + bin_s, bin_s)
    # output tokens spread over a request's chunks, so a long stream counts where its tokens arrived
    tt = [t for r in ok for t in r.chunk_times]
    tw = [(r.output_tokens or 0) / len(r.chunk_times) for r in ok for _ in r.chunk_times]
    tok, _ = np.histogram(tt, bins=bins, weights=tw)
    req, _ = np.histogram([r.end for r in ok], bins=bins)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    a1.plot(bins[:-1], tok / bin_s, label="output tokens/s")
    a1b = a1.twinx()
    a1b.plot(bins[:-1], req / bin_s, color="tab:orange", label="finished requests/s")
    a1.set_ylabel("tokens/s")
    a1b.set_ylabel("requests/s")
    a1.legend(loc="upper left")
    a1b.legend(loc="upper right")
    t, n = concurrency_profile(records)
    if len(t):
        a2.step(t, n, where="post")
    a2.set_ylabel("requests in flight")
    a2.set_xlabel("seconds since start")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        for m in marks:
            ax.axvline(m, color="grey", ls="--", lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sweep(steps: list[dict], path: Path) -> Path:
    plt = _plt()
    rate = [s["rate"] for s in steps]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    a1.plot(rate, [s["request_throughput"] or 0 for s in steps], "o-", label="throughput (req/s)")
    if all("goodput" in s for s in steps):
        a1.plot(rate, [s["goodput"]["requests_per_s"] or 0 for s in steps], "s-", label="goodput (req/s)")
    a1.plot(rate, rate, ":", color="grey", label="offered")
    a1.set_xlabel("offered rate (req/s)")
    a1.legend()
    a2.plot(rate, [(s["ttft"]["p99"] or np.nan) * 1000 for s in steps], "o-", label="TTFT p99")
    a2.plot(rate, [(s["itl"]["p99"] or np.nan) * 1000 for s in steps], "s-", label="ITL p99")
    a2.set_xlabel("offered rate (req/s)")
    a2.set_ylabel("ms")
    a2.legend()
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def soak(samples: list[dict], windows: list[dict], fits: dict, metric: str, path: Path,
         warmup: tuple[float, float] | None = None) -> Path:
    """fits: sample key -> (slope per second, intercept) of the lines to draw; warmup: the span left out of them."""
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(13, 7), sharex=True)
    for ax, key, title in ((axes[0][0], "rss", "server RSS (MB)"), (axes[0][1], "gpu_used", "GPU memory used (MB)")):
        if key == "rss" and fits.get("server_rss"):  # a remote server: its own /metrics RSS was fitted
            key = "server_rss"
        if key == "gpu_used" and fits.get("gpu_proc"):
            key = "gpu_proc"
        pts = [(s["t"], s[key]) for s in samples if s.get(key) is not None]
        if pts:
            t, y = np.array(pts).T
            ax.plot(t, y / 1e6, ".", ms=3)
            if fits.get(key):
                b, a = fits[key]
                ax.plot(t, (a + b * t) / 1e6, "-", color="tab:red", label=f"fit: {b * 86400 / 1e6:+.1f} MB/day")
                ax.legend()
        else:
            ax.text(0.5, 0.5, "not sampled", ha="center", transform=ax.transAxes)
        ax.set_title(title)
    mid = [w["mid"] for w in windows]
    axes[1][0].plot(mid, [w["error_rate"] * 100 for w in windows], "o-", ms=3)
    axes[1][0].set_title("errors per window (%)")
    for m in ("ttft", "itl", "e2e"):
        axes[1][1].plot(mid, [(w[f"{m}_p99"] if w[f"{m}_p99"] is not None else np.nan) for w in windows], "o-",
                        ms=3, label=f"{m} p99" + (" (drift bar)" if m == metric else ""))
    axes[1][1].set_title("P99 per window (s)")
    axes[1][1].legend()
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if warmup is not None:
            ax.axvspan(*warmup, color="grey", alpha=0.12, lw=0)
    axes[0][0].text(0.01, 0.97, "shaded: warm-up, not fitted" if warmup else "", transform=axes[0][0].transAxes,
                    va="top", fontsize=8, color="grey")
    for ax in axes[1]:
        ax.set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
