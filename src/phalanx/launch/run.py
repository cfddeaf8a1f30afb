"""``phalanx run``: start N workers on this machine (or on several), like torchrun, and watch them to the end.

The arguments are parsed into one frozen :class:`~phalanx.launch.config.RunConfig`
(:mod:`phalanx.launch.config`, where every check lives); then torch's public elastic
launcher starts the workers, so the multi-host options mean exactly what torchrun's
mean. Workers see only the standard variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) plus ``PHALANX_THREADS`` /
``OMP_NUM_THREADS`` and, when set, ``PHALANX_TIMEOUT``, which :func:`phalanx.init` reads.

On one machine with no rendezvous options the launcher hosts the store itself,
on a free port bound to loopback only (no other machine can reach it), and
workers' gloo connections stay on loopback too; two jobs never collide on 29500.

When a worker fails, the launcher stops the others and exits with the status of
the first one that failed, naming its rank and, for a Python exception, its type
and message in one line. A worker's usage error (:class:`phalanx.PhalanxError`)
is that one line with no traceback unless ``--debug`` (or ``PHALANX_DEBUG=1``).
If a parameter server started by ``--servers`` died, the line names the server.
Ctrl-C or SIGTERM stops every worker; a launcher killed outright (SIGKILL) leaves
no orphans, since each worker ends when this process is gone
(:mod:`phalanx.group.orphan`). A preempted job (SIGTERM, SLURM's SIGUSR1) exits 75
with one line, and ``--requeue`` requeues it under SLURM. ``--elastic`` jobs are run
by :mod:`phalanx.launch.elastic`; the other nodes of an elastic SLURM job join the
first node's with :mod:`phalanx.launch.join`. ``--link RATE`` jobs are run by :mod:`phalanx.launch.linked`.

Example:
    >>> _status(-9)[1]  # the exit status of a worker killed by SIGKILL, as `phalanx run` ends with it
    137
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Iterator, Sequence

from . import join as launch_join
from ..errors import ConfigError, usage
from .config import DEFAULT_MASTER_ADDR, RunConfig, build_parser
from .elastic import listening_store, make_job_secret, run_elastic, saved_checkpoint
from ..elastic import secret
from ..group.env import DEFAULT_TIMEOUT_S
from .stacks import WatchThread, register_job
from .status import JobStatus, run_with_status, stacks_button
from .failures import failure_line, root_cause as _root_cause, status as _status
from .linked import run_linked
from .slurm import requeue
from .stopping import Stopping, leads_its_group
from ..step.preempt import PREEMPTED_EXIT

__all__ = ["RunConfig", "build_parser", "main", "run"]  # RunConfig and build_parser: from phalanx.launch.config


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """Set variables for the workers (the agent copies os.environ into them), then restore."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _quiet_torch_elastic() -> None:
    """The agent logs every stop; we print one line of our own instead (LOGLEVEL=INFO shows them)."""
    if "LOGLEVEL" in os.environ:
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _dead_server(servers) -> str | None:
    """A line naming a parameter server that has died, if one has (workers then fail because of it)."""
    if servers is None:
        return None
    for i, proc in enumerate(servers.procs):
        if proc.poll() is not None:
            return f"phalanx: parameter server {i} (pid {proc.pid}) {_status(proc.returncode)[0]} (first failure); " \
                   "stopped the workers"
    return None


def _watch_servers(servers):  # -> threading.Event: set it before stopping the servers on purpose
    """Stop the workers as soon as a parameter server dies (they would wait out their timeout on it).

    A daemon thread polls the servers; on a death it sends this process SIGINT, which torch's
    agent turns into stopping every worker, and :func:`run` then names the server.
    """
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            if not all(servers.alive()):
                os.kill(os.getpid(), signal.SIGINT)  # not SIGTERM: workers take that as a preemption and save
                return

    threading.Thread(target=watch, name="phalanx-server-watch", daemon=True).start()
    return done


def _start_servers(cfg: RunConfig):
    try:
        from ..ps.launcher import start_servers
    except ImportError as err:
        if err.name and err.name.startswith("phalanx.ps"):
            raise ConfigError(usage(f"--servers {cfg.servers}", "parameter servers (phalanx.ps), which this "
                                    "installation does not have", "Run without --servers.")) from None
        raise
    return start_servers(cfg.servers, host=cfg.master_addr, token=None)  # a token is made off loopback


def run(cfg: RunConfig) -> int:
    """Start the workers and wait; returns the exit status ``phalanx run`` should end with.

    With ``--status`` the launcher serves the status page around the job (:mod:`phalanx.launch.status`).
    """
    return run_with_status(cfg, lambda status: _run(cfg, status))


