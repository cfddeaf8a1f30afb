"""Check `phalanx bench`'s advice against the measured time to quality.

`phalanx bench` projects each setup's throughput on a link from the compute time of one
step and the bytes it sends (:mod:`phalanx.bench.projection`). Here the same model is fed
with this benchmark's own inputs (measured compute time per step on one worker, counted
bytes per step of each setup, the link's rate, 2 workers), and three rules are compared
with the setup that actually reached the target first on that link:

* ``old``: the highest projected throughput (:func:`projection.recommend_by_throughput`,
  the rule before this benchmark existed); it favours whatever sends the fewest bytes;
* ``new``: what `phalanx bench` prints now (:func:`projection.recommend`): the fastest
  setup that converges per step like all-reduce, naming any faster-projected setup of
  another kind as one to measure first;
* ``with_steps``: :func:`projection.recommend` given this run's measured steps to target
  (what `phalanx bench` could say after a quality run), declining ("cannot tell between A
  and B") where its pick is projected less than :data:`MARGIN` sooner than the runner-up, or
  where the throughput projection of either is off by more than :data:`MARGIN` against the
  samples/s measured on this link: a lead inside the model's own error is not a lead.

Each verdict is ``right`` (it named the winner), ``cannot tell`` (it declined, or named
the winner as one to measure, or its pick's time to target overlaps the winner's, or
nothing reached the target) or ``wrong``, with how far off it was (its pick's median time
to target over the winner's; inf when its pick never reached the target). The top-level
``verdict``/``off_by`` are the new rule's.

It also records, per setup, projected over measured samples/s: how far the throughput
model itself is off.

Example:
    >>> rate_bits("100mbit"), rate_bits("1gbit")
    (100000000.0, 1000000000.0)
"""
from __future__ import annotations

import math
import re
from typing import Any

from phalanx.bench import projection
from .curves import INF, winner

UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
# The throughput projection's measured error: 0.88-1.23x of the measured samples/s (benchmarks/reports/quality.md).
MARGIN = 1.25


