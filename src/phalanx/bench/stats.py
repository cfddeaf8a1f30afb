"""Statistics of a benchmark run: warm-up excluded, windows, median and spread, speedup, efficiency.

Throughput is measured over *windows* of consecutive steps after the warm-up. A
window is one step for rules that talk every step; for periodic rules (local SGD
every k steps) it is k steps, so every window holds exactly one sync and a median
over windows is not flattered by the cheap local steps. A window's throughput adds
up every worker's own rate (samples in the window / that worker's time for it),
which is right for synchronous workers (their clocks agree) and for asynchronous
ones alike.

Example:
    >>> s = summary([100.0, 110.0, 90.0, 100.0])
    >>> s["median"], round(s["mean"], 1), round(s["low"], 1), round(s["high"], 1)
    (100.0, 100.0, 90.8, 109.2)
    >>> speedup(180.0, 100.0, 2)
    (1.8, 0.9)
"""
from __future__ import annotations

import math
import statistics
from typing import Sequence


def timed(step_s: Sequence[float], warmup: int) -> list[float]:
    """The step times after the first ``warmup`` steps."""
    if warmup < 0:
        raise ValueError(f"warmup={warmup}; expected >= 0")
    return list(step_s[warmup:])


def windows(step_s: Sequence[float], size: int) -> list[float]:
    """Sums of consecutive, complete windows of ``size`` steps (a short tail is dropped)."""
    if size < 1:
        raise ValueError(f"window size {size}; expected >= 1")
    return [sum(step_s[i:i + size]) for i in range(0, len(step_s) - size + 1, size)]


def window_throughput(ranks_step_s: Sequence[Sequence[float]], batch: int, size: int) -> list[float]:
    """Global samples/s of each window: the sum over workers of batch*size / window time.

    ``ranks_step_s`` holds each worker's timed step times (warm-up already removed).
    Fewer timed steps than ``size`` make one window of all of them.
    """
    size = max(1, min([size, *(len(s) for s in ranks_step_s)]))
    per_rank = [windows(s, size) for s in ranks_step_s]
    count = min((len(w) for w in per_rank), default=0)
    return [sum(batch * size / w[i] for w in per_rank) for i in range(count)]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation, as numpy's default."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, frac = int(math.floor(pos)), pos - math.floor(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * frac


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, mean, sample std, the spread (2.5th to 97.5th percentile of the values), and the count.

    The spread is read off the values themselves, not mean ± 1.96·std: with a few
    skewed windows the latter goes below zero for a throughput that cannot.
    With one value the std is 0; with none everything is nan.
    """
    n = len(values)
    if n == 0:
        nan = math.nan
        return {"median": nan, "mean": nan, "std": nan, "low": nan, "high": nan, "n": 0}
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if n > 1 else 0.0
    return {"median": float(statistics.median(values)), "mean": mean, "std": std,
            "low": percentile(values, 2.5), "high": percentile(values, 97.5), "n": n}


def speedup(thpt_n: float, thpt_1: float, n: int) -> tuple[float, float]:
    """Speedup thpt(N)/thpt(1) and efficiency speedup/N."""
    if not thpt_1 > 0 or n < 1:
        return math.nan, math.nan
    s = thpt_n / thpt_1
    return s, s / n
