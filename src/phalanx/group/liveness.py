"""Liveness: which ranks are still running, told by heartbeats in the group's store.

Every worker runs a :class:`Heartbeat`, a daemon thread that bumps a counter in the
store every half second on its own store connection, and leaves a note with
:func:`record_exit` when it ends ("ok", or the exception that ended it). A reader
decides with its own clock, so hosts need not agree on the time:

- a rank whose counter advances is **alive**, even if it is busy elsewhere or
  skipped a collective;
- a rank that left a note has **exited**, and the note says how;
- a rank whose counter stands still for ``stale_after_s`` has **stopped** (killed,
  crashed hard, or frozen);
- when the store itself does not answer, nobody can tell, and :func:`survey`
  returns ``None`` rather than guess.

:func:`guarded` wraps a collective so that a peer's disappearance becomes one
:class:`~phalanx.WorkerLostError` naming the rank that is really gone.

Example (a store of our own; in a job use ``phalanx.group.group.store()``):
    >>> import torch.distributed as dist
    >>> store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> beat = Heartbeat(store, rank=0, every_s=0.05).start()
    >>> record_exit(store, 1, "ValueError: boom")
    >>> survey(store, world_size=3, stale_after_s=0.5)
    Liveness(alive=[0], exited={1: 'ValueError: boom'}, stopped=[2])
    >>> beat.stop()
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist


HEARTBEAT_EVERY_S = 0.5
STALE_AFTER_S = 3.0  # six missed beats: a loaded machine can starve a thread for a second or two, not for three
CONFIRM_S = 1.5  # a rank whose last beat is already old is called stopped after watching it this long (3 beats)
STORE_PROBE_TIMEOUT_S = 5.0  # a diagnosis must not hang on a frozen store host


def _beat_key(rank: int) -> str:
    return f"liveness/beat/{rank}"


def _time_key(rank: int) -> str:
    return f"liveness/beat-time/{rank}"


def _exit_key(rank: int) -> str:
    return f"liveness/exit/{rank}"


def second_connection(store: dist.Store, timeout_s: float = STORE_PROBE_TIMEOUT_S) -> dist.Store:
    """A second connection to ``store`` with a short timeout: a blocked wait on the first must not hold it up."""
    clone = store.clone()
    clone.set_timeout(timedelta(seconds=timeout_s))
    return clone


class Heartbeat:
    """Bump ``rank``'s counter in ``store`` every ``every_s`` seconds from a daemon thread.

    The thread uses its own store connection, so a long ``store.wait`` or a collective on
    the main thread never delays a beat. The first beat is written by :meth:`start`
    itself, so a rank is visible as soon as ``start()`` returns. If the store goes away
    the thread ends quietly (the reader then cannot tell anything either).

    Why an elastic worker beats twice (this one, and ``phalanx.elastic.worker``'s under its id): this one beats a
    *rank* in one generation's store and is restarted at every rebuild; the launcher must see an *id* beat without gaps.

    Example:
        >>> import torch.distributed as dist
        >>> store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        >>> beat = Heartbeat(store, rank=0, every_s=0.01).start()
        >>> time.sleep(0.2); beat.stop(); beats(store, 1)[0] > 1
        True
    """

    def __init__(self, store: dist.Store, rank: int, every_s: float = HEARTBEAT_EVERY_S) -> None:
        self.rank, self.every_s = rank, every_s
        self._store = second_connection(store)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Heartbeat":
        """Write the first beat now and keep beating in the background; returns self."""
        if self._thread is None:
            self._beat()
            self._thread = threading.Thread(target=self._run, name=f"phalanx-heartbeat-{self.rank}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating (readers will see this rank stand still); safe to call twice."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.every_s + STORE_PROBE_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self._beat()
            except Exception:  # the store's host is gone: nothing left to tell anyone
                return

    def _beat(self) -> None:
        # The writer's clock lets a reader recognise a beat that stopped long ago without waiting
        # stale_after_s itself; the counter (read by the reader's own clock) guards against skew.
        self._store.set(_time_key(self.rank), repr(time.time()))
        self._store.add(_beat_key(self.rank), 1)


def beats(store: dist.Store, world_size: int) -> list[int]:
    """Each rank's heartbeat counter now (0: never beat); ``add(key, 0)`` reads without blocking."""
    return [int(store.add(_beat_key(r), 0)) for r in range(world_size)]


def beat_times(store: dist.Store, ranks: list[int]) -> list[float]:
    """Wall-clock time (the writer's) of each rank's last beat; only for ranks that have beaten."""
    return [float(v) for v in store.multi_get([_time_key(r) for r in ranks])] if ranks else []


def record_exit(store: dist.Store, rank: int, reason: str = "ok") -> None:
    """Leave a note that ``rank`` is ending: "ok" for a normal exit, else what ended it (one line)."""
    store.set(_exit_key(rank), reason.splitlines()[0][:300] if reason else "ok")


def exit_records(store: dist.Store, world_size: int) -> dict[int, str]:
    """The notes left so far, by rank."""
    return {r: store.get(_exit_key(r)).decode(errors="replace") for r in range(world_size)
            if store.check([_exit_key(r)])}


@dataclass
class Liveness:
    """What the store says about every rank; a rank is in exactly one of the three."""

    alive: list[int] = field(default_factory=list)  # heartbeat advanced while we watched
    exited: dict[int, str] = field(default_factory=dict)  # left a note: "ok" or the exception that ended it
    stopped: list[int] = field(default_factory=list)  # heartbeat stood still for stale_after_s

    @property
    def lost(self) -> list[int]:
        """Ranks that are no longer running: exited for any reason, or stopped."""
        return sorted([*self.exited, *self.stopped])


class Watch:
    """Non-blocking view of heartbeats: call :meth:`poll` now and then, read :meth:`stale`.

    A rank is stale once its counter has not moved for ``stale_after_s`` by this
    process's clock, counted from the first poll; or, sooner, once it has not moved
    for ``CONFIRM_S`` and its last beat, by the writer's clock, is ``stale_after_s``
    old (a rank that died before we started watching). A live rank on a host whose
    clock is off still advances within ``CONFIRM_S``, so skew cannot get it blamed.

    Example:
        >>> import torch.distributed as dist
        >>> store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        >>> watch = Watch(store, world_size=2, stale_after_s=0.1); watch.poll(); watch.stale()
        []
        >>> time.sleep(0.2); watch.poll(); watch.stale()
        [0, 1]
    """

    def __init__(self, store: dist.Store, world_size: int, stale_after_s: float = STALE_AFTER_S) -> None:
        self.store, self.world_size, self.stale_after_s = store, world_size, stale_after_s
        self._last: list[int] | None = None
        self._first: list[int] | None = None
        self._since: list[float] = []
        self._silent_s: list[float] = []  # seconds since each rank's last beat, by the writer's clock

    def poll(self) -> None:
        """Read every counter once (one store round trip per rank, and one for the beat times)."""
        now, seen = time.monotonic(), beats(self.store, self.world_size)
        if self._last is None:
            self._first, self._since = list(seen), [now] * self.world_size
        else:
            self._since = [now if s != last else t for s, last, t in zip(seen, self._last, self._since, strict=True)]
        self._last = seen
        started = [r for r in range(self.world_size) if seen[r] > 0]
        wall, silent = time.time(), [0.0] * self.world_size
        for r, t in zip(started, beat_times(self.store, started), strict=True):
            silent[r] = wall - t
        self._silent_s = silent

    def advanced(self) -> list[int]:
        """Ranks whose counter moved since the first poll."""
        if self._last is None or self._first is None:
            return []
        return [r for r in range(self.world_size) if self._last[r] != self._first[r]]

    def stale(self) -> list[int]:
        """Ranks whose counter has stood still for ``stale_after_s``."""
        now = time.monotonic()
        return [r for r, t in enumerate(self._since)
                if now - t >= self.stale_after_s
                or (now - t >= min(CONFIRM_S, self.stale_after_s) and self._silent_s[r] >= self.stale_after_s)]


def survey(store: dist.Store, world_size: int, stale_after_s: float = STALE_AFTER_S, *,
           me: int | None = None, poll_s: float = 0.05) -> Liveness | None:
    """Watch until every rank has advanced, left a note or stood still for ``stale_after_s``.

    Blocks at most about ``stale_after_s`` (less when every rank answers sooner). ``me``
    counts as alive without watching. Returns None when the store does not answer.
    """
    try:
        watch = Watch(store, world_size, stale_after_s)
        watch.poll()
        while True:
            exited = exit_records(store, world_size)
            advanced = set(watch.advanced()) | ({me} if me is not None else set())
            stale = set(watch.stale())
            pending = [r for r in range(world_size) if r not in exited and r not in advanced and r not in stale]
            if not pending:
                alive = sorted(advanced - set(exited))
                stopped = sorted(stale - advanced - set(exited))
                return Liveness(alive=alive, exited=exited, stopped=stopped)
            time.sleep(poll_s)
            watch.poll()
    except Exception:  # the store's host is gone or frozen
        return None


def alive_ranks(store: dist.Store, world_size: int, stale_after_s: float = STALE_AFTER_S) -> list[int] | None:
    """Ranks still running (heartbeat advancing, no exit note); None when the store does not answer.

    Example:
        >>> import torch.distributed as dist
        >>> store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        >>> beat = Heartbeat(store, rank=1, every_s=0.05).start()
        >>> alive_ranks(store, world_size=2, stale_after_s=0.3)
        [1]
        >>> beat.stop()
    """
    seen = survey(store, world_size, stale_after_s)
    return None if seen is None else seen.alive


# -- diagnosis of a failed collective (the worker group's own store) ------------------------------------------------

def _consequence(note: str) -> bool:
    """An exit note of a rank that ended because it lost another (not a cause of its own)."""
    return note.startswith(("ok after losing", "WorkerLostError"))


def culprits(seen: Liveness, me: int) -> list[int]:
    """The ranks that caused a loss: those that failed or went silent; failing that, those that ended after one.

    A rank that ended only because it lost another is not blamed while a cause is known.

    Example:
        >>> culprits(Liveness(alive=[0], exited={1: "ok after losing rank(s) 2"}, stopped=[2]), me=0)
        [2]
    """
    exited = {r: why for r, why in seen.exited.items() if r != me}
    causes = [r for r, why in exited.items() if not _consequence(why)]
    return sorted([*causes, *(r for r in seen.stopped if r != me)]) or sorted(r for r, why in exited.items()
                                                                          if _consequence(why))


def describe(seen: Liveness | None, me: int) -> str:
    """Who is gone and how, in words (the middle of a WorkerLostError message).

    The headline names the ranks that caused the loss; ranks that ended only because
    they lost one of those are listed after it.

    Example:
        >>> describe(Liveness(alive=[0, 2], exited={1: "ValueError: boom"}), me=0)
        'rank(s) 1 (rank 1 raised ValueError: boom)'
        >>> describe(Liveness(alive=[0], exited={1: "ok after losing rank(s) 2"}, stopped=[2]), me=0)
        'rank(s) 2 (its heartbeat stopped: killed, crashed or frozen; rank 1 has also ended, after losing rank(s) 2)'
    """
    if seen is None:
        return ("the group's store, which no longer answers, so it cannot tell which rank is gone (the store "
                "lives in rank 0, or in the launcher under `phalanx run`/torchrun: that process has probably ended)")
    exited = {r: why for r, why in seen.exited.items() if r != me}
    causes = {r: why for r, why in exited.items() if not _consequence(why)}
    after = {r: why for r, why in exited.items() if _consequence(why)}
    lost = culprits(seen, me)
    if not lost:  # everyone is alive: nobody died; the collective itself failed
        return ("a peer, although every rank is still running (they may have called different collectives, "
                "or one was slower than the timeout)")
    how = [f"rank {r} exited normally before this collective: the ranks ran different numbers of collectives"
           if why == "ok" else f"rank {r} raised {why}" for r, why in sorted(causes.items())]
    if seen.stopped:
        whose = "its" if len(seen.stopped) == 1 else "their"
        how.append(("" if len(seen.stopped) == len(lost) == 1 else f"rank(s) {', '.join(map(str, seen.stopped))}: ")
                   + f"{whose} heartbeat stopped: killed, crashed or frozen")
    for r, why in sorted(after.items()):
        how.append(f"rank {r} has also ended, {why[3:] if why.startswith('ok ') else 'having lost contact too'}")
    return f"rank(s) {', '.join(map(str, lost))} ({'; '.join(how)})"
