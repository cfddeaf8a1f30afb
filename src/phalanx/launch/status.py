"""``phalanx run --status``: the launcher's side of the status page (:mod:`phalanx.monitor`).

The port is bound before anything starts, so a port in use refuses the job in one line
naming it. Once the launcher holds the job's store and its secret, :meth:`JobStatus.attach`
starts reading the workers' summaries and answering, and prints the link (its token is an
HMAC of the job's secret: keep it as you keep the secret). When the job ends, the page
learns the exit status and the launcher's last ``phalanx:`` line, which says why.

Example:
    >>> from phalanx.launch.config import RunConfig
    >>> JobStatus.open(RunConfig(script="train.py")) is None  # no --status
    True
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Iterator, TextIO

from ..elastic import secret as job_secret
from ..errors import ConfigError, usage
from ..monitor import Collector, StatusServer, parse_address, token
from ..monitor.collect import Members
from ..group.stacks import ANSWER_S, blocks, request_stacks
from .config import RunConfig
from .stacks import connect


class JobStatus:
    """The status server of one ``phalanx run`` and, once attached, the collector it shows."""

    def __init__(self, server: StatusServer) -> None:
        self.server = server
        self.collector: Collector | None = None
        self.secret = ""  # the job's, once attached (the stacks button asks with it)
        self.last_line = ""  # the launcher's last `phalanx:` line: why the job ended

    @classmethod
    def open(cls, cfg: RunConfig) -> "JobStatus | None":
        """Bind ``--status``'s port now (None without ``--status``); a port in use is one ConfigError naming it."""
        return None if cfg.status is None else cls.bind(*cfg.status)

    @classmethod
    def bind(cls, host: str, port: int, flag: str = "--status") -> "JobStatus":
        """A status server bound on ``host:port`` now; a port in use is one ConfigError naming it."""
        try:
            return cls(StatusServer(host, port))
        except OSError as err:
            raise ConfigError(usage(f"{flag} {host}:{port}: port {port} cannot be served on {host} "
                                    f"({err.strerror or err})", "a free port on an address of this host",
                                    f"Pick another port (or stop what holds port {port}); nothing was started."))\
                from None

    @staticmethod
    def link(address: tuple[str, int], secret: str) -> str:
        """The link a holder of ``secret`` opens for the page served on ``address``."""
        host = f"[{address[0]}]" if ":" in address[0] else address[0]
        return f"http://{host}:{address[1]}/?token={token(secret)}"

    def attach(self, store: Any, members: Members, secret: str | None = None,
               checkpoint: Callable[[Any], str | None] = lambda store: None, announce: bool = True) -> None:
        """Serve the job in ``store``: ``members(store)`` says who is in it; ``secret``: the job's (None: made now);
        ``announce``: print the link (the Ray driver prints it itself)."""
        secret = secret or os.environ.get(job_secret.ENV) or job_secret.make()
        self.secret = secret
        self.collector = Collector(store, members, checkpoint, clone=True).start()
        self.server.serve(self.collector.status, token(secret))
        if announce:
            print(f"phalanx: status page at {self.server.url} (also /status.json and /metrics with the header "
                  "`Authorization: Bearer <token>`; the token comes from the job's secret: keep the link private)",
                  file=sys.stderr, flush=True)

    def follow(self, store: Any, host: str, port: int) -> None:
        """The job's store moved to ``host:port`` (a standby took over, :mod:`.standby`): the page reads it there,
        its history kept, and its "stacks" button asks there."""
        if self.collector is None:
            return
        self.collector.move(store)
        if "stacks" in self.server.actions:
            self.action("stacks", stacks_button(host, port, self.secret))

    def action(self, name: str, fn: Callable[[], str]) -> None:
        """Add a button ``name`` to the page: it runs ``fn()`` here and shows the text it returns (e.g. "stacks":
        every worker's Python stacks). Only the token's holder can press it (``POST /action/<name>``)."""
        self.server.actions[name] = fn

    @contextlib.contextmanager
    def watching_stderr(self) -> Iterator[None]:
        """Keep the launcher's last ``phalanx:`` line (the reason the job ended) while passing everything through."""
        real = sys.stderr
        sys.stderr = _Tee(real, self)  # type: ignore[assignment]
        try:
            yield
        finally:
            sys.stderr = real

    def settle(self) -> None:
        """Read the workers' last reports now: the launcher calls it before it closes the job's store."""
        if self.collector is not None:
            self.collector.settle()

    def end(self, code: int, reason: str | None = None) -> None:
        """The job ended with ``code``: the page says so (and why), then the server goes."""
        reason = reason or self.last_line or ("training finished" if code == 0
                                              else f"the launcher exited with status {code}")
        if self.collector is not None:
            self.collector.end(code, reason)
            self.server.ended()
        self.server.close()


class _Tee:
    """sys.stderr that notes the last line starting with ``phalanx:``."""

    def __init__(self, real: TextIO, status: JobStatus) -> None:
        self.real, self.status = real, status

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.startswith("phalanx:") and "status page at" not in line:
                self.status.last_line = line[len("phalanx:"):].strip()
        return self.real.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def stacks_button(host: str, port: int, secret: str) -> Callable[[], str]:
    """The page's "stacks" button: every worker's Python stacks, one block per rank, as ``phalanx stacks`` prints
    them (:mod:`phalanx.launch.stacks`), on a store connection of its own for each press."""
    def press() -> str:
        got = request_stacks(connect(host, port), secret, timeout_s=ANSWER_S)
        return "\n".join(blocks(got, ANSWER_S))
    return press


def status_address(value: str | int | None, flag: str) -> tuple[str, int] | None:
    """``[HOST:]PORT`` (or a port number) -> (host, port); one ConfigError line for anything else.

    Example:
        >>> status_address(8080, "status="), status_address(None, "status=")
        (('127.0.0.1', 8080), None)
    """
    if value is None:
        return None
    try:
        return parse_address(str(value))
    except ValueError:
        raise ConfigError(usage(f"{flag}{value!r}" if flag.endswith("=") else f"{flag} {value}",
                                "[HOST:]PORT, e.g. 8080 or 0.0.0.0:8080",
                                "Pass a port number, with the host to listen on if not loopback.")) from None


def run_with_status(cfg: RunConfig, body: Callable[["JobStatus | None"], int]) -> int:
    """Run ``body(status)`` (the job) with ``--status``'s server around it; returns the job's exit status."""
    status = JobStatus.open(cfg)  # before anything starts: a port in use refuses the job
    if status is None:
        return body(None)
    code = 1
    try:
        with status.watching_stderr():
            code = body(status)
    finally:
        status.end(code)
    return code


__all__ = ["JobStatus", "run_with_status", "stacks_button", "status_address"]
