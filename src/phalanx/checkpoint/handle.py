"""A save in flight and how it ends: :class:`SaveHandle`, and the directory put in place all at once or not at all.

Every worker writes into ``<path>.tmp-<host>-<pid>-<id>``; once all of them are done,
rank 0 checks the directory is whole, writes its marker, and renames it over ``path``
(:func:`_commit`), so a save killed half-way never replaces the last good checkpoint. A
kill between the two renames of a replacement leaves the previous checkpoint beside it
as ``<path>.old-<id>``, which :func:`_resolve` finds. A failed write removes the
temporary directory and posts the error for the other workers (:func:`_abandon`).

Example:
    >>> _resolve("/nonexistent/ckpt")
    '/nonexistent/ckpt'
"""
from __future__ import annotations

import os
import shutil
import uuid
import warnings
import weakref
from concurrent.futures import Future
from typing import Any, Callable

from ..group import group
from ..errors import CheckpointError
from ..framing import MARKER
from .agreement import _file_error, _post_saved, _post_write, _wait_for_write
from .dcp import _dcp, _seal


class SaveHandle:
    """A checkpoint being written in the background (``px.save_checkpoint(..., blocking=False)``).

    ``done()`` says whether it is written (and renamed into place); ``wait()`` blocks until
    then and raises its error, if any. The next ``px.save_checkpoint`` and ``px.shutdown()``
    wait for it themselves (:meth:`finish`): they raise its error only if no ``wait()`` did, so a
    failure the caller handled does not fail the next save or the exit again.
    """

    def __init__(self, path: str, future: Future | None, key: str | None, rank: int,
                 pg: Any = None, generation: int = 0, store: Any = None) -> None:
        self.path, self.key, self.rank = path, key, rank
        # the store of the generation that saves: its keys count the saves afresh in each generation, so the outcome
        # of a save that ends after a regroup (rank 0's callback) must go where its own waiters look, never under the
        # same key in the next generation's store, where that generation's own save of the same number reads it
        self.store = store
        # reused by the next save of the same group generation. Weak: the group's own cache (Group.split) keeps it
        # for that generation, DCP holds it while an asynchronous save runs; a strong reference here kept the
        # previous generation's checkpoint group, and its sockets to every old peer, alive after a regroup until the
        # next save (and made the regroup's full collection find nothing to free: 0.16 s of every regroup).
        self._pg = None if pg is None else weakref.ref(pg)
        self.generation = generation
        self._future = future
        self._committed: Future = Future()  # rank 0: set once the directory is in place (or the save failed)
        self._error: BaseException | None = None
        self._ended = False  # its outcome is known (written, or _error): a wait() returned or raised it

    @property
    def pg(self) -> Any:
        """The checkpoint process group this save used, while it lives (None once its generation is gone)."""
        return None if self._pg is None else self._pg()

    def done(self) -> bool:
        """True once this worker's part is written (on rank 0: and the checkpoint renamed into place)."""
        if self._future is not None and not self._future.done():
            return False
        if self.rank == 0:
            return self._committed.done()
        return self.key is None or self.store is None or self.store.check([f"{self.key}/written"])

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is complete; raise a :class:`CheckpointError` if it could not be written.

        ``timeout``: at most this many seconds for this worker's write (``TimeoutError`` after), e.g. for a worker
        that is leaving because of an error and must not hang on a stalled disk.
        """
        if self._ended:
            if self._error is not None:
                raise self._error
            return
        try:
            if self._future is not None:
                try:
                    self._future.result(timeout)
                except TimeoutError:
                    raise
                except (Exception, _dcp().api.CheckpointException) as err:  # noqa: BLE001 - every rank's failure
                    if self.rank != 0:
                        raise _write_error(self.path, err) from err
            if self.rank == 0:
                self._committed.result(timeout)
            elif group.current().generation == self.generation:  # (a regrouped job has a new store: rank 0 wrote)
                _wait_for_write(self.key, self.store)
        except TimeoutError:
            raise  # not an outcome: the save goes on, and a later wait() waits for it again
        except Exception as err:
            self._error, self._ended = err, True
            raise
        self._ended = True

    def finish(self, timeout: float | None = None) -> None:
        """Wait for the save to end, as the next save and ``px.shutdown()`` do; raise its error once only.

        An error a ``wait()`` already raised was the caller's to handle: it is not raised again (the next
        save, perhaps to another disk, goes ahead). A save that a regroup interrupted (its generation of the
        group is gone with a lost peer) ends with a warning: the checkpoint at its path is the previous one.

        Example:
            >>> import torch, phalanx as px, tempfile, os
            >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
            >>> handle = px.save_checkpoint(path, torch.nn.Linear(2, 1), blocking=False)
            >>> handle.finish(); handle.done()
            True
        """
        if self._ended:
            return
        try:
            self.wait(timeout)
        except TimeoutError:
            raise
        except Exception as err:
            if not (group.is_initialized() and group.current().generation != self.generation):
                raise
            warnings.warn(f"the asynchronous checkpoint {self.path!r} of generation {self.generation} was not "
                          f"written: the group changed while it was ({str(err).splitlines()[0][:200]}); the "
                          "checkpoint at that path is the previous one.", stacklevel=2)

    def __repr__(self) -> str:
        return f"SaveHandle({self.path!r}, done={self.done()})"


def _finish(handle: SaveHandle, tmp: str, world: int, step: int, *, blocking: bool,
            commit: Callable[[str, str, int, int], None] | None = None) -> None:
    """Rank 0, once every worker's part is written: verify, mark complete, rename into place, tell the others.

    ``commit`` does the sealing and renaming (default :func:`_commit`, here; an asynchronous save's writer process).
    """
    if handle.rank != 0:
        _wait_for_write(handle.key, handle.store)
        return
    try:
        if handle._future is not None:
            try:
                handle._future.result()
            except (Exception, _dcp().api.CheckpointException) as err:  # noqa: BLE001
                raise _write_error(handle.path, err) from err
        (commit or _commit)(tmp, handle.path, world, step)
    except BaseException as err:
        _abandon(tmp, handle.key, err, handle.store)
        if blocking:
            raise
        handle._committed.set_exception(err)
        return
    _post_write(handle.key, "ok", handle.store)
    _post_saved(handle.path)
    if not handle._committed.done():
        handle._committed.set_result(None)


def _commit(tmp: str, path: str, world: int, step: int) -> None:
    """Check the temporary directory is whole, write the marker, and swap it in for ``path``."""
    _seal(tmp, path, world, step)
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{uuid.uuid4().hex[:8]}"
        os.replace(path, old)  # a kill between these two renames leaves the old one here: _resolve finds it
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))
    if old is not None:  # (``latest_checkpoint`` may be removing the same leftover: either may finish it)
        shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else _unlink(old)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _abandon(tmp: str, key: str | None, err: BaseException | None = None, store: Any = None) -> None:
    """Rank 0 after a failed write: remove the temporary directory and post the error for the others (in ``store``,
    the saving generation's)."""
    shutil.rmtree(tmp, ignore_errors=True)
    if err is not None:
        _post_write(key, f"{type(err).__name__}\n{err}", store)


def _write_error(path: str, err: BaseException) -> CheckpointError:
    """One line for a failed DCP write, naming the path, the rank and the OS error (a full disk)."""
    if isinstance(err, CheckpointError):
        return err
    failures = getattr(err, "failures", None) or {}  # DCP's CheckpointException: {rank: (exception, stack)}
    for rank, cause in sorted(failures.items()):
        cause = cause[0] if isinstance(cause, tuple) else cause
        os_error = cause
        while os_error is not None and not isinstance(os_error, OSError):
            os_error = os_error.__cause__ or os_error.__context__
        if isinstance(os_error, OSError) and os_error.errno is not None:
            return CheckpointError(_file_error(path, rank, os_error).args[0])
        first = next(iter(str(cause).strip().splitlines()), "")
        return CheckpointError(f"rank {rank} could not write the checkpoint {path!r}: {type(cause).__name__}: "
                               f"{first[:200]}. The previous checkpoint at that path is untouched (a full disk "
                               "shows this way too): free space or save elsewhere.")
    first = next(iter(str(err).strip().splitlines()), type(err).__name__)
    return CheckpointError(f"the checkpoint {path!r} could not be written: {first[:300]}. The previous "
                           "checkpoint at that path is untouched.")


def _fsync_dir(directory: str) -> None:
    """Make the renames in ``directory`` durable: a rename lasts a crash only once its directory is synced."""
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _resolve(path: str) -> str:
    """The checkpoint at ``path``; if a save was killed between its two renames, the previous one beside it."""
    if os.path.lexists(path):
        return path
    directory, base = os.path.split(os.path.abspath(path))
    olds = [os.path.join(directory, n) for n in (os.listdir(directory) if os.path.isdir(directory) else ())
            if n.startswith(f"{base}.old-") and os.path.exists(os.path.join(directory, n, MARKER))]
    return max(olds, key=os.path.getmtime) if olds else path
