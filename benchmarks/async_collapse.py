"""How often asynchronous SGD on parameter servers ends at chance: the settings of tests/ps (report: ps_async.md).

    python benchmarks/async_collapse.py --lr 0.02 --staleness 3 --pushes 95 --seeds 60 --bar 0.7
    python benchmarks/async_collapse.py --lr 0.01 --staleness 5 --pushes 155 --seeds 50 --bar 0.7

One process replays what Downpour's servers see (Dean et al. 2012, ``push_every=pull_every=1``): each push is a
batch-32 gradient of the digits CNN computed from the parameters of a uniformly random 0..``staleness`` pushes
ago, applied by the server rule (``phalanx.ps.Adagrad`` or ``phalanx.ps.SGD``, the library's own). Which interleaving
a real job gets is up to the scheduler, so a multi-process test's bar must hold over the interleavings, not one
run: this counts the seeds whose final test accuracy falls below ``--bar``.

Why it exists: Adagrad's first update moves every weight by ``lr`` whatever its gradient's size, and a few pushes
computed from the same stale start add up before the accumulator grows; at ``lr=0.02`` that kills the CNN's
ReLUs in a few seeds out of a hundred and the model stays at chance (accuracy 0.10) for good.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))


def run(seed: int, rule_name: str, lr: float, staleness: int, pushes: int) -> float:
    """One simulated job; returns the servers' final test accuracy."""
    import torch
    import torch.nn.functional as F

    from phalanx.bench.models import digits_cnn, load_digits_split
    from phalanx.ps.optim import SGD, Adagrad

    train_set, test_set = load_digits_split()
    x, y = train_set.tensors
    torch.manual_seed(seed)
    pick = random.Random(seed)
    rule = Adagrad(lr=lr) if rule_name == "adagrad" else SGD(lr=lr)
    server = digits_cnn()
    states = [rule.init_state(p) for p in server.parameters()]
    history = [[p.detach().clone() for p in server.parameters()]]  # the versions a worker may still hold
    worker = digits_cnn()
    for _ in range(pushes):
        old = history[-1 - pick.randint(0, min(staleness, len(history) - 1))]
        with torch.no_grad():
            for p, v in zip(worker.parameters(), old, strict=True):
                p.copy_(v)
        worker.zero_grad()
        batch = torch.randint(0, len(x), (32,))
        F.cross_entropy(worker(x[batch]), y[batch]).backward()
        with torch.no_grad():
            for p, q, state in zip(server.parameters(), worker.parameters(), states, strict=True):
                rule.apply_(p, q.grad, state)
        history = (history + [[p.detach().clone() for p in server.parameters()]])[-(staleness + 1):]
    tx, ty = test_set.tensors
    with torch.no_grad():
        return (server(tx).argmax(1) == ty).float().mean().item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rule", choices=("adagrad", "sgd"), default="adagrad")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--staleness", type=int, default=3, help="a push is computed from up to this many pushes ago")
    p.add_argument("--pushes", type=int, default=95, help="pushes the servers apply in the job")
    p.add_argument("--seeds", type=int, default=50)
    p.add_argument("--first", type=int, default=0, help="the first seed (seeds first .. first + seeds - 1)")
    p.add_argument("--bar", type=float, default=0.7, help="the test's accuracy bar")
    args = p.parse_args(argv)
    accs = [run(s, args.rule, args.lr, args.staleness, args.pushes) for s in range(args.first, args.first + args.seeds)]
    below = sum(a < args.bar for a in accs)
    low = [(s, round(a, 3)) for s, a in zip(range(args.first, args.first + args.seeds), accs) if a < args.bar]
    print(f"{args.rule} lr={args.lr} staleness<={args.staleness} pushes={args.pushes}: {below}/{len(accs)} seeds "
          f"below {args.bar} {low}; accuracy min {min(accs):.3f}, median {statistics.median(accs):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
