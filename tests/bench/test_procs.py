"""phalanx.bench.procs: the port it picks for a worker group's store."""
from __future__ import annotations

import socket

from phalanx.bench import procs


def test_free_port_lies_below_the_range_outgoing_connections_take_theirs_from_and_binds():
    low = procs._ephemeral_low()
    for _ in range(20):
        port = procs.free_port()
        assert procs.LOWEST_PORT <= port < low  # no client socket's local port: only a deliberate bind takes it
        with socket.socket() as s:
            s.bind(("", port))


def test_a_port_someone_listens_on_is_drawn_again(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        draws = iter([busy, busy, busy + 1])

        class Draw:
            def randrange(self, start, stop):
                return next(draws)

        monkeypatch.setattr(procs.random, "SystemRandom", Draw)
        monkeypatch.setattr(procs, "_ephemeral_low", lambda: 65536)
        monkeypatch.setattr(procs, "LOWEST_PORT", 1024)
        assert procs.free_port() == busy + 1
