"""Accounting: the bytes a rule has sent, for the Trainer's history, trackers and the benchmark.

Every byte a rule sends goes through its :class:`~phalanx.group.collectives.Comm`, which counts
it (``comm.stats``). A rule that reports its traffic implements :class:`Accounted`; the
:class:`Accounting` mixin does so from the rule's ``comm`` (every built-in rule has it). Where a
rule does not, :func:`bytes_sent` reads 0.

Example:
    >>> import torch, phalanx as px
    >>> from phalanx.strategies.accounting import Accounted, bytes_sent
    >>> net = torch.nn.Linear(2, 1)
    >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    >>> isinstance(px.strategy_of(opt), Accounted), bytes_sent(px.strategy_of(opt))
    (True, 0)
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..group.collectives import Comm
from ..step.clock import StepClock


@runtime_checkable
class Accounted(Protocol):
    """A rule that reports the payload bytes it sent."""

    @property
    def bytes_sent(self) -> int: ...

    @property
    def bytes_per_step(self) -> float: ...


class Accounting:
    """:class:`Accounted` from the rule's ``comm`` and ``clock`` (mixed in before :class:`phalanx.Strategy`)."""

    comm: Comm
    clock: StepClock

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this worker has sent so far."""
        return self.comm.stats.bytes_sent

    @property
    def bytes_per_step(self) -> float:
        """Mean payload bytes sent per step since attach (the initial broadcast excluded)."""
        bytes0, steps0 = getattr(self, "_attach_mark", (0, 0))  # set by attach; (0, 0) before it
        return (self.comm.stats.bytes_sent - bytes0) / max(1, self.clock.step - steps0)


def bytes_sent(strategy: Any) -> int:
    """Payload bytes ``strategy`` has sent so far: 0 where it does not report them (or there is none).

    Example:
        >>> bytes_sent(None)
        0
    """
    return strategy.bytes_sent if isinstance(strategy, Accounted) else 0


__all__ = ["Accounted", "Accounting", "bytes_sent"]
