"""Where a training step's time goes: data wait, forward+backward, exposed communication, optimizer step.

:class:`StepProbe` timestamps a step from public torch hooks only, so it works on
any loop and any strategy without touching the loop itself:

* a forward pre-hook on the trained module (maybe a DDP wrapper) and on the user's
  module inside it: the gap between the two is DDP's pre-forward work (buffer
  broadcast), which is communication;
* a post-accumulate-grad hook on every parameter: the last one marks the end of
  backward *compute*;
* global optimizer-step pre/post hooks (they run before/after every per-optimizer
  hook, so the strategy's own hooks fall inside the window).

**Exposed communication** is communication the step waits for, not the part that
overlaps compute. For DDP-based all-reduce (phalanx ``AllReduce``, raw DDP, their
comm hooks) all-reduce of the early buckets overlaps the rest of backward; what
is exposed is the wait between the last gradient being ready and ``backward()``
returning (the reducer's finalisation), measured as last-grad → optimizer pre-hook.
We chose this over timing backward with and without ``no_sync`` on alternate steps
because it needs no second kind of step, works inside any user loop, and also
covers comm hooks (PowerSGD's compression then counts as communication). Strategies
that communicate around ``optimizer.step()`` (local SGD, DiLoCo, EASGD...) time their
collectives in :class:`phalanx.Comm`; that time is taken out of the optimizer phase.

Example:
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(4, 2); opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> probe = StepProbe(net, opt)
    >>> net(torch.randn(8, 4)).sum().backward(); opt.step()
    >>> sorted(probe.records[-1])
    ['comm_s', 'compute_s', 'data_s', 'optimizer_s', 'step_s']
    >>> probe.close()
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..train.callbacks import Callback
from ..wrap import strategy_of, unwrap

PHASES = ("data_s", "compute_s", "comm_s", "optimizer_s")
LABELS = {"data_s": "data wait", "compute_s": "forward+backward", "comm_s": "exposed comm",
          "optimizer_s": "optimizer step"}


class StepProbe:
    """Time the phases of each optimizer step of ``model``/``optimizer``; see the module docstring.

    ``records`` gets one dict per ``optimizer.step()``: the four phases plus ``step_s``,
    the time since the previous step ended (or since the first forward).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock, self.optimizer = clock, optimizer
        self.inner = unwrap(model)
        self.ddp = isinstance(model, DistributedDataParallel)
        strategy = strategy_of(optimizer)
        self._comm = getattr(getattr(strategy, "comm", None), "stats", None)
        self.records: list[dict[str, float]] = []
        self._prev_end: float | None = None
        self._reset()
        self._handles = [model.register_forward_pre_hook(self._on_forward)]
        if self.ddp:
            self._handles.append(self.inner.register_forward_pre_hook(self._on_inner_forward))
        for p in self.inner.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._handles.append(register_optimizer_step_pre_hook(self._on_step_pre))
        self._handles.append(register_optimizer_step_post_hook(self._on_step_post))

    def _reset(self) -> None:
        self._t_fwd = self._t_inner = self._t_grad = self._t_pre = None
        self._comm0 = 0.0

    def _on_forward(self, *_: Any) -> None:
        if torch.is_grad_enabled() and self._t_fwd is None:  # the first training forward of this step
            self._t_fwd = self.clock()
            if not self.ddp:
                self._t_inner = self._t_fwd

    def _on_inner_forward(self, *_: Any) -> None:
        if torch.is_grad_enabled() and self._t_inner is None:
            self._t_inner = self.clock()

    def _on_grad(self, _: torch.Tensor) -> None:
        self._t_grad = self.clock()

    def _comm_seconds(self) -> float:
        return self._comm.seconds if self._comm is not None else 0.0

    def _on_step_pre(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if optimizer is self.optimizer:
            self._t_pre = self.clock()
            self._comm0 = self._comm_seconds()

    def _on_step_post(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if optimizer is not self.optimizer or self._t_pre is None:
            return
        end = self.clock()
        pre = self._t_pre
        fwd = self._t_fwd if self._t_fwd is not None else pre
        inner = self._t_inner if self._t_inner is not None else fwd
        grad = self._t_grad if self._t_grad is not None else pre
        start = self._prev_end if self._prev_end is not None else fwd
        step_comm = self._comm_seconds() - self._comm0
        pre_forward, tail = inner - fwd, max(pre - grad, 0.0)
        comm = step_comm + (pre_forward + tail if self.ddp else 0.0)
        compute = (grad - inner) + (0.0 if self.ddp else pre_forward + tail)
        self.records.append({"data_s": max(fwd - start, 0.0), "compute_s": compute, "comm_s": comm,
                             "optimizer_s": max((end - pre) - step_comm, 0.0), "step_s": end - start})
        self._prev_end = end
        self._reset()

    def mark(self) -> None:
        """Start the data-wait clock now (e.g. at the top of the first step)."""
        self._prev_end = self.clock()

    def close(self) -> None:
        """Remove every hook; the model and optimizer behave as before."""
        for h in self._handles:
            h.remove()
        self._handles = []


def summarize(records: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each phase and of the step time over ``records`` (means add up; medians do not)."""
    if not records:
        return {}
    return {key: statistics.fmean(r[key] for r in records) for key in (*PHASES, "step_s")}


class StepBreakdown(Callback):
    """A :class:`phalanx.Trainer` callback: per-step phase times of this worker.

    ``records`` holds, per step, ``data_s`` (the Trainer's own data timing),
    ``compute_s``, ``comm_s``, ``optimizer_s`` and ``step_s`` (the Trainer's step
    time). ``summary()`` gives means per step after ``warmup_steps``.

    Example:
        >>> import phalanx as px
        >>> from phalanx.bench.breakdown import StepBreakdown
        >>> breakdown = StepBreakdown(warmup_steps=5)
        >>> # px.Trainer(model, opt, loss_fn, callbacks=[breakdown]).fit(data); breakdown.summary()
    """

    def __init__(self, warmup_steps: int = 5) -> None:
        self.warmup_steps = warmup_steps
        self.records: list[dict[str, float]] = []
        self.probe: StepProbe | None = None

    def on_train_begin(self, trainer: Any) -> None:
        self.probe = StepProbe(trainer.model, trainer.optimizer)

    def on_step_end(self, trainer: Any, step: int, logs: dict[str, float]) -> None:
        if self.probe is None or not self.probe.records:
            return
        r = self.probe.records.pop()
        self.probe.records.clear()
        # The Trainer times data loading itself (its batch is moved to the device before the forward).
        self.records.append({**r, "data_s": logs.get("data_s", r["data_s"]), "step_s": logs.get("step_s", r["step_s"])})

    def on_train_end(self, trainer: Any) -> None:
        if self.probe is not None:
            self.probe.close()
            self.probe = None

    def summary(self) -> dict[str, float]:
        """Mean phase times (seconds) per step after warm-up."""
        return summarize(self.records[self.warmup_steps:])
