"""The worker group: the one place that reads the environment.

A script launched by ``phalanx run`` or ``torchrun`` sees ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. A plain ``python script.py``
sees none of them and is a group of one, which needs no process group at all.

Example:
    >>> import phalanx as px
    >>> px.init()
    >>> px.rank(), px.world_size()
    (0, 1)
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import time
import traceback
import weakref
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import liveness
from .errors import ConfigError, PhalanxError, WorkerLostError, usage
from .workerenv import DEFAULT_TIMEOUT_S, WorkerEnv  # noqa: F401 (re-exported: older imports)

@dataclass
class _Group:
    env: WorkerEnv
    device: torch.device
    store: dist.Store | None = None
    probe: dist.Store | None = None  # a second store connection with a short timeout, for diagnosis and exit notes
    heartbeat: liveness.Heartbeat | None = None
    failed: BaseException | None = None  # the exception this worker is exiting with, if any
    # The step clocks of the models px.wrap attached in this group: the loaders tell them each batch's weight
    # (phalanx.steps.set_batch_weight). Weak, so a model dropped by the user is forgotten.
    clocks: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)


_group: _Group | None = None


def init(backend: str | None = None, timeout: float | None = None, threads: int | None = None) -> None:
    """Join the worker group described by the environment; idempotent.

    ``backend`` defaults to NCCL when CUDA is available and gloo otherwise.
    ``timeout`` bounds every collective (seconds), so a lost peer fails fast.

    Example:
        >>> import phalanx as px; px.init(); px.world_size()
        1
    """
    global _group
    if _group is not None:
        return
    env = WorkerEnv.from_environ()
    if timeout is not None:
        if not float(timeout) > 0:
            raise ConfigError(usage(f"timeout={timeout}", "a positive number of seconds", "Pass e.g. timeout=60."))
        env = replace(env, timeout_s=float(timeout))
    if threads is not None:
        if int(threads) < 1:
            raise ConfigError(usage(f"threads={threads}", "an integer >= 1", "Pass e.g. threads=1."))
        env = replace(env, threads=int(threads))
    timeout_s = env.timeout_s
    if env.threads is not None:
        torch.set_num_threads(env.threads)
    use_cuda = torch.cuda.is_available()
    if use_cuda and (backend or "nccl") == "nccl" and env.local_world_size > torch.cuda.device_count():
        # NCCL refuses two ranks on one GPU, but only inside the first collective, as an "invalid usage"
        # that reads like a lost peer: say what is wrong before anything starts.
        raise ConfigError(usage(f"{env.local_world_size} workers on this host on NCCL, with "
                                f"{torch.cuda.device_count()} GPU(s) visible",
                                "at most one NCCL worker per GPU",
                                f"Start at most {torch.cuda.device_count()} worker(s) per host (-n), or let workers "
                                "share a GPU over gloo: px.init(backend='gloo')."))
    device = torch.device("cuda", env.local_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    store = probe = heartbeat = None
    if env.world_size > 1 and not dist.is_initialized():
        # We own the store so that failure diagnosis (which rank is gone?) has a side channel
        # that does not depend on the broken process group.
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                              is_master=env.rank == 0 and not env.agent_store,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        store = dist.PrefixStore(f"phalanx/{env.attempt}", store)
        # Beat before joining: once the process group exists, every rank is visibly alive.
        heartbeat = liveness.Heartbeat(store, env.rank).start()
        probe = liveness.second_connection(store)
        dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"), store=store,
                                rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=timeout_s))
    _group = _Group(env=env, device=device, store=store, probe=probe, heartbeat=heartbeat)
    if store is not None:
        atexit.register(_at_exit)  # scripts rarely call shutdown(); exiting without it can abort (see shutdown)
        _install_excepthook(env)


_uncaught: BaseException | None = None  # what ends this worker, once the interpreter is exiting because of it


def _install_excepthook(env: WorkerEnv) -> None:
    """Record an uncaught exception at once, so peers and the launcher learn who failed and why."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb) -> None:  # type: ignore[no-untyped-def]
        global _uncaught
        _uncaught = exc
        _fail(exc)
        # Under `phalanx run` the launcher prints a usage error (or a Ctrl-C) in one line, once.
        quiet = env.launched_by_phalanx and not env.debug and isinstance(exc, (PhalanxError, KeyboardInterrupt))
        if not quiet:
            previous(exc_type, exc, tb)
        sys.stderr.flush()

    sys.excepthook = hook


