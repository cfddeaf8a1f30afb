"""The one-process oracle behind each quality-benchmark target: what DDP would reach, with no network.

    python benchmarks/quality_oracle.py --task gpt-large --steps 240 --every 10
    python benchmarks/quality_oracle.py --task resnet20 --steps 200 --every 15 --seeds 0,1
    python benchmarks/quality_oracle.py --task gpt --lr 0.002 --threads 2
    python benchmarks/quality_oracle.py --task gpt --lr 0.001 --momentum 0.9 --seeds 0,1,2 --every 4

One process trains the task's model on the global batch (``--world`` × the task's per-worker
batch: exactly the samples two DDP workers see at each step, ``benchmarks.quality.tasks``)
with the task's optimizer at its base lr (or ``--lr``), from the seed each benchmark repeat
starts from, and evaluates every ``--every`` steps. DDP's all-reduced mean gradient equals
this one's (up to float summation order), so its steps to a target are DDP's on any link.
It prints the curve and, for each threshold of ``--thresholds`` (default: around the task's
target), the first step reaching it per seed: a target is set where DDP's oracle reaches it
at about 2/3 of the task's ``budget_steps``, so that a setup paying nothing for
communication has room to reach it and a slow one visibly does not.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def curve(task_name: str, seed: int, steps: int, every: int, world: int, lr: float | None,
          threads: int, *, stale: bool = False, momentum: float | None = None) -> list[tuple[int, float]]:
    """``(step, quality)`` every ``every`` steps (and at step 0) of one oracle run.

    ``stale``: step ``t`` applies the gradient computed at step ``t - 1`` (the first applies nothing), as a
    gradient exchange overlapped with the next step would (``benchmarks/stale_gradient.py``). ``momentum``:
    AdamW's β1 or SGD's momentum instead of the task's."""
    import torch

    from benchmarks.quality.tasks import get

    torch.set_num_threads(threads)
    task = get(task_name)
    torch.manual_seed(seed)  # the benchmark's repeat ``seed`` starts from this model
    model = task.model()
    opt = task.optim.build(model.parameters(), task.optim.lr if lr is None else lr)
    for group in opt.param_groups if momentum is not None else ():
        if "betas" in group:
            group["betas"] = (momentum, group["betas"][1])
        else:
            group["momentum"] = momentum
    previous: list | None = None
    judged = task.judged(model)  # what the benchmark's workers evaluate: the weights or their moving average
    points = [(0, task.evaluate(judged.module))]
    started = time.perf_counter()
    for step in range(steps):
        x, y = task.batch(step, 0, 1, world * task.per_worker)
        opt.zero_grad(set_to_none=True)
        task.loss(model(x), y).backward()
        if stale:  # apply the last step's gradient; this one waits a step (None at the first: nothing moves)
            current = [p.grad for p in model.parameters()]
            for p, g in zip(model.parameters(), previous or [None] * len(current), strict=True):
                p.grad = g
            previous = current
        opt.step()
        judged.update()
        if (step + 1) % every == 0 or step + 1 == steps:
            points.append((step + 1, task.evaluate(judged.module)))
            print(f"  {'stale ' if stale else ''}seed {seed} step {step + 1}: {points[-1][1]:.4f} "
                  f"({(time.perf_counter() - started) / (step + 1):.2f} s a step)", file=sys.stderr, flush=True)
    return points


def first_reaching(points: list[tuple[int, float]], threshold: float, higher: bool) -> int | None:
    """The first evaluated step whose quality reaches ``threshold``.

        >>> first_reaching([(0, 3.2), (10, 2.9), (20, 2.7)], 2.8, higher=False)
        20
    """
    return next((s for s, q in points if (q >= threshold if higher else q <= threshold)), None)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.quality.tasks import TASKS, get

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="gpt", choices=sorted(TASKS))
    p.add_argument("--steps", type=int, default=0, help="default: the task's budget_steps")
    p.add_argument("--every", type=int, default=10, help="evaluate every this many steps")
    p.add_argument("--seeds", default="0", help="comma list of seeds (the benchmark's repeats)")
    p.add_argument("--world", type=int, default=2, help="workers whose global batch one process takes")
    p.add_argument("--lr", type=float, default=None, help="default: the task's base lr")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--momentum", type=float, default=None, help="AdamW's beta1 or SGD's momentum (default: the "
                   "task's)")
    p.add_argument("--thresholds", default="", help="comma list (default: the target and 4 values around it)")
    p.add_argument("--json", default="", help="also write the curves here")
    args = p.parse_args(argv)
    task = get(args.task)
    steps = args.steps or task.budget_steps
    if steps < 1 or args.every < 1 or args.world < 1 or args.threads < 1:
        p.error(f"--steps {steps} --every {args.every} --world {args.world} --threads {args.threads}: "
                "expected positive integers")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    runs = {seed: curve(task.name, seed, steps, args.every, args.world, args.lr, args.threads,
                         momentum=args.momentum) for seed in seeds}
    sign = 1 if task.higher_is_better else -1
    step_size = 0.02 if task.higher_is_better else 0.05
    thresholds = ([float(t) for t in args.thresholds.split(",") if t] if args.thresholds else
                  [round(task.target + sign * k * step_size, 4) for k in (-2, -1, 0, 1, 2)])
    print(f"{task.name}: {task.quality_name}, lr {task.optim.lr if args.lr is None else args.lr}, global batch "
          f"{args.world} x {task.per_worker}, target today {task.target}, budget {task.budget_steps} steps")
    for t in thresholds:
        firsts = {seed: first_reaching(points, t, task.higher_is_better) for seed, points in runs.items()}
        print(f"  {t:g}: first reached at step " + ", ".join(f"{s} (seed {seed})" for seed, s in firsts.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"task": task.name, "lr": args.lr, "world": args.world, "curves": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
