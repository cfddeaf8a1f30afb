"""How the workers of one ``px.save_checkpoint`` agree, on the group's store, before and after DCP writes.

A save is collective, and a failure on one worker must reach every worker before any
of them enters DCP's collective write (where it would hang). So, under one key per call
(``phalanx-entry/save_checkpoint/<n>``):

1. every worker announces its entry (:func:`_all_enter`): one that waited
   :data:`ENTRY_WAIT_S` seconds for the others raises a ConfigError saying the call is
   collective, instead of hanging in the write;
2. rank 0 names the temporary directory (:func:`_agree_on_temporary`);
3. every worker posts whether its own file was written (:func:`_agree`): all raise the
   first failure;
4. rank 0 posts the outcome of the write and rename (:func:`_post_write`), which the
   others wait for (:func:`_wait_for_write`), and the newest checkpoint's path
   (:data:`LAST_SAVED_KEY`, read by the launcher).

With no store (a plain process) or one worker every step is local.

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

from ..group import group
from ..group.collectives import guarded
from ..errors import CheckpointError, ConfigError, usage

#: Seconds the first worker to enter ``save_checkpoint`` waits for the others before saying it is not collective.
#: Synchronous strategies bring workers there within moments of each other; under local strategies (LocalSGD,
#: DiLoCo) a slow worker can trail by up to one round of local steps: raise this if yours trail by more.
ENTRY_WAIT_S = 10.0

LAST_SAVED_KEY = "checkpoint/last"  # in the group's store: the newest px.save_checkpoint checkpoint (absolute path)


def _all_enter(what: str) -> str | None:
    """Every worker announces entry on the group's store; fail fast if some never come.

    ``save_checkpoint`` gathers every worker's state, so a call on rank 0 alone (the
    place ``torch.save`` had in a DDP script) would wait in the gather until the
    collective timeout and then look like a crash. Instead the workers meet on the
    store first: one that waited :data:`ENTRY_WAIT_S` seconds for the others raises a
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
    deadline = time.monotonic() + ENTRY_WAIT_S
    while count < world:
        if store.check([f"{key}/gave-up"]):
            raise ConfigError(store.get(f"{key}/gave-up").decode())
        if time.monotonic() > deadline:
            came = [r for r in range(world) if store.check([f"{key}/{r}"])]
            missing = [r for r in range(world) if r not in came]
            # Short, cause first: a peer stuck in its next collective quotes this line from our exit note.
            message = usage(f"px.{what} is collective but rank(s) {_ranks(missing)} did not call it within "
                            f"{ENTRY_WAIT_S:g} s of rank(s) {_ranks(came)}", "a call on every worker",
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
    with guarded("waiting for rank 0 to name the checkpoint's directory"):
        store.wait([f"{key}/tmp"])  # type: ignore[union-attr]
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
    with guarded(f"waiting for every worker's {what} of the checkpoint"):
        store.wait([f"{key}/{what}/{r}" for r in range(world)])
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


def _post_write(key: str | None, outcome: str) -> None:
    """Rank 0: post how its write and rename ended ("ok", or the error's type and message) for the others."""
    store = group.store()
    if key is not None and store is not None:
        store.set(f"{key}/written", outcome)


def _wait_for_write(key: str | None) -> None:
    """Wait for rank 0's write; raise its error here too."""
    store = group.store()
    if key is None or store is None:
        return
    with guarded("waiting for rank 0 to write the checkpoint"):
        store.wait([f"{key}/written"])
    outcome = store.get(f"{key}/written").decode()
    if outcome != "ok":
        kind, _, message = outcome.partition("\n")
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
