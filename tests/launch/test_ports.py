"""phalanx.launch.ports: the port picked for a store or page started next."""
from __future__ import annotations

import socket

from phalanx.launch import ports


def test_free_port_lies_below_the_range_outgoing_connections_take_theirs_from_and_binds():
    low = ports._ephemeral_low()
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST_PORT <= port < low  # no client socket's local port: only a deliberate bind takes it
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

        monkeypatch.setattr(ports.random, "SystemRandom", Draw)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65536)
        monkeypatch.setattr(ports, "LOWEST_PORT", 1024)
        assert ports.free_port() == busy + 1
