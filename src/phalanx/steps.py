"""The framework's step count, and the three moments a strategy is told about.

``px.wrap`` gives every strategy a :class:`StepClock`. The clock, not the strategy,
counts training steps, and it counts them identically on every rank:

* **One synchronising backward pass is one step.** A backward pass outside
  ``px.no_sync(model)`` ends the step's gradient; the strategy's ``after_backward(step)``
  runs then, inside ``backward()``, where gradient averaging belongs. For gradient
  accumulation, run every micro-batch but the last under ``px.no_sync(model)``, as
  with DDP's ``no_sync()``.
* **The step closes** at ``optimizer.step()`` (``after_step(step, taken=True)``), or, on a
  rank whose ``optimizer.step()`` was skipped (``torch.amp.GradScaler`` skips it when it
  finds inf or nan), just before the model's next forward pass, or at ``finish()`` /
  ``state_dict()`` when none comes (``after_step(step, taken=False)``). Either way every
  rank runs ``after_step`` for every step, in the same order, so the collectives of a
  periodic rule stay paired and no rank waits for a step its peer never announces.

A forward pass of the model between a synchronising backward and ``optimizer.step()``
therefore closes the step as skipped. Two-pass methods (SAM) count two steps per
iteration; every rank counts the same, so nothing desynchronises.

Example:
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(2, 1)
    >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    >>> for _ in range(3):
    ...     opt.zero_grad(); model(torch.ones(4, 2)).sum().backward(); opt.step()
    >>> px.strategy_of(opt).steps
    3
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from .backward import after_backward

if TYPE_CHECKING:
    from .strategies.base import Strategy


class StepClock:
    """Counts steps for one wrapped model/optimizer pair and calls the strategy's hooks."""

    def __init__(self) -> None:
        self.step = 0          # steps closed so far, identical on every rank
        self.pending = False   # a synchronising backward ended and its step is not closed yet
        self.strategy: Strategy | None = None
        self.module: nn.Module | None = None
        self._handles: list[Any] = []

    def bind(self, strategy: "Strategy", model: nn.Module, module: nn.Module,
             optimizer: torch.optim.Optimizer) -> None:
        """Called once by ``px.wrap``: hook the end of backward, the optimizer step and the next forward."""
        self.strategy, self.module = strategy, module
        self.backward = after_backward(strategy.params, self._backward_done)
        self._handles = [optimizer.register_step_post_hook(self._stepped),
                         model.register_forward_pre_hook(self._forward)]

    def syncing(self) -> bool:
        """False inside ``px.no_sync`` (or DDP's own ``no_sync()``): the backward pass only accumulates."""
        if getattr(self, "backward", None) is not None and self.backward.is_paused:
            return False
        return bool(getattr(self.module, "require_backward_grad_sync", True))  # DDP's public flag

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: no exchange, and the step does not end, until the context exits."""
        ddp_no_sync = getattr(self.module, "no_sync", None)
        with self.backward.paused(), (ddp_no_sync() if callable(ddp_no_sync) else contextlib.nullcontext()):
            yield

    # -- the three moments ----------------------------------------------------------------------------
    def _backward_done(self) -> None:
        if not self.syncing():
            return
        self.settle()  # two synchronising passes with no step and no forward between: the first step was skipped
        self.strategy.after_backward(self.step + 1)  # type: ignore[union-attr]
        self.pending = True

    def _stepped(self, *_: Any) -> None:
        self.pending = False
        self.step += 1
        self.strategy.after_step(self.step, True)  # type: ignore[union-attr]

    def _forward(self, *_: Any) -> None:
        self.settle()

    def settle(self) -> None:
        """Close a step this rank skipped (its ``optimizer.step()`` never ran); a no-op otherwise."""
        if self.pending:
            self.pending = False
            self.step += 1
            self.strategy.after_step(self.step, False)  # type: ignore[union-attr]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        if getattr(self, "backward", None) is not None:
            self.backward.remove()
