"""``phalanx run --elastic``: the launcher side of an elastic job.

The launcher hosts the job's TCPStore, so the store outlives every worker, rank 0
included. It starts the workers, watches them, and writes what it sees into the
store for the survivors' quorum: ``elastic/dead/<id>`` when a worker exits or is
killed, and it kills a worker whose heartbeat stopped (SIGSTOP, a deadlock), which
gloo alone cannot free its peers from. It never restarts the group: the survivors
rebuild it themselves. The job ends when the workers end: status 0 if training
finished on the survivors; one line and status 1 when fewer than
``--min-workers`` are left.

A worker that fails on its own (an exception in the script, a ``px.PhalanxError``: anything
but a lost peer) ends the job at once, with the one line ``phalanx run`` prints without
``--elastic``: each worker writes its failure record into an error file of its own (torch
elastic's format, :mod:`phalanx.launch.failures`), read here when it exits. No replacement is
started for it: a new process running the same script would fail the same way.

``--spares K`` starts K more processes at once, as joiners: each imports torch and
the script and then waits, parked in the store with its heartbeat running. A lost
worker's place goes to the first spare in reserve, which the survivors' quorum
admits at the regroup (the same admission as any joiner's); only when no spare is
left does ``--replace`` start a new process.

Example:
    >>> cfg = ElasticConfig.from_flags(nproc=3, min_workers="2", max_workers=None, heartbeat="10")
    >>> cfg.min_workers, cfg.max_workers, cfg.heartbeat_s
    (2, 3, 10.0)
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from ..checkpoint import LAST_SAVED_KEY
from ..elastic import secret
from ..elastic.membership import key
from ..elastic.options import DEFAULT_HEARTBEAT_S, ElasticConfig, add_arguments  # noqa: F401 - re-exported
from ..elastic.rebuild import generation_prefix
from ..elastic.watch import Remote, Watched, describe, exit_note, poll
from ..errors import PhalanxError
from .failures import Recorded, failure_line, own_failure, status
from .stacks import Watchdog, register_job
from .status import stacks_button
from .workers import start_worker

if TYPE_CHECKING:
    from .config import RunConfig
    from .status import JobStatus

POLL_S = 0.05  # a process's exit is seen this soon (a waitpid, no store call): recovery starts from it
STORE_POLL_S = 0.5  # heartbeats, members and remote workers are read from the store this often
MAX_FAILED_STARTS = 3  # replacements in a row that died before any generation admitted them
SILENT_S = 1.5  # a worker whose heartbeat stood still this long is not waited for when stacks are collected


# the watching code lives in watch.py, shared with `phalanx join`'s local watcher
_Worker, _how, _exit_note = Watched, describe, exit_note


def run_elastic(cfg: "RunConfig", status: "JobStatus | None" = None) -> int:
    """Host the store, start ``cfg.nproc`` workers and the spares, watch them; returns the exit status.

    ``status``: ``--status``'s server, bound already; it serves this job once the store and secret exist.
    """
    el: ElasticConfig = cfg.elastic
    store = listening_store(cfg.master_addr, cfg.master_port or 0)
    port = store.port
    ids, spares = [str(r) for r in range(cfg.nproc)], [f"s{i}" for i in range(el.spares)]
    job_secret, secret_file = make_job_secret()
    job_nonce = secret.nonce()
    store.set(key("config"), json.dumps({"min_workers": el.min_workers, "max_workers": el.max_workers,
                                         "heartbeat_s": el.heartbeat_s, "workers": cfg.nproc, "spares": spares,
                                         "nonce": job_nonce, "check": secret.verifier(job_secret, job_nonce),
                                         "status": status is not None,  # joiners report to the page too
                                         "replace": el.replace}))  # a standby that takes over replaces as well
    how = f"--secret-file {secret_file} " if secret_file else ""
    print(f"phalanx: elastic job: its store is at {cfg.master_addr}:{port}; add workers with "
          f"`phalanx join {how}--rdzv-endpoint {cfg.master_addr}:{port} -n K {cfg.script}`"
          f"{'' if secret_file else f' and the {secret.ENV} you set'}", file=sys.stderr, flush=True)
    store.set(key("gen", 0, "members"), json.dumps(ids))
    if status is not None:
        status.attach(store, members=generation_members, secret=job_secret,
                      checkpoint=lambda s: saved_checkpoint(s, generation_members(s)[0]))
        status.action("stacks", stacks_button(cfg.master_addr, port, job_secret))  # a button on the page
    servers = None  # `--servers K`: started before the workers, outlive every one of them
    if cfg.servers:
        from ..ps.launcher import start_servers  # parameter servers only with --servers (as in launch.py)
        servers = start_servers(cfg.servers, host=cfg.master_addr)
    base = {**os.environ, **quiet_store_env(cfg.debug), **cfg.worker_env(), **(servers.env() if servers else {}),
            "WORLD_SIZE": str(cfg.nproc), "LOCAL_WORLD_SIZE": str(cfg.nproc),
            "MASTER_ADDR": cfg.master_addr, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "true",
            "TORCHELASTIC_RESTART_COUNT": "0", secret.ENV: job_secret}
    command = [cfg.script, *cfg.script_args]
    errors = tempfile.mkdtemp(prefix="phalanx-errors-")  # each worker's failure record: <id>.json

    def record(wid: str) -> dict[str, str]:
        return {"TORCHELASTIC_ERROR_FILE": _record(errors, wid)}

    workers = [_Worker(w, start_worker(el.start_method, command, {**base, "RANK": w, "LOCAL_RANK": w,
                                                                  "PHALANX_ELASTIC_ID": w, **record(w)}))
               for w in ids]

    def joiner(wid: str) -> _Worker:
        """A spare or a replacement: a joiner with no rank; it enters when the quorum admits it."""
        env = {k: v for k, v in base.items() if k not in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK")}
        return _Worker(wid, start_worker(el.start_method, command, {**env, **joiner_env(wid), **record(wid)}))

    workers += [joiner(s) for s in spares]  # they import torch and the script now, and wait parked
    # who ends with this launcher: a standby store that takes over from this one marks them dead (launch/standby.py)
    store.set(key("launched"), json.dumps([w.id for w in workers]))
    stop = {"sig": None}

    def on_signal(sig: int, _frame: object) -> None:
        stop["sig"] = sig

    # SIGUSR1 too: SLURM's --signal=USR1@N reaches the launcher as well, whose default action would end it at once
    # and leave its workers to end as orphans a heartbeat timeout later, with no line saying why
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    # Stacks of every worker when the group stops stepping, and before a hung worker is killed (launch/stacks.py)
    dog = Watchdog(store, job_secret, el.heartbeat_s, expect=lambda: _members(store),
                   lost=lambda: [w.id for w in workers if w.returncode is not None or w.proc.poll() is not None],
                   epoch=lambda: store.get(key("gen")) if store.check([key("gen")]) else b"0")
    note = register_job(cfg.master_addr, port, secret_file, cfg.script)
    try:
        return _watch(workers, store, el, stop, joiner, reserve=list(spares), servers=servers, errors=errors,
                      dog=dog)
    finally:
        if dog.end_note():
            print(dog.end_note(), file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            os.remove(note)
        for s, h in old.items():
            signal.signal(s, h)
        if status is not None:
            status.settle()  # the workers' last reports, before the store closes
        _stop_all(workers)
        shutil.rmtree(errors, ignore_errors=True)
        if servers is not None:
            servers.stop()
        if secret_file:
            shutil.rmtree(os.path.dirname(secret_file), ignore_errors=True)


def make_job_secret() -> tuple[str, str | None]:
    """The job's secret and the file a joiner (or ``phalanx stacks``) reads it from (None: the user set
    PHALANX_SECRET and holds it).

    The file is in a directory of its own, readable by this user only (mkdtemp makes it 0700), and is
    removed when the job ends.
    """
    given = os.environ.get(secret.ENV)
    if given:
        return given, None
    made = secret.make()
    folder = tempfile.mkdtemp(prefix="phalanx-elastic-")
    atexit.register(shutil.rmtree, folder, True)  # also when the launcher fails before its watch loop
    path = os.path.join(folder, "secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(made + "\n")
    return made, path


def listening_store(host: str, port: int = 0, timeout_s: float = 30.0, *, multi_tenant: bool = False):
    """Host a job's store listening on ``host`` only (``--master-addr``; loopback by default).

    torch's TCPStore listens on every interface, IPv4 and IPv6, whatever address it is
    given: we bind the socket ourselves and hand it over. The store owns it from then on and
    closes it when the store and its clones are gone: a second close of ours would close
    whatever file had reused the number by then (another thread's socket).

    Example:
        >>> store = listening_store("127.0.0.1")
        >>> store.set("k", "v"); store.get("k")
        b'v'
    """
    import socket

    import torch.distributed as dist

    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise PhalanxError(f"the elastic store cannot listen on {host}:{port} ({err.strerror}); pass an address "
                           "of this host as --master-addr and a free --master-port") from None
    sock.listen(512)
    try:
        store = dist.TCPStore(host, sock.getsockname()[1], None, True, timedelta(seconds=timeout_s),
                              wait_for_workers=False, multi_tenant=multi_tenant, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's now (see above)
    return store


def quiet_store_env(debug: bool = False) -> dict[str, str]:
    """Keep torch's C++ store warnings (a backtrace per failed store call) off an elastic job's stderr.

    An elastic worker expects its store calls to fail when a peer or the launcher goes:
    phalanx says what happened in one line, and torch's own warnings would bury it under
    dozens of C++ frames. Your own ``TORCH_CPP_LOG_LEVEL``, or ``--debug``, keeps them.
    """
    if debug or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return {}
    return {"TORCH_CPP_LOG_LEVEL": "ERROR"}


def joiner_env(wid: str) -> dict[str, str]:
    """What a joining worker gets on top of MASTER_ADDR/MASTER_PORT: no rank, it has none yet."""
    return {"PHALANX_ELASTIC_ID": wid, "PHALANX_ELASTIC_JOIN": "1"}


def _admitted(store) -> set[str]:
    """Every worker some generation so far has included."""
    newest = int(store.get(key("gen"))) if store.check([key("gen")]) else 0
    return {m for g in range(newest + 1) for m in json.loads(store.get(key("gen", g, "members")))}


def _members(store) -> list[str]:
    """The newest generation's workers (rank order)."""
    return generation_members(store)[1]


def generation_members(store) -> tuple[int, list[str]]:
    """The newest generation and its workers (rank order), as the status page shows them."""
    generation = int(store.get(key("gen"))) if store.check([key("gen")]) else 0
    return generation, json.loads(store.get(key("gen", generation, "members")))


def _watch(workers: list[_Worker], store, el: ElasticConfig, stop: dict, joiner, reserve: list[str],
           servers=None, errors: str | None = None, dog: Watchdog | None = None) -> int:
    """Poll the workers until they are all gone. ``reserve``: the spares no lost worker has claimed yet;
    ``errors``: the directory of the workers' failure records (``<id>.json``).

    Each lost worker (or lost claimed spare) leaves a hole: the first spare in reserve fills it
    at the survivors' regroup (the quorum admits it there); with none left, ``--replace`` starts
    a new process. Only the members of the newest generation count toward --min-workers: a
    waiting spare or replacement does not, and when the members are gone it is stopped.
    """
    first_failure: int | None = None
    replaced = 0
    failed_starts = 0  # a script that fails at start would otherwise be replaced forever
    remotes = Remote()  # workers joined from other hosts
    next_store_poll = 0.0
    while True:
        # The store is read every STORE_POLL_S, a process exit is seen every POLL_S: a dozen store round trips
        # every 50 ms took CPU from the workers on the same cores (1.5 ms per ResNet-20 step, measured under load),
        # while a heartbeat timeout is seconds long and a dead process is still found at once.
        exited = any(w.returncode is None and w.proc.poll() is not None for w in workers)
        if not exited and stop["sig"] is None and time.monotonic() < next_store_poll:
            time.sleep(POLL_S)
            continue
        next_store_poll = time.monotonic() + STORE_POLL_S
        if stop["sig"] is not None:
            print(f"phalanx: received {signal.Signals(stop['sig']).name}; stopped all workers", file=sys.stderr,
                  flush=True)
            return 128 + int(stop["sig"])
        dead_servers = servers.exited() if servers is not None else []
        if dead_servers and not store.check([key("done")]):
            from ..ps.launcher import restart_exited  # started again, the workers roll back to a commit
            if restart_exited(servers, store, dead_servers):
                continue
            print(f"phalanx: elastic: {dead_servers[0]}; a lost server cannot be regrouped around, so the job "
                  "stops. Resume from your last disk checkpoint (px.save_checkpoint holds the servers' shards), "
                  "if any.", file=sys.stderr, flush=True)
            return 1
        now = time.monotonic()
        # Before the hung are killed: their stacks first. A report blocks this loop (a second or so: the silent
        # workers' answers are not waited for), so the heartbeats are then judged by the time after it, not before.
        if dog is not None and dog.poll(now, silent=[w.id for w in workers if w.beats and now - w.seen > SILENT_S]):
            now = time.monotonic()
        kill_hook = dog.before_kill if dog is not None else None
        # poll() marks the dead and leaves their exit notes. Every worker that ended is read before any is reported:
        # a peer that ended because of another's own failure must not be reported as a loss the others regroup from.
        ended = [(w, code) for w in workers if (code := poll(w, store, el.heartbeat_s, now=now,
                                                             before_kill=kill_hook))]
        own = [(w, f) for w, code in ended if own_failure(f := Recorded.read(_record(errors, w.id), code))]
        if own:
            return _failed_on_its_own(own, workers, store, remotes, el.heartbeat_s, now)
        if ended and dog is not None:
            dog.reset(now)  # the survivors regroup: not a stall
        for w, code in ended:
            first_failure = code if first_failure is None else first_failure
            if store.check([key("done")]):
                continue
            if w.id in reserve:  # a parked spare died: one spare fewer, no hole in the group
                reserve.remove(w.id)
                print(f"phalanx: elastic: spare {w.id} (pid {w.proc.pid}) {_how(code)}; {len(reserve)} spare(s) "
                      "left", file=sys.stderr, flush=True)
                continue
            admitted = w.id in _admitted(store)
            if not admitted:  # a replacement that never entered: no hole in the group, one failed start
                failed_starts += 1
                print(f"phalanx: elastic: replacement {w.id} (pid {w.proc.pid}) {_how(code)} before it joined "
                      f"({failed_starts} in a row)", file=sys.stderr, flush=True)
            else:
                failed_starts = 0
                members = set(_members(store))
                running = [x for x in workers if x is not w and x.proc.poll() is None]
                others = [x.id for x in running if x.id in members]
                others += remotes.alive(store, {x.id for x in workers}, el.heartbeat_s, now=now)
                waiting = [x.id for x in running if x.id not in members]  # spares, replacements not yet admitted
                after = "the others regroup without it" if others else "it was the last worker" if not waiting \
                    else f"no member is left (not yet admitted: {', '.join(waiting)})"
                print(f"phalanx: elastic: worker {w.id} (pid {w.proc.pid}) {_how(code)}; {after}", file=sys.stderr,
                      flush=True)
            if reserve:
                spare = next(s for s in workers if s.id == reserve[0])
                reserve.pop(0)
                print(f"phalanx: elastic: spare {spare.id} (pid {spare.proc.pid}, already started) takes its "
                      f"place at the regroup (at the next commit if it is still starting); {len(reserve)} spare(s) "
                      "left", file=sys.stderr, flush=True)
            elif el.replace and failed_starts >= MAX_FAILED_STARTS:
                if failed_starts == MAX_FAILED_STARTS:
                    print(f"phalanx: elastic: {failed_starts} replacements in a row died before joining; starting "
                          "no more (see their errors above); the job goes on with the workers it has",
                          file=sys.stderr, flush=True)
            elif el.replace:
                replaced += 1
                workers.append(joiner(f"r{replaced}"))
                store.set(key("launched"), json.dumps([x.id for x in workers]))
                print(f"phalanx: elastic: started worker r{replaced} (pid {workers[-1].proc.pid}) to "
                      "replace it; it joins at the next commit", file=sys.stderr, flush=True)
        alive = [w for w in workers if w.returncode is None]
        ok = [w for w in workers if w.returncode == 0]
        # members that joined from other hosts count too, and the store must outlive them
        remote = remotes.alive(store, {w.id for w in workers}, el.heartbeat_s, now=now)
        if not alive and not remote:
            if ok or store.check([key("done")]):
                return 0
            print(f"phalanx: elastic: the job ended before training finished: every worker is gone (the first "
                  f"{_how(first_failure or 1)}); {last_checkpoint(store)}", file=sys.stderr, flush=True)
            return 128 - first_failure if first_failure and first_failure < 0 else (first_failure or 1)
        if not ok:  # a spare or a replacement is a worker once a generation includes it, not before
            members = set(_members(store))
            alive = [w for w in alive if w.id in members]
        if not ok and len(alive) + len(remote) < el.min_workers and not store.check([key("done")]):
            print(f"phalanx: elastic: {len(alive) + len(remote)} worker(s) left, below --min-workers "
                  f"{el.min_workers}; stopping the job (commits are in memory only); {last_checkpoint(store)}",
                  file=sys.stderr, flush=True)
            return 1
        time.sleep(POLL_S)


def _record(errors: str | None, wid: str) -> str | None:
    """Where worker ``wid`` writes its failure record (None: this launcher gave it no error file)."""
    return os.path.join(errors, f"{wid}.json") if errors is not None else None


def _failed_on_its_own(own: list, workers: list[_Worker], store, remotes: Remote, heartbeat_s: float,
                       now: float) -> int:
    """End the job on a worker's own failure (``own``: the (worker, :class:`Recorded`) pairs seen together).

    Says the first failure in ``phalanx run``'s one line, then who is left, why the job ends and where the
    newest checkpoint is; the caller stops the workers still running. Returns the exit status.
    """
    w, failure = min(own, key=lambda wf: (wf[1].timestamp, wf[0].id))
    print(failure_line(0, failure, others=False, who=f"worker {w.id}"), file=sys.stderr, flush=True)
    running = [x.id for x in workers if x.returncode is None and x.proc.poll() is None]
    try:
        remote = remotes.alive(store, {x.id for x in workers}, heartbeat_s, now=now)
    except Exception:  # noqa: BLE001 - our own store; this is the last line, say what we know
        remote = []
    left = f"stopping worker{'s' * (len(running) > 1)} {', '.join(running)}, still running" if running \
        else "no other worker is running"
    if remote:
        left += f"; those joined from other hosts ({', '.join(remote)}) stop when this store closes"
    print(f"phalanx: elastic: the job stopped: worker {w.id} failed in the script, not by losing a peer, so neither "
          f"a regroup nor a replacement can get past it; {left}; {last_checkpoint(store)}", file=sys.stderr,
          flush=True)
    return status(failure.exitcode)[1]


def last_checkpoint(store) -> str:
    """Where to resume from, in words: the newest file ``px.save_checkpoint`` wrote in this job, if any.

    The workers leave its path in their group's store (each generation has its own key space),
    so the newest generation that saved one names it.
    """
    try:
        newest = saved_checkpoint(store, int(store.get(key("gen"))) if store.check([key("gen")]) else 0)
        if newest is not None:
            return f"resume from the last disk checkpoint, {newest}"
    except Exception:  # noqa: BLE001 - our own store; unreadable only if it broke, and this is the last line
        pass
    return "no disk checkpoint was saved (px.save_checkpoint), so the job restarts from the beginning"


def saved_checkpoint(store, newest: int) -> str | None:
    """The newest file ``px.save_checkpoint`` wrote in this job, from generation ``newest`` down (None: none)."""
    for g in range(newest, -1, -1):
        k = f"{'phalanx/0' if g == 0 else generation_prefix(g)}/{LAST_SAVED_KEY}"
        if store.check([k]):
            return store.get(k).decode()
    return None


def _stop_all(workers: list[_Worker], grace_s: float = 3.0) -> None:
    running = [w for w in workers if w.proc.poll() is None]
    for w in running:
        w.proc.terminate()
    deadline = time.monotonic() + grace_s
    for w in running:
        try:
            w.proc.wait(timeout=max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
