"""``phalanx stacks`` and the launcher's step-progress watchdog: every worker's Python stacks, one block per rank.

    phalanx stacks                                   # the one job you run on this host
    phalanx stacks --rdzv-endpoint HOST:PORT --secret-file PATH    # any job, from any host

Each worker answers through the job's store (:mod:`phalanx.group.stacks`: faulthandler on a
signal it raises in itself, so a worker spinning in Python or blocked in a collective answers
too). A request must prove it holds the job's secret; without it the workers answer nothing.
``phalanx run`` (one host) and ``phalanx run --elastic`` leave a note of their store and secret
file in a directory only you can read (:func:`register_job`), which is how ``phalanx stacks``
finds the job with no arguments; a job on another host is named by the store address its
launcher prints and the secret file (or ``PHALANX_SECRET``), as for ``phalanx join``.

**The watchdog.** The launcher reads each worker's step count (published by the worker
every :data:`~phalanx.group.stacks.POLL_S`) and keeps the group's recent step time. When
some worker has completed no step for :meth:`Watchdog.bound` seconds (``FACTOR`` times
the recent step time, at least ``FLOOR_S``, at most the heartbeat timeout under ``--elastic``
and half the collective timeout otherwise, so it comes before either ends anything; that
most until a step time is measured), it asks
every worker for its stacks and prints them, one block per rank, before anything is killed:
under ``--elastic`` a worker whose heartbeat stopped is killed only after the stacks are
printed. Once per stall; a step anywhere re-arms it. The job's last lines say when stacks
were printed. It arms at the group's first step, so a job still starting is never
taken for stuck; a long pause outside the step (an evaluation, a checkpoint) longer than the
bound prints stacks once, which shows where it is.

Example:
    >>> dog = Watchdog(None, "s", cap_s=30.0)
    >>> dog.observe({"0": 10, "1": 10}, now=0.0); dog.observe({"0": 20, "1": 20}, now=1.0)
    >>> round(dog.step_time(), 3), dog.bound()
    (0.1, 5.0)
    >>> dog.observe({"0": 21, "1": 20}, now=7.0); dog.stalled(now=7.0)
    (6.0, ['1'])
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Callable, Iterable, NoReturn, Sequence, TextIO

import torch.distributed as dist

from ..elastic import secret as job_secret
from ..errors import ConfigError, PhalanxError, usage
from ..group import stacks
from ..group.stacks import ANSWER_S, Stacks, blocks, request_stacks

FACTOR = 20.0  # a stall is this many recent step times without a step ...
FLOOR_S = 5.0  # ... and at least this long: the step counts are read every 0.5 s, by a launcher sharing the cores
POLL_S = 0.5  # the non-elastic launcher's watchdog reads the step counts this often
PROBE_TIMEOUT_S = 5.0
WINDOW = 20  # step-time samples kept


class Watchdog:
    """Print every worker's stacks when the group completes no step for :meth:`bound` seconds.

    ``store``: the job's store (a connection of the caller's thread); ``secret``: the job's;
    ``cap_s``: the most the bound may be. ``expect()``: the worker ids that count (default:
    every worker answering requests); ``lost()``: ids known dead (their stacks are not waited
    for); ``epoch()``: a value that changes with the membership (a regroup resets the clocks).
    """

    def __init__(self, store: dist.Store | None, secret: str, cap_s: float, *,
                 expect: Callable[[], Iterable[str]] | None = None, lost: Callable[[], Iterable[str]] | None = None,
                 epoch: Callable[[], object] | None = None, out: TextIO | None = None,
                 answer_s: float = ANSWER_S) -> None:
        self.store, self.secret, self.cap_s = store, secret, cap_s
        self.expect, self.lost, self.epoch, self.answer_s = expect, lost, epoch, answer_s
        self.out = out
        self.last: dict[str, tuple[int | None, float]] = {}  # id -> (its step, when it last changed)
        self.group: deque[tuple[float, int]] = deque(maxlen=WINDOW + 1)  # (when, the group's step) as it moved
        self.armed_at: float | None = None  # when the first step was seen
        self.firing = False  # a stall was reported and no step came since
        self.printed: list[tuple[float, float]] = []  # (wall time, seconds without a step) of each report
        self._epoch: object = None

    # -- what the step counts say -------------------------------------------------------------------------------
    def observe(self, steps: dict[str, int | None], now: float) -> None:
        """Take the workers' step counts now (None: none published yet); those absent no longer count."""
        for wid in list(self.last):
            if wid not in steps:
                del self.last[wid]
        for wid, step in steps.items():
            seen = self.last.get(wid)
            if seen is None or seen[0] != step:
                self.last[wid] = (step, now)
        known = [s for s, _ in self.last.values() if s is not None and s >= 0]
        if known and (not self.group or self.group[-1][1] != min(known)):
            self.group.append((now, min(known)))
            self.armed_at = now if self.armed_at is None else self.armed_at

    def step_time(self) -> float | None:
        """The median seconds per group step over the recent window; None before the group's steps moved twice."""
        rates = [(t1 - t0) / (s1 - s0) for (t0, s0), (t1, s1) in zip(self.group, list(self.group)[1:]) if s1 > s0]
        return statistics.median(rates) if rates else None

    def bound(self) -> float | None:
        """Seconds without a step that make a stall; None while no worker has stepped, the cap until a step time."""
        if not self.group:
            return None
        step = self.step_time()
        return self.cap_s if step is None else min(self.cap_s, max(FLOOR_S, FACTOR * step))

    def stalled(self, now: float) -> tuple[float, list[str]]:
        """The longest any counted worker has gone without a step, and which workers went that long."""
        if not self.last or not self.group:
            return 0.0, []
        oldest = min(t for _, t in self.last.values())
        # counted from the group's first step at the earliest: a worker's setup before it is no stall
        return now - max(oldest, self.armed_at or oldest), sorted(w for w, (_, t) in self.last.items() if t == oldest)

    def reset(self, now: float) -> None:
        """The membership changed: every worker starts a fresh wait (a regroup is not a stall)."""
        self.last = {w: (s, now) for w, (s, _) in self.last.items()}
        self.firing = False

    # -- one look at the job ------------------------------------------------------------------------------------------
    def poll(self, now: float | None = None, silent: Iterable[str] = ()) -> bool:
        """Read the step counts once and report a stall if there is one; True when stacks were printed now.

        ``silent``: workers whose heartbeat has stood still a while; their answers are not waited for (a
        stopped process cannot answer), which keeps the caller's watch short.
        """
        now = time.monotonic() if now is None else now
        if self.store is None:
            return False
        if self.epoch is not None:
            epoch = self.epoch()
            if epoch != self._epoch:
                self._epoch = epoch
                self.reset(now)
        ids = list(self.expect()) if self.expect is not None else stacks.responders(self.store)
        present = [w for w in ids if self.store.check([stacks.key("step", w)])]
        values = self.store.multi_get([stacks.key("step", w) for w in present]) if present else []
        steps: dict[str, int | None] = {w: None for w in ids}
        steps.update({w: int(v) for w, v in zip(present, values)})
        self.observe(steps, now)
        bound = self.bound()
        waited, who = self.stalled(now)
        if bound is None or waited < bound:
            self.firing = False
            return False
        if self.firing:
            return False
        step = self.step_time()
        how = f"{FACTOR:g} x the recent step time of {step:.3f} s, at least {FLOOR_S:g} s, at most {self.cap_s:g} s" \
            if step is not None else "no step time measured yet, so the most it may be"
        self.report(f"the group has completed no step for {waited:.1f} s (worker(s) {', '.join(who)} the longest; "
                    f"the bound is {bound:.1f} s: {how})", waited, ids, hung=list(silent))
        return True

    def before_kill(self, wid: str, why: str) -> None:
        """About to kill worker ``wid`` (``why``, in words): print every worker's stacks first (once per stall)."""
        if self.firing or self.store is None:
            return
        ids = list(self.expect()) if self.expect is not None else stacks.responders(self.store)
        waited, _ = self.stalled(time.monotonic())
        self.report(f"worker {wid} {why}; before it is killed", waited, ids, hung=[wid])

    def report(self, why: str, waited: float, ids: list[str], hung: Iterable[str] = ()) -> None:
        """Ask every worker in ``ids`` for its stacks and print them, one block per rank, under one header.

        ``hung``: workers whose heartbeat stopped; they cannot answer, so their answers are not waited for.
        """
        self.firing = True
        self.printed.append((time.time(), waited))
        hung = list(hung)

        def lost() -> list[str]:
            return [*(self.lost() if self.lost is not None else ()), *hung]

        try:
            got = request_stacks(self.store, self.secret, expect=ids, timeout_s=self.answer_s, lost=lost)
            text = "\n".join(blocks(got, self.answer_s))
        except (PhalanxError, dist.DistError) as err:
            text = f"(the stacks could not be collected: {type(err).__name__}: {str(err).splitlines()[0][:200]})"
        out = self.out or sys.stderr
        print(f"phalanx: stacks: {why}; every worker's Python stacks, all threads, most recent call first:\n{text}\n"
              "phalanx: stacks: end", file=out, flush=True)

    def end_note(self) -> str | None:
        """The line the launcher ends with when stacks were printed during the job (None when none were)."""
        if not self.printed:
            return None
        first, waited = self.printed[0]
        when = time.strftime("%H:%M:%S", time.localtime(first))
        return (f"phalanx: the group stalled {len(self.printed)} time(s) in this job; every worker's stacks were "
                f"printed above each time, under 'phalanx: stacks:' (the first at {when}, after {waited:.1f} s "
                "without a step)")


