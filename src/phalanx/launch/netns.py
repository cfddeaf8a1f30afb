"""A rate-limited link between workers: two network namespaces joined by a veth pair.

Each end is shaped with ``tc qdisc add dev IF root tbf rate RATE burst 64kb latency 50ms``
(``netem`` is not available in this kernel, so there is no added delay). Workers of
even rank run in namespace A, odd ranks in B, via ``ip netns exec NS env ...`` with
``MASTER_ADDR`` set to A's address and ``GLOO_SOCKET_IFNAME`` to their veth end, so
all their traffic crosses the shaped link. Nothing outside the two namespaces is
touched: the addresses are private to them.

Names carry the creating process's pid, so parallel runs do not clash, and leftovers
of a run that was killed with SIGKILL are removed by the next run (only our own
``phxb<pid>`` namespaces whose pid is gone).

Teardown always happens: on normal exit, on an exception, on Ctrl-C and on SIGTERM
or SIGHUP (turned into exceptions while the link is up), and at interpreter exit.

``phalanx bench --link`` and ``phalanx run --link`` (:mod:`phalanx.launch.linked`) build their links here.

Example (as root):
    >>> with Link("100mbit") as link:                                  # doctest: +SKIP
    ...     subprocess.run(link.prefix(1) + ["ping", "-c1", link.addresses[0]])
"""
from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import signal
import subprocess
from typing import Any

from ..errors import ConfigError, PhalanxError, usage

PREFIX = "phxb"
SUBNET = "10.231.7"  # private to the two namespaces; never routed anywhere else


class LinkError(PhalanxError, RuntimeError):
    """The shaped link cannot be built here (not root, no `ip`/`tc`, no netns support)."""


def parse_rate(text: str, *, expected: str = "loopback or a rate such as 100mbit, 1gbit, 500kbit",
               fix: str = "Pass e.g. --link loopback,100mbit.") -> str:
    """Normalise a link name such as ``100mbit``, ``1gbit``, ``500kbit`` to tc's spelling.

    Example:
        >>> parse_rate("100Mbit"), parse_rate("1.5gbit")
        ('100mbit', '1.5gbit')
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(usage(f"link {text!r}", expected, fix))
    return f"{m.group(1)}{m.group(2)}"


def why_not(fallback: str = "use --link loopback") -> str | None:
    """None when a link can be built here, else the reason in words, ending with ``fallback``."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return f"building network namespaces and tc shaping needs root (CAP_NET_ADMIN); run as root, or {fallback}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed; install iproute2 or {fallback}"
    return None


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode:
        raise LinkError(f"`{' '.join(args)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def cleanup_stale() -> list[str]:
    """Delete our namespaces left by runs whose process is gone; returns their names."""
    proc = _sh("ip", "netns", "list", check=False)
    gone = []
    for line in proc.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)(?:x\d+)?[ab]", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _sh("ip", "netns", "del", name, check=False)
            gone.append(name)
    return gone


class _Interrupted(KeyboardInterrupt):
    """SIGTERM/SIGHUP while the link is up: unwinds like Ctrl-C so ``finally`` blocks run."""


class Link:
    """Two namespaces, a veth pair and tbf on both ends; a context manager that always tears down."""

    def __init__(self, rate: str, *, burst: str = "64kb", latency: str = "50ms", tag: str | None = None) -> None:
        self.rate = parse_rate(rate)
        self.burst, self.latency = burst, latency
        tag = tag or str(os.getpid())
        if not re.fullmatch(r"\d+(x\d)?", tag):
            raise ValueError(f"tag {tag!r}; expected PID or PIDxI (it names interfaces, 15 characters at most)")
        self.namespaces = (f"{PREFIX}{tag}a", f"{PREFIX}{tag}b")
        self.interfaces = (f"phxv{tag}a", f"phxv{tag}b")
        self.addresses = (f"{SUBNET}.1", f"{SUBNET}.2")
        self.token = secrets.token_hex(16)  # parameter servers off loopback demand one
        self.is_up = False
        self._old_handlers: dict[int, Any] = {}

    # -- building -------------------------------------------------------------------
    def up(self) -> "Link":
        reason = why_not()
        if reason:
            raise LinkError(f"cannot build the {self.rate} link: {reason}")
        cleanup_stale()
        self.is_up = True  # from here on, down() has something to undo
        try:
            (a, b), (va, vb) = self.namespaces, self.interfaces
            _sh("ip", "netns", "add", a)
            _sh("ip", "netns", "add", b)
            _sh("ip", "link", "add", va, "netns", a, "type", "veth", "peer", "name", vb, "netns", b)
            for ns, iface, addr in zip(self.namespaces, self.interfaces, self.addresses, strict=True):
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
                _sh("ip", "-n", ns, "link", "set", iface, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, "root", "tbf",
                    "rate", self.rate, "burst", self.burst, "latency", self.latency)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Delete both namespaces (which deletes the veth pair and its qdiscs); safe to repeat."""
        if not self.is_up:
            return
        for ns in self.namespaces:
            _sh("ip", "netns", "del", ns, check=False)
        _sh("ip", "link", "del", self.interfaces[0], check=False)  # only if creation stopped half-way
        self.is_up = False

    def exists(self) -> bool:
        listed = _sh("ip", "netns", "list", check=False).stdout
        return any(line.split()[0] in self.namespaces for line in listed.splitlines() if line.split())

    # -- using ---------------------------------------------------------------------
    def side(self, rank: int) -> int:
        return rank % 2

    def prefix(self, rank: int) -> list[str]:
        """Command prefix that runs a program inside ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[self.side(rank)]]

    def env(self, rank: int) -> dict[str, str]:
        """Variables for a worker of ``rank``: rank 0's address as master, this side's veth for gloo."""
        side = self.side(rank)
        iface = self.interfaces[side]
        return {"MASTER_ADDR": self.addresses[0], "GLOO_SOCKET_IFNAME": iface, "TP_SOCKET_IFNAME": iface,
                "PHALANX_BENCH_IFACE": iface, "PHALANX_PS_HOST": self.addresses[side],  # colocated PS servers
                "PHALANX_PS_TOKEN": self.token}

    def tx_bytes(self) -> int:
        """Bytes both veth ends have sent so far (headers included: everything that crossed the link)."""
        total = 0
        for ns, iface in zip(self.namespaces, self.interfaces, strict=True):
            out = _sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{iface}/statistics/tx_bytes").stdout
            total += int(out.strip() or 0)
        return total

    # -- context manager: teardown on every way out -----------------------------------
    def __enter__(self) -> "Link":
        atexit.register(self.down)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: rely on finally/atexit
                pass
        return self.up()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.down()
        finally:
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers.clear()
            atexit.unregister(self.down)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        raise _Interrupted(f"signal {signum}")

    def __repr__(self) -> str:
        return f"Link({self.rate!r}, namespaces={self.namespaces})"
