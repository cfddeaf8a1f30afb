"""``phalanx run``'s command line, parsed and checked once into a frozen :class:`RunConfig`.

Every check of ``phalanx run``'s input lives in :meth:`RunConfig.from_args`, so each
mistake is one clear line (a :class:`~phalanx.errors.ConfigError`) before anything
starts. Inside a SLURM allocation the host flags come from SLURM's variables; a flag
that disagrees with them is refused. The config then says what the workers get
(:meth:`RunConfig.worker_env`) and how torch's launcher starts them
(:meth:`RunConfig.launch_config`); :mod:`phalanx.launch.run` runs it.

Example:
    >>> cfg = RunConfig.from_argv(["-n", "2", "--threads", "2", __file__])
    >>> cfg.nproc, cfg.standalone, cfg.worker_env()["OMP_NUM_THREADS"]
    (2, True, '2')
    >>> RunConfig.from_argv([__file__, "-n", "2"]).warnings()[0][:56]
    'phalanx: warning: `-n 2` comes after the script, so it g'
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass
from typing import Sequence

from .allocator import heap_env
from ..elastic.options import ElasticConfig
from ..elastic.options import add_arguments as add_elastic_arguments
from ..errors import ConfigError, OneLineParser, usage
from .netns import parse_rate, why_not
from ..monitor.server import parse_address
from .slurm import SlurmEnv, node_address
from ..step.preempt import PREEMPTED_EXIT, latest_checkpoint

RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500  # torchrun's default for the static rendezvous
EPILOG = """\
examples:
  phalanx run -n 2 train.py --epochs 3          2 workers on this machine
  phalanx run -n 4 --threads 2 train.py         4 workers, 2 intra-op threads each
  phalanx run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 -n 2 train.py
                                                host 0 of 2 (run the same with --node-rank 1 on host 1)
  phalanx run --nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job7 -n 2 train.py
                                                1 to 4 hosts meet at an endpoint (torchrun's rendezvous)
  phalanx run -n 3 --elastic --min-workers 2 train.py
                                                a lost worker leaves, the others train on (--elastic)

The same script also runs under `torchrun --nproc-per-node N train.py` or as a plain `python train.py`.
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="phalanx run", usage_hint="`phalanx run [options] script.py [args]`",
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
                description="Start N data-parallel workers running script.py. Ctrl-C or SIGTERM stops them;\n"
                            "if one fails, the others are stopped and its exit status is returned.")
    # Everything is read as text and checked in RunConfig.from_args, so each error is one clear line.
    p.add_argument("-n", "--nproc-per-node", dest="nproc", default=None, metavar="N",
                   help="workers on this machine (default 1; under SLURM, SLURM_GPUS_ON_NODE when set)")
    p.add_argument("--threads", default="1", metavar="T", help="intra-op threads per CPU worker (default 1)")
    p.add_argument("--timeout", default=None, metavar="S",
                   help="seconds a collective may wait for a lost peer before failing (default 60)")
    p.add_argument("--servers", default="0", metavar="S", help="parameter-server processes to start (default 0)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="record a timeline of a few steps per worker into DIR (Chrome-trace JSON; see px.profile)")
    p.add_argument("--link", default=None, metavar="RATE",
                   help="root: split the workers over two network namespaces joined by a link shaped to RATE "
                        "(tc tbf; 100mbit, 1gbit, 500kbit as phalanx bench --link spells them); prints where the "
                        "steps went and the bytes on the wire at the end")
    p.add_argument("--status", default=None, metavar="[HOST:]PORT",
                   help="serve a live status page, /status.json and /metrics on PORT (loopback unless HOST is given), "
                        "for the holder of the job's secret only; the link is printed at start (docs/monitoring.md)")
    p.add_argument("--debug", action="store_true",
                   help="show full tracebacks for workers' usage errors (same as PHALANX_DEBUG=1)")
    hosts = p.add_argument_group("several hosts (same meaning as torchrun's)")
    hosts.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                       help="number of hosts (default 1); MIN:MAX starts with MIN to MAX hosts, and a host added "
                            "or lost restarts the whole group (torchrun's rendezvous, up to --max-restarts)")
    hosts.add_argument("--node-rank", default=None, metavar="R", help="this host's rank for --rdzv-backend static")
    hosts.add_argument("--master-addr", default=None, metavar="HOST",
                       help=f"address of host 0 (default {DEFAULT_MASTER_ADDR})")
    hosts.add_argument("--master-port", default=None, metavar="PORT",
                       help=f"port on host 0 (default {DEFAULT_MASTER_PORT}; a free one when no host option is given)")
    hosts.add_argument("--rdzv-backend", default=None, metavar="NAME",
                       help="rendezvous backend: " + ", ".join(RDZV_BACKENDS) + " (default static)")
    hosts.add_argument("--rdzv-endpoint", default=None, metavar="HOST[:PORT]", help="rendezvous endpoint")
    hosts.add_argument("--rdzv-id", default=None, metavar="ID", help="job id shared by all hosts (c10d/etcd)")
    hosts.add_argument("--max-restarts", default="0", metavar="K",
                       help="restart the whole group up to K times after a failure (default 0)")
    pre = p.add_argument_group("preemption (SIGTERM or SIGUSR1: stop at a step boundary, save, exit "
                               f"{PREEMPTED_EXIT}; see docs/launching.md)")
    pre.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                     help="where a preempted job writes its checkpoint (workers: px.checkpoint_dir())")
    pre.add_argument("--resume-from", default=None, metavar="auto|PATH",
                     help="continue from this checkpoint (workers: px.resume_from()); auto: the newest complete "
                          "one in --checkpoint-dir, or a fresh start when there is none")
    pre.add_argument("--grace", default="30", metavar="S",
                     help="seconds the workers get to save and exit after SIGTERM/SIGUSR1 before SIGKILL (default 30)")
    pre.add_argument("--requeue", action="store_true",
                     help="under SLURM, `scontrol requeue` the job when it was preempted")
    add_elastic_arguments(p)  # --elastic and its flags
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed on to the script")
    return p


