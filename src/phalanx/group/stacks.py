"""Where a stuck worker is stuck: every thread's Python stack, dumped by the worker itself, on request, via the store.

A worker started by a phalanx launcher holds the job's secret (``PHALANX_SECRET``) and the
address of the job's store (``MASTER_ADDR``/``MASTER_PORT``). ``px.init()`` starts a
:class:`Responder` there: a daemon thread with its own store connection that looks every
:data:`POLL_S` for a new request. For each one that proves it holds the secret, it raises
:data:`SIGNAL` in its own thread; :mod:`faulthandler`, registered on that signal, writes
every thread's stack from the C signal handler, without the GIL, so it answers the same
whether the main thread spins in a Python loop or waits in a gloo collective. The thread
reads the dump back (at most :data:`MAX_BYTES`), seals it to the request and posts it under a
key of its own; the requester (:func:`request_stacks`) collects one answer per worker. The
request and the answers cross the store only, so a worker on another host (``phalanx join``)
answers like a local one, and nothing attaches a debugger or stops a process.

The store has no access control (whoever reaches its port reads every key), so the secret
guards both ways: a request carries an HMAC of its nonce, which a worker checks before it
dumps anything, and an answer is encrypted and authenticated with a key derived from the
secret and that nonce (a SHAKE-256 keystream, encrypt-then-HMAC-SHA256; standard library
only). A request without the secret gets nothing, and reading the answers of others' requests
from the store shows only ciphertext.

The same thread publishes this worker's step count (set by the step clock, :class:`Progress`)
when it changes, which the launcher's step-progress watchdog reads
(:mod:`phalanx.launch.stacks`); the step itself costs one attribute store.

torch 2.13's ``torch.distributed.debug`` serves the same stacks through an HTTP server on
every rank (``_WorkerServer``, unauthenticated, on every interface) whose ``dump_traceback``
handler takes the GIL; neither its port nor its private handler is used here.

Example (one process, its own store; a job's workers do this in ``px.init()``):
    >>> import torch.distributed as dist
    >>> store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> me = Responder("127.0.0.1", store.port, "s3cret", "0", lambda: (0, 0)).start()
    >>> got = request_stacks(store, "s3cret", timeout_s=10)
    >>> "request_stacks" in got["0"].text, got["0"].rank
    (True, 0)
    >>> me.stop()
"""
from __future__ import annotations

import faulthandler
import hashlib
import hmac
import json
import os
import secrets
import signal
import socket
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, Iterable

import torch.distributed as dist

from ..errors import StacksRefused
from .env import WorkerEnv
from .records import Record, Slot

PREFIX = "phalanx/job/stacks"  # in the job's store, beside group.job_key()'s other job-wide keys
POLL_S = 0.5  # a request is seen this soon (one store round trip per poll, on the responder's own connection)
ANSWER_S = 5.0  # how long a requester waits for every worker's answer by default
MAX_BYTES = 64 * 1024  # of one worker's dump: faulthandler writes up to 100 frames of up to 100 threads
STORE_TIMEOUT_S = 5.0
# A real-time signal: SIGUSR1 is SLURM's preemption warning, SIGUSR2 a common user choice (and the chaos harness's)
SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2


def key(*parts: object) -> str:
    """A key of the stacks protocol in the job's store.

    Example:
        >>> key("asks")
        'phalanx/job/stacks/asks'
    """
    return "/".join([PREFIX, *map(str, parts)])


@dataclass(frozen=True)
class Stacks:
    """One worker's answer: where it runs, where it stands, and every thread's Python stack (faulthandler's text)."""

    id: str  # the worker's id: its rank under `phalanx run`, its elastic id under --elastic / `phalanx join`
    rank: int  # in the current generation (-1: a joiner not admitted yet)
    generation: int
    host: str
    pid: int
    step: int  # steps this worker's step clock closed (-1: none yet)
    text: str
    truncated: int = 0  # bytes of the dump left out (beyond MAX_BYTES)

    def header(self) -> str:
        """One line naming the worker, e.g. ``rank 1 (worker 1, pid 412 on node3, generation 0, step 17)``."""
        who = f"rank {self.rank}" if self.rank >= 0 else "not admitted yet"
        step = f"step {self.step}" if self.step >= 0 else "no step yet"
        return f"{who} (worker {self.id}, pid {self.pid} on {self.host}, generation {self.generation}, {step})"


