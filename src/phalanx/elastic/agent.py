"""``phalanx run --elastic``: the launcher side of an elastic job.

The launcher hosts the job's TCPStore, so the store outlives every worker, rank 0
included. It starts the workers, watches them, and writes what it sees into the
store for the survivors' quorum: ``elastic/dead/<id>`` when a worker exits or is
killed, and it kills a worker whose heartbeat stopped (SIGSTOP, a deadlock), which
gloo alone cannot free its peers from. It never restarts the group: the survivors
rebuild it themselves. The job ends when the workers end: status 0 if training
finished on the survivors; one line and status 1 when fewer than
``--min-workers`` are left.

Example:
    >>> cfg = ElasticConfig.from_flags(nproc=3, min_workers="2", max_workers=None, heartbeat="10")
    >>> cfg.min_workers, cfg.max_workers, cfg.heartbeat_s
    (2, 3, 10.0)
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from ..errors import ConfigError, usage
from .watch import Remote, Watched, describe, exit_note, poll

if TYPE_CHECKING:
    from ..launch import RunConfig

DEFAULT_HEARTBEAT_S = 10.0
POLL_S = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The elastic flags of ``phalanx run`` (read as text; checked in :meth:`ElasticConfig.from_flags`)."""
    g = parser.add_argument_group("elastic (survive lost workers; see docs/elastic.md)")
    g.add_argument("--elastic", action="store_true",
                   help="keep training when a worker is lost: survivors regroup and roll back to the last commit")
    g.add_argument("--min-workers", default=None, metavar="M", help="stop when fewer than M workers are left "
                   "(default: more than half of -n)")
    g.add_argument("--max-workers", default=None, metavar="M", help="largest group joiners may grow (default -n)")
    g.add_argument("--replace", action="store_true",
                   help="start a new worker for each one lost (up to -n); it joins at the next commit")
    g.add_argument("--heartbeat-timeout", default=None, metavar="S", dest="heartbeat",
                   help=f"kill a worker whose heartbeat stopped for S seconds (default {DEFAULT_HEARTBEAT_S:g})")


