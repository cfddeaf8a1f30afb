"""Test utilities: start real worker processes, inject failures in one line.

``run_workers("workers.mod:fn", world_size=2)`` starts one Python process per rank with the
variables ``phalanx run`` and torchrun set and returns what each rank's ``fn(**kwargs)``
returned; nothing is mocked, the workers talk gloo. It is the runner the benchmarks use
(:mod:`phalanx.bench.procs`), so a test and a benchmark start their workers alike, except that
tests fork their ranks from a server that imported torch once (``start_method="forkserver"``):
each rank is still its own process, and the suite spends its time testing rather than importing.
"""
from __future__ import annotations

import os
import subprocess
import sys

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from phalanx.bench import procs
from phalanx.bench.procs import WorkerRun, free_port

__all__ = ["WorkerRun", "at_once", "free_port", "kill_at", "outcome", "reap", "run_workers", "shared_run"]


def run_workers(target: str, world_size: int = 2, **options: Any) -> WorkerRun:
    """:func:`phalanx.bench.procs.run_workers`, forking ranks from the preloaded server unless told otherwise."""
    options.setdefault("start_method", "forkserver")
    return procs.run_workers(target, world_size, **options)


def shared_run(target: str, world_size: int = 2, *, name: str = "runs", **options: Any) -> Any:
    """A module-scoped fixture ``name``: each rank's result of one :func:`run_workers`, shared by the module's tests.

    Example:
        >>> runs = shared_run("workers.unused:unused", timeout=180, names=["allreduce"])  # at module level
    """
    import pytest  # here: the workers import this module too, and need no pytest

    @pytest.fixture(scope="module", name=name)
    def results() -> list:
        return run_workers(target, world_size, **options).results

    return results


def kill_at(step: int, *, rank: int, now: int, my_rank: int | None = None, code: int = 1) -> None:
    """Failure injection in one line: ``kill_at(5, rank=1, now=step)`` exits rank 1 at step 5."""
    from phalanx.group import group
    me = group.rank() if my_rank is None else my_rank
    if me == rank and now == step:
        sys.stdout.flush()
        os._exit(code)


def reap(*procs: subprocess.Popen | None) -> None:
    """Kill (SIGKILL) and wait for each of ``procs`` still running; ``None`` (never started) is skipped.

    A test's ``finally:`` so that a failed wait leaves no launcher or joiner behind.

    Example:
        >>> reap(None)
    """
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def at_once(jobs: dict[Any, Callable[[], Any]], at_most: int | None = None) -> dict[Any, Any]:
    """Run every job at once, in threads (each starts processes of its own and mostly waits on them: one after the
    other they left the cores idle); each job's result, or the exception it raised (:func:`outcome` raises it again
    in the test that reads that job). ``at_most``: jobs running at a time (default: all).

    Example:
        >>> got = at_once({"a": lambda: 1, "b": lambda: 1 / 0})
        >>> outcome(got, "a"), type(got["b"]).__name__
        (1, 'ZeroDivisionError')
    """
    with ThreadPoolExecutor(at_most or len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: f.exception() or f.result() for name, f in futures.items()}


def outcome(results: dict[Any, Any], name: Any) -> Any:
    """One job's result from :func:`at_once`, or the exception it raised, raised here (in the test reading it)."""
    got = results[name]
    if isinstance(got, BaseException):
        raise got
    return got
