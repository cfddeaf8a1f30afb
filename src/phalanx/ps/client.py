"""The worker's side: one DEALER socket per server, and the table of its parameters' shards.

:class:`Client` sends one request to each server involved and then waits for all the
answers together. So a step costs one round trip, however many servers there are.
Every wait is bounded: a server that does not answer in time raises
:class:`ServerUnreachable`, naming its address.

:class:`ParamTable` cuts the model's parameters into the placement's pieces. It keeps
the version of every shard this worker last pulled.

Example:
    >>> from phalanx.ps.server import Server
    >>> server = Server().start()
    >>> client = Client([server.address], timeout=5)
    >>> client.call({0: ({"op": "info"}, [])})[0].control["shards"]
    0
    >>> client.close(); server.stop()
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import zmq

from ..errors import PhalanxError
from .config import TIMEOUT, check_addr
from .placement import Piece, specs
from .shards import Policy
from .wire import Header, Message, recv_message, send_message

Request = tuple[dict[str, Any], Sequence[tuple[Header, torch.Tensor]]]


class PSError(PhalanxError, RuntimeError):
    """A parameter server refused a request (the message says why); its state is unchanged."""


class ServerUnreachable(PSError):
    """A parameter server did not answer within the timeout."""


@dataclass
class Traffic:
    """What this client exchanged with each server (index = server)."""

    bytes_sent: list[int] = field(default_factory=list)
    bytes_received: list[int] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    seconds: float = 0.0  # wall time spent waiting for servers


class Client:
    """Requests to a list of servers, answered in parallel within ``timeout`` seconds."""

    def __init__(self, addrs: Sequence[str], *, token: str | None = None, timeout: float = 30.0) -> None:
        self.addrs = [check_addr(a) for a in addrs]
        if not self.addrs:
            raise PSError("no parameter-server addresses; expected at least one tcp://HOST:PORT")
        self.timeout = float(timeout)
        self._token = (token or "").encode()
        self._ctx = zmq.Context()
        self._socks = [self._connect(a) for a in self.addrs]
        self._next_id = 0
        n = len(self.addrs)
        self.traffic = Traffic([0] * n, [0] * n, [0] * n)

    def _connect(self, addr: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        return sock

    def call(self, requests: dict[int, Request], *, timeout: float | None = None) -> dict[int, Message]:
        """Send ``{server: (control, tensors)}`` and return ``{server: reply}``, all or an error."""
        start = time.perf_counter()
        ids = {}
        for s, (control, tensors) in requests.items():
            self._next_id += 1
            ids[s] = self._next_id
            self.traffic.bytes_sent[s] += send_message(self._socks[s], {**control, "id": self._next_id}, tensors,
                                                       prefix=[self._token])
            self.traffic.requests[s] += 1
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        poller = zmq.Poller()
        for s in ids:
            poller.register(self._socks[s], zmq.POLLIN)
        replies: dict[int, Message] = {}
        while len(replies) < len(ids):
            remaining = deadline - time.monotonic()
            ready = dict(poller.poll(max(0, int(remaining * 1000)))) if remaining > 0 else {}
            if not ready:
                break
            for s in ids:
                if s not in replies and self._socks[s] in ready:
                    msg = recv_message(self._socks[s])
                    self.traffic.bytes_received[s] += msg.nbytes
                    # id None: the server could not read our request (token, framing); else match the id,
                    # so a late answer to a request we gave up on is dropped.
                    if msg.control.get("id") in (ids[s], None):
                        replies[s] = msg
                        poller.unregister(self._socks[s])
        self.traffic.seconds += time.perf_counter() - start
        missing = [s for s in ids if s not in replies]
        if missing:
            for s in missing:  # a fresh socket: whatever was queued for the lost server is dropped
                self._socks[s].close(linger=0)
                self._socks[s] = self._connect(self.addrs[s])
            op = next(iter(requests.values()))[0].get("op")
            raise ServerUnreachable(
                f"no answer from parameter server {', '.join(self.addrs[s] for s in missing)} within {limit:g} s "
                f"(op {op!r}). Is it running and reachable from here? Check the address (PHALANX_PS_ADDRS, set by "
                f"`phalanx run --servers N`); if it is only slow, raise {TIMEOUT}.")
        for s, msg in replies.items():
            if not msg.control.get("ok"):
                raise PSError(f"parameter server {self.addrs[s]} refused {requests[s][0].get('op')!r}: "
                              f"{msg.control.get('error')}")
        return replies

    def broadcast(self, control: dict[str, Any]) -> dict[int, Message]:
        """The same tensor-less request to every server."""
        return self.call({s: (control, []) for s in range(len(self.addrs))})

    def close(self) -> None:
        for sock in self._socks:
            sock.close(linger=0)
        self._ctx.term()


class ParamTable:
    """A worker's parameters, cut into shards by placement; each exchange is one request per server."""

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], client: Client, placement: Any) -> None:
        self.client = client
        self.params = [p for _, p in named]
        self.index = {name: i for i, (name, _) in enumerate(named)}
        self.pieces: list[Piece] = placement.place(specs(named), len(client.addrs))
        self.by_server = [[p for p in self.pieces if p.server == s] for s in range(len(client.addrs))]
        self.by_name = {p.name: p for p in self.pieces}
        self.versions = {p.name: 0 for p in self.pieces}

    def _view(self, tensors: Sequence[torch.Tensor], piece: Piece) -> torch.Tensor:
        t = tensors[self.index[piece.var]].detach()
        return t if piece.whole else t.reshape(-1)[piece.start:piece.stop]

    def _frames(self, tensors: Sequence[torch.Tensor], server: int) -> list[tuple[Header, torch.Tensor]]:
        return [(Header.of(p.name, view, self.versions[p.name]), view)
                for p in self.by_server[server] for view in [self._view(tensors, p)]]

    def _call(self, op: dict[str, Any], tensors: Sequence[torch.Tensor] | None) -> dict[int, Message]:
        busy = [s for s, pieces in enumerate(self.by_server) if pieces]
        return self.client.call({s: (op, self._frames(tensors, s) if tensors is not None else []) for s in busy})

    def _received(self, reply: Message) -> list[tuple[Piece, Header, torch.Tensor]]:
        out = []
        for header, value in reply.tensors:
            piece = self.by_name.get(header.name)
            if piece is None or value.numel() != piece.stop - piece.start:
                raise PSError(f"a server answered with shard {header.name!r} {list(header.shape)}, which this "
                              "worker's placement does not have; do all workers use the same model and placement?")
            out.append((piece, header, value))
        return out

    def _load(self, replies: dict[int, Message], into: Sequence[torch.Tensor], *, versions: bool) -> None:
        for reply in replies.values():
            for piece, header, value in self._received(reply):
                view = self._view(into, piece)
                view.copy_(value.view_as(view))
                if versions:
                    self.versions[piece.name] = header.version

    def register(self, policy: Policy) -> bool:
        """Create the shards that do not exist yet, then pull: the first worker's values win.

        Returns False when some shard already existed with another policy (a late joiner
        asked for different rules; the server's stay in force).
        """
        replies = self._call({"op": "init", "policy": policy.spec()}, self.params)
        self.pull()
        return all(r.control.get("same_policy", True) for r in replies.values())

    def pull(self) -> None:
        """Overwrite the local parameters with the servers' values."""
        replies = {s: ({"op": "pull", "names": [p.name for p in pieces]}, [])
                   for s, pieces in enumerate(self.by_server) if pieces}
        self._load(self.client.call(replies), self.params, versions=True)

    def push(self, grads: Sequence[torch.Tensor], *, pull: bool) -> int:
        """Send gradients (stamped with the versions they were computed from); returns how many shards dropped it."""
        replies = self._call({"op": "push", "pull": pull}, grads)
        if pull:
            self._load(replies, self.params, versions=True)
        return sum(len(r.control.get("dropped", [])) for r in replies.values())

    def elastic(self, alpha: float) -> None:
        """Asynchronous EASGD: the servers move the centre toward us by ``d``; we move by ``-d``."""
        for reply in self._call({"op": "elastic", "alpha": alpha}, self.params).values():
            for piece, _, d in self._received(reply):
                view = self._view(self.params, piece)
                view.sub_(d.view_as(view))

    def reduce(self, grads: Sequence[torch.Tensor], *, step: int, workers: int) -> None:
        """Synchronous mode: replace ``grads`` by their mean over all ``workers``."""
        self._load(self._call({"op": "reduce", "step": step, "workers": workers}, grads), grads, versions=False)
