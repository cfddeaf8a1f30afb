"""``phalanx run`` for the elastic tests without two fresh interpreters per job.

A job started as ``python -c "from phalanx.cli import main; ..."`` pays a fresh interpreter importing torch for its
launcher (about 1.4 CPU s) and, with ``--start-method forkserver``, a fork server that imports torch, dynamo, DCP,
FSDP and phalanx (about 2.8 CPU s) before its first worker starts. Here ONE preloaded fork server per test process,
started once in the environment an elastic launcher gives its workers' server (``OMP_NUM_THREADS=1``,
``TORCH_CPP_LOG_LEVEL=ERROR``), forks each launcher (running the same ``phalanx.cli.main`` in the test's environment)
and every launcher's workers. Each worker is still its own process,
forked from a server that imported torch and nothing else, with its own environment set in it
(:func:`phalanx.launch.workers._run`), exactly as ``--start-method forkserver`` forks it; the launcher runs the
same code as the ``phalanx`` script. Use it where a test does not test the launcher's own process start (a test
that kills the launcher, or reads what a fresh interpreter prints, keeps :func:`support.elastic_job.launch`).

Example:
    >>> # proc, results = launch(tmp_path, "--min-workers", "2", "--", "--kill", "1@5")  # as elastic_job.launch
"""
from __future__ import annotations

import atexit
import functools
import glob
import json
import multiprocessing
import multiprocessing.process
import os
import signal
import subprocess
import threading
import sys
import tempfile
import traceback
from multiprocessing import forkserver
from typing import Sequence

from support.elastic_job import WORKER

# the fork server's module-level functions are bound methods of its one instance (multiprocessing.forkserver)
_SERVER_FUNCTIONS = ("ensure_running", "get_inherited_fds", "connect_to_new_process", "set_forkserver_preload")
#: held while :func:`start_cli` swaps multiprocessing's module-level fork-server functions for its server's: a test
#: that starts processes from several threads through those functions too (``support.procs.run_workers``) holds it
STARTING = threading.RLock()


