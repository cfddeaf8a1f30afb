"""``phalanx run --link RATE``: the user's own script, its workers on either side of a link shaped to RATE.

Try a rule on your own model before renting machines. As root, ``phalanx run -n 2 --link 100mbit train.py``
builds two network namespaces joined by a veth pair, each end shaped with ``tc tbf`` to RATE
(:mod:`phalanx.launch.netns`, what ``phalanx bench --link`` builds); even ranks run in one, odd ranks in
the other, so every collective between the sides crosses the link. Rank 0 hosts the store in the first
namespace. At the end it prints, in one line, where the steps went and what crossed the wire:

    phalanx run --link 100mbit: 200 steps; a step took 124 ms: computing 60.2 ms, waiting on the exchange
    63.8 ms (mean of 2 workers, the first 2 steps left out); on the wire 2.10 MB a step (veth tx, both ways,
    everything: store and heartbeats included); the compute-only step is 60.2 ms, so this run took 2.06x it

"Computing" is everything in a step but the waiting on the exchange that the step clock counts
(:mod:`phalanx.step.report`); it is the step this model would take were the link infinitely fast.
Without root, without ``ip``/``tc``, or with a malformed rate, ``phalanx run`` says so in one line
before starting anything (:mod:`phalanx.launch.config`).

Example (as root):
    >>> # phalanx run -n 2 --link 10mbit train.py --epochs 1
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from .config import DEFAULT_MASTER_PORT, RunConfig
from .failures import status as _status
from .netns import Link, LinkError

#: What a worker's report leaves out at the start (the first steps build buckets, warm caches).
SKIP = 2


def run_linked(cfg: RunConfig) -> int:
    """Start ``cfg.nproc`` workers split across the shaped link, wait for them, print the summary line."""
    assert cfg.link is not None
    reports = tempfile.mkdtemp(prefix="phalanx-link-")
    try:
        with Link(cfg.link) as link:
            before = link.tx_bytes()
            code = _run_workers(cfg, link, reports)
            wire = link.tx_bytes() - before
        if code == 0:
            print(summary(cfg.link, _read(reports, cfg.nproc), wire), file=sys.stderr, flush=True)
        return code
    except LinkError as err:
        print(f"phalanx: {err}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("phalanx: interrupted; stopped all workers and removed the link", file=sys.stderr, flush=True)
        return 130
    finally:
        for name in os.listdir(reports):
            os.unlink(os.path.join(reports, name))
        os.rmdir(reports)


def _run_workers(cfg: RunConfig, link: Link, reports: str) -> int:
    base = {**os.environ, **cfg.worker_env(), "WORLD_SIZE": str(cfg.nproc), "LOCAL_WORLD_SIZE": str(cfg.nproc),
            "MASTER_PORT": str(cfg.master_port or DEFAULT_MASTER_PORT), "PHALANX_STEP_REPORT": reports}
    base.pop("PHALANX_LAUNCHER", None)  # torch's agent is not there to print a failure: the worker prints its own
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(cfg.nproc):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), **link.env(rank)}
            procs.append(subprocess.Popen(link.prefix(rank) + [sys.executable, "-u", cfg.script, *cfg.script_args],
                                          env=env))
        return _wait(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _wait(procs: list[subprocess.Popen]) -> int:
    """Every worker's end; after the first failure the others get the heartbeat's time to notice, then SIGKILL."""
    failed: tuple[int, int] | None = None
    deadline = None
    while True:
        codes = [p.poll() for p in procs]
        if failed is None:
            failed = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                deadline = time.monotonic() + 30
        if all(c is not None for c in codes):
            break
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
        time.sleep(0.1)  # sleep: polling child processes; a wait on one would miss another's failure
    if failed is None:
        return 0
    rank, code = failed
    words, status = _status(code)
    print(f"phalanx: worker rank {rank} {words} (first failure); stopped the others", file=sys.stderr, flush=True)
    return status


def _read(directory: str, n: int) -> list[dict[str, Any]]:
    out = []
    for rank in range(n):
        try:
            with open(os.path.join(directory, f"rank{rank}.json")) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue  # this rank wrapped no model (or never stepped): nothing to report
    return out


def summary(rate: str, ranks: list[dict[str, Any]], wire_bytes: int) -> str:
    """The closing line: the step split, the bytes on the wire per step, the compute-only step.

    Example:
        >>> summary("100mbit", [{"total": 10, "steps": 8, "step_s": 0.12, "wait_s": 0.06}] * 2, 2_000_000)
        'phalanx run --link 100mbit: 10 steps; a step took 120 ms: computing 60 ms, waiting on the exchange 60 ms \
(mean of 2 workers, the first 2 steps left out); on the wire 200 kB a step (veth tx, both ways, everything: \
store and heartbeats included); the compute-only step is 60 ms, so this run took 2.00x it'
    """
    timed = [r for r in ranks if r.get("steps")]
    total = max((int(r.get("total") or 0) for r in ranks), default=0)
    if not timed or total == 0:
        wire = f"{_bytes(wire_bytes)} in all crossed the link (veth tx)"
        return (f"phalanx run --link {rate}: no timed steps (no model wrapped with px.wrap took more than {SKIP} "
                f"steps), so no step split; {wire}")
    step = sum(r["step_s"] for r in timed) / len(timed)
    wait = sum(r["wait_s"] for r in timed) / len(timed)
    compute = max(step - wait, 0.0)
    ratio = f", so this run took {step / compute:.2f}x it" if compute > 0 else ""
    return (f"phalanx run --link {rate}: {total} steps; a step took {_ms(step)}: computing {_ms(compute)}, waiting "
            f"on the exchange {_ms(wait)} (mean of {len(timed)} workers, the first {SKIP} steps left out); on the "
            f"wire {_bytes(wire_bytes / total)} a step (veth tx, both ways, everything: store and heartbeats "
            f"included); the compute-only step is {_ms(compute)}{ratio}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


__all__ = ["run_linked", "summary"]