def _int(flag: str, raw: str, minimum: int, fix: str, maximum: int | None = None) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        bound = f"an integer >= {minimum}" if maximum is None else f"an integer from {minimum} to {maximum}"
        raise ConfigError(usage(f"{flag} {raw}", bound, fix))
    return value


def _port(flag: str, raw: str) -> int:
    return _int(flag, raw, 1, f"Pass a free TCP port, e.g. {flag} {DEFAULT_MASTER_PORT}.", maximum=65535)


@dataclass(frozen=True)
class RunConfig:
    """Everything ``phalanx run`` was asked to do, checked once."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc: int = 1
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int | None = None  # None: standalone picks a free port
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    max_restarts: int = 0
    threads: int = 1
    timeout_s: float | None = None
    servers: int = 0
    standalone: bool = False  # one host, no rendezvous options: we host the store, on loopback
    debug: bool = False
    profile_dir: str | None = None  # --profile DIR: the workers record a timeline there (phalanx.step.profiling)
    status: tuple[str, int] | None = None  # --status [HOST:]PORT: the launcher serves the status page there
    elastic: "ElasticConfig | None" = None  # --elastic: phalanx.launch.elastic runs the job
    checkpoint_dir: str | None = None  # --checkpoint-dir
    resume_from: str | None = None  # --resume-from, resolved: a checkpoint path, or None for a fresh start
    requeue: bool = False
    grace_s: int = 30  # --grace: torch's agent waits this long for stopping workers, then SIGKILL
    slurm: SlurmEnv | None = None  # inside a SLURM allocation: the hosts came from its variables
    link: str | None = None  # --link RATE: the workers on either side of a shaped veth (phalanx.launch.linked)

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> "RunConfig":
        return cls.from_args(build_parser().parse_args(list(argv)))

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "RunConfig":
        """The one place where ``phalanx run``'s input is validated."""
        slurm = SlurmEnv.from_environ(os.environ)
        if slurm is not None:
            a = _apply_slurm(a, slurm)
        nproc = _int("-n", a.nproc or "1", 1, "Pass the number of workers, e.g. -n 2.")
        threads = _int("--threads", a.threads, 1, "Pass e.g. --threads 1 (one per worker fits one core each).")
        servers = _int("--servers", a.servers, 0, "Pass e.g. --servers 2, or leave it out.")
        max_restarts = _int("--max-restarts", a.max_restarts, 0, "Pass e.g. --max-restarts 0.")
        timeout_s = None
        if a.timeout is not None:
            try:
                timeout_s = float(a.timeout)
            except ValueError:
                timeout_s = -1.0
            if not timeout_s > 0:
                raise ConfigError(usage(f"--timeout {a.timeout}", "a positive number of seconds",
                                        "Pass e.g. --timeout 60."))
        fix = "Pass e.g. --nnodes 2 or --nnodes 1:4."
        a.nnodes, a.node_rank = a.nnodes or "1", a.node_rank or "0"
        parts = a.nnodes.split(":")
        if len(parts) > 2:
            raise ConfigError(usage(f"--nnodes {a.nnodes}", "N or MIN:MAX", fix))
        min_nodes = _int("--nnodes", parts[0], 1, fix)
        max_nodes = _int("--nnodes", parts[-1], 1, fix)
        if max_nodes < min_nodes:
            raise ConfigError(usage(f"--nnodes {a.nnodes}", "MIN <= MAX", fix))
        backend = a.rdzv_backend or "static"
        if backend not in RDZV_BACKENDS:
            raise ConfigError(usage(f"--rdzv-backend {backend}", "one of " + ", ".join(RDZV_BACKENDS),
                                    "Use static with --master-addr, or c10d with --rdzv-endpoint."))
        node_rank = _int("--node-rank", a.node_rank, 0, "Number hosts 0..nnodes-1.", maximum=max_nodes - 1)
        master_addr = a.master_addr if a.master_addr is not None else DEFAULT_MASTER_ADDR
        if not master_addr.strip():
            raise ConfigError(usage("--master-addr ''", "a host name or IP address of host 0",
                                    "Pass e.g. --master-addr 10.0.0.1."))
        master_port = None if a.master_port is None else _port("--master-port", a.master_port)
        endpoint = a.rdzv_endpoint or ""
        if endpoint:
            host, sep, port = endpoint.rpartition(":")
            if not (host if sep else endpoint).strip():
                raise ConfigError(usage(f"--rdzv-endpoint {endpoint}", "HOST[:PORT]",
                                        "Pass e.g. --rdzv-endpoint 10.0.0.1:29400."))
            if sep:
                _int(f"--rdzv-endpoint {endpoint}: port", port, 1, "Pass e.g. --rdzv-endpoint 10.0.0.1:29400.",
                     maximum=65535)
        elif backend != "static":
            raise ConfigError(usage(f"--rdzv-backend {backend} without --rdzv-endpoint", "HOST[:PORT] to meet at",
                                    "Pass e.g. --rdzv-endpoint 10.0.0.1:29400."))
        if not a.script:
            raise ConfigError(usage("no script", "`phalanx run -n N script.py [args]`",
                                    "Name the training script after the options."))
        if a.script.startswith("-"):
            raise ConfigError(usage(f"unknown option {a.script}", "an option listed by `phalanx run --help`",
                                    "Check the spelling; options go before the script."))
        if not os.path.isfile(a.script):
            what = "a directory" if os.path.isdir(a.script) else "not found"
            raise ConfigError(usage(f"script {a.script!r} ({what}, cwd {os.getcwd()})", "an existing Python file",
                                    "Check the path, e.g. `phalanx run -n 2 train.py`."))
        checkpoint_dir, resume_from = _preemption_flags(a)
        grace_s = _int("--grace", a.grace, 1, "Pass the seconds workers get to save, e.g. --grace 30.")
        standalone = max_nodes == 1 and all(
            v is None for v in (a.master_addr, a.master_port, a.rdzv_backend, a.rdzv_endpoint))
        if servers and max_nodes > 1:
            raise ConfigError(usage(f"--servers {servers} with --nnodes {a.nnodes}",
                                    "parameter servers in a one-host run", "Run on one host, or drop --servers."))
        # Under SLURM -n counts one node's workers; the elastic bounds count the whole allocation's
        # (node 0 starts its -n, every other node's launcher joins with its own -n).
        elastic = ElasticConfig.from_args(a, nproc * (slurm.nnodes if slurm is not None else 1),
                                          1 if slurm is not None else max_nodes)
        if elastic is not None and slurm is not None and slurm.nnodes > 1 and not os.environ.get("PHALANX_SECRET"):
            raise ConfigError(usage("--elastic on several SLURM nodes without PHALANX_SECRET",
                                    "the job's secret in PHALANX_SECRET on every node",
                                    "Add `export PHALANX_SECRET=$(openssl rand -hex 32)` to the job script."))
        status = _status_flag(getattr(a, "status", None), standalone=standalone, elastic=elastic is not None,
                              node_rank=node_rank)
        link = _link_flag(a, nproc=nproc, max_nodes=max_nodes, servers=servers, elastic=elastic is not None,
                          explicit=not standalone)
        return cls(link=link, elastic=elastic, status=status, script=a.script, script_args=tuple(a.args),
                   nproc=nproc,
                   min_nodes=min_nodes,
                   max_nodes=max_nodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port,
                   rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_id=a.rdzv_id or "none",
                   max_restarts=max_restarts, threads=threads, timeout_s=timeout_s, servers=servers,
                   standalone=standalone, debug=bool(getattr(a, "debug", False)), checkpoint_dir=checkpoint_dir,
                   resume_from=resume_from, requeue=bool(a.requeue), grace_s=grace_s, slurm=slurm,
                   profile_dir=getattr(a, "profile", None) or None)

    def warnings(self) -> list[str]:
        """Lines to print before starting: launcher options written after the script go to the script."""
        options = {s for action in build_parser()._actions for s in action.option_strings} - {"-h", "--help"}
        out = []
        for i, arg in enumerate(self.script_args):
            name = arg.split("=", 1)[0]
            if name in options:
                shown = arg if "=" in arg or i + 1 == len(self.script_args) else f"{arg} {self.script_args[i + 1]}"
                out.append(f"phalanx: warning: `{shown}` comes after the script, so it goes to "
                           f"{os.path.basename(self.script)}, not to phalanx run; put launcher options before the "
                           f"script (`phalanx run {shown} {os.path.basename(self.script)}`)")
        return out

    def worker_env(self) -> dict[str, str]:
        """Variables every worker gets on top of the launcher's environment."""
        env = {"OMP_NUM_THREADS": str(self.threads), "PHALANX_THREADS": str(self.threads),
               "PHALANX_LAUNCHER": "run", **heap_env(os.environ),
               # this process: a worker ends when it is gone (phalanx.group.orphan), never trains on as an orphan
               "PHALANX_LAUNCHER_PID": str(os.getpid())}
        if self.timeout_s is not None:
            env["PHALANX_TIMEOUT"] = repr(self.timeout_s)
        if self.debug:
            env["PHALANX_DEBUG"] = "1"
        if self.profile_dir:  # read once by the workers (WorkerEnv); rank 0 says in one line if it cannot write
            env["PHALANX_PROFILE"] = os.path.abspath(self.profile_dir)
        if self.status is not None:  # the workers report their steps to the page (phalanx.step.telemetry)
            env["PHALANX_STATUS"] = "1"
        if self.checkpoint_dir is not None:
            env["PHALANX_CHECKPOINT_DIR"] = self.checkpoint_dir
        if self.resume_from is not None:
            env["PHALANX_RESUME_FROM"] = self.resume_from
        if self.standalone and "GLOO_SOCKET_IFNAME" not in os.environ and _loopback_interface():
            env["GLOO_SOCKET_IFNAME"] = _loopback_interface()  # one host: gloo listens on loopback only
        return env

    def launch_config(self, store_port: int = 0):  # -> torch.distributed.launcher.api.LaunchConfig (lazy: slow)
        """torch's launch settings; for a one-host run ``store_port`` is the loopback store :func:`run` made."""
        from torch.distributed.launcher.api import LaunchConfig

        if self.standalone:
            # The static rendezvous finds the store we already host on this port (multi-tenant) and
            # hands it to the workers; torch's own --standalone store would listen on every interface.
            backend, endpoint, run_id = "static", f"{DEFAULT_MASTER_ADDR}:{store_port}", "phalanx"
            configs, local_addr = {"rank": 0}, DEFAULT_MASTER_ADDR
        else:
            backend, run_id, local_addr = self.rdzv_backend, self.rdzv_id, None
            endpoint = self.rdzv_endpoint
            configs = {}
            if backend == "static":
                configs["rank"] = self.node_rank
                endpoint = endpoint or f"{self.master_addr}:{self.master_port or DEFAULT_MASTER_PORT}"
        # The agent turns these signals into stopping the workers with the same signal and waits for them
        # (shutdown_timeout: --grace) before SIGKILL. SIGTERM and SLURM's `--signal=USR1@N` (preemptions) are not
        # in its list: run() passes them on itself and keeps every worker's exit status (launch/stopping.py).
        return LaunchConfig(min_nodes=self.min_nodes, max_nodes=self.max_nodes, nproc_per_node=self.nproc,
                            run_id=run_id, rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_configs=configs,
                            max_restarts=self.max_restarts, local_addr=local_addr,
                            signals_to_handle="SIGINT,SIGHUP,SIGQUIT", shutdown_timeout=self.grace_s)


