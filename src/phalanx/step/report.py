"""Where a worker's steps went, for ``phalanx run --link``: step time, and the part spent waiting on the exchange.

The step clock already counts the seconds a rank waits on its exchanges (``clock.waited``: from its last
local gradient to the end of the averaging, and in the exchange after the optimizer step). A
:class:`StepReport` samples it, with the wall clock, after each optimizer step, and at exit writes
``DIR/rank{r}.json``: the steps after ``skip`` warm-up steps, their mean wall time and mean waiting.
``phalanx run --link`` sets ``PHALANX_STEP_REPORT=DIR`` (read once into
:class:`~phalanx.group.env.WorkerEnv`) and ``px.wrap`` starts one for the model it wraps.

Example:
    >>> import tempfile, torch, phalanx as px
    >>> net = torch.nn.Linear(2, 1)
    >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    >>> report = StepReport(tempfile.mkdtemp(), px.strategy_of(opt).clock, opt, rank=0, skip=1)
    >>> for _ in range(3):
    ...     opt.zero_grad(); model(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> summary = report.summary(); summary["steps"], summary["wait_s"] >= 0
    (2, True)
"""
from __future__ import annotations

import atexit
import json
import os
import time
from typing import Any

import torch

from .clock import StepClock


class StepReport:
    """Samples one clock after every optimizer step; writes its summary at :meth:`write` (at exit by default)."""

    def __init__(self, directory: str, clock: StepClock, optimizer: torch.optim.Optimizer, *, rank: int,
                 skip: int = 2) -> None:
        self.path = os.path.join(directory, f"rank{rank}.json")
        self.clock, self.skip = clock, skip
        self.first: tuple[int, float, float] | None = None  # (step, wall, waited) at the end of the warm-up
        self.last: tuple[int, float, float] | None = None
        self.total = 0  # optimizer steps seen, warm-up included
        # registered after the clock's own post-hook: the exchange after the step is inside the sample
        self._handle = optimizer.register_step_post_hook(self._sample)
        atexit.register(self.write)

    def _sample(self, *_: Any) -> None:
        self.total += 1
        now = (self.clock.step, time.perf_counter(), self.clock.waited)
        if self.total == max(self.skip, 1):
            self.first = now
        self.last = now

    def summary(self) -> dict[str, Any]:
        """``steps`` timed (after the warm-up), their mean ``step_s`` and ``wait_s``; ``total`` steps in all."""
        out: dict[str, Any] = {"total": self.clock.step, "steps": 0, "step_s": None, "wait_s": None}
        if self.first is not None and self.last is not None and self.last[0] > self.first[0]:
            n = self.last[0] - self.first[0]
            out.update(steps=n, step_s=(self.last[1] - self.first[1]) / n, wait_s=(self.last[2] - self.first[2]) / n)
        return out

    def write(self) -> None:
        """Write ``rank{r}.json`` (replacing an earlier one: a temporary file, then a rename)."""
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self.summary(), f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # the launcher's directory is gone (it was stopped): nobody is left to read the report


__all__ = ["StepReport"]
