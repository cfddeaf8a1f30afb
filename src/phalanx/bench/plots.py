"""PNG plots of a sweep: throughput against workers with the ideal line, efficiency, and the breakdown.

matplotlib runs headless (the Agg backend); each function writes one file and
returns its path, or None when the rows hold nothing to draw.
"""
from __future__ import annotations

import math
import os
from typing import Any

from .breakdown import LABELS, PHASES

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
                err = [1.96 * r["samples_per_s"]["std"] for r in pts]
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
        ax.set_ylabel("samples/s (median, ±1.96·std)")
        ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def efficiency(rows: list[dict[str, Any]], path: str) -> str | None:
    """Scaling efficiency of every multi-worker (and multi-thread) configuration, grouped by model."""
    plt = _plt()
    pts = [r for r in rows if _ok(r) and (r["workers"] > 1 or r["threads"] > 1) and not math.isnan(r["efficiency"])]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(pts) + 2), 4.5))
    labels = [f"{r['model']}\n{r['setup']} {r['workers']}×{r['threads']}\n{r['link'] if r['workers'] > 1 else ''}"
              for r in pts]
    colors = [f"C{list(dict.fromkeys(p['model'] for p in pts)).index(r['model'])}" for r in pts]
    bars = ax.bar(range(len(pts)), [100 * r["efficiency"] for r in pts], color=colors)
    ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.axhline(100, ls="--", color="grey", lw=0.8)
    ax.axhline(90, ls=":", color="grey", lw=0.8)
    ax.set_xticks(range(len(pts)), labels, fontsize=6, rotation=90)
    ax.set_ylabel("efficiency = speedup / N (%)")
    ax.set_title("Scaling efficiency (processes × threads)")
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
    ax.set_yticks(range(len(bars)), [f"{r['model']} {r['setup']} {r['workers']}×{r['threads']} {r['link']} "
                                     f"w{rank} ({1e3 * b['step_s']:.0f} ms)" for r, rank, b in bars], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("share of the step time (%)")
    ax.set_title("Where the time goes (mean step, per worker)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(PHASES))
    return _save(fig, path)


def all_plots(rows: list[dict[str, Any]], out_dir: str) -> list[str]:
    made = [throughput(rows, os.path.join(out_dir, "throughput.png")),
            efficiency(rows, os.path.join(out_dir, "efficiency.png")),
            breakdown(rows, os.path.join(out_dir, "breakdown.png"))]
    return [p for p in made if p]
