"""A parameter server: shards behind a ZeroMQ ROUTER socket, served by a few handler threads.

Run one per process with ``python -m phalanx.ps serve --port-file F`` (what
:func:`phalanx.ps.launcher.start_servers` does), or inside a worker as a thread
(colocated mode, :class:`Server` ``.start()``).

Requests arrive on a ROUTER socket. A C-level proxy forwards them to ``threads`` handler
threads, so pushes to different shards run in parallel. torch releases the GIL during
the math. The per-shard lock of each shard's :class:`~phalanx.ps.shards.Policy` decides
whether two pushes to one shard may interleave.

Security: the server binds to loopback unless told otherwise. On any other interface it
refuses to start without a token. When it has a token, every request must carry it; the
token is compared in constant time before anything else in the request is parsed.
Whoever holds the token (or, without one, any local process) is still not trusted to
knock the server over: every tensor header is checked against the registered shard
before anything is allocated, frames are capped (``ZMQ_MAXMSGSIZE``), non-finite values
are refused, registrations are sealed, abandoned synchronous rounds time out, and a
handler answers any exception with an error and keeps serving.

Example:
    >>> server = Server().start()
    >>> server.address.startswith("tcp://127.0.0.1:")
    True
    >>> server.stop()
"""
from __future__ import annotations

import hmac
import os
import signal
import threading
import traceback
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

import torch

from .. import check
from ..errors import ConfigError, PhalanxError, usage
from ..step.latch import Latch
from .config import DEFAULT_TIMEOUT_S, is_loopback
from .reducer import Reducer
from .shards import Policy, RejectError, ShardStore, Tensors
from .wire import Header, WireError, recv_message, require_zmq, send_message

if TYPE_CHECKING:
    import zmq

PROTOCOL = 1
Reply = tuple[dict[str, Any], list[tuple[Header, torch.Tensor]]]


class AuthError(PhalanxError, PermissionError):
    """A request without the job's token."""


