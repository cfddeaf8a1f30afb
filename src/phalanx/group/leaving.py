"""How a worker leaves its group: at the end of a run, on an error, at interpreter exit.

The group (:mod:`phalanx.group.group`) owns who is in the run; this module owns the way out,
which is where distributed jobs hang or lose their diagnosis:

* a worker ending normally meets its peers in the store, then at a short barrier, so that
  nobody destroys a gloo group while a peer still tears its own down (that aborts the
  process now and then);
* a worker ending with an exception skips the barrier, leaves a note in the store (read by
  its peers' :class:`~phalanx.errors.WorkerLostError`) and an error file (read by the
  launcher), and ends at once;
* the worker hosting the store keeps it up, a few seconds at most, until every peer has
  left a note or gone silent, so their diagnosis can still read it.

:func:`phalanx.group.group.shutdown` runs these steps in order; the functions here take the group
as an argument and never look up the current one.

Example:
    >>> release(object())  # nothing held a reference to this "process group"
    0
"""
from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import functools
import gc
import os
import sys
import threading
import time
import traceback
import warnings
import weakref
from datetime import timedelta
from typing import Any, Callable, NoReturn, Sequence

import torch.distributed as dist

from . import liveness
from ..errors import PhalanxError


def leave_at_exit(g: Any, shutdown: Callable[[], None]) -> None:
    """Once per group (``g``: a :class:`phalanx.group.group.Group`), when it first has a store: ``shutdown`` at exit.

    Scripts rarely call ``px.shutdown()``, and exiting with a process group still up can abort (see
    :func:`phalanx.group.group.shutdown`); an uncaught exception is recorded at once for the peers and the launcher.
    """
    if g.leaves_at_exit:
        return
    g.leaves_at_exit = True
    atexit.register(_at_exit, g, shutdown)
    _install_excepthook(g)


def _install_excepthook(g: Any) -> None:
    """Record an uncaught exception at once, so peers and the launcher learn who failed and why."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb) -> None:  # type: ignore[no-untyped-def]
        g.uncaught = exc
        g.fail(exc)
        # Under `phalanx run` the launcher prints a usage error (or a Ctrl-C) in one line, once.
        quiet = g.env.launched_by_phalanx and not g.env.debug and isinstance(exc, (PhalanxError, KeyboardInterrupt))
        if not quiet:
            previous(exc_type, exc, tb)
        sys.stderr.flush()

    sys.excepthook = hook


def _at_exit(g: Any, shutdown: Callable[[], None]) -> None:
    """Leave the group at interpreter exit; after an uncaught exception, end the process at once.

    Tearing down an interpreter that holds a process group takes from half a second to
    several on a busy machine, and the launcher only stops the others once this
    process is gone. Exit handlers registered after ``px.init()`` have already run by
    now (they run last-in, first-out); logging is flushed here.

    A failure of the way out itself (an asynchronous checkpoint that failed and that nobody waited
    for) ends the worker as any failure would: one line, exit status 1. Raised from here, it would
    print a traceback and skip the group's teardown, which aborts the process now and then (rc 134).
    """
    try:
        shutdown()
    except Exception as exc:  # noqa: BLE001 - whatever it is, the group must still be left
        _fail_at_exit(g, exc)
        shutdown()  # nothing is in flight any more, and g.failed is set: it leaves as a failed worker
    uncaught = g.uncaught  # set by the excepthook, even when the script called shutdown() itself first
    if uncaught is not None:
        import logging
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if isinstance(uncaught, KeyboardInterrupt) else 1)


_ENDING = threading.Lock()  # a lock, not state: held for good by the thread that ends the process (one line only)


def end_now(line: str, code: int = 1) -> NoReturn:
    """End this process at once with one line on stderr: the job around it is gone, nobody can be told more.

    No exit handlers run (they would wait on peers or a store that are gone). Whichever thread
    comes first says its line; another that comes later (the launcher lost, then its store) waits
    here until the process is gone, so a worker says one line, never two.

    Example (what a worker whose launcher is gone runs; not here, it ends the process):
        >>> callable(end_now)
        True
    """
    _ENDING.acquire()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # the reader of our output went with the launcher
    try:
        # one write, newline included: every worker says this at once into the same pipe
        os.write(2, (line.rstrip("\n") + "\n").encode())
    except OSError:
        pass
    os._exit(code)


def _fail_at_exit(g: Any, exc: BaseException) -> None:
    """Record ``exc`` as this worker's failure at exit and say it in one line (the traceback under ``--debug``)."""
    g.uncaught = exc
    g.fail(exc)
    if g.env.launched_by_phalanx and not g.env.debug and isinstance(exc, PhalanxError):
        return  # `phalanx run` prints it from the error file, once
    if g.env.debug:
        traceback.print_exception(exc)
    else:
        print(f"phalanx: error at exit: {reason(exc)}", file=sys.stderr)
    sys.stderr.flush()


