"""``phalanx join``: add workers to a running elastic job, from any host.

    phalanx join --secret-file PATH --rdzv-endpoint HOST:PORT -n K train.py [args]

HOST:PORT is the store of a ``phalanx run --elastic`` launcher, or its standby's once that took over (it prints
it, with the file holding the job's secret; ``PHALANX_SECRET`` may hold the secret instead). The K
new workers run the same script; each one enters at the job's next commit point and
receives the current state from rank 0; nobody rolls back. The group grows up to
the job's ``--max-workers``. An endpoint with no job, or a job that is not elastic, is
refused within seconds; a job that already finished makes the joiners exit 0 at once.
Without the job's secret, or with another one, ``phalanx join`` is refused with one
line and the job never hears of it.
Like the launcher, ``phalanx join`` watches the workers it started: one that exits is
reported to the job at once, and one whose heartbeat stops is killed.
``--standby-store ADDR[:PORT]`` makes this launcher host the job's standby store too
(:mod:`phalanx.launch.standby`): if the job's store is lost with its host, the workers
regroup there and this launcher watches the job to its end (replacing the workers of this host
it sees lost from then on, when the job was started with ``phalanx run --replace``).
``--status [HOST:]PORT`` serves the job's status page from this launcher too (a job started with
``phalanx run --status``); it reads the job's store, and follows it to the standby after a take-over.

Example:
    >>> JoinConfig.from_argv(["--rdzv-endpoint", "10.0.0.1:29400", "-n", "2", __file__]).port
    29400
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator, NoReturn, Sequence

import torch.distributed as dist

from .allocator import heap_env
from ..elastic import secret
from ..elastic.membership import key
from ..elastic.watch import Remote, Watched, describe, poll
from ..elastic.worker import FAILOVER, read_standby
from ..errors import ConfigError, PhalanxError, usage
from .elastic import (MAX_FAILED_STARTS, POLL_S, STORE_POLL_S, generation_members, joiner_env, quiet_store_env,
                      saved_checkpoint)
from .failures import Recorded, own_failure
from .stacks import Watchdog
from .standby import LAUNCHED, Standby, parse_standby
from .status import JobStatus, stacks_button, status_address

PROBE_TIMEOUT_S = 5.0
STOP_GRACE_S = 3.0  # Ctrl-C: how long the joiners get to leave before they are killed (as the launcher's)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(usage(f"`phalanx join`: {message}", "`phalanx join --rdzv-endpoint HOST:PORT -n K "
                                "script.py [args]`", "See `phalanx join --help`."))


@dataclass(frozen=True)
class JoinConfig:
    host: str
    port: int
    nproc: int
    script: str
    script_args: tuple[str, ...] = ()
    threads: int = 1
    secret_file: str | None = None
    standby: tuple[str, int] | None = None  # --standby-store: host the job's standby store here
    status: tuple[str, int] | None = None  # --status: serve the job's status page here too (it follows a failover)

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> "JoinConfig":
        p = _Parser(prog="phalanx join", description="Add K workers to a running `phalanx run --elastic` job.")
        p.add_argument("--rdzv-endpoint", required=True, metavar="HOST:PORT", help="the elastic job's store")
        p.add_argument("-n", "--nproc-per-node", dest="nproc", default="1", metavar="K", help="workers to add")
        p.add_argument("--threads", default="1", metavar="T", help="intra-op threads per worker (default 1)")
        p.add_argument("--secret-file", default=None, metavar="PATH",
                       help=f"file holding the job's secret (the launcher names it); or set {secret.ENV}")
        p.add_argument("--standby-store", default=None, metavar="ADDR[:PORT]",
                       help="host the job's standby store on this address of this host (every worker must reach "
                            "it): if the job's store is lost, the workers regroup there")
        p.add_argument("--status", default=None, metavar="[HOST:]PORT",
                       help="serve the job's status page here too (a job started with `phalanx run --status`); "
                            "with --standby-store it goes on showing the job after the standby took over")
        p.add_argument("script")
        p.add_argument("args", nargs=argparse.REMAINDER)
        a = p.parse_args(list(argv))
        host, _, port = a.rdzv_endpoint.rpartition(":")
        fix = "Pass the address the launcher printed, e.g. --rdzv-endpoint 10.0.0.1:29400."
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(usage(f"--rdzv-endpoint {a.rdzv_endpoint}", "HOST:PORT", fix))
        for flag, raw in (("-n", a.nproc), ("--threads", a.threads)):
            if not raw.isdigit() or int(raw) < 1:
                raise ConfigError(usage(f"{flag} {raw}", "an integer >= 1", f"Pass e.g. {flag} 1."))
        if not os.path.isfile(a.script):
            raise ConfigError(usage(f"script {a.script!r} (not found, cwd {os.getcwd()})", "an existing Python file",
                                    "Run the same script as the job, e.g. `phalanx join ... train.py`."))
        standby = parse_standby(a.standby_store) if a.standby_store is not None else None
        return cls(host, int(port), int(a.nproc), a.script, tuple(a.args), int(a.threads), a.secret_file, standby,
                   status_address(a.status, "--status"))


@contextlib.contextmanager
def _quiet_store_log() -> Iterator[None]:
    """Keep torch's C++ store log off stderr while ``phalanx join`` asks the job's store (``--debug`` keeps it).

    torch logs each failed connection attempt to a store at length (a C++ backtrace per retry), from C++ and so
    past Python's ``sys.stderr``; and ``TORCH_CPP_LOG_LEVEL`` is read once, when torch loads, before this command
    knew it would ask a store. When the address answers but is no job's store, phalanx says so in one line: the
    descriptor is pointed at /dev/null for the call, and whatever fails is raised once it is back.
    """
    if os.environ.get("PHALANX_DEBUG", "") not in ("", "0") or "TORCH_CPP_LOG_LEVEL" in os.environ:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _store(host: str, port: int) -> dist.TCPStore:
    """A client of the job's store, its C++ log kept off stderr while it connects (see :func:`_quiet_store_log`)."""
    with _quiet_store_log():
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=PROBE_TIMEOUT_S),
                             wait_for_workers=False)


