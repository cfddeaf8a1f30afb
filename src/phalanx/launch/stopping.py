"""How ``phalanx run`` stops its workers on SIGTERM or SLURM's SIGUSR1 (a preemption) and keeps their exit statuses.

The first signal is passed on to every worker's process group, as torch's agent would, and the launcher goes on
watching the workers through torch's agent, so each worker's exit status comes back the usual way: 75
(:data:`~phalanx.step.preempt.PREEMPTED_EXIT`) from a worker that stopped at the agreed step and saved; 0 from one
that reached the end of its script first; a failure's own status (and its one line) from one that failed while
stopping. Workers still running ``--grace`` seconds after the signal are killed (SIGKILL).

Why not torch's way: its handler raises out of the agent's loop, and the agent then stops the workers and waits
for them, but drops how each ended. A job whose workers heard the signal at different moments (SLURM signals each
node's processes from that node's daemon; on a loaded machine one heard it seconds later) trains on until every
worker has heard it (:mod:`phalanx.step.preempt`), and may reach the end of its script first: its workers
finished, exit 0, and the launcher said "stopped all workers" and exited 138, so SLURM marked the finished job
FAILED (a CI run of tests/launch/test_slurm.py, 1 in 10 under load).

A signal that comes before every worker has started still ends the start-up through torch's agent (its
``SignalException``): a worker it starts after the signal would never hear it. A SIGUSR1 before any worker started
is ignored: SLURM's early warning does not end a job that has not begun. A later signal has nothing to add (every
worker heard the first) and is absorbed: the grace runs to its end. SIGINT stays torch's (it stops at once).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable, Sequence


class Stopping:
    """The launcher's SIGTERM/SIGUSR1 handler: pass the first on to the workers and kill those left after the grace.

    ``workers()`` returns the pids of the workers started so far (each leads its own process group, as torch's
    agent starts them); ``nproc`` is how many there will be.

    Example:
        >>> s = Stopping(lambda: [], nproc=2, grace_s=30)
        >>> s(signal.SIGUSR1, None) is None, s.first     # no worker yet: SLURM's early warning, ignored
        (True, None)
        >>> try:
        ...     s(signal.SIGTERM, None)                   # start-up: torch's agent stops what it started
        ... except Exception as e:
        ...     print(type(e).__name__, e.sigval.name)
        SignalException SIGTERM
        >>> s(signal.SIGTERM, None), s.first.name         # a repeat: nothing
        (None, 'SIGTERM')
    """

    def __init__(self, workers: Callable[[], Sequence[int]], *, nproc: int, grace_s: float) -> None:
        self.workers, self.nproc, self.grace_s = workers, nproc, grace_s
        self.first: signal.Signals | None = None  # the signal that stops the job
        self.forwarded = False  # it was passed on to every worker (not raised into torch's start-up)
        self.killed = False  # the grace ran out: the workers left were killed
        self._ended = threading.Event()  # the workers are gone: nothing to stop, nothing to kill
        self._timer: threading.Timer | None = None

    def __call__(self, signum: int, _frame: object) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if self.first is not None or self._ended.is_set():
            return
        started = list(self.workers())
        if signum == signal.SIGUSR1 and not started:
            return
        self.first = signal.Signals(signum)
        if len(started) < self.nproc:
            raise SignalException(f"Process {os.getpid()} got signal: {self.first}", sigval=self.first)
        self.forwarded = True
        _signal_groups(started, self.first)
        self._timer = threading.Timer(self.grace_s, self._kill, [started])
        self._timer.daemon = True
        self._timer.start()

    def _kill(self, signalled: Sequence[int]) -> None:
        if self._ended.is_set():
            return
        self.killed = True
        # and any worker torch's agent started since (--max-restarts after a failure): it never heard the signal
        _signal_groups(sorted({*signalled, *self.workers()}), signal.SIGKILL)

    def ended(self) -> None:
        """The workers are gone (the launcher's cleanup): a signal from now on has nothing to stop."""
        self._ended.set()
        if self._timer is not None:
            self._timer.cancel()


def _signal_groups(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # it ended meanwhile
            os.killpg(pid, sig)


def leads_its_group(pid: int) -> bool:
    """Whether process ``pid`` leads its own process group, as each worker torch's agent starts does (parameter
    servers and other helpers of the launcher do not).

    Example:
        >>> leads_its_group(os.getpid()) in (True, False)
        True
    """
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


__all__ = ["Stopping", "leads_its_group"]
