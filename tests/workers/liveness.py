"""Worker functions for tests/group/test_liveness.py: failures injected in one line, survivors report what they saw."""
from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

import phalanx as px


def _step() -> None:
    t = torch.ones(4)
    px.Comm().all_reduce_([t], op="sum")


def raise_at(step: int, rank: int, steps: int = 50) -> None:
    """Every rank all-reduces each step; ``rank`` raises ValueError at ``step`` (nothing catches it)."""
    px.init()
    for now in range(steps):
        if px.rank() == rank and now == step:
            print(f"RAISE {time.time():.6f}", flush=True)
            raise ValueError(f"boom at step {step}")
        _step()
        time.sleep(0.01)  # sleep: a step of known length, so the raise lands mid-run


def _diagnosed_key(rank: int) -> str:
    return f"test/diagnosed/{rank}"


def _busy_until_diagnosed(victim: int, slow: int) -> None:
    """Rank ``slow`` stays out of every collective until each other survivor has been told who is lost.

    It is busy elsewhere for the survivors' whole diagnosis (an event, not a guessed sleep): longer than any
    check-in window a diagnosis might wait for it (the old one was 3 s and blamed it). Bounded: a diagnosis
    takes at most about the heartbeat's stale time plus a store probe.
    """
    from datetime import timedelta

    from phalanx.group import group
    from phalanx.group.liveness import STALE_AFTER_S, STORE_PROBE_TIMEOUT_S
    others = [r for r in range(px.world_size()) if r not in (victim, slow)]
    group.store().wait([_diagnosed_key(r) for r in others],
                       timedelta(seconds=4 * (STALE_AFTER_S + STORE_PROBE_TIMEOUT_S)))


def _until_lost(victim: int, step: int, sig: signal.Signals, steps: int, slow: int | None = None,
                on_lost: Any = None) -> dict[str, Any]:
    """All-reduce every step; ``victim`` sends itself ``sig`` at ``step``. A survivor reports its WorkerLostError.

    ``slow``: a rank busy outside the collectives from ``step`` until every other survivor has its diagnosis.
    """
    at = None
    try:
        for now in range(steps):
            if now == step:
                at = time.time()
                if px.rank() == victim:
                    os.kill(os.getpid(), sig)
                if px.rank() == slow:
                    _busy_until_diagnosed(victim, slow)
            _step()
    except px.WorkerLostError as err:
        if slow is not None:
            from phalanx.group import group
            group.store().set(_diagnosed_key(px.rank()), "1")  # the slow rank may join the collective now
        if on_lost is not None:
            on_lost()
        return {"message": str(err), "after_s": time.time() - at, "lost_ranks": err.lost_ranks}
    return {"message": None, "after_s": None, "lost_ranks": None}


def kill_one(victim: int, step: int = 3, slow: int | None = None, steps: int = 200) -> dict[str, Any]:
    """``victim`` kills itself with SIGKILL at ``step``; rank ``slow`` is busy (not in a collective) when it happens.

    A survivor returns the WorkerLostError message it got, and how long after reaching ``step`` it came.
    """
    px.init()
    return _until_lost(victim, step, signal.SIGKILL, steps, slow=slow)


def freeze_one(victim: int, step: int = 3, steps: int = 10000) -> dict[str, Any]:
    """``victim`` freezes itself with SIGSTOP at ``step`` (a hung peer); survivors report, then rank 0 reaps it."""
    from phalanx.group import group
    px.init()
    group.store().set(f"test/pid/{px.rank()}", str(os.getpid()))

    def reap() -> None:
        if px.rank() == 0:
            os.kill(int(group.store().get(f"test/pid/{victim}")), signal.SIGKILL)
    return _until_lost(victim, step, signal.SIGSTOP, steps, on_lost=reap)


def noted_while_a_peer_waits(synchronous: bool = False) -> dict[str, Any]:
    """Rank 1 stays out of the all-reduce, alive (its sockets open: gloo cannot fail the collective), and leaves a
    failure note as the elastic launcher does for a worker it saw killed; rank 0 reports how its wait ended."""
    from datetime import timedelta

    from phalanx.group import group, liveness
    px.init()
    store = group.store()
    if px.rank() == 1:
        liveness.record_exit(group.current().probe, 1, "KilledBySIGKILL: by the test")
        store.wait(["test/done"], timedelta(seconds=120))  # alive until rank 0 has its answer
        return {}
    t, started = torch.ones(4), time.monotonic()
    try:
        if synchronous:
            px.Comm().all_reduce_([t])
        else:
            px.Comm().all_reduce_async(t).wait()
        return {"message": None, "after_s": time.monotonic() - started}
    except px.WorkerLostError as err:
        return {"message": str(err), "after_s": time.monotonic() - started, "lost_ranks": err.lost_ranks}
    finally:
        store.set("test/done", "1")