def reason(exc: BaseException) -> str:
    """The one line a peer and the launcher are told: the exception's type and the first line of its text.

    Example:
        >>> reason(ValueError("bad batch\\nat step 3"))
        'ValueError: bad batch'
    """
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def finish_background_work(g: Any) -> None:
    """Before leaving: the group's records finish their work (a checkpoint being written, the timeline).

    Each is told whether this worker leaves on an error: then a stalled write must not keep a failed
    job from ending, and nothing collective runs (its peers may be gone).
    """
    g.records.before_leaving(failing=sys.exc_info()[1] is not None or g.failed is not None)


def failure(g: Any) -> BaseException | None:
    """What this worker is leaving with: the failure it recorded, or the exception being handled (not an exit)."""
    pending = sys.exc_info()[1]
    if g.failed is not None:
        return g.failed
    return pending if pending is not None and not isinstance(pending, SystemExit) else None


def leave_failed(g: Any, exc: BaseException) -> None:
    """Leave on ``exc`` with no barrier: tell peers and the launcher; the store's host stays a moment for them."""
    g.fail(exc)
    if hosts_store(g) and dist.is_initialized():
        g.drop_process_groups()  # peers blocked on us in a collective see it fail now (the group holds none after)
        linger_for_peers(g)


def leave_normally(g: Any) -> bool:
    """Meet every peer in the store, then at a short barrier; True if all met. Records this worker's exit note."""
    met = g.heartbeat is not None and dist.is_initialized() and _everyone_leaving(g)
    if met:
        try:  # the process group's own method: torch's function refuses a group phalanx formed (not named "gloo")
            (g.process_group or dist.group.WORLD).monitored_barrier(timedelta(seconds=min(10.0, g.env.timeout_s)))
        except (RuntimeError, ValueError):
            pass  # a peer is gone or went elsewhere; leave anyway
    if g.probe is not None:
        try:
            lost = g.losses  # ended normally, but only after losing a peer: not a cause
            liveness.record_exit(g.probe, g.rank,
                                 f"ok after losing rank(s) {', '.join(map(str, lost))}" if lost else "ok")
        except Exception:
            pass
    if g.heartbeat is not None:
        g.heartbeat.stop()
    return met


def hosts_store(g: Any) -> bool:
    """This worker hosts the job's store (rank 0 started without torchrun or ``phalanx run``)."""
    return g.env.rank == 0 and not g.env.agent_store


def linger_for_peers(g: Any) -> None:
    """Keep the store up until every peer has left a note or gone silent (bounded)."""
    store, world = g.probe, g.env.world_size
    if store is None:
        return
    try:
        watch = liveness.Watch(store, world)
        deadline = time.monotonic() + liveness.STALE_AFTER_S + 2.0
        while time.monotonic() < deadline:
            watch.poll()
            # a peer this worker already found lost (g.losses) will leave no note: no need to watch it go silent
            done = set(liveness.exit_records(store, world)) | set(watch.stale()) | set(g.losses) | {g.env.rank}
            if len(done) >= world:
                return
            time.sleep(0.05)
    except Exception:
        return