def probe(host: str, port: int) -> str:
    """"running", "done" (training ended), or a PhalanxError saying why there is no job to join."""
    try:  # a plain socket first: torch logs a failed store connection at length
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as err:
        raise PhalanxError(f"no job answers at {host}:{port} ({err.strerror or type(err).__name__}); check the "
                           "address that `phalanx run --elastic` printed, and that the job is still running") from None
    try:
        store = _store(host, port)
    except Exception as err:  # noqa: BLE001 - refused, unreachable, timed out: no job there
        raise PhalanxError(f"no job answers at {host}:{port} ({type(err).__name__}); check the address that "
                           "`phalanx run --elastic` uses, and that the job is still running") from None
    try:
        with _quiet_store_log():
            elastic, done = store.check([key("config")]), store.check([key("done")])
    except dist.DistError as err:  # it hung up after the handshake: no job's store either
        raise PhalanxError(f"no job answers at {host}:{port} ({type(err).__name__}); check the address that "
                           "`phalanx run --elastic` uses, and that the job is still running") from None
    if not elastic:
        raise PhalanxError(f"the job at {host}:{port} is not elastic; only jobs started with "
                           "`phalanx run --elastic` accept new workers")
    return "done" if done else "running"


def wait_for_job(host: str, port: int, seconds: float) -> bool:
    """Wait up to ``seconds`` for the store at ``host:port`` to publish an elastic job; True once it has.

    A launcher opens its store's port before it writes the job's config: a node that saw the port open and asked
    at once was told "not elastic" (a two-node SLURM job's second node, in CI)."""
    try:
        store = _store(host, port)
        with _quiet_store_log():
            store.wait([key("config")], timedelta(seconds=max(seconds, 0.001)))
        return True
    except Exception:  # noqa: BLE001 - timed out, refused, hung up: the caller says which job did not come up
        return False


def check_secret(host: str, port: int, given: str | None) -> str:
    """The secret we present, checked against the one the job at ``host:port`` published; one line if not."""
    if given is None:
        raise ConfigError(usage(f"`phalanx join` to {host}:{port} without the job's secret",
                                f"--secret-file PATH (the file the launcher named) or {secret.ENV} in the environment",
                                "Copy the secret file the launcher printed to this host; never pass the secret "
                                "on the command line."))
    config = json.loads(_store(host, port).get(key("config")))
    if "check" not in config or not secret.matches(given, config["nonce"], config["check"]):
        raise PhalanxError(f"the secret given does not match the one of the elastic job at {host}:{port}; the job "
                           "refuses this joiner. Use the secret file that job's launcher printed")
    return given


