"""What ``phalanx.elastic`` asks of a rule across a membership change: two capabilities, checked with ``isinstance``.

A rule implements these where it keeps state that depends on the group, or on a consistent cut
of work done outside the workers; any other rule needs nothing (it is left alone). Where a commit
may be taken is the core's question (:class:`phalanx.step.protocols.ReplicasAgree`, also asked by
checkpoints and preemption), and so is what a joiner loads (:class:`phalanx.strategies.base.Joinable`,
asked by the training state it restores).

Example:
    >>> import phalanx as px
    >>> from phalanx.elastic.rule import CommitPoint, Regroupable
    >>> isinstance(px.EASGD(), Regroupable), isinstance(px.LocalSGD(), Regroupable), isinstance(px.EASGD(), CommitPoint)
    (True, False, False)
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Regroupable(Protocol):
    """A rule whose state depends on the group (a divisor, a per-rank buffer, an exchange in flight)."""

    def regroup(self) -> None:
        """Called on every member after the group was rebuilt with a new size, before training goes on.

        ``regroup`` has this one meaning, a rule's reaction; forming the new group is ``ElasticWorker.rebuild``.
        """


@runtime_checkable
class CommitPoint(Protocol):
    """A rule whose model lives partly outside the workers (asynchronous parameter servers)."""

    def commit_point(self) -> None:
        """Called on every rank just before and just after an elastic commit (collective where it waits): the
        commit is then one consistent cut."""


__all__ = ["CommitPoint", "Regroupable"]
