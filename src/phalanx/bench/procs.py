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

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..group import group
from ..launch.ports import free_port
from ..launch.workers import StartMethod, start_worker


@dataclass
class WorkerRun:
    returncodes: list[int]
    results: list[Any]
    logs: list[str] = field(default_factory=list)

    def log(self, rank: int) -> str:
        return self.logs[rank]


def run_workers(target: str, world_size: int = 2, *, timeout: float = 120.0, env: dict[str, str] | None = None,
                check: bool = True, start_method: StartMethod = "spawn", **kwargs: Any) -> WorkerRun:
    """Run ``target`` ("module:function") on ``world_size`` real processes and collect results.

    ``kwargs`` must be JSON-serialisable. With ``check`` a non-zero exit raises with the logs.
    ``start_method`` (:mod:`phalanx.launch.workers`): ``"spawn"`` runs a fresh interpreter per
    rank; ``"forkserver"`` forks each rank from a server that imported torch once (the tests'
    choice: 5 s less CPU per worker). Either way every rank is its own process with its own
    environment, talking gloo.
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="phalanx-workers-") as out:
        procs, logs = [], []
        for rank in range(world_size):
            worker_env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                          "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                          "OMP_NUM_THREADS": "1", "PHALANX_THREADS": "1", **(env or {})}
            logs.append(os.path.join(out, f"rank{rank}.log"))
            argv = ["-m", "phalanx.bench.procs", target, json.dumps(kwargs), os.path.join(out, f"rank{rank}.pt")]
            procs.append(start_worker(start_method, argv, worker_env, log=logs[-1]))
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                break
        codes = [p.wait() for p in procs]
        texts = []
        for log in logs:
            with open(log, errors="replace") as f:
                texts.append(f.read())
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


def _main(argv: list[str]) -> None:
    target, kwargs, out = argv[0], json.loads(argv[1]), argv[2]
    module, _, name = target.partition(":")
    result = getattr(importlib.import_module(module), name)(**kwargs)
    torch.save(result, out)
    group.shutdown()


if __name__ == "__main__":
    _main(sys.argv[1:])
