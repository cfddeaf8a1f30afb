"""Watching elastic workers: shared by the launcher (``phalanx run --elastic``) and ``phalanx join``.

Whoever started a worker process watches it, on its own host: when the process
exits it marks ``elastic/dead/<id>`` and leaves the worker's liveness exit note, so
the survivors' quorum and failed collectives know at once who is gone; when its
heartbeat stops (SIGSTOP, a deadlock) it kills it, since gloo alone cannot free the
peers that wait on it. :class:`Remote` is the launcher's view of workers it did not
start (joined from another host): it cannot kill them, but it declares one dead when
its heartbeat stops, which is how a lost host is found.

Example:
    >>> describe(-9), describe(3)
    ('was killed by SIGKILL', 'exited with status 3')
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Callable

import torch.distributed as dist

from ..group import liveness
from .membership import key
from .rebuild import generation_prefix


class Watched:
    """A worker process started on this host, and what its watcher has seen of it."""

    def __init__(self, wid: str, proc: subprocess.Popen) -> None:
        self.id, self.proc = wid, proc
        self.beats, self.seen = 0, time.monotonic()
        self.returncode: int | None = None
        self.killed = False


def describe(code: int) -> str:
    """A process's exit status in words."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def poll(w: Watched, store, heartbeat_s: float, *, now: float | None = None,
         before_kill: Callable[[str, str], None] | None = None) -> int | None:
    """Check one worker once: None while it runs; its exit status the first time it is seen ended.

    A worker that ended with a non-zero status is marked dead and gets its exit note
    here; a running worker whose heartbeat stood still for ``heartbeat_s`` is killed
    (its exit is then seen by a later poll), after ``before_kill(id, why)`` (the launcher
    prints every worker's stacks there).
    """
    now = time.monotonic() if now is None else now
    if w.returncode is not None:
        return None
    code = w.proc.poll()
    if code is None:
        if w.killed or store.check([key("finished", w.id)]):
            return None  # a finished worker's heartbeat stops while it exits; that is no hang
        beats = int(store.add(key("hb", w.id), 0))
        if beats != w.beats:
            w.beats, w.seen = beats, now
        elif w.beats and now - w.seen > heartbeat_s:
            if before_kill is not None:
                before_kill(w.id, f"sent no heartbeat for {now - w.seen:.1f}s (hung or stopped)")
            print(f"phalanx: elastic: worker {w.id} (pid {w.proc.pid}) sent no heartbeat for "
                  f"{now - w.seen:.1f}s (hung or stopped); killing it", file=sys.stderr, flush=True)
            w.proc.kill()
            w.killed = True
        return None
    w.returncode = code
    if code != 0:
        mark_dead(store, w.id, describe(code))
    return code


def mark_dead(store, wid: str, how: str) -> None:
    """Tell the quorum (``dead/<id>``) and the survivors' failed collectives (the exit note) that ``wid`` is gone."""
    store.set(key("dead", wid), "1")
    exit_note(store, wid, how)


def exit_note(store, wid: str, how: str) -> None:
    """Leave the dead worker's exit note in its generation's liveness keys, as it would have itself.

    A survivor's failed collective asks liveness which peers are gone; with the note it
    knows at once instead of waiting for the dead worker's heartbeat to go stale.
    """
    generation = int(store.get(key("gen"))) if store.check([key("gen")]) else 0
    members = json.loads(store.get(key("gen", generation, "members")))
    if wid in members:
        prefix = "phalanx/0" if generation == 0 else generation_prefix(generation)
        liveness.record_exit(dist.PrefixStore(prefix, store), members.index(wid), f"worker {wid} {how}")


EXITED_AFTER_S = 1.5  # three missed heartbeats of a finished worker: its process has exited


class Remote:
    """The launcher's view of the current members it did not start: ``phalanx join`` workers of any host.

    Their own watcher (``phalanx join``) reports their deaths; when that whole host
    is lost nobody does, so a member whose heartbeat stands still for the heartbeat
    timeout is declared dead here.
    """

    def __init__(self) -> None:
        self.seen: dict[str, tuple[int, float]] = {}  # id -> (beats, when they last changed)

    def alive(self, store, local: set[str], heartbeat_s: float, *, now: float | None = None) -> list[str]:
        """Members of the newest generation started elsewhere whose process still runs.

        A finished member counts until its heartbeat stops: the store must outlive its exit,
        or its heartbeat thread would fail mid-call while the process shuts down.
        """
        now = time.monotonic() if now is None else now
        generation = int(store.get(key("gen"))) if store.check([key("gen")]) else 0
        members = json.loads(store.get(key("gen", generation, "members")))
        out = []
        for m in members:
            if m in local or store.check([key("dead", m)]):
                continue
            beats = int(store.add(key("hb", m), 0))
            last = self.seen.get(m)
            if last is None or last[0] != beats:
                self.seen[m] = (beats, now)
            elif store.check([key("finished", m)]):
                if now - last[1] > EXITED_AFTER_S:
                    continue  # finished, and its heartbeat thread has stopped: the process is gone
            elif now - last[1] > heartbeat_s:
                print(f"phalanx: elastic: worker {m} (started by `phalanx join`) sent no heartbeat for "
                      f"{now - last[1]:.1f}s; its host may be lost. The others regroup without it",
                      file=sys.stderr, flush=True)
                mark_dead(store, m, f"sent no heartbeat for {now - last[1]:.1f}s (its host may be lost)")
                continue
            out.append(m)
        return out
