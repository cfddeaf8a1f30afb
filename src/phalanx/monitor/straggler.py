"""Which rank holds the others back, and why: compute, input, or the exchange.

Each worker's summary (:mod:`phalanx.step.telemetry`) holds the medians of its last steps,
split into compute, input (waiting for the loader) and exchange (from its last local
gradient to the end of the averaging). In a synchronous group everybody's step lasts as
long as the slowest worker's own work, and the fast ones spend the difference waiting in
the exchange. So a straggler is found by its *own* work: the worker whose compute or input
exceeds the median of the others' the most, by at least :data:`MIN_RATIO` and by a share
:data:`MIN_SHARE` of the group's step. Only when nobody's own work stands out is a worker
whose exchange alone is slow named (a slow link of its own).

Example:
    >>> w = lambda wid, c, i, e: {"worker": wid, "rank": int(wid), "compute_s": c, "input_s": i, "exchange_s": e,
    ...                           "step_s": c + i + e, "steps": 50}
    >>> s = attribute([w("0", 0.01, 0.0, 0.02), w("1", 0.031, 0.0, 0.0), w("2", 0.01, 0.0, 0.021)])
    >>> s["text"]
    'rank 1: compute 3.1x the median of the others over the last 50 steps (31.0 ms vs 10.0 ms)'
    >>> attribute([w("0", 0.01, 0.0, 0.001), w("1", 0.011, 0.0, 0.0)]) is None
    True
"""
from __future__ import annotations

import statistics
from typing import Any

MIN_RATIO = 1.5  # a part this many times the others' median...
MIN_SHARE = 0.2  # ...and longer than theirs by this share of the group's median step
OWN = ("compute", "input")  # the worker's own work; the exchange is where the others wait for it
MIN_STEPS = 5  # a summary of fewer steps says nothing yet


def attribute(workers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The straggler among ``workers`` (their summaries), or None: ``{"worker", "rank", "cause", "ratio", "text"}``."""
    ready = [w for w in workers if w.get("steps", 0) >= MIN_STEPS and w.get("step_s") is not None]
    if len(ready) < 2:
        return None
    step = statistics.median(w["step_s"] for w in ready)
    for causes in (OWN, ("exchange",)):
        best = None
        for w in ready:
            others = [o for o in ready if o is not w]
            for cause in causes:
                mine, theirs = w[f"{cause}_s"], statistics.median(o[f"{cause}_s"] for o in others)
                excess = mine - theirs
                if excess < MIN_SHARE * step or mine < MIN_RATIO * theirs:
                    continue
                if best is None or excess > best[0]:
                    best = (excess, w, cause, mine, theirs)
        if best is not None:
            _, w, cause, mine, theirs = best
            ratio = mine / theirs if theirs > 0 else float("inf")
            times = f"{ratio:.1f}x" if ratio != float("inf") else "far above"
            text = (f"rank {w['rank']}: {cause} {times} the median of the others over the last {w['steps']} steps "
                    f"({mine * 1e3:.1f} ms vs {theirs * 1e3:.1f} ms)")
            return {"worker": w["worker"], "rank": w["rank"], "cause": cause,
                    "ratio": ratio if ratio != float("inf") else None, "text": text}
    return None


__all__ = ["MIN_RATIO", "MIN_SHARE", "attribute"]
