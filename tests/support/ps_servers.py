"""Parameter servers for the tests, forked from the tests' preloaded fork server instead of fresh interpreters.

:func:`phalanx.ps.start_servers` starts each server as ``python -m phalanx.ps serve``: a fresh interpreter that
imports torch (about 1.4 CPU s on this machine). :func:`forked_servers` runs the same command line, each server
still its own process on its own port talking ZeroMQ to the workers, but forked from the server the tests' workers
are forked from (:func:`phalanx.launch.workers.start_worker`, ``"forkserver"``), which imported torch once. Use it
where a test does not test how a server process is started; it returns the same :class:`ServerGroup`.

Example:
    >>> # with forked_servers(2) as servers: run_workers("workers.ps:train", env=servers.env(), ...)
"""
from __future__ import annotations

import os
import secrets
import tempfile

from phalanx.launch.workers import ForkedWorker, start_worker
from phalanx.ps.config import TOKEN
from phalanx.ps.launcher import ServerGroup, _wait_serving

__all__ = ["forked_servers"]


class _Server:
    """A forked server: :class:`ForkedWorker` plus the ``send_signal`` :meth:`ServerGroup.stop` sends SIGTERM with."""

    def __init__(self, proc: ForkedWorker) -> None:
        self._proc, self.pid = proc, proc.pid

    def poll(self) -> int | None:
        return self._proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._proc.wait(timeout)

    def kill(self) -> None:
        self._proc.kill()

    def send_signal(self, sig: int) -> None:
        if self._proc.poll() is None:
            os.kill(self.pid, sig)

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()


def forked_servers(n: int, host: str = "127.0.0.1", timeout: float = 60.0) -> ServerGroup:
    """``n`` servers as :func:`phalanx.ps.start_servers` starts them (same command line, a new token, each writing
    its address to a file in the group's log folder), forked from the tests' preloaded fork server.

    Example:
        >>> # with forked_servers(1) as servers: servers.alive()  # [True]
    """
    token = secrets.token_urlsafe(24)
    log_dir = tempfile.mkdtemp(prefix="phalanx-ps-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", TOKEN: token}
    procs, cmds = [], []
    for i in range(n):
        argv = ["-m", "phalanx.ps", "serve", "--host", host, "--index", str(i), "--threads", "2",
                "--port-file", os.path.join(log_dir, f"ps{i}.addr")]
        cmds.append(argv)
        procs.append(_Server(start_worker("forkserver", argv, env, log=os.path.join(log_dir, f"ps{i}.log"))))
    group = ServerGroup([""] * n, token, procs, log_dir, cmds, env)  # type: ignore[arg-type]
    _wait_serving(group, range(n), host, timeout)
    return group

