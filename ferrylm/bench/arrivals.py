"""The arrival schedule: send offsets (seconds from the start) fixed up front from the seed, so the same
flags send the same load. Poisson (exponential gaps), gamma (gaps with a shape: < 1 bursty, > 1 regular,
mean gap kept at 1 / rate) or constant. Always bounded: by duration, by count, or both.
"""

from __future__ import annotations

import math

import numpy as np

from ferrylm.bench import BenchError

KINDS = ("poisson", "gamma", "constant")


def schedule(rate: float, kind: str, duration: float | None, count: int | None, seed: int,
             burstiness: float = 1.0) -> list[float]:
    if kind not in KINDS:
        raise BenchError(f"unknown arrival process {kind!r}: choose from {', '.join(KINDS)}")
    if duration is None and count is None:
        raise BenchError("a run needs a bound: give a duration, a number of requests, or both")
    if math.isinf(rate):
        if count is None:
            raise BenchError("rate inf sends everything at once: give a number of requests (-n)")
        return [0.0] * count
    if kind == "gamma" and not burstiness > 0:
        raise BenchError("burstiness (the gamma shape) must be > 0")
    limit = count if count is not None else math.inf
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    while len(out) < limit:
        if kind == "constant":
            gap = 1.0 / rate
        elif kind == "poisson":
            gap = rng.exponential(1.0 / rate)
        else:
            gap = rng.gamma(burstiness, 1.0 / (rate * burstiness))
        # the first request goes at 0, so a run's span and its rate line up
        if out:
            t += gap
        if duration is not None and t >= duration:
            break
        out.append(t)
    return out
