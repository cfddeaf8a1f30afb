"""Commit correctness under ``phalanx run --elastic``: one rank's skipped step, a death inside a commit.

Run with ``phalanx run --elastic -n 3 tests/workers/elastic_commit.py --out DIR ...``. Every
worker trains with a ``torch.amp.GradScaler("cpu")`` and plain SGD (no momentum) and records,
per step, the sample ids the whole group trained on (rolled back with the commits).
Failure injection, one flag each:

* ``--skip ID@STEP``: at step STEP the loss is scaled by 0 on every worker and the worker
  started as rank ID puts an inf into its gradient, so its GradScaler alone skips
  ``optimizer.step()`` (a zero step is no step for momentum-free SGD: the others' models stay
  equal to it, and to the oracle, which leaves the step out). Several, comma-separated
  (``1@2,0@5``), skip several steps in one run, each by its own worker.
* ``--kill ID@STEP``: that worker is SIGKILLed before step STEP.
* ``--die-in-commit ID@STEP``: that worker exits inside the first commit taken at or after
  step STEP (while its state is captured), before anything of the commit reaches the store.
  Several, comma-separated (``0@3,1@6``), die one after another, each at its own commit.
"""
from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import phalanx as px  # noqa: E402
from support.loop import elastic_id, elastic_parser, epoch_batches, group_ids, take_step, write_worker  # noqa: E402
from workers.elastic import BATCH, Record, dataset, model, setup  # noqa: E402

SCALE = 2.0 ** 10  # every worker's GradScaler keeps this scale: the average of scaled gradients stays exact


def optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.05)


def oracle(record: list) -> list[torch.Tensor]:
    """One process on the same global batches; a step the group skipped is left out."""
    net, data = model(), dataset()
    opt = optimizer(net)
    for _epoch, _world, ids, skipped in record:
        if not skipped:
            take_step(net, opt, *data[torch.tensor(ids)][:2], loss=F.mse_loss)
    return [p.detach() for p in net.parameters()]


class DieInCommit:
    """An ``extra`` of the state whose capture ends this process: a death inside a commit."""

    def __init__(self, at: int, me: str, victim: str) -> None:
        self.record, self.at, self.me, self.victim = Record(), at, me, victim  # the state's record, once it is made
        self.armed = True

    def state_dict(self) -> dict:
        if self.armed and self.me == self.victim and len(self.record.steps) >= self.at:
            os._exit(9)
        return {"steps": len(self.record.steps)}

    def load_state_dict(self, state: dict) -> None:
        # after a change of membership nobody dies again, unless its own commit is still ahead (several deaths)
        self.armed = self.armed and state.get("steps", self.at) < self.at


def main() -> None:
    p = elastic_parser()
    p.add_argument("--skip", default="", help="ID@STEP[,ID@STEP...]: that worker's GradScaler alone skips step STEP")
    p.add_argument("--die-in-commit", default="",
                   help="ID@STEP[,ID@STEP...]: that worker exits inside the commit at STEP")
    args = p.parse_args()
    me = elastic_id()
    skippers = {int(at): wid for wid, _, at in (s.partition("@") for s in args.skip.split(",") if s)}  # step -> id
    victim, _, kill_at = args.kill.partition("@")
    diers = dict(d.partition("@")[::2] for d in args.die_in_commit.split(",") if d)  # id -> step
    dier, die_at = (me, diers[me]) if me in diers else ("", "")

    px.init()
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    die = DieInCommit(int(die_at or 0), me, dier)
    model_, opt, loader, record, state = setup(args.commit_every, optimizer, scaler=scaler,
                                               extra={"die": die} if diers else {})
    die.record = record
    comm = px.Comm()
    steps_at: list[list] = []  # (state.step, steps in the record) as each step begins

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for epoch, x, y, ids in epoch_batches(state, loader, args.epochs):
            steps_at.append([state.step, len(record.steps)])  # the steps before this one, two counts
            step = len(record.steps) + 1
            if me == victim and step == int(kill_at) and not state.history:
                with open(os.path.join(args.out, "killed.json"), "w") as f:
                    json.dump({"id": me, "pid": os.getpid()}, f)
                os.kill(os.getpid(), signal.SIGKILL)
            skipper = skippers.get(step)
            skip = skipper is not None and not state.history
            record.steps.append([epoch, px.world_size(), group_ids(comm, ids, BATCH), skip])
            opt.zero_grad()
            loss = F.mse_loss(model_(x), y) * (0.0 if skip else 1.0)
            scaler.scale(loss).backward()
            if skip and me == skipper:
                next(iter(px.unwrap(model_).parameters())).grad.view(-1)[0] = float("inf")  # after the average
            scaler.step(opt)
            scaler.update(SCALE)

    train(state)
    write_worker(args.out, me, model_, record.steps, state.history, pid=os.getpid(), steps_at=steps_at,
                 scale=scaler.get_scale())


if __name__ == "__main__":
    main()
