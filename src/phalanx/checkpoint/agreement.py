"""How the workers of one ``px.save_checkpoint`` agree, on the group's store, before and after DCP writes.

A save is collective, and a failure on one worker must reach every worker before any
of them enters DCP's collective write (where it would hang). So, under one key per call
(``phalanx-entry/save_checkpoint/<n>``):

1. every worker announces its entry (:func:`_all_enter`): one that waited
   the group's timeout (:data:`ENTRY_WAIT_S`) for the others raises a ConfigError saying the call is
   collective, instead of hanging in the write;
2. rank 0 names the temporary directory (:func:`_agree_on_temporary`);
3. every worker posts whether its own file was written (:func:`_agree`): all raise the
   first failure;
4. rank 0 posts the outcome of the write and rename (:func:`_post_write`), which the
   others wait for (:func:`_wait_for_write`), and the newest checkpoint's path
   (:data:`LAST_SAVED_KEY`, read by the launcher).

With no store (a plain process) or one worker every step is local.

Every wait here is bounded by the group's timeout and consults who is known dead
(:func:`_wait_keys`): a peer that left an exit note (its own, or the one the elastic
launcher writes for a killed worker) or whose heartbeat stopped ends the wait at once
with a :class:`~phalanx.WorkerLostError`, the type ``phalanx.elastic`` regroups on. A
failure of DCP's own collectives is told the same way (:func:`peer_lost`): by the
liveness of the peers and the error's type, never by its message.

Example:
    >>> _ranks([0, 2])
    '0, 2'
"""
from __future__ import annotations

import errno
import os
import shutil
import socket
import time
import uuid
from typing import Callable, Mapping

import torch.distributed as dist

from ..group import group, liveness
from ..group.guard import guarded, lost_ranks
from ..errors import CheckpointError, ConfigError, StoreLostError, WorkerLostError, usage

#: Seconds the first worker to enter ``save_checkpoint`` waits for the others before saying it is not collective;
#: None (the default): the group's timeout (``phalanx run --timeout``, 60 s), the time any collective of the group
#: may wait for a peer. A fixed few seconds took a peer that was only slow (a loaded machine, a worker of a local
#: strategy trailing by a round of local steps) for a call on some workers only, and ended an elastic job with a
#: ConfigError (the chaos soak, under load 45-57, after 57 minutes): a slow peer is not a misuse.
ENTRY_WAIT_S: float | None = None

LAST_SAVED_KEY = "checkpoint/last"  # in the group's store: the newest px.save_checkpoint checkpoint (absolute path)

POLL_S = 0.02  # how often a wait looks at the store for the keys it waits on
LIVENESS_EVERY_S = 0.25  # how often it asks who is known dead (one store round trip per rank)


class _Dead:
    """Who of the ranks a wait depends on is known gone: an exit note other than "ok", or a stopped heartbeat."""

    def __init__(self) -> None:
        g = group.current()
        self.me = g.rank
        self.watch = None if g.probe is None else liveness.Watch(g.probe, g.world_size)
        self.next = 0.0

    def among(self, ranks: Callable[[], list[int]]) -> list[int]:
        """The ranks of ``ranks()`` known gone now (asked at most every :data:`LIVENESS_EVERY_S`)."""
        now = time.monotonic()
        if self.watch is None or now < self.next:
            return []
        self.next = now + LIVENESS_EVERY_S
        waiting = ranks()
        if not waiting:
            return []
        gone = set(group.current().lost_peers())
        self.watch.poll()
        gone |= set(self.watch.stale())
        return sorted(r for r in waiting if r in gone and r != self.me)


def _lost(what: str, lost: list[int], why: str) -> WorkerLostError:
    return WorkerLostError(f"rank {group.rank()} lost rank(s) {_ranks(lost)} {why} while {what}; the save is "
                           "abandoned and the previous checkpoint at that path is untouched", lost_ranks=lost)


def _wait_keys(keys: Mapping[int, str], what: str, store: dist.Store | None = None) -> None:
    """Wait until every rank's key in ``keys`` ({rank: key}) is in the group's store; bounded, dead-aware.

    Ends at once with a :class:`WorkerLostError` naming a rank it waits on that is known gone
    (exit note, stopped heartbeat), and after the group's timeout with one naming those still
    missing: never the store's own full timeout for a peer that is already dead.
    """
    store, g = store if store is not None else group.store(), group.current()
    deadline, dead = time.monotonic() + g.timeout_s, _Dead()
    with guarded(what):  # the store itself gone: StoreLostError
        while True:
            missing = [r for r, k in keys.items() if not store.check([k])]  # type: ignore[union-attr]
            if not missing:
                return
            lost = dead.among(lambda m=missing: m)
            if lost:
                raise _lost(what, lost, "(it exited or its heartbeat stopped)")
            if time.monotonic() > deadline:
                raise _lost(what, missing, f"(no answer within the group's timeout of {g.timeout_s:g}s)")
            time.sleep(POLL_S)


