"""When a benchmark's numbers cannot be trusted, say so: a busy machine, a wide spread, a ratio within noise.

Example:
    >>> busy((3.6, 2.0, 1.0), cpu_count=2) is not None
    True
    >>> within_noise({"median": 100.0, "low": 90.0, "high": 110.0}, {"median": 105.0, "low": 95.0, "high": 115.0})
    True
"""
from __future__ import annotations

import math
from typing import Any, Sequence

NOISY = 0.25  # a row whose spread is wider than ±25% of its median gives no usable ratio


def busy(loadavg: Sequence[float] | None, cpu_count: int | None) -> str | None:
    """A warning when the machine was already busy before the benchmark started its own processes."""
    if not loadavg or not cpu_count:
        return None
    load = float(loadavg[0])
    if load > max(1.0, 0.5 * cpu_count):
        return (f"the machine was busy when the benchmark started (load average {load:.2f} on {cpu_count} cores): "
                "other processes compete with the workers, so every figure here is low and noisy; rerun on an idle "
                "machine before quoting them")
    return None


def relative_spread(s: dict[str, float]) -> float:
    """Half the spread (high - low) over the median; nan without a median."""
    med = s.get("median", math.nan)
    if not med or math.isnan(med) or "low" not in s or "high" not in s:
        return math.nan
    return (s["high"] - s["low"]) / (2 * med)


def noisy(s: dict[str, float]) -> bool:
    """True when the spread is wider than ±25% of the median, or there is a single window."""
    return s.get("n", 0) < 2 or not relative_spread(s) <= NOISY


def within_noise(a: dict[str, float], b: dict[str, float]) -> bool:
    """True when the spreads of ``a`` and ``b`` overlap: their ratio does not say which is faster."""
    if any(math.isnan(x.get(k, math.nan)) for x in (a, b) for k in ("low", "high")):
        return True
    return a["low"] <= b["high"] and b["low"] <= a["high"]


def warnings(rows: list[dict[str, Any]], environment: dict[str, Any]) -> list[str]:
    """Every warning for a sweep: a busy machine, and the rows too noisy for their ratios to mean anything."""
    out = []
    msg = busy(environment.get("loadavg_at_start"), environment.get("cpu_count"))
    if msg:
        out.append(msg)
    for r in rows:
        s = r["samples_per_s"]
        if s.get("n") and noisy(s):
            out.append(f"{r['model']} {r['setup']} {r['workers']}×{r['threads']}: spread ±"
                       f"{100 * relative_spread(s):.0f}% of the median over {s['n']} window(s); its speedup and "
                       "ratios are not meaningful (more --steps or --repeats, or an idle machine)")
    return out
