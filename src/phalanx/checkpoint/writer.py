"""The checkpoint writer: a process of the worker's own that writes an asynchronous save's files.

``px.save_checkpoint(..., blocking=False)`` blocks training only while it snapshots the state's
tensors (:meth:`WriterProcess.stage`) into shared memory (a region kept and reused by the next save):
the parameters and the optimizer's state are copied beside training until its next step, the rest
in the call (:mod:`phalanx.checkpoint.staging`).
With :data:`FORK` set it forks the worker instead (:class:`.snapshot.Snapshot`, copy-on-write: the call
costs the page tables, training then the page faults of its first writes) and the child copies its frozen
view; where a fork cannot freeze a tensor (a CUDA process; shared memory; strided views:
:func:`.snapshot._forkable`) the call copies it. Everything else of the write runs beside training:

* DCP itself (its plans, its collectives among the workers, rank 0's ``.metadata``) runs in a
  thread of the worker, through :func:`torch.distributed.checkpoint.async_save`, as before; its
  ``write_data`` (serialising every tensor, writing and syncing the files) crosses to the writer
  process, which reads the staged tensors from the shared region;
* rank 0's seal and rename (:func:`phalanx.checkpoint.handle._commit`: the SHA-256 of every byte,
  the marker written last, the directory renamed into place) runs in the writer process too.

Why a process: a thread shares the interpreter (its GIL) and the cores with training, and the
seal reads back and hashes every byte. The writer runs with one torch thread at the worker's own
CPU priority (:data:`NICE`; at the lowest, 19, a write on busy cores was starved until the next
wait). It never touches a GPU (``CUDA_VISIBLE_DEVICES`` is empty).

The process's own loop, and the messages both halves exchange, are in :mod:`.writer_child`.

Its lifetime is its worker's:

* one is started at the worker's first asynchronous save and serves every later one;
* it ends with its worker (it waits on a pidfd of the worker, whichever way the worker ends);
* at a regroup, a write in flight is killed at once with its writer (its save is abandoned with
  the old generation, whose collectives are gone; the next save starts another writer); a commit
  in flight (a whole checkpoint being put in place) is let finish; an idle writer serves the next
  generation, as the worker does;
* when the group is left (``px.shutdown()``, at exit) it ends after the last save.

A writer (or a snapshot's child) killed half-way loses only the checkpoint in flight: its worker's wait raises a
:class:`~phalanx.errors.CheckpointError` naming the signal, rank 0 removes the temporary directory
(or, if rank 0's worker was killed too, the next save or load of that path does), the previous
checkpoint at the path is untouched, and the next save starts another writer.

Example:
    >>> _describe(-9)
    'was killed by signal 9 (SIGKILL)'
"""
from __future__ import annotations

import functools
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

import torch

from ..group import group
from ..group.records import Record, Slot
from .dcp import _dcp
from .snapshot import Snapshot, WriterGone, _can_fork, _describe, _forkable
from .staging import Fences, Region, StateCopy
from .writer_child import receive, send

# The writer's CPU priority (added to the worker's). 0: at 19, the lowest, a write on cores that training (or anyone
# else) keeps busy was starved and deferred whole to the next save's or the exit's wait, longer than a synchronous
# save (benchmarks/reports/checkpoint_blocking.md); at the worker's own it shares the cores and is done in the steps.
NICE = 0
# Whether an asynchronous save snapshots the state by fork where it can (:class:`Snapshot`); False (the default): the
# call copies everything into the shared region itself. Side by side (benchmarks/checkpoint_blocking.py, idle, a worker
# training on one core) both block about as long, and the fork's page faults cost training 1.8-3.7x the copy's total:
# every step writes every parameter and moment, so each page of the state is copied once more, one fault at a time.
FORK = False
_CHILD = "import sys; from phalanx.checkpoint.writer_child import serve; serve(*map(int, sys.argv[1:4]))"


