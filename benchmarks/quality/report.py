"""The quality benchmark's report: markdown tables, the headline targets, and quality-vs-time plots.

Example:
    >>> cell({"median": 12.0, "low": 10.0, "high": 15.0, "n": 3}, ".1f")
    '12.0 (10.0–15.0)'
    >>> cell({"median": float("inf"), "low": 9.0, "high": float("inf"), "n": 3}, ".1f")
    'not reached (best 9.0)'
"""
from __future__ import annotations

import math
import os
from typing import Any

from phalanx.bench.report import fmt_bytes
from .curves import INF, PEERS, paired, ratio, winner


def cell(s: dict[str, float], spec: str) -> str:
    if not s["n"] or math.isnan(s["median"]):
        return "n/a"
    if s["median"] == INF:
        return "not reached" + (f" (best {s['low']:{spec}})" if s["low"] < INF else "")
    return f"{s['median']:{spec}} ({s['low']:{spec}}–{s['high']:{spec}})" if s["n"] > 1 else f"{s['median']:{spec}}"


def table(rows: list[dict[str, Any]], task: str, link: str) -> str:
    mine = [r for r in rows if r["task"] == task and r["link"] == link]
    ddp = next((r for r in mine if r["setup"] == "ddp"), None)
    out = ["| setup | by | lr | time to target (s) | steps to target | reached | samples/s | "
           "final quality at budget | bytes/step counted | bytes/step on the wire | × sooner than DDP | "
           "time to target / compute-only bound |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(mine, key=lambda r: (r["time_to_target"]["median"], r["setup"])):
        if not r["ok"]:
            out.append(f"| {r['setup']} | {r['provider']} | {r['lr']:g} | failed: {r['errors'][0][:120]} |"
                       " | | | | | | | |")
            continue
        vs = ratio(ddp["time_to_target"], r["time_to_target"]) if ddp and ddp["ok"] else None
        vs_cell = "" if vs is None or math.isnan(vs["median"]) else (
            f"{vs['median']:.2f} ({vs['low']:.2f}–{vs['high']:.2f})" if vs["median"] < INF else
            f"> {r['budget_s'] / r['time_to_target']['median']:.2f} (DDP missed)")
        out.append(f"| {r['setup']} | {r['provider']} | {r['lr']:g} | {cell(r['time_to_target'], '.1f')} | "
                   f"{cell(r['steps_to_target'], '.0f')} | {r['reached']}/{r['runs']} | "
                   f"{cell(r['samples_per_s'], ',.0f')} | {cell(r['final'], '.3f')} | "
                   f"{fmt_bytes(r['bytes_per_step']['median'])} | {fmt_bytes(r['wire_bytes_per_step']['median'])} | "
                   f"{vs_cell} | {cell(r.get('vs_bound') or {'n': 0}, '.2f')} |")
    return "\n".join(out) + "\n"


def bound_line(bound: dict[str, Any] | None) -> str:
    """One sentence: the task's compute-only bound and where it comes from."""
    if not bound or bound.get("bound_s") is None:
        return "Compute-only bound: cannot tell (DDP did not reach the target on any link).\n\n"
    how = ("the step of two workers training side by side with no exchange (compute-only runs, median)"
           if bound.get("compute_source") == "side by side" else "one worker's compute step, measured alone")
    return (f"Compute-only bound: {bound['bound_s']:.1f} s = DDP's {bound['ddp_steps']:.0f} steps to target (the "
            f"fewest over the links) × {how}, {1e3 * bound['compute_s']:.0f} ms.\n\n")


def headline(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Best phalanx setup against DDP and against the best peer (torch or torchft), per task and link."""
    out = []
    for task, link in dict.fromkeys((r["task"], r["link"]) for r in rows):
        px_best, peer_best = winner(rows, task, link, "phalanx"), winner(rows, task, link, PEERS)
        ddp = next((r for r in rows if r["task"] == task and r["link"] == link and r["setup"] == "ddp"), None)
        entry: dict[str, Any] = {"task": task, "link": link, "best_phalanx": px_best and px_best["setup"],
                                 "best_peer": peer_best and peer_best["setup"]}
        if px_best and ddp:
            entry["vs_ddp"] = ratio(ddp["time_to_target"], px_best["time_to_target"])
            if entry["vs_ddp"]["median"] == INF:  # DDP missed within its budget: the budget gives a lower bound
                entry["vs_ddp"]["lower_bound"] = ddp["budget_s"] / px_best["time_to_target"]["median"]
        if px_best and peer_best:
            entry["vs_best_peer"] = ratio(peer_best["time_to_target"], px_best["time_to_target"])
            entry["paired_vs_best_peer"] = paired(peer_best, px_best)
        out.append(entry)
    return out


def _r(x: dict[str, float] | None) -> str:
    if not x or math.isnan(x["median"]):
        return "n/a (a side never reached the target)"
    if x["median"] == INF:
        if "lower_bound" in x:
            return f"> {x['lower_bound']:.2f}× (DDP did not reach the target within the budget)"
        return "∞ (the other side never reached the target)"
    return f"{x['median']:.2f}× (range {x['low']:.2f}–{x['high']:.2f})"


def _paired(x: dict[str, Any] | None) -> str:
    if not x or not x["n"]:
        return "n/a"
    return f"{_r(x)}, ahead in {x['ahead']} of {x['n']}"


def headline_table(entries: list[dict[str, Any]]) -> str:
    out = ["| task | link | best phalanx setup | vs torch DDP, time to target | best peer (torch, torchft) | "
           "best phalanx vs best peer | the same, repeat by repeat (same seed) |", "|---|---|---|---|---|---|---|"]
    for e in entries:
        out.append(f"| {e['task']} | {e['link']} | {e['best_phalanx'] or 'none reached'} | {_r(e.get('vs_ddp'))} | "
                   f"{e['best_peer'] or 'none reached'} | {_r(e.get('vs_best_peer'))} | "
                   f"{_paired(e.get('paired_vs_best_peer'))} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict[str, Any]], task: str, link: str, quality_name: str, out_dir: str) -> str | None:
    """Quality against training seconds, one line per setup (median repeat drawn; all repeats faint)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["task"] == task and r["link"] == link and r["curves"]]
    if not mine:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(sorted(mine, key=lambda r: r["setup"])):
        color, style = plt.cm.tab20(i % 20), "-" if r["provider"] == "phalanx" else "--"  # 13 setups: 20 colours
        for k, curve in enumerate(r["curves"]):
            xs, ys = [p[0] for p in curve], [p[2] for p in curve]
            ax.plot(xs, ys, style, color=color, alpha=1.0 if k == 0 else 0.3, lw=1.4 if k == 0 else 0.8,
                    label=f"{r['setup']} ({r['provider']})" if k == 0 else None)
    target = mine[0]["target"]
    ax.axhline(target, color="black", lw=0.8, ls=":", label=f"target {target:g}")
    ax.set_title(f"{task}: {quality_name} vs training time, 2 workers, {link} link (target {target:g})")
    ax.set_xlabel("training time, evaluation excluded (s)")
    ax.set_ylabel(quality_name)
    ax.legend(fontsize=7, ncol=2, loc="best", title="solid: phalanx, dashed: torch", title_fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out_dir, f"quality-{task}-{link}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