class WatchThread:
    """The non-elastic launcher's watchdog: a daemon thread with its own connection to the job's store."""

    def __init__(self, host: str, port: int, secret: str, cap_s: float) -> None:
        self.host, self.port, self.secret, self.cap_s = host, port, secret, cap_s
        self.dog: Watchdog | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-stall-watch", daemon=True)

    def start(self) -> "WatchThread":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            store = connect(self.host, self.port)
        except PhalanxError:
            return
        self.dog = Watchdog(store, self.secret, self.cap_s)
        while not self._stop.wait(POLL_S):
            try:
                self.dog.poll()
            except dist.DistError:  # the store closed: the job is over
                return

    def stop(self) -> str | None:
        """Stop watching; returns the launcher's last line about stalls, if any."""
        self._stop.set()
        self._thread.join(timeout=POLL_S + 2 * ANSWER_S)
        return self.dog.end_note() if self.dog is not None else None


def connect(host: str, port: int) -> dist.TCPStore:
    """A client connection to the job's store at ``host:port``; one :class:`PhalanxError` line if none answers."""
    try:  # a plain socket first: torch logs a failed store connection at length (as `phalanx join` does)
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as err:
        raise PhalanxError(f"no job answers at {host}:{port} ({err.strerror or type(err).__name__}); check the "
                           "address, and that the job is still running") from None
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=PROBE_TIMEOUT_S),
                             wait_for_workers=False)
    except Exception as err:  # noqa: BLE001 - refused, unreachable, timed out: no job there
        raise PhalanxError(f"no job answers at {host}:{port} ({type(err).__name__}); check the address, and that the "
                           "job is still running") from None