class WriterProcess:
    """One worker's writer process, the shared region its saves are staged in, and the channel to it.

    ``stage`` runs on the caller's thread; ``write`` and ``commit`` on DCP's, one at a time.
    """

    def __init__(self) -> None:
        mine, theirs = socket.socketpair()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
               # the worker's own import path (a test's or a script's directory too): a writer class it passes
               # (``saver._writer``) is unpickled there
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(theirs.fileno()), str(os.getpid()), str(NICE)],
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self.sock = mine
        self.region: Region | None = None
        self._sent: int | None = None  # the id of the region the writer has mapped
        self._request = threading.Lock()  # one request at a time
        self._state = threading.Lock()
        self._busy: str | None = None  # "write" or "commit" while a request is in flight
        self._retiring = False
        self.snapshot: Snapshot | None = None  # the forked child copying the last save's state, until reaped
        self.forked = 0  # how many of the last save's tensors its child copied (the rest were copied in the call)
        self.copy = StateCopy()  # the call's copy, and the part of it that runs beside training (.staging)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None and self.sock.fileno() >= 0

    # -- the caller's thread: the only part that blocks training -----------------------------------------------
    def stage(self, tensors: dict[str, torch.Tensor], later: frozenset[int] = frozenset(),
              fences: Fences | None = None) -> list[tuple[str, torch.dtype, tuple[int, ...], int]]:
        """Snapshot ``tensors`` (a DTensor: its local shard) into the shared region; return where each one lies.

        Those whose memory starts at an address of ``later`` (the parameters and the optimizer's state: only
        the next step writes them) are copied beside training until a fence of ``fences``
        (:mod:`phalanx.checkpoint.staging`), the others (buffers, a rule's state) in the call. With
        :data:`FORK`, the tensors :func:`_forkable` says a fork freezes are copied by a forked child of this worker
        (:class:`Snapshot`), after the call, instead.
        """
        try:
            self.reap()  # the previous save's child: its write waited for it, unless that save failed before
        except WriterGone:
            pass  # that save's outcome, not this one's (it ended before its write, e.g. at a regroup)
        self.copy.fence()  # (likewise) the previous copy beside training, before its region may be replaced
        local = {k: _local(t) for k, t in tensors.items()}
        layout = [(k, t.dtype, tuple(t.shape)) for k, t in local.items()]
        if self.region is None or self.region.layout != layout:
            self.region = None  # the old mapping goes first: a state that changed shape needs no more than one
            self.region = Region(layout)
        fork = FORK and _can_fork()
        moves, forked, beside, now = [], [], [], []
        with torch.no_grad():
            for k, t in local.items():
                view = self.region.views[k]
                if fork and _forkable(t):
                    moves.append((view.data_ptr(), t.data_ptr(), t.numel() * t.element_size()))
                    forked.append((view, t))
                elif not fork and t.device.type == "cpu" and t.data_ptr() in later and t.numel():
                    beside.append((view, t))
                else:
                    now.append((view, t))
            self.forked = len(moves)
            if moves:
                try:
                    self.snapshot = Snapshot(moves)
                except OSError:  # no fork now (strict overcommit, a process limit): the call copies them
                    self.forked = 0
                    now += forked
        names = {id(t): k for k, t in local.items()}
        self.copy.start(now, beside, names, fences)
        return self.region.entries

    def reap(self, what: str = "the next save") -> None:
        """Wait for the snapshot's child, if one is copying; raise :class:`WriterGone` if it did not finish."""
        snapshot, self.snapshot = self.snapshot, None
        if snapshot is not None:
            snapshot.wait(what)

    # -- DCP's thread ------------------------------------------------------------------------------------------
    def write(self, inner: Any, plan: Any, entries: list, what: str, generation: int) -> list:
        """The writer process runs ``inner.write_data(plan, ...)`` over the staged tensors; its WriteResults.

        Refused once the group has left ``generation`` (the save's): a regroup abandoned that save.
        """
        region = self.region
        assert region is not None, "stage() comes first"
        self.reap(what)  # the staged bytes are whole once the snapshot's child is done
        self.copy.fence()  # and the copy beside training
        if group.current().generation == generation:  # (else a regroup's restore may have written under it: refused)
            self.copy.finish(what)  # TornCopy if a tensor changed under it
        if hasattr(inner, "per_thread_copy_ahead"):
            inner.per_thread_copy_ahead = 0  # the staged tensors are in memory already (as DCP's own staging does)
        fds = [] if self._sent == region.ident else [region.fd]
        body = {"writer": inner, "plan": plan, "entries": entries, "region": (region.ident, region.size)}
        results = self._ask("write", body, fds, what, generation)
        self._sent = region.ident
        return results

    def commit(self, tmp: str, path: str, world: int, step: int) -> None:
        """Rank 0: the writer process seals ``tmp`` and renames it over ``path`` (:func:`~.handle._commit`)."""
        self._ask("commit", (tmp, path, world, step), [], f"sealing the checkpoint {path!r}")

    def _ask(self, kind: str, body: Any, fds: list[int], what: str, generation: int | None = None) -> Any:
        with self._request:
            with self._state:  # (a regroup changes the generation, then kills a write in flight under this lock)
                if self._retiring or not self.alive() or (
                        generation is not None and group.current().generation != generation):
                    raise WriterGone(f"the checkpoint writer process (pid {self.pid}) was stopped, or the group "
                                     f"changed, before {what}; this checkpoint is abandoned and the previous one "
                                     "at that path is untouched.")
                self._busy = kind
            try:
                try:
                    send(self.sock, (kind, body), fds)
                    answer = receive(self.sock)
                except OSError:
                    answer = None
                if answer is None:
                    raise WriterGone(f"the checkpoint writer process (pid {self.pid}) {self._ended()} while "
                                     f"{what}; this checkpoint is abandoned and the previous one at that path is "
                                     "untouched. The next save starts another writer.")
            finally:
                with self._state:
                    self._busy = None
                    if self._retiring:
                        self._end()
            status, value = pickle.loads(answer[0])
            if status == "error":
                raise value
            return value

    def _ended(self) -> str:
        try:
            code = self.proc.wait(timeout=5)  # it closed its end: it is ending (or ended)
        except subprocess.TimeoutExpired:
            self._kill()
            return "stopped answering"
        return _describe(code)

    # -- its end -----------------------------------------------------------------------------------------------
    def retire(self) -> None:
        """End it: at once if idle or writing (that save is abandoned), after the commit if one is in flight."""
        with self._state:
            self._retiring = True
            if self._busy is None:
                self._end()
            elif self._busy == "write":
                self._kill()  # the request's thread sees the end of the channel, says so, and closes it
            # a commit in flight puts a whole checkpoint in place: _ask ends the writer after it

    def abandon_write(self) -> bool:
        """Kill it if a write is in flight (its save is abandoned; the caller starts another writer); True if so."""
        with self._state:
            if self._busy != "write":
                return False  # idle (kept for the next save), or a commit putting a whole checkpoint in place
            self._retiring = True
            self._kill()
            return True

    def _kill(self) -> None:
        """SIGKILL and reap it (an idle writer holds nothing; a write in flight is abandoned by its caller)."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass  # not reapable yet (in uninterruptible I/O): it ends when that returns

    def _end(self) -> None:
        self._kill()
        self.sock.close()
        self.copy.close()
        snapshot, self.snapshot = self.snapshot, None
        if snapshot is not None:
            snapshot.kill()

    def __repr__(self) -> str:
        return f"WriterProcess(pid={self.pid}, alive={self.alive()})"


class Writers(Slot[WriterProcess]):
    """The group's record of its worker's writer process: started at the first asynchronous save, ended with it."""

    def __init__(self) -> None:
        super().__init__()
        self._watching = False

    def process(self, g: group.Group) -> WriterProcess:
        """The worker's writer, started now if it has none (or the last one ended)."""
        writer = self.value
        if writer is not None and not writer.alive():
            writer.retire()
            writer = None
        if writer is None:
            writer = self.value = WriterProcess()
            if not self._watching:
                g.on_regroup(self._regrouped)
                self._watching = True
        return writer

    def _regrouped(self, g: group.Group) -> None:
        """A write in flight belonged to the generation that ended: kill it (the next save starts a new writer)."""
        writer = self.value
        if writer is not None and writer.abandon_write():
            self.value = None

    def stop(self) -> None:
        """End this group's writer (see :meth:`WriterProcess.retire`)."""
        writer, self.value = self.value, None
        if writer is not None:
            writer.retire()

    def before_leaving(self, failing: bool) -> None:
        """The group is left (after the save in flight, which the checkpoint's own record waits for): end it."""
        self.stop()


