"""The coordinator's view of a running job: the workers' summaries read from the job's store, once a second.

The launcher that holds the store gives a :class:`Collector` the store and two small
functions of the store: who the members are now (the generation and the worker ids in rank order) and
where the newest checkpoint is. A thread of its own reads each member's summary
(:func:`phalanx.step.telemetry.status_key`) on a connection of its own; a summary whose
sequence number stopped moving ages (its heartbeat age, by this process's clock, so hosts
need not agree on the time). :meth:`Collector.status` is what ``/status.json`` serves and
what the page and ``/metrics`` show.

Example (a store of our own and one summary in it):
    >>> import json, torch.distributed as dist
    >>> from phalanx.step.telemetry import status_key
    >>> store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> store.set(status_key("0"), json.dumps({"worker": "0", "rank": 0, "generation": 0, "step": 7, "seq": 1}))
    >>> c = Collector(store, lambda store: (0, ["0", "1"])); c.poll()
    >>> s = c.status(); s["members"], [w["step"] for w in s["workers"]]
    (['0', '1'], [7, None])
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any, Callable

from ..step.telemetry import EVERY_S, status_key
from .straggler import attribute

Members = Callable[[Any], "tuple[int, list[str]]"]  # (store) -> (generation, worker ids in rank order)
HISTORY = 600  # throughput points kept for the chart (ten minutes at one a second)


class Collector:
    """Reads the members' summaries from ``store`` every ``every_s``; :meth:`status` is the job as the page shows it."""

    def __init__(self, store: Any, members: Members, checkpoint: Callable[[Any], str | None] = lambda store: None, *,
                 every_s: float = EVERY_S, clone: bool = False) -> None:
        self._clone = clone
        if clone:  # a connection of its own: the launcher's watch loop uses the store from its own thread
            store = store.clone()
            store.set_timeout(timedelta(seconds=5))
        self.store, self.members, self.checkpoint, self.every_s = store, members, checkpoint, every_s
        self.started = time.time()
        self.generation, self.ids = 0, []
        self.summaries: dict[str, dict] = {}
        self._seen: dict[str, tuple[int, float]] = {}  # id -> (seq, monotonic time it changed)
        self.throughput: deque[tuple[float, float]] = deque(maxlen=HISTORY)
        self.changes: list[dict] = []  # membership changes, as the workers noted them
        self.ended: dict | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def move(self, store: Any) -> None:
        """Read the job from ``store`` from now on (its store moved: a standby took over); what was seen stays.

        Example:
            >>> import torch.distributed as dist
            >>> a = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            >>> b = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            >>> c = Collector(a, lambda store: (0, [])); c.move(b); c.store is b
            True
        """
        if self._clone:
            store = store.clone()
            store.set_timeout(timedelta(seconds=5))
        self.store = store  # (one assignment: the polling thread reads one store or the other)

    def poll(self) -> None:
        """Read the members and their summaries now (the thread does it every ``every_s``)."""
        generation, ids = self.members(self.store)
        found: dict[str, dict] = {}
        for wid in ids:
            k = status_key(wid)
            if self.store.check([k]):
                found[wid] = json.loads(self.store.get(k))
        now = time.monotonic()
        with self._lock:
            self.generation, self.ids = generation, list(ids)
            for wid, s in found.items():
                seq = s.get("seq", 0)
                if self._seen.get(wid, (None, 0.0))[0] != seq:
                    self._seen[wid] = (seq, now)
                self.summaries[wid] = s
                for c in s.get("changes", []):
                    self._note(c)
            rates = [found[w].get("samples_per_s") for w in ids if w in found]
            if rates and all(r is not None for r in rates) and self._fresh(ids, now):
                self.throughput.append((round(time.time() - self.started, 1), round(sum(rates), 2)))

    def _note(self, change: dict) -> None:
        """Keep one entry per generation: a member's that lived through the change (a joiner was in no group
        before it), with what later summaries add (the seconds to the first step after it)."""
        same = [k for k in self.changes if k.get("generation") == change.get("generation")]
        if not same:
            self.changes.append(dict(change))
        elif change.get("was", 0) > same[0].get("was", 0):
            same[0].update(change)
        else:
            for key, v in change.items():
                same[0].setdefault(key, v)

    def _fresh(self, ids: list[str], now: float) -> bool:
        return all(w in self._seen and now - self._seen[w][1] < 3 * self.every_s for w in ids)

    def status(self) -> dict[str, Any]:
        """The job now: generation, members, each worker's figures, the straggler, changes, checkpoint, throughput."""
        now = time.monotonic()
        with self._lock:
            workers = []
            for rank, wid in enumerate(self.ids):
                s = dict(self.summaries.get(wid, {}))
                seen = self._seen.get(wid)
                row = {"worker": wid, "rank": rank, "host": s.get("host"), "pid": s.get("pid"),
                       "step": s.get("step"), "steps": s.get("steps", 0), "generation": s.get("generation"),
                       "step_s": s.get("step_s"), "compute_s": s.get("compute_s"), "input_s": s.get("input_s"),
                       "exchange_s": s.get("exchange_s"), "samples_per_s": s.get("samples_per_s"),
                       "bytes_per_step": s.get("bytes_per_step"), "share": s.get("share"),
                       "heartbeat_age_s": round(now - seen[1], 2) if seen else None, "straggler": None}
                if s.get("generation") != self.generation:  # from before the regroup: its split no longer holds
                    row.update(steps=0, step_s=None)
                workers.append(row)
            straggler = attribute(workers) if self.ended is None else None
            for row in workers:
                if straggler is not None and row["worker"] == straggler["worker"]:
                    row["straggler"] = straggler["text"]
            first = next((self.summaries[w] for w in self.ids if self.summaries.get(w, {}).get("strategy")), {})
            strategy = first.get("schedule") or first.get("strategy")
            in_flight = first.get("in_flight") or []
            out = {"generation": self.generation, "members": list(self.ids), "workers": workers,
                   "straggler": straggler, "strategy": strategy, "in_flight": in_flight,
                   "changes": list(self.changes[-10:]),
                   "throughput": list(self.throughput), "started": self.started, "ended": self.ended,
                   "checkpoint": self._checkpoint(), "now": time.time()}
        return out

    def _checkpoint(self) -> dict | None:
        try:
            path = self.checkpoint(self.store)
        except Exception:  # noqa: BLE001 - the store went with the job; the page still shows the rest
            return None
        if path is None:
            return None
        try:
            age = round(time.time() - os.path.getmtime(path), 1)
        except OSError:
            age = None  # written on another host
        return {"path": path, "age_s": age}

    def end(self, code: int, reason: str) -> None:
        """The job ended with exit status ``code``; ``reason``: the launcher's last line about it."""
        self.settle()
        with self._lock:
            self.ended = {"code": code, "reason": reason, "at": time.time()}
        self._stop.set()

    def settle(self) -> None:
        """Read the workers' last summaries now, while the store is still up (the launcher calls it at the end)."""
        if self.ended is None:
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the store went first: the page keeps the previous reading
                pass

    def start(self) -> "Collector":
        """Poll every ``every_s`` from a daemon thread until :meth:`end`; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="phalanx-status-collect", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a store that does not answer now may answer next time
                pass
            self._stop.wait(self.every_s)


__all__ = ["Collector", "Members"]