def _status_flag(text: str | None, *, standalone: bool, elastic: bool, node_rank: int) -> tuple[str, int] | None:
    """``--status [HOST:]PORT`` -> (host, port): served by the launcher that holds the job's store."""
    if text is None:
        return None
    try:
        address = parse_address(text)
    except ValueError:
        raise ConfigError(usage(f"--status {text}", "[HOST:]PORT, e.g. --status 8080 or --status 0.0.0.0:8080",
                                "Pass a port number, with the host to listen on if not loopback.")) from None
    if not (standalone or (elastic and node_rank == 0)):
        raise ConfigError(usage(f"--status {text} on a {'node other than the first' if elastic else 'multi-host'} "
                                "run", "--status where the launcher holds the job's store: a one-host run, or node 0 "
                                "of an --elastic job", "Pass --status on the first node's launcher only."))
    return address


def _apply_slurm(a: argparse.Namespace, slurm: SlurmEnv) -> argparse.Namespace:
    """Fill the host flags from SLURM's variables; a flag that disagrees with them is refused in one line."""
    slurm.check_launchers()
    fix = "Drop the flag: inside a SLURM allocation phalanx run reads it from SLURM."
    for flag, given, value in (("--nnodes", a.nnodes, str(slurm.nnodes)), ("--node-rank", a.node_rank,
                                                                           str(slurm.node_id))):
        if given is not None and given != value:
            raise ConfigError(usage(f"{flag} {given} inside SLURM job {slurm.job_id}",
                                    f"{flag} {value} (from SLURM_{'NNODES' if flag == '--nnodes' else 'NODEID'})",
                                    fix))
    if a.rdzv_backend not in (None, "static") or a.rdzv_endpoint:
        raise ConfigError(usage("--rdzv-backend/--rdzv-endpoint inside a SLURM allocation",
                                "the hosts of the allocation (SLURM_JOB_NODELIST)", fix))
    if a.nproc is None and slurm.gpus_on_node:
        a.nproc = str(slurm.gpus_on_node)
    a.nnodes, a.node_rank = str(slurm.nnodes), str(slurm.node_id)
    if slurm.nnodes > 1:
        first = node_address(slurm.hosts[0])
        if a.master_addr is not None and a.master_addr not in (first, slurm.hosts[0]):
            raise ConfigError(usage(f"--master-addr {a.master_addr} inside SLURM job {slurm.job_id}",
                                    f"the first node of SLURM_JOB_NODELIST ({slurm.hosts[0]}, at {first})", fix))
        a.master_addr = first
        a.master_port = a.master_port or str(slurm.port)
    return a


