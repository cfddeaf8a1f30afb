"""Workers of uneven speed: equal split, ``px.shard(balance="speed")`` and Downpour, one worker throttled.

    python benchmarks/balance.py                       # the three modes, 300 steps each
    python benchmarks/balance.py --steps 120 --modes equal balanced

Two workers train a small MLP (synthetic teacher labels) with a global batch of 128.
Worker 1 is throttled to ``--quota`` of a core: a cgroup-v1 CPU quota
(``/sys/fs/cgroup/cpu/phalanx-balance-slow``, root only) or, where that cannot be
written, a busy loop pinned beside it on its core (``taskset``-style affinity). Worker 0
runs on the other core. The modes:

* ``equal``: ``px.AllReduce()``, each worker half of every global batch (the default);
* ``balanced``: the same with ``px.shard(..., balance="speed", rebalance_every=--every)``;
* ``downpour``: ``px.Downpour()`` with one parameter server (asynchronous: nobody waits).

Printed per mode: samples/s (each worker's samples over its own wall time, summed), the
split in force at the end, and the time until worker 0's loss on a fixed evaluation set
first reaches ``--target`` (checked every 10 steps). On a shared machine every figure is
"under load": compare modes within one run only.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Any, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CGROUP = "/sys/fs/cgroup/cpu/phalanx-balance-slow"
MODES = ("equal", "balanced", "downpour")


def worker(mode: str, steps: int, every: int, width: int, goal: float, throttle: str) -> dict[str, Any]:
    """One worker of one mode (run by phalanx.bench.procs on every rank)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import phalanx as px

    px.init()
    rank = px.rank()
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})  # one core each; the busy loop shares core 1
    if rank == 1 and throttle.startswith("cgroup:"):
        with open(os.path.join(throttle[len("cgroup:"):], "cgroup.procs"), "a") as f:
            f.write(str(os.getpid()))  # this process only: the quota throttles worker 1 alone
    torch.manual_seed(0)
    n, features = 16384, 32
    x = torch.randn(n, features)
    y = nn.Sequential(nn.Linear(features, 64), nn.Tanh(), nn.Linear(64, 10))(x).argmax(1)  # a teacher's labels
    eval_x, eval_y = x[:512], y[:512]
    data = torch.utils.data.TensorDataset(x, y)
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                        nn.Linear(width, 10))
    strategy = px.Downpour() if mode == "downpour" else px.AllReduce()
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), strategy=strategy)
    balance = {"balance": "speed", "rebalance_every": every} if mode == "balanced" else {}
    loader = px.shard(data, batch_size=64, seed=0, **balance)
    done, samples, reached = 0, 0, None
    start = time.perf_counter()
    for epoch in range(10**6):
        loader.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            done, samples = done + 1, samples + len(xb)
            if rank == 0 and reached is None and done % 10 == 0:
                with torch.no_grad():
                    if F.cross_entropy(model(eval_x), eval_y).item() <= goal:
                        reached = time.perf_counter() - start
            if done == steps:
                break
        if done == steps:
            break
    wall = time.perf_counter() - start
    shares = loader.sampler.shares
    px.strategy_of(opt).finish()
    px.shutdown()
    return {"samples": samples, "wall_s": wall, "reached_s": reached, "shares": shares}


@contextlib.contextmanager
def throttled(quota: float) -> Iterator[str]:
    """A cgroup with ``quota`` of a core (``cgroup:PATH``), else a busy loop on core 1 (``busy``)."""
    try:
        os.makedirs(CGROUP, exist_ok=True)
        with open(os.path.join(CGROUP, "cpu.cfs_period_us")) as f:
            period = int(f.read())
        with open(os.path.join(CGROUP, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(int(period * quota)))
    except OSError:
        busy = subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {1})\nwhile True: pass"])
        try:
            yield "busy"
        finally:
            busy.kill()
            busy.wait()
        return
    try:
        yield f"cgroup:{CGROUP}"
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(CGROUP)  # refused while a task is still inside; the next run reuses it


def run_mode(mode: str, args: argparse.Namespace, throttle: str) -> dict[str, Any]:
    from phalanx.bench.procs import run_workers

    env = {"PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "benchmarks"), os.environ.get("PYTHONPATH", "")])}
    kwargs = dict(mode=mode, steps=args.steps, every=args.every, width=args.width, goal=args.target,
                  throttle=throttle)
    if mode == "downpour":
        import phalanx as px
        with px.ps.start_servers(1) as servers:
            results = run_workers("balance:worker", 2, timeout=600, env={**env, **servers.env()}, **kwargs).results
    else:
        results = run_workers("balance:worker", 2, timeout=600, env=env, **kwargs).results
    return {"mode": mode, "samples_per_s": sum(r["samples"] / r["wall_s"] for r in results),
            "wall_s": max(r["wall_s"] for r in results), "reached_s": results[0]["reached_s"],
            "shares": results[0]["shares"], "samples": [r["samples"] for r in results]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--steps", type=int, default=300, help="steps per worker (default 300)")
    p.add_argument("--every", type=int, default=20, help="balanced: rebalance_every (default 20)")
    p.add_argument("--width", type=int, default=256, help="hidden width of the MLP (default 256)")
    p.add_argument("--quota", type=float, default=0.33, help="worker 1's share of a core (default 0.33)")
    p.add_argument("--target", type=float, default=0.9, help="evaluation loss to reach (default 0.9)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    rows = []
    with throttled(args.quota) as throttle:
        print(f"worker 1 throttled to {args.quota:g} of a core by {throttle.split(':')[0]}; {args.steps} steps, "
              f"global batch 128, MLP width {args.width}", flush=True)
        for mode in args.modes:
            row = run_mode(mode, args, throttle)
            rows.append(row)
            reached = f"{row['reached_s']:.1f} s" if row["reached_s"] is not None else "not reached"
            shares = "/".join(f"{s:.2f}" for s in row["shares"]) if row["shares"] else "equal"
            print(f"{mode:<9} {row['samples_per_s']:8.0f} samples/s   wall {row['wall_s']:6.1f} s   "
                  f"loss <= {args.target:g}: {reached:>11}   split {shares}   samples per worker {row['samples']}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
