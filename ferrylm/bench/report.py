"""The summary of a set of `Record`s: counts, errors, throughput, latency distributions, concurrency and
goodput against an SLO. Numbers only; files are the session's, pictures `plots.py`'s.

Definitions (stated in docs/bench.md): TTFT = first chunk with text - sent; ITL = gaps between chunks with
text (a chunk may carry several tokens); TPOT = (last chunk - first chunk) / (output tokens - 1); E2E =
end of stream - sent. Latencies cover ok requests only. The span is first send to last end, and rates are
per second of it. A request meets the SLO when every bound holds (itl: the request's own P99 gap) and it
did not fail; goodput is such requests per second.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ferrylm.bench.record import Record
from ferrylm.bench.stats import describe


def span(records: list[Record]) -> float:
    sent = [r.sent for r in records if r.sent is not None]
    ends = [r.end for r in records if r.end is not None]
    return max(ends) - min(sent) if sent and ends else 0.0


def _slo_value(r: Record, metric: str) -> float | None:
    if metric == "itl":
        gaps = r.itl
        return float(np.percentile(gaps, 99)) if gaps else 0.0
    return getattr(r, metric)


def meets(r: Record, slo) -> bool:
    if not r.ok:
        return False
    for metric, bound in slo:
        v = _slo_value(r, metric)
        if v is None or v > bound:
            return False
    return True


def concurrency_profile(records: list[Record]) -> tuple[np.ndarray, np.ndarray]:
    """(times, requests in flight from each time on): a step function over the sends and ends."""
    ev = [(r.sent, 1) for r in records if r.sent is not None] + [(r.end, -1) for r in records if r.sent is not None]
    ev.sort()
    t = np.array([e[0] for e in ev])
    return t, np.cumsum([e[1] for e in ev])


def summarize(records: list[Record], slo=(), slo_target: float = 0.9) -> dict:
    sent = [r for r in records if r.sent is not None]
    ok = [r for r in records if r.ok]
    cancelled = [r for r in records if r.cancelled]
    failed = [r for r in records if not r.ok and not r.cancelled]
    judged = [r for r in sent if not r.cancelled]
    # requests that got an answer or failed: the base of error rates and goodput
    secs = span(records)
    out_tok = sum(r.output_tokens or 0 for r in ok)
    in_tok = sum(r.prompt_tokens or 0 for r in ok)
    by_status = Counter(str(r.status) if r.status is not None else "no response" for r in failed)
    messages = list(dict.fromkeys(r.error for r in failed if r.error))[:5]
    busy = sum(r.end - r.sent for r in sent if r.end is not None)
    _, inflight = concurrency_profile(records)
    per = (lambda x: x / secs) if secs > 0 else (lambda x: None)
    out = {
        "requests": {"planned_or_sent": len(records), "sent": len(sent), "ok": len(ok), "failed": len(failed),
                     "cancelled": len(cancelled), "server_errors": sum(r.server_error for r in records),
                     "failed_by_status": dict(by_status), "first_errors": messages},
        "error_rate": len(failed) / max(len(judged), 1),
        "duration_s": secs,
        "request_throughput": per(len(ok)),
        "prompt_tokens": in_tok, "output_tokens": out_tok,
        "output_tok_s": per(out_tok), "total_tok_s": per(out_tok + in_tok),
        "tokens_counted_from": dict(Counter(r.tokens_from for r in ok)),
        "ttft": describe([r.ttft for r in ok]),
        "itl": describe([g for r in ok for g in r.itl]),
        "tpot": describe([r.tpot for r in ok]),
        "e2e": describe([r.e2e for r in ok]),
        "concurrency": {"max": int(inflight.max()) if len(inflight) else 0, "mean": per(busy)},
        "client_wait": describe([r.sent - r.scheduled for r in sent]),
    }
    if slo:
        good = sum(meets(r, slo) for r in judged)
        frac = good / len(judged) if judged else None
        out["goodput"] = {"slo": dict(slo), "good": good, "judged": len(judged), "fraction": frac,
                          "requests_per_s": per(good), "target": slo_target,
                          "met": frac is not None and frac >= slo_target}
    return out


def _ms(d: dict) -> str:
    if not d or not d.get("n"):
        return "-"
    return "/".join(f"{d[k] * 1000:.0f}" for k in ("p50", "p90", "p99")) + " ms"


def brief(results: dict, label: str = "") -> str:
    """One human line of a results block (stderr; the JSON is the record)."""
    q = results["requests"]
    rate = results["request_throughput"]
    line = (f"{label}ok {q['ok']}/{q['sent']}" + (f", failed {q['failed']}" if q["failed"] else "")
            + (f", cancelled {q['cancelled']}" if q["cancelled"] else "")
            + (f" | {rate:.2f} req/s, {results['output_tok_s']:.1f} out tok/s" if rate is not None else "")
            + f" | p50/p90/p99 TTFT {_ms(results['ttft'])}, ITL {_ms(results['itl'])}, E2E {_ms(results['e2e'])}")
    if "goodput" in results:
        g = results["goodput"]
        line += f" | goodput {g['good']}/{g['judged']} {'met' if g['met'] else 'NOT met'}"
    return line