def _link_flag(a: argparse.Namespace, *, nproc: int, max_nodes: int, servers: int, elastic: bool,
               explicit: bool) -> str | None:
    """``--link RATE`` checked: a rate in tc's units, a one-host job of 2 or more workers, and root with ``ip``
    and ``tc`` here; each refusal is one line."""
    raw = getattr(a, "link", None)
    if raw is None:
        return None
    rate = parse_rate(raw, expected="a rate such as 100mbit, 1gbit or 500kbit (tc's units, as phalanx bench --link "
                      "spells them)", fix="Pass e.g. --link 100mbit.")
    fix = "Drop --link, or run the job on its own with -n 2 or more."
    if nproc < 2:
        raise ConfigError(usage(f"--link {rate} with -n {nproc}", "2 or more workers (they sit on either side of "
                                "the link)", fix))
    for given, what in ((max_nodes > 1, f"--nnodes {a.nnodes}"), (explicit and max_nodes == 1,
                        "--master-addr/--master-port/--rdzv-*"), (servers > 0, f"--servers {servers}"),
                        (elastic, "--elastic")):
        if given:
            raise ConfigError(usage(f"--link {rate} with {what}", "a plain one-host job (the link joins two "
                                    "namespaces of this machine, and phalanx run --link starts the workers itself)",
                                    fix))
    reason = why_not("run without --link")
    if reason:
        raise ConfigError(usage(f"--link {rate}", "a machine where it can be built", reason[0].upper() + reason[1:]
                                + "."))
    return rate


def _preemption_flags(a: argparse.Namespace) -> tuple[str | None, str | None]:
    """``--checkpoint-dir`` and ``--resume-from`` resolved: ``auto`` becomes the newest checkpoint, or None."""
    directory = os.path.abspath(a.checkpoint_dir) if a.checkpoint_dir else None
    if a.resume_from is None:
        return directory, None
    if a.resume_from == "auto":
        if directory is None:
            raise ConfigError(usage("--resume-from auto without --checkpoint-dir", "the directory to look in",
                                    "Pass e.g. --checkpoint-dir ckpt --resume-from auto."))
        found = latest_checkpoint(directory)
        print(f"phalanx: resuming from {found}" if found else f"phalanx: no checkpoint in {directory}; starting "
              "fresh", file=sys.stderr, flush=True)
        return directory, found
    if not os.path.exists(a.resume_from):
        raise ConfigError(usage(f"--resume-from {a.resume_from} (not found, cwd {os.getcwd()})",
                                "an existing checkpoint, or auto", "Check the path, or pass --resume-from auto."))
    return directory, os.path.abspath(a.resume_from)


def _loopback_interface() -> str | None:
    """The loopback interface's name ("lo" on Linux), if this system lists one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)
