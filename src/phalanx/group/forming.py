"""Forming a process group that phalanx owns: on keys that name its generation, all or nothing.

torch's ``init_process_group`` and ``new_group`` name each group from a process-wide counter,
and the gloo rendezvous keys its addresses with that name. A call that fails (a peer died
while the group formed) advances the counter in the processes that tried and leaves no group
whose destruction would reset it; from then on those processes and a fresh one (a
replacement, a joiner) look for each other under different keys and never meet. So a group
that is rebuilt while the job runs (``phalanx run --elastic``) is formed here instead
(torchft builds its process groups the same way, directly on a ``PrefixStore`` per quorum):

1. the gloo backend is built directly on the store it is given (a ``PrefixStore`` naming the
   generation, or one subgroup of it) with the rank and size given: its keys depend on
   nothing else, so a failed attempt leaves nothing that a later one could trip on;
2. its rendezvous waits through :class:`Watched`, a store whose every wait is bounded and
   ends as soon as a member is known lost;
3. the members agree that the group formed (a compare-and-set verdict in the same store): a
   peer that connected to a member just before it died does not keep a group the others gave
   up on;
4. the backend is handed to torch through its public plugin API (``Backend.register_backend``,
   then ``init_process_group`` or ``new_group`` with that backend), so ``dist.*`` calls, DDP,
   FSDP2, ``DeviceMesh`` and DCP find it as the default group or a subgroup. That step is
   local: it talks to no peer and cannot fail because one died.

Every failure to form (a refused connection, a key that never came from a member known
dead, the job's timeout) is a :class:`~phalanx.errors.WorkerLostError`: a lost peer.

Example (a group of one: nobody to wait for):
    >>> import torch.distributed as dist
    >>> store = dist.HashStore()
    >>> backend = form(store, rank=0, world_size=1, timeout_s=5.0, lost=lambda: [])
    >>> backend.size(), store.get("form/verdict")
    (1, b'ok')
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist

from ..errors import WorkerLostError

BACKEND = "phalanx"  # the name torch knows phalanx's own groups by: dist.get_backend() under --elastic
POLL_S = 0.02
# How long gloo may take to connect ranks that all arrived (see form): milliseconds idle, a few seconds on a loaded
# 2-core machine; a rank that died after it arrived costs the others a few times this (gloo's constructor tries its
# connections again: 25.0 s measured, 5x), not the collective timeout.
CONNECT_S = 5.0
_prepared: list[Any] = []  # the backend the next init_process_group/new_group with BACKEND takes (one at a time)


class Watched(dist.Store):
    """``store`` for a group's rendezvous: every wait ends within ``deadline`` or as soon as a member is lost.

    gloo waits for each peer's address with the group's whole timeout, and knows nothing of
    who died; here a wait polls the keys and asks ``lost()`` (ranks known gone) in between.

    Example:
        >>> import torch.distributed as dist
        >>> watched = Watched(dist.HashStore(), lost=lambda: [1], deadline=time.monotonic() + 5)
        >>> watched.wait(["never"])
        Traceback (most recent call last):
        ...
        phalanx.errors.WorkerLostError: rank(s) [1] of the group being formed are gone (waiting for ['never'])
    """

    def __init__(self, store: dist.Store, lost: Callable[[], Sequence[int]], deadline: float) -> None:
        super().__init__()
        self.inner, self.lost, self.deadline = store, lost, deadline

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        until = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout.total_seconds())
        while not self.inner.check(keys):
            gone = list(self.lost())
            if gone:
                raise WorkerLostError(f"rank(s) {gone} of the group being formed are gone (waiting for {keys})",
                                      lost_ranks=gone)
            if time.monotonic() > until:
                raise WorkerLostError(f"the group did not form in time (waiting for {keys}): a peer is gone or hung")
            time.sleep(POLL_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.inner.get(key)

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        pass  # the deadline above bounds every wait


def form(store: dist.Store, rank: int, world_size: int, timeout_s: float, lost: Callable[[], Sequence[int]],
         op_timeout_s: float | None = None) -> Any:
    """Build ``rank``'s gloo backend of a group of ``world_size`` on ``store`` and agree with the others it formed.

    ``lost()`` names the ranks known gone (polled while waiting); the whole formation takes
    at most ``timeout_s``, and each collective on the group at most ``op_timeout_s`` (default:
    ``timeout_s``). Collective across the group's ranks. Returns the backend (a
    ``ProcessGroupGloo``); raises :class:`WorkerLostError` when the group did not form on
    every rank, on every rank alike.
    """
    deadline = time.monotonic() + timeout_s
    verdict = "form/verdict"
    try:
        # Everyone arrives first (a wait that watches the lost): gloo then connects ranks that are all inside its
        # constructor, which takes milliseconds, so its own wait for a connection can be short. A rank that dies
        # after publishing its address is waited for by gloo alone, who knows nothing of the lost: with the
        # collective timeout there, the others sat a whole minute in the constructor (the chaos soak's longest
        # stretch without a step); CONNECT_S bounds it, then the collective timeout is set for the group's life.
        store.set(f"form/arrived/{rank}", "1")
        Watched(store, lost, deadline).wait([f"form/arrived/{r}" for r in range(world_size)])
        backend = dist.ProcessGroupGloo(Watched(dist.PrefixStore("gloo", store), lost, deadline), rank, world_size,
                                        timedelta(seconds=min(timeout_s, CONNECT_S)))
        backend.set_timeout(timedelta(seconds=timeout_s if op_timeout_s is None else op_timeout_s))
    except Exception as err:  # noqa: BLE001 - refused, reset, timed out, or a member known lost: all one failure
        store.compare_set(verdict, "", "no")
        raise WorkerLostError(f"rank {rank} of {world_size} could not form the group: {_line(err)}",
                              lost_ranks=list(lost())) from err
    # All or nothing: a rank whose connections all succeeded may still be alone in that (another one's
    # connection to a member that died was refused). The first to know writes the verdict; everyone reads it.
    store.set(f"form/done/{rank}", "1")
    done = [f"form/done/{r}" for r in range(world_size)]
    while not store.check([verdict]):
        if store.check(done):
            store.compare_set(verdict, "", "ok")
        elif lost() or time.monotonic() > deadline:
            # re-read after the loss was seen: a member that said "done" before it died still formed
            store.compare_set(verdict, "", "ok" if store.check(done) else "no")
        else:
            time.sleep(POLL_S)
    if store.get(verdict) != b"ok":
        del backend  # its sockets close with it
        gone = list(lost())
        raise WorkerLostError(f"the group of {world_size} did not form on every rank"
                              + (f" (rank(s) {gone} are gone)" if gone else ""), lost_ranks=gone)
    return backend


def install(backend: Any, store: dist.Store, rank: int, world_size: int, timeout_s: float) -> Any:
    """Make ``backend`` (from :func:`form`) torch's default process group and return that group. Local.

    ``store`` is where torch keeps the keys of groups asked of it later (``dist.new_group`` with
    another backend, e.g. a checkpoint's gloo group); the backend itself already formed.
    """
    _register()
    _prepared.append(backend)
    try:
        dist.init_process_group(BACKEND, store=dist.PrefixStore("torch", store), rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    finally:
        _prepared.clear()
    return dist.group.WORLD


def register_subgroup(backend: Any, ranks: Sequence[int]) -> Any:
    """Register ``backend`` (from :func:`form`, over the global ``ranks``) as a torch subgroup; returns it. Local.

    Only the members call it (``use_local_synchronization``): nothing here waits for anyone.
    """
    _register()
    _prepared.append(backend)
    try:
        return dist.new_group(sorted(ranks), backend=BACKEND, use_local_synchronization=True)
    finally:
        _prepared.clear()


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    """torch's plugin hook: the backend :func:`install` prepared; for a group asked of torch itself
    (``dist.new_group()`` in a user's script under ``--elastic``), a gloo backend on torch's own keys."""
    if _prepared:
        return _prepared.pop()
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _register() -> None:
    if not hasattr(dist.Backend, BACKEND.upper()):  # once per process: torch refuses a second registration
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


def _line(err: BaseException) -> str:
    text = str(err).splitlines()[0][:200] if str(err) else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