@functools.cache
def _server() -> forkserver.ForkServer:
    """This test process's preloaded fork server for the launchers' workers (started once, on first use)."""
    from phalanx.launch.workers import PRELOAD, environment
    server = forkserver.ForkServer()
    server.set_forkserver_preload(PRELOAD)
    # torch reads these when it loads, in the server (phalanx.launch.workers._start_server): what the elastic
    # launcher gives its workers (phalanx.launch.elastic: the C++ store log off; one thread per worker on 2 cores)
    with environment({**os.environ, "OMP_NUM_THREADS": "1", "PHALANX_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}):
        server.ensure_running()
    atexit.register(_stop, server)
    return server


def _stop(server: forkserver.ForkServer) -> None:
    """At this process's exit: close the server's alive pipe (it exits) and reap it, so that its CPU and its reaped
    workers' count among this process's children (``/usr/bin/time``, ``os.times()``), as a launcher's did."""
    os.close(server._forkserver_alive_fd)
    os.waitpid(server._forkserver_pid, 0)


class Launcher:
    """A launcher started by :func:`start_cli`: the part of :class:`subprocess.Popen` the tests use (``pid``,
    ``returncode``, ``poll``, ``wait``, ``kill``, ``communicate``); its output is in ``OUT/launcher.{out,err}``.

    Example:
        >>> # launcher = start_cli(argv, str(tmp_path)); stderr = launcher.communicate(timeout=120)[1]
    """

    def __init__(self, proc: multiprocessing.process.BaseProcess, argv: list[str], paths: tuple[str, str]) -> None:
        self._proc, self.args, self.paths = proc, argv, paths
        self.pid: int = proc.pid  # type: ignore[assignment]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self.returncode = self._proc.exitcode  # as Popen's: negative for a signal
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0, stderr=open(self.paths[1]).read())
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return open(self.paths[0]).read(), open(self.paths[1]).read()


def run_cli(argv: Sequence[str], out: str, timeout: float, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    """``phalanx ARGV`` in a fork of this process whose workers fork from :func:`_server`; its stdout and stderr
    are kept in ``OUT/launcher.out`` and ``OUT/launcher.err``; ``env`` is added to its environment. Raises
    :class:`subprocess.TimeoutExpired` (the launcher killed) after ``timeout`` seconds, as :func:`subprocess.run`.

    Example:
        >>> # proc = run_cli(["run", "-n", "2", "--elastic", WORKER, "--out", str(tmp_path)], str(tmp_path), 120)
    """
    launcher = start_cli(argv, out, env)
    try:
        launcher.wait(timeout)
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.wait()
        raise
    stdout, stderr = launcher.communicate()
    return subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout=stdout, stderr=stderr)


def start_cli(argv: Sequence[str], out: str, env: dict[str, str] | None = None) -> Launcher:
    """:func:`run_cli` without waiting: the launcher's handle.

    The launcher is forked from :func:`_server` too, not from this process: a test process that ran Ray (its gRPC
    threads) or any other threads is no safe parent for a fork (the suite's forked launchers died of SIGSEGV after
    the Ray file had run in their xdist worker), while the server imported torch and phalanx and nothing else.

    Example:
        >>> # launcher = start_cli(["run", "-n", "2", "--elastic", WORKER, "--out", str(tmp_path)], str(tmp_path))
    """
    server = _server()
    paths = os.path.join(out, "launcher.out"), os.path.join(out, "launcher.err")
    environ = {**os.environ, **(env or {})}
    environ.setdefault("PHALANX_START_METHOD", "forkserver")  # a module fixture's job too: the server
    ctx = multiprocessing.get_context("forkserver")
    proc = ctx.Process(target=_launcher, args=(list(argv), paths, environ, server._forkserver_address), daemon=False)
    # multiprocessing starts a process through its module-level server: ours, for this one start
    with STARTING:
        saved = {name: getattr(forkserver, name) for name in _SERVER_FUNCTIONS}
        try:
            for name in _SERVER_FUNCTIONS:
                setattr(forkserver, name, getattr(server, name))
            proc.start()
        finally:
            for name, function in saved.items():
                setattr(forkserver, name, function)
    return Launcher(proc, ["phalanx", *argv], paths)


def _launcher(argv: list[str], paths: tuple[str, str], environ: dict[str, str], address: str) -> None:
    """In the launcher, forked from the shared server: its output to ``paths``, this test's environment, its
    workers forked from the same server (whose address it is given), then ``phalanx ARGV``."""
    code: int = 1
    try:
        for fd, path in zip((1, 2), paths):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)  # workers append too
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(environ)
        tempfile.tempdir = None  # the server's, cached: read again from this environment (TMPDIR), as a fresh one would
        # the server's child already holds the server's alive descriptor (multiprocessing.forkserver._serve_one);
        # given its address, it asks the same server for its workers; the server runs (a dead one fails the job's
        # first worker start, which the test sees)
        forkserver._forkserver._forkserver_address = address
        forkserver.ensure_running = lambda: None  # type: ignore[assignment]
        forkserver._forkserver.ensure_running = lambda: None  # type: ignore[method-assign]
        forkserver._forkserver._forkserver_pid = -1  # phalanx.launch.workers._start_server: it is running
        # a worker forked from the shared server inherits the server's stdout and stderr, not this launcher's:
        # it points them at this job's files first (appending, as the launcher does: one stream, in time order)
        from phalanx.launch import workers
        workers._run = functools.partial(_worker, paths)
        from phalanx.cli import main
        sys.argv = ["phalanx", *argv]
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed, as the interpreter would, and exit 1
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # the launcher's own (its run folder removed); multiprocessing would skip them
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _worker(paths: tuple[str, str], argv: list[str], env: dict[str, str], cwd: str, log: str | None) -> None:
    """In a worker forked from the shared server: stdout and stderr to its launcher's files (as a worker forked from
    the launcher's own server writes to the launcher's), then :func:`phalanx.launch.workers._run`."""
    from phalanx.launch.workers import _run
    for fd, path in zip((1, 2), paths):
        opened = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(opened, fd)
        os.close(opened)
    _run(argv, env, cwd, log)


def launch(tmp_path, *flags: str, n: int = 3, timeout: float = 120, script: str = WORKER
           ) -> tuple[subprocess.CompletedProcess, dict]:
    """:func:`support.elastic_job.launch` (the same flags: the launcher's, then ``--``, then the script's), with the
    launcher forked from this process and its workers from this process's one preloaded server.

    Example:
        >>> # proc, results = launch(tmp_path, "--min-workers", "2", "--", "--kill", "1@5", "--commit-every", "3")
    """
    cut = flags.index("--") if "--" in flags else len(flags)
    argv = ["run", "-n", str(n), "--elastic", *flags[:cut], script, "--out", str(tmp_path), *flags[cut + 1:]]
    proc = run_cli(argv, str(tmp_path), timeout)
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}
    return proc, results