def _run(cfg: RunConfig, status: JobStatus | None) -> int:
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    if cfg.link is not None:  # --link RATE: the workers on either side of a shaped link, started by us
        return run_linked(cfg)
    if cfg.elastic is not None:  # elastic: our own agent keeps survivors running
        if cfg.slurm is not None and cfg.node_rank > 0:  # the other nodes of the allocation join node 0's job
            return _join_slurm_job(cfg)
        return run_elastic(cfg, status)
    _quiet_torch_elastic()
    for line in cfg.warnings():
        print(line, file=sys.stderr, flush=True)
    # the job's store on a free port of 127.0.0.1 only (torch's would listen on every interface), kept for the run
    store = listening_store(DEFAULT_MASTER_ADDR, 0, 900, multi_tenant=True) if cfg.standalone else None
    launch = cfg.launch_config(store.port if store else 0)
    env, servers, watching, children = cfg.worker_env(), None, None, _children()
    stalls, note = None, None
    if store is not None:  # one host: the workers answer `phalanx stacks` and the watchdog (launch/stacks.py)
        made, secret_file = make_job_secret()
        env[secret.ENV] = made
        note = register_job(DEFAULT_MASTER_ADDR, store.port, secret_file, cfg.script)
        # at most half the collective bound: the stacks come before a stuck collective ends the job
        stalls = WatchThread(DEFAULT_MASTER_ADDR, store.port, made,
                             (cfg.timeout_s or DEFAULT_TIMEOUT_S) / 2).start()
        if status is not None:  # --status needs the store here (config.py refuses it elsewhere)
            status.attach(store, members=lambda _: (0, [str(r) for r in range(cfg.nproc)]), secret=made,
                          checkpoint=lambda s: saved_checkpoint(s, 0))
            status.action("stacks", stacks_button(DEFAULT_MASTER_ADDR, store.port, made))
    notes = tempfile.mkdtemp(prefix="phalanx-preempt-")  # a preempted worker leaves its step here
    env["PHALANX_PREEMPT_NOTES"] = notes
    if threading.current_thread() is threading.main_thread():
        # Ours, not torch's (config.py leaves these two out of its list): torch's raised out of its agent's loop on
        # every signal, losing how each worker ended, and a repeat during the grace ended its wait (launch/stopping.py)
        preemption = Stopping(lambda: sorted(p for p in _children() - children if leads_its_group(p)),
                              nproc=cfg.nproc, grace_s=cfg.grace_s)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, preemption)
    else:
        preemption = None
    try:
        if cfg.servers:
            servers = _start_servers(cfg)
            env.update(servers.env())
            watching = _watch_servers(servers)
        with _environ(env):
            # sys.executable -u: the same interpreter as ours, unbuffered so workers' lines interleave promptly.
            elastic_launch(launch, sys.executable)("-u", cfg.script, *cfg.script_args)
        if preemption is not None and preemption.first is not None:
            # A worker that heard the signal late trains on until all have heard it: the script ended first
            print(f"phalanx: received {preemption.first.name}, but the workers reached the end of the script before "
                  "the step they would have stopped at: the job is complete", file=sys.stderr, flush=True)
        return 0
    except ChildFailedError as err:
        signame = preemption.first.name if preemption is not None and preemption.first is not None else None
        if all(f.exitcode == PREEMPTED_EXIT for f in err.failures.values()):
            return _preempted(cfg, notes, signame)
        if preemption is not None and preemption.forwarded:
            stopped = _stopped(cfg, err.failures, notes, preemption)
            if stopped is not None:
                return stopped
        rank, failure = _root_cause(err.failures)
        server = _dead_server(servers)
        line = server or failure_line(rank, failure, others=cfg.nproc * cfg.max_nodes > 1)
        print(line, file=sys.stderr, flush=True)
        return _status(failure.exitcode)[1]
    except (RendezvousError, DistNetworkError) as err:
        print(f"phalanx: the hosts could not meet at {launch.rdzv_endpoint} ({type(err).__name__}: "
              f"{str(err).splitlines()[0]}); check --master-addr/--master-port or --rdzv-endpoint, and that "
              "host 0 is up and reachable", file=sys.stderr, flush=True)
        return 1
    except SignalException as err:  # SIGINT, SIGHUP, SIGQUIT (torch's), or ours during the start-up
        server = _dead_server(servers)
        if server:
            print(server, file=sys.stderr, flush=True)
            return 1
        print(f"phalanx: received {err.sigval.name}; stopped all workers", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    finally:
        if preemption is not None:
            preemption.ended()  # the workers are gone: a signal from now on has nothing to stop
        last = stalls.stop() if stalls is not None else None
        if last:
            print(last, file=sys.stderr, flush=True)
        if note is not None:
            with contextlib.suppress(OSError):
                os.remove(note)
        shutil.rmtree(notes, ignore_errors=True)
        if watching is not None:
            watching.set()
        if servers is not None:
            servers.stop()
        if store is not None:
            if status is not None:
                status.settle()  # the workers' last reports, before the store closes
            store = None  # its socket closes with the last handle on it (the store owns it)
        _reap_children(children)


def _children() -> set[int]:
    """The live (not zombie) child processes of this process, from /proc (empty where there is none)."""
    me, found = str(os.getpid()), set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, parent = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue  # it ended meanwhile
        if parent == me and state != "Z":
            found.add(int(pid))
    return found


def _reap_children(before: set[int]) -> None:
    """SIGKILL the processes started during this run that are still alive: none, unless a signal came while
    torch's agent was starting the workers (it then stops only those it already tracked, and the others
    would outlive `phalanx run`, holding its output open and waiting on a store that is gone)."""
    for pid in _children() - before:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue


def _steps(notes: str) -> list[str]:
    """The steps the workers stopped after, from the notes they left (one per worker that stopped at a step)."""
    return sorted({open(os.path.join(notes, n)).read().strip() for n in os.listdir(notes)})


def _preempted(cfg: RunConfig, notes: str, signame: str | None) -> int:
    """The one line (and the SLURM requeue) of a preempted job; returns :data:`PREEMPTED_EXIT`."""
    steps = _steps(notes)
    how = f"received {signame}" if signame else "the workers were preempted"
    where = f" in {cfg.checkpoint_dir}" if cfg.checkpoint_dir else ""
    stopped = (f"the workers stopped after step {', '.join(steps)} to save a checkpoint{where}" if steps else
               "the workers stopped before their first step (nothing to save)")
    print(f"phalanx: {how}; {stopped}; resume with `phalanx run --resume-from auto ...` (exit status "
          f"{PREEMPTED_EXIT}: preempted, resumable)", file=sys.stderr, flush=True)
    if cfg.requeue and cfg.slurm is not None and cfg.node_rank == 0:
        for sig in (signal.SIGTERM, signal.SIGUSR1):  # the requeue stops this job step, this launcher included
            signal.signal(sig, signal.SIG_IGN)
        print(requeue(cfg.slurm.job_id), file=sys.stderr, flush=True)
    return PREEMPTED_EXIT


def _stopped(cfg: RunConfig, failures: dict, notes: str, preemption: Stopping) -> int | None:
    """The line of a job the launcher's signal stopped without every worker saving; None where a worker failed on
    its own (the usual failure line names it)."""
    sig = preemption.first
    assert sig is not None
    if preemption.killed:
        steps, where = _steps(notes), f" in {cfg.checkpoint_dir}" if cfg.checkpoint_dir else ""
        what = (f"stopped after step {', '.join(steps)} but wrote no checkpoint{where}" if steps else
                "did not stop")
        print(f"phalanx: received {sig.name}; the workers {what} within --grace {cfg.grace_s} s (a worker hung or "
              "took longer); killed them", file=sys.stderr, flush=True)
        return 128 + int(sig)
    if all(f.exitcode in (PREEMPTED_EXIT, -int(sig)) for f in failures.values()):
        # ended by the signal itself: it came before their handler was installed (start-up)
        print(f"phalanx: received {sig.name}; stopped all workers", file=sys.stderr, flush=True)
        return 128 + int(sig)
    return None


def _join_slurm_job(cfg: RunConfig, within: float = 120.0) -> int:
    """A node other than the first of an elastic SLURM job: ``phalanx join`` node 0's store once it is up and has
    published the job (its port opens first)."""
    deadline = time.monotonic() + within  # node 0's launcher imports torch and opens its store first
    while True:
        try:
            with socket.create_connection((cfg.master_addr, int(cfg.master_port or 0)), timeout=5):
                break
        except OSError:
            if time.monotonic() > deadline:
                print(f"phalanx: the first node's elastic store at {cfg.master_addr}:{cfg.master_port} did not "
                      "come up within 120 s", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)  # polling a port that is not open yet; nothing to wait on instead
    if not launch_join.wait_for_job(cfg.master_addr, int(cfg.master_port or 0), deadline - time.monotonic()):
        print(f"phalanx: the first node's store at {cfg.master_addr}:{cfg.master_port} published no elastic job "
              f"within {within:.0f} s", file=sys.stderr, flush=True)
        return 1
    return launch_join.main(["--rdzv-endpoint", f"{cfg.master_addr}:{cfg.master_port}", "-n", str(cfg.nproc),
                      "--threads", str(cfg.threads), cfg.script, *cfg.script_args])


def main(argv: Sequence[str]) -> int:
    """``phalanx run [options] script.py [args]``; usage errors raise ConfigError (the CLI prints one line)."""
    return run(RunConfig.from_argv(argv))
