"""What a worker tells the job's status page (``phalanx run --status``): its steps, split into their parts.

Each step is split from timestamps phalanx already takes: the step clock closes a step
(``optimizer.step()``), the loader times how long it waited for its batch, and the clock
sums the time spent in the exchange (from the last local gradient to the end of the
averaging, and in ``after_step``: :attr:`~phalanx.step.clock.StepClock.waited`). What is
left of the step is compute: forward, backward, the optimizer and your own code. Per step
this costs a ``perf_counter`` and one tuple appended to a ring of the last
:data:`WINDOW` steps (a few microseconds: docs/monitoring.md has the figures); a daemon
thread of the :class:`Reporter`, on its own store connection, writes a summary of the ring
into the job's store every :data:`EVERY_S` seconds, where the launcher that serves the page
reads it (:mod:`phalanx.monitor`). Nothing is sent per step, and nothing when no page was
asked for: the reporter starts only under ``phalanx run --status`` (``PHALANX_STATUS``).

Example (a reporter with no store: it measures, and its summary is what it would send):
    >>> from phalanx.step.clock import StepClock
    >>> r, clock = Reporter(None, "0"), StepClock()
    >>> for step in range(1, 4):
    ...     r.input_waited(0.0, samples=8); clock.step = step; r.closed(clock)
    >>> s = r.summary(); s["step"], s["steps"]
    (3, 2)
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time
from collections import deque
from typing import Any

from ..group import group
from ..group.liveness import second_connection
from ..group.records import Record, Slot

WINDOW = 50  # steps each summary (and the straggler attribution) covers
EVERY_S = 1.0  # how often a worker writes its summary into the store


def status_key(worker: str) -> str:
    """Where worker ``worker`` (its elastic id, or its rank) leaves its summary in the job's store.

    Example:
        >>> status_key("1")
        'phalanx/job/status/worker/1'
    """
    return group.job_key("status", "worker", worker)


class Reporter:
    """One worker's step measurements and the thread that sends their summary (made by :func:`start`)."""

    def __init__(self, g: group.Group | None, worker: str, every_s: float = EVERY_S) -> None:
        self.group, self.worker, self.every_s = g, worker, every_s
        # per step of this generation: (seconds, input seconds, exchange seconds, samples, bytes sent so far)
        self.steps: deque[tuple[float, float, float, int, int]] = deque(maxlen=WINDOW)
        self.step = 0
        self.share: float | None = None  # this worker's share of the global batch (px.shard(balance="speed"))
        self.changes: deque[dict] = deque(maxlen=10)  # the last membership changes (phalanx.elastic notes them)
        self.strategy: Any = None  # the first wrapped model's rule: its name and its bytes per step
        self._clock: Any = None  # the clock whose steps are timed (the first model's, with several)
        self._sent: Any = None  # the rule's CommStats (phalanx.group.collectives), if it has a comm
        self._last: float | None = None  # perf_counter when the previous step closed
        self._waited = 0.0  # the clock's exchange seconds then
        self._input, self._samples = 0.0, 0
        self._first_after: dict | None = None  # a membership change whose first step is still to come
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: Any = None

    # -- per step: the training thread --------------------------------------------------------------------
    def input_waited(self, seconds: float, samples: int, share: float | None = None) -> None:
        """The loader waited ``seconds`` for a batch of ``samples`` samples (``share``: of the global batch)."""
        self._input += seconds
        self._samples += samples
        if share is not None:
            self.share = share

    def closed(self, clock: Any) -> None:
        """A step closed on ``clock`` (:class:`~phalanx.step.clock.StepClock`): time it, from the previous one."""
        if self._clock is None:
            self._clock, self.strategy = clock, clock.strategy
            self._sent = getattr(getattr(clock.strategy, "comm", None), "stats", None)
        elif clock is not self._clock:
            return
        now = time.perf_counter()
        if self._last is not None:
            self.steps.append((now - self._last, self._input, clock.waited - self._waited, self._samples,
                               self._sent.bytes_sent if self._sent is not None else 0))
        self._last, self._waited, self._input, self._samples = now, clock.waited, 0.0, 0
        self.step = clock.step
        if self._first_after is not None:
            self._first_after["first_step_s"] = round(time.monotonic() - self._first_after.pop("_at"), 3)
            self._first_after = None

    def changed(self, note: dict) -> None:
        """The group changed (``note``: who left, who joined, what it cost); the next step is timed anew."""
        entry = {k: v for k, v in note.items() if isinstance(v, (int, float, str, list)) and k != "cause"}
        entry["_at"] = time.monotonic()
        self.changes.append(entry)
        self._first_after = entry
        self._last = None  # the regroup is not a step
        self.steps.clear()  # the medians describe this generation: its world size sets the step

    # -- every EVERY_S: the reporter's thread -------------------------------------------------------------
    def summary(self) -> dict:
        """What the page shows of this worker: medians over the last :data:`WINDOW` steps, and who it is."""
        steps = list(self.steps.copy())  # deque.copy is one C call: the training thread cannot interleave
        g = self.group
        out: dict[str, Any] = {"worker": self.worker, "rank": g.rank if g else 0, "generation": g.generation if g
                               else 0, "world_size": g.world_size if g else 1, "host": socket.gethostname(),
                               "pid": os.getpid(), "step": self.step, "steps": len(steps), "share": self.share,
                               "time": time.time(), "changes": [{k: v for k, v in c.items() if k != "_at"}
                                                                for c in list(self.changes)]}
        if steps:
            total = [s[0] for s in steps]
            inputs = [min(s[1], s[0]) for s in steps]
            exchange = [min(s[2], s[0] - i) for s, i in zip(steps, inputs)]
            out.update(step_s=statistics.median(total), input_s=statistics.median(inputs),
                       exchange_s=statistics.median(exchange),
                       compute_s=statistics.median(t - i - e for t, i, e in zip(total, inputs, exchange)))
            samples = sum(s[3] for s in steps)
            out["samples_per_s"] = samples / sum(total) if samples else None
            if self._sent is not None and len(steps) > 1:  # what the last steps sent, not a mean since the start
                out["bytes_per_step"] = (steps[-1][4] - steps[0][4]) / (len(steps) - 1)
        if self.strategy is not None:
            out["strategy"] = type(self.strategy).__name__
            out["schedule"] = repr(self.strategy)[:300]  # the rule and its exchange schedule, e.g. LocalSGD(every(4))
            # StreamingDiLoCo: the fragments whose exchange is in flight (sent, not applied yet)
            out["in_flight"] = [f.index for f in getattr(self.strategy, "fragments", None) or []
                                if getattr(f, "sent_at", -1) >= 0]
        return out

    def send(self) -> None:
        """Write :meth:`summary` into the job's store now (the thread does it every ``every_s``)."""
        if self._store is None:
            job = self.group.job_store if self.group is not None else None
            if job is None:
                return  # not formed yet (an elastic joiner before its entry): the next tick tries again
            self._store = second_connection(job)
        self._seq += 1
        self._store.set(status_key(self.worker), json.dumps({**self.summary(), "seq": self._seq}))

    def start(self) -> "Reporter":
        """Send now and every ``every_s`` from a daemon thread; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="phalanx-status", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sending (safe twice)."""
        self._stop.set()

    def _run(self) -> None:
        while True:
            try:
                self.send()
            except Exception:  # noqa: BLE001 - the store is gone (the job ends) or rebuilding: the page shows age
                self._store = None
            if self._stop.wait(self.every_s):
                return


