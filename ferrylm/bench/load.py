"""Level 2, `ferry bench load`: open-loop arrivals (Poisson by default) at a rate, with a concurrency cap,
bounded by duration and/or count; or a sweep over rates, stopping at the first rate whose SLO breaks.

Each rate is one step with its own seeded schedule (seed + step), its own summary and its own goodput; the
records carry their step. Adds the summary (one `results`, or `steps` and the highest rate that met the
SLO) and the plots (latency CDFs over every step, timeline with step marks, the sweep curve).
"""

from __future__ import annotations

import math

from ferrylm.bench import BenchError, plots
from ferrylm.bench.arrivals import schedule
from ferrylm.bench.config import BenchConfig
from ferrylm.bench.driver import drive
from ferrylm.bench.latency import warm_up
from ferrylm.bench.report import summarize


def rates(cfg: BenchConfig) -> list[float]:
    if cfg.sweep is None:
        return [cfg.rate]
    if cfg.sweep:
        return list(cfg.sweep)
    if math.isinf(cfg.rate):
        raise BenchError("an automatic sweep doubles --rate from where it starts: give a finite --rate")
    return [cfg.rate * 2 ** k for k in range(cfg.sweep_steps)]


def needed(cfg: BenchConfig) -> int:
    per_step = [len(schedule(r, cfg.arrivals, cfg.duration, cfg.num_requests, cfg.seed + k, cfg.burstiness))
                for k, r in enumerate(rates(cfg))]
    return sum(per_step) + cfg.warmup


async def run(session, client, prompts) -> dict:
    cfg = session.cfg
    warm_failed = await warm_up(session, client, prompts)
    steps, marks, all_records, index = [], [], [], 0
    for k, rate in enumerate(rates(cfg)):
        if session.stop.is_set():
            break
        offsets = schedule(rate, cfg.arrivals, cfg.duration, cfg.num_requests, cfg.seed + k, cfg.burstiness)
        plan = [(o, index + i, prompts[(cfg.warmup + index + i) % len(prompts)]) for i, o in enumerate(offsets)]
        index += len(plan)
        marks.append(client.now())
        session.live.step(f"load {rate:g} req/s" if not math.isinf(rate) else "load (all at once)", cfg.duration,
                          len(plan))
        records = await drive(session, client, plan, cfg.max_concurrency, until=cfg.duration, step=k)
        all_records += records
        steps.append({"rate": rate, **summarize(records, cfg.slo, cfg.slo_target)})
        if cfg.sweep is not None and cfg.slo and not steps[-1]["goodput"]["met"]:
            break
    out = {"warmup": {"sent": cfg.warmup, "failed": warm_failed}}
    if cfg.sweep is None:
        out["results"] = steps[0] if steps else summarize([])
    else:
        out["steps"] = steps
        if cfg.slo:
            met = [s["rate"] for s in steps if s["goodput"]["met"]]
            out["max_rate_meeting_slo"] = max(met) if met else None
            out["slo_broke_at"] = next((s["rate"] for s in steps if not s["goodput"]["met"]), None)
    out["plots"] = [plots.latency_cdf(all_records, session.out / "latency_cdf.png").name,
                    plots.timeline(all_records, session.out / "timeline.png", marks=marks[1:]).name]
    if len(steps) > 1:
        out["plots"].append(plots.sweep(steps, session.out / "sweep.png").name)
    return out
