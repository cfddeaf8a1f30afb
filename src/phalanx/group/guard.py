"""The guard on every collective and store wait: a failure, or a wait on a peer known gone, is a typed loss.

:func:`guarded` turns whatever torch raises inside a collective or a store wait into one
:class:`~phalanx.errors.WorkerLostError` naming the lost ranks (read from the heartbeats);
:func:`wait_watched` (and :class:`InFlight`, a collective started with ``async_op=True``) waits for a
collective in flight and ends as soon as a peer is known gone, without waiting for gloo's own bound.
It is apart from :mod:`.liveness`, a leaf that knows no group, and from :mod:`.collectives`, which uses it.

Example:
    >>> with guarded("nothing"):
    ...     pass
    >>> wait_watched(None, "nothing in flight")   # a group of one: nothing to wait for
"""
from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Iterator

import torch

from . import group, liveness
from ..errors import StoreLostError, WorkerLostError


def lost_ranks(timeout_s: float = liveness.STALE_AFTER_S) -> list[int] | None:
    """After a failed collective: the ranks that are no longer running (None: the store does not answer).

    Never names a rank whose heartbeat still advances. Blocks at most about ``timeout_s``.
    """
    g = group.current()
    if g.probe is None:
        return None
    seen = liveness.survey(g.probe, g.world_size, timeout_s, me=g.rank)
    return None if seen is None else seen.lost


@contextlib.contextmanager
def guarded(what: str) -> Iterator[None]:
    """Turn a failure inside a collective or a store wait into one :class:`WorkerLostError` naming the lost ranks.

    Whatever torch raises there (a gloo socket error, NCCL's ``DistBackendError``, a store's
    ``DistStoreError`` or timeout) is a failure of the group, so it is re-raised as that one
    type with ``lost_ranks`` read from the heartbeats; :class:`StoreLostError` when the store
    itself no longer answers. Errors of other types (a bad argument) pass through as they are.

    Example:
        >>> with guarded("nothing"):
        ...     pass
    """
    try:
        yield
    except RuntimeError as err:  # torch's distributed errors (DistBackendError, DistStoreError...) derive from it
        if isinstance(err, WorkerLostError):
            raise
        g = group.current()
        me = g.rank
        seen = None if g.probe is None else liveness.survey(g.probe, g.world_size, liveness.STALE_AFTER_S, me=me)
        lost = [] if seen is None else liveness.culprits(seen, me)  # the ranks the message blames
        g.losses = lost
        kind = StoreLostError if seen is None and g.probe is not None else WorkerLostError
        raise kind(
            f"rank {me} lost contact with {liveness.describe(seen, me)} during {what} "
            f"(timeout {g.timeout_s:.0f}s): {str(err).splitlines()[0][:200] if str(err) else type(err).__name__}. "
            "See that rank's own log for its error. If it was only slow, raise the bound with "
            "PHALANX_TIMEOUT or px.init(timeout=...).", lost_ranks=lost,
        ) from err


#: How often a wait on a collective in flight asks who is known gone (exit notes: one store round trip per rank).
#: gloo fails a collective when a peer's socket closes, but not always: the chaos soak's 60-minute run saw one
#: survivor of a SIGKILLed peer wait out the group's whole timeout (60 s) in a gradient all-reduce, once in 240
#: kills, while the other survivor had failed at once and left for the regroup.
WATCH_EVERY_S = 0.5


def wait_watched(work: Any, what: str) -> None:
    """Wait for the collective ``work`` (``async_op=True``'s handle); end as soon as a peer is known gone.

    Bounded by the collective's own timeout, as a plain ``work.wait()``, and every
    :data:`WATCH_EVERY_S` it asks the group who left a failure note (a worker the elastic
    launcher saw killed has one at once): then it raises :class:`WorkerLostError` without waiting
    for gloo, which leaves the collective behind (the regroup destroys its group). A failure of
    the collective itself is raised as :func:`guarded` raises it. A fast collective costs one
    wait with a timeout, no store call.

    Example:
        >>> import torch, torch.distributed as dist
        >>> wait_watched(None, "nothing in flight")   # a group of one: nothing to wait for
    """
    if work is None:
        return
    g = group.current()
    every = timedelta(seconds=WATCH_EVERY_S)
    with guarded(what):
        while True:
            try:
                work.wait(every)
                return
            except RuntimeError:
                if work.is_completed():  # the collective failed: guarded() says who was lost
                    raise
            if not g.lost_peers():  # only our own bound passed: go on unless a peer is known gone
                continue
            notes = {r: why for r, why in liveness.exit_records(g.probe, g.world_size).items() if r != g.rank}
            seen = liveness.Liveness(alive=[r for r in range(g.world_size) if r not in notes], exited=notes)
            g.losses = liveness.culprits(seen, g.rank)
            raise WorkerLostError(f"rank {g.rank} lost contact with {liveness.describe(seen, g.rank)} during {what} "
                                  "(it left a note; gloo had not failed the collective yet)", lost_ranks=g.losses)


class InFlight:
    """A collective started with ``async_op=True``: :meth:`wait` is :func:`wait_watched`, then its result.

    Example:
        >>> InFlight(None, torch.futures.Future(), "nothing").future.done()
        False
    """

    def __init__(self, work: Any, future: torch.futures.Future, what: str) -> None:
        self.work, self.future, self.what = work, future, what

    def wait(self, what: str | None = None) -> Any:
        """Wait as :func:`wait_watched` (a loss is named as during ``what``, default the collective's), then return
        the future's value."""
        wait_watched(self.work, what or self.what)
        return self.future.wait()

    def then(self, fn: Any) -> torch.futures.Future:
        """The future's ``then``: ``fn`` runs when the collective completes (its waiter is not watched)."""
        return self.future.then(fn)

    def done(self) -> bool:
        return self.future.done()


__all__ = ["InFlight", "WATCH_EVERY_S", "guarded", "lost_ranks", "wait_watched"]