class Reporting(Slot[Reporter]):
    """The group's reporter (``None`` unless ``phalanx run --status`` asked for one)."""

    def before_leaving(self, failing: bool) -> None:
        """Send the last summary (the page shows the final step) and stop."""
        if self.value is not None:
            try:
                self.value.send()
            except Exception:  # noqa: BLE001 - leaving anyway; the store may be gone
                pass
            self.value.stop()


REPORT: Record[Reporting] = Record("status report", Reporting)


def of(g: group.Group | None = None) -> Reporter | None:
    """The reporter of group ``g`` (default: the current one), or None: the loader and the clock ask this."""
    if g is None:
        if not group.is_initialized():
            return None
        g = group.current()
    return REPORT.of(g).value


def start(g: group.Group) -> Reporter:
    """Start ``g``'s reporter if it has none (``px.wrap`` does, under ``phalanx run --status``); returns it.

    Example:
        >>> import phalanx as px
        >>> r = start(px.init()); r is of(); r.stop()
        True
    """
    slot = REPORT.of(g)
    if slot.value is None:
        slot.value = Reporter(g, g.env.elastic_id or str(g.rank)).start()
    return slot.value


__all__ = ["EVERY_S", "REPORT", "Reporter", "Reporting", "WINDOW", "of", "start", "status_key"]
