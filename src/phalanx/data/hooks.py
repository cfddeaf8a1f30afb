"""The commit point a loader offers: hooks called each time it is about to hand out a batch.

``px.shard``'s loader and ``px.stream.StreamLoader`` both offer it; ``px.elastic.State`` commits
there and decides who joins or leaves, between two steps the user's loop shows.

Example:
    >>> points = BeforeBatch()
    >>> handle = points.before_batch(lambda: print("between two steps"))
    >>> points.run_before_batch()
    between two steps
    >>> handle.remove(); points.run_before_batch()
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from torch.utils.hooks import RemovableHandle


class BeforeBatch:
    """A loader's ``before_batch`` hooks (a base class: the loader calls :meth:`run_before_batch`)."""

    def __init__(self) -> None:
        self._before_batch: OrderedDict[int, Callable[[], None]] = OrderedDict()  # RemovableHandle: weakref-able

    def before_batch(self, hook: Callable[[], None]) -> RemovableHandle:
        """Call ``hook()`` each time a batch is about to be handed out, before the position moves past it.

        The step before is then over on every rank, whether its ``optimizer.step()`` ran or was
        skipped: ``px.elastic`` commits here. Returns a handle whose ``remove()`` undoes it.
        """
        handle = RemovableHandle(self._before_batch)
        self._before_batch[handle.id] = hook
        return handle

    def run_before_batch(self) -> None:
        """Call every hook, in the order they were added (the loader's own iteration does, at the same point on
        every rank)."""
        for hook in list(self._before_batch.values()):
            hook()