def _at_exit() -> None:
    """Leave the group at interpreter exit; after an uncaught exception, end the process at once.

    Tearing down an interpreter that holds a process group takes from half a second to
    several on a busy machine, and the launcher only stops the others once this
    process is gone. Exit handlers registered after ``px.init()`` have already run by
    now (they run last-in, first-out); logging is flushed here.
    """
    shutdown()
    if _uncaught is not None:
        import logging
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if isinstance(_uncaught, KeyboardInterrupt) else 1)


def _reason(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _fail(exc: BaseException) -> None:
    """This worker is ending with ``exc``: tell peers (store) and the launcher (error file), once."""
    if _group is None or _group.failed is not None:
        return
    _group.failed = exc
    if _group.heartbeat is not None:
        _group.heartbeat.stop()
    if _group.probe is not None:
        try:
            liveness.record_exit(_group.probe, _group.env.rank, _reason(exc))
        except Exception:
            pass  # the store's host is gone; the launcher or a stale heartbeat will tell
    path = _group.env.error_file
    if path:
        # torch.distributed.elastic's error-file format, read by torchrun and `phalanx run`;
        # "phalanx" carries what our launcher needs for its one line.
        data = {"message": _reason(exc), "timestamp": int(time.time()),
                "phalanx": {"rank": _group.env.rank, "type": type(exc).__name__, "time": time.time(),
                            "text": " ".join(str(exc).split())[:2000],
                            # WorkerLostError reports another rank's failure, not a cause of its own
                            "usage": isinstance(exc, PhalanxError) and not isinstance(exc, WorkerLostError),
                            "consequence": isinstance(exc, WorkerLostError),
                            "traceback": "".join(traceback.format_exception(exc))[-20000:]}}
        try:
            with open(path, "w") as f:
                json.dump(data, f)
        except OSError:
            pass


def shutdown() -> None:
    """Leave the group; runs at interpreter exit too, and is safe to call twice.

    On a normal exit workers meet at a short barrier first: destroying a gloo group
    while a peer is still tearing its own down aborts the process now and then
    ("terminate called without an active exception", seen in about 1 run in 6 on 2
    workers here, plain torch too). They meet in the store before the barrier, so a
    peer that failed or died is noticed within seconds (its exit note or its silent
    heartbeat) and nobody waits for the collective timeout.

    A worker leaving with an exception (called from a ``finally`` or at exit after an
    uncaught error) skips the barrier and leaves the group as it is: its peers learn of
    the failure from its exit note, and the process ends at once.

    When this worker hosts the store (rank 0 launched without torchrun or ``phalanx
    run``) and something failed, it waits (a few seconds at most) for every peer to
    leave a note or fall silent, so their diagnosis can still read the store.
    """
    global _group
    g, met = _group, True
    if g is not None and g.store is not None:
        pending = sys.exc_info()[1]
        if g.failed is not None or (pending is not None and not isinstance(pending, SystemExit)):
            _fail(g.failed or pending)  # type: ignore[arg-type]
            _group = None
            if _hosts_store(g) and dist.is_initialized():
                dist.destroy_process_group()  # peers blocked on us in a collective see it fail now
                _linger_for_peers(g)
            return  # no barrier: a failed worker's teardown must not wait on anyone
        met = g.heartbeat is not None and dist.is_initialized() and _everyone_leaving(g)
        if met:
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=min(10.0, g.env.timeout_s)))
            except RuntimeError:
                pass  # a peer is gone or went elsewhere; leave anyway
        if g.probe is not None:
            try:
                lost = liveness.losses_seen()  # ended normally, but only after losing a peer: not a cause
                liveness.record_exit(g.probe, g.env.rank,
                                     f"ok after losing rank(s) {', '.join(map(str, lost))}" if lost else "ok")
            except Exception:
                pass
        if g.heartbeat is not None:
            g.heartbeat.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    if g is not None and g.store is not None and not met and _hosts_store(g):
        _linger_for_peers(g)
    _group = None