class Progress:
    """This worker's step count, as its step clock closes steps (read by the :class:`Responder`'s thread)."""

    def __init__(self) -> None:
        self.step = -1


# The group's step progress (set by its step clocks) and its responder: records of the group, not attributes of it.
PROGRESS: Record[Progress] = Record("step progress", Progress)
RESPONDER: "Record[Slot[Responder]]" = Record("stacks responder", Slot)


# -- sealing an answer to the secret and the request -------------------------------------------------------------

def _derive(secret: str, purpose: str) -> bytes:
    return hmac.new(secret.encode(), f"phalanx-stacks/{purpose}".encode(), hashlib.sha256).digest()


def seal(secret: str, context: str, data: bytes) -> bytes:
    """Encrypt and authenticate ``data`` for ``context`` (unique per request and worker): tag (32 bytes) + ciphertext.

    Example:
        >>> unseal("s", "ctx", seal("s", "ctx", b"hello")), unseal("t", "ctx", seal("s", "ctx", b"hello"))
        (b'hello', None)
    """
    k = _derive(secret, f"seal/{context}")
    stream = hashlib.shake_256(k + b"/stream").digest(len(data))
    body = (int.from_bytes(data, "big") ^ int.from_bytes(stream, "big")).to_bytes(len(data), "big")
    return hmac.new(k, body, hashlib.sha256).digest() + body


def unseal(secret: str, context: str, sealed: bytes) -> bytes | None:
    """The data :func:`seal` sealed, or None when it was not sealed with this secret and context (or was altered)."""
    k = _derive(secret, f"seal/{context}")
    tag, body = sealed[:32], sealed[32:]
    if len(tag) < 32 or not hmac.compare_digest(tag, hmac.new(k, body, hashlib.sha256).digest()):
        return None
    stream = hashlib.shake_256(k + b"/stream").digest(len(body))
    return (int.from_bytes(body, "big") ^ int.from_bytes(stream, "big")).to_bytes(len(body), "big")


def _ask_mac(secret: str, nonce: str) -> str:
    return hmac.new(_derive(secret, "ask"), nonce.encode(), hashlib.sha256).hexdigest()


def _check(secret: str, nonce: str) -> str:
    return hmac.new(_derive(secret, "check"), nonce.encode(), hashlib.sha256).hexdigest()


# -- the worker's side -----------------------------------------------------------------------------------------------

