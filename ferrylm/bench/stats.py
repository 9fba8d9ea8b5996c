"""The arithmetic of a bench report: percentiles, empirical CDFs, and least-squares slopes with a 95%
confidence interval (for leak and drift verdicts). Plain numbers in, plain numbers out.

Percentiles interpolate linearly between order statistics (numpy's default, as vLLM's bench uses). The slope
interval is the textbook OLS one, t(0.975, n-2) * standard error; samples taken close together are
correlated, which makes it narrower than it should be, so the soak verdict also needs the bound itself to
clear the bar, not just the point estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 90, 95, 99)

# two-sided 95% Student t quantiles by degrees of freedom (normal beyond 30)
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(df: int) -> float:
    return _T975[df - 1] if df <= len(_T975) else 1.96


def percentile(xs, q: float) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else None


def describe(xs) -> dict:
    """n, mean, the PERCENTILES, max (None when empty)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"n": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}, "max": None}
    a = np.asarray(xs, dtype=float)
    return {"n": len(xs), "mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES},
            "max": float(a.max())}


def cdf(xs) -> tuple[np.ndarray, np.ndarray]:
    """Sorted values and the fraction of values <= each: a monotone step function ending at 1."""
    a = np.sort(np.asarray([x for x in xs if x is not None], dtype=float))
    return a, np.arange(1, len(a) + 1) / max(len(a), 1)


@dataclass(frozen=True)
class Slope:
    slope: float
    """Units of y per unit of t."""
    low: float
    high: float
    """The 95% confidence interval of the slope."""
    intercept: float
    n: int

    def to_json(self, scale: float = 1.0) -> dict:
        return {"slope": self.slope * scale, "ci95": [self.low * scale, self.high * scale], "n": self.n}


def fit_slope(t, y) -> Slope | None:
    """Least-squares line y = a + b t; None with fewer than 3 points or no spread in t."""
    t, y = np.asarray(t, dtype=float), np.asarray(y, dtype=float)
    n = len(t)
    if n < 3:
        return None
    tc = t - t.mean()
    sxx = float((tc ** 2).sum())
    if sxx == 0:
        return None
    b = float((tc * (y - y.mean())).sum() / sxx)
    a = float(y.mean() - b * t.mean())
    resid = y - (a + b * t)
    se = math.sqrt(float((resid ** 2).sum()) / (n - 2) / sxx)
    half = t975(n - 2) * se
    return Slope(b, b - half, b + half, a, n)


def verdict(s: Slope | None, bar: float, scale: float = 1.0, both_ways: bool = False) -> str:
    """`pass` when the whole 95% interval (times scale) is within the bar, `fail` when it lies wholly beyond
    it, else `inconclusive` (too short or too noisy to say); `no data` without a fit."""
    if s is None:
        return "no data"
    lo, hi = s.low * scale, s.high * scale
    if both_ways:
        if -bar <= lo and hi <= bar:
            return "pass"
        return "fail" if lo > bar or hi < -bar else "inconclusive"
    if hi <= bar:
        return "pass"
    return "fail" if lo > bar else "inconclusive"
