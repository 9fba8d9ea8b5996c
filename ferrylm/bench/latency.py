"""Level 1, `ferry bench latency`: one request at a time, so each figure is the server's unloaded latency.

Sends `warmup` requests that are not measured, then num_requests one after another (bounded by the
duration too). Adds the summary and the latency CDF and timeline plots.
"""

from __future__ import annotations

from ferrylm.bench import plots
from ferrylm.bench.config import BenchConfig
from ferrylm.bench.driver import drive
from ferrylm.bench.record import Record
from ferrylm.bench.report import summarize


def needed(cfg: BenchConfig) -> int:
    return cfg.num_requests + cfg.warmup


async def warm_up(session, client, prompts) -> int:
    """Send cfg.warmup requests (not recorded); the number that failed."""
    bad = 0
    for i in range(session.cfg.warmup):
        if session.stop.is_set():
            break
        rec = await client.send(prompts[i % len(prompts)], Record(-1 - i, "warmup", client.now()))
        bad += not rec.ok
    return bad


async def run(session, client, prompts) -> dict:
    cfg = session.cfg
    warm_failed = await warm_up(session, client, prompts)
    plan = [(0.0, i, prompts[(cfg.warmup + i) % len(prompts)]) for i in range(cfg.num_requests)]
    session.live.step("latency", cfg.duration, cfg.num_requests)
    records = await drive(session, client, plan, concurrency=1, until=cfg.duration)
    results = summarize(records, cfg.slo, cfg.slo_target)
    results.pop("client_wait")  # one at a time: the wait is just the previous request
    out = {"warmup": {"sent": cfg.warmup, "failed": warm_failed}, "results": results}
    out["plots"] = [plots.latency_cdf(records, session.out / "latency_cdf.png").name,
                    plots.timeline(records, session.out / "timeline.png").name]
    return out