def peer_lost(err: BaseException, what: str) -> WorkerLostError | None:
    """After DCP's save failed on this worker: a :class:`WorkerLostError` if a peer was lost, else None.

    Told by the peers' liveness (exit notes and heartbeats, at most about
    :data:`~phalanx.group.liveness.STALE_AFTER_S`) and by type (torch's distributed errors anywhere in
    the cause chain or among DCP's per-rank failures), never by the message: a full disk, with every
    peer alive, stays a :class:`CheckpointError`.

    Example:
        >>> peer_lost(OSError(28, "No space left on device"), "writing") is None   # a plain process
        True
    """
    if not group.is_initialized() or group.world_size() == 1:
        return None
    lost = lost_ranks()
    if lost is None and group.current().probe is not None:
        return StoreLostError(f"rank {group.rank()} lost the group's store while {what}", lost_ranks=[])
    if lost:
        return _lost(what, lost, "(it exited or its heartbeat stopped)")
    if any(isinstance(e, (dist.DistError, WorkerLostError)) for e in _causes(err)):
        return WorkerLostError(f"rank {group.rank()} lost contact with a peer while {what}", lost_ranks=[])
    return None


def _causes(err: BaseException) -> list[BaseException]:
    """``err``, its causes and contexts, and the per-rank failures DCP's CheckpointException carries."""
    out: list[BaseException] = []
    todo = [err]
    while todo and len(out) < 64:
        e = todo.pop()
        if e is None or any(e is o for o in out):
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__]  # type: ignore[list-item]
        for f in (getattr(e, "failures", None) or {}).values():
            todo.append(f[0] if isinstance(f, tuple) else f)
    return [e for e in out if isinstance(e, BaseException)]


def _all_enter(what: str) -> str | None:
    """Every worker announces entry on the group's store; fail fast if some never come.

    ``save_checkpoint`` gathers every worker's state, so a call on rank 0 alone (the
    place ``torch.save`` had in a DDP script) would wait in the gather until the
    collective timeout and then look like a crash. Instead the workers meet on the
    store first: one that waited the group's timeout (:data:`ENTRY_WAIT_S`) for the others raises a
    ConfigError saying the call is collective, and posts it, so a worker arriving
    later raises the same at once.
    """
    store, world, me = group.store(), group.world_size(), group.rank()
    if store is None or world == 1:
        return None
    # This rank's call count, kept in the store: a regrouped job (elastic: a new store prefix) counts afresh.
    key = f"phalanx-entry/{what}/{store.add(f'phalanx-entry/{what}/calls/{me}', 1)}"
    store.set(f"{key}/{me}", "1")
    count = store.add(f"{key}/count", 1)
    patience = group.current().timeout_s if ENTRY_WAIT_S is None else ENTRY_WAIT_S
    deadline, dead = time.monotonic() + patience, _Dead()
    while count < world:
        if store.check([f"{key}/gave-up"]):
            raise ConfigError(store.get(f"{key}/gave-up").decode())
        # a peer known dead never comes: a lost peer (the elastic job regroups), not a call on some workers only
        lost = dead.among(lambda: [r for r in range(world) if not store.check([f"{key}/{r}"])])
        if lost:
            raise _lost(f"waiting for every worker to enter px.{what}", lost, "(it exited or its heartbeat stopped)")
        if time.monotonic() > deadline:
            came = [r for r in range(world) if store.check([f"{key}/{r}"])]
            missing = [r for r in range(world) if r not in came]
            # Short, cause first: a peer stuck in its next collective quotes this line from our exit note.
            message = usage(f"px.{what} is collective but rank(s) {_ranks(missing)} did not call it within "
                            f"{patience:g} s of rank(s) {_ranks(came)}", "a call on every worker",
                            "Call it on every worker, not under `if rank == 0:` "
                            "(px.save is the main-worker-only save).")
            store.set(f"{key}/gave-up", message)
            raise ConfigError(message)
        time.sleep(0.02)
        count = store.add(f"{key}/count", 0)
    return key


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _agree_on_temporary(path: str, key: str | None) -> str:
    """Rank 0 names the temporary directory (unique, with its host and pid) and removes abandoned ones."""
    store = group.store()
    if group.rank() == 0:
        _remove_abandoned(path)
        tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if key is not None and store is not None:
            store.set(f"{key}/tmp", tmp)
        return tmp
    _wait_keys({0: f"{key}/tmp"}, "waiting for rank 0 to name the checkpoint's directory")
    return store.get(f"{key}/tmp").decode()  # type: ignore[union-attr]


