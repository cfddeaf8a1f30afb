"""What the Trainer reports for an epoch: its history row and the words on the progress bar.

The row is built from one all-reduced vector of sums (loss, samples, seconds, bytes),
so every worker gets the same row. The bar's words are the running loss, a stream
loader's rate and lag, and under ``fit(elastic=...)`` the current world size, which
changes when a worker leaves or joins.

Example:
    >>> step_postfix(0.25, loader=None, world_size=3)
    {'loss': '0.2500', 'workers': '3'}
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from .metrics import Metric


def step_postfix(loss: float, loader: Any, world_size: int | None = None) -> dict[str, str]:
    """The bar's words after a step: the running loss, a stream's rate and lag, the world size when elastic."""
    out = {"loss": f"{loss:.4f}", **stream_postfix(loader)}
    if world_size is not None:
        out["workers"] = str(world_size)
    return out


def stream_postfix(loader: Any) -> dict[str, str]:
    """A stream loader's events/s, lag and acknowledged position for the progress bar (nothing for a dataset)."""
    if not hasattr(loader, "stats"):
        return {}
    s = loader.stats()
    return {"events/s": f"{s['events_per_s']:,.0f}", "lag": str(s["lag"]), "acked": str(s["acknowledged"])}


def epoch_row(epoch: int, totals: Sequence[float], train_metrics: Sequence[Metric], val_metrics: Sequence[Metric],
              *, steps: int, step: int, world_size: int, loader: Any) -> dict[str, Any]:
    """One history row from the epoch's all-reduced sums ``[loss_sum, count, samples, seconds, wall, bytes]``.

    Example:
        >>> row = epoch_row(0, [2.0, 4.0, 8.0, 2.0, 2.0, 100.0], [], [], steps=2, step=2, world_size=2, loader=None)
        >>> row["epoch"], row["loss"], row["samples_per_s"], row["bytes_sent"]
        (1, 0.5, 8.0, 50)
    """
    loss_sum, count, samples, seconds, wall, sent = totals
    row: dict[str, Any] = {"epoch": epoch + 1, "loss": loss_sum / count if count else math.nan}
    row.update({m.name: m.compute() for m in train_metrics})
    if val_metrics:
        row.update({f"val_{m.name}": m.compute() for m in val_metrics})
        row["val_samples"] = val_metrics[0].samples
    row.update({"samples_per_s": samples / (seconds / world_size) if seconds > 0 else math.nan,
                "bytes_sent": int(round(sent / world_size)), "steps": steps, "step": step,
                "time_s": wall / world_size})
    row.update(loader.stats() if hasattr(loader, "stats") else {})  # stream: events, events/s, lag, acknowledged
    return row


__all__ = ["epoch_row", "step_postfix", "stream_postfix"]