class Responder:
    """Answer the job's stack requests from this process: a daemon thread on its own store connection.

    ``where()`` returns ``(rank, generation)`` now (a worker's rank changes with each
    generation); ``progress`` is this worker's :class:`Progress`, published when it changes.
    """

    def __init__(self, host: str, port: int, secret: str, wid: str, where: Callable[[], tuple[int, int]],
                 progress: Progress | None = None) -> None:
        self.host, self.port, self.secret, self.id, self.where = host, port, secret, wid, where
        self.progress = progress if progress is not None else Progress()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file = tempfile.TemporaryFile(buffering=0)  # unlinked: nothing to clean up, nobody else can open it
        self._lock = threading.Lock()

    def start(self) -> "Responder":
        """Register in the store and start answering; returns self. A requester counts this worker once it returns.

        A store that does not answer leaves nothing started: nobody could ask this worker anything.
        """
        if self._thread is not None:
            return self
        try:
            store = self._connect()
            nonce = secrets.token_hex(16)
            store.set(key("check", self.id), json.dumps({"nonce": nonce, "check": _check(self.secret, nonce)}))
            store.delete_key(key("gone", self.id))  # a worker restarted under the same id answers again
            store.append(key("who"), self.id + "\n")
            done = len(_lines(store))  # requests made before this worker started are not for it
        except Exception:  # noqa: BLE001 - refused, unreachable, timed out
            return self
        faulthandler.register(SIGNAL, file=self._file, all_threads=True, chain=False)
        self._thread = threading.Thread(target=self._run, args=(store, done), name=f"phalanx-stacks-{self.id}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop answering and say so in the store (a requester then stops waiting for this worker); idempotent."""
        if self._stop.is_set() or self._thread is None:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=POLL_S + 2 * STORE_TIMEOUT_S)
        try:
            faulthandler.unregister(SIGNAL)
        except (RuntimeError, ValueError):
            pass

    def dump(self) -> tuple[str, int]:
        """Every thread's stack but this one's, now, and the bytes left out beyond :data:`MAX_BYTES`."""
        with self._lock:
            fd = self._file.fileno()
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            # to this thread: the handler has run (and written the file) when pthread_kill returns
            signal.pthread_kill(threading.get_ident(), SIGNAL)
            size = os.fstat(fd).st_size
            raw = os.pread(fd, MAX_BYTES, 0)
        return name_threads(raw.decode(errors="replace")), max(0, size - MAX_BYTES)

    def _connect(self) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S),
                             wait_for_workers=False)

    def _run(self, store: dist.TCPStore, done: int) -> None:
        published = None
        asked = -1
        while not self._stop.wait(POLL_S):
            try:
                step = self.progress.step
                if step != published:
                    store.set(key("step", self.id), str(step))
                    published = step
                count = int(store.add(key("asked"), 0))  # one cheap round trip; the log is read only when it moved
                if count != asked:
                    asked = count
                    asks = _lines(store)
                    for line in asks[done:]:
                        self._answer(store, line)
                    done = len(asks)
            except Exception:  # noqa: BLE001 - the store's host is gone: nothing left to answer
                return
        try:
            store.set(key("gone", self.id), "1")
        except Exception:  # noqa: BLE001 - leaving anyway
            pass

    def _answer(self, store: dist.TCPStore, line: str) -> None:
        try:
            ask = json.loads(line)
            nonce, mac = str(ask["nonce"]), str(ask["mac"])
        except (ValueError, KeyError, TypeError):
            return
        if not hmac.compare_digest(_ask_mac(self.secret, nonce), mac):
            return  # not from a holder of the secret: no dump, no answer
        text, left_out = self.dump()
        rank, generation = self.where()
        answer = Stacks(self.id, rank, generation, socket.gethostname(), os.getpid(), self.progress.step, text,
                        left_out)
        store.set(key("answer", nonce, self.id), seal(self.secret, f"{nonce}/{self.id}",
                                                      json.dumps(asdict(answer)).encode()))


def respond(env: WorkerEnv, where: Callable[[], tuple[int, int]], progress: Progress) -> Responder | None:
    """Start this worker's :class:`Responder` when a launcher gave it the job's secret and store; else None.

    ``phalanx run`` (one host), ``--elastic``, ``phalanx join``, SLURM's elastic jobs and
    ``phalanx.launch.raytrain`` give both; under plain torchrun, set ``PHALANX_SECRET`` yourself.

    Example:
        >>> respond(WorkerEnv(), lambda: (0, 0), Progress()) is None   # a plain process
        True
    """
    if not env.elastic_secret or (env.world_size < 2 and env.elastic_id is None and not env.launched_by_phalanx):
        return None
    wid = env.elastic_id if env.elastic_id is not None else str(env.rank)
    responder = Responder(env.master_addr, env.master_port, env.elastic_secret, wid, where, progress).start()
    return responder if responder._thread is not None else None


def name_threads(dump: str) -> str:
    """faulthandler's dump without the dumping thread's own stack, each thread named (``Thread 0x... (MainThread)``),
    the main thread first.

    Example:
        >>> print(name_threads('Current thread 0x01 (most recent call first):\\n  File "a.py", line 1 in f\\n'))
        <BLANKLINE>
    """
    names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
    blocks = [b for b in dump.split("\n\n") if b.strip() and not b.startswith("Current thread ")]
    out = []
    for block in blocks:
        head, _, rest = block.partition("\n")
        word = head.split(" ")[1] if head.startswith("Thread 0x") else ""
        try:
            name = names.get(int(word, 16)) if word else None
        except ValueError:
            name = None
        if name:
            head = head.replace(word, f"{word} ({name})", 1)
        out.append(f"{head}\n{rest}".rstrip("\n"))
    out.sort(key=lambda block: "(MainThread)" not in block.partition("\n")[0])  # the script's own thread first
    return "\n\n".join(out)


def _lines(store: dist.Store) -> list[str]:
    return store.get(key("asks")).decode().splitlines() if store.check([key("asks")]) else []


