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

**The batch weight travels with the step.** Gradient averaging takes the plain mean
of the workers' gradients; that is one process's gradient on the same samples only
when every worker holds as many samples. So each clock holds ``weight``, this
worker's share of the global batch its next backward pass computes on
(``n_i * world_size / total``: 1 on every even step, 0 for an empty part). The
loader sets it as it yields a batch, through :func:`set_batch_weight`, which reaches
the clocks of every model wrapped in the current group (:func:`clocks`: the
group, the one piece of module-level state, owns the registry; no other global is
involved). While a strategy averages gradients (:class:`~phalanx.step.protocols.WeighsGradients`),
the clock scales each backward pass's gradient by the weight *as it arrives*, before
it is accumulated into ``.grad`` (a tensor hook per parameter), so with gradient
accumulation every micro-batch counts by its own share, and an empty part (whose
mean loss is NaN) contributes exact zeros. The exchange then only sums and divides by
the world size. A rank's weight is its own; the others' are never needed.
(``torch.autograd.grad`` with respect to the parameters sees the same scaling on an
uneven step, as it passes through the same tensor hooks.)

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
import functools
import time
import weakref
from typing import Any, Callable, Iterator, Protocol

import torch
from torch import nn

from ..group import group
from ..group.records import Record
from ..group.stacks import PROGRESS, Progress
from . import preempt
from .protocols import WeighsGradients
from .backward import after_backward
from ..group.spans import Spans, span, step_closed

class StepHooks(Protocol):
    """What the clock calls on the rule it drives; :class:`phalanx.Strategy` is the one that implements it.

    The clock depends on these three members only (and on :class:`~phalanx.step.protocols.WeighsGradients`
    where the rule implements it), so the step count sits below the strategies."""

    params: list[torch.Tensor]

    def after_backward(self, step: int) -> None: ...

    def after_step(self, step: int, taken: bool) -> None: ...