WRITERS: Record[Writers] = Record("checkpoint writer process", Writers)


# -- DCP's side of an asynchronous save ----------------------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor's self, a DTensor's local shard (what this worker writes of it)."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


@functools.cache
def _proxy_class() -> type:
    """DCP's StorageWriter that hands ``write_data`` to the writer process (DCP is imported at the first save)."""
    base = _dcp().StorageWriter

    class ProcessStorageWriter(base):  # type: ignore[misc, valid-type]
        """``inner``'s plans and metadata in this worker; its data files written by the writer process."""

        def __init__(self, writer: WriterProcess, inner: Any, entries: list, path: str, generation: int) -> None:
            self.writer, self.inner, self.entries, self.path = writer, inner, entries, path
            self.generation = generation

        def reset(self, checkpoint_id: Any = None) -> None:
            self.inner.reset(checkpoint_id)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return _dcp().FileSystemWriter.validate_checkpoint_id(checkpoint_id)

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            self.inner.set_up_storage_writer(is_coordinator, *args, **kwargs)

        def prepare_local_plan(self, plan: Any) -> Any:
            return self.inner.prepare_local_plan(plan)

        def prepare_global_plan(self, plans: list) -> list:
            return self.inner.prepare_global_plan(plans)

        def write_data(self, plan: Any, planner: Any) -> Any:
            results = self.writer.write(self.inner, plan, self.entries, f"writing the checkpoint {self.path!r}",
                                        self.generation)
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(results)
            return done

        def finish(self, metadata: Any, results: list) -> None:
            self.inner.finish(metadata, results)

        def storage_meta(self) -> Any:
            return self.inner.storage_meta()

    return ProcessStorageWriter


class Staging:
    """An asynchronous save's staging: :meth:`copy` (the blocking part) and DCP's ``async_stager``.

    :meth:`copy` copies the tensors into the writer's shared region on the caller's thread; DCP's
    ``stage`` then returns the state as given: DCP plans from it in its thread (shapes and layouts
    only, which training does not change), and the bytes written are the staged ones.
    """

    _synchronize_after_execute = False  # the copy is done before DCP is called

    def __init__(self, writer: WriterProcess) -> None:
        self.writer = writer
        self.entries: list = []

    def copy(self, tensors: dict[str, torch.Tensor], later: frozenset[int] = frozenset(),
             fences: Fences | None = None) -> None:
        """Copy ``tensors`` into the writer's shared region, ``later``'s beside training (see ``stage``)."""
        self.entries = self.writer.stage(tensors, later, fences)

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def storage_writer(staging: Staging, inner: Any, path: str, generation: int) -> Any:
    """DCP's storage writer for an asynchronous save of ``generation``: ``inner``'s, its data written from
    ``staging`` by its writer process."""
    return _proxy_class()(staging.writer, inner, staging.entries, path, generation)


__all__ = ["FORK", "NICE", "WRITERS", "Staging", "WriterProcess", "Writers", "storage_writer"]
