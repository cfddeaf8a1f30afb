"""A flag a signal handler may set and any thread may wait on.

A Python signal handler runs in the main thread between any two of its bytecodes. ``threading.Event.set()``
takes the Event's lock; when the handler interrupts the main thread inside ``Event.wait()`` at a moment that
thread holds that lock (entering or leaving the wait), ``set()`` waits for a lock its own thread holds: the
process hangs for good. :class:`Latch` writes one byte to a pipe instead, which takes no lock.
"""
from __future__ import annotations

import os
import select


class Latch:
    """Set once from anywhere (a signal handler included), waited on with a timeout from any thread.

    Example:
        >>> latch = Latch()
        >>> latch.is_set(), latch.wait(0)
        (False, False)
        >>> latch.set(); latch.set()   # the second is a no-op
        >>> latch.is_set(), latch.wait(0)
        (True, True)
        >>> latch.close()
    """

    def __init__(self) -> None:
        self._set = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)

    def set(self) -> None:
        """Set the flag and wake every waiter; safe in a signal handler (a write to a pipe takes no lock)."""
        if self._set:
            return
        self._set = True
        try:
            os.write(self._write, b"\0")
        except OSError:  # the pipe is full (already written) or closed: the flag alone answers from now on
            pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False if ``timeout`` seconds passed first. The byte stays in the pipe, so every
        waiter, now or later, wakes."""
        if self._set:
            return True
        try:
            select.select([self._read], [], [], timeout)
        except (OSError, ValueError):  # closed: nothing can set it any more
            pass
        return self._set

    def close(self) -> None:
        """Release the pipe; the flag keeps its value."""
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._read = self._write = -1

    def __del__(self) -> None:
        if getattr(self, "_read", -1) >= 0:
            self.close()