# -- finding a job on this host -------------------------------------------------------------------------------------

def jobs_dir() -> str:
    """Where this user's launchers on this host leave their notes (mode 0700)."""
    return os.path.join(tempfile.gettempdir(), f"phalanx-jobs-{os.getuid()}")


def register_job(host: str, port: int, secret_file: str | None, script: str) -> str:
    """Leave a note of this launcher's job for ``phalanx stacks``; returns its path (remove it when the job ends).

    Example:
        >>> path = register_job("127.0.0.1", 29400, None, "train.py"); [j["port"] for j in running_jobs()][-1]
        29400
        >>> os.remove(path)
    """
    folder = jobs_dir()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, f"{os.getpid()}.json")
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "host": host, "port": port, "secret_file": secret_file,
                   "script": script, "started": time.time()}, f)
    os.replace(tmp, path)
    return path


def running_jobs() -> list[dict]:
    """The notes of this user's launchers still running on this host, oldest first; a dead launcher's is removed."""
    folder, found = jobs_dir(), []
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    except OSError:
        return []
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                job = json.load(f)
            os.kill(int(job["pid"]), 0)
        except ProcessLookupError:
            try:
                os.remove(path)
            except OSError:
                pass
            continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found.append(job)
    return sorted(found, key=lambda j: j.get("started", 0))


