"""Ports for a store or page a process starts next: ones no outgoing connection takes meanwhile.

Example:
    >>> from phalanx.launch.ports import LOWEST_PORT, free_port
    >>> LOWEST_PORT <= free_port() < 65536
    True
"""
from __future__ import annotations

import random
import socket

LOWEST_PORT = 20000  # above the ports Ray's workers take (10002-19999 by default)


def free_port(host: str = "") -> int:
    """A TCP port nobody on this machine listens on or connects from, for a store or page started next.

    Not one the kernel picks for ``bind(0)``: that comes from its ephemeral range, where every
    outgoing connection's local port comes from too, so a client socket elsewhere (another
    job's store client) could take it before the process meant to listen there binds it
    (EADDRINUSE, seen in a clean-clone CI run). Below that range only a deliberate bind takes a port: one is drawn
    at random there and probed.

    Example:
        >>> LOWEST_PORT <= free_port() < 65536
        True
    """
    low = _ephemeral_low()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    draw = random.SystemRandom()
    for _ in range(64 if low - LOWEST_PORT >= 1000 else 0):
        port = draw.randrange(LOWEST_PORT, low)
        with socket.socket(family) as s:
            try:
                s.bind((host, port))  # "": every address, a port bound on any one of them is taken
            except OSError:
                continue
        return port
    with socket.socket(family) as s:  # an unusual range (or a crowded one): the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The kernel's lowest ephemeral port (Linux's default when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
