"""The demos' summary table (the main demo, ``--keras`` and ``--stream`` print the same one)."""
from __future__ import annotations

import math
from typing import Any

MIN_ACCURACY = 0.95


def table(rows: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table (it reads well in a terminal and pastes into docs).

    Example:
        >>> print(table([{"workers": 1, "test_accuracy": 0.98, "samples_per_s": 1000.0},
        ...              {"workers": 2, "test_accuracy": 0.97, "samples_per_s": 1800.0}]))
        | workers | test accuracy | samples/s | speedup | efficiency |
        |--------:|--------------:|----------:|--------:|-----------:|
        |       1 |         0.980 |     1,000 |   1.00x |       100% |
        |       2 |         0.970 |     1,800 |   1.80x |        90% |
    """
    head = ["workers", "test accuracy", "samples/s", "speedup", "efficiency"]
    base = next((r["samples_per_s"] for r in rows if r["workers"] == 1), rows[0]["samples_per_s"])
    body = []
    for r in rows:
        speedup = r["samples_per_s"] / base
        if math.isfinite(speedup):  # a run shorter than the warm-up has no rate
            rate, gain, eff = f"{r['samples_per_s']:,.0f}", f"{speedup:.2f}x", f"{speedup / r['workers']:.0%}"
        else:
            rate, gain, eff = "n/a", "n/a", "n/a"
        body.append([str(r["workers"]), f"{r['test_accuracy']:.3f}", rate, gain, eff])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["| " + " | ".join(h.rjust(w) for h, w in zip(head, widths)) + " |",
             "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(b, widths)) + " |" for b in body]
    return "\n".join(lines)