def _hosts_store(g: _Group) -> bool:
    return g.env.rank == 0 and not g.env.agent_store


def _linger_for_peers(g: _Group) -> None:
    """Keep the store up until every peer has left a note or gone silent (bounded)."""
    store, world = g.probe, g.env.world_size
    if store is None:
        return
    try:
        watch = liveness.Watch(store, world)
        deadline = time.monotonic() + liveness.STALE_AFTER_S + 2.0
        while time.monotonic() < deadline:
            watch.poll()
            done = set(liveness.exit_records(store, world)) | set(watch.stale()) | {g.env.rank}
            if len(done) >= world:
                return
            time.sleep(0.05)
    except Exception:
        return


def _everyone_leaving(g: _Group) -> bool:
    """Meet in the store before the exit barrier; False as soon as a peer failed or went silent."""
    store, world = g.probe, g.env.world_size
    if store is None:
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


# --- elastic hook (phalanx.elastic): re-point the group at a rebuilt generation -------------
def regroup(rank: int, world_size: int, store: dist.Store | None) -> None:
    """After ``phalanx.elastic`` rebuilt the process group: this worker's new rank, size and store.

    The heartbeat and the probe connection move to the new generation's store, under the new rank.
    """
    global _group
    current = _current()
    if current.heartbeat is not None:
        current.heartbeat.stop()
    heartbeat = liveness.Heartbeat(store, rank).start() if store is not None else None
    probe = liveness.second_connection(store) if store is not None else None
    _group = _Group(env=replace(current.env, rank=rank, world_size=world_size), device=current.device,
                    store=store, probe=probe, heartbeat=heartbeat, clocks=current.clocks)


def is_elastic() -> bool:
    """True under ``phalanx run --elastic`` or ``phalanx join``: the group may be rebuilt with another size."""
    return "PHALANX_ELASTIC_ID" in os.environ
# --- end of elastic hook ------------------------------------------------------------------


def _current() -> _Group:
    if _group is not None:
        return _group
    env = WorkerEnv.from_environ()
    if env.world_size > 1:
        raise ConfigError(usage(f"a phalanx call in a {env.world_size}-worker run before px.init()",
                                "px.init() first", "Call px.init() at the top of the script."))
    return _Group(env=env, device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def is_initialized() -> bool:
    """True once px.init() has run in this process."""
    return _group is not None


def rank() -> int:
    """This worker's global rank (0 in a plain process)."""
    return _current().env.rank


def world_size() -> int:
    """Number of workers in the group (1 in a plain process)."""
    return _current().env.world_size


def local_rank() -> int:
    """Rank within this host; picks the GPU."""
    return _current().env.local_rank


def is_main() -> bool:
    """True on rank 0, the worker that prints and saves."""
    return rank() == 0


def device() -> torch.device:
    """The device this worker computes on: its own GPU, or the CPU."""
    return _current().device


def timeout_s() -> float:
    """The bound on every collective, in seconds."""
    return _current().env.timeout_s


def store() -> dist.Store | None:
    """The group's key-value store (None in a group of one)."""
    return _current().store


def clocks() -> "weakref.WeakSet[Any]":
    """The step clocks of the models wrapped in this group (``phalanx.steps``).

    A plain process that never called px.init() has no lasting group, so this is empty
    there; its batches all weigh 1, so nothing is lost.
    """
    return _current().clocks


def probe_store() -> dist.Store | None:
    """A connection to the group's store with a short timeout, for liveness checks (None in a group of one)."""
    return _current().probe
