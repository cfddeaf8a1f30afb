"""BatchNorm's running statistics under DiLoCo: how far eval-mode accuracy lags the weights.

    python benchmarks/bn_statistics.py                  # 130 steps, DiLoCo(every=50), 2 gloo workers
    python benchmarks/bn_statistics.py --steps 60 --every 20

Two workers train ResNet-20 on the quality benchmark's teacher task (``benchmarks.quality``,
AdamW lr 1e-3, 32 images per worker and step) under ``px.DiLoCo``. Around each outer step and after
``finish()``, rank 0 scores the model on 256 fixed validation images twice: in eval mode with the
running statistics as training left them, and on a copy whose statistics were recomputed on 8
training batches (``torch.optim.swa_utils.update_bn``). The gap is why the quality benchmark
recomputes the statistics before each ResNet-20 evaluation, and why docs/strategies.md tells
DiLoCo users with BatchNorm models to do the same before evaluating.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(steps: int, every: int) -> list[tuple[Any, float, float]]:
    """One rank: train, and on rank 0 score both ways at the steps around each outer step."""
    import torch

    import phalanx as px
    from benchmarks.quality.tasks import TASKS

    px.init()
    task = TASKS["resnet20"]
    torch.manual_seed(0)
    net = task.model()
    model, opt = px.wrap(net, torch.optim.AdamW(net.parameters(), lr=1e-3), strategy=px.DiLoCo(every=every))
    rank, world = px.rank(), px.world_size()

    def both(label: Any) -> tuple[Any, float, float]:
        copy = task.model()
        copy.load_state_dict(net.state_dict())
        batches = [task.batch(10_000 + i, 0, 1, 32)[0] for i in range(8)]
        torch.optim.swa_utils.update_bn(batches, copy)
        with torch.no_grad():  # TeacherResNet.evaluate recomputes on its own; score the copy as it is here
            copy.eval()
            xs, ys = task.val[0][:256], task.val[1][:256]
            fresh = float((copy(xs).argmax(1) == ys).float().mean())
            net.eval()
            plain = float((net(xs).argmax(1) == ys).float().mean())
            net.train()
        return label, plain, fresh

    marks = {s for k in range(every, steps + 1, every) for s in (k - 1, k, k + 1, k + 5)} | {steps}
    rows = []
    for step in range(1, steps + 1):
        x, y = task.batch(step, rank, world, 32)
        opt.zero_grad()
        task.loss(model(x), y).backward()
        opt.step()
        if rank == 0 and step in marks:
            rows.append(both(step))
    px.strategy_of(opt).finish()
    if rank == 0:
        rows.append(both("finish"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=130)
    p.add_argument("--every", type=int, default=50, help="DiLoCo's H")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from phalanx.bench.procs import run_workers

    env = {"PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    rows = run_workers("bn_statistics:worker", 2, timeout=900, env=env, steps=args.steps, every=args.every).results[0]
    print(f"| step (outer steps at multiples of {args.every}) | eval mode, running statistics | statistics "
          "recomputed |\n|---|---:|---:|")
    for label, plain, fresh in rows:
        print(f"| {label} | {plain:.3f} | {fresh:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
