"""Level 3, `ferry bench soak`: a long, steady load (Poisson at requests_per_hour / 3600 by default) while
a `Monitor` samples the server every sample_every seconds; then the leak, drift, error and health verdicts.

Statistics (each verdict is `pass`, `fail` or `inconclusive`, see `stats.verdict`):
- leak: least-squares slope of RSS (and GPU memory) against time over the samples after the first window
  (the warm-up: caches and allocators fill there), scaled to bytes per 24 h; pass when the upper end of its
  95% interval is under the bar, fail when the lower end is over it.
- drift: the same fit of the per-window P99 (of `drift_metric`) against the window's middle, from the
  second window on, times the time those windows span: the P99 change over the run, with its interval;
  pass when the interval is inside +-max_p99_drift.
- errors: server errors (5xx, error events, dropped connections) over requests that finished or failed.
- health: the fraction of samples whose GET /health answered 200.
With --chaos, faults are injected in the last two thirds of the run and reported per fault (bench/chaos.py);
requests the net-drop proxy cut on purpose are left out of the errors verdict (and counted as injected).
samples.jsonl grows with every sample and summary.json is rewritten after every window (`"partial": true`),
so a soak that is killed still leaves its evidence; windows.json is written at the end.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx

from ferrylm.bench import plots
from ferrylm.bench.arrivals import schedule
from ferrylm.bench.chaos import Chaos
from ferrylm.bench.chaos import report as chaos_report
from ferrylm.bench.client import auth_headers
from ferrylm.bench.config import BenchConfig
from ferrylm.bench.driver import drive
from ferrylm.bench.latency import warm_up
from ferrylm.bench.monitor import Monitor, find_pid
from ferrylm.bench.record import Record
from ferrylm.bench.report import summarize
from ferrylm.bench.stats import fit_slope, percentile, verdict

DAY = 86400.0


def window_length(cfg: BenchConfig) -> float:
    return cfg.window or max(cfg.duration / 20, cfg.sample_every)


def needed(cfg: BenchConfig) -> int:
    return len(schedule(cfg.rate, cfg.arrivals, cfg.duration, cfg.num_requests, cfg.seed, cfg.burstiness)) + cfg.warmup


def windows_of(records: list[Record], samples: list[dict], start: float, end: float, length: float) -> list[dict]:
    out = []
    for w in range(max(1, math.ceil((end - start) / length))):
        lo, hi = start + w * length, start + (w + 1) * length
        rs = [r for r in records if r.sent is not None and lo <= r.sent < hi and not r.cancelled]
        ok = [r for r in rs if r.ok]
        ss = [s for s in samples if lo <= s["t"] < hi]
        mean = lambda k: (sum(s[k] for s in ss if s[k] is not None) / n if (n := sum(s[k] is not None for s in ss))  # noqa: E731
                          else None)
        out.append({"index": w, "start": lo, "mid": (lo + min(hi, end)) / 2, "requests": len(rs), "ok": len(ok),
                    "server_errors": sum(r.server_error for r in rs),
                    "error_rate": (len(rs) - len(ok)) / len(rs) if rs else 0.0,
                    "ttft_p99": percentile([r.ttft for r in ok], 99),
                    "itl_p99": percentile([g for r in ok for g in r.itl], 99),
                    "e2e_p99": percentile([r.e2e for r in ok], 99),
                    "rss_mean": mean("rss"), "gpu_mean": mean("gpu_proc") if any(s["gpu_proc"] is not None for s in ss)
                    else mean("gpu_used")})
    return out


def analyse(cfg: BenchConfig, records: list[Record], samples: list[dict], start: float, end: float,
            excused=None) -> tuple[dict, dict]:
    """(the soak part of the summary, the fitted lines for the plot). `excused(record)`: a failure the bench
    injected itself (chaos net-drop), left out of the server-error check and counted apart."""
    length = window_length(cfg)
    windows = windows_of(records, samples, start, end, length)
    after = [s for s in samples if s["t"] >= start + length]
    warm_excluded = len(after) >= 3
    fit_on = after if warm_excluded else samples
    lines, memory = {}, {}
    gpu_key = "gpu_proc" if any(s["gpu_proc"] is not None for s in samples) else "gpu_used"
    # the process tree's RSS when the server is local, else what its own /metrics says (vLLM exports it)
    rss_key = "rss" if any(s["rss"] is not None for s in samples) else "server_rss"
    for name, key, bar in (("rss", rss_key, cfg.rss_leak_per_day), ("gpu", gpu_key, cfg.gpu_leak_per_day)):
        pts = [(s["t"], s[key]) for s in fit_on if s[key] is not None]
        fit = fit_slope(*zip(*pts)) if len(pts) >= 3 else None
        memory[name] = {"source": key, "samples": len(pts), "first": pts[0][1] if pts else None,
                        "last": pts[-1][1] if pts else None,
                        "slope_bytes_per_day": fit.to_json(DAY) if fit else None, "bar_bytes_per_day": bar,
                        "verdict": verdict(fit, bar, DAY)}
        if fit:
            lines[key] = (fit.slope, fit.intercept)
    metric = cfg.drift_metric
    ws = [w for w in windows[1:] if w[f"{metric}_p99"] is not None]
    dfit = fit_slope([w["mid"] for w in ws], [w[f"{metric}_p99"] for w in ws]) if len(ws) >= 3 else None
    across = ws[-1]["mid"] - ws[0]["mid"] if len(ws) >= 2 else 0.0
    sent = [r for r in records if r.sent is not None and not r.cancelled]
    judged = [r for r in sent if excused is None or not excused(r)]
    injected = len(sent) - len(judged)
    server_errors = sum(r.server_error for r in judged)
    rate_5xx = server_errors / len(judged) if judged else None
    health = [s["health"] for s in samples]
    checks = {"rss_leak": memory["rss"]["verdict"], "gpu_leak": memory["gpu"]["verdict"],
              "p99_drift": verdict(dfit, cfg.max_p99_drift, across, both_ways=True),
              "server_errors": "no data" if rate_5xx is None else ("pass" if rate_5xx <= cfg.max_5xx_rate else "fail"),
              "health": "no data" if not health else ("pass" if all(h == 200 for h in health) else "fail")}
    judged_checks = [v for k, v in checks.items() if v != "no data" or k in ("rss_leak", "p99_drift")]
    overall = "fail" if "fail" in judged_checks else ("pass" if all(v == "pass" for v in judged_checks) else "inconclusive")
    soak = {"verdict": overall, "checks": checks, "window_s": length, "windows": len(windows),
            "warmup_excluded_from_fits": warm_excluded, "memory": memory,
            "p99_drift": {"metric": metric, "windows_fitted": len(ws), "span_s": across,
                          "drift_s": dfit.to_json(across) if dfit else None, "bar_s": cfg.max_p99_drift,
                          "first_window_p99": ws[0][f"{metric}_p99"] if ws else None,
                          "last_window_p99": ws[-1][f"{metric}_p99"] if ws else None},
            "server_errors": {"count": server_errors, "rate": rate_5xx, "bar": cfg.max_5xx_rate,
                              "injected_excluded": injected},
            "health": {"samples": len(health), "ok": sum(h == 200 for h in health),
                       "first_failure_t": next((s["t"] for s in samples if s["health"] != 200), None)},
            "samples": len(samples)}
    return soak, lines


async def run(session, client, prompts) -> dict:
    cfg = session.cfg
    pid = cfg.pid or find_pid(cfg.base_url)
    # the monitor talks to the server directly, never through the chaos proxy
    direct = httpx.AsyncClient(base_url=cfg.base_url, headers=auth_headers(cfg), timeout=30)
    monitor = Monitor(direct, pid)
    chaos = Chaos(cfg.chaos, cfg.base_url, cfg.chaos_delay, cfg.chaos_dir, cfg.chaos_fill_size,
                  cfg.chaos_fill_files, cfg.chaos_drop, cfg.seed, client.now) if cfg.chaos else None
    excused = chaos.excused if chaos is not None else None
    if chaos is not None and (proxy := await chaos.start()):
        client.http.base_url = proxy
    samples: list[dict] = []
    sample_file = open(session.out / "samples.jsonl", "w", encoding="utf-8")
    warm_failed = await warm_up(session, client, prompts)
    start = client.now()
    length = window_length(cfg)
    header = {"warmup": {"sent": cfg.warmup, "failed": warm_failed}, "pid": pid, "gpu_sampled": monitor.gpu_available}

    async def sample() -> None:
        s = await monitor.sample(client.now())
        samples.append(s)
        sample_file.write(json.dumps(s) + "\n")
        sample_file.flush()

    async def sampler() -> None:
        next_checkpoint = start + length
        while True:
            await sample()
            if client.now() >= next_checkpoint:  # interim summary: a killed soak keeps its verdict so far
                next_checkpoint += length
                part, _ = analyse(cfg, session.records, samples, start, client.now(), excused)
                session.write_json("summary.json", {**session.header(client.model, ""), **header, "partial": True,
                                                    "soak": part})
            if not await session.wait(asyncio.sleep(cfg.sample_every)):
                return

    offsets = schedule(cfg.rate, cfg.arrivals, cfg.duration, cfg.num_requests, cfg.seed, cfg.burstiness)
    plan = [(o, i, prompts[(cfg.warmup + i) % len(prompts)]) for i, o in enumerate(offsets)]
    session.live.step(f"soak {cfg.rate * 3600:g} req/h", cfg.duration, cfg.num_requests)
    tasks = [asyncio.create_task(sampler())]
    if chaos is not None:
        chaos.plan(client.now(), cfg.duration)
        tasks.append(asyncio.create_task(chaos.run(client.now, lambda s: session.wait(asyncio.sleep(s)))))
    try:
        records = await drive(session, client, plan, cfg.max_concurrency, until=cfg.duration)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if chaos is not None:
            await chaos.close()
    await sample()  # the state after the last request
    await direct.aclose()
    sample_file.close()
    end = client.now()
    soak, lines = analyse(cfg, records, samples, start, end, excused)
    windows = windows_of(records, samples, start, end, length)
    session.write_json("windows.json", windows)
    out = {**header, "results": summarize(records, cfg.slo, cfg.slo_target), "soak": soak}
    if chaos is not None:
        out["chaos"] = chaos_report(records, chaos.windows, chaos.windows[0][1], chaos.disk, chaos)
    out["plots"] = [plots.latency_cdf(records, session.out / "latency_cdf.png").name,
                    plots.timeline(records, session.out / "timeline.png").name,
                    plots.soak(samples, windows, lines, cfg.drift_metric, session.out / "soak.png",
                               (start, start + length) if soak["warmup_excluded_from_fits"] else None).name]
    return out
