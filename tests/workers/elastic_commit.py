"""Commit correctness under ``phalanx run --elastic``: one rank's skipped step, a death inside a commit.

Run with ``phalanx run --elastic -n 3 tests/workers/elastic_commit.py --out DIR ...``. Every
worker trains with a ``torch.amp.GradScaler("cpu")`` and plain SGD (no momentum) and records,
per step, the sample ids the whole group trained on (rolled back with the commits).
Failure injection, one flag each:

* ``--skip ID@STEP``: at step STEP the loss is scaled by 0 on every worker and the worker
  started as rank ID puts an inf into its gradient, so its GradScaler alone skips
  ``optimizer.step()`` (a zero step is no step for momentum-free SGD: the others' models stay
  equal to it, and to the oracle, which leaves the step out).
* ``--kill ID@STEP``: that worker is SIGKILLed before step STEP.
* ``--die-in-commit ID@STEP``: that worker exits inside the first commit taken at or after
  step STEP (while its state is captured), before anything of the commit reaches the store.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import phalanx as px  # noqa: E402
from workers.elastic import BATCH, Record, dataset, model  # noqa: E402

SCALE = 2.0 ** 10  # every worker's GradScaler keeps this scale: the average of scaled gradients stays exact


def optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.05)


def oracle(record: list) -> list[torch.Tensor]:
    """One process on the same global batches; a step the group skipped is left out."""
    net, data = model(), dataset()
    opt = optimizer(net)
    for _epoch, _world, ids, skipped in record:
        if skipped:
            continue
        x, y, _ = data[torch.tensor(ids)]
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


class DieInCommit:
    """An ``extra`` of the state whose capture ends this process: a death inside a commit."""

    def __init__(self, record: Record, at: int, me: str, victim: str) -> None:
        self.record, self.at, self.me, self.victim = record, at, me, victim
        self.armed = True

    def state_dict(self) -> dict:
        if self.armed and self.me == self.victim and len(self.record.steps) >= self.at:
            os._exit(9)
        return {}

    def load_state_dict(self, state: dict) -> None:
        self.armed = False  # after a change of membership nobody dies again


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--commit-every", type=int, default=3)
    p.add_argument("--skip", default="", help="ID@STEP: that worker's GradScaler alone skips step STEP")
    p.add_argument("--kill", default="", help="ID@STEP: that worker is SIGKILLed before step STEP")
    p.add_argument("--die-in-commit", default="", help="ID@STEP: that worker exits inside the commit at STEP")
    args = p.parse_args()
    me = os.environ.get("PHALANX_ELASTIC_ID", os.environ.get("RANK", "0"))
    skipper, _, skip_at = args.skip.partition("@")
    victim, _, kill_at = args.kill.partition("@")
    dier, _, die_at = args.die_in_commit.partition("@")

    px.init()
    net, data = model(), dataset()
    model_, opt = px.wrap(net, optimizer(net))
    loader = px.shard(data, batch_size=BATCH, seed=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    record = Record()
    extra = {"record": record}
    if dier:
        extra["die"] = DieInCommit(record, int(die_at), me, dier)
    state = px.elastic.State(model_, opt, loader, commit_every=args.commit_every, scaler=scaler, extra=extra)
    comm = px.Comm()
    steps_at: list[list] = []  # (state.step, steps in the record) as each step begins

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for epoch in range(state.epoch, args.epochs):
            loader.set_epoch(epoch)
            for x, y, ids in loader:
                steps_at.append([state.step, len(record.steps)])  # the steps before this one, two counts
                step = len(record.steps) + 1
                if me == victim and step == int(kill_at) and not state.history:
                    with open(os.path.join(args.out, "killed.json"), "w") as f:
                        json.dump({"id": me, "pid": os.getpid()}, f)
                    os.kill(os.getpid(), signal.SIGKILL)
                skip = bool(skipper) and step == int(skip_at) and not state.history
                padded = torch.cat([ids, torch.full((BATCH - len(ids),), -1, dtype=ids.dtype)])
                everyone = torch.cat(comm.all_gather(padded))
                record.steps.append([epoch, px.world_size(), everyone[everyone >= 0].tolist(), skip])
                opt.zero_grad()
                loss = F.mse_loss(model_(x), y) * (0.0 if skip else 1.0)
                scaler.scale(loss).backward()
                if skip and me == skipper:
                    next(iter(net.parameters())).grad.view(-1)[0] = float("inf")  # after the average
                scaler.step(opt)
                scaler.update(SCALE)

    train(state)
    with open(os.path.join(args.out, f"worker{me}.json"), "w") as f:
        json.dump({"id": me, "pid": os.getpid(), "world_size": px.world_size(), "record": record.steps,
                   "params": [t.tolist() for t in px.unwrap(model_).parameters()], "history": state.history,
                   "steps_at": steps_at, "scale": scaler.get_scale()}, f)


if __name__ == "__main__":
    main()