class Server:
    """Shards, a reducer for synchronous mode, and the sockets that serve them.

    Args:
        host: interface to bind; loopback by default. Anything else needs ``token``.
        port: 0 picks a free port (read it back from ``.address``).
        token: the per-job secret every request must carry (None: none required, loopback only).
        threads: handler threads.
        checkpoint: a file for this server's shards: loaded at start if it exists, written on
            ``stop()`` and on a client's ``save`` request.
        index: this server's position in the job's address list (for logs and checkpoints).
        max_message_mb: the largest frame a peer may send; a larger one drops that peer's connection.
        max_bytes: what registrations may allocate before a strategy seals the set (None: no limit).
        round_timeout: seconds after which an incomplete synchronous round is abandoned.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None, threads: int = 2,
                 checkpoint: str | None = None, checkpoint_every: float | None = None, index: int = 0,
                 max_message_mb: int = 1024, max_bytes: int | None = None,
                 round_timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if not is_loopback(host) and not token:
            raise ConfigError(usage(f"a parameter server on {host!r} without a token",
                                    "a per-job token on any interface other than loopback",
                                    "Set PHALANX_PS_TOKEN (start_servers makes one), or bind to 127.0.0.1."))
        check.positive_int("threads", threads, "Use 2.")
        self.host, self.port, self.index = host, port, index
        self._token = token.encode() if token else None
        if checkpoint_every is not None and not (checkpoint and checkpoint_every > 0):
            raise ConfigError(usage(f"checkpoint_every={checkpoint_every!r}",
                                    "a positive period with a checkpoint file",
                                    "Pass --checkpoint PATH too, or leave the period out."))
        self.threads, self.checkpoint, self.max_message_mb = threads, checkpoint, max_message_mb
        self.checkpoint_every = checkpoint_every
        round_timeout = check.positive_float("round_timeout", round_timeout, "Use the workers' PHALANX_PS_TIMEOUT.")
        self.store, self.reducer = ShardStore(max_bytes), Reducer(round_timeout)
        self.stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ops: dict[str, Callable[[bytes, dict[str, Any], Tensors], Any]] = {
            "info": self._info, "init": self._init, "pull": self._pull, "push": self._push,
            "easgd": self._easgd, "reduce": self._reduce, "stats": self._stats, "save": self._save,
            "snapshot": self._snapshot, "set": self._set}
        if checkpoint and os.path.exists(checkpoint):
            self.store.load(checkpoint)  # a job resuming from its servers' shards

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> "Server":
        zmq = require_zmq()
        self._ctx = zmq.Context()
        frontend = self._ctx.socket(zmq.ROUTER)
        frontend.setsockopt(zmq.LINGER, 0)
        frontend.setsockopt(zmq.MAXMSGSIZE, self.max_message_mb * 2**20)  # bound what a peer can make us hold
        url = f"tcp://{self.host}"
        if self.port == 0:
            self.port = frontend.bind_to_random_port(url)
        else:
            frontend.bind(f"{url}:{self.port}")
        inproc = f"inproc://ps-{id(self)}"
        backend = self._ctx.socket(zmq.DEALER)
        backend.bind(inproc)
        control = self._ctx.socket(zmq.PAIR)
        control.bind(inproc + "-control")
        self._control = self._ctx.socket(zmq.PAIR)
        self._control.connect(inproc + "-control")
        self._threads.append(threading.Thread(target=self._proxy, args=(frontend, backend, control),
                                              name=f"ps{self.index}-proxy", daemon=True))
        if self.checkpoint_every:
            self._threads.append(threading.Thread(target=self._save_periodically, name=f"ps{self.index}-checkpoint",
                                                  daemon=True))
        for i in range(self.threads):
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(inproc)
            self._threads.append(threading.Thread(target=self._handle_loop, args=(sock,),
                                                  name=f"ps{self.index}-handler{i}", daemon=True))
        for t in self._threads:
            t.start()
        return self

    @staticmethod
    def _proxy(frontend: "zmq.Socket", backend: "zmq.Socket", control: "zmq.Socket") -> None:
        zmq = require_zmq()
        try:
            zmq.proxy_steerable(frontend, backend, None, control)
        except zmq.ContextTerminated:
            pass
        finally:
            for s in (frontend, backend, control):
                s.close(linger=0)

    def _save_periodically(self) -> None:
        while not self._stop.wait(self.checkpoint_every):
            self.store.save(self.checkpoint)  # type: ignore[arg-type]

    def stop(self, *, save: bool = True) -> None:
        """Stop serving; write the checkpoint (when configured) once no handler can change a shard."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._control.send(b"TERMINATE")
        for t in self._threads:
            t.join(timeout=10)
        self._control.close(linger=0)
        self._ctx.term()
        if save and self.checkpoint:
            self.store.save(self.checkpoint)

    def serve_forever(self) -> None:
        """Block until SIGTERM or SIGINT, then stop (saving the checkpoint)."""
        # A Latch: an Event's set() in the handler could wait on the lock its own thread holds in done.wait()
        done = Latch()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        done.wait()
        done.close()
        self.stop()

    # -- one request --------------------------------------------------------------------------
    def _handle_loop(self, sock: "zmq.Socket") -> None:
        zmq = require_zmq()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    if poller.poll(100):
                        self._serve_one(sock)
                    self._expire_rounds(sock)
                except zmq.ContextTerminated:
                    return
                except Exception:  # noqa: BLE001 - whatever a request did, this thread keeps serving
                    traceback.print_exc()
        finally:
            sock.close(linger=0)

    def _expire_rounds(self, sock: "zmq.Socket") -> None:
        for who, why in self.reducer.expire():
            identity, rid = who
            self._count(rejected=1)
            send_message(sock, {"ok": False, "error": why, "id": rid}, prefix=[identity])

    def _authorize(self, prefix: list[bytes]) -> None:
        if self._token is not None and not hmac.compare_digest(prefix[1], self._token):
            self._count(unauthorized=1)
            raise AuthError("rejected: this server requires the job's token (PHALANX_PS_TOKEN) and the request "
                            "did not carry it")

    def _admit(self, control: dict[str, Any], header: Header) -> None:
        self.store.admit(control.get("op"), header)

    def _serve_one(self, sock: "zmq.Socket") -> None:
        try:
            msg = recv_message(sock, prefix_frames=2, authorize=self._authorize, admit=self._admit)
        except Exception as err:  # noqa: BLE001 - a malformed or hostile message: answer it, keep serving
            prefix = getattr(err, "prefix", [])
            if prefix:
                self._count(rejected=1)
                why = str(err) if isinstance(err, PhalanxError) else f"malformed request: {type(err).__name__}"
                send_message(sock, {"ok": False, "error": why[:4000]}, prefix=prefix[:1])
            return
        identity, control = msg.prefix[0], msg.control
        self._count(requests=1, bytes_in=msg.nbytes)
        rid = control.get("id")
        rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else None  # echoed back: keep it small
        try:
            op = self._ops.get(control.get("op"))  # type: ignore[arg-type]
            if op is None:
                raise RejectError(f"unknown op {control.get('op')!r}; expected one of {sorted(self._ops)}")
            replies = op(identity, control, msg.tensors)
            if replies is None:  # deferred: a synchronous round still waits for other workers
                return
            if not isinstance(replies, list):
                replies = [(identity, rid, replies)]
        except (RejectError, ConfigError, WireError) as err:
            self._count(rejected=1)
            replies = [(identity, rid, ({"ok": False, "error": str(err)[:4000]}, []))]
        except Exception as err:  # noqa: BLE001 - a bug here must not kill the server for every other worker
            traceback.print_exc()
            self._count(rejected=1)
            replies = [(identity, rid, ({"ok": False, "error": f"internal error: {type(err).__name__}: "
                                                              f"{str(err)[:2000]}"}, []))]
        for who, req_id, (reply, tensors) in replies:
            self._reply(sock, who, req_id, reply, tensors)

    def _reply(self, sock: "zmq.Socket", who: bytes, rid: Any, reply: dict[str, Any],
               tensors: list[tuple[Header, torch.Tensor]]) -> None:
        """Send one answer; if it cannot be packed (a field out of range), send that error instead, so a
        request is never left without an answer."""
        try:
            sent = send_message(sock, {"ok": True, **reply, "id": rid}, tensors, prefix=[who])
        except (WireError, ValueError, OverflowError, TypeError) as err:
            self._count(rejected=1)
            sent = send_message(sock, {"ok": False, "error": f"the reply could not be sent: {str(err)[:2000]}",
                                       "id": rid}, prefix=[who])
        self._count(bytes_out=sent)

    def _count(self, **amounts: int) -> None:
        with self._stats_lock:
            self.stats.update(amounts)

    # -- the operations --------------------------------------------------------------------------
    def _info(self, who: bytes, control: dict[str, Any], tensors: Tensors) -> Reply:
        return {"index": self.index, "protocol": PROTOCOL, "shards": len(self.store.shards)}, []

    def _init(self, who: bytes, control: dict[str, Any], tensors: Tensors) -> Reply:
        return self.store.init(tensors, Policy.from_spec(control.get("policy")), seal=control.get("seal") is True), []

    def _pull(self, who: bytes, control: dict[str, Any], tensors: Tensors) -> Reply:
        return {}, self.store.pull(control.get("names"))

    def _push(self, who: bytes, control: dict[str, Any], tensors: Tensors) -> Reply:
        dropped, applied = self.store.push(tensors, control.get("lr"))
        values = self.store.pull([h.name for h, _ in tensors]) if control.get("pull") else []
        return {"dropped": dropped, "applied": applied}, values

    def _easgd(self, who: bytes, control: dict[str, Any], tensors: Tensors) -> Reply:
        return {}, self.store.easgd(tensors, control.get("alpha"))  # type: ignore[arg-type]

    def _reduce(self, who: bytes, control: dict[str, Any], tensors: Tensors) -> list[Any] | None:
        done = self.reducer.contribute(control.get("step"), control.get("workers"), (who, control.get("id")), tensors,
                                       control.get("generation", 0))
        if done is None:
            return None
        everyone, means = done
        return [(identity, rid, ({}, means)) for identity, rid in everyone]

    def _stats(self, who: bytes, control: dict[str, Any], tensors: Tensors) -> Reply:
        with self._stats_lock:
            stats = dict(self.stats)
        held = self.store.bytes_held
        return {"index": self.index, "shards": len(self.store.shards), "bytes_held": held,
                **{k: stats.get(k, 0) for k in ("requests", "bytes_in", "bytes_out", "rejected", "unauthorized")},
                **{k: self.store.counts.get(k, 0) for k in ("applied", "dropped_stale", "easgd")}}, []

    def _snapshot(self, who: bytes, control: dict[str, Any], tensors: Tensors) -> Reply:
        return {}, self.store.snapshot()

    def _set(self, who: bytes, control: dict[str, Any], tensors: Tensors) -> Reply:
        return {"set": self.store.set(tensors)}, []

    def _save(self, who: bytes, control: dict[str, Any], tensors: Tensors) -> Reply:
        if not self.checkpoint:
            raise RejectError("this server was started without a checkpoint file (--checkpoint PATH)")
        self.store.save(self.checkpoint)
        return {"saved": True}, []
