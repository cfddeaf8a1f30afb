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
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..errors import PhalanxError, WorkerLostError
from .config import TIMEOUT, check_addr
from .placement import Piece, specs
from .shards import STATE_SEP, Policy
from .wire import Header, Message, recv_message, require_zmq, send_message

if TYPE_CHECKING:
    import zmq

ABANDON_POLL_S = 0.25

Request = tuple[dict[str, Any], Sequence[tuple[Header, torch.Tensor]]]


class PSError(PhalanxError, RuntimeError):
    """A parameter server refused a request (the message says why); its state is unchanged."""


class ServerUnreachable(PSError):
    """A parameter server did not answer within the timeout.

    ``servers`` holds the silent servers' indices (their place in ``PHALANX_PS_ADDRS``)
    and ``addrs`` their addresses; the message names both.
    """

    def __init__(self, message: str, servers: Sequence[int] = (), addrs: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.servers, self.addrs = list(servers), list(addrs)


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
        self._zmq = zmq = require_zmq()
        self._ctx = zmq.Context()
        self._socks = [self._connect(a) for a in self.addrs]
        self._next_id = 0
        n = len(self.addrs)
        self.traffic = Traffic([0] * n, [0] * n, [0] * n)
        # Under --elastic: why every answer will be lost or refused (a server was restarted empty), or None.
        self.abandon: Callable[[], str | None] | None = None

    def _connect(self, addr: str) -> "zmq.Socket":
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        return sock

    def call(self, requests: dict[int, Request], *, timeout: float | None = None,
             abandon: Callable[[], str | None] | None = None) -> dict[int, Message]:
        """Send ``{server: (control, tensors)}`` and return ``{server: reply}``, all or an error.

        ``abandon``, asked every quarter second while we wait, may return why the answer will
        never come (under ``--elastic``: a worker of the synchronous round died); we then stop
        waiting and raise :class:`~phalanx.WorkerLostError` with that reason.
        """
        start = time.perf_counter()
        abandon = abandon if abandon is not None else self.abandon
        ids = {}
        for s, (control, tensors) in requests.items():
            self._next_id += 1
            ids[s] = self._next_id
            self.traffic.bytes_sent[s] += send_message(self._socks[s], {**control, "id": self._next_id}, tensors,
                                                       prefix=[self._token])
            self.traffic.requests[s] += 1
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        poller = self._zmq.Poller()
        for s in ids:
            poller.register(self._socks[s], self._zmq.POLLIN)
        replies: dict[int, Message] = {}
        given_up = None
        while len(replies) < len(ids):
            remaining = deadline - time.monotonic()
            if abandon is not None:
                remaining = min(remaining, ABANDON_POLL_S)
            ready = dict(poller.poll(max(0, int(remaining * 1000)))) if remaining > 0 else {}
            if not ready:
                given_up = abandon() if abandon is not None else None
                if given_up is None and abandon is not None and time.monotonic() < deadline:
                    continue
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
            if given_up is not None:
                raise WorkerLostError(given_up)
            op = next(iter(requests.values()))[0].get("op")
            names = ", ".join(f"{s} ({self.addrs[s].removeprefix('tcp://')})" for s in missing)
            raise ServerUnreachable(
                f"no answer from parameter server {names} within {limit:g} s (op {op!r}). Has it exited? "
                f"Is it reachable from here? Check the address (PHALANX_PS_ADDRS, set by `phalanx run --servers N`); "
                f"if it is only slow, raise {TIMEOUT}.", missing, [self.addrs[s] for s in missing])
        for s, msg in replies.items():
            if not msg.control.get("ok"):
                given_up = abandon() if abandon is not None else None
                if given_up is not None:  # refused by a server started again, empty: the group rolls back
                    raise WorkerLostError(given_up)
                raise PSError(f"parameter server {s} ({self.addrs[s]}) refused {requests[s][0].get('op')!r}: "
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
    """A worker's parameters, cut into shards by placement; each exchange is one request per server.

    A piece is a range of the parameter's elements in logical (row-major) order. A
    parameter whose memory is laid out otherwise (``channels_last``) is read through a
    contiguous copy, and what comes back is written through ``copy_`` into the parameter
    itself, so no update lands in a temporary.
    """

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], client: Client, placement: Any) -> None:
        self.client = client
        self.params = [p for _, p in named]
        self.index = {name: i for i, (name, _) in enumerate(named)}
        self.pieces: list[Piece] = placement.place(specs(named), len(client.addrs))
        self.by_server = [[p for p in self.pieces if p.server == s] for s in range(len(client.addrs))]
        self.by_name = {p.name: p for p in self.pieces}
        self.versions = {p.name: 0 for p in self.pieces}

    def _view(self, tensors: Sequence[torch.Tensor], piece: Piece) -> torch.Tensor:
        """What to send for ``piece`` (read only: for a non-contiguous tensor this is a copy)."""
        t = tensors[self.index[piece.var]].detach()
        return t if piece.whole else t.reshape(-1)[piece.start:piece.stop]

    def _frames(self, tensors: Sequence[torch.Tensor], server: int) -> list[tuple[Header, torch.Tensor]]:
        return [(Header.of(p.name, view, self.versions[p.name]), view)
                for p in self.by_server[server] for view in [self._view(tensors, p)]]

    def _call(self, op: dict[str, Any], tensors: Sequence[torch.Tensor] | None,
              **kwargs: Any) -> dict[int, Message]:
        busy = [s for s, pieces in enumerate(self.by_server) if pieces]
        return self.client.call({s: (op(s) if callable(op) else op,
                                     self._frames(tensors, s) if tensors is not None else []) for s in busy},
                                **kwargs)

    def _received(self, reply: Message) -> list[tuple[Piece, Header, torch.Tensor]]:
        out = []
        for header, value in reply.tensors:
            piece = self.by_name.get(header.name)
            if piece is None or value.numel() != piece.stop - piece.start:
                raise PSError(f"a server answered with shard {header.name!r} {list(header.shape)}, which this "
                              "worker's placement does not have; do all workers use the same model and placement?")
            out.append((piece, header, value))
        return out

    def _write(self, into: Sequence[torch.Tensor], received: Sequence[tuple[Piece, torch.Tensor]],
               update: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
        """``update(target, value)`` on each piece's elements of ``into``, in place in the tensors themselves."""
        by_var: dict[str, list[tuple[Piece, torch.Tensor]]] = defaultdict(list)
        for piece, value in received:
            by_var[piece.var].append((piece, value))
        with torch.no_grad():
            for var, items in by_var.items():
                t = into[self.index[var]].detach()
                flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)  # the latter is a copy
                for piece, value in items:
                    update(flat[piece.start:piece.stop], value.reshape(-1))
                if not t.is_contiguous():
                    t.copy_(flat.view(t.shape))  # back into the parameter's own memory layout

    def _load(self, replies: dict[int, Message], into: Sequence[torch.Tensor], *, versions: bool) -> None:
        received = [(piece, header, value) for reply in replies.values() for piece, header, value
                    in self._received(reply)]
        self._write(into, [(piece, value) for piece, _, value in received], torch.Tensor.copy_)
        if versions:
            for piece, header, _ in received:
                self.versions[piece.name] = header.version

    def register(self, policy: Policy) -> bool:
        """Create (and seal) the shards that do not exist yet, then pull: the first worker's values win.

        Returns False when some shard already existed with another policy (a late joiner
        asked for different rules; the server's stay in force).
        """
        replies = self._call({"op": "init", "policy": policy.spec(), "seal": True}, self.params)
        self.pull()
        return all(r.control.get("same_policy", True) for r in replies.values())

    def pull(self) -> None:
        """Overwrite the local parameters with the servers' values."""
        replies = {s: ({"op": "pull", "names": [p.name for p in pieces]}, [])
                   for s, pieces in enumerate(self.by_server) if pieces}
        self._load(self.client.call(replies), self.params, versions=True)

    def push(self, grads: Sequence[torch.Tensor], *, pull: bool, lrs: Sequence[float] | None = None,
             reached: Sequence[bool] | None = None) -> int:
        """Send gradients (stamped with the versions they were computed from); returns how many shards dropped it.

        ``lrs``: one learning rate per parameter (its param group's current lr), applied by an SGD server rule.
        ``reached``: per parameter, whether it had a gradient; one without is left out of the push, so the
        servers' momentum and weight decay leave it alone, as torch's optimizers skip a ``.grad`` of None.
        A ``pull`` still brings every parameter back.
        """
        sent = [[p for p in pieces if reached is None or reached[self.index[p.var]]] for pieces in self.by_server]

        def control(server: int) -> dict[str, Any]:
            c: dict[str, Any] = {"op": "push", "pull": pull}
            if lrs is not None:
                c["lr"] = [lrs[self.index[p.var]] for p in sent[server]]
            return c
        replies = self.client.call({s: (control(s), [(Header.of(p.name, view, self.versions[p.name]), view)
                                                     for p in pieces for view in [self._view(grads, p)]])
                                    for s, pieces in enumerate(sent) if pieces})
        if pull:
            self._load(replies, self.params, versions=True)
            rest = {s: ({"op": "pull", "names": names}, []) for s, pieces in enumerate(self.by_server)
                    for names in [[p.name for p in pieces if p not in sent[s]]] if names}
            if rest:  # the pieces left out of the push: a pull of their own
                self._load(self.client.call(rest), self.params, versions=True)
        return sum(len(r.control.get("dropped", [])) for r in replies.values())

    def easgd(self, alpha: float) -> None:
        """Asynchronous EASGD: the servers move the centre toward us by ``d``; we move by ``-d``."""
        received = [(piece, d) for reply in self._call({"op": "easgd", "alpha": alpha}, self.params).values()
                    for piece, _, d in self._received(reply)]
        self._write(self.params, received, torch.Tensor.sub_)

    def reduce(self, grads: Sequence[torch.Tensor], *, step: int, workers: int, generation: int = 0,
               abandon: Callable[[], str | None] | None = None) -> None:
        """Synchronous mode: replace ``grads`` by their mean over all ``workers``.

        We wait a little longer than the servers' round timeout, so that when a worker is
        missing the servers' verdict (which names the round) arrives before our own timeout.
        ``generation`` (under ``--elastic``) keys the round with the worker group it belongs to.
        """
        replies = self._call({"op": "reduce", "step": step, "workers": workers, "generation": generation}, grads,
                             timeout=self.client.timeout + 5, abandon=abandon)
        self._load(replies, grads, versions=False)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """The servers' state of every shard: ``{name: {"value", "version", "state": {key: tensor}}}``."""
        out: dict[str, dict[str, Any]] = {}
        mine = {p.name for p in self.pieces}
        replies = self.client.call({s: ({"op": "snapshot"}, []) for s, pieces in enumerate(self.by_server) if pieces})
        for reply in replies.values():
            for header, value in reply.tensors:
                name, _, key = header.name.partition(STATE_SEP)
                if name not in mine:
                    continue  # another model's shards on the same servers
                entry = out.setdefault(name, {"value": None, "version": 0, "state": {}})
                if key:
                    entry["state"][key] = value
                else:
                    entry["value"], entry["version"] = value, header.version
        missing = mine - {n for n, e in out.items() if e["value"] is not None}
        if missing:
            raise PSError(f"the servers do not hold {len(missing)} of this model's shards (e.g. {min(missing)!r})")
        return out

    def set(self, shards: dict[str, dict[str, Any]]) -> None:
        """Make the servers hold ``shards`` (a :meth:`snapshot`): values, versions and rule states."""
        if set(shards) != {p.name for p in self.pieces}:
            raise PSError("the saved server state does not hold this model's shards under this placement; "
                          "resume with the same model, servers count and placement")
        requests = {}
        for s, pieces in enumerate(self.by_server):
            if not pieces:
                continue
            frames: list[tuple[Header, torch.Tensor]] = []
            for p in pieces:
                entry = shards[p.name]
                frames.append((Header.of(p.name, entry["value"], int(entry["version"])), entry["value"]))
                frames += [(Header.of(p.name + STATE_SEP + k, v), v) for k, v in entry["state"].items()]
            requests[s] = ({"op": "set"}, frames)
        self.client.call(requests)
        self.versions = {name: int(entry["version"]) for name, entry in shards.items()}
