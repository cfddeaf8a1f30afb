"""Progress output of the Trainer on the main worker: a bar on a terminal, plain lines elsewhere.

Carriage-return progress bars turn a CI log or a file into one very long line, so
when stdout is not a terminal the Trainer prints a whole line every 30 s and one
when each epoch ends.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable


def bar(total: int, desc: str) -> Any:
    """A progress bar on a terminal; periodic plain lines otherwise (CI logs, files: no carriage returns)."""
    if not sys.stdout.isatty():
        return PlainProgress(total, desc)
    from tqdm.auto import tqdm  # imported here: `import phalanx` stays cheap
    return tqdm(total=total, desc=desc, unit="step", leave=True, dynamic_ncols=True, mininterval=0.25,
                file=sys.stdout)


class PlainProgress:
    """What a progress bar says, as whole lines: one every ``every_s`` seconds and one when the epoch ends.

    Example:
        >>> bar = PlainProgress(total=4, desc="epoch 1/2")
        >>> bar.update(4); bar.set_postfix({"loss": "0.5000"}); bar.close()
        epoch 1/2: 4/4 steps, loss=0.5000
    """

    def __init__(self, total: int, desc: str, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.total, self.desc, self.every_s, self.clock = total, desc, every_s, clock
        self.n, self.postfix = 0, ""
        self._last = clock()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.clock() - self._last >= self.every_s:
            self._print()

    def set_postfix(self, values: dict[str, Any] | None = None, refresh: bool = False, **kwargs: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in {**(values or {}), **kwargs}.items())

    def close(self) -> None:
        self._print()

    def _print(self) -> None:
        self._last = self.clock()
        print(f"{self.desc}: {self.n}/{self.total} steps" + (f", {self.postfix}" if self.postfix else ""), flush=True)


def postfix(row: dict[str, Any]) -> dict[str, str]:
    keep = {k: v for k, v in row.items() if k in ("loss", "val_loss") or k.startswith("val_") and k != "val_samples"}
    out = {k: f"{v:.4f}" for k, v in keep.items()}
    if not math.isnan(row["samples_per_s"]):
        out["samples/s"] = f"{row['samples_per_s']:,.0f}"
    return out


__all__ = ["PlainProgress", "bar", "postfix"]
