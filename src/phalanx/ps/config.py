"""The one place the parameter-server code reads the environment.

``phalanx run --servers S`` (through :func:`phalanx.ps.launcher.start_servers`) sets:

* ``PHALANX_PS_ADDRS``: comma-separated server addresses, ``tcp://host:port``, in
  server-index order. When it is unset, PS strategies run colocated servers: one
  shard server per worker, in a thread of the worker (as BytePS does).
* ``PHALANX_PS_TOKEN``: the per-job secret; required by servers on any interface
  other than loopback.
* ``PHALANX_PS_TIMEOUT``: seconds a client waits for a server's answer (default 30).
* ``PHALANX_PS_HOST``: the interface colocated servers bind to (default 127.0.0.1).

Example:
    >>> PSConfig.from_environ({"PHALANX_PS_ADDRS": "tcp://127.0.0.1:5000,tcp://127.0.0.1:5001"}).addrs
    ('tcp://127.0.0.1:5000', 'tcp://127.0.0.1:5001')
"""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Mapping

from .. import check
from ..errors import ConfigError, usage

DEFAULT_TIMEOUT_S = 30.0
ADDRS, TOKEN, TIMEOUT, HOST = "PHALANX_PS_ADDRS", "PHALANX_PS_TOKEN", "PHALANX_PS_TIMEOUT", "PHALANX_PS_HOST"


@dataclass(frozen=True)
class PSConfig:
    addrs: tuple[str, ...] = ()  # empty: colocated servers
    token: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    host: str = "127.0.0.1"

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "PSConfig":
        env = os.environ if env is None else env
        addrs = tuple(a.strip() for a in env.get(ADDRS, "").split(",") if a.strip())
        for a in addrs:
            check_addr(a, ADDRS)
        raw = env.get(TIMEOUT)
        timeout = DEFAULT_TIMEOUT_S if raw is None else check.parse_float(TIMEOUT, raw, f"Set {TIMEOUT}=30.")
        return cls(addrs=addrs, token=env.get(TOKEN) or None, timeout_s=timeout, host=env.get(HOST, "127.0.0.1"))


def check_addr(addr: str, where: str = "address") -> str:
    """``tcp://host:port`` with a port in range; anything else is a :class:`ConfigError`."""
    host, _, port = addr.removeprefix("tcp://").rpartition(":")
    if not addr.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(usage(f"{where} {addr!r}", "tcp://HOST:PORT, e.g. tcp://127.0.0.1:5555",
                                f"Fix {where}, or let `phalanx run --servers N` set it."))
    return addr


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``: interfaces no other machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name or a wildcard such as "*": treat it as reachable from outside