class StepClock:
    """Counts steps for one wrapped model/optimizer pair and calls the strategy's hooks."""

    def __init__(self) -> None:
        self.step = 0          # steps closed so far, identical on every rank
        self.pending = False   # a synchronising backward ended and its step is not closed yet
        self.strategy: StepHooks | None = None
        self._weighs: Callable[[int], bool] | None = None  # the rule's weighs_gradients, where it has one
        self.module: nn.Module | None = None
        self.weight = 1.0      # this worker's share of the batch the next backward pass computes on
        self.step_weight = 1.0  # the weight of the step's synchronising backward pass (its share, for LocalSGD)
        self.reached: set[int] = set()  # ids of the parameters the current backward pass gave a gradient
        # Seconds this rank spent in its exchanges (from its last local gradient to the end of the averaging,
        # and in after_step): time spent waiting for peers, which px.shard(balance="speed") leaves out.
        self.waited = 0.0
        self._grad_at = 0.0
        self.spans = Spans()  # the timeline's forward+backward and optimizer spans (phalanx.step.profiling)
        self._handles: list[Any] = []
        self.preemption: preempt.Preemption | None = None
        self.progress = Progress()  # the group's, once bound: the step count the launcher's watchdog reads

    def bind(self, strategy: StepHooks, model: nn.Module, module: nn.Module,
             optimizer: torch.optim.Optimizer) -> None:
        """Called once by ``px.wrap``: hook the end of backward, the optimizer step and the next forward."""
        self.strategy, self.module = strategy, module
        # asked once here: an isinstance against a Protocol costs tens of microseconds, and _weigh runs per parameter
        self._weighs = strategy.weighs_gradients if isinstance(strategy, WeighsGradients) else None
        self.backward = after_backward(strategy.params, self._backward_done)
        self._handles = [optimizer.register_step_pre_hook(self._stepping),
                         optimizer.register_step_post_hook(self._stepped),
                         model.register_forward_pre_hook(self._forward),
                         *(p.register_hook(functools.partial(self._weigh, id(p)))
                           for p in strategy.params if p.requires_grad)]  # a sharded model's are its shards
        clocks().add(self)
        self.preemption = preempt.of()  # the step boundary is where a preemption signal is acted on
        self.progress = PROGRESS.of(group.current())
        self.preemption.clocks.add(self)

    def _weigh(self, key: int, grad: torch.Tensor) -> torch.Tensor | None:
        """Scale one backward pass's gradient of one parameter by this worker's batch weight, before accumulation."""
        self.reached.add(key)
        self._grad_at = time.perf_counter()
        w = self.weight
        if w == 1.0 or not self.weighs_gradients(self.step + 1):
            return None  # unchanged: a group of one, and every even step, stay plain PyTorch bit for bit
        return torch.zeros_like(grad) if w == 0 else grad * w  # an empty part's gradient may be NaN

    def weighs_gradients(self, step: int) -> bool:
        """True where the rule averages step ``step``'s gradients (:class:`~phalanx.step.protocols.WeighsGradients`),
        so each backward pass's gradient is scaled by this worker's batch weight; False before :meth:`bind`."""
        return self._weighs is not None and self._weighs(step)

    def syncing(self) -> bool:
        """False inside ``px.no_sync`` (or DDP's own ``no_sync()``): the backward pass only accumulates."""
        if getattr(self, "backward", None) is not None and self.backward.is_paused:
            return False
        return bool(getattr(self.module, "require_backward_grad_sync", True))  # DDP's public flag

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: no exchange, and the step does not end, until the context exits."""
        ddp_no_sync = getattr(self.module, "no_sync", None)
        with self.backward.paused(), (ddp_no_sync() if callable(ddp_no_sync) else _fsdp_no_sync(self.module)):
            yield

    # -- the three moments ----------------------------------------------------------------------------
    def _backward_done(self) -> None:
        if not self.syncing():
            return
        self.settle()  # two synchronising passes with no step and no forward between: the first step was skipped
        self.step_weight = self.weight
        try:
            with span("phalanx/exchange"):
                self.strategy.after_backward(self.step + 1)  # type: ignore[union-attr]
        finally:
            self.reached.clear()
            self.spans.end("phalanx/forward+backward")
        self.waited += time.perf_counter() - self._grad_at if self._grad_at else 0.0
        self.pending = True

    def _stepping(self, *_: Any) -> None:
        self.spans.begin("phalanx/optimizer step")

    def _stepped(self, *_: Any) -> None:
        self.spans.end("phalanx/optimizer step")
        self.pending = False
        self.step += 1
        self._after_step(True)

    def _after_step(self, taken: bool) -> None:
        start = time.perf_counter()
        with span("phalanx/exchange after step"):
            self.strategy.after_step(self.step, taken)  # type: ignore[union-attr]
        self.waited += time.perf_counter() - start
        self.spans.end("phalanx/forward+backward")  # a forward that no backward followed
        self._grad_at = 0.0
        step_closed(self.step)  # the timeline's window moves with the step (phalanx.step.profiling)
        self.progress.step = self.step
        self.preemption.at_boundary(self.step)

    def _forward(self, *_: Any) -> None:
        self.reached.clear()  # a new pass begins (with accumulation, only the synchronising one's count)
        self.settle()
        if torch.is_grad_enabled():
            self.spans.begin("phalanx/forward+backward")

    def restore(self, step: int) -> None:
        """Stand at ``step`` with no step open: where a loaded checkpoint or an elastic rollback resumes.

        Example:
            >>> clock = StepClock(); clock.restore(7); (clock.step, clock.pending)
            (7, False)
        """
        self.step, self.pending = int(step), False

    def settle(self) -> None:
        """Close a step this rank skipped (its ``optimizer.step()`` never ran); a no-op otherwise."""
        if self.pending:
            self.spans.end("phalanx/optimizer step")
            self.pending = False
            self.step += 1
            self._after_step(False)

    def remove(self) -> None:
        clocks().discard(self)
        if self.preemption is not None:
            self.preemption.clocks.discard(self)
        for h in self._handles:
            h.remove()
        if getattr(self, "backward", None) is not None:
            self.backward.remove()


@contextlib.contextmanager
def _fsdp_no_sync(module: Any) -> Iterator[None]:
    """FSDP2's public switch (a sharded model, phalanx.sharding): keep the unsharded gradients, reduce-scatter later."""
    switch = getattr(module, "set_requires_gradient_sync", None)
    if not callable(switch):
        yield
        return
    switch(False)
    try:
        yield
    finally:
        switch(True)


# The step clocks of the models px.wrap attached in a group: the loaders tell them each batch's weight. Weak, so a
# model dropped by the user is forgotten.
CLOCKS: "Record[weakref.WeakSet[StepClock]]" = Record("step clocks", weakref.WeakSet)


def clocks(g: group.Group | None = None) -> "weakref.WeakSet[StepClock]":
    """The step clocks of the models wrapped in group ``g`` (default: the current one).

    A plain process that never called px.init() has no lasting group, so this is empty
    there; its batches all weigh 1, so nothing is lost.
    """
    return CLOCKS.of(g if g is not None else group.current())


def set_batch_weight(weight: float) -> None:
    """This worker's share of the batch just handed out: ``n_i * world_size / total`` (1 when parts are equal).

    Called by the loaders (``px.shard``, ``phalanx.stream.StreamLoader``) as they yield a
    batch, and by your own loader if it splits global batches unevenly. It reaches the
    clock of every model wrapped in the current group; the next backward pass of each is
    weighted by it while its strategy averages gradients.

    Example:
        >>> import torch, phalanx as px
        >>> from phalanx.step.clock import set_batch_weight
        >>> net = torch.nn.Linear(2, 1)
        >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
        >>> set_batch_weight(1.0)
    """
    for clock in list(clocks()):
        clock.weight = float(weight)
