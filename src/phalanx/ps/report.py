"""Load per server: bytes, requests and imbalance, measured by the servers themselves.

``load_report(strategy)`` (or a :class:`~phalanx.ps.launcher.ServerGroup`, or a list of
addresses) asks every server for its counters. ``python -m phalanx.bench.placement`` prints
how round-robin and greedy placement spread the reference models over 2 to 4 servers.

Example:
    >>> from phalanx.ps.server import Server
    >>> server = Server().start()
    >>> load_report([server.address]).requests  # the stats request itself counts
    [1]
    >>> server.stop()
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from .client import Client
from .config import PSConfig
from .placement import imbalance


@dataclass
class LoadReport:
    """Counters per server (index = server), as the servers counted them, over all workers."""

    addrs: list[str]
    bytes_in: list[int]
    bytes_out: list[int]
    requests: list[int]
    bytes_held: list[int]
    applied: list[int]  # shard updates applied (a push to a server updates each of its shards once)
    dropped_stale: list[int]
    rejected: list[int]
    shards: list[int]

    @property
    def bytes_imbalance(self) -> float:
        """max / mean of the bytes each server received and sent."""
        return imbalance([i + o for i, o in zip(self.bytes_in, self.bytes_out, strict=True)])

    @property
    def requests_imbalance(self) -> float:
        return imbalance(self.requests)

    @property
    def held_imbalance(self) -> float:
        """max / mean of the parameter bytes each server holds (what placement decided)."""
        return imbalance(self.bytes_held)

    def as_dict(self) -> dict[str, Any]:
        return {"addrs": self.addrs, "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "requests": self.requests, "bytes_held": self.bytes_held, "applied": self.applied,
                "dropped_stale": self.dropped_stale, "rejected": self.rejected, "shards": self.shards,
                "bytes_imbalance": self.bytes_imbalance, "requests_imbalance": self.requests_imbalance,
                "held_imbalance": self.held_imbalance}

    def markdown(self) -> str:
        rows = ["| server | MB in | MB out | requests | MB held | applied | dropped stale |",
                "|---|---|---|---|---|---|---|"]
        for i, _addr in enumerate(self.addrs):
            rows.append(f"| {i} | {self.bytes_in[i] / 1e6:.1f} | {self.bytes_out[i] / 1e6:.1f} | {self.requests[i]} "
                        f"| {self.bytes_held[i] / 1e6:.2f} | {self.applied[i]} | {self.dropped_stale[i]} |")
        rows.append(f"\nimbalance (max/mean): bytes {self.bytes_imbalance:.3f}, requests "
                    f"{self.requests_imbalance:.3f}, held {self.held_imbalance:.3f}")
        return "\n".join(rows)


@contextlib.contextmanager
def _client_for(source: Any, token: str | None, timeout: float | None) -> Iterator[Client]:
    """The strategy's own client, or a fresh one for a ServerGroup or a list of addresses."""
    link = getattr(source, "link", None)
    if link is not None and not link.released:
        yield link.client
        return
    cfg = PSConfig.from_environ()
    client = Client(list(getattr(source, "addrs", source)), timeout=timeout or cfg.timeout_s,
                    token=token or getattr(source, "token", None) or cfg.token)
    try:
        yield client
    finally:
        client.close()


def load_report(source: Any, *, token: str | None = None, timeout: float | None = None) -> LoadReport:
    """Ask every server of ``source`` for its counters.

    ``source``: a PS strategy after ``px.wrap`` (and before ``finish()``), a ServerGroup,
    or a list of addresses (``token`` defaults to ``PHALANX_PS_TOKEN``).
    """
    with _client_for(source, token, timeout) as client:
        replies = client.broadcast({"op": "stats"})
        stats = [replies[s].control for s in range(len(client.addrs))]
        addrs = list(client.addrs)
    pick = lambda key: [int(st.get(key, 0)) for st in stats]  # noqa: E731
    return LoadReport(addrs, pick("bytes_in"), pick("bytes_out"), pick("requests"), pick("bytes_held"),
                      pick("applied"), pick("dropped_stale"), pick("rejected"), pick("shards"))


def save_shards(source: Any, *, token: str | None = None, timeout: float | None = None) -> None:
    """Make every server of ``source`` write its shard checkpoint now (each needs ``--checkpoint``)."""
    with _client_for(source, token, timeout) as client:
        client.broadcast({"op": "save"})