def _remove_abandoned(path: str) -> None:
    """Temporary directories of ``path`` left by saves on this host whose process is gone (killed mid-write)."""
    directory, base = os.path.split(path)
    prefix = f"{base}.tmp-{socket.gethostname()}-"
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        if name.startswith(prefix):
            pid = name[len(prefix):].split("-")[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _agree(what: str, key: str | None, failure: BaseException | None, path: str, tmp: str) -> None:
    """Every worker posts whether its step succeeded; all raise the first failure (none enters DCP's collective)."""
    store, world, me = group.store(), group.world_size(), group.rank()
    if key is None or store is None or world == 1:
        if failure is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _file_error(path, me, failure) from failure
        return
    mine = None if failure is None else _file_error(path, me, failure)
    store.set(f"{key}/{what}/{me}", "" if mine is None else f"{type(mine).__name__}: {mine}")
    _wait_keys({r: f"{key}/{what}/{r}" for r in range(world)}, f"waiting for every worker's {what} of the checkpoint")
    for r in range(world):
        outcome = store.get(f"{key}/{what}/{r}").decode()
        if outcome:
            if me == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            kind, _, message = outcome.partition(": ")
            raise (ConfigError if kind == "ConfigError" else CheckpointError)(message)


def _file_error(path: str, rank: int, err: BaseException) -> BaseException:
    """A worker's failure to write its own file, in one line naming the path, the rank and the OS error."""
    cause = err.__cause__ if isinstance(err, CheckpointError) and isinstance(err.__cause__, OSError) else err
    if isinstance(cause, OSError) and cause.errno is not None:
        return CheckpointError(f"rank {rank} could not write the checkpoint {path!r}: {os.strerror(cause.errno)} "
                               f"({errno.errorcode.get(cause.errno, cause.errno)}); expected room for every "
                               "worker's part. The previous checkpoint at that path is untouched: free space or "
                               "save elsewhere.")
    return err


def _post_write(key: str | None, outcome: str, store: dist.Store | None) -> None:
    """Rank 0: post how its write and rename ended ("ok", or the error's type and message) for the others.

    ``store``: the store of the generation that saved (:class:`~phalanx.checkpoint.handle.SaveHandle` keeps it), not
    the group's store of now: an asynchronous save can end after a regroup, and the next generation numbers its saves
    afresh. A store gone with its generation takes nothing: nobody waits there any more.
    """
    if key is not None and store is not None:
        try:
            store.set(f"{key}/written", outcome)
        except dist.DistError:
            if group.is_initialized() and group.store() is store:
                raise  # the store of the living group: its waiters must hear of it (StoreLostError upstream)


def _wait_for_write(key: str | None, store: dist.Store | None) -> None:
    """Wait for rank 0's write in ``store`` (the saving generation's); raise its error here too."""
    if key is None or store is None:
        return
    _wait_keys({0: f"{key}/written"}, "waiting for rank 0 to write the checkpoint", store)
    outcome = store.get(f"{key}/written").decode()
    if outcome != "ok":
        kind, _, message = outcome.partition("\n")
        if kind in (WorkerLostError.__name__, StoreLostError.__name__):  # a lost peer for rank 0 is one for all
            raise WorkerLostError(f"rank {group.rank()}: rank 0 abandoned the checkpoint's write: {message}")
        raise (ConfigError if kind == "ConfigError" else CheckpointError)(
            f"rank 0 could not write the checkpoint: {message}")


def _post_saved(path: str | os.PathLike) -> None:
    """Leave the newest checkpoint's path in the group's store: a launcher whose job ends names it."""
    store = group.store()
    if store is not None:
        try:
            store.set(LAST_SAVED_KEY, os.path.abspath(os.fspath(path)))
        except Exception:  # noqa: BLE001 - only a hint for the launcher's last line; the file is written
            pass
