"""An asynchronous save's snapshot by fork: the worker's tensors frozen copy-on-write and copied by a forked child.

:class:`Snapshot` forks the worker in the save's call; its child copies the tensors :func:`_forkable` says a fork
freezes into the writer's shared region (:mod:`phalanx.checkpoint.writer`), and the write waits for it. Where a fork
cannot serve (:func:`_can_fork`: no pidfds, a CUDA process) the call copies. :class:`WriterGone` is how either half
of an asynchronous save ends early: the snapshot's child, or the writer process, gone before its work was done.

Example:
    >>> import torch
    >>> _forkable(torch.zeros(3)), _forkable(torch.zeros(3).share_memory_())
    (True, False)
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

import torch

from ..errors import CheckpointError


class WriterGone(CheckpointError):
    """The writer process ended while it had a request: the checkpoint in flight is abandoned."""


class Snapshot:
    """A copy-on-write snapshot of the worker's tensors: a forked child copying them into the shared region.

    ``os.fork()`` at the save's call (its cost: the worker's page tables) gives the child the worker's
    memory as it is at that instant; training then goes on writing its parameters, and the kernel copies
    each page it writes while the child still shares it (Redis's BGSAVE works the same way). The child
    runs :func:`_copy_in_child` only (libc ``memmove`` of raw bytes, with the addresses taken before the
    fork): no torch, no OpenMP pool, no CUDA, no lock another thread might have held at the fork.
    """

    def __init__(self, moves: list[tuple[int, int, int]]) -> None:
        done, tell = os.pipe()  # (not inherited by the writer process: close-on-exec)
        copy = _copy_in_child  # looked up before the fork (a test replaces it to hold the child)
        pid = os.fork()
        if pid == 0:  # the child: raw copies, then gone without running anything of the worker's (os._exit)
            code = 1
            try:
                signal.signal(signal.SIGINT, signal.SIG_DFL)  # not the worker's handlers
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.close(done)
                copy(moves, tell)
                code = 0
            finally:
                os._exit(code)
        os.close(tell)
        self.pid = pid
        self._done = done
        self._pidfd = os.pidfd_open(pid)  # its kill cannot reach another process that reused the pid
        self._lock = threading.Lock()
        self._outcome: str | None = None  # None while copying; "" once done; else how it ended

    def wait(self, what: str) -> None:
        """Block until the child has copied every byte; :class:`WriterGone` naming its end if it did not."""
        with self._lock:
            if self._outcome is None:
                ok = os.read(self._done, 1) == b"\x01"  # its last act; EOF: it ended before
                try:
                    code: int | None = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
                except ChildProcessError:
                    code = None  # reaped by someone else's wait()
                self._outcome = "" if ok else (_describe(code) if code is not None else "ended")
        if self._outcome:
            raise WriterGone(f"the checkpoint's snapshot process (pid {self.pid}, a fork of this worker copying "
                             f"its state) {self._outcome} before {what}; this checkpoint is abandoned and the "
                             "previous one at that path is untouched. The next save forks another.")

    def kill(self) -> None:
        """SIGKILL and reap it (its save is abandoned)."""
        try:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.wait("its writer ended")
        except WriterGone:
            pass

    def __del__(self) -> None:
        for fd in (getattr(self, "_done", None), getattr(self, "_pidfd", None)):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


def _copy_in_child(moves: list[tuple[int, int, int]], tell: int) -> None:
    """The snapshot child's whole work: copy each ``(destination, source, bytes)``, then say so on ``tell``."""
    for dst, src, n in moves:
        _memmove(dst, src, n)
    os.write(tell, b"\x01")


_memmove = ctypes.memmove  # bound at import: the child calls it without importing or resolving anything


def _can_fork() -> bool:
    """Whether this worker may snapshot by fork: Linux (pidfds) and no CUDA context.

    A CUDA process's host memory may be pinned or mapped by the driver (not copied on write, or not at
    all, in a child), and its tensors on the device are not in host memory: there the call copies.
    """
    return sys.platform.startswith("linux") and hasattr(os, "fork") and hasattr(os, "pidfd_open") and \
        not torch.cuda.is_initialized()


def _forkable(t: torch.Tensor) -> bool:
    """Whether a fork freezes ``t``'s bytes: a plain dense tensor in the worker's private memory, laid out whole.

    Shared memory (``share_memory_()``, a DataLoader's or Hogwild's) is not copied on write: a child would
    see the worker's later writes; such tensors are copied in the call, as are views with strides or flags.
    """
    return type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided and \
        t.is_contiguous() and t.numel() > 0 and not t.is_shared() and not t.is_conj() and not t.is_neg() and \
        not t.is_quantized


def _describe(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-code} ({name})"
    return f"exited with status {code}"


__all__ = ["Snapshot", "WriterGone"]
