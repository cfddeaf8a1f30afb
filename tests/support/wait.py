"""Bounded waits for what another process makes true: a file, a store key, a log line, an exit.

A marker written by another process gives no portable notification, so this is the one place the tests poll:
every ``POLL_S`` until the condition holds. A watched process that ends first, or the deadline, fails the wait
at once with what it knows, so a wedge is a failure with a reason, never a hang.

Example:
    >>> until(lambda: True, timeout=1, what="nothing")
"""
from __future__ import annotations

import subprocess
import time
from typing import Callable, Sequence

POLL_S = 0.02


def until(cond: Callable[[], object], *, timeout: float, what: str, procs: Sequence[subprocess.Popen] = (),
          detail: Callable[[], str] = lambda: "") -> None:
    """Return once ``cond()`` is true; fail if a process in ``procs`` ends first or ``timeout`` seconds pass."""
    end = time.monotonic() + timeout
    while not cond():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: the process ended first (status {p.returncode}) {detail()}")
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {timeout:.0f} s {detail()}")
        time.sleep(POLL_S)  # sleep: the one poll of a condition another process makes true (bounded above)


def exited(proc: subprocess.Popen, *, timeout: float, what: str) -> int:
    """The exit status of ``proc`` once it ended (bounded): ``Popen.wait`` blocks in the kernel, no polling."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{what}: still running after {timeout:.0f} s") from None