# -- the requester's side -------------------------------------------------------------------------------------------

def responders(store: dist.Store) -> list[str]:
    """The workers that ever answered requests in this job's store (in the order they started), less those that left.

    Example:
        >>> import torch.distributed as dist
        >>> responders(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
        []
    """
    who = list(dict.fromkeys(store.get(key("who")).decode().split())) if store.check([key("who")]) else []
    return [w for w in who if not store.check([key("gone", w)])]


def check_secret(store: dist.Store, secret: str) -> None:
    """Raise :class:`StacksRefused` at once when ``secret`` is not the one the job's workers hold."""
    for wid in responders(store)[:1]:
        published = json.loads(store.get(key("check", wid)))
        if not hmac.compare_digest(_check(secret, published["nonce"]), published["check"]):
            raise StacksRefused("the secret given is not the job's; its workers answer no request made with it. Use "
                                "the job's secret file (the launcher names it) or the PHALANX_SECRET it was started "
                                "with")


def request_stacks(store: dist.Store, secret: str, *, expect: Iterable[str] | None = None,
                   timeout_s: float = ANSWER_S, lost: Callable[[], Iterable[str]] | None = None,
                   poll_s: float = 0.05) -> dict[str, Stacks | None]:
    """Ask every worker of the job whose store is ``store`` for its stacks; by worker id, None for no answer.

    ``expect``: the worker ids to wait for (default: every worker answering requests now).
    Waits at most ``timeout_s``, less once each expected worker answered, left (it said so
    in the store) or is named by ``lost()`` (the caller's knowledge of who is dead). A worker
    stopped (SIGSTOP) or holding the GIL in C code cannot answer: its entry is None.
    Raises :class:`StacksRefused` at once when ``secret`` is not the job's.

    Example:
        >>> import torch.distributed as dist
        >>> store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        >>> request_stacks(store, "s3cret", timeout_s=0.1)   # no worker in this store
        {}
    """
    check_secret(store, secret)
    ids = list(dict.fromkeys(expect)) if expect is not None else responders(store)
    nonce = secrets.token_hex(16)
    store.append(key("asks"), json.dumps({"nonce": nonce, "mac": _ask_mac(secret, nonce)}) + "\n")
    store.add(key("asked"), 1)
    got: dict[str, Stacks | None] = {w: None for w in ids}
    pending = set(ids)
    deadline = time.monotonic() + timeout_s
    while pending:
        for wid in sorted(pending):
            k = key("answer", nonce, wid)
            if store.check([k]):
                pending.discard(wid)
                opened = unseal(secret, f"{nonce}/{wid}", store.get(k))
                got[wid] = Stacks(**json.loads(opened)) if opened is not None else None
                store.delete_key(k)  # read once: the store does not keep every dump of a long job
            elif store.check([key("gone", wid)]):
                pending.discard(wid)
        pending -= set(lost() if lost is not None else ())
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)  # sleep: polling the store for answers; a TCPStore wait cannot end on "a worker left"
    return got


def blocks(got: dict[str, Stacks | None], timeout_s: float = ANSWER_S) -> list[str]:
    """One block of text per worker, in rank order (the ones with no answer last).

    Example:
        >>> print(blocks({"1": None}, 5.0)[0])
        ----- worker 1: no answer within 5.0 s (stopped, exited, or holding the GIL in C code) -----
    """
    answered = sorted((s for s in got.values() if s is not None), key=lambda s: (s.rank < 0, s.rank, s.id))
    out = []
    for s in answered:
        more = f"\n  ... {s.truncated} more bytes left out" if s.truncated else ""
        out.append(f"----- {s.header()} -----\n{s.text}{more}")
    for wid in sorted(w for w, s in got.items() if s is None):
        out.append(f"----- worker {wid}: no answer within {timeout_s:.1f} s (stopped, exited, or holding the GIL "
                   "in C code) -----")
    return out


__all__ = ["ANSWER_S", "MAX_BYTES", "POLL_S", "PREFIX", "PROGRESS", "Progress", "RESPONDER", "Responder", "SIGNAL",
           "Stacks", "StacksRefused", "blocks", "check_secret", "key", "name_threads", "request_stacks", "respond",
           "responders", "seal", "unseal"]
