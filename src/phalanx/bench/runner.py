"""Run the sweep: start real worker processes for each configuration, collect their raw numbers.

Every configuration runs in fresh processes (one per worker; gloo between them),
so thread settings, allocator state and process groups never leak from one to the
next. With ``repeats`` > 1 the whole list runs again, alternating its order, so a
slow drift of the machine's load hits every configuration alike.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..errors import PhalanxError
from .procs import free_port
from ..launch.netns import Link
from .spec import Run


class RunFailed(PhalanxError, RuntimeError):
    """A worker of one configuration exited with an error or ran out of time."""


@dataclass
class Options:
    warmup: int = 5
    steps: int = 30
    repeats: int = 1
    timeout: float = 600.0  # per configuration
    seed: int = 0
    progress: bool = True


def launch(run: Run, cfg: dict[str, Any], *, module: str = "phalanx.bench.worker", link: Link | None = None,
           timeout: float = 600.0) -> list[dict[str, Any]]:
    """Start ``run.workers`` processes of ``python -m module CFG OUT`` and return each rank's result."""
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        port, threads = free_port(), str(run.threads)
        procs: list[subprocess.Popen] = []
        logs = []
        try:
            for rank in range(run.workers):
                env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(run.workers),
                       "LOCAL_WORLD_SIZE": str(run.workers), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": threads, "PHALANX_THREADS": threads,
                       "PHALANX_TIMEOUT": str(int(min(timeout, 300)))}
                prefix: list[str] = []
                if link is not None:
                    env.update(link.env(rank))
                    prefix = link.prefix(rank)
                log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
                logs.append(log)
                out = os.path.join(tmp, f"rank{rank}.json")
                procs.append(subprocess.Popen(prefix + [sys.executable, "-m", module, cfg_path, out],
                                              env=env, stdout=log, stderr=subprocess.STDOUT))
            codes = _wait(procs, timeout)
            if any(codes):
                tails = []
                for rank, (code, log) in enumerate(zip(codes, logs, strict=True)):
                    log.seek(0)
                    lines = log.read().strip().splitlines()
                    tails.append(f"rank {rank} exited {code}: {lines[-1] if lines else '(no output)'}")
                raise RunFailed(f"{run.title}: " + "; ".join(tails))
            results = []
            for rank in range(run.workers):
                with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                    results.append(json.load(f))
            return results
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()


def _wait(procs: list[subprocess.Popen], timeout: float, grace: float = 20.0) -> list[int]:
    """Wait for all; once one fails, the others get ``grace`` seconds (gloo notices a lost peer fast)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes]
        if any(c not in (None, 0) for c in codes):
            deadline = min(deadline, time.monotonic() + grace)
        if time.monotonic() > deadline:
            return [int(c) if c is not None else -9 for c in codes]  # -9: we kill it in launch()'s finally
        time.sleep(0.05)


def config_for(run: Run, opts: Options) -> dict[str, Any]:
    return {"model": run.model, "setup": {"name": run.setup.name, "kwargs": run.setup.kwargs},
            "batch": run.batch, "threads": run.threads, "warmup": opts.warmup, "steps": opts.steps,
            "seed": opts.seed}


@contextlib.contextmanager
def terminate_unwinds() -> Iterator[None]:
    """SIGTERM/SIGHUP unwind like Ctrl-C while the sweep runs, so its workers are killed and links torn down."""
    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            old[sig] = signal.signal(sig, interrupt)
    except ValueError:  # not the main thread
        pass
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def links_for(runs: list[Run]) -> Iterator[dict[str, Link]]:
    """Build every shaped link the runs need, and tear all of them down on the way out."""
    names = sorted({r.link for r in runs if r.link != "loopback"})
    with contextlib.ExitStack() as stack:
        pid = os.getpid()
        yield {name: stack.enter_context(Link(name, tag=f"{pid}x{i}")) for i, name in enumerate(names)}


def sweep(runs: list[Run], opts: Options, *, make_config: Callable[[Run, Options], dict[str, Any]] = config_for,
          module: str = "phalanx.bench.worker", desc: str = "bench",
          describe: Callable[[dict[str, Any]], str] | None = None) -> list[dict[str, Any]]:
    """Run every configuration ``opts.repeats`` times; a failed one is recorded and the sweep goes on."""
    from tqdm import tqdm

    records: list[dict[str, Any]] = []
    order = [(k, run) for k in range(opts.repeats) for run in (runs if k % 2 == 0 else runs[::-1])]
    bar = tqdm(total=len(order), desc=desc, unit="run", disable=not opts.progress, file=sys.stderr, dynamic_ncols=True)
    with terminate_unwinds(), links_for(runs) as links, bar:
        for k, run in order:
            bar.set_postfix_str(run.title)
            start = time.perf_counter()
            record: dict[str, Any] = {"run": run.to_json(), "repeat": k, "ranks": [], "error": None}
            for _ in range(2):
                try:
                    record["ranks"] = launch(run, make_config(run, opts), module=module,
                                             link=links.get(run.link), timeout=opts.timeout)
                    record["error"] = None
                    break
                except RunFailed as err:
                    record["error"] = str(err)
                    if "EADDRINUSE" not in record["error"]:
                        break  # only a lost race for the free port is worth a second try
            record["wall_s"] = time.perf_counter() - start
            records.append(record)
            bar.write(f"  {run.title}: " + (f"FAILED ({record['error'][:200]})" if record["error"]
                                              else (describe(record) if describe else "done")), file=sys.stderr)
            bar.update(1)
    return records
