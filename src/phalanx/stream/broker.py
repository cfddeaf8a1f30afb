"""A throwaway redis-server for tests and the demo: unix socket, temporary directory, no persistence.

Example::

    with RedisServer() as server:
        source = RedisStream(server.url, stream="events", decode=decode_sample, create=True)
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

from .source import StreamError


class RedisServer:
    """Start ``redis-server`` on a unix socket in a fresh temporary directory; :meth:`stop` removes it all."""

    def __init__(self, *, start_timeout_s: float = 10.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise StreamError("redis-server not found on PATH; expected the Debian package redis-server. "
                              "Install it: apt-get install -y redis-server (as root), or `make setup`.")
        self.dir = tempfile.mkdtemp(prefix="phalanx-redis-")
        self.socket = os.path.join(self.dir, "redis.sock")
        self.url = f"unix://{self.socket}"
        args = [exe, "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700", "--dir", self.dir,
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
        self.log = open(os.path.join(self.dir, "redis.log"), "w+b")
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        import redis
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                if redis.Redis(unix_socket_path=self.socket, socket_timeout=1.0).ping():
                    return
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                time.sleep(0.05)
        self.log.seek(0)
        tail = self.log.read()[-500:].decode(errors="replace")
        self.stop()
        raise StreamError(f"redis-server did not answer PING on {self.socket} within {timeout_s:.0f}s; expected "
                          f"it to start. Its log: {tail!r}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and delete its directory."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