# -- `phalanx stacks` -------------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(usage(f"`phalanx stacks`: {message}", "`phalanx stacks [--rdzv-endpoint HOST:PORT "
                                "--secret-file PATH]`", "See `phalanx stacks --help`."))


def main(argv: Sequence[str]) -> int:
    """``phalanx stacks``: print every worker's Python stacks, one block per rank; returns the exit status.

    0 when every worker answered, 1 when some did not (their blocks say so).
    """
    p = _Parser(prog="phalanx stacks", description="Print every worker's Python stacks (all threads) of a running "
                "job, one block per rank, as each worker dumps them itself (it may spin or wait in a collective).")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="the job's store (default: the one job you run on this host)")
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help=f"file holding the job's secret (default: the job's own, or {job_secret.ENV})")
    p.add_argument("--timeout", default=str(ANSWER_S), metavar="S", help="seconds to wait for the answers")
    a = p.parse_args(list(argv))
    try:
        timeout_s = float(a.timeout)
    except ValueError:
        timeout_s = -1.0
    if not timeout_s > 0:
        raise ConfigError(usage(f"--timeout {a.timeout}", "a positive number of seconds", "Pass e.g. --timeout 5."))
    host, port, secret_file = _locate(a.rdzv_endpoint, a.secret_file)
    given = job_secret.load(os.environ, secret_file)
    if given is None:
        raise ConfigError(usage(f"`phalanx stacks` to {host}:{port} without the job's secret",
                                f"--secret-file PATH (the file the launcher named) or {job_secret.ENV}",
                                "Never pass the secret on the command line."))
    store = connect(host, port)
    if not stacks.responders(store):
        raise PhalanxError(f"no worker of the job at {host}:{port} answers stack requests (it is starting or "
                           f"finished, or its workers were started without a {job_secret.ENV})")
    got = request_stacks(store, given, timeout_s=timeout_s)  # StacksRefused: one line from the CLI
    print("\n".join(blocks(got, timeout_s)), flush=True)
    return 0 if all(isinstance(s, Stacks) for s in got.values()) else 1


def _locate(endpoint: str | None, secret_file: str | None) -> tuple[str, int, str | None]:
    """The job's store address and secret file: from the flags, else from the one job of ours on this host."""
    if endpoint is not None:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(usage(f"--rdzv-endpoint {endpoint}", "HOST:PORT",
                                    "Pass the job's store address, e.g. --rdzv-endpoint 10.0.0.1:29400."))
        return host, int(port), secret_file
    jobs = running_jobs()
    if not jobs:
        raise PhalanxError("no phalanx job of yours runs on this host; for a job on another host pass "
                           "--rdzv-endpoint HOST:PORT and --secret-file PATH")
    if len(jobs) > 1:
        listed = "; ".join(f"{j['host']}:{j['port']} ({j['script']}, launcher pid {j['pid']})" for j in jobs)
        raise ConfigError(usage(f"`phalanx stacks` with {len(jobs)} jobs running here ({listed})", "one job",
                                "Pass --rdzv-endpoint HOST:PORT of the one you mean."))
    job = jobs[0]
    return job["host"], int(job["port"]), secret_file or job.get("secret_file")


__all__ = ["FACTOR", "FLOOR_S", "WatchThread", "Watchdog", "connect", "jobs_dir", "main", "register_job",
           "running_jobs"]
