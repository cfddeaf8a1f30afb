"""Where the seconds of a chaos soak's longest stretches without a step went: every worker's events inside each.

    python benchmarks/chaos_gaps.py OUT            # OUT: a benchmarks/chaos.py --out folder
    python benchmarks/chaos_gaps.py OUT --top 5

For each of the ``--top`` longest stretches between two steps (any worker's), it prints the kills inside it and
every worker's events (regroup+/-, grow+/-, join+/-, ckpt+/-, commit+/-, start, init) with their offset from the
stretch's start, then a breakdown: detection (the kill to the first ``regroup+``), the regroup itself (``regroup+``
to ``regroup-``, of the slowest survivor), checkpoint writes inside the stretch, a replacement's start-up (``start``
to ``join+``) and the join (``join+`` to ``join-``), grows, and the parts of each (``part`` events of 50 ms or
more: quorum, forming, rollback, state sent, shards moved, a reload from disk, the resumed commit's write).
"""
from __future__ import annotations

import argparse
import glob
import json
import os


def load(out: str) -> tuple[list[dict], list[dict]]:
    events = []
    for path in glob.glob(os.path.join(out, "events", "*.jsonl")):
        with open(path) as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    pass  # a line cut by the kill
    events.sort(key=lambda e: e["t"])
    kills = []
    report = os.path.join(out, "chaos.json")
    if os.path.exists(report):
        with open(report) as f:
            kills = json.load(f).get("kill_log") or []
    return events, kills


def spans(events: list[dict], a: float, b: float, begin: str, end: str) -> list[tuple[str, float, float]]:
    """(worker, start, end) of each ``begin``..``end`` pair of one worker overlapping [a, b]."""
    out, open_ = [], {}
    for e in events:
        if e["ev"] == begin:
            open_[e["id"]] = e["t"]
        elif e["ev"] == end and e["id"] in open_:
            s = open_.pop(e["id"])
            if e["t"] >= a and s <= b:
                out.append((e["id"], s, e["t"]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--top", type=int, default=3)
    a = p.parse_args(argv)
    events, kills = load(a.out)
    steps = [e["t"] for e in events if e["ev"] == "step"]
    gaps = sorted(((b - s, s, b) for s, b in zip(steps, steps[1:])), reverse=True)[:a.top]
    for length, s, b in gaps:
        print(f"== stretch of {length:.2f} s without a step")
        for e in events:
            if s <= e["t"] <= b and e["ev"] not in ("held", "part"):
                extra = {k: v for k, v in e.items() if k not in ("t", "id", "pid", "ev")}
                print(f"  +{e['t'] - s:7.2f}  {e['id']:>4} {e['ev']:<10} {extra}")
        for k in kills:
            if s <= k.get("t", 0) <= b:
                print(f"  +{k['t'] - s:7.2f}  KILL {k}")
        for name, (bg, en) in {"regroup": ("regroup+", "regroup-"), "grow": ("grow+", "grow-"),
                               "join": ("join+", "join-"), "ckpt": ("ckpt+", "ckpt-"),
                               "commit": ("commit+", "commit-")}.items():
            for wid, x, y in spans(events, s, b, bg, en):
                print(f"  {name:<8} {wid:>4}: {x - s:+7.2f} .. {y - s:+7.2f}  ({y - x:.2f} s)")
        # the parts of a regroup, grow or join (tests/workers/chaos_job.py's "part" events), each worker's
        for e in events:
            if e["ev"] == "part" and e["t"] >= s and e["began"] <= b and e["s"] >= 0.05:
                print(f"  part {e['name']:<13} {e['id']:>4}: {e['began'] - s:+7.2f} .. {e['t'] - s:+7.2f}  "
                      f"({e['s']:.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
