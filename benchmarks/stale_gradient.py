"""What a one-step-stale gradient costs in quality: the check behind leaving Pipe-SGD out (docs/performance.md §7).

    python benchmarks/stale_gradient.py --task gpt
    python benchmarks/stale_gradient.py --task resnet20 --lr 0.025
    python benchmarks/stale_gradient.py --task gpt --lr 0.001 --momentum 0.5 --every 12

One process trains the task's model on the global batch (``--world`` × the task's per-worker
batch, as ``benchmarks/quality_oracle.py``: DDP's gradient with no network) twice from the same
seed: once as DDP does, once applying at step ``t`` the gradient computed at step ``t - 1``
(the first step applies nothing), which is what a gradient exchange overlapped with the next
step's compute (Pipe-SGD, Li et al. 2018, pipeline width 2) trains on any link. It prints the
quality every ``--every`` steps and the first step reaching the task's target, per run.
``--momentum`` sets AdamW's β1 (SGD's momentum) for both runs: the usual compensation for a
delay, which acts as extra momentum (Mitliagkas et al. 2016, "Asynchrony begets momentum").
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def run(task_name: str, lr: float | None, stale: bool, *, seed: int, world: int, every: int,
        threads: int, momentum: float | None = None) -> tuple[float, int | None]:
    """The final quality and the first evaluated step reaching the target (None: never)."""
    import torch

    from phalanx.bench.quality.tasks import get

    torch.set_num_threads(threads)
    task = get(task_name)
    torch.manual_seed(seed)
    model = task.model()
    opt = task.optim.build(model.parameters(), task.optim.lr if lr is None else lr)
    for group in opt.param_groups if momentum is not None else ():
        if "betas" in group:
            group["betas"] = (momentum, group["betas"][1])
        else:
            group["momentum"] = momentum
    judged = task.judged(model)
    previous: list | None = None
    first, quality = None, float("nan")
    for step in range(task.budget_steps):
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
        if (step + 1) % every == 0 or step + 1 == task.budget_steps:
            quality = task.evaluate(judged.module)
            print(f"  {'stale' if stale else 'ddp'} step {step + 1}: {quality:.4f}", file=sys.stderr, flush=True)
            if first is None and task.reached(quality, task.target):
                first = step + 1
    return quality, first


def main(argv: list[str] | None = None) -> int:
    from phalanx.bench.quality.tasks import TASKS, get

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="gpt", choices=sorted(TASKS))
    p.add_argument("--lr", type=float, default=None, help="default: the task's base lr")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--every", type=int, default=20, help="evaluate every this many steps")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--momentum", type=float, default=None, help="AdamW's beta1 or SGD's momentum (default: the "
                   "task's)")
    args = p.parse_args(argv)
    task = get(args.task)
    for stale in (False, True):
        quality, first = run(args.task, args.lr, stale, seed=args.seed, world=args.world, every=args.every,
                             threads=args.threads, momentum=args.momentum)
        print(f"{args.task} {'one-step-stale' if stale else 'ddp'}: quality {quality:.3f} at step "
              f"{task.budget_steps}, target {task.target} first reached at step {first}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
