"""What the step layer asks of a rule beyond its hooks: two capabilities, each checked with ``isinstance``.

A rule (:class:`phalanx.Strategy`) implements these methods where it takes part; where it does not,
the functions here give the default (no weighting, replicas always agree).

Example:
    >>> import phalanx as px
    >>> from phalanx.step.protocols import ReplicasAgree, replicas_agree, weighs_gradients
    >>> isinstance(px.LocalSGD(every=4), ReplicasAgree), replicas_agree(px.LocalSGD(every=4), 3)
    (True, False)
    >>> weighs_gradients(px.Strategy(), 1), weighs_gradients(px.AllReduce(), 1)
    (False, True)
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class WeighsGradients(Protocol):
    """A rule that averages gradients over the workers at some steps.

    At those steps the step clock scales each backward pass's gradient by this worker's share of
    the batch (:mod:`phalanx.step.clock`); local steps keep their own mean gradient.
    """

    def weighs_gradients(self, step: int) -> bool: ...


@runtime_checkable
class ReplicasAgree(Protocol):
    """A rule whose replicas hold the same model only after some steps (periodic rules: their syncs).

    A commit, a deduplicated checkpoint or a preemption stop is taken only where it says so.
    """

    def replicas_agree(self, step: int) -> bool: ...


def weighs_gradients(strategy: Any, step: int) -> bool:
    """True where ``strategy`` averages step ``step``'s gradients (:class:`WeighsGradients`); False otherwise."""
    return isinstance(strategy, WeighsGradients) and strategy.weighs_gradients(step)


def replicas_agree(strategy: Any, step: int) -> bool:
    """True when after ``step`` every replica holds the same model: by :class:`ReplicasAgree`, else always
    (a synchronous rule agrees after every step)."""
    return strategy.replicas_agree(step) if isinstance(strategy, ReplicasAgree) else True


__all__ = ["ReplicasAgree", "WeighsGradients", "replicas_agree", "weighs_gradients"]
