"""From quality curves to the numbers in the tables: time to target, medians with spread, ratios.

A curve is a list of ``(training seconds, steps, quality)`` points of rank 0. The time
to target is the first point whose quality meets the target (evaluations are a few per
run, so this is an upper bound by at most one evaluation interval; every setup is
evaluated at the same clock marks). A repeat that never reaches the target counts as
infinitely slow, so the median over repeats is finite only when most repeats reach it.

Example:
    >>> curve = [(0.0, 0, 5.0), (10.0, 100, 3.0), (20.0, 200, 2.0)]
    >>> time_to_target(curve, 2.5, higher_is_better=False)
    (20.0, 200)
    >>> time_to_target(curve, 1.0, higher_is_better=False) is None
    True
    >>> spread([3.0, 1.0, 2.0])
    {'median': 2.0, 'low': 1.0, 'high': 3.0, 'n': 3}

Repeat ``k`` of every setup starts from the same seed, so two setups compare best repeat by repeat
(:func:`paired`); the spreads across repeats are mostly the seed's.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any, Sequence

INF = math.inf


def time_to_target(curve: Sequence[Sequence[float]], target: float, *,
                   higher_is_better: bool) -> tuple[float, int] | None:
    """(seconds, steps) of the first point at or past ``target``; None when no point reaches it."""
    for seconds, steps, quality in curve:
        if quality is None or math.isnan(quality):
            continue
        if (quality >= target) if higher_is_better else (quality <= target):
            return float(seconds), int(steps)
    return None


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max (inf allowed: a repeat that missed the target), and the count."""
    if not values:
        return {"median": math.nan, "low": math.nan, "high": math.nan, "n": 0}
    return {"median": float(statistics.median(values)), "low": float(min(values)), "high": float(max(values)),
            "n": len(values)}


