"""Elastic training: the cost of ``--elastic`` with no failure, recovery time, steps redone.

    python benchmarks/elastic.py --out results/elastic [--trials 3] [--steps 40]

(a) Step time of ResNet-20 (CIFAR shapes, batch 32 per worker, synthetic data), 2 workers:
    plain ``phalanx run -n 2`` against ``phalanx run -n 2 --elastic`` (commits every 10
    steps), interleaved runs, the median of each run's mean step time after 5 warm-up steps.
(b) Time from a kill -9 to the first step of the rebuilt group, one host, 3 workers
    (tests/workers/elastic.py, a small MLP, 50 ms per step), the worker started as rank 1
    killed at step 15, commits every 10: shrink (the survivors go on with 2), ``--replace``
    (a new process joins at a later commit) and ``--spares 1`` (a parked spare enters at the
    regroup). "back to 3" is the time until the group is at 3 workers again.
(c) Work lost per failure: the steps redone after the rollback.

It prints a table (median and min-max over the trials) and writes it as JSON to
OUT/elastic.json. About 4-6 minutes on an idle 2-core machine with the defaults.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "elastic.py")
CLI = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]
MODES = {"shrink": [], "--replace": ["--replace"], "--spares 1": ["--spares", "1"]}
WARMUP = 5


# -- (a) the worker: ResNet-20 under `phalanx run -n 2 [--elastic] benchmarks/elastic.py --worker` -------
def worker(out: str, steps: int) -> None:
    import torch
    import torch.nn.functional as F

    import phalanx as px
    from phalanx.models import resnet_cifar

    px.init()
    torch.manual_seed(0)
    net = resnet_cifar(20)
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    n = 32 * px.world_size() * (steps + WARMUP)
    data = torch.utils.data.TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
    loader = px.shard(data, batch_size=32, seed=0)
    state = px.elastic.State(model, opt, loader, commit_every=10)  # a no-op without --elastic
    times: list[float] = []

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for x, y in loader:
            started = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - started)

    train(state)
    if px.rank() == 0:
        timed = times[WARMUP:]
        with open(os.path.join(out, "resnet.json"), "w") as f:
            json.dump({"step_s": sum(timed) / len(timed), "steps": len(timed)}, f)


def resnet_step(elastic: bool, steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        flags = ["--elastic", "--min-workers", "1"] if elastic else []
        subprocess.run([*CLI, "run", "-n", "2", *flags, __file__, "--worker", "--out", out, "--steps", str(steps)],
                       check=True, capture_output=True, text=True, timeout=600)
        return json.load(open(os.path.join(out, "resnet.json")))["step_s"]


# -- (b), (c): kill the worker started as rank 1 at step 15 --------------------------------------
def recovery(flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([*CLI, "run", "-n", "3", "--elastic", "--min-workers", "2", *flags, WORKER,
                               "--out", out, "--epochs", "20", "--commit-every", "10", "--kill", "1@15",
                               "--step-sleep", "0.05"], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"elastic run {flags} failed:\n{proc.stderr[-2000:]}")
        killed = json.load(open(os.path.join(out, "killed.json")))["time"]
        main = json.load(open(os.path.join(out, "worker0.json")))
        full = [t for t, world, _ in main["changes"] if world == 3]
        return {"kill_to_first_step_s": main["changes"][0][0] - killed,
                "kill_to_back_to_3_s": full[0] - killed if full else None,
                "redone_steps": main["history"][0]["redone_steps"],
                "processes_started_after_kill": sum(os.path.getmtime(f) > killed
                                                    for f in glob.glob(os.path.join(out, "start*.json")))}


def summary(values: list) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def cell(s: dict | None, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    if s is None:
        return "-"
    return f"{fmt.format(s['median'] * scale)} ({fmt.format(s['min'] * scale)}-{fmt.format(s['max'] * scale)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for elastic.json (or, with --worker, the run's folder)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="timed ResNet-20 steps per run (after 5 warm-up steps)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.out, a.steps)
    os.makedirs(a.out, exist_ok=True)
    plain, elastic = [], []
    for _ in range(a.trials):  # interleaved, so that drift on the machine hits both alike
        plain.append(resnet_step(False, a.steps))
        elastic.append(resnet_step(True, a.steps))
    ratios = [e / p_ for p_, e in zip(plain, elastic)]
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(a.trials):
        for mode, flags in MODES.items():
            runs[mode].append(recovery(flags))
    result = {
        "step_time_resnet20_2_workers": {"plain_s": summary(plain), "elastic_s": summary(elastic),
                                         "elastic_over_plain": summary(ratios), "raw_plain": plain,
                                         "raw_elastic": elastic},
        "recovery_3_workers_kill_at_15_commit_every_10": {
            mode: {k: summary([r[k] for r in rs]) for k in rs[0]} | {"raw": rs} for mode, rs in runs.items()},
    }
    print(f"(a) ResNet-20, 2 workers, step time in ms, median (min-max) of {a.trials} interleaved runs")
    print(f"    plain     {cell(summary(plain), 1e3, '{:.1f}')}")
    print(f"    --elastic {cell(summary(elastic), 1e3, '{:.1f}')}")
    print(f"    ratio     {cell(summary(ratios), 1.0, '{:.3f}')}")
    print(f"(b, c) kill -9 of 1 of 3 workers at step 15, commits every 10; seconds, median (min-max) of {a.trials}")
    print(f"    {'mode':<12} {'kill -> first step':<22} {'kill -> back to 3':<22} {'steps redone':<14} new processes")
    for mode in runs:
        row = result["recovery_3_workers_kill_at_15_commit_every_10"][mode]
        print(f"    {mode:<12} {cell(row['kill_to_first_step_s']):<22} {cell(row['kill_to_back_to_3_s']):<22} "
              f"{cell(row['redone_steps'], 1.0, '{:g}'):<14} {cell(row['processes_started_after_kill'], 1.0, '{:g}')}")
    with open(os.path.join(a.out, "elastic.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {os.path.join(a.out, 'elastic.json')}")


if __name__ == "__main__":
    main()
