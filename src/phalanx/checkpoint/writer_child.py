"""The checkpoint writer process's own side: its loop, and the framed messages both halves exchange.

:mod:`phalanx.checkpoint.writer` starts this process (``python -c ... serve(fd, parent, nice)``) at a worker's first
asynchronous save and talks to it over a socket pair: each request and answer is a length-prefixed pickle, the
shared region's descriptor riding along with the first write of a region (``SCM_RIGHTS``). Both ends are this
worker's own processes, started from this package: nothing read here comes from the network.

Example:
    >>> import socket
    >>> a, b = socket.socketpair()
    >>> send(a, ("ok", 42)); pickle.loads(receive(b)[0])
    ('ok', 42)
    >>> a.close(); receive(b) is None
    True
"""
from __future__ import annotations

import mmap
import os
import pickle
import select
import socket
import struct
import threading
import time
from typing import Any, Sequence

import torch

from ..errors import CheckpointError
from .dcp import _dcp
from .handle import _commit
from .staging import views

_HEADER = struct.Struct("!Q")


# -- the messages -----------------------------------------------------------------------------------------------

def send(sock: socket.socket, obj: Any, fds: Sequence[int] = ()) -> None:
    """``obj`` pickled behind its length, ``fds`` passed with the length's bytes."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(data)


def receive(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """The next message (pickled) and the descriptors sent with it; None once the other end closed."""
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
    if not head:
        return None
    head += _read(sock, _HEADER.size - len(head))
    (n,) = _HEADER.unpack(head)
    body = _read(sock, n)
    return (body, fds) if len(body) == n else None


def _read(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = sock.recv(min(n - got, 1 << 20))
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


# -- the writer process ----------------------------------------------------------------------------------------

def serve(fd: int, parent: int, nice: int) -> None:
    """The writer process's loop: answer each request on the socket ``fd`` until the worker ``parent`` is gone."""
    if os.getppid() != parent:
        os._exit(1)  # the worker ended before we started
    threading.Thread(target=_end_with, args=(parent,), name="phalanx-writer-watch", daemon=True).start()
    torch.set_num_threads(1)
    _dcp()  # (its import is most of the start)
    # Niced (if at all) once started, not before: a start at the lowest priority on a busy machine takes minutes (CFS
    # gives a nice-19 process 1.5% of a nice-0 one's share), and the first save would wait for it.
    if nice:
        os.nice(nice)
    sock = socket.socket(fileno=fd)
    mapped: tuple[int, Any] | None = None
    while True:
        try:
            got = receive(sock)
        except OSError:
            got = None
        if got is None:
            os._exit(0)  # the worker closed its end (it stopped us, or it is gone)
        data, fds = got
        try:
            kind, body = pickle.loads(data)  # a writer class that does not import here fails this request only
            if kind == "write":
                if fds:
                    mapped = None
                    mapped = (body["region"][0], mmap.mmap(fds[0], body["region"][1], flags=mmap.MAP_SHARED))
                    os.close(fds[0])
                if mapped is None or mapped[0] != body["region"][0]:
                    raise CheckpointError("the checkpoint writer was asked to write a staged state it was not given")
                tensors = views(mapped[1], body["entries"])
                done = body["writer"].write_data(body["plan"], _Resolver(tensors))
                answer: tuple[str, Any] = ("ok", done.wait() if hasattr(done, "wait") else done.result())
                del tensors, done
            elif kind == "commit":
                _commit(*body)
                answer = ("ok", None)
            else:
                answer = ("error", CheckpointError(f"the checkpoint writer got an unknown request {kind!r}"))
        except BaseException as err:  # noqa: BLE001 - every failure goes back to the worker, typed
            answer = ("error", _portable(err))
        try:
            send(sock, answer)
        except OSError:
            os._exit(0)


class _Resolver:
    """The planner DCP's ``write_data`` asks for each item's tensor: here, the staged one."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def resolve_data(self, item: Any) -> torch.Tensor:
        tensor = self.tensors.get(item.index.fqn)
        if tensor is None:
            raise CheckpointError(f"the checkpoint writer has no staged tensor {item.index.fqn!r}")
        return tensor


def _portable(err: BaseException) -> BaseException:
    """``err`` as it can cross to the worker: itself if it pickles, else a CheckpointError saying what it was."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its type and first line
        first = next(iter(str(err).strip().splitlines()), "")
        return CheckpointError(f"{type(err).__name__}: {first[:300]}")


def _end_with(parent: int) -> None:
    """End the writer as soon as its worker is gone, whatever it is doing (a pidfd: no polling)."""
    try:
        fd = os.pidfd_open(parent)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd on this system: reparenting tells
        while os.getppid() == parent:
            time.sleep(0.5)  # nothing to wait on without a pidfd
        os._exit(1)
    select.select([fd], [], [])
    os._exit(1)


__all__ = ["receive", "send", "serve"]
