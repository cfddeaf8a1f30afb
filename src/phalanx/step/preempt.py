"""Preemption: a SIGTERM (or SLURM's ``--signal=USR1@N``) ends the job at a step boundary, resumably.

A cluster manager that takes a job's machines away sends SIGTERM and waits a grace
window (Kubernetes 30 s by default, torch's agent 30 s, SLURM's ``KillWait``) before
SIGKILL. phalanx turns that signal into a clean stop:

1. The signal handler only records the signal (no work in a signal handler).
2. At the next step boundary (the end of ``optimizer.step()`` of a wrapped optimizer,
   :class:`phalanx.step.clock.StepClock`) the worker tells the others through the group's
   store, and every worker stops at **the same step**: the step after the last worker
   heard the signal. Steps where no signal arrived cost one attribute read.
3. :func:`preempted` is then True on every worker: the loop writes a checkpoint
   (``px.save_checkpoint``; the Trainer does it itself) and exits with
   :data:`PREEMPTED_EXIT` (75, ``EX_TEMPFAIL``: "temporary failure, retry").
   ``phalanx run`` forwards the signal to its workers, waits for them, and exits with
   75 too (and, with ``--requeue`` under SLURM, requeues the job).

A signal that arrives before the first step (start-up) ends the worker at once with
status 75: nothing is written half (every checkpoint
write is an atomic rename). Only launched workers (``phalanx run``, torchrun) handle the
signals; a plain ``python`` process keeps the default.

Every worker of the job must hear the signal (a launcher forwards it to all of them;
SLURM and Kubernetes signal every process); a worker signalled alone trains on until the
others hear it too. With per-step strategies (``px.AllReduce``...) the stop is the step after
the last worker heard the signal; with periodic ones (``px.LocalSGD``, ``px.DiLoCo``), whose
workers drift up to a round of local steps apart, it is the next sync after that, the first
step no worker can pass alone (and the checkpoint there holds one model).

Example (your own loop):
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(2, 1)
    >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    >>> for step in range(3):
    ...     opt.zero_grad(); model(torch.ones(4, 2)).sum().backward(); opt.step()
    ...     if px.preempted():   # True on every worker at the same step once the job is told to stop
    ...         px.save_checkpoint(f"ckpt/step-{step + 1}.pt", model, opt, step=step + 1)
    ...         raise SystemExit(px.PREEMPTED_EXIT)
    >>> latest_checkpoint("no-such-dir") is None
    True
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable

from ..group import group
from ..group.records import Record, Slot
from ..framing import MARKER, read_verified
from ..sealed import verify_directory
from .latch import Latch
from .protocols import ReplicasAgree

if TYPE_CHECKING:
    from ..group.group import Group

#: Exit status of a worker (and of ``phalanx run``) that stopped because it was preempted: resumable.
#: 75 is ``EX_TEMPFAIL`` of sysexits.h: a temporary failure, the job may be retried.
PREEMPTED_EXIT = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_KEY = "preempt"  # keys in the group's per-generation store


class Preempted(SystemExit):
    """Raised to end a preempted worker with :data:`PREEMPTED_EXIT` (a ``SystemExit``: no traceback)."""

    def __init__(self, checkpoint: str | None = None) -> None:
        super().__init__(PREEMPTED_EXIT)
        self.checkpoint = checkpoint


class Preemption:
    """One worker's view of a preemption: the signal heard, and the step all workers stop at.

    The group keeps one (:data:`PREEMPTION`, made by :func:`of`); the handler and the step boundary are its only
    writers. The step clocks of the wrapped models report their boundaries here (:attr:`clocks`).
    """

    def __init__(self, g: "Group") -> None:
        self.group = g
        self.clocks: weakref.WeakSet[Any] = weakref.WeakSet()  # the step clocks of this group's wrapped models
        self.signal: int | None = None  # written by the signal handler only
        # Set with it, for tests and tools that wait for the signal; a Latch, not a threading.Event, because the
        # handler may interrupt the main thread inside heard.wait() while it holds the Event's lock (latch.py)
        self.heard = Latch()
        self.armed = False  # a step boundary has passed: from now on a signal waits for the next one
        self.posted_at: int | None = None  # the boundary where this worker told the others
        self.stop_at: int | None = None  # the step every worker stops after
        self.due = False
        self.step = 0  # the last step boundary seen
        self._installed: dict[int, Any] = {}

    # -- the signal --------------------------------------------------------------------------------------
    def install(self) -> None:
        """Handle SIGTERM and SIGUSR1 in a launched worker, unless the program installed its own handler.

        Only workers a launcher started (``phalanx run``, torchrun, ``srun phalanx run``) defer the
        signal: a plain process (a notebook, a test runner) keeps the default, so a SIGTERM after its
        training ended still ends it.
        """
        env = self.group.env
        launched = (env.launched_by_phalanx or env.world_size > 1
                    or HANDED_OVER.of(self.group).value is not None)  # (a joiner too)
        if self._installed or not launched or threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            current = signal.getsignal(sig)
            older = getattr(current, "__self__", None)
            if isinstance(older, Preemption):  # a previous group's (px.shutdown(), then px.init() again)
                self._installed[sig] = older._installed.get(sig, signal.SIG_DFL)
                signal.signal(sig, self._handler)
            elif current in (signal.SIG_DFL, None):
                self._installed[sig] = signal.signal(sig, self._handler)

    def uninstall(self) -> None:
        for sig, old in self._installed.items():
            if signal.getsignal(sig) == self._handler:
                signal.signal(sig, old)
        self._installed.clear()

    def _handler(self, signum: int, frame: Any) -> None:
        # A second signal only repeats the first: SLURM signals every process of the step and the launcher
        # forwards it too, so a worker commonly hears it twice.
        if not self.armed or group._group is not self.group:
            raise Preempted()  # start-up (nothing trained, nothing to save) or after shutdown: leave now
        if self.signal is None:
            self.signal = signum
            # Every later SIGTERM/SIGUSR1 only repeats this one: from now on the kernel drops them. A Python handler
            # would not do: the interpreter's finalization puts back the default action, and a repeat then killed a
            # worker that had stopped and saved (torch's agent SIGTERMs the other workers as soon as one ends, with
            # 75 too). A worker that hangs instead of stopping still ends: the launcher kills it after --grace.
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
        self.heard.set()

    # -- the step boundary -------------------------------------------------------------------------------
    def at_boundary(self, step: int) -> bool:
        """Called after every step (by the step clock); True once every worker should stop here."""
        self.armed = True
        self.step = step
        if self.signal is None and self.posted_at is None:
            return False  # the normal step: one attribute read
        if self.due:
            return True
        g = self.group
        store, world = g.store, g.world_size
        if HANDED_OVER.of(g).value is not None:
            return False  # e.g. under --elastic a signalled worker leaves at the next commit (phalanx.elastic.State)
        if store is None or world == 1:
            self.stop_at = step
        elif self.posted_at is None:
            self.posted_at = step
            store.set(f"{_KEY}/seen/{g.rank}", str(step))
            if int(store.add(f"{_KEY}/heard", 1)) == world:  # the last to hear it decides the stop
                seen = [int(v) for v in store.multi_get([f"{_KEY}/seen/{r}" for r in range(world)])]
                store.set(f"{_KEY}/stop", str(self._stop_after(max(seen))))
        if self.stop_at is None and store is not None and world > 1 and store.check([f"{_KEY}/stop"]):
            self.stop_at = int(store.get(f"{_KEY}/stop"))
        self.due = self.stop_at is not None and step >= self.stop_at
        if self.due:
            self._note(step)
        return self.due

    def _stop_after(self, latest: int) -> int:
        """The step every worker stops after, decided by the last to hear at its boundary; ``latest`` is the
        newest boundary any worker posted at.

        It must be a step no worker has passed yet. Per-step strategies meet every step: a worker posting at
        boundary s has every peer at s-1 or later, and none finishes step s+1 before this post, since step s+1
        meets this worker; so the stop is ``latest + 1``. Periodic ones (LocalSGD, DiLoCo) meet only at their
        syncs, and a worker may run up to a round of local steps ahead of the last one to hear, past
        ``latest + 1``; but none passes the next sync, which needs every worker. So the stop is the first step
        after ``latest`` where the replicas agree: the next sync for those, the next step for the others (and a
        checkpoint taken there holds one model).
        """
        strategies = [c.strategy for c in self.clocks if c.strategy is not None]
        agree = [s.replicas_agree for s in strategies if isinstance(s, ReplicasAgree)]  # the rest agree every step
        for step in range(latest + 1, latest + 1 + 1_000_000):  # a sync schedule is a function of the step
            if all(a(step) for a in agree):
                return step
        return latest + 1  # a schedule that never syncs again: its workers never meet, any step will do

    def _note(self, step: int) -> None:
        """Tell ``phalanx run`` (a file in its notes directory) that this worker stops, preempted, after ``step``."""
        notes = self.group.env.preempt_notes
        if notes and os.path.isdir(notes):
            with open(os.path.join(notes, f"rank-{self.group.rank}"), "w") as f:
                f.write(str(step))


PREEMPTION: "Record[Slot[Preemption]]" = Record("preemption", Slot)

#: Who takes a signalled worker out of the group instead of the step boundary: ``None`` (every worker stops
#: at one step, :meth:`Preemption.at_boundary`), or the name of the feature that does (``phalanx.elastic`` sets
#: itself when it takes the worker's place: the worker leaves at its next commit and the others go on). A feature
#: that takes this over also launched the worker, so its signal handler is installed.
HANDED_OVER: "Record[Slot[str]]" = Record("preemption handed over", Slot)


def of(g: "Group | None" = None) -> Preemption:
    """The group's :class:`Preemption` (made, and its handlers installed, on first use)."""
    g = g if g is not None else group.current()
    slot = PREEMPTION.of(g)
    if slot.value is None:
        slot.value = Preemption(g)
        slot.value.install()
    return slot.value