def rows(records: list[dict[str, Any]], targets: dict[str, float],
         higher: dict[str, bool]) -> list[dict[str, Any]]:
    """One row per (task, link, setup), pooled over repeats."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        r = rec["run"]
        groups[(r["task"], r["link"], r["setup"])].append(rec)
    out = []
    for (task, link, setup), recs in groups.items():
        good = [rec for rec in recs if not rec["error"] and rec["ranks"]]
        ok = [rec["ranks"][0] for rec in good]
        ttt, steps = [], []
        for r0 in ok:
            hit = time_to_target(r0["curve"], targets[task], higher_is_better=higher[task])
            ttt.append(hit[0] if hit else INF)
            steps.append(hit[1] if hit else INF)
        # repeat k runs every setup from the same seed (weights, data order): the pairing paired() uses
        by_repeat = {int(rec.get("repeat", i)): t for i, (rec, t) in enumerate(zip(good, ttt))}
        out.append({"task": task, "link": link, "setup": setup, "provider": recs[0]["run"]["provider"],
                    "lr": recs[0]["run"]["lr"], "runs": len(recs), "ok": len(ok),
                    "reached": sum(1 for t in ttt if t < INF), "target": targets[task],
                    "time_to_target": spread(ttt), "steps_to_target": spread(steps), "by_repeat": by_repeat,
                    "samples_per_s": spread([r["samples_per_s"] for r in ok]),
                    "final": spread([r["final"] for r in ok]),
                    "bytes_per_step": spread([r["bytes_per_step"] for r in ok]),
                    "wire_bytes_per_step": spread([r["wire_bytes_per_step"] for r in ok
                                                   if r["wire_bytes_per_step"] is not None]),
                    "budget_s": recs[0]["run"]["budget_s"], "curves": [r["curve"] for r in ok],
                    "errors": [rec["error"] for rec in recs if rec["error"]]})
    return out


COMPUTE_ONLY = "compute-only"  # the setup whose runs measure the bound's step: two workers, no exchange


def side_by_side_steps(raw: list[dict[str, Any]]) -> dict[str, float]:
    """Per task, the seconds a step took in its ``compute-only`` runs: two workers training side by side on the
    same machine with no exchange at all, the median over runs of rank 0's training seconds per step.

    It is the step a run paying no communication takes under the same contention (memory, the other worker) as
    the setups it bounds, measured as long as they train; one worker measured alone moved by 10-25% within an
    hour on a 2-core machine. Rank 0's clock is the one every time to target is read from; rank 1's is not a
    compute step: with no exchange it trains its next steps while rank 0 evaluates, on the same cores (up to 6% slower
    steps measured), which rank 0 of no setup meets.

        >>> rec = {"run": {"task": "t", "setup": "compute-only"}, "error": None,
        ...        "ranks": [{"train_seconds": 10.0, "steps": 160}, {"train_seconds": 10.6, "steps": 160}]}
        >>> side_by_side_steps([rec])
        {'t': 0.0625}
    """
    per_task: dict[str, list[float]] = defaultdict(list)
    for rec in raw:
        if rec["run"]["setup"] == COMPUTE_ONLY and not rec["error"] and rec["ranks"] and rec["ranks"][0]["steps"]:
            per_task[rec["run"]["task"]].append(rec["ranks"][0]["train_seconds"] / rec["ranks"][0]["steps"])
    return {t: statistics.median(v) for t, v in per_task.items()}


def add_bounds(rows_: list[dict[str, Any]], compute_s: dict[str, float]) -> dict[str, dict[str, Any]]:
    """The compute-only bound per task, and each row's time to target over it (``row["vs_bound"]``).

    The bound is the time to target of a run that pays no communication at all: DDP's steps to target
    (synchronous SGD: the same steps on any link; the fewest of the links where it reached, median over
    repeats) times the compute step (:func:`side_by_side_steps` where the invocation ran ``compute-only``,
    else one worker's, measured alone). None where DDP never reached the target.

    Example:
        >>> rows_ = [{"task": "t", "link": "1gbit", "setup": "ddp", "ok": 1, "steps_to_target": spread([100]),
        ...           "time_to_target": spread([30.0])}]
        >>> add_bounds(rows_, {"t": 0.2})["t"]["bound_s"], rows_[0]["vs_bound"]["median"]
        (20.0, 1.5)
    """
    bounds: dict[str, dict[str, Any]] = {}
    for task in dict.fromkeys(r["task"] for r in rows_):
        steps = [r["steps_to_target"]["median"] for r in rows_ if r["task"] == task and r["setup"] == "ddp"
                 and r["ok"] and r["steps_to_target"]["median"] < INF]
        if not steps or task not in compute_s:
            bounds[task] = {"bound_s": None, "ddp_steps": None, "compute_s": compute_s.get(task)}
            continue
        bounds[task] = {"bound_s": min(steps) * compute_s[task], "ddp_steps": min(steps),
                        "compute_s": compute_s[task]}
    for r in rows_:
        b = bounds[r["task"]]["bound_s"]
        r["vs_bound"] = {k: (v / b if isinstance(v, float) and b else math.nan) if k != "n" else v
                         for k, v in r["time_to_target"].items()} if b else spread([])
    return bounds


def ratio(slow: dict[str, float], fast: dict[str, float]) -> dict[str, float]:
    """How many times sooner ``fast`` is than ``slow``: median ratio with its range (worst, best pairing)."""
    def div(a: float, b: float) -> float:
        if b == 0 or math.isnan(a) or math.isnan(b) or (a == INF and b == INF):
            return math.nan
        return a / b
    return {"median": div(slow["median"], fast["median"]), "low": div(slow["low"], fast["high"]),
            "high": div(slow["high"], fast["low"])}


def paired(slow: dict[str, Any], fast: dict[str, Any]) -> dict[str, Any]:
    """How many times sooner ``fast`` is than ``slow``, repeat by repeat (each repeat's seed is the same for
    every setup, so most of the spread between repeats, the seed's, cancels): the ratios' median and range,
    and in how many repeats ``fast`` was ahead. A repeat that only one side missed counts as inf or 0.

    Example:
        >>> paired({"by_repeat": {0: 30.0, 1: 25.0, 2: 26.0}}, {"by_repeat": {0: 28.0, 1: 24.0, 2: 24.5}})["ahead"]
        3
    """
    out = []
    for k in sorted(set(slow.get("by_repeat", {})) & set(fast.get("by_repeat", {}))):
        a, b = slow["by_repeat"][k], fast["by_repeat"][k]
        if a == INF and b == INF:
            continue
        out.append(INF if b == 0 or a == INF else a / b)
    return {**spread(out), "ahead": sum(1 for x in out if x > 1)}


PEERS = ("torch", "torchft")  # the providers phalanx is compared with


def winner(rows_: list[dict[str, Any]], task: str, link: str,
           provider: str | tuple[str, ...] | None = None) -> dict[str, Any] | None:
    """The row with the lowest median time to target (ties: more repeats reached, then higher throughput);
    ``provider``: only that provider's rows (a tuple: any of them)."""
    wanted = (provider,) if isinstance(provider, str) else provider
    mine = [r for r in rows_ if r["task"] == task and r["link"] == link and r["ok"]
            and (wanted is None or r["provider"] in wanted)]
    mine = [r for r in mine if r["time_to_target"]["median"] < INF]
    if not mine:
        return None
    return min(mine, key=lambda r: (r["time_to_target"]["median"], -r["reached"], -r["samples_per_s"]["median"]))
