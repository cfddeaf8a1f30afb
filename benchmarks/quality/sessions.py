"""Run a list of quality runs in persistent worker pairs (one session per link), with progress as they finish.

Starting two interpreters and importing torch costs seconds per run, a large share of a
15-second run on 2 cores. Here every link gets one pair of worker processes
(:func:`.worker.session`) that trains its runs one after the other. A run that fails or
outlives ``timeout`` is recorded as failed, the pair is killed, and a fresh pair goes on
with the next run, so one bad run never costs the rest.

``on_record`` is called after every finished run (the caller prints progress and writes
partial results), so a benchmark stopped late still leaves its tables.

Example:
    >>> items = [Item(run=None, repeat=0, config={"seed": 0})]
    >>> len(items), items[0].repeat
    (1, 0)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from phalanx.bench.procs import free_port
from phalanx.launch.netns import Link


@dataclass
class Item:
    """One run of a session: the run (a :class:`.plan.QRun`), its repeat number and the worker's config."""

    run: Any
    repeat: int
    config: dict[str, Any]


def _lines(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except OSError:
        return []


def _tail(path: str) -> str:
    try:
        with open(path) as f:
            lines = [x for x in f.read().strip().splitlines() if x.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(no output)"


# The workers run ``-m benchmarks.quality.worker``: the repository root must be on their path, wherever they start.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(cfg_path: str, outs: list[str], logs: list[str], link: Link | None,
           timeout: float) -> list[subprocess.Popen]:
    port, procs = free_port(), []
    for rank in range(len(outs)):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(len(outs)),
               "LOCAL_WORLD_SIZE": str(len(outs)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PHALANX_THREADS": "1", "PHALANX_TIMEOUT": str(int(min(timeout, 300))),
               "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)}
        prefix: list[str] = []
        if link is not None:
            env.update(link.env(rank))
            prefix = link.prefix(rank)
        with open(logs[rank], "a") as log:
            procs.append(subprocess.Popen(prefix + [sys.executable, "-m", "benchmarks.quality.worker", cfg_path,
                                                    outs[rank]], env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def run_session(items: list[Item], link: Link | None, *, timeout: float, workers: int = 2,
                on_record: Callable[[dict[str, Any]], None] = lambda r: None) -> list[dict[str, Any]]:
    """Train every item in order in one pair of processes; returns one record per item (``error`` set if failed)."""
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="phalanx-quality-") as tmp:
        cfg_path = os.path.join(tmp, "config.json")
        start, attempt = 0, 0
        while start < len(items):
            outs = [os.path.join(tmp, f"a{attempt}-rank{r}.jsonl") for r in range(workers)]
            logs = [os.path.join(tmp, f"a{attempt}-rank{r}.log") for r in range(workers)]
            with open(cfg_path, "w") as f:
                json.dump({"start": start, "runs": [it.config for it in items]}, f)
            procs = _start(cfg_path, outs, logs, link, timeout)
            last, error = time.monotonic(), None
            try:
                while True:
                    done = [_lines(p) for p in outs]
                    while all(len(d) > len(records) - start for d in done):
                        k = len(records) - start
                        it = items[start + k]
                        records.append({"run": it.run.to_json(), "repeat": it.repeat, "error": None,
                                        "ranks": [d[k] for d in done], "wall_s": done[0][k]["wall_s"]})
                        on_record(records[-1])
                        last = time.monotonic()
                    if len(records) == len(items):
                        break
                    codes = [p.poll() for p in procs]
                    if any(c not in (None, 0) for c in codes) or all(c is not None for c in codes):
                        time.sleep(2.0)  # let the other rank's error reach its log
                        error = "; ".join(f"rank {r} exited {p.poll()}: {_tail(logs[r])}" for r, p in enumerate(procs))
                        break
                    if time.monotonic() - last > timeout:
                        error = f"no run finished in {timeout:.0f} s: " + "; ".join(_tail(x) for x in logs)
                        break
                    time.sleep(0.2)
            finally:
                _stop(procs)
            if error is not None:
                it = items[len(records)]
                records.append({"run": it.run.to_json(), "repeat": it.repeat, "ranks": [], "wall_s": float("nan"),
                                "error": f"{it.run.title}: {error}"})
                on_record(records[-1])
            start, attempt = len(records), attempt + 1
    return records