def preempted() -> bool:
    """True on every worker, at the same step, once the job has been told to stop (SIGTERM or SIGUSR1).

    Call it after ``optimizer.step()``; when it is True, write a checkpoint
    (``px.save_checkpoint``, every worker) and ``raise SystemExit(px.PREEMPTED_EXIT)``.
    In a loop without ``px.wrap`` each call is the step boundary.
    """
    g = group.current() if group.is_initialized() else group.init()
    p = of(g)
    if not p.clocks:  # no wrapped optimizer marks the steps: this call does
        return p.at_boundary(p.step + 1)
    p.armed = True
    return p.due


def resume_from() -> str | None:
    """The checkpoint ``phalanx run --resume-from`` chose for this job; None to start fresh.

    ``--resume-from auto`` picks the newest complete checkpoint in ``--checkpoint-dir``
    (:func:`latest_checkpoint`), so a requeued job script stays the same.
    """
    return (group.current() if group.is_initialized() else group.init()).env.resume_from


def checkpoint_dir(default: str = "checkpoints") -> str:
    """Where a preempted job writes its checkpoint: ``phalanx run --checkpoint-dir``, else ``default``."""
    return (group.current() if group.is_initialized() else group.init()).env.checkpoint_dir or default


def latest_checkpoint(directory: str | os.PathLike | None) -> str | None:
    """The newest checkpoint in ``directory`` that verifies (a checkpoint directory, or a one-file checkpoint).

    Every candidate is checked whole, newest first, and the first that verifies is taken: a directory
    needs its marker and every file the marker lists, each byte matching its SHA-256 (a missing
    ``.metadata`` or data file, a truncated worker's file, a flipped bit: passed over for the next
    newest); a file needs its framing's SHA-256. Temporaries (``*.tmp-*``) and hidden files are
    skipped. A save killed between its two renames left the previous checkpoint as ``<name>.old-<id>``
    with no ``<name>``: it is renamed back (or taken where it is, when the directory is read-only);
    an ``.old-*`` beside a ``<name>`` that verifies is a leftover, and removed. None when none verifies.
    """
    if directory is None or not os.path.isdir(directory):
        return None
    def verifies(path: str) -> bool:
        try:
            verify_directory(path) if os.path.isdir(path) else read_verified(path)
        except Exception:  # noqa: BLE001 - a damaged, partial or foreign checkpoint: try the next newest
            return False
        return True

    directory = os.fspath(directory)
    recovered = _recover_replaced(directory, verifies)
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), "*")):
        name = os.path.basename(path)
        if name.startswith(".") or ".tmp-" in name or (".old-" in name and path not in recovered):
            continue
        if os.path.isdir(path) and not os.path.exists(os.path.join(path, MARKER)):
            continue
        found.append((os.path.getmtime(path), name, path))
    for _, _, path in sorted(found, reverse=True):
        if verifies(path):
            return path
    return None