@dataclass(frozen=True)
class ElasticConfig:
    """What ``--elastic`` asked for, checked once."""

    min_workers: int
    max_workers: int
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    replace: bool = False

    @classmethod
    def from_args(cls, a: argparse.Namespace, nproc: int, nodes: int) -> "ElasticConfig | None":
        if not getattr(a, "elastic", False):
            if getattr(a, "replace", False):
                raise ConfigError(usage("--replace without --elastic", "--elastic with it",
                                        "Add --elastic, or drop --replace."))
            for flag in ("min_workers", "max_workers", "heartbeat"):
                if getattr(a, flag, None) is not None:
                    name = "--" + flag.replace("_", "-") if flag != "heartbeat" else "--heartbeat-timeout"
                    raise ConfigError(usage(f"{name} without --elastic", "--elastic with it",
                                            f"Add --elastic, or drop {name}."))
            return None
        if nodes > 1:
            raise ConfigError(usage("--elastic with --nnodes > 1", "--elastic on one launcher host (workers of "
                                    "other hosts join with `phalanx join`)", "Drop --nnodes."))
        cfg = cls.from_flags(nproc=nproc, min_workers=a.min_workers, max_workers=a.max_workers,
                             heartbeat=a.heartbeat)
        return cls(cfg.min_workers, cfg.max_workers, cfg.heartbeat_s, replace=bool(a.replace))

    @classmethod
    def from_flags(cls, *, nproc: int, min_workers: str | None, max_workers: str | None,
                   heartbeat: str | None) -> "ElasticConfig":
        if nproc < 2:
            raise ConfigError(usage(f"--elastic with -n {nproc}", "-n 2 or more (one worker has no one to "
                                    "survive)", "Pass e.g. -n 3 --elastic --min-workers 2, or drop --elastic."))
        low = _count("--min-workers", min_workers, nproc // 2 + 1)
        if low > nproc:
            raise ConfigError(usage(f"--min-workers {low} with -n {nproc}", f"--min-workers <= -n ({nproc})",
                                    f"Pass e.g. --min-workers {max(1, nproc - 1)}."))
        high = _count("--max-workers", max_workers, nproc)
        if high < nproc:
            raise ConfigError(usage(f"--max-workers {high} with -n {nproc}", f"--max-workers >= -n ({nproc})",
                                    f"Pass e.g. --max-workers {nproc}, or leave it out."))
        hb = DEFAULT_HEARTBEAT_S
        if heartbeat is not None:
            try:
                hb = float(heartbeat)
            except ValueError:
                hb = -1.0
            if not hb > 0:
                raise ConfigError(usage(f"--heartbeat-timeout {heartbeat}", "a positive number of seconds",
                                        "Pass e.g. --heartbeat-timeout 10."))
        return cls(min_workers=low, max_workers=high, heartbeat_s=hb)


def _count(flag: str, raw: str | None, default: int) -> int:
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(usage(f"{flag} {raw}", "an integer >= 1", f"Pass e.g. {flag} 2."))
    return value


# el-hosts: the watching code lives in watch.py, shared with `phalanx join`'s local watcher
_Worker, _how, _exit_note = Watched, describe, exit_note


def run_elastic(cfg: "RunConfig") -> int:
    """Host the store, start ``cfg.nproc`` workers, watch them; returns the launcher's exit status."""
    import torch.distributed as dist

    from .membership import key

    el: ElasticConfig = cfg.elastic
    store = dist.TCPStore(cfg.master_addr if cfg.master_addr != "127.0.0.1" else "127.0.0.1", cfg.master_port or 0,
                          is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    port = store.port
    store.set(key("config"), json.dumps({"min_workers": el.min_workers, "max_workers": el.max_workers,
                                         "heartbeat_s": el.heartbeat_s}))
    print(f"phalanx: elastic job: its store is at {cfg.master_addr}:{port}; add workers with "
          f"`phalanx join --rdzv-endpoint {cfg.master_addr}:{port} -n K {cfg.script}`", file=sys.stderr, flush=True)
    ids = [str(r) for r in range(cfg.nproc)]
    store.set(key("gen", 0, "members"), json.dumps(ids))
    servers = None  # el-hosts: `--servers K`: started before the workers, outlive every one of them
    if cfg.servers:
        from ..ps.launcher import start_servers
        servers = start_servers(cfg.servers, host=cfg.master_addr)
    base = {**os.environ, **cfg.worker_env(), **(servers.env() if servers else {}),
            "WORLD_SIZE": str(cfg.nproc), "LOCAL_WORLD_SIZE": str(cfg.nproc),
            "MASTER_ADDR": cfg.master_addr, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "true",
            "TORCHELASTIC_RESTART_COUNT": "0"}
    workers = [_Worker(w, subprocess.Popen([sys.executable, "-u", cfg.script, *cfg.script_args],
                                           env={**base, "RANK": w, "LOCAL_RANK": w, "PHALANX_ELASTIC_ID": w}))
               for w in ids]

    def replacement(number: int) -> _Worker:
        wid = f"r{number}"
        env = {k: v for k, v in base.items() if k not in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK")}
        return _Worker(wid, subprocess.Popen([sys.executable, "-u", cfg.script, *cfg.script_args],
                                             env={**env, **joiner_env(wid)}))
    stop = {"sig": None}

    def on_signal(sig: int, _frame: object) -> None:
        stop["sig"] = sig

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _watch(workers, store, el, stop, replacement if el.replace else None, servers)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _stop_all(workers)
        if servers is not None:
            servers.stop()


def joiner_env(wid: str) -> dict[str, str]:
    """What a joining worker gets on top of MASTER_ADDR/MASTER_PORT: no rank, it has none yet."""
    return {"PHALANX_ELASTIC_ID": wid, "PHALANX_ELASTIC_JOIN": "1"}


def _watch(workers: list[_Worker], store, el: ElasticConfig, stop: dict, replacement=None, servers=None) -> int:
    from .membership import key

    first_failure: int | None = None
    replaced = 0
    remotes = Remote()  # el-hosts
    while True:
        if stop["sig"] is not None:
            print(f"phalanx: received {signal.Signals(stop['sig']).name}; stopped all workers", file=sys.stderr,
                  flush=True)
            return 128 + int(stop["sig"])
        dead_servers = servers.exited() if servers is not None else []  # el-hosts
        if dead_servers and not store.check([key("done")]):
            print(f"phalanx: elastic: {dead_servers[0]}; a lost server cannot be regrouped around, so the job "
                  "stops. Resume from your last disk checkpoint (px.save_checkpoint holds the servers' shards), "
                  "if any.", file=sys.stderr, flush=True)
            return 1
        now = time.monotonic()
        for w in workers:
            code = poll(w, store, el.heartbeat_s, now=now)  # el-hosts: watch.poll
            if code:
                first_failure = code if first_failure is None else first_failure
                if not store.check([key("done")]):
                    print(f"phalanx: elastic: worker {w.id} (pid {w.proc.pid}) {_how(code)}; the others regroup "
                          "without it", file=sys.stderr, flush=True)
                    if replacement is not None:
                        replaced += 1
                        workers.append(replacement(replaced))
                        print(f"phalanx: elastic: started worker r{replaced} (pid {workers[-1].proc.pid}) to "
                              "replace it; it joins at the next commit", file=sys.stderr, flush=True)
        alive = [w for w in workers if w.returncode is None]
        ok = [w for w in workers if w.returncode == 0]
        # el-hosts: members that joined from other hosts count too, and the store must outlive them
        remote = remotes.alive(store, {w.id for w in workers}, el.heartbeat_s, now=now)
        if not alive and not remote:
            if ok or store.check([key("done")]):
                return 0
            return 128 - first_failure if first_failure and first_failure < 0 else (first_failure or 1)
        if not ok and len(alive) + len(remote) < el.min_workers and not store.check([key("done")]):
            print(f"phalanx: elastic: {len(alive) + len(remote)} worker(s) left, below --min-workers "
                  f"{el.min_workers}; stopping the job. Commits are in memory only: resume from your last disk "
                  "checkpoint (px.save_checkpoint), if any.", file=sys.stderr, flush=True)
            return 1
        time.sleep(POLL_S)


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
