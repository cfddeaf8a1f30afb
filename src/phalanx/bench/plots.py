"""PNG plots of a sweep: throughput against workers with the ideal line, efficiency, and the breakdown.

matplotlib runs headless (the Agg backend); each function writes one file and
returns its path, or None when the rows hold nothing to draw.
"""
from __future__ import annotations

import math
import os
from typing import Any

from .breakdown import LABELS, PHASES
from .report import row_label, setup_name

COLORS = {"data_s": "#9ecae1", "compute_s": "#3182bd", "comm_s": "#e6550d", "optimizer_s": "#31a354"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _ok(row: dict[str, Any]) -> bool:
    return bool(row["samples_per_s"]["n"]) and not math.isnan(row["samples_per_s"]["median"])


def throughput(rows: list[dict[str, Any]], path: str) -> str | None:
    """Samples/s against worker count per model, one line per setup and link, with the ideal N·thpt(1)."""
    plt = _plt()
    models = list(dict.fromkeys(r["model"] for r in rows if _ok(r)))
    if not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model and _ok(r) and r["kind"] != "plain"]
        one = {r["setup"]: r for r in mine if r["workers"] == 1}
        for setup in dict.fromkeys(r["setup"] for r in mine):
            for link in dict.fromkeys(r["link"] for r in mine if r["setup"] == setup and r["workers"] > 1):
                pts = sorted([r for r in mine if r["setup"] == setup and (r["link"] == link or r["workers"] == 1)],
                             key=lambda r: r["workers"])
                xs = [r["workers"] for r in pts]
                ys = [r["samples_per_s"]["median"] for r in pts]
                err = [[max(0.0, r["samples_per_s"]["median"] - r["samples_per_s"]["low"]) for r in pts],
                       [max(0.0, r["samples_per_s"]["high"] - r["samples_per_s"]["median"]) for r in pts]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"{setup} ({link})")
        for r in one.values():
            top = max(r2["workers"] for r2 in mine)
            base = r["samples_per_s"]["median"]
            ax.plot([1, top], [base, base * top], ls="--", color="grey", lw=0.8)
        plain = [r for r in rows if r["model"] == model and r["kind"] == "plain" and _ok(r)]
        for r in plain:
            ax.axhline(r["samples_per_s"]["median"], ls=":", lw=0.8, color="black")
            ax.annotate(f"plain 1 proc × {r['threads']} thr", (1, r["samples_per_s"]["median"]), fontsize=7,
                        xytext=(0, 2), textcoords="offset points", ha="left", va="bottom")
        ax.set_xticks(sorted({r["workers"] for r in mine}))
        ax.set_title(f"{model} (dashed: ideal N·thpt(1))")
        ax.set_xlabel("workers (processes)")
        ax.set_ylabel("samples/s (median; bars: 2.5–97.5 pct)")
        ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def efficiency_series(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, list[tuple[int, float]]]]]:
    """``series[model][panel][label]`` = [(N, efficiency)]: panel "processes" holds each setup on N processes
    × 1 thread (one line per link), panel "threads" the plain loop in 1 process × N threads; a thread row is
    never drawn in a process series."""
    out: dict[str, dict[str, dict[str, list[tuple[int, float]]]]] = {}
    ok = [r for r in rows if _ok(r) and not math.isnan(r["efficiency"])]
    for model in dict.fromkeys(r["model"] for r in ok):
        mine = [r for r in ok if r["model"] == model]
        procs: dict[str, list[tuple[int, float]]] = {}
        for r in mine:
            if r["kind"] == "plain" or r["threads"] != 1 or r["workers"] < 2:
                continue
            one = [(1, o["efficiency"]) for o in mine if o["setup"] == r["setup"] and o["workers"] == 1
                   and o["threads"] == 1]
            procs.setdefault(f"{setup_label(r)} ({r['link']})", one[:1]).append((r["workers"], r["efficiency"]))
        threads = {setup_label(r) + ", 1 process": [(t["threads"], t["efficiency"]) for t in mine
                                                   if t["kind"] == "plain" and t["workers"] == 1]
                   for r in mine if r["kind"] == "plain"}
        out[model] = {"processes": {k: sorted(v) for k, v in procs.items()},
                      "threads": {k: sorted(v) for k, v in threads.items()}}
    return out


def setup_label(row: dict[str, Any]) -> str:
    return setup_name(row)


def efficiency(rows: list[dict[str, Any]], path: str) -> str | None:
    """Scaling efficiency against N: per model, one panel for N processes, one for 1 process × N threads."""
    plt = _plt()
    series = efficiency_series(rows)
    series = {m: p for m, p in series.items() if any(len(v) > 1 for s in p.values() for v in s.values())}
    if not series:
        return None
    fig, axes = plt.subplots(len(series), 2, figsize=(11, 4 * len(series)), squeeze=False)
    for row_axes, (model, panels) in zip(axes, series.items(), strict=True):
        for ax, panel in zip(row_axes, ("processes", "threads"), strict=True):
            for label, pts in panels[panel].items():
                ax.plot([n for n, _ in pts], [100 * e for _, e in pts], marker="o", label=label)
            ax.axhline(100, ls="--", color="grey", lw=0.8)
            ax.axhline(90, ls=":", color="grey", lw=0.8)
            ns = sorted({n for pts in panels[panel].values() for n, _ in pts})
            if ns:
                ax.set_xscale("log", base=2)
                ax.set_xticks(ns, [str(n) for n in ns])
            ax.set_ylim(0, 110)
            ax.set_xlabel("worker processes (1 thread each)" if panel == "processes" else "threads in 1 process")
            ax.set_ylabel("efficiency = speedup / N (%)")
            ax.set_title(f"{model}: " + ("N processes × 1 thread" if panel == "processes" else "1 process × N threads"))
            if panels[panel]:
                ax.legend(fontsize=8, loc="lower left")
    return _save(fig, path)


def breakdown(rows: list[dict[str, Any]], path: str) -> str | None:
    """Stacked bars of the mean step time per worker, as shares; the label gives the mean step in ms."""
    plt = _plt()
    bars = [(r, rank, b) for r in rows if _ok(r) for rank, b in r.get("breakdown", {}).items()]
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(8, max(3, 0.28 * len(bars) + 1)))
    for i, (_, _, b) in enumerate(bars):
        left = 0.0
        total = sum(b[k] for k in PHASES) or 1.0
        for k in PHASES:
            share = 100 * b[k] / total
            ax.barh(i, share, left=left, color=COLORS[k], label=LABELS[k] if i == 0 else None)
            left += share
    ax.set_yticks(range(len(bars)), breakdown_labels(rows), fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("share of the step time (%)")
    ax.set_title("Where the time goes (mean step, per worker)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(PHASES))
    return _save(fig, path)


def breakdown_labels(rows: list[dict[str, Any]]) -> list[str]:
    """The breakdown plot's row labels: the breakdown table's own first columns, and the mean step."""
    return [f"{row_label(r, rank)} ({1e3 * b['step_s']:.0f} ms)"
            for r in rows if _ok(r) for rank, b in r.get("breakdown", {}).items()]


def all_plots(rows: list[dict[str, Any]], out_dir: str) -> list[str]:
    made = [throughput(rows, os.path.join(out_dir, "throughput.png")),
            efficiency(rows, os.path.join(out_dir, "efficiency.png")),
            breakdown(rows, os.path.join(out_dir, "breakdown.png"))]
    return [p for p in made if p]