def _serves_status(host: str, port: int) -> bool:
    """Does the job at ``host:port`` serve a status page (``phalanx run --status``)?"""
    return bool(json.loads(_store(host, port).get(key("config"))).get("status"))


def main(argv: Sequence[str]) -> int:
    """``phalanx join``: start the joiners, wait for them; returns the exit status."""
    cfg = JoinConfig.from_argv(argv)
    if probe(cfg.host, cfg.port) == "done":
        print(f"phalanx: the job at {cfg.host}:{cfg.port} has finished training; nothing to join", file=sys.stderr)
        return 0
    job = check_secret(cfg.host, cfg.port, secret.load(os.environ, cfg.secret_file))
    page = _page(cfg, job)
    if page is None:
        return _join(cfg, job, None)
    code = 1
    try:
        with page.watching_stderr():
            code = _join(cfg, job, page)
    finally:
        page.end(code, "training finished" if code == 0 else None)
    return code


def _page(cfg: JoinConfig, job: str) -> JobStatus | None:
    """``--status``: the job's page, served by this launcher from the job's store (None without the flag)."""
    if cfg.status is None:
        return None
    if not _serves_status(cfg.host, cfg.port):
        raise ConfigError(usage(f"`phalanx join --status {cfg.status[0]}:{cfg.status[1]}` to the job at {cfg.host}:"
                                f"{cfg.port}, which was started without --status", "a job started with "
                                "`phalanx run --status PORT` (its workers publish what the page shows)",
                                "Start the job with --status, or join without --status."))
    page = JobStatus.bind(*cfg.status)
    page.attach(_store(cfg.host, cfg.port), members=generation_members, secret=job,
                checkpoint=lambda s: saved_checkpoint(s, generation_members(s)[0]))
    page.action("stacks", stacks_button(cfg.host, cfg.port, job))
    return page


def _join(cfg: JoinConfig, job: str, page: JobStatus | None) -> int:
    """Start the joiners and watch them (``page``: ``--status``'s, which follows the job's store); their status."""
    tag = uuid.uuid4().hex[:6]
    quiet = quiet_store_env(os.environ.get("PHALANX_DEBUG", "") not in ("", "0"))
    base = {**os.environ, **quiet, **heap_env(os.environ), "MASTER_ADDR": cfg.host, "MASTER_PORT": str(cfg.port),
            "OMP_NUM_THREADS": str(cfg.threads), "PHALANX_THREADS": str(cfg.threads), secret.ENV: job,
            "PHALANX_LAUNCHER_PID": str(os.getpid())}  # its joiners end when it is gone (phalanx.group.orphan)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        base.pop(name, None)
    if _serves_status(cfg.host, cfg.port):  # `phalanx run --status`: the joiners report to the page as the others
        base["PHALANX_STATUS"] = "1"
    standby = None
    if cfg.standby is not None:  # before the joiners start: they read its address at start
        standby = Standby(*cfg.standby, dist.TCPStore(cfg.host, cfg.port, is_master=False,
                                                      timeout=timedelta(seconds=PROBE_TIMEOUT_S),
                                                      wait_for_workers=False))
        print(f"phalanx: elastic: the job's standby store is at {standby.address}; if the store at {cfg.host}:"
              f"{cfg.port} is lost, the workers regroup there", file=sys.stderr, flush=True)
    # each worker's failure record (<id>.json): a replacement is started only for a loss, never for a worker whose
    # script failed on its own (the same script would fail the same way)
    errors = tempfile.mkdtemp(prefix="phalanx-errors-") if standby is not None and standby.replace else None

    def start(wid: str, env: dict[str, str]) -> Watched:
        record = {"TORCHELASTIC_ERROR_FILE": os.path.join(errors, f"{wid}.json")} if errors else {}
        return Watched(wid, subprocess.Popen([sys.executable, "-u", cfg.script, *cfg.script_args],
                                             env={**env, **joiner_env(wid), **record}))

    def replacement(wid: str) -> Watched:  # once the standby took over: a joiner of the job's store, now this one
        return start(wid, {**base, "MASTER_ADDR": standby.host, "MASTER_PORT": str(standby.port)})

    workers = [start(f"j{tag}-{i}", base) for i in range(cfg.nproc)]
    procs = [w.proc for w in workers]  # with the replacements once started (watch_joiners appends to `workers`)
    try:
        codes = watch_joiners(workers, cfg.host, cfg.port, secret=job, standby=standby,
                              replace=replacement if errors else None, errors=errors, tag=tag, page=page)
        procs = [w.proc for w in workers]
    except KeyboardInterrupt:
        procs = [w.proc for w in workers]
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + STOP_GRACE_S  # waited for: a joiner whose launcher is gone ends at once
        for p in procs:
            try:
                p.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return 130
    finally:
        if page is not None:
            page.settle()  # the workers' last reports, before the store this launcher may host closes
        if standby is not None:
            standby.close()
        if errors is not None:
            shutil.rmtree(errors, ignore_errors=True)
    failed = [c for c in codes if c]
    return 0 if not failed else (128 - failed[0] if failed[0] < 0 else failed[0])


