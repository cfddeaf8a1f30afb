"""Check `phalanx bench`'s advice against the measured time to quality.

`phalanx bench` projects each setup's throughput on a link from the compute time of one
step and the bytes it sends (:mod:`phalanx.bench.projection`) and recommends the setup
with the highest projected throughput. Here the same model and the same rule
(:func:`projection.recommend`) are fed with this benchmark's own inputs (measured
compute time per step on one worker, counted bytes per step of each setup, the link's
rate, 2 workers), and the recommendation is compared with the setup that actually
reached the target first on that link:

* ``right``: it recommended the winner;
* ``cannot tell``: it declined to recommend, or its pick's time to target overlaps the
  winner's (min–max over repeats), or nothing reached the target;
* ``wrong``: otherwise, with how far off it was (its pick's median time to target over
  the winner's; inf when its pick never reached the target).

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

from .. import projection
from .curves import INF, winner

UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(link: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", link)
    if not m:
        return math.nan  # loopback: no rate to project
    return float(m.group(1)) * UNITS[m.group(2)]


def check(rows: list[dict[str, Any]], compute_s: dict[str, float], per_worker: dict[str, int], *,
          alpha: float = 25e-6, threshold: float = 0.8, workers: int = 2) -> list[dict[str, Any]]:
    """One verdict per (task, link)."""
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
        text = projection.recommend(table, gbit, threshold)
        pick = None if text.startswith("no setup") else text.split(" on ")[0]
        best = winner(rows, task, link)
        entry: dict[str, Any] = {"task": task, "link": link, "advice": text, "recommended": pick,
                                 "winner": best["setup"] if best else None,
                                 "throughput_error": {r["setup"]: projected[r["setup"]] / r["samples_per_s"]["median"]
                                                      for r in mine if r["samples_per_s"]["median"] > 0}}
        if best is None:
            entry.update(verdict="cannot tell", why="no setup reached the target", off_by=math.nan)
        elif pick is None:
            entry.update(verdict="cannot tell", why="the advisor declined to recommend", off_by=math.nan)
        elif pick == best["setup"]:
            entry.update(verdict="right", why="it recommended the winner", off_by=1.0)
        else:
            chosen = next(r for r in mine if r["setup"] == pick)["time_to_target"]
            off = chosen["median"] / best["time_to_target"]["median"]
            if chosen["low"] <= best["time_to_target"]["high"]:
                entry.update(verdict="cannot tell", why="its pick's time to target overlaps the winner's", off_by=off)
            else:
                entry.update(verdict="wrong", off_by=off,
                             why="its pick never reached the target" if chosen["median"] == INF else
                             f"its pick took {off:.2f}× as long as the winner")
        out.append(entry)
    return out


def markdown(verdicts: list[dict[str, Any]]) -> str:
    head = ("| task | link | `phalanx bench` advice (projection) | measured winner | verdict | off by | why |\n"
            "|---|---|---|---|---|---|---|\n")
    lines = []
    for v in verdicts:
        off = v.get("off_by", math.nan)
        cell = "" if math.isnan(off) else "never reached" if off == INF else f"{off:.2f}×"
        lines.append(f"| {v['task']} | {v['link']} | {v.get('advice', '')} | {v.get('winner') or 'none'} | "
                     f"{v['verdict']} | {cell} | {v['why']} |")
    return head + "\n".join(lines) + "\n"
