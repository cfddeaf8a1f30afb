"""A worker whose launcher is gone ends: it never trains on as an orphan, unwatched, its end reported to nobody.

``phalanx run`` (with or without ``--elastic``) and ``phalanx join`` give each worker their
own pid (``PHALANX_LAUNCHER_PID``, read once into :class:`~phalanx.group.env.WorkerEnv`).
``px.init()`` starts :func:`watch_launcher`: a daemon thread that waits on a pidfd of that
process (``pidfd_open``, Linux 5.3 and later), which becomes readable the moment the launcher
exits, whether it is reaped or left a zombie by its own parent. When it does, the worker says
so in one line and ends at once with status 1 (:func:`phalanx.group.leaving.end_now`), well
within the heartbeat timeout. Its peers, orphans of the same launcher, end the same way; a
checkpoint being written is left unfinished, and checkpoints are atomic.

The launcher is watched directly, not through what it provides:

* **not the store.** The launcher hosts the job's store today, but losing the store is another
  fault (a store may outlive its host, or a host its store); and without ``--elastic`` nothing
  reads the store after the group is formed, so the workers trained on to the end.
* **not ``prctl(PR_SET_PDEATHSIG)``.** It fires when the *thread* that started the worker ends,
  not the process, and only for a direct child: a worker forked by ``--start-method forkserver``
  is the fork server's child.
* **not ``os.getppid()``.** Direct children only, as above.

Where there is no pidfd (another OS, an old kernel) the thread polls the pid every
:data:`POLL_S` instead; a pid the system reuses before ``px.init()`` runs would then be taken
for the launcher, which is why the pidfd comes first.

Example:
    >>> import os
    >>> launcher_gone(os.getpid())
    False
    >>> watch_launcher(None, "worker rank 0") is None   # not started by a phalanx launcher
    True
"""
from __future__ import annotations

import os
import select
import threading
import time

from . import leaving

POLL_S = 0.5  # where there is no pidfd: as often as the heartbeat beats
THREAD = "phalanx-launcher-watch"


def watch_launcher(pid: int | None, who: str) -> threading.Thread | None:
    """End this process, with one line naming ``who``, as soon as process ``pid`` (its launcher) is gone.

    Idempotent: one watching thread per process (a second ``px.init()`` after ``px.shutdown()``
    finds it). None when there is nothing to watch.

    Example:
        >>> watch_launcher(None, "worker rank 0") is None
        True
    """
    if pid is None or pid == os.getpid():
        return None
    for thread in threading.enumerate():
        if thread.name == THREAD:
            return thread
    thread = threading.Thread(target=_watch, args=(pid, who), name=THREAD, daemon=True)
    thread.start()
    return thread


def launcher_gone(pid: int) -> bool:
    """Has process ``pid`` exited (no such process, or a zombie nobody reaped)? One look, no waiting.

    Example:
        >>> import os
        >>> launcher_gone(os.getpid())
        False
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return True  # another user's process: the pid was reused, our launcher (same user) is gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False  # no /proc here: kill(0) answered, so it runs


def _wait_until_gone(pid: int) -> None:
    """Return once process ``pid`` has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # it ended before we looked
    except (AttributeError, OSError):  # no pidfd on this system: poll
        while not launcher_gone(pid):
            time.sleep(POLL_S)  # nothing to wait on without a pidfd; the heartbeat's own period
        return
    try:
        select.select([fd], [], [])  # readable once the process exits (blocks only this daemon thread)
    finally:
        os.close(fd)


def _watch(pid: int, who: str) -> None:
    _wait_until_gone(pid)
    leaving.end_now(f"phalanx: {who} (pid {os.getpid()}): its launcher (pid {pid}) is gone; stopping, since nobody "
                    "is left to watch this worker or report its end. Resume from your last disk checkpoint "
                    "(px.save_checkpoint), if any.")
