"""What thousands of bogus joiner ids in the store cost an elastic job's commits, as a ratio in one run.

Anyone who reaches the launcher's store can write ids into ``elastic/joiners``. This runs
``phalanx run -n 2 --elastic`` on a small model that commits at every step, and alternates phases
of ``--steps`` steps: with the joiners list empty, and with ``--bogus`` ids that prove nothing
(written by worker 0 through the real store at the start of the phase). Each step's time includes
its commit point (the look for joiners to admit). It prints the median step time of each kind of
phase (the median of its phases' medians) and their ratio (target: at most 1.05).

    python benchmarks/bogus_joiners.py [--bogus 5000] [--phases 20] [--steps 30]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


SKIP = 3  # steps at the start of each phase left out of its median


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import phalanx as px
    from phalanx.elastic.membership import key

    px.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.01))
    data = torch.utils.data.TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
    loader = px.shard(data, batch_size=16, seed=0)
    state = px.elastic.State(model, opt, loader, commit_every=1)
    me = os.environ.get("PHALANX_ELASTIC_ID", "0")
    total = args.phases * args.steps
    times: list[list] = []  # (phase kind, seconds of the step, its commit point included)

    def kind(step: int) -> str:
        return "bogus" if step // args.steps % 2 else "none"

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        last = None
        for epoch in range(state.epoch, 1000):
            loader.set_epoch(epoch)
            for x, y in loader:  # the commit point ran just before this batch was handed out
                now, step = time.perf_counter(), state.step
                if last is not None:  # the step before and the commit point after it
                    times.append([kind(step - 1), now - last])
                last = now
                if step >= total:
                    return
                if me == "0" and step % args.steps == 0:  # a new phase: the list as this phase has it
                    ids = [f"bogus-{i}" for i in range(args.bogus)] if kind(step) == "bogus" else []
                    state.worker.store.set(key("joiners"), json.dumps(ids))
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()

    train(state)
    with open(os.path.join(args.out, f"times{me}.json"), "w") as f:
        json.dump(times, f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bogus", type=int, default=5000)
    parser.add_argument("--phases", type=int, default=20, help="alternating phases (none, bogus, none, ...)")
    parser.add_argument("--steps", type=int, default=30, help="steps per phase")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    out = tempfile.mkdtemp(prefix="bogus-joiners-")
    cmd = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())", "run", "-n", "2",
           "--elastic", os.path.abspath(__file__), "--worker", "--out", out, "--bogus", str(args.bogus),
           "--phases", str(args.phases), "--steps", str(args.steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    # Each phase's median step, its first SKIP steps left out (the write of the list, and the one look at each new
    # id, belong to the phase change); then the median over the phases of each kind, on both workers.
    med: dict[str, list[float]] = {"none": [], "bogus": []}
    for name in ("times0.json", "times1.json"):
        times = json.load(open(os.path.join(out, name)))
        for start in range(0, len(times), args.steps):
            phase = times[start:start + args.steps][SKIP:]
            if phase:
                med[phase[0][0]].append(statistics.median(t for _, t in phase))
    none, bogus = statistics.median(med["none"]), statistics.median(med["bogus"])
    print(f"median step (commit point included): {none * 1e3:.2f} ms with no joiner entries, {bogus * 1e3:.2f} ms "
          f"with {args.bogus} bogus ones; ratio {bogus / none:.3f} ({args.phases} alternating phases of "
          f"{args.steps} steps, 2 workers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
