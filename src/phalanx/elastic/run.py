"""``px.elastic.run`` and ``state.epochs``: re-enter the training after every membership change.

A lost peer, an admitted joiner or a graceful leave ends the current attempt (the training
function, or the epoch's ``with state:`` block); the group is rebuilt outside the except block
that caught it (:mod:`phalanx.elastic.recovery`) and the training is re-entered from the commit.
"""
from __future__ import annotations

import functools
import sys
import time
from typing import Any, Callable, Iterator, TypeVar

import torch.distributed as dist

from ..errors import ConfigError, PhalanxError, WorkerLostError, usage
from .membership import QuorumError

F = TypeVar("F", bound=Callable[..., Any])


class Reentry:
    """The re-entry half of ``px.elastic.State``: ``state.epochs(n)``, ``with state:``, ``state.supervise(fn)``.

    A mixin: its attributes (``_pending``, ``_in_epochs``, ``worker``, ...) are the state's.
    """

    def supervise(self, fn: Callable[["Reentry"], Any]) -> Any:
        """``fn(self)``, re-entered after every membership change: ``run(fn)(self)``, as the Trainer calls it."""
        return run(fn)(self)

    # -- a loop kept at module level: `for epoch in state.epochs(n): with state: ...` --------------------------
    def epochs(self, epochs: int) -> Iterator[int]:
        """The epochs to train, for a loop kept at module level; re-entered after a membership change.

        Replace ``for epoch in range(epochs):`` by ``for epoch in state.epochs(epochs):`` and put the
        epoch's body under ``with state:``. A lost peer or an admitted joiner ends that block; the
        group is rebuilt, every worker rolls back to the newest commit they all hold, and the loop
        goes on from the commit's epoch, mid-epoch (the loader keeps its position). Outside
        ``phalanx run --elastic`` this is ``range(epochs)``, and ``with state:`` does nothing.

        Example:
            >>> import torch, phalanx as px
            >>> net = torch.nn.Linear(2, 1)
            >>> net, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
            >>> state = px.elastic.State(net, opt)
            >>> for epoch in state.epochs(2):
            ...     with state:
            ...         opt.zero_grad(); net(torch.ones(1, 2)).sum().backward(); opt.step()
            >>> state.step
            2
        """
        return _epochs(self, epochs)

    def __enter__(self) -> "Reentry":
        self._attempting = self._in_epochs  # an epoch's attempt: the loop's state.commit() may end it
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        self._attempting = False
        if exc is None or not self._in_epochs:
            return False  # outside `for epoch in state.epochs(n)` nothing would re-enter the loop: let it end
        return _caught(self, exc)  # True: the epoch ends here; epochs() regroups and resumes at the commit


class MembershipChange(BaseException):
    """The group changes at this commit point: the attempt ends here, and ``@px.elastic.run`` (or
    ``state.epochs`` with ``with state:``) rebuilds the group and re-enters the training from the commit.

    Raised only at a commit point the loop shows: where a ``px.shard`` or ``px.stream`` loader hands out the
    next batch (the loop's ``for batch in loader``), or, with another loader (a ``DataLoader``, your own iterator),
    at the loop's ``state.commit()``, as Horovod raises from ``state.commit()``; never from inside
    ``optimizer.step()``. A
    ``BaseException``, as ``KeyboardInterrupt`` is, so a user's ``except Exception:`` around the step
    cannot swallow it; code that must clean up uses ``finally`` and lets it pass.

    Example:
        >>> import phalanx as px
        >>> try:
        ...     try:
        ...         raise px.elastic.JoinersAdmitted(["j1"])
        ...     except Exception:
        ...         pass  # never reached: a user's handler does not swallow it
        ... except px.elastic.MembershipChange as change:
        ...     print(change.joiners)
        ['j1']
    """


class JoinersAdmitted(MembershipChange):
    """Joiners (``phalanx join``, ``--replace``) were admitted at this commit: the group grows here.

    ``joiners``: their worker ids. Nothing is redone: the members send them the commit just taken.
    """

    def __init__(self, joiners: list[str]) -> None:
        super().__init__(f"admitting {joiners}")
        self.joiners = joiners


class WorkersLeaving(MembershipChange):
    """Workers leave gracefully at this commit (a drained node: SIGTERM): the others regroup here.

    ``leavers``: their worker ids. Nothing is redone: the others roll back to this very commit.
    """

    def __init__(self, leavers: list[str]) -> None:
        super().__init__(f"{', '.join(leavers)} leaving")
        self.leavers = leavers


_Resize, _Leave = JoinersAdmitted, WorkersLeaving  # their private names before they were public, for one release


def is_peer_failure(err: BaseException) -> bool:
    """A failure a rebuilt group can survive: a peer died or stopped answering. Told by type, never by message.

    Every collective and store wait raises :class:`~phalanx.WorkerLostError` through
    :func:`phalanx.group.guard.guarded`; torch's own distributed errors count too, for a collective
    a user's code ran outside phalanx.
    """
    return isinstance(err, (WorkerLostError, dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError))


# -- re-entering the training after a membership change: one machinery for both forms ------------------------------

