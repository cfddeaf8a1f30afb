"""The end of backward: one callback per backward pass, after every ``.grad`` is accumulated.

Strategies that average gradients do it here, as DDP does, so that user code between
``loss.backward()`` and ``optimizer.step()`` (``clip_grad_norm_``, ``GradScaler.unscale_``
and its inf check) sees the average rather than this worker's local gradient.

How: every parameter gets a public ``Tensor.register_post_accumulate_grad_hook``. The
first one to fire in a backward pass queues ``callback`` on the autograd engine; the
engine runs it once, when the pass is over (after DDP's own end-of-backward work), so
parameters that get no gradient in a pass, ``retain_graph=True`` and several backward
passes per step all work: each ``backward()`` call ends with exactly one callback. (A pass that reaches no parameter
at all, such as ``torch.autograd.grad`` on inputs, runs none.)

Gradient accumulation is the caller's choice: while :meth:`AfterBackward.paused` is
entered the callback is skipped (DDP's ``no_sync()``); ``px.no_sync(model)`` uses it.

Example:
    >>> import torch
    >>> from phalanx.step.backward import after_backward
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> handle = after_backward([w], lambda: print("grad", w.grad.tolist()))
    >>> (w * 3).sum().backward()
    grad [3.0, 3.0]
    >>> with handle.paused():
    ...     (w * 3).sum().backward()   # accumulated, no callback
    >>> (w * 3).sum().backward()
    grad [9.0, 9.0]
    >>> handle.remove()
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

import torch

from . import _engine


class AfterBackward:
    """Handle returned by :func:`after_backward`: ``remove()`` it, or ``paused()`` it for accumulation."""

    def __init__(self, params: Iterable[torch.Tensor], callback: Callable[[], None]) -> None:
        self.callback = callback
        self._queued = False  # one callback per pass, however many parameters fire
        self._paused = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params if p.requires_grad]

    def _on_grad(self, _param: torch.Tensor) -> None:
        if not self._queued and not self._paused:
            self._queued = True
            _engine.queue_callback(self._last)

    def _last(self) -> None:
        # Queued again from the queue, it runs after every callback queued during the pass:
        # DDP's reducer queues its own end-of-backward work (waiting for its last buckets) then.
        _engine.queue_callback(self._fire)

    def _fire(self) -> None:
        self._queued = False  # first: a callback that raises must not silence the next pass
        self.callback()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without calling back (DDP's ``no_sync``)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def is_paused(self) -> bool:
        return self._paused > 0

    def remove(self) -> None:
        """Stop calling back (the hooks are removed from every parameter)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def after_backward(params: Iterable[torch.Tensor], callback: Callable[[], None]) -> AfterBackward:
    """Call ``callback()`` once at the end of every backward pass that reaches ``params``.

    It runs inside ``backward()``, after every parameter's ``.grad`` is accumulated and
    before ``backward()`` returns; an exception it raises comes out of ``backward()``.

    Example:
        >>> import torch
        >>> a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
        >>> calls = []
        >>> h = after_backward([a, b], lambda: calls.append((a.grad.item(), b.grad)))
        >>> (2 * a).sum().backward()     # b gets no gradient in this pass
        >>> calls
        [(2.0, None)]
    """
    return AfterBackward(params, callback)


__all__ = ["AfterBackward", "after_backward"]