# -- the joiners' local watcher --------------------------------------------------------------
def watch_joiners(workers: list[Watched], host: str, port: int, secret: str | None = None,
                  standby: "Standby | None" = None, replace: Callable[[str], Watched] | None = None,
                  errors: str | None = None, tag: str = "", page: JobStatus | None = None) -> list[int]:
    """Watch this host's joiners as the launcher watches its own; returns their exit statuses (not those of the
    lost workers a replacement was started for: the replacement's stands for theirs).

    A joiner that exits is marked dead in the job's store with its exit note, and a hung
    one (no heartbeat for the job's ``--heartbeat-timeout``) is killed, so the others
    regroup at once instead of after the quorum timeout; with the job's ``secret``, the
    stacks of this host's joiners are printed first (:mod:`phalanx.launch.stacks`).

    The job's store belongs to the first launcher, which closes it once the job is over:
    a joiner that said it finished (``finished/<id>``) is then only waited for, with no
    store call, since its process may outlive the store by a few seconds of shutdown.
    If the store is lost (torch raises a :class:`torch.distributed.DistError`; each call
    waits at most :data:`PROBE_TIMEOUT_S`) and this launcher hosts the job's ``standby``
    store, it takes over (:meth:`Standby.take_over`) and watches the job there to its end,
    members of other hosts included; if the job's standby is another host's, it follows it
    there; with none, the joiners end by themselves, each saying so in one line; we only wait.

    ``replace`` (the job asked for ``phalanx run --replace``): once this launcher took over, a
    worker of this host lost after that (killed, or hung and killed; not one whose failure record
    in ``errors`` says its script failed on its own) gets a replacement, ``replace("r<tag>-<n>")``,
    appended to ``workers`` and admitted at the survivors' next commit, as the primary's launcher
    does (no more after :data:`MAX_FAILED_STARTS` in a row died before a generation admitted them).

    ``page`` (``phalanx join --status``): the job's status page this launcher serves; it follows the job's store to
    this launcher's standby when it takes over, or to another host's standby when the joiners follow it there.
    """
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=PROBE_TIMEOUT_S),
                              wait_for_workers=False)
        heartbeat_s = float(json.loads(store.get(key("config")))["heartbeat_s"])
        elsewhere = read_standby(store) if standby is None else None
    except dist.DistError:  # the job ended between the probe and now: the joiners see it too
        store, elsewhere = None, None
    leaving: set[str] = set()  # joiners that finished training: their exit is ours to see, not the job's
    dog = Watchdog(store, secret, float("inf"), expect=lambda: [w.id for w in workers if w.returncode is None]) \
        if store is not None and secret else None
    remotes, taken_over, next_read = Remote(), False, 0.0
    replaced = failed_starts = 0
    superseded: set[str] = set()  # the lost workers a replacement took over from: its exit status stands for theirs

    def before_kill(wid: str, why: str) -> None:
        if dog is not None:
            dog.report(f"worker {wid} {why}; before it is killed, this host's joiners", 0.0,
                       [w.id for w in workers if w.returncode is None], hung=[wid])
    while store is not None:
        try:
            for w in workers:
                if w.id not in leaving and w.returncode is None and store.check([key("finished", w.id)]):
                    leaving.add(w.id)
                if w.id in leaving:
                    if w.returncode is None:
                        w.returncode = w.proc.poll()
                    continue
                code = poll(w, store, heartbeat_s, before_kill=before_kill)
                if code and not store.check([key("done")]):
                    print(f"phalanx: elastic: worker {w.id} (pid {w.proc.pid}) {describe(code)}; the others "
                          "regroup without it", file=sys.stderr, flush=True)
                    if taken_over and replace is not None and standby is not None:
                        failed_starts = 0 if _admitted(store, standby.generation, w.id) else failed_starts + 1
                        own = own_failure(Recorded.read(os.path.join(errors, f"{w.id}.json") if errors else None,
                                                        code))
                        if not own and failed_starts < MAX_FAILED_STARTS:
                            replaced += 1
                            superseded.add(w.id)
                            workers.append(replace(f"r{tag}-{replaced}"))
                            store.set(LAUNCHED, json.dumps([x.id for x in workers]))
                            print(f"phalanx: elastic: started worker {workers[-1].id} (pid {workers[-1].proc.pid}) "
                                  "to replace it; it joins at the next commit", file=sys.stderr, flush=True)
                        elif failed_starts == MAX_FAILED_STARTS or own:
                            why = "its script failed on its own (a replacement would fail the same way)" if own \
                                else f"{failed_starts} replacements in a row died before joining"
                            print(f"phalanx: elastic: no replacement for worker {w.id}: {why}", file=sys.stderr,
                                  flush=True)
            # What a take-over or a follow needs, read after the workers' finished marks: not once one of ours
            # finished training. The job is ending and node 0 closes its store then; a call after that fails, and
            # torch logs the failure with a C++ backtrace (seen in the SLURM job's output).
            if time.monotonic() >= next_read and not taken_over and not leaving:
                next_read = time.monotonic() + STORE_POLL_S
                if standby is not None:
                    standby.mirror(store)
                elif elsewhere is None:
                    elsewhere = read_standby(store)
            # once it took over, this launcher keeps the store up for the members of other hosts too
            remote = remotes.alive(store, {w.id for w in workers}, heartbeat_s) if taken_over else []
            if not remote and all(w.returncode is not None for w in workers):
                break
        except dist.DistError:  # the job's store is gone
            # not at the job's end: once training is done (or one of ours finished it) the store closes as planned
            if standby is not None and not taken_over and not standby.done and not leaving:
                store, taken_over, dog = standby.take_over({w.id for w in workers}, f"{host}:{port}"), True, None
                # who ends with this launcher, as the primary's launcher says it: a next standby (a host that comes
                # back with `phalanx join --standby-store` this store) marks them dead if this host is lost too
                store.set(LAUNCHED, json.dumps([w.id for w in workers]))
                if page is not None:
                    page.follow(store, standby.host, standby.port)
                continue
            followed = elsewhere
            store, elsewhere = _follow(elsewhere, heartbeat_s), None  # another host's standby, if it took over
            if store is not None and followed is not None and page is not None:
                page.follow(store, *followed)
            dog = None
        time.sleep(POLL_S)
    return [w.proc.wait() if w.returncode is None else w.returncode for w in workers if w.id not in superseded]


def _admitted(store, since: int, wid: str) -> bool:
    """Did a generation of this store (from ``since``, the first it holds after a take-over) include ``wid``?"""
    newest = int(store.get(key("gen"))) if store.check([key("gen")]) else since
    return any(store.check([k := key("gen", g, "members")]) and wid in json.loads(store.get(k))
               for g in range(since, newest + 1))


def _follow(standby: tuple[str, int] | None, heartbeat_s: float):  # -> dist.TCPStore | None
    """The job's standby store once it took over (bounded: the heartbeat timeout); None without one."""
    if standby is None:
        return None
    try:
        store = dist.TCPStore(*standby, is_master=False, timeout=timedelta(seconds=heartbeat_s),
                              wait_for_workers=False)
        deadline = time.monotonic() + heartbeat_s
        while not store.check([FAILOVER]):
            if time.monotonic() > deadline:
                return None
            time.sleep(POLL_S)  # sleep: the standby launcher's word comes with no notification; bounded
        return store
    except dist.DistError:
        return None