def _everyone_leaving(g: Any) -> bool:
    """Meet in the store before the exit barrier; False as soon as a peer failed or went silent."""
    store, world = g.probe, g.env.world_size
    if store is None or g.losses:  # a peer this worker already found lost will not come: no wait to see it silent
        return False
    try:
        store.add("liveness/leaving", 1)
        watch = liveness.Watch(store, world)
        deadline = time.monotonic() + min(10.0, g.env.timeout_s)
        while time.monotonic() < deadline:
            if int(store.add("liveness/leaving", 0)) >= world:
                return True
            if any(why != "ok" for why in liveness.exit_records(store, world).values()):
                return False
            watch.poll()
            if watch.stale():
                return False
            time.sleep(0.02)
    except Exception:  # the store is gone: so is whoever hosted it
        return False
    return False


def destroy_process_group(also: Sequence[weakref.ref] = ()) -> None:
    """Drop the current process group and its subgroups; errors from a group whose peers died are expected.

    ``also``: weak references to the subgroups the caller held (it dropped its own), whose sockets must close too.

    Example:
        >>> destroy_process_group()   # no group: nothing happens
    """
    if not dist.is_initialized():
        return
    release(dist.group.WORLD)
    watched = [weakref.ref(dist.group.WORLD), *also]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may fail to tear down; it is gone either way
            pass
    # The failed collective's exception and traceback form reference cycles that hold the old group's
    # work objects, and through them the group; its sockets close only when it is freed. Until the next
    # automatic collection (seconds later, or never in a quiet loop) a peer blocked on us waits for its
    # collective timeout (seen on torch 2.11: 4 workers, every recovery missed the quorum).
    # Those cycles were made by the failure, just now: the young generations hold them. A full collection walks
    # every object of a process that imported torch (300,000 here): 0.23-0.96 s of every regroup and grow on a
    # 2-core machine at load 10, on every survivor, 1.4-3.5 s at load 17. In the chaos soak the young one freed
    # the default group every time; a sharded model's mesh subgroups often outlived it (held by older cycles, which
    # the full one then frees, or by live references, which it does not). The full one runs only then.
    gc.collect(1)
    if any(ref() is not None for ref in watched):
        gc.collect()


def give_back_freed_memory() -> bool:
    """Hand the memory the C allocator holds free back to the OS (glibc's ``malloc_trim``); False where there is none.

    Called once a regroup, a grow or a join has its new state in place. Each generation frees the old one's
    buffers (gloo's, the state sent to a joiner, the resharded shards), many of them in threads that come and go
    with the generation; glibc keeps what each thread freed in that thread's arena, and big freed chunks stay mapped
    once its dynamic mmap threshold has risen. A survivor's RSS then grew with every membership change:
    ``benchmarks/regroup_memory.py --shard 2`` measured +15.9 MB per regroup, 1.33x over 9 (the chaos soak's shard
    workers 1.45x). A trim costs milliseconds, once per membership change, never per step.

    Example:
        >>> isinstance(give_back_freed_memory(), bool)
        True
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.lru_cache(maxsize=1)
def _malloc_trim():  # noqa: ANN202 - a ctypes function or None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to hand back this way
        return None


def release(pg: object) -> int:
    """Drop the references to ``pg`` that outlive ``destroy_process_group``; returns how many were dropped.

    gloo closes a group's sockets only when the group object dies. While it lives, a
    survivor blocked in a collective on us (not on the dead worker: with 4 workers,
    rank 0 when rank 2 dies) waits for its collective timeout instead of failing at once.
    ``torch.distributed.nn.functional`` binds ``group.WORLD`` as a default argument when it
    is first imported (torch imports it lazily, e.g. on the first ``px.wrap``); a default
    of None means the same group there, the default one.

    Example:
        >>> release(object())
        0
    """
    module = sys.modules.get("torch.distributed.nn.functional")
    dropped = 0
    for fn in list(vars(module).values()) if module is not None else []:
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(d is pg for d in defaults):
            fn.__defaults__ = tuple(None if d is pg else d for d in defaults)
            dropped += 1
    return dropped
