"""How ``phalanx run --elastic`` starts a worker process: a fresh interpreter, or a fork of a preloaded server.

``--start-method spawn`` (the default, as torchrun's) runs ``python -u SCRIPT ARGS`` per worker.
``--start-method forkserver`` forks each worker from :mod:`multiprocessing`'s fork server,
which imported torch and phalanx once: a worker, a spare or a replacement then starts without
the 5 s of CPU an import of torch costs on a small machine (``python -X importtime``). Either
way each worker is its own process with its own environment, runs the script as ``__main__``
and is watched through the same :class:`subprocess.Popen`-like handle.

Example:
    >>> import sys
    >>> from phalanx.launch.workers import start_worker
    >>> p = start_worker("spawn", ["-c", "print('hi')"], {"PATH": ""})
    >>> p.wait(60)
    0
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing
from multiprocessing import forkserver
import os
import runpy
import subprocess
import sys
import threading
from typing import Iterator, Literal, Protocol

StartMethod = Literal["spawn", "forkserver"]
START_METHODS: tuple[str, ...] = ("spawn", "forkserver")

# What a forked worker finds imported: torch, the parts of it phalanx loads on first use, phalanx's core.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.fsdp", "phalanx", "phalanx.train.trainer"]


class WorkerProcess(Protocol):
    """The part of :class:`subprocess.Popen` the launchers use to watch a worker."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def start_worker(method: StartMethod, argv: list[str], env: dict[str, str], log: str | None = None) -> WorkerProcess:
    """Start ``python -u *argv`` (a script, ``-m MODULE`` or ``-c CODE``, then arguments) with ``env`` (its whole
    environment) the way ``method`` says; ``log``: a file its stdout and stderr go to (appended), else ours."""
    if method == "spawn":
        if log is None:
            return subprocess.Popen([sys.executable, "-u", *argv], env=env)
        with open(log, "a") as out:
            return subprocess.Popen([sys.executable, "-u", *argv], env=env, stdout=out, stderr=subprocess.STDOUT)
    if method == "forkserver":
        return ForkedWorker(argv, env, log)
    raise ValueError(f"start method {method!r}; expected one of {', '.join(START_METHODS)}")


class ForkedWorker:
    """A worker forked from the fork server; :class:`subprocess.Popen`'s watching interface."""

    def __init__(self, argv: list[str], env: dict[str, str], log: str | None = None) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read when this process's fork server starts (once)
        _start_server(env)
        self._proc = ctx.Process(target=_run, args=(argv, env, os.getcwd(), log), daemon=False)
        self._proc.start()
        self.pid: int = self._proc.pid  # type: ignore[assignment]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self.returncode = self._proc.exitcode
            # its two descriptors (the fork server's status pipe, the sentinel) go now, not when the handle is
            # dropped: the launcher keeps every worker's handle, and --replace starts one for every worker lost
            self._proc.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(["phalanx-worker", str(self.pid)], timeout or 0.0)
        return self.returncode  # type: ignore[return-value]

    def terminate(self) -> None:
        if self.returncode is None:
            self._proc.terminate()

    def kill(self) -> None:
        if self.returncode is None:
            self._proc.kill()


def _start_server(env: dict[str, str]) -> None:
    """Start the fork server (once) in the workers' environment: torch reads some variables when it loads
    (``TORCH_CPP_LOG_LEVEL``, ``OMP_NUM_THREADS``), and in a forked worker it was loaded by the server.

    The environment is swapped only to start the server, under a lock: a launcher that starts workers from two
    threads (the tests' late joiner) read an empty or another worker's ``os.environ`` while it was swapped on
    every start. Once the server runs, each worker's environment is set in the worker (:func:`_run`).
    """
    with _SERVER_START:
        # multiprocessing has no public "is it running"; ensure_running() reads this same attribute
        if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
            return
        with environment(env):
            forkserver.ensure_running()


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` is ``env`` inside (what a process started there inherits), and what it was after.

    Example:
        >>> with environment({"ONLY": "this"}):
        ...     dict(os.environ)
        {'ONLY': 'this'}
    """
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


_SERVER_START = threading.Lock()  # a lock, not state: it orders the fork server's start between threads


def _run(argv: list[str], env: dict[str, str], cwd: str, log: str | None) -> None:
    """In the forked worker: become ``python -u *argv`` and run it."""
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # as -u: the launcher interleaves workers' lines as they come
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - the launcher's -c
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as the interpreter does for a script
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - to sys.excepthook, as the interpreter does (px.init's note)
        sys.excepthook(*sys.exc_info())
        code = 1
    # multiprocessing's children skip atexit; a script's exit handlers (px.init's shutdown) run as they would at an
    # interpreter's exit.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