def rate_bits(link: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", link)
    if not m:
        return math.nan  # loopback: no rate to project
    return float(m.group(1)) * UNITS[m.group(2)]


def _verdict(text: str, mine: list[dict[str, Any]], best: dict[str, Any] | None) -> dict[str, Any]:
    pick = None if text.startswith(("no setup", "none", "cannot tell")) else text.split(" on ")[0]
    flagged = text.split("; ")[1].split(" ")[0] if "; " in text else None
    out: dict[str, Any] = {"advice": text, "recommended": pick}
    if best is None:
        return {**out, "verdict": "cannot tell", "why": "no setup reached the target", "off_by": math.nan}
    if pick is None:
        return {**out, "verdict": "cannot tell", "why": "the advisor declined to recommend", "off_by": math.nan}
    if pick == best["setup"]:
        return {**out, "verdict": "right", "why": "it recommended the winner", "off_by": 1.0}
    chosen = next(r for r in mine if r["setup"] == pick)["time_to_target"]
    off = chosen["median"] / best["time_to_target"]["median"]
    if flagged == best["setup"]:
        return {**out, "verdict": "cannot tell", "off_by": off,
                "why": "it named the winner as the one to measure with --quality"}
    if chosen["low"] <= best["time_to_target"]["high"]:
        return {**out, "verdict": "cannot tell", "why": "its pick's time to target overlaps the winner's",
                "off_by": off}
    return {**out, "verdict": "wrong", "off_by": off, "why": "its pick never reached the target"
            if chosen["median"] == INF else f"its pick took {off:.2f}× as long as the winner"}


def check(rows: list[dict[str, Any]], compute_s: dict[str, float], per_worker: dict[str, int], *,
          alpha: float = 25e-6, threshold: float = 0.8, workers: int = 2) -> list[dict[str, Any]]:
    """One entry per (task, link): the old, the new and the with-steps rule's advice and verdict."""
    out = []
    for task, link in dict.fromkeys((r["task"], r["link"]) for r in rows):
        bits = rate_bits(link)
        mine = [r for r in rows if r["task"] == task and r["link"] == link and r["ok"]]
        if math.isnan(bits) or task not in compute_s or not mine:
            out.append({"task": task, "link": link, "verdict": "cannot tell", "why": "no link rate or no data"})
            continue
        gbit = bits / 1e9
        table: dict[str, Any] = {}
        projected: dict[str, float] = {}
        for r in mine:
            t = compute_s[task] + projection.ring_seconds(workers, r["bytes_per_step"]["median"], bits / 8, alpha)
            thpt = workers * per_worker[task] / t
            table[r["setup"]] = {"links": {gbit: {workers: {"efficiency": compute_s[task] / t,
                                                            "samples_per_s": thpt}}}}
            projected[r["setup"]] = thpt
        best = winner(rows, task, link)
        steps = {r["setup"]: r["steps_to_target"]["median"] for r in mine}
        entry: dict[str, Any] = {"task": task, "link": link, "winner": best["setup"] if best else None,
                                 "throughput_error": {r["setup"]: projected[r["setup"]] / r["samples_per_s"]["median"]
                                                      for r in mine if r["samples_per_s"]["median"] > 0}}
        entry.update(_verdict(projection.recommend(table, gbit, threshold), mine, best))
        entry["old"] = _verdict(projection.recommend_by_throughput(table, gbit, threshold), mine, best)
        entry["with_steps"] = _verdict(with_steps(table, gbit, threshold, steps, entry["throughput_error"],
                                                  workers), mine, best)
        out.append(entry)
    return out


def with_steps(table: dict[str, Any], gbit: float, threshold: float, steps: dict[str, float],
               errors: dict[str, float], workers: int = 2) -> str:
    """:func:`projection.recommend` with measured steps to target, or "cannot tell between A and B" where the
    pick's projected lead over the runner-up is under :data:`MARGIN`, or the projection of either is off by more
    than :data:`MARGIN` against the throughput measured on the link (``errors``: projected / measured)."""
    text = projection.recommend(table, gbit, threshold, steps)
    pick = text.split(" on ")[0]
    if text.startswith(("no setup", "none")) or pick not in table:
        return text
    score = {s: t["links"][gbit][workers]["samples_per_s"] / steps[s] for s, t in table.items()
             if steps.get(s, math.inf) < math.inf and workers in t["links"][gbit]}
    runner = max((s for s in score if s != pick), key=score.get, default=None)
    if runner is None:
        return text
    for s in (pick, runner):
        e = errors.get(s, 1.0)
        if not 1 / MARGIN <= e <= MARGIN:
            return (f"cannot tell between {pick} and {runner}: the projection of {s}'s throughput is off by {e:.2f}x "
                    "against the samples/s measured on this link")
    lead = score[pick] / score[runner]
    if lead < MARGIN:
        return (f"cannot tell between {pick} and {runner}: {pick} is projected {lead:.2f}x sooner to target, "
                f"inside the throughput model's error ({MARGIN:.2f}x)")
    return text


def _cell(v: dict[str, Any]) -> str:
    off = v.get("off_by", math.nan)
    off_text = "" if math.isnan(off) else ", never reached" if off == INF else f", off by {off:.2f}×"
    return f"{v.get('recommended') or 'none'}: **{v['verdict']}**{off_text} ({v['why']})"


def markdown(verdicts: list[dict[str, Any]]) -> str:
    head = ("| task | link | measured winner | old rule: throughput only | new rule: `phalanx bench` now | "
            "new rule + measured steps to target |\n|---|---|---|---|---|---|\n")
    lines = []
    for v in verdicts:
        if "old" not in v:
            lines.append(f"| {v['task']} | {v['link']} | | {v['why']} | | |")
            continue
        lines.append(f"| {v['task']} | {v['link']} | {v.get('winner') or 'none'} | {_cell(v['old'])} | {_cell(v)} | "
                     f"{_cell(v['with_steps'])} |")
    advice = [f"* {v['task']}, {v['link']}: {v['advice']}" for v in verdicts if "advice" in v]
    return head + "\n".join(lines) + "\n\nThe new rule's advice in full:\n\n" + "\n".join(advice) + "\n"
