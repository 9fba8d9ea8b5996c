"""The human units of `ferry bench` flags: durations (100ms, 90s, 10m, 72h), sizes (0.3GB, 120MB, 2GiB),
token ranges (512, 50-2000), the prompt mix (en,zh:2,code) and SLOs (ttft=2s,itl=100ms).

Every parser raises `BenchError` naming the text it could not read; it knows nothing of what the values
are used for.
"""

from __future__ import annotations

import math
import re

from ferrylm.bench import BenchError

_DURATION = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
         "tib": 2**40}
SLO_METRICS = ("ttft", "itl", "tpot", "e2e")
"""Per-request latencies an SLO may bound (itl: the request's P99 gap between streamed chunks)."""


def _number_unit(text: str, what: str) -> tuple[float, str]:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m:
        raise BenchError(f"cannot read {what} {text!r}")
    return float(m.group(1)), m.group(2).lower()


def parse_duration(text: str) -> float:
    """Seconds in `text`; a bare number is seconds."""
    value, unit = _number_unit(text, "duration")
    if unit and unit not in _DURATION:
        raise BenchError(f"cannot read duration {text!r}: unit must be one of {', '.join(_DURATION)}")
    return value * _DURATION.get(unit or "s")


def parse_size(text: str) -> float:
    """Bytes in `text`; a bare number is bytes. GB is 1e9, GiB is 2**30."""
    value, unit = _number_unit(text, "size")
    if unit and unit not in _SIZE:
        raise BenchError(f"cannot read size {text!r}: unit must be one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    return value * _SIZE.get(unit or "b")


def parse_rate(text: str) -> float:
    """Requests per second; `inf` sends everything at once (the concurrency cap still holds)."""
    if text.strip().lower() in ("inf", "max"):
        return math.inf
    try:
        rate = float(text)
    except ValueError:
        raise BenchError(f"cannot read rate {text!r}: give requests per second or `inf`") from None
    if not rate > 0:
        raise BenchError(f"rate must be > 0, got {text!r}")
    return rate


def parse_range(text: str) -> tuple[int, int]:
    """`512` -> (512, 512); `50-2000` -> (50, 2000)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if not m:
        raise BenchError(f"cannot read token range {text!r}: give N or LO-HI")
    lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
    if not 1 <= lo <= hi:
        raise BenchError(f"token range {text!r} must have 1 <= LO <= HI")
    return lo, hi


def parse_mix(text: str, known: tuple[str, ...]) -> tuple[tuple[str, float], ...]:
    """`en,zh:2,code` -> (("en", 1), ("zh", 2), ("code", 1)): kinds with relative weights."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition(":")
        if name not in known:
            raise BenchError(f"unknown prompt kind {name!r} in --mix: choose from {', '.join(known)}")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise BenchError(f"cannot read weight {weight!r} of {name!r} in --mix") from None
        if w <= 0:
            raise BenchError(f"weight of {name!r} in --mix must be > 0")
        out.append((name, w))
    if not out:
        raise BenchError("--mix is empty")
    return tuple(out)


def parse_slo(text: str) -> tuple[tuple[str, float], ...]:
    """`ttft=2s,itl=100ms` -> (("ttft", 2.0), ("itl", 0.1)): each request must meet every bound."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        if not eq or name not in SLO_METRICS:
            raise BenchError(f"cannot read SLO {part!r}: write METRIC=DURATION with METRIC in {', '.join(SLO_METRICS)}")
        out.append((name, parse_duration(value)))
    if not out:
        raise BenchError("--slo is empty")
    return tuple(out)
