"""What a one-step-stale gradient costs in quality: why phalanx leaves Pipe-SGD out (benchmarks/reports/quality.md).

    python benchmarks/stale_gradient.py --task gpt --lr 0.001
    python benchmarks/stale_gradient.py --task resnet20 --lr 0.025
    python benchmarks/stale_gradient.py --task gpt --lr 0.001 --momentum 0.5 --every 12

DDP's one-process oracle (``benchmarks/quality_oracle.py``: the global batch, DDP's gradient with
no network) twice from the same seed: once as DDP does, once applying at step ``t`` the gradient
computed at step ``t - 1`` (the first step applies nothing), which is what a gradient exchange
overlapped with the next step's compute (Pipe-SGD, Li et al. 2018, pipeline width 2) trains on
any link. It prints each run's final quality and the first evaluated step reaching the task's
target. ``--momentum`` sets AdamW's β1 (SGD's momentum) for both runs: the usual compensation for
a delay, which acts as extra momentum (Mitliagkas et al. 2016, "Asynchrony begets momentum").
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from quality_oracle import ROOT, curve, first_reaching  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "src"))


def main(argv: list[str] | None = None) -> int:
    from benchmarks.quality.tasks import TASKS, get

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
        points = curve(task.name, args.seed, task.budget_steps, args.every, args.world, args.lr, args.threads,
                       stale=stale, momentum=args.momentum)
        first = first_reaching(points, task.target, task.higher_is_better)
        print(f"{task.name} {'one-step-stale' if stale else 'ddp'}: quality {points[-1][1]:.3f} at step "
              f"{points[-1][0]}, target {task.target} first reached at step {first}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
