"""Start real worker processes on this machine: what the benchmarks and demos launch with.

``run_workers("mypkg.mod:fn", world_size=2)`` starts one Python process per rank
with the same variables ``phalanx run`` and torchrun set (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``...), calls ``fn(**kwargs)`` in each, and returns
what each rank's call returned (tensors and plain values, moved with
``torch.save``/``weights_only`` loads). Nothing is mocked: the workers talk gloo.

Example:
    >>> from phalanx.bench.procs import run_workers
    >>> run_workers("phalanx.bench.procs:_echo_rank", world_size=2).results
    [0, 1]
"""
from __future__ import annotations

import atexit
import importlib
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO, Any, Literal, Protocol

import torch

from .. import group


def free_port() -> int:
    """An unused TCP port on loopback (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class WorkerRun:
    returncodes: list[int]
    results: list[Any]
    logs: list[str] = field(default_factory=list)

    def log(self, rank: int) -> str:
        return self.logs[rank]


StartMethod = Literal["spawn", "forkserver"]

# What a forked worker finds already imported: torch, the parts of it phalanx imports lazily, and phalanx's core.
# Importing them is 5 s of CPU per process on a small machine, more than most multi-process tests run.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.fsdp", "phalanx", "phalanx.trainer"]


def run_workers(target: str, world_size: int = 2, *, timeout: float = 120.0, env: dict[str, str] | None = None,
                check: bool = True, start_method: StartMethod = "spawn", **kwargs: Any) -> WorkerRun:
    """Run ``target`` ("module:function") on ``world_size`` real processes and collect results.

    ``kwargs`` must be JSON-serialisable. With ``check`` a non-zero exit raises with the logs.
    ``start_method`` names the process start as :mod:`multiprocessing` does: ``"spawn"`` runs a fresh
    interpreter per rank (what ``phalanx run`` does); ``"forkserver"`` forks each rank from a server
    process that imported :data:`PRELOAD` once (the tests' choice: 5 s less CPU per worker). Either
    way every rank is its own process with its own environment, talking gloo.
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="phalanx-workers-") as out:
        procs: list[_Worker] = []
        logs = []
        for rank in range(world_size):
            worker_env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                          "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                          "OMP_NUM_THREADS": "1", "PHALANX_THREADS": "1", **(env or {})}
            log = open(os.path.join(out, f"rank{rank}.log"), "w+")
            logs.append(log)
            argv = [target, json.dumps(kwargs), os.path.join(out, f"rank{rank}.pt")]
            if start_method == "forkserver":
                procs.append(_Forked(argv, worker_env, log))
            elif start_method == "spawn":
                procs.append(_Spawned(argv, worker_env, log))
            else:
                raise ValueError(f"start_method={start_method!r}; expected 'spawn' or 'forkserver'")
        deadline = time.monotonic() + timeout
        for p in procs:
            if p.wait(max(0.1, deadline - time.monotonic())) is None:
                for q in procs:
                    q.kill()
                break
        codes = [p.wait(None) for p in procs]
        texts = []
        for log in logs:
            log.seek(0)
            texts.append(log.read())
            log.close()
        results = []
        for rank in range(world_size):
            path = os.path.join(out, f"rank{rank}.pt")
            results.append(torch.load(path, weights_only=True) if os.path.exists(path) else None)
    run = WorkerRun(codes, results, texts)
    if check and any(codes):
        detail = "\n".join(f"--- rank {r} exited {c} ---\n{t[-3000:]}"
                           for r, (c, t) in enumerate(zip(codes, texts, strict=True)))
        raise RuntimeError(f"workers failed: {codes}\n{detail}")
    return run


def _echo_rank() -> int:
    group.init()
    return group.rank()


class _Worker(Protocol):
    def wait(self, timeout: float | None) -> int | None: ...

    def kill(self) -> None: ...


class _Spawned:
    """A rank in a fresh interpreter: ``python -m phalanx.bench.procs TARGET KWARGS OUT``."""

    def __init__(self, argv: list[str], env: dict[str, str], log: IO[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "phalanx.bench.procs", *argv], env=env, stdout=log,
                                     stderr=subprocess.STDOUT)

    def wait(self, timeout: float | None) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self.proc.kill()


class _Forked:
    """A rank forked from :mod:`multiprocessing`'s fork server, which imported :data:`PRELOAD` once."""

    def __init__(self, argv: list[str], env: dict[str, str], log: IO[str]) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (once per parent process)
        self.proc = ctx.Process(target=_forked_main, args=(argv, env, log.name, os.getcwd()), daemon=False)
        self.proc.start()

    def wait(self, timeout: float | None) -> int | None:
        self.proc.join(timeout)
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()


def _forked_main(argv: list[str], env: dict[str, str], log: str, cwd: str) -> None:
    """In the forked rank: become what ``python -m phalanx.bench.procs`` would have been, then run it."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    code = 0
    try:
        _main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - handed to sys.excepthook, as a fresh interpreter would
        sys.excepthook(*sys.exc_info())  # px.init()'s hook leaves the failure note peers read (lost_peers)
        code = 1
    # multiprocessing's children skip atexit; phalanx's exit handlers (the group's shutdown) must run as they
    # would at a spawned interpreter's exit.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(argv: list[str]) -> None:
    target, kwargs, out = argv[0], json.loads(argv[1]), argv[2]
    module, _, name = target.partition(":")
    result = getattr(importlib.import_module(module), name)(**kwargs)
    torch.save(result, out)
    group.shutdown()


if __name__ == "__main__":
    _main(sys.argv[1:])
