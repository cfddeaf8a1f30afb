"""Start and stop a job's parameter-server processes.

``phalanx run -n 4 --servers 2 train.py`` calls :func:`start_servers` and passes
``servers.env()`` to every worker.

Example:
    >>> servers = start_servers(1)
    >>> sorted(servers.env())
    ['PHALANX_PS_ADDRS', 'PHALANX_PS_TOKEN']
    >>> servers.stop()
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from .. import check
from ..errors import PhalanxError
from .config import ADDRS, TOKEN
from .elastic import RESTARTS


class ServerStartError(PhalanxError, RuntimeError):
    """A parameter-server process failed to start, or did not start in time."""


@dataclass
class ServerGroup:
    """Running server processes; ``env()`` tells workers where they are."""

    addrs: list[str]
    token: str | None
    procs: list[subprocess.Popen] = field(repr=False)
    log_dir: str = field(repr=False, default="")
    cmds: list[list[str]] = field(repr=False, default_factory=list)  # how each was started, to restart it
    proc_env: dict[str, str] = field(repr=False, default_factory=dict)
    restarts: int = 0

    def env(self) -> dict[str, str]:
        """The variables a worker needs: ``PHALANX_PS_ADDRS`` (and ``PHALANX_PS_TOKEN`` if there is one)."""
        env = {ADDRS: ",".join(self.addrs)}
        if self.token:
            env[TOKEN] = self.token
        return env

    def log(self, index: int) -> str:
        """What server ``index`` printed (its start line, and any traceback)."""
        path = os.path.join(self.log_dir, f"ps{index}.log")
        if not os.path.exists(path):
            return ""
        with open(path, errors="replace") as f:
            return f.read()

    def alive(self) -> list[bool]:
        return [p.poll() is None for p in self.procs]

    def exited(self) -> list[str]:
        """One line per server process that has exited, naming it: what a launcher should print.

        Example: ``parameter server 1 (127.0.0.1:40123, pid 4242) exited with status -9 (killed by signal 9)``.
        """
        lines = []
        for i, p in enumerate(self.procs):
            code = p.poll()
            if code is None:
                continue
            how = f"status {code}" + (f" (killed by signal {-code})" if code < 0 else "")
            where = self.addrs[i].removeprefix("tcp://") or "not yet serving"
            lines.append(f"parameter server {i} ({where}, pid {p.pid}) exited with {how}")
        return lines

    def restart(self, index: int, timeout: float = 60.0) -> None:
        """Start server ``index`` again, empty, on the address it had (its clients reconnect by themselves).

        Under ``phalanx run --elastic`` the workers then roll back to their last commit, which
        holds its shards. Raises :class:`ServerStartError` if it cannot serve there again.
        """
        port = self.addrs[index].rsplit(":", 1)[1]
        path = os.path.join(self.log_dir, f"ps{index}.addr")
        if os.path.exists(path):
            os.remove(path)
        with open(os.path.join(self.log_dir, f"ps{index}.log"), "a") as log:
            self.procs[index] = subprocess.Popen([*self.cmds[index], "--port", port], env=self.proc_env,
                                                 stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.restarts += 1
        _wait_serving(self, [index], self.addrs[index], timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every server (each writes its checkpoint, if it has one), then SIGKILL stragglers."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> "ServerGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_servers(n: int, host: str = "127.0.0.1", token: str | None = None, *, checkpoint_dir: str | None = None,
                  checkpoint_every: float | None = None, threads: int = 2, timeout: float = 60.0,
                  round_timeout: float | None = None, max_message_mb: int | None = None) -> ServerGroup:
    """Start ``n`` server processes on ``host`` and wait (at most ``timeout`` s) until all serve.

    Unless you pass one, a token is made (``secrets.token_urlsafe``) and handed to the
    workers through ``env()``, on loopback too: other local users then cannot talk to
    the servers (they cannot read our processes' environments). With
    ``checkpoint_dir``, server i keeps its shards in ``checkpoint_dir/ps-shard-i.pt``. It
    resumes from that file when it exists, and writes it when stopped and every
    ``checkpoint_every`` seconds.
    """
    check.positive_int("--servers", n, "Pass the number of parameter servers.")
    if token is None:
        token = secrets.token_urlsafe(24)
    log_dir = tempfile.mkdtemp(prefix="phalanx-ps-")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(TOKEN, None)
    if token:
        env[TOKEN] = token  # through the environment, not argv, which other users can read in `ps`
    procs, cmds = [], []
    for i in range(n):
        cmd = [sys.executable, "-m", "phalanx.ps", "serve", "--host", host, "--index", str(i),
               "--threads", str(threads), "--port-file", os.path.join(log_dir, f"ps{i}.addr")]
        if round_timeout is not None:
            cmd += ["--round-timeout", str(round_timeout)]
        if max_message_mb is not None:
            cmd += ["--max-message-mb", str(max_message_mb)]
        if checkpoint_dir:
            os.makedirs(checkpoint_dir, exist_ok=True)
            cmd += ["--checkpoint", os.path.join(checkpoint_dir, f"ps-shard-{i}.pt")]
            if checkpoint_every:
                cmd += ["--checkpoint-every", str(checkpoint_every)]
        cmds.append(cmd)
        with open(os.path.join(log_dir, f"ps{i}.log"), "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL))
    group = ServerGroup([""] * n, token, procs, log_dir, cmds, env)
    _wait_serving(group, range(n), host, timeout)
    return group


def _wait_serving(group: ServerGroup, indices: Any, host: str, timeout: float) -> None:
    """Wait until servers ``indices`` wrote their address; stop the group and raise if one exits or is late."""
    deadline = time.monotonic() + timeout
    pending = set(indices)
    while pending:
        for i in sorted(pending):
            path = os.path.join(group.log_dir, f"ps{i}.addr")
            if os.path.exists(path):
                group.addrs[i] = open(path).read().strip()
                pending.discard(i)
            elif group.procs[i].poll() is not None:
                text = group.log(i).strip()[-2000:]
                group.stop()
                raise ServerStartError(f"parameter server {i} exited with status {group.procs[i].returncode} "
                                       f"while starting on {host}:\n{text}")
        if pending and time.monotonic() > deadline:
            group.stop()
            raise ServerStartError(f"parameter server(s) {sorted(pending)} did not start within {timeout:g} s; "
                                   "is the machine overloaded?")
        if pending:
            time.sleep(0.05)


# -- under `phalanx run --elastic --servers K` ---------------------------------------------------------------
MAX_RESTARTS = 3  # a server that keeps exiting (out of memory at every start) ends the job after this many


def restart_exited(servers: Any, store: Any, exited: list[str]) -> bool:
    """``phalanx run --elastic --servers K``: start exited servers again on their addresses; False if it cannot.

    Each worker's commit holds the servers' shards (Downpour, async EASGD) or the servers
    hold nothing (synchronous PS), so the workers roll back to their last commit and go
    on. Says so in one line on stderr.
    """
    if servers.restarts >= MAX_RESTARTS:
        return False
    # Counted first: a worker that the new, empty server refuses must already know why.
    store.add(RESTARTS, 1)
    try:
        for i, alive in enumerate(servers.alive()):
            if not alive:
                servers.restart(i)
    except ServerStartError as err:
        print(f"phalanx: elastic: {str(err).splitlines()[0]}", file=sys.stderr, flush=True)
        return False
    print(f"phalanx: elastic: {exited[0]}; started it again on the same address (restart {servers.restarts} of "
          f"at most {MAX_RESTARTS}); the workers roll back to their last commit (and its shards)",
          file=sys.stderr, flush=True)
    return True