_OLD = re.compile(r"(.+)\.old-[0-9a-f]{8}")  # what handle._commit names the checkpoint it replaces


def _recover_replaced(directory: str, verifies: Callable[[str], bool]) -> set[str]:
    """Put back the checkpoints a save killed between its two renames left as ``<name>.old-<id>``; remove those a
    newer ``<name>`` superseded. Returns the ``.old-*`` paths that could not be renamed back (taken where they are)."""
    olds = [os.path.join(directory, n) for n in os.listdir(directory) if _OLD.fullmatch(n)]
    kept = set()
    for old in sorted(olds, key=lambda p: os.path.getmtime(p) if os.path.lexists(p) else 0, reverse=True):
        target = os.path.join(directory, _OLD.fullmatch(os.path.basename(old)).group(1))
        try:
            if os.path.lexists(target):
                if verifies(target):  # the replace finished but its removal of the old one did not
                    shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.unlink(old)
            elif verifies(old):
                try:
                    os.rename(old, target)  # atomic; another worker doing the same at once: one of them wins
                except FileExistsError:
                    pass
                except OSError:  # a read-only directory: take it where it is
                    kept.add(old)
        except FileNotFoundError:  # another worker recovered or removed it first
            continue
    return kept


def checkpoint_name(directory: str | os.PathLike, step: int) -> str:
    """Where a preempted job writes its checkpoint: ``directory/step-00000042.pt``."""
    return os.path.join(os.fspath(directory), f"step-{step:08d}.pt")


__all__ = ["PREEMPTED_EXIT", "Preempted", "Preemption", "checkpoint_dir", "checkpoint_name", "latest_checkpoint",
           "preempted", "resume_from"]