def _begin(state: Reentry) -> bool:
    """Before the first attempt: a joiner waits to be admitted; the start is a commit every worker holds.

    False when a joiner arrives after training ended (nothing to do).
    """
    if state.elastic and state.worker.joining and not state.join():
        return False
    if not state.commits:
        state._commit_together()
    return True


def _caught(state: Reentry, err: BaseException) -> bool:
    """Note what ended an attempt, to act on outside the except block; False: not ours, re-raise it."""
    if isinstance(err, JoinersAdmitted):
        state._pending = ("joiners", err.joiners)
        return True
    if isinstance(err, WorkersLeaving):
        state._pending = ("failure", f"worker(s) {', '.join(err.leavers)} left (preempted)", time.time())
        return True
    if not isinstance(err, Exception) or not state.elastic:
        return False
    where = state.worker.address  # before asking: the heartbeat thread may fail over meanwhile
    if not state.worker.host_alive():
        if not state.worker.fail_over(where):
            state.worker.lost_host()
        # the job's store was lost and its standby took over: the survivors regroup there, whatever failed here
        state._pending = ("failure", f"the job's store at {state.worker.primary} was lost", time.time())
        return True
    if not is_peer_failure(err) and not _peer_died_under(state, err):
        return False
    state._pending = ("failure", f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                      time.time())
    return True


def _peer_died_under(state: Reentry, err: BaseException, poll_s: float = 0.05) -> bool:
    """A plain ``RuntimeError`` from a collective torch ran outside phalanx (FSDP's all-gather and reduce-scatter,
    a ``dist.*`` call of the script): gloo says a peer closed its connection with no type of its own. It is a lost
    peer when a member of this generation is marked dead (``dead/<id>``: the launcher marks a lost process at once)
    within the heartbeat timeout; a script's own error, with everyone alive, is re-raised after that wait.
    A typed phalanx failure (a ``PhalanxError``) is never reclassified here.

    Example (outside an elastic job nothing is reclassified):
        >>> callable(_peer_died_under)
        True
    """
    if not isinstance(err, RuntimeError) or isinstance(err, PhalanxError):
        return False
    worker = state.worker
    others = [m for m in worker.membership.members if m != worker.me]
    deadline = time.monotonic() + float(worker.config["heartbeat_s"])
    while True:
        if any(worker.membership.is_dead(m) for m in others):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)  # sleep: the launcher's mark comes with no notification; bounded by the heartbeat


def _change(state: Reentry) -> None:
    """Grow with the admitted joiners, or regroup after a loss and roll back; again if a peer is lost meanwhile.

    Runs outside the except block that caught the failure: a live exception keeps the dead group's
    tensors (and the collectives other ranks are blocked in) alive. A peer lost while the group is
    being rebuilt (rank 0 killed inside the commit or the regroup) is one more failure of the same
    kind: the survivors regroup again and roll back to the newest commit they all hold.
    """
    while state._pending is not None:
        pending, state._pending = state._pending, None
        try:
            if pending[0] == "joiners":
                state.grow(pending[1])
            else:
                state.recover(pending[1], pending[2])
        except QuorumError as err:
            print(f"phalanx: elastic: worker {state.worker.me}: {err}; stopping", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except Exception as err:  # noqa: BLE001 - a lost peer is noted by _caught; anything else is raised
            if not _caught(state, err):
                where = state.worker.address
                if not state.worker.host_alive() and not state.worker.fail_over(where):
                    state.worker.lost_host()
                raise


def _end(state: Reentry) -> None:
    for handle in state._handles:
        handle.remove()
    state._handles = []
    if state.elastic:
        state.worker.finished()


def run(fn: F) -> F:
    """Decorate the training function ``fn(state, ...)``: it is re-entered after every membership change.

    Start your loops from the state (``for epoch in range(state.epoch, epochs)``): after a
    rollback the loader resumes mid-epoch where the commit left it. To keep the loop at
    module level instead, see :meth:`State.epochs`.
    """
    @functools.wraps(fn)
    def wrapper(state: Reentry, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, Reentry):
            raise ConfigError(usage(f"{fn.__name__}({type(state).__name__}, ...)",
                                    "a px.elastic.State as the first argument",
                                    "Build state = px.elastic.State(model, opt, loader) and call "
                                    f"{fn.__name__}(state)."))
        if not _begin(state):
            return None  # training ended before we got in: nothing to do
        while True:
            state._attempting = True  # the loop's state.commit() is a commit point while fn runs
            try:
                result = fn(state, *args, **kwargs)
            except BaseException as err:  # noqa: BLE001 - _caught keeps a lost peer and a resize; the rest is raised
                state._attempting = False
                if not _caught(state, err):
                    raise
            else:
                state._attempting = False
                _end(state)
                return result
            _change(state)
    return wrapper  # type: ignore[return-value]


def _epochs(state: Reentry, epochs: int) -> Iterator[int]:
    if not _begin(state):
        return  # training ended before we got in
    state._in_epochs = True
    try:
        epoch = state.epoch
        while epoch < epochs:
            yield epoch
            if state._pending is not None:  # `with state:` ended the epoch early: regroup, resume at the commit
                _change(state)
                epoch = state.epoch
            else:
                epoch += 1
    finally:
        state._in_epochs = False
    _end(state)
