"""Speed targets, checked against the rows of a ``phalanx bench`` run: ``python -m benchmarks.targets bench.json``.

A target whose configurations were not in the sweep is simply not listed.

Example:
    >>> rows = [{"model": "mlp", "setup": "allreduce", "workers": 1, "threads": 1, "link": "loopback",
    ...          "vs_plain": 0.99, "vs_ddp": float("nan"), "efficiency": 1.0, "samples_per_s": {"median": 1.0}}]
    >>> [(t["name"], t["ok"]) for t in check(rows)]
    [('phalanx AllReduce, 1 worker >= 0.98x plain loop 1x1 (mlp)', True)]
"""
from __future__ import annotations

import math
from typing import Any


def _target(name: str, value: float, goal: float, fmt: str = ".3f") -> dict[str, Any]:
    return {"name": name, "value": value, "goal": goal, "ok": bool(value >= goal), "text": format(value, fmt)}


def check(rows: list[dict[str, Any]], tta_rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    find = {(r["model"], r["setup"], r["workers"], r["threads"], r["link"]): r for r in rows}
    for r in rows:
        if r["setup"] != "allreduce" or r["threads"] != 1:
            continue
        m = r["model"]
        if r["workers"] == 1 and not math.isnan(r["vs_plain"]):
            out.append(_target(f"phalanx AllReduce, 1 worker >= 0.98x plain loop 1x1 ({m})", r["vs_plain"], 0.98))
        if r["workers"] > 1 and not math.isnan(r["vs_ddp"]):
            out.append(_target(f"phalanx AllReduce, {r['workers']} workers >= 1.00x torch DDP ({m}, {r['link']})",
                               r["vs_ddp"], 1.0))
        if r["workers"] > 1 and m == "resnet20" and r["link"] == "loopback" and not math.isnan(r["efficiency"]):
            out.append(_target(f"ResNet-20 scaling efficiency >= 0.90 (phalanx AllReduce, {r['workers']} workers)",
                               r["efficiency"], 0.90))
    for (m, setup, n, t, link), r in find.items():
        base = find.get((m, "allreduce", n, t, link))
        if m == "mlp" and n > 1 and base and r.get("bytes_per_step"):
            goal = {"local-sgd": 8.0, "powersgd": 20.0}.get(setup)
            if goal:
                out.append(_target(f"MLP bytes/step fall >= {goal:.0f}x under {setup} ({link})",
                                   base["bytes_per_step"] / r["bytes_per_step"], goal, ".1f"))
        peer = find.get((m, "ddp-powersgd", n, t, link))
        if setup == "powersgd" and peer and n > 1:
            out.append(_target(f"phalanx PowerSGD >= torch DDP PowerSGD hook throughput ({m}, {link})",
                               r["samples_per_s"]["median"] / peer["samples_per_s"]["median"], 1.0))
    for link in dict.fromkeys(r["link"] for r in tta_rows or []):
        mine = [r for r in tta_rows or [] if r["link"] == link and r["kind"] == "phalanx" and r["vs_ddp"] > 0]
        if mine:
            best = max(mine, key=lambda r: r["vs_ddp"])
            out.append(_target(f"best phalanx setup reaches the target accuracy >= 3x sooner than DDP ({link}; "
                               f"{best['setup']})", best["vs_ddp"], 3.0, ".2f"))
    return out


def markdown(targets: list[dict[str, Any]]) -> str:
    if not targets:
        return "(none of the issues' target configurations were in this sweep)\n"
    return "".join(f"- {'met' if t['ok'] else '**missed**'}: {t['name']}: {t['text']}\n" for t in targets)


def main(argv: list[str] | None = None) -> int:
    """Print the targets met and missed by a ``phalanx bench`` run's ``bench.json``; exit 1 if any was missed."""
    import json
    import sys

    paths = sys.argv[1:] if argv is None else argv
    missed = 0
    for path in paths:
        with open(path) as f:
            payload = json.load(f)
        found = check(payload["rows"], payload.get("time_to_accuracy"))
        print(f"## Targets ({path})\n\n" + markdown(found))
        missed += sum(not t["ok"] for t in found)
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
